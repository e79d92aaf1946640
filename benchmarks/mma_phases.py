"""Where the mma / wgmma kernel's time goes: phase stamps inside gemm_mma.cu (device only).

The kernel is built with -DKBIT_MMA_PHASES, which makes lane 0 of every warp
(of the first 2048 CTAs, 16 warps) write the global timer (ns) and its SM's
clock at these points:

    0 entry                              4 the cluster's partial tiles written
    1 the first weight tile arrived        (split K in clusters only)
    2 the first K tile's activations     5 exit
      staged (the tables built)          6 the warp's part of the tables written
    3 the segment multiplied (the last    7 C (or the partial tiles) stored
      segment's, wgmma: after the wait)     (not on the cluster path)
(1 is stamped after 2: it is when both had happened.) The grouped launch
(``--moe``) stamps its set-up too:

    8 the router's ids staged and counted (moe_linear)
    9 the problems counted and scanned
   10 the rows of the CTA's problems placed (moe_linear)
   11 the placement about to start (moe_linear; after the first tile's L2
      prefetch, or its loads into registers where the early tile is on:
      gemm_mma.cu kEarlyTile)
   12 the placement's first problem counted and scanned (moe_linear)
   13 the placement's first expert found (its search; moe_linear)
   14 the placement's first problem's ids counted, before the scan (moe_linear;
      lane 0's slice: the stamping lane's)

The public call (``kbit_gemm(..., kernel=--kernel)``, the launch plan as the
package makes it) runs in a CUDA graph of (256 MB overwrite, call), the
TARGETS.md cold-L2 setting, as latency_phases.py does for gemm_latency.cu;
printed per (layer, k, M) as medians over the replays: per point the time
since the CTA's own entry of the median and of the slowest CTA, the span (last
exit after the first entry) and the kernel-only time with and without stamps.
Where a call launches more than one gemm_mma kernel, the last one built is
stamped.

    PYTHONPATH=.:benchmarks python benchmarks/mma_phases.py --layers 768x2048 --k 4 --m 64 128 256

With ``--moe E,TOP_K`` the stamped calls are instead ``moe_linear`` and
``kbit_grouped_gemm`` (the same pairs grouped by expert) over E experts of
each --layers K_dimxN, top-k routing, T = --m tokens, one line each; where a
call takes the few-row latency kernel nothing is stamped.

    PYTHONPATH=.:benchmarks python benchmarks/mma_phases.py --moe 512,10 --layers 2048x512 --m 8 32
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os

import numpy as np
from latency_phases import add_flush_argument, phases

POINTS = ("weights in", "A staged", "multiplied", "shared", "exit", "tables", "stored",
          "ids in", "scanned", "placed", "placing", "1st scan", "1st expert", "1st count")
POINTS_ALLOCATED = 15  # gemm_mma.cu's kMmaPhasePoints


@contextlib.contextmanager
def stamped_gemm_mma(defines=()):
    """Inside: gemm_mma variants are built with -DKBIT_MMA_PHASES (and
    ``defines``) from an empty cache; yields the list their modules are
    appended to, in build order. Restored on exit."""
    import cupy as cp

    from kbit_cupy import _jit

    modules = []
    saved_get, saved_cache = _jit.get_kernel, dict(_jit._kernels)
    _jit._kernels.clear()

    def get_kernel(family, *template_args):
        if family != "gemm_mma":
            return saved_get(family, *template_args)
        key = (family, template_args, cp.cuda.runtime.getDevice())
        if key not in _jit._kernels:
            name = _jit.kernel_name(family, *template_args)
            options = (*_jit.compile_options(), "-DKBIT_MMA_PHASES", *(f"-D{d}" for d in defines))
            if _jit.needs_sm90a(family, template_args):
                options = (*options, "-arch=sm_90a")
            module = cp.RawModule(code=_jit.render_source(family), options=options,
                                  name_expressions=[name])
            _jit._kernels[key] = module.get_function(name)
            modules.append(module)
        return _jit._kernels[key]

    _jit.get_kernel = get_kernel
    try:
        yield modules
    finally:
        _jit.get_kernel = saved_get
        _jit._kernels.clear()
        _jit._kernels.update(saved_cache)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=["768x2048", "2048x768"])
    p.add_argument("--k", nargs="+", type=int, default=[4])
    p.add_argument("--m", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--kernel", default="auto", help="kbit_gemm's kernel= (default auto)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--replays", type=int, default=15)
    add_flush_argument(p)
    p.add_argument("--define", action="append", default=[],
                   help="NAME=VALUE: also compile the stamped kernels with -DNAME=VALUE")
    p.add_argument("--moe", default=None, metavar="E,TOP_K",
                   help="stamp moe_linear and kbit_grouped_gemm over E experts of each "
                        "--layers K_dimxN, top-k routing, T = --m tokens (k = --k)")
    p.add_argument("--warm-code", action="store_true",
                   help="in the stamped graph, a call of the same kernel on another weight, "
                        "A and output between the flush and the stamped call (its code in "
                        "L2 and the SMs' caches, its data not)")
    args = p.parse_args()

    import cupy as cp
    from latency_kernel import activations_and_cublas

    from kbit_cupy import kbit_gemm, quantize_weight
    from kbit_cupy._arrays import BFLOAT16
    from kbit_cupy.bench import harness

    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]
    info = harness.gpu_info()
    print(f"{info['gpu']}  commit {os.environ.get('KBIT_COMMIT', info.get('commit'))}  "
          f"{args.dtype}, kernel={args.kernel}, cold L2 (stamps after a 256 MB {args.flush}), graph replays "
          f"{args.replays}, defines {args.define}", flush=True)
    print("times in us since each CTA's entry: median CTA / slowest CTA")
    if args.moe:
        return moe_main(args, dtype)
    print(f"{'layer':>10} {'k':>2} {'M':>4} {'CTAs':>5} {'warps':>5} {'spread':>6} "
          + " ".join(f"{n:>13}" for n in POINTS[:7])
          + f" {'span':>6} {'graph':>6} {'plain':>6} {'cuBLAS':>6}", flush=True)
    for layer in args.layers:
        K_dim, N = (int(v) for v in layer.lower().split("x"))
        W = (cp.random.default_rng(0).standard_normal((N, K_dim), dtype=cp.float32)
             * np.float32(0.02)).astype(cp.float16)
        for k in args.k:
            plain_w = quantize_weight(W, k=k).prepare()
            probe_w = quantize_weight(W, k=k).prepare()
            warm_w = quantize_weight(W, k=k).prepare()
            cp.cuda.Device().synchronize()  # prepare() ran on the default stream
            stream = harness._bench_stream()
            for M in args.m:
                A, cublas = activations_and_cublas(W, M, dtype)  # cuBLAS fp16, capturable
                A2, out2 = A.copy(), cp.empty((M, N), dtype)
                # made on the current stream: finished before the harness's (non-blocking) uses them
                cp.cuda.Device().synchronize()
                out_q, out_p = (cp.empty((M, N), dtype) for _ in range(2))
                plain = functools.partial(kbit_gemm, A, plain_w, out=out_q, kernel=args.kernel)
                with stream:
                    plain()
                    with stamped_gemm_mma(args.define) as modules:
                        probe = functools.partial(kbit_gemm, A, probe_w, out=out_p,
                                                  kernel=args.kernel)
                        probe()
                        warm = functools.partial(kbit_gemm, A2, warm_w, out=out2, kernel=args.kernel)
                        warm()
                    stream.synchronize()
                if not modules:
                    print(f"{layer:>10} {k:>2} {M:>4}  (no gemm_mma launch: nothing stamped)")
                    continue
                with stream:
                    again = out_q.copy()
                    plain()
                    stream.synchronize()
                if not bool(cp.all(out_q == again)):
                    print(f"  {layer} k={k} M={M}: the plain call's bits differ between two calls")
                if not bool(cp.all(out_p == out_q)):
                    d = float(cp.abs(out_p.astype(cp.float32) - out_q.astype(cp.float32)).max())
                    print(f"  {layer} k={k} M={M}: stamped and plain kernels' bits differ "
                          f"(max abs difference {d:.3g} of max |C| "
                          f"{float(cp.abs(out_q.astype(cp.float32)).max()):.3g})")
                stamped = ((lambda w=warm, q=probe: (w(), q())) if args.warm_code else probe)
                s, ctas, warps = phases(modules[-1], stamped, stream, args.replays, args.flush,
                                        symbol="kbit_mma_phases", max_warps=16,
                                        points=POINTS_ALLOCATED)
                cells = " ".join(f"{s[f'p{i}_med'] / 1e3:6.2f}/{s[f'p{i}_max'] / 1e3:6.2f}"
                                 for i in range(1, 8))
                t_probe = harness.time_graph(probe, reps=20)
                t_plain = harness.time_graph(plain, reps=20)
                t_cublas = harness.time_graph(cublas, reps=20)
                print(f"{layer:>10} {k:>2} {M:>4} {ctas:>5} {warps:>5} {s['spread'] / 1e3:6.2f} "
                      f"{cells} {s['span'] / 1e3:6.2f} {t_probe['median_us']:6.2f} "
                      f"{t_plain['median_us']:6.2f} {t_cublas['median_us']:6.2f}", flush=True)
    return 0


def moe_main(args, dtype) -> int:
    """--moe: one line per (shape, T, call), the grouped launch's stamps in the
    order of its set-up (points 8, 9, 11, 13, 14, 12, 10, then 1, 2, 6, 3, 7)."""
    import cupy as cp
    import moe_gap_probe

    from kbit_cupy import kbit_grouped_gemm, moe_linear, quantize_experts
    from kbit_cupy.bench import harness

    E, top_k = (int(v) for v in args.moe.split(","))
    moe_gap_probe.ACT = dtype  # (_routed's activations)
    order = (8, 9, 11, 13, 14, 12, 10, 1, 2, 6, 3, 7)
    print(f"{E} experts, top-{top_k}; points in set-up order")
    print(f"{'shape':>10} {'k':>2} {'T':>4} {'call':>8} {'CTAs':>5} {'warps':>5} {'spread':>6} "
          + " ".join(f"{POINTS[i - 1]:>13}" for i in order)
          + f" {'span':>6} {'graph':>6} {'plain':>6}", flush=True)
    rng = np.random.default_rng(0)
    for layer in args.layers:
        K_dim, N = (int(v) for v in layer.lower().split("x"))
        W = cp.asarray((rng.standard_normal((E, N, K_dim)) * 0.02).astype(np.float16))
        for k in args.k:
            plain_x, probe_x = (quantize_experts(W, k=k).prepare() for _ in range(2))
            cp.cuda.Device().synchronize()  # prepare() ran on the default stream
            stream = harness._bench_stream()
            for T in args.m:
                ids, x, offsets, rows = moe_gap_probe._routed(T, E, top_k, K_dim, rng)
                x, rows = x.astype(dtype), rows.astype(dtype)
                cp.cuda.Device().synchronize()
                for name in ("moe", "grouped"):
                    out_q, out_p = (cp.empty((T, top_k, N), dtype) for _ in range(2))
                    if name == "moe":
                        plain, probe = (functools.partial(moe_linear, x, ids, w, out=o, validate=False)
                                        for w, o in ((plain_x, out_q), (probe_x, out_p)))
                    else:
                        plain, probe = (functools.partial(kbit_grouped_gemm, rows, w, offsets,
                                                          out=o.reshape(T * top_k, N), validate=False)
                                        for w, o in ((plain_x, out_q), (probe_x, out_p)))
                    with stream:
                        plain()
                        with stamped_gemm_mma(args.define) as modules:
                            probe()
                        stream.synchronize()
                    if not modules:
                        print(f"{layer:>10} {k:>2} {T:>4} {name:>8}  (no gemm_mma launch: nothing stamped)")
                        continue
                    if not bool(cp.all(out_p == out_q)):
                        print(f"  {layer} k={k} T={T} {name}: stamped and plain kernels' bits differ")
                    s, ctas, warps = phases(modules[-1], probe, stream, args.replays, args.flush,
                                            symbol="kbit_mma_phases", max_warps=16,
                                            points=POINTS_ALLOCATED)
                    cells = " ".join(f"{s[f'p{i}_med'] / 1e3:6.2f}/{s[f'p{i}_max'] / 1e3:6.2f}"
                                     for i in order)
                    t_probe = harness.time_graph(probe, reps=20)
                    t_plain = harness.time_graph(plain, reps=20)
                    print(f"{layer:>10} {k:>2} {T:>4} {name:>8} {ctas:>5} {warps:>5} "
                          f"{s['spread'] / 1e3:6.2f} {cells} {s['span'] / 1e3:6.2f} "
                          f"{t_probe['median_us']:6.2f} {t_plain['median_us']:6.2f}", flush=True)
        del W
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
