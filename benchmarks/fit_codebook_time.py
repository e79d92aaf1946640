"""Time fit_codebook on a 4096x14336 fp16 CuPy matrix (the issue's size): python benchmarks/fit_codebook_time.py"""
import time

import cupy as cp

from kbit_cupy import fit_codebook

W = (cp.random.default_rng(0).standard_normal((4096, 14336), dtype=cp.float32) * 0.02).astype(cp.float16)
fit_codebook(W[:64], 4)
for k in (2, 4, 5):
    cp.cuda.Device().synchronize(); t0 = time.perf_counter(); fit_codebook(W, k); print(f"fit_codebook 4096x14336 fp16 on the GPU (host histogram), k={k}: {time.perf_counter() - t0:.2f} s")
