"""Issue 20's sweep: kbit_gemm against cuBLAS fp16 and the read ceiling, kernel-only and events.

    PYTHONPATH=.:benchmarks python benchmarks/full_sweep.py --dtype float16 \
        --out benchmarks/results/full_sweep_h100_<commit>_float16

For each layer and M, one process: cuBLAS fp16 ``A @ W.T`` through its
capturable call and ``kbit_gemm(kernel=...)`` at each k, each timed twice by
the TARGETS.md method:
- ``graph_us``: kernel-only, a CUDA graph of (256 MB overwrite, op) pairs minus
  a graph of the overwrites (``harness.time_graph``);
- ``events_us``: the public call launched from Python after each overwrite,
  events around it (``harness.time_ops``, ops interleaved rep by rep).

For each layer of at least 2^24 weights, the read ceiling of its kbit bytes
(indices + E4M4 scales) at each k: the fastest of stream_probe.py's reads
(``flat_hint``, 4 or 8 loads in flight, with and without evict_first, over
its grids), as graphs in the same process. ``read_share`` is that read's time
over kbit_gemm's graph time (issue 20 target 2 asks >= 0.90 at M = 1..16).
Records carry ``time_us`` (= ``graph_us``) so ``derive_dispatch.py`` reads a
sweep run with ``--kernels auto mma wgmma dequant``. ``choice`` is what
``choose_kernel`` names for the point (auto's kernel).
"""

from __future__ import annotations

import argparse

import numpy as np

LAYERS = ["2048x768", "768x2048", "2048x512", "4096x6144", "14336x4096", "4096x28672",
          "28672x8192", "8192x57344"]
M_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=LAYERS, help="K_dimxN")
    p.add_argument("--m", nargs="+", type=int, default=M_ROWS)
    p.add_argument("--k", nargs="+", type=int, default=[2, 3, 4, 5])
    p.add_argument("--kernels", nargs="+", default=["auto"])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-events", action="store_true", help="graphs only")
    p.add_argument("--out", default=None, help="path prefix for .json and .md")
    args = p.parse_args()

    import cupy as cp
    from latency_kernel import activations_and_cublas, layer_weights, run_info
    from stream_probe import read_ceilings

    from kbit_cupy import kbit_gemm
    from kbit_cupy._arrays import BFLOAT16
    from kbit_cupy.bench import harness
    from kbit_cupy.gemm import _device_tbps, choose_kernel

    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]
    info = run_info(harness)
    tbps = _device_tbps()
    records = []

    def write() -> None:  # after each layer: a run cut short keeps what it measured
        if not args.out:
            return
        meta = {**info, "peak_TB_s": tbps,
                "method": "graph_us: CUDA graphs of (256 MB overwrite, op) pairs minus overwrites, "
                          "median of 10 replays of reps pairs; events_us: TARGETS.md events after "
                          "each overwrite, ops interleaved, median of reps; cuBLAS fp16 through "
                          "_launch.cublas_gemm; read_us: fastest flat_hint read of the layer's kbit "
                          "bytes (stream_probe.py), graphs",
                "reps": args.reps}
        harness.write_results(records, meta, f"{args.out}.json", f"{args.out}.md",
                              columns=["K_dim", "N", "M", "k", "kernel", "choice", "dtype",
                                       "graph_us", "speedup", "events_us", "speedup_events",
                                       "read_us", "read_share"],
                              title="kbit_gemm vs cuBLAS fp16 and the read ceiling (issue 20 sweep)")
        print(f"wrote {args.out}.json and {args.out}.md", flush=True)

    for layer in args.layers:
        K_dim, N, W, weights = layer_weights(layer, args.k)
        ceil = read_ceilings(K_dim, N, args.k, args.reps) if N * K_dim >= 1 << 24 else {}
        for k, t in ceil.items():
            print(f"{layer} read k={k}: {t:.2f} us", flush=True)
        for M in args.m:
            A, cublas = activations_and_cublas(W, M, dtype)
            ops = {"cublas_fp16": (16, "cublas", cublas)}
            for k, w in weights.items():
                for kern in args.kernels:
                    out = cp.empty((M, N), dtype)
                    ops[f"k{k}_{kern}"] = (k, kern, lambda w=w, kern=kern, A=A, out=out:
                                           kbit_gemm(A, w, out=out, kernel=kern))
            cp.cuda.Device().synchronize()
            graph = {name: harness.time_graph(op, reps=args.reps) for name, (_, _, op) in ops.items()}
            events = ({} if args.no_events else
                      harness.time_ops({name: op for name, (_, _, op) in ops.items()}, reps=args.reps))
            g_base = graph["cublas_fp16"]["median_us"]
            e_base = events["cublas_fp16"]["median_us"] if events else float("nan")
            for name, (k, kern, _) in ops.items():
                g = graph[name]["median_us"] if graph[name] else float("nan")
                e = events[name]["median_us"] if events else float("nan")
                rec = {"K_dim": K_dim, "N": N, "M": M, "k": k, "kernel": kern, "dtype": args.dtype,
                       "choice": (choose_kernel(M, N, K_dim, k, dtype, tbps=tbps)
                                  if kern == "auto" else kern),
                       "graph_us": g, "events_us": e, "time_us": g,
                       "speedup": g_base / g, "speedup_events": e_base / e,
                       "read_us": ceil.get(k, float("nan")),
                       "read_share": ceil[k] / g if k in ceil else float("nan")}
                records.append(rec)
                share = f"  {rec['read_share']:6.1%} of read" if k in ceil else ""
                print(f"{K_dim:>5}x{N:<6} M={M:<4} {name:<12} {rec['choice']:<8} {g:9.2f} us "
                      f"{rec['speedup']:5.2f}x  events {e:9.2f} us {rec['speedup_events']:5.2f}x{share}",
                      flush=True)
            del A, ops, graph, events
        del W, weights
        cp.get_default_memory_pool().free_all_blocks()
        write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
