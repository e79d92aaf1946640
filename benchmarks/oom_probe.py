"""Which public call does not raise OutOfMemoryError under a pool limit (debug aid for
tests/test_files_safety.py::test_out_of_gpu_memory_raises_and_the_next_call_succeeds)."""
import cupy as cp
import numpy as np

import kbit_cupy as kc

pool = cp.get_default_memory_pool()
rng = np.random.default_rng(0)
W = cp.asarray(rng.standard_normal((1024, 4096)).astype(np.float16))
weight = kc.quantize_weight(W, 4).prepare()
A = cp.asarray(rng.standard_normal((64, 4096)).astype(np.float16))
packed, absmax, codebook = kc.quantize_kbit(W, k=4)
kc.kbit_gemm(A, weight)
kc.dequantize_kbit(packed, absmax, codebook, 4, W.shape, np.float32)
cp.cuda.Device().synchronize()
calls = {
    "quantize_kbit": lambda: kc.quantize_kbit(cp.concatenate([W] * 64), k=4),
    "dequantize": lambda: kc.dequantize_kbit(packed, absmax, codebook, 4, W.shape, np.float32),
    "quantize_weight": lambda: kc.quantize_weight(W, 4),
    "gemm": lambda: kc.kbit_gemm(A, weight),
    "big_gemm": lambda: kc.kbit_gemm(cp.concatenate([A] * 512), weight),
}
for name, call in calls.items():
    pool.free_all_blocks()
    print(name, "used", pool.used_bytes(), "total", pool.total_bytes(), flush=True)
    pool.set_limit(size=pool.used_bytes() + 1024)
    try:
        r = call()
        print(name, "DID NOT RAISE", type(r), getattr(r, "nbytes", None), "total", pool.total_bytes())
    except cp.cuda.memory.OutOfMemoryError:
        print(name, "raised")
    pool.set_limit(size=0)
