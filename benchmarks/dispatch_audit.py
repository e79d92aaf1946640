"""kernel="auto" against every kernel kbit_gemm offers, point by point, kernel-only.

    PYTHONPATH=.:benchmarks python benchmarks/dispatch_audit.py --dtype float16 \
        --out benchmarks/results/dispatch_audit_h200_<commit>_float16

For each layer, M and k, every kernel of ``gemm.KERNELS`` that accepts the
point (a first call that raises ValueError leaves it out: "lut" past one row,
"cluster" where its split does not apply, ...) is timed as a CUDA graph after
the 256 MB overwrite (``harness.time_graph``, the TARGETS.md method), with
"auto" among them, in one process. ``dequant`` (dequantize + cuBLAS) is timed
from ``--dequant-from`` rows only: below that it is never near the fused
kernels. ``over_best`` is auto's time over the fastest kernel's; points where
it passes ``--flag`` are printed at the end. derive_dispatch.py checks
mma / wgmma / dequant only; this checks the choices of the latency, cluster
and lookup kernels too.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

LAYERS = ["2048x768", "768x2048", "2048x512", "4096x4096", "4096x6144", "5120x13824",
          "13824x5120", "14336x4096", "4096x28672", "28672x8192", "8192x57344"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=LAYERS, help="K_dimxN")
    p.add_argument("--m", nargs="+", type=int, default=[1, 2, 4, 8, 16, 24, 32, 64, 128, 256])
    p.add_argument("--k", nargs="+", type=int, default=[2, 3, 4, 5])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--kernels", nargs="+", default=None,
                   help="the kernels to time besides auto (default: every one of gemm.KERNELS)")
    p.add_argument("--dequant-from", type=int, default=64, help="time dequant from this M")
    p.add_argument("--latency-max-m", type=int, default=64,
                   help="time the latency kernel up to this M (past it, it runs in several launches "
                        "at many times the others' time)")
    p.add_argument("--cluster-max-m", type=int, default=256, help="time the cluster split up to this M")
    p.add_argument("--flag", type=float, default=1.03, help="report auto past this x the best")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="stop starting new layers after this many seconds (results so far kept)")
    p.add_argument("--twice", action="store_true",
                   help="time every kernel of a point again after all of them (the second "
                        "timing in the log and in the records' graph_us_again): whether a slow "
                        "time stays with the point's plan")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import cupy as cp
    from latency_kernel import layer_weights, run_info

    from kbit_cupy import kbit_gemm
    from kbit_cupy._arrays import BFLOAT16
    from kbit_cupy.bench import harness
    from kbit_cupy.gemm import KERNELS, _device_tbps, choose_kernel

    start = time.monotonic()
    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]
    info = run_info(harness)
    tbps = _device_tbps()
    records, flagged = [], []

    def write() -> None:
        if args.out:
            meta = {**info, "method": "CUDA graphs: (256 MB overwrite, op) pairs minus overwrites, "
                    f"median of 10 replays of {args.reps} pairs; every kernel that accepts the point"}
            harness.write_results(records, meta, f"{args.out}.json", f"{args.out}.md",
                                  columns=["K_dim", "N", "M", "k", "dtype", "kernel", "choice",
                                           "graph_us", "over_best"],
                                  title="kernel='auto' against every kernel (kernel-only)")

    for layer in args.layers:
        if time.monotonic() - start > args.budget_s:
            print(f"budget spent: stopped before {layer}", flush=True)
            break
        K_dim, N, _W, weights = layer_weights(layer, args.k)
        del _W
        for M in args.m:
            A = cp.random.default_rng(1).standard_normal((M, K_dim), dtype=cp.float32).astype(dtype)
            for k, w in weights.items():
                times, ops = {}, {}
                for kern in KERNELS:
                    if ((kern != "auto" and args.kernels is not None and kern not in args.kernels)
                            or (kern == "dequant" and M < args.dequant_from)
                            or (kern == "latency" and M > args.latency_max_m)
                            or (kern == "cluster" and M > args.cluster_max_m)):
                        continue
                    out = cp.empty((M, N), dtype)
                    try:
                        kbit_gemm(A, w, out=out, kernel=kern)
                    except ValueError:
                        continue  # (the kernel does not take this point)
                    ops[kern] = lambda w=w, kern=kern, A=A, out=out: kbit_gemm(A, w, out=out, kernel=kern)
                    st = harness.time_graph(ops[kern], reps=args.reps)
                    if st:
                        times[kern] = st["median_us"]
                again = {}
                if args.twice:
                    for kern in times:
                        st = harness.time_graph(ops[kern], reps=args.reps)
                        again[kern] = st["median_us"] if st else float("nan")
                best = min((t for kern, t in times.items() if kern != "auto"), default=float("nan"))
                choice = choose_kernel(M, N, K_dim, k, dtype, tbps=tbps)
                for kern, t in times.items():
                    records.append({"K_dim": K_dim, "N": N, "M": M, "k": k, "dtype": args.dtype,
                                    "kernel": kern, "choice": choice if kern == "auto" else kern,
                                    "graph_us": t, "over_best": t / best,
                                    **({"graph_us_again": again[kern]} if again else {})})
                ratio = times.get("auto", float("nan")) / best
                fastest = min((kern for kern in times if kern != "auto"), key=times.get, default="-")
                line = (f"{K_dim:>5}x{N:<6} M={M:<4} k={k} auto={choice:<8} {ratio:5.3f}x best "
                        f"({fastest}) " + " ".join(f"{kern}={t:.2f}" for kern, t in times.items())
                        + ("  again: " + " ".join(f"{kern}={t:.2f}" for kern, t in again.items())
                           if again else ""))
                print(line, flush=True)
                if ratio > args.flag:
                    flagged.append(line)
            del A
        del weights
        cp.get_default_memory_pool().free_all_blocks()
        write()
    print(f"== auto past {args.flag}x the best kernel at {len(flagged)} points:")
    for line in flagged:
        print(line)
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
