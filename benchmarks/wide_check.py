"""Error of an mma launch built with a gemm.py knob against fp32 math on the
dequantized weight, next to the default launch's (device only): a quick
correctness look before the GPU tests.

usage: python benchmarks/wide_check.py --knob _K5_TABLE --k 5 [--m 1 3 8]
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

import kbit_cupy as kc
from kbit_cupy import gemm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--knob", required=True, help="a gemm.py attribute, set to 1")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--m", nargs="+", type=int, default=[1, 3, 8, 9, 16])
    p.add_argument("--shapes", nargs="+", default=["8192x40", "8448x1040", "16384x4100", "256x16400"])
    args = p.parse_args()
    rng = np.random.default_rng(0)
    bad = 0
    for shape in args.shapes:
        K_dim, N = (int(v) for v in shape.split("x"))
        w = kc.quantize_weight(rng.standard_normal((N, K_dim)).astype(np.float32), k=args.k).to_device()
        W = cp.asarray(w.dequantize(np.float32))
        for M in args.m:
            A = cp.asarray(rng.standard_normal((M, K_dim)).astype(np.float32)).astype(cp.float16)
            ref = A.astype(cp.float32) @ W.T
            errs = []
            for on in (0, 1):
                setattr(gemm, args.knob, on)
                w._plans.clear()  # plans are made per knob setting
                out = cp.full((M, N), np.nan, cp.float16)
                C = kc.kbit_gemm(A, w, out=out, kernel="mma").astype(cp.float32)
                again = kc.kbit_gemm(A, w, kernel="mma").astype(cp.float32)
                same = bool((C == again).all())
                err = float(cp.linalg.norm(C - ref) / cp.linalg.norm(ref))
                warps = gemm._mma_warps(args.k, w.absmax.dtype, M, 1, N, K_dim)
                errs.append((err, bool(cp.isfinite(C).all()), same, warps))
            setattr(gemm, args.knob, 0)
            ok = errs[1][1] and errs[1][2] and errs[1][0] <= 1.5 * errs[0][0] + 1e-4
            bad += not ok
            print(f"{shape:>11} M={M:<3} default {errs[0]}  {args.knob}=1 {errs[1]}  {'ok' if ok else 'BAD'}")
    print("BAD" if bad else "all ok")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
