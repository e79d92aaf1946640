"""One kbit_gemm launch for ncu: python benchmarks/profile_gemm.py K_dim N M k [kernel]."""

import sys

import cupy as cp

import kbit_cupy as kc

K_dim, N, M, k = (int(v) for v in sys.argv[1:5])
kernel = sys.argv[5] if len(sys.argv) > 5 else "mma"
rng = cp.random.default_rng(0)
w = kc.quantize_weight((rng.standard_normal((N, K_dim), dtype=cp.float32) * 0.02).astype(cp.float16),
                       k=k).prepare()
A = rng.standard_normal((M, K_dim), dtype=cp.float32).astype(cp.float16)
kc.kbit_gemm(A, w, kernel=kernel)
cp.cuda.Device().synchronize()
