"""kbit_gemm against cuBLAS fp16 with the TARGETS.md method, one process and run.

``python -m kbit_cupy bench-gemm [--shapes KxN ...] [--m 1 16 ...] [--k 2 3 4 5]
[--kernels auto mma dequant] [--dtype float16] [--bf16-baseline] [--out PREFIX]``: for each layer
(K_dim x N, as TARGETS.md writes them) and M, times cuBLAS ``A @ W.T`` (fp16)
and kbit_gemm for each k and kernel in one interleaved ``harness.time_ops`` call,
(with ``--bf16-baseline`` cuBLAS bf16 too, as ``kernel="cublas_bf16"``) and reports the ratio, the bandwidth on our bytes (weights + scales +
activations + output) as a share of the copy bandwidth measured in the same run,
and TFLOP/s.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .._arrays import BFLOAT16
from ..gemm import kbit_gemm, quantize_weight
from . import harness

DEFAULT_SHAPES = ["4096x6144", "4096x28672", "8192x57344", "2048x768"]  # TARGETS.md layers
DEFAULT_M = [1, 4, 16, 32, 64, 128, 1024]


def parse_shape(text: str) -> tuple[int, int]:
    K_dim, N = (int(v) for v in text.lower().split("x"))
    return K_dim, N


def run(args) -> int:
    import cupy as cp

    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]
    info = harness.gpu_info()
    copy_bw = harness.copy_bandwidth(1 << 30)
    print(f"{info['gpu']} {info['cc']}  commit {info['commit']}  copy {copy_bw / 1e12:.3f} TB/s")
    records = []
    skipped_lut = False
    shapes = [parse_shape(s) for s in args.shapes]
    for K_dim, N in harness.progress(shapes, "layer"):
        rng = cp.random.default_rng(0)
        W = (rng.standard_normal((N, K_dim), dtype=cp.float32) * np.float32(0.02)).astype(cp.float16)
        weights = {k: quantize_weight(W, k=k).prepare() for k in args.k}
        del W
        for M in args.m:
            base, binfo = harness.cublas_fp16_matmul_op(M, N, K_dim, "float16")
            A = cp.asarray(cp.random.default_rng(1).standard_normal((M, K_dim), dtype=cp.float32)
                           ).astype(dtype)
            outs = cp.empty((M, N), dtype)
            ops = {"cublas_fp16": base}
            if getattr(args, "bf16_baseline", False):  # the tensor-core rate of bf16 as well
                ops["cublas_bf16"] = harness.cublas_fp16_matmul_op(M, N, K_dim, "bfloat16")[0]
            for k, w in weights.items():
                for kern in args.kernels:
                    if kern == "lut" and (k != 2 or M != 1):  # (its only sizes: kbit_gemm's docstring)
                        if not skipped_lut:
                            print("kernel 'lut' runs k = 2 at M = 1 only: its other points are skipped")
                        skipped_lut = True
                        continue
                    ops[f"k{k}_{kern}"] = (lambda w=w, kern=kern, A=A, outs=outs: kbit_gemm(A, w, out=outs, kernel=kern))
            times = harness.time_ops(ops, reps=args.reps)
            t_base = times["cublas_fp16"]["median_us"]
            for name, r in times.items():
                t = r["median_us"]
                if name in ("cublas_fp16", "cublas_bf16"):
                    k, nbytes = 16, binfo["bytes"]
                    kern = "cublas" if name == "cublas_fp16" else "cublas_bf16"
                else:
                    k = int(name[1])
                    kern = name.split("_", 1)[1]
                    w = weights[k]
                    nbytes = w.nbytes + A.nbytes + outs.nbytes
                rec = {
                    "K_dim": K_dim, "N": N, "M": M, "k": k, "kernel": kern, "dtype": args.dtype,
                    "time_us": t, "speedup": t_base / t, "GB_s": nbytes / t / 1e3,
                    "copy_frac": nbytes / (t * 1e-6) / copy_bw,
                    "TFLOP_s": 2.0 * M * N * K_dim / t / 1e6,
                }
                records.append(rec)
                print(f"{K_dim:>5}x{N:<6} M={M:<5} {name:<14} {t:9.1f} us  {rec['speedup']:5.2f}x  "
                      f"{100 * rec['copy_frac']:5.1f}% of copy  {rec['TFLOP_s']:7.1f} TFLOP/s")
            del base, A, outs
        del weights
    if args.out:
        meta = {**info, "copy_bandwidth_TB_s": copy_bw / 1e12, "method": harness.METHOD,
                "reps": args.reps, "baseline": "cuBLAS fp16 A @ W.T (cupy.matmul)"}
        harness.write_results(records, meta, f"{args.out}.json", f"{args.out}.md",
                              columns=["K_dim", "N", "M", "k", "kernel", "dtype", "time_us",
                                       "speedup", "GB_s", "copy_frac", "TFLOP_s"],
                              title="kbit_gemm vs cuBLAS fp16")
        print(f"wrote {args.out}.json and {args.out}.md")
        if getattr(args, "plot", False):
            from .plots import plot_roofline, plot_speedup

            recs = json.loads(Path(f"{args.out}.json").read_text())["records"]
            for fn, suffix in ((plot_speedup, "speedup"), (plot_roofline, "roofline")):
                print(f"wrote {fn(recs, meta, f'{args.out}_{suffix}.png')}")
    return 0
