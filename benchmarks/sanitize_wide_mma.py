"""The 8-warp mma launch (gemm._mma_warps) for compute-sanitizer (device only).

usage: compute-sanitizer --tool racecheck python benchmarks/sanitize_wide_mma.py [--quick] [--k5] [--ring]
       [--define=NAME=VALUE[,NAME=VALUE]] (define_ab.py's syntax; benchmarks on PYTHONPATH)
The 8-warp launch at M <= 8: k = 4 (with its ring of A's stages at 1..4
rows, gemm._mma_ring; k = 2's ring where gemm._K2_RING_MAX_M asks), and k =
2 where _jit.GEMM_K2_QUAD_TABLE (K_dim >= 8192, also with two row tiles a
warp); the 16-warp k = 5 launch (gemm._K5_TABLE) at M <= 16 (with the ring
variant's 8 stages where its knob asks); the Hopper path's four-warpgroup
launch at 6..16 rows. E4M4, large-layer shapes (one short group, several),
both work splits, fp16 and bf16; each result checked finite (poisoned
output). k = 3's 8-warp launch (from 3 rows where K_dim >= 8192) too.

racecheck and the rings (--ring, and k = 5's launches where a CTA has more K
tiles than stages): racecheck (2025.3) reports every refill of a stage as a
WAR hazard against the reads before it, though the readers' mbarrier
arrivals order them; it reports the same of a two-warp ring that is correct
by the PTX memory model (benchmarks/racecheck_mbarrier_probe.py). Without
--ring (--quick: 5 rows and more) no stage is refilled and racecheck checks
the rest of each launch.
"""

import math
import sys

import cupy as cp
import numpy as np

import kbit_cupy as kc
from kbit_cupy import _jit, gemm
from kbit_cupy._arrays import BFLOAT16

for spec in (a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--define=")):
    from define_ab import whole_run_with

    whole_run_with(spec)
rng = np.random.default_rng(0)
count = 0
wide_n = 32 * cp.cuda.Device().attributes["MultiProcessorCount"] + 80  # k = 2: two row tiles a warp
cases = [(k, M, N, K_dim) for k in ((2, 3, 4) if _jit.GEMM_K2_QUAD_TABLE else (3, 4))
         for M, N, K_dim in [(1, 40, 8192), (3, 1040, 8448), (8, 16400, 256), (6, 16400, 256),
                             (7, 1040, 8448), (4, wide_n, 8192)]
         if gemm._mma_warps(k, np.uint8, M, 1, N, K_dim) == 8]
# k = 4's ring variant (gemm._mma_ring: 1..4 rows, enough K tiles a CTA, a
# GPU of 4 TB/s or more: taken as that here, as for k = 5 below)
gemm._device_tbps = lambda: 4.8
cases += [(4, M, 16400, 8192) for M in (1, 2, 4)
          if gemm._mma_warps(4, np.uint8, M, 1, 16400, 8192) == 8
          and gemm._mma_ring(4, np.uint8, M, 8, 1, math.ceil(16400 / 16 / 8) * (8192 // 256))
          == _jit.GEMM_MMA_RING_STAGES]
# ... and k = 2's where gemm._K2_RING_MAX_M asks (off by default): two row
# tiles a warp on 16400 x 8192, one on 4112 x 16384
cases += [(2, M, N, K_dim) for M in (1, 2) for N, K_dim, rpw in [(16400, 8192, 2), (4112, 16384, 1)]
          if _jit.GEMM_K2_QUAD_TABLE
          and gemm._mma_ring(2, np.uint8, M, 8, rpw, math.ceil(N / 16 / 8 / rpw) * (K_dim // 256))]
RING_LAYERS = {(16400, 8192), (4112, 16384)}
# k = 5: 16 warps and the 128 KB pair table at one and two n8 tiles (one: a
# GPU of 4 TB/s or more)
cases += [(5, M, N, K_dim) for M, N, K_dim in [(1, 40, 8192), (8, 1040, 8448), (9, 16400, 256),
                                               (13, 16400, 256), (16, 40, 16384)]
          if gemm._mma_warps(5, np.uint8, M, 1, N, K_dim) == 16]
# ... and its ring variant's 8 stages where gemm._K5_RING_MAX_M asks (off by default:
# --define=gemm._K5_RING_MAX_M=8; 1..8 rows, enough K tiles a CTA)
cases += [(5, M, 16400, 8192) for M in (1, 8)
          if gemm._mma_warps(5, np.uint8, M, 1, 16400, 8192) == 16
          and gemm._mma_ring(5, np.uint8, M, 16, 1, math.ceil(16400 / 16 / 16) * (8192 // 256))
          == _jit.GEMM_MMA_RING_STAGES]
k5_only = "--k5" in sys.argv[1:]  # the 16-warp k = 5 launch alone (its ring of A's stages)
# the launches with a ring: k = 5's, k = 4's at 1..4 rows (k = 2's where its knob asks)
ring_only = "--ring" in sys.argv[1:]
# --quick (racecheck: the whole run passes 280 s): 5 rows and more (with
# --ring also the rings at 1..4 rows), split K, fp16
quick = "--quick" in sys.argv[1:]
if quick:
    cases = [c for c in cases
             if (c[1] >= 5 and c[2:] not in RING_LAYERS) or (ring_only and c[2:] in RING_LAYERS)]
if k5_only:
    cases = [c for c in cases if c[0] == 5]
if ring_only:
    cases = [c for c in cases if c[0] == 5 or c[2:] in RING_LAYERS]
for slack in (10**6,) if quick else (10**6, -10**6):  # split K, stream-K
    gemm._STREAM_K_SLACK = slack
    for k, M, N, K_dim in cases:
        w = kc.quantize_weight(rng.standard_normal((N, K_dim)).astype(np.float32), k=k).to_device()
        for dtype in (np.float16,) if quick else (np.float16, BFLOAT16):
            A = cp.asarray(rng.standard_normal((M, K_dim)).astype(np.float32)).astype(dtype)
            out = cp.full((M, N), np.nan, dtype)
            C = kc.kbit_gemm(A, w, out=out, kernel="mma")
            assert bool(cp.isfinite(C.astype(cp.float32)).all())
            count += 1
# The Hopper path's four-warpgroup launch at 5..16 rows (its first four warps
# copy A: gemm_mma.cu's KBIT_A_COPY_WARPS); not with --k5
for k, M in [] if k5_only or ring_only else [(4, 6), (2, 12), (4, 16)]:
    w = kc.quantize_weight(rng.standard_normal((wide_n, 8192)).astype(np.float32), k=k).to_device()
    for dtype in (np.float16,) if quick else (np.float16, BFLOAT16):
        A = cp.asarray(rng.standard_normal((M, 8192)).astype(np.float32)).astype(dtype)
        out = cp.full((M, wide_n), np.nan, dtype)
        C = kc.kbit_gemm(A, w, out=out, kernel="wgmma")
        assert bool(cp.isfinite(C.astype(cp.float32)).all())
        count += 1
cp.cuda.Device().synchronize()
assert {k for k, *_ in cases} >= ({5} if k5_only else {4, 5} if ring_only else {2, 4} if _jit.GEMM_K2_QUAD_TABLE else {4}), cases
print(f"ran {count} cases")
