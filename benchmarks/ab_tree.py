"""A/B of the whole package against a saved tree of it, in one process (device only).

usage:
    # here: the base tree as a second package, kbit_cupy_base (ignored by git)
    python benchmarks/ab_tree.py --make-base HEAD
    # on the device (carry benchmarks/_base):
    PYTHONPATH=.:benchmarks/_base python benchmarks/ab_tree.py [--layers ...] [--moe]

"A" is the package at the saved commit (kbit_cupy_base: its own host code and
kernels), "B" the working tree's. Every op is timed kernel-only (a CUDA graph
of (256 MB overwrite, op) pairs minus the overwrites: harness.time_graph, the
TARGETS.md method), A, B and cuBLAS fp16 one after another for each case, in
one process. The results of A and B are compared bit for bit (the change under
test is expected to keep the bits; a difference is printed, not hidden).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

BASE_DIR = Path(__file__).resolve().parent / "_base"
DENSE = ["2048x768", "768x2048", "2048x512", "4096x4096", "4096x6144", "14336x4096",
         "4096x28672", "8192x57344"]
MOE = ((128, 1536, 2048, 8), (128, 2048, 768, 8), (512, 512, 2048, 10))  # E, N, K_dim, top_k


def make_base(rev: str) -> None:
    """Write ``rev``'s kbit_cupy (with kernels_src inside it) to _base/kbit_cupy_base."""
    repo = Path(__file__).resolve().parent.parent
    dest = BASE_DIR / "kbit_cupy_base"
    shutil.rmtree(BASE_DIR, ignore_errors=True)
    dest.parent.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(repo), "archive", rev, "kbit_cupy", "kernels_src"],
                         check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(BASE_DIR)], input=tar, check=True)
    (BASE_DIR / "kbit_cupy").rename(dest)
    (BASE_DIR / "kernels_src").rename(dest / "kernels_src")
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    (dest / "AB_COMMIT").write_text(commit + "\n")
    print(f"base {commit} in {dest}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--make-base", metavar="REV")
    p.add_argument("--layers", nargs="*", default=DENSE)
    p.add_argument("--m", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--k", nargs="+", type=int, default=[2, 3, 4, 5])
    p.add_argument("--kernel", default="auto")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--moe", action="store_true", help="also moe_linear at T = 1, 2, 4")
    p.add_argument("--moe-t", nargs="+", type=int, default=[1, 2, 4],
                   help="the token counts of --moe")
    p.add_argument("--moe-mixtral", action="store_true",
                   help="--moe also on Mixtral's 8 experts of [28672, 4096], top-2")
    p.add_argument("--route", action="store_true",
                   help="--moe also times the routing launch (route_pairs) alone, A and B")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--set", action="append", default=[], metavar="NAME=NUMBER",
                   help="also B with kbit_cupy.gemm.NAME = NUMBER during its calls (own plans)")
    args = p.parse_args()
    if args.make_base:
        make_base(args.make_base)
        return 0

    import cupy as cp
    import kbit_cupy_base as ka

    import kbit_cupy as kb
    from kbit_cupy import _launch
    from kbit_cupy._arrays import BFLOAT16
    from kbit_cupy.bench import harness

    base = (Path(ka.__file__).parent / "AB_COMMIT").read_text().strip()
    info = harness.gpu_info()
    print(f"{info['gpu']}  A = {base}  B = working tree on {info.get('commit')}", flush=True)
    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]

    def compare(ra, rb):
        same = bool((ra.view(cp.uint16) == rb.view(cp.uint16)).all())
        if same:
            return "same bits"
        a32, b32 = ra.astype(cp.float32), rb.astype(cp.float32)
        return f"DIFFERENT bits, rel {float(cp.linalg.norm(a32 - b32) / cp.linalg.norm(a32)):.1e}"

    knobs = [(n, float(v) if "." in v or "e" in v else int(v))
             for n, v in (kv.split("=") for kv in args.set)]

    def clear_caches():  # functools caches of gemm.py (_work_split, _dispatch) see the knob
        for obj in vars(kb.gemm).values():
            if callable(getattr(obj, "cache_clear", None)):
                obj.cache_clear()

    def with_knob(fn, knob):
        def op():
            saved = getattr(kb.gemm, knob[0])
            setattr(kb.gemm, *knob)
            clear_caches()
            try:
                return fn()
            finally:
                setattr(kb.gemm, knob[0], saved)
                clear_caches()
        return op

    def graph_us(op):
        r = harness.time_graph(op, reps=args.reps)
        return r["median_us"] if r else float("nan")

    for layer in args.layers:
        K_dim, N = (int(v) for v in layer.lower().split("x"))
        rng = cp.random.default_rng(0)
        W = (rng.standard_normal((N, K_dim), dtype=cp.float32) * np.float32(0.02)).astype(cp.float16)
        for k in args.k:
            wa = ka.quantize_weight(W, k=k).prepare()
            wb = kb.quantize_weight(W, k=k).prepare()
            wks = [kb.quantize_weight(W, k=k).prepare() for _ in knobs]
            cp.cuda.Device().synchronize()  # prepare() ran on the default stream
            for M in args.m:
                A = cp.random.default_rng(1).standard_normal((M, K_dim), dtype=cp.float32).astype(dtype)
                A16 = A.astype(cp.float16)
                ca, cb, c16 = (cp.empty((M, N), dtype) for _ in range(3))

                def cublas(A16=A16, c16=c16, W=W, M=M, N=N, K_dim=K_dim):
                    _launch.cublas_gemm(M, N, K_dim, "float16", A16.data.ptr, W.data.ptr, c16.data.ptr,
                                        cp.cuda.get_current_stream().ptr)
                    return c16

                op_a = lambda A=A, w=wa, c=ca: ka.kbit_gemm(A, w, out=c, kernel=args.kernel)
                op_b = lambda A=A, w=wb, c=cb: kb.kbit_gemm(A, w, out=c, kernel=args.kernel)
                t_c, t_a, t_b = graph_us(cublas), graph_us(op_a), graph_us(op_b)
                with harness._bench_stream():
                    ra, rb = op_a().copy(), op_b().copy()
                cp.cuda.Device().synchronize()
                chosen = kb.gemm.choose_kernel(M, N, K_dim, k, dtype) if args.kernel == "auto" else args.kernel
                extra = ""
                for knob, wk in zip(knobs, wks):
                    ck = cp.empty((M, N), dtype)
                    op_k = with_knob(lambda A=A, w=wk, c=ck: kb.kbit_gemm(A, w, out=c, kernel=args.kernel), knob)
                    t_k = graph_us(op_k)
                    with harness._bench_stream():
                        rk = op_k().copy()
                    cp.cuda.Device().synchronize()
                    extra += f"  B@{knob[0]}={knob[1]} {t_k:8.2f} ({t_a / t_k:5.3f}, {compare(rb, rk)} as B)"
                print(f"{layer:>11s} M={M:<3d} k={k} {chosen:8s} cuBLAS {t_c:8.2f}  A {t_a:8.2f} "
                      f"({t_c / t_a:4.2f}x)  B {t_b:8.2f} ({t_c / t_b:4.2f}x)  B/A {t_a / t_b:5.3f}  "
                      f"{compare(ra, rb)}{extra}", flush=True)
            del wa, wb, wks
        del W
        cp.get_default_memory_pool().free_all_blocks()

    if args.moe:
        from kbit_cupy_base.experts import route_pairs as route_a

        from kbit_cupy.experts import route_pairs as route_b

        nrng = np.random.default_rng(0)
        for E, N, K_dim, top_k in MOE + (((8, 28672, 4096, 2),) if args.moe_mixtral else ()):
            W = cp.asarray((nrng.standard_normal((E, N, K_dim)) * 0.02).astype(np.float16))
            ea = ka.quantize_experts(W, k=4).prepare()
            eb = kb.quantize_experts(W, k=4).prepare()
            del W
            cp.cuda.Device().synchronize()
            for T in args.moe_t:
                ids = cp.asarray(np.stack([nrng.choice(E, top_k, replace=False) for _ in range(T)])
                                 .astype(np.int32))
                x = cp.asarray(nrng.standard_normal((T, K_dim)).astype(np.float16))
                oa, ob = (cp.empty((T, top_k, N), cp.float16) for _ in range(2))
                op_a = lambda x=x, ids=ids, e=ea, o=oa: ka.moe_linear(x, ids, e, out=o, validate=False)
                op_b = lambda x=x, ids=ids, e=eb, o=ob: kb.moe_linear(x, ids, e, out=o, validate=False)
                t_a, t_b = graph_us(op_a), graph_us(op_b)
                with harness._bench_stream():
                    ra, rb = op_a().copy(), op_b().copy()
                cp.cuda.Device().synchronize()
                print(f"moe_linear E={E} [{N},{K_dim}] top-{top_k} T={T}: A {t_a:7.2f}  B {t_b:7.2f}  "
                      f"B/A {t_a / t_b:5.3f}  {compare(ra, rb)}", flush=True)
                if args.route:
                    t_a = graph_us(lambda ids=ids, E=E: route_a(ids, E))
                    t_b = graph_us(lambda ids=ids, E=E: route_b(ids, E))
                    with harness._bench_stream():
                        same = all(bool((a == b).all()) for a, b in zip(route_a(ids, E),
                                                                        route_b(ids, E)))
                    print(f"route_pairs E={E} pairs={ids.size}: A {t_a:7.2f}  B {t_b:7.2f}  "
                          f"B/A {t_a / t_b:5.3f}  {'same' if same else 'DIFFERENT'}", flush=True)
            del ea, eb
            cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
