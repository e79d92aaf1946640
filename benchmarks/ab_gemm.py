"""A/B timing of a gemm_mma source change in one process (device only).

usage: python benchmarks/ab_gemm.py 'OLD TEXT' 'NEW TEXT' [K_dim N M k ...]
"A" is kernels_src/gemm_mma.cu with NEW TEXT replaced back by OLD TEXT, "B"
the file as it is; both run through kbit_gemm (the compiled kernel is swapped
in the package's cache around each launch) and are timed in one interleaved
bench.time_ops call with cuBLAS fp16, so run-to-run drift cancels.
"""

import sys

import cupy as cp
import numpy as np

import kbit_cupy as kc
from kbit_cupy import _jit, bench

old, new = sys.argv[1], sys.argv[2]
cases = [int(v) for v in sys.argv[3:]] or [8192, 57344, 1, 4]
src_b = _jit.render_source("gemm_mma")
assert new in src_b, "NEW TEXT not found in kernels_src/gemm_mma.cu"
src_a = src_b.replace(new, old)
for i in range(0, len(cases), 4):
    K_dim, N, M, k = cases[i : i + 4]
    rng = cp.random.default_rng(0)
    w = kc.quantize_weight((rng.standard_normal((N, K_dim), dtype=cp.float32) * 0.02)
                           .astype(cp.float16), k=k).prepare()
    A = rng.standard_normal((M, K_dim), dtype=cp.float32).astype(cp.float16)
    out = cp.empty((M, N), cp.float16)
    kc.kbit_gemm(A, w, out=out, kernel="mma")  # compiles B, fills the cache
    key = next(key for key in _jit._kernels if key[0] == "gemm_mma" and key[1][0] == k)
    kern_b = _jit._kernels[key]
    name = _jit.kernel_name("gemm_mma", *key[1])
    kern_a = cp.RawModule(code=src_a, options=_jit.compile_options(),
                          name_expressions=[name]).get_function(name)

    def run_with(kern, key=key, A=A, w=w, out=out, kern_b=kern_b):
        _jit._kernels[key] = kern
        kc.kbit_gemm(A, w, out=out, kernel="mma")
        _jit._kernels[key] = kern_b

    base, _ = bench.cublas_fp16_matmul_op(M, N, K_dim)
    res = bench.time_ops({"cublas": base, "A": lambda ka=kern_a, r=run_with: r(ka),
                          "B": lambda kb=kern_b, r=run_with: r(kb)},
                         reps=30)
    t = {n: r["median_us"] for n, r in res.items()}
    print(f"{K_dim}x{N} M={M} k={k}: cublas {t['cublas']:.1f} us  A {t['A']:.1f} us "
          f"({t['cublas'] / t['A']:.2f}x)  B {t['B']:.1f} us ({t['cublas'] / t['B']:.2f}x)  "
          f"B/A {t['A'] / t['B']:.3f}")
    np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint16),
                                  cp.asnumpy(kc.kbit_gemm(A, w, kernel="mma")).view(np.uint16))
