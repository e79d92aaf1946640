"""Error of kbit_gemm against the dequantized weight (fp32 reference), with the
kernels compiled with extra defines (device only): a correctness check for
define_ab.py variants whose bits differ from the default build's.

usage: python benchmarks/scale_after_check.py --define KBIT_SCALE_AFTER_TILES=2 [--m 9 16]
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np
from define_ab import kbit_variant

import kbit_cupy as kc
from kbit_cupy._arrays import BFLOAT16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--define", action="append", default=[])
    p.add_argument("--layers", nargs="+", default=["4096x16384", "8192x2048"])
    p.add_argument("--m", nargs="+", type=int, default=[1, 3, 9, 13, 16])
    args = p.parse_args()
    variants = {"default": {}}
    for spec in args.define:
        variants[spec] = dict(kv.split("=") for kv in spec.split(","))
    worst = 0.0
    for layer in args.layers:
        K_dim, N = (int(v) for v in layer.lower().split("x"))
        rng = cp.random.default_rng(1)
        W = (rng.standard_normal((N, K_dim), dtype=cp.float32) * np.float32(0.02)).astype(cp.float16)
        for dtype in (np.dtype(np.float16), BFLOAT16):
            As = {m: rng.standard_normal((m, K_dim), dtype=cp.float32).astype(dtype) for m in args.m}
            for name, d in variants.items():
                w = kbit_variant(W, 4, d, As.values(), "mma")
                Wd = cp.asarray(w.dequantize(np.float32))
                for m, A in As.items():
                    ref = A.astype(cp.float32) @ Wd.T
                    out = cp.full((m, N), np.nan, dtype)
                    got = kc.kbit_gemm(A, w, out=out, kernel="mma").astype(cp.float32)
                    err = float(cp.abs(got - ref).max() / cp.abs(ref).max())
                    finite = bool(cp.isfinite(got).all())
                    worst = max(worst, err) if name != "default" else worst
                    print(f"{layer} {dtype.name} M={m} {name}: max rel err {err:.2e} finite {finite}",
                          flush=True)
    print(f"worst (variants) {worst:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
