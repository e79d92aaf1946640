"""One kbit_gemm launch for ncu: python benchmarks/profile_gemm.py K_dim N M k [kernel]
[--define=NAME=VALUE[,NAME=VALUE]] (the kernels built with -DNAME=VALUE, or a kbit_cupy
module attribute set: define_ab.py's syntax; run with benchmarks on PYTHONPATH)."""

import sys

import cupy as cp

import kbit_cupy as kc

args = [a for a in sys.argv[1:] if not a.startswith("--define=")]
for spec in (a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--define=")):
    from define_ab import whole_run_with

    whole_run_with(spec)
K_dim, N, M, k = (int(v) for v in args[:4])
kernel = args[4] if len(args) > 4 else "mma"
rng = cp.random.default_rng(0)
w = kc.quantize_weight((rng.standard_normal((N, K_dim), dtype=cp.float32) * 0.02).astype(cp.float16),
                       k=k).prepare()
A = rng.standard_normal((M, K_dim), dtype=cp.float32).astype(cp.float16)
kc.kbit_gemm(A, w, kernel=kernel)
cp.cuda.Device().synchronize()
