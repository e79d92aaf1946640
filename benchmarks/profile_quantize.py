"""One quantize and one dequantize launch on 2**26 fp16 elements, for ncu."""

import cupy as cp

import kbit_cupy as kc

x = cp.random.default_rng(0).standard_normal(1 << 26, dtype=cp.float32).astype(cp.float16)
packed, absmax, cb = kc.quantize_kbit(x, k=4)
kc.dequantize_kbit(packed, absmax, cb, 4, x.size)
cp.cuda.Device().synchronize()
