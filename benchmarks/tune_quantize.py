"""Quantize-kernel experiments: source variants timed side by side (device only).

Each variant edits the rendered source (slices per warp step, compute removed)
or the grid, and runs on the same 2**28 fp16 input with the TARGETS.md method.
Used to find what limits the kernel; see NOTES-format-kernels.md.
"""

import math

import cupy as cp
import numpy as np

from kbit_cupy import _jit
from kbit_cupy.bench import harness as bench
from kbit_cupy.format import create_normal_float_codebook, make_index_plan
from kbit_cupy.quantize import _resident_ctas, _sm_count

K = 2
N = 1 << 28
x = cp.random.default_rng(0).standard_normal(N, dtype=cp.float32).astype(cp.float16)
plan = make_index_plan(create_normal_float_codebook(K))
table = cp.asarray(plan.table)
codebook = cp.asarray(plan.codebook)
packed = cp.empty(N // 32 * K, cp.uint32)
absmax = cp.empty(N // 32, cp.uint8)
flags = cp.zeros(1, cp.int32)
name = _jit.kernel_name("quantize", K, "float16", "uint8", False)
base = _jit.render_source("quantize")


def variant(vecs: int, no_compute: bool):
    src = base.replace("constexpr int kVecs = 4;", f"constexpr int kVecs = {vecs};")
    if no_compute:
        src = src.replace("idx = select_fast(divide_rn(v[e], scale[u], inv_scale[u])",
                          "idx = (__float_as_uint(v[e]) >> 13) & 3u; (void)(0.0f")
    mod = cp.RawModule(code=src, options=_jit.compile_options(), name_expressions=[name])
    return mod.get_function(name)


ops = {}
for vecs in (2, 4, 8):
    for no_compute in (False, True):
        kern = variant(vecs, no_compute)
        per_sm = _resident_ctas(kern, 256, 8 * plan.bins)
        for mult in (1, 2):
            grid = min(_sm_count() * per_sm * mult, math.ceil(N / (256 * vecs * 8)))
            label = f"vecs={vecs} {'memonly' if no_compute else 'full'} regs={kern.num_regs} grid={grid}"

            def op(kern=kern, grid=grid):
                kern((grid,), (256,), (x, np.int64(N), table, np.int32(plan.bins),
                                       np.float32(plan.bin_scale),
                                       np.float32(12582912.0 + plan.bins // 2), codebook,
                                       packed, absmax, flags), shared_mem=8 * plan.bins)
            ops[label] = op
res = bench.time_ops(ops, reps=10)
for label, r in res.items():
    us = r["median_us"]
    print(f"{label:50s} {us:7.1f} us  {N * (2 + K / 8 + 1 / 32) / us / 1e3:6.0f} GB/s")
