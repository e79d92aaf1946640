"""gemm_latency.cu against gemm_mma.cu, kernel="auto" and cuBLAS fp16, kernel-only.

Every op is timed as a CUDA graph of (256 MB L2 flush, op) pairs minus a
graph of flushes (``harness.time_graph``, the TARGETS.md method); cuBLAS
through its capturable form (``_launch.cublas_gemm``), our kernels through
the public ``kbit_gemm`` call with ``out=``. One process, layers and M
interleaved op by op. Before timing, each kbit kernel's result is compared
with the mma kernel's (relative Frobenius error, printed; the GPU tests are
the correctness gate).

    PYTHONPATH=. python benchmarks/latency_kernel.py --out benchmarks/results/latency_h100_<commit>
"""

from __future__ import annotations

import argparse
import os

import numpy as np

LAYERS = ["2048x768", "768x2048", "2048x512", "4096x4096", "4096x6144", "14336x4096",
          "4096x28672"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=LAYERS, help="K_dimxN")
    p.add_argument("--m", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--k", nargs="+", type=int, default=[2, 3, 4, 5])
    p.add_argument("--kernels", nargs="+", default=["mma", "latency", "auto"])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import cupy as cp

    from kbit_cupy import kbit_gemm
    from kbit_cupy._arrays import BFLOAT16
    from kbit_cupy.bench import harness

    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]
    info = run_info(harness)
    records = []
    for layer in args.layers:
        K_dim, N, W, weights = layer_weights(layer, args.k)
        for M in args.m:
            A, cublas = activations_and_cublas(W, M, dtype)
            ops = {"cublas_fp16": (16, "cublas", cublas)}
            for k, w in weights.items():
                ref = kbit_gemm(A, w, kernel="mma").astype(cp.float32)
                for kern in args.kernels:
                    out = cp.empty((M, N), dtype)
                    got = kbit_gemm(A, w, out=out, kernel=kern).astype(cp.float32)
                    err = float(cp.linalg.norm(got - ref) / max(float(cp.linalg.norm(ref)), 1e-30))
                    if err > (2e-3 if dtype == np.float16 else 1e-2):
                        print(f"  MISMATCH {layer} M={M} k={k} {kern}: {err:.2e}", flush=True)
                    ops[f"k{k}_{kern}"] = (k, kern, lambda w=w, kern=kern, A=A, out=out:
                                           kbit_gemm(A, w, out=out, kernel=kern))
            cp.cuda.Device().synchronize()
            base = None
            for name, (k, kern, op) in ops.items():
                st = harness.time_graph(op, reps=args.reps)
                t = st["median_us"] if st else float("nan")
                if name == "cublas_fp16":
                    base = t
                rec = {"K_dim": K_dim, "N": N, "M": M, "k": k, "kernel": kern,
                       "dtype": args.dtype, "graph_us": t, "speedup": base / t}
                records.append(rec)
                print(f"{K_dim:>5}x{N:<6} M={M:<3} {name:<12} {t:8.2f} us {base / t:5.2f}x",
                      flush=True)
        del weights
    if args.out:
        meta = {**info, "method": "CUDA graphs: (256 MB flush, op) pairs minus flushes, median "
                "of 10 replays of 20 pairs; cuBLAS fp16 through _launch.cublas_gemm"}
        harness.write_results(records, meta, f"{args.out}.json", f"{args.out}.md",
                              columns=["K_dim", "N", "M", "k", "kernel", "dtype", "graph_us",
                                       "speedup"],
                              title="gemm_latency vs gemm_mma vs cuBLAS fp16 (kernel-only)")
        print(f"wrote {args.out}.json and {args.out}.md")
    return 0


def run_info(harness) -> dict:
    """harness.gpu_info() with $KBIT_COMMIT (when set) as the commit, printed
    as the run's first line."""
    info = harness.gpu_info()
    info["commit"] = os.environ.get("KBIT_COMMIT", info.get("commit"))
    print(f"{info['gpu']}  commit {info['commit']}", flush=True)
    return info


def layer_weights(layer: str, ks):
    """(K_dim, N, W, {k: KbitWeight}) of a ``"K_dimxN"`` layer: W [N, K_dim]
    fp16, standard normal x 0.02 (seed 0), quantized at each k and prepared;
    the device synchronized after (prepare() ran on the default stream, the
    timing stream is another)."""
    import cupy as cp

    from kbit_cupy import quantize_weight

    K_dim, N = (int(v) for v in layer.lower().split("x"))
    rng = cp.random.default_rng(0)
    W = (rng.standard_normal((N, K_dim), dtype=cp.float32) * np.float32(0.02)).astype(cp.float16)
    weights = {k: quantize_weight(W, k=k).prepare() for k in ks}
    cp.cuda.Device().synchronize()
    return K_dim, N, W, weights


def activations_and_cublas(W, M: int, dtype):
    """A [M, K_dim] of ``dtype`` (standard normal, seed 1) for the fp16 weight
    W [N, K_dim], and the baseline op: cuBLAS fp16 ``A @ W.T`` through its
    capturable call (A cast to fp16 once, the output preallocated)."""
    import cupy as cp

    from kbit_cupy import _launch

    N, K_dim = W.shape
    A = cp.random.default_rng(1).standard_normal((M, K_dim), dtype=cp.float32).astype(dtype)
    A16 = A.astype(cp.float16) if dtype != np.float16 else A
    C16 = cp.empty((M, N), cp.float16)

    def cublas():
        _launch.cublas_gemm(M, N, K_dim, "float16", A16.data.ptr, W.data.ptr, C16.data.ptr,
                            cp.cuda.get_current_stream().ptr)
        return C16

    return A, cublas


if __name__ == "__main__":
    raise SystemExit(main())
