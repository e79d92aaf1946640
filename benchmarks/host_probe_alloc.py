"""Host time of a pool allocation plus an ndarray (what a call that returns a
new array pays) against the calls that pay it, medians of back-to-back calls
(perf_counter_ns per call, synchronising every 200 calls, like bench-decode's
host table). Run on a GPU machine: PYTHONPATH=. python benchmarks/host_probe_alloc.py"""
import statistics
import time

import cupy as cp
import numpy as np

import kbit_cupy as kc


def median_us(fn, n=10_000):
    fn()
    cp.cuda.get_current_stream().synchronize()
    samples = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
        if i % 200 == 199:
            cp.cuda.get_current_stream().synchronize()
    return statistics.median(samples) / 1e3


def layer(N, K):
    W = cp.asarray(np.random.default_rng(0).standard_normal((N, K)).astype(np.float16))
    w = kc.quantize_weight(W, k=4)
    del W
    n = N * K

    def fresh():
        return cp.ndarray((n,), cp.float16, cp.cuda.alloc(2 * n))

    def dequant():
        return kc.dequantize_kbit(w.packed, w.absmax, w.codebook, 4, n)

    out = cp.empty(n, cp.float16)

    def dequant_out():
        return kc.dequantize_kbit(w.packed, w.absmax, w.codebook, 4, n, out=out)

    A = cp.ones((1, K), cp.float16)

    def gemm():
        return kc.kbit_gemm(A, w)

    print(f"{N}x{K}: alloc+ndarray {median_us(fresh):6.2f} us", flush=True)
    for name, fn in (("dequantize_kbit", dequant), ("dequantize_kbit(out=)", dequant_out),
                     ("kbit_gemm M=1", gemm)):
        for rep in range(2):
            print(f"{N}x{K}: {name} {median_us(fn):6.2f} us (run {rep})", flush=True)


def main():
    for N, K in ((2048, 768), (28672, 4096)):
        layer(N, K)


if __name__ == "__main__":
    main()
