"""Probe (device only): dequantize + cuBLAS in N-slabs small enough to stay in L2.

usage: python benchmarks/slab_probe.py [K_dim N M k ...]

The "dequant" kernel of kbit_gemm writes the whole fp16 weight (940 MB for
8192x57344) to DRAM before cuBLAS reads it back. Here the weight is
dequantized slab by slab (rows n0..n1 of W) into one reused scratch buffer and
each slab is multiplied at once (cuBLAS gemmEx writing columns n0..n1 of C
with ldc = N), so the scratch lines can be overwritten while still in L2.
Timed with the TARGETS.md method against cupy.matmul and the whole-weight
dequant path, in one process.
"""

import sys

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

import kbit_cupy as kc
from kbit_cupy.bench import harness as bench
from kbit_cupy.format import BLOCK
from kbit_cupy.quantize import _dequantize_cuda

_R16F, _R16BF, _COMPUTE_32F = 2, 14, 68


def gemm_slab(A, w_slab, C, n0):
    """C[:, n0:n0+Ns] = A @ w_slab.T (row-major, fp32 accumulate)."""
    M, K = A.shape
    Ns = w_slab.shape[0]
    N = C.shape[1]
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    t = _R16F if A.dtype == cp.float16 else _R16BF
    cublas.gemmEx(handle, 1, 0, Ns, M, K, one.ctypes.data, w_slab.data.ptr, t, K,
                  A.data.ptr, t, K, zero.ctypes.data, C.data.ptr + n0 * C.itemsize, t, N,
                  _COMPUTE_32F, -1)


def run_case(K_dim, N, M, k):
    rng = cp.random.default_rng(0)
    W = (rng.standard_normal((N, K_dim), dtype=cp.float32) * 0.02).astype(cp.float16)
    w = kc.quantize_weight(W, k=k)
    del W
    A = rng.standard_normal((M, K_dim), dtype=cp.float32).astype(cp.float16)
    C = cp.empty((M, N), cp.float16)
    words_per_block = k  # packed: k uint32 words per 32-element block
    ops = {"cublas": bench.cublas_fp16_matmul_op(M, N, K_dim)[0],
           "dequant": lambda: kc.kbit_gemm(A, w, out=C, kernel="dequant")}
    for rows in (1024, 2048, 4096, 8192):
        if rows >= N:
            continue
        scratch = cp.empty((rows, K_dim), cp.float16)

        def slabbed(rows=rows, scratch=scratch):
            for n0 in range(0, N, rows):
                n1 = min(N, n0 + rows)
                b0, b1 = n0 * K_dim // BLOCK, n1 * K_dim // BLOCK
                ws = scratch[: n1 - n0]
                _dequantize_cuda(w.packed[b0 * words_per_block: b1 * words_per_block],
                                 w.absmax[b0:b1], w.codebook, k, ws.size, ws.reshape(-1))
                gemm_slab(A, ws, C, n0)

        ops[f"slab{rows}"] = slabbed
        ref = kc.kbit_gemm(A, w, kernel="dequant")
        slabbed()
        assert cp.array_equal(ref, C), f"slab {rows} differs"
        # cuBLAS alone on one slab shape (how efficient the small GEMM is)
        ws_full = cp.asarray(rng.standard_normal((rows, K_dim), dtype=cp.float32)
                             .astype(cp.float16))
        ops[f"gemm_only{rows}x{N // rows}"] = (
            lambda ws=ws_full, rows=rows: [gemm_slab(A, ws, C, n0)
                                           for n0 in range(0, N - rows + 1, rows)])
    res = bench.time_ops(ops, reps=15)
    base = res["cublas"]["median_us"]
    for name, r in res.items():
        print(f"{K_dim}x{N} M={M} k={k} {name:>18}: {r['median_us']:8.1f} us "
              f"{base / r['median_us']:.3f}x", flush=True)


def main():
    cases = [int(v) for v in sys.argv[1:]] or [8192, 57344, 1024, 4, 4096, 28672, 1024, 4,
                                                 8192, 57344, 256, 4, 8192, 57344, 128, 4]
    for i in range(0, len(cases), 4):
        run_case(*cases[i: i + 4])


if __name__ == "__main__":
    main()
