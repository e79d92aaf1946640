"""The mixture-of-experts kernels over a spread of cases, for compute-sanitizer.

usage: compute-sanitizer --tool memcheck python benchmarks/sanitize_moe.py [--wgmma [--wg-tiles N]]
       compute-sanitizer --tool racecheck python benchmarks/sanitize_moe.py --quick [--wgmma]
Runs kernels_src/moe_route.cu and the grouped launch of gemm_mma.cu (with
and without row indirection) on: every k, both scale formats and activation
dtypes, E = 1 .. 512, T = 1 .. 300, top_k 1 .. 10, experts without rows, one
expert with every row, N not a multiple of 16, unchecked offsets outside
[0, T] or falling, and unchecked ids outside [0, E) (validate=False: nothing
may be touched outside the arrays). Results are checked loosely (the GPU tests check
them exactly); the point is that the sanitizer sees every path.
"""

import argparse

import cupy as cp
import numpy as np

import kbit_cupy as kc
from kbit_cupy._arrays import BFLOAT16
from kbit_cupy.experts import route_pairs

parser = argparse.ArgumentParser()
parser.add_argument("--quick", action="store_true", help="fewer cases (racecheck is slow)")
parser.add_argument("--wgmma", action="store_true",
                    help="the grouped launch forced onto the Hopper path (sm_90)")
parser.add_argument("--wg-tiles", type=int, default=None,
                    help="with --wgmma: problems of 8 * N rows only (default: chosen per call)")
parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5], help="bit widths to run")
parser.add_argument("--define", default=None, metavar="NAME=VALUE[,module.ATTR=VALUE]",
                    help="the whole run with the kernels built with -DNAME=VALUE and kbit_cupy "
                         "module attributes set (define_ab.py's syntax)")
args = parser.parse_args()
if args.define:
    import define_ab  # (benchmarks/, this script's directory)

    define_ab.whole_run_with(args.define)
if args.wgmma:
    from kbit_cupy import _jit
    from kbit_cupy import experts as _experts

    _experts._GROUPED_WG = True
    if args.wg_tiles:
        _jit.GEMM_GROUPED_WG_M_TILES = (args.wg_tiles,)

rng = np.random.default_rng(0)
# (E, N, K_dim, T, top_k)
cases = [(1, 16, 32, 1, 1), (8, 100, 96, 33, 2), (64, 128, 256, 65, 8), (512, 32, 64, 40, 10),
         (4, 96, 512, 300, 2), (128, 48, 2048, 8, 8)]
if args.quick:
    cases = [cases[1], cases[2], cases[4]]
count = 0
for k in args.k:
    for fmt in ("e4m4", "fp16"):
        for dtype in (np.float16, BFLOAT16):
            for E, N, K_dim, T, top_k in cases:
                W = rng.standard_normal((E, N, K_dim)).astype(np.float32) * 0.05
                ex = kc.quantize_experts(cp.asarray(W), k, absmax_format=fmt)
                x = cp.asarray(rng.standard_normal((T, K_dim)).astype(np.float32)).astype(dtype)
                ids = cp.asarray(rng.integers(0, E, (T, top_k)))
                y = kc.moe_linear(x, ids, ex)
                assert bool(cp.isfinite(y.astype(cp.float32)).all())
                ids[0, 0], ids[-1, -1] = -3, E + 5  # unchecked bad ids: rows left unwritten
                kc.moe_linear(x, ids, ex, validate=False)
                sizes = rng.multinomial(T, np.ones(E) / E)
                if E > 1:  # the last expert has no rows
                    sizes[0] += sizes[-1]
                    sizes[-1] = 0
                offsets = cp.asarray(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
                C = kc.kbit_grouped_gemm(x, ex, offsets)
                assert bool(cp.isfinite(C.astype(cp.float32)).all())
                bad = offsets.copy()
                bad[0], bad[-1] = -7, T + 100  # unchecked offsets outside [0, T]
                kc.kbit_grouped_gemm(x, ex, bad, validate=False)
                zigzag = cp.asarray(np.resize(np.array([0, T], np.int32), E + 1))  # falling
                kc.kbit_grouped_gemm(x, ex, zigzag, validate=False)
                count += 5
            one = cp.asarray(np.array([0, 0, 300, 300], np.int32))  # one expert takes every row
            ex = kc.quantize_experts(cp.asarray(rng.standard_normal((3, 64, 128)).astype(np.float32)),
                                     k, absmax_format=fmt)
            x = cp.asarray(rng.standard_normal((300, 128)).astype(np.float32)).astype(dtype)
            kc.kbit_grouped_gemm(x, ex, one)
            count += 1
# the routing launch alone: the ids and the order staged in shared memory (past
# 48 KB at 8192 pairs) or, past what it holds, read and stored in memory; one warp
# (7000 experts); ids outside [0, E) among them
for E, pairs in ((128, 8192), (128, 70000 if not args.quick else 9000), (7000, 500), (2, 33)):
    ids = cp.asarray(rng.integers(-2, E + 2, pairs).astype(np.int32))
    offsets, order = route_pairs(ids, E)
    keep = cp.asnumpy((ids >= 0) & (ids < E))
    assert int(offsets[-1]) == int(keep.sum())
    count += 1
cp.cuda.Device().synchronize()
print(f"ran {count} cases")
