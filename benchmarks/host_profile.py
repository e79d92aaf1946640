"""Where the host time of the public GPU calls goes: cProfile of N calls and
timings of the CuPy primitives they use (run on a GPU machine)."""
import cProfile
import io
import pstats
import sys
import time

import cupy as cp
import numpy as np

import kbit_cupy as kc
from kbit_cupy import _launch


def per_call_us(fn, n=3000):
    fn()
    cp.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter_ns()
    for i in range(n):
        fn()
        if i % 200 == 199:
            cp.cuda.get_current_stream().synchronize()
    return (time.perf_counter_ns() - t0) / n / 1e3


def main():
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        W = cp.asarray(np.random.standard_normal((768, 2048)).astype(np.float16))
        w = kc.quantize_weight(W, k=4)
        A = cp.ones((1, 2048), cp.float16)
        C = cp.empty((1, 768), cp.float16)
        x = cp.ones(1, cp.float16)
        d = {((1, 2048), A.dtype, "auto", 5): 1}
        prims = {
            "cp.empty((1,768))": lambda: cp.empty((1, 768), cp.float16),
            "cp.cuda.alloc(1536)": lambda: cp.cuda.alloc(1536),
            "get_current_stream().ptr": lambda: cp.cuda.get_current_stream().ptr,
            "runtime.getDevice()": lambda: cp.cuda.runtime.getDevice(),
            "A.strides": lambda: A.strides,
            "A.data.ptr": lambda: A.data.ptr,
            "A.shape,A.dtype dict get": lambda: d.get((A.shape, A.dtype, "auto", 5)),
            "is_capturing()": lambda: _launch.is_capturing(),
            "x + x (elementwise)": lambda: x + x,
            "kbit_gemm out=": lambda: kc.kbit_gemm(A, w, out=C),
            "kbit_gemm": lambda: kc.kbit_gemm(A, w),
        }
        for name, fn in prims.items():
            print(f"{name:<28} {per_call_us(fn):7.2f} us", flush=True)
        calls = {
            "kbit_gemm": lambda: kc.kbit_gemm(A, w),
            "dequantize_kbit": lambda: kc.dequantize_kbit(w.packed, w.absmax, w.codebook, 4, w.shape),
            "quantize_kbit": lambda: kc.quantize_kbit(W, k=4, validate=False),
        }
        for name, fn in calls.items():
            fn()
            pr = cProfile.Profile()
            pr.enable()
            for i in range(2000):
                fn()
                if i % 200 == 199:
                    s.synchronize()
            pr.disable()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(14)
            print("=====", name)
            print("\n".join(out.getvalue().splitlines()[6:24]))


if __name__ == "__main__":
    sys.exit(main())
