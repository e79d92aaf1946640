"""Accuracy of kbit_gemm built with compile-time defines (device only).

usage: python benchmarks/define_check.py --define KBIT_SCALE_AFTER=1,KBIT_MIN_CTAS_1=6 [...]
For each variant (the package's kernels compiled with those -D options, as
define_ab.py builds them), each k, dtype and a spread of shapes (odd M, N not
a multiple of 16, K_dim = 32, split K), the relative Frobenius error of
kbit_gemm(kernel) against A @ dequant(W).T in float64, against FORMAT.md
section 7's bound, and whether two calls give the same bits.
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np
from define_ab import kernels_built_with, module_attributes

import kbit_cupy as kc
from kbit_cupy._arrays import BFLOAT16

SHAPES = [(1, 1, 32), (3, 7, 96), (1, 130, 288), (5, 769, 2048), (8, 4096, 4096), (2, 57, 14336)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--define", action="append", default=[])
    p.add_argument("--k", nargs="+", type=int, default=[2, 3, 4, 5])
    p.add_argument("--kernel", default="mma")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    bad = 0
    for spec in args.define:
        defines = dict(kv.split("=") for kv in spec.split(","))
        attrs = {n: v for n, v in defines.items() if "." in n}
        options = [f"-D{n}={v}" for n, v in defines.items() if "." not in n]
        worst = {}
        with module_attributes(attrs), kernels_built_with(options):
            for M, N, K_dim in SHAPES:
                W = rng.standard_normal((N, K_dim)).astype(np.float32)
                W[0, :32] *= 3e-4  # a block of tiny scales (E4M4 subnormal codes)
                for k in args.k:
                    for absmax in ("e4m4", "fp16"):
                        w = kc.quantize_weight(cp.asarray(W), k=k, absmax_format=absmax).prepare()
                        ref_w = cp.asnumpy(w.dequantize(np.float32)).astype(np.float64)
                        for dtype, bound in ((np.float16, 2e-3), (BFLOAT16, 1e-2)):
                            A = rng.standard_normal((M, K_dim)).astype(dtype)
                            want = A.astype(np.float64) @ ref_w.T
                            got1 = kc.kbit_gemm(cp.asarray(A), w, kernel=args.kernel)
                            got2 = kc.kbit_gemm(cp.asarray(A), w, kernel=args.kernel)
                            same = bool((got1.view(cp.uint16) == got2.view(cp.uint16)).all())
                            got = cp.asnumpy(got1).astype(np.float64)
                            err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300)
                            key = (k, absmax, np.dtype(dtype).name)
                            worst[key] = max(worst.get(key, 0.0), err)
                            if err > bound or not same or not np.isfinite(got).all():
                                bad += 1
                                print(f"  FAIL {spec} M={M} N={N} K={K_dim} k={k} {key}: "
                                      f"err {err:.2e} same bits {same}", flush=True)
        print(f"{spec}: worst relative error "
              + ", ".join(f"k={k} {a}/{d} {e:.2e}" for (k, a, d), e in sorted(worst.items())),
              flush=True)
    print("all within bounds, repeats identical" if bad == 0 else f"{bad} FAILED", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
