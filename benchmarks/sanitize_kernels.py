"""Run every kernel family over a spread of shapes, for compute-sanitizer.

usage: compute-sanitizer --tool memcheck python benchmarks/sanitize_kernels.py [--stream-k | --large-m]
       compute-sanitizer --tool racecheck python benchmarks/sanitize_kernels.py --quick [--stream-k]
Checks results loosely (the GPU tests check them exactly); the point is that
the sanitizer sees every code path: odd M, N, K_dim, split K, both scale
formats, both activation dtypes, every k.
"""

import argparse

import cupy as cp
import numpy as np

import kbit_cupy as kc
from kbit_cupy import _launch
from kbit_cupy._arrays import BFLOAT16

parser = argparse.ArgumentParser()
parser.add_argument("--quick", action="store_true", help="fewer shapes (racecheck is slow)")
parser.add_argument("--no-cublas", action="store_true",
                    help="skip kernel='dequant' (cuBLAS kernels report their own racecheck hazards)")
parser.add_argument("--stream-k", action="store_true",
                    help="force the mma kernel's stream-K work split (CTAs ending two segments)")
parser.add_argument("--only", choices=["mma", "wgmma", "latency", "cluster"],
                    help="one fused kernel (and no cuBLAS)")
parser.add_argument("--k", type=int, nargs="+", default=None,
                    help="bit widths (default 2..5; with --large-m --quick: 4; racecheck of one "
                         "kernel: --k 4 to fit a run)")
parser.add_argument("--large-m", action="store_true",
                    help="wgmma launches of 129..256 rows and their M chunks only "
                         "(warp-specialised, tensor copies), both work splits")
parser.add_argument("--define", default=None, metavar="NAME=VALUE[,module.ATTR=VALUE]",
                    help="the whole run with the kernels built with -DNAME=VALUE and kbit_cupy "
                         "module attributes set (an A/B knob under the sanitizer; define_ab.py's "
                         "syntax, e.g. KBIT_LATENCY_KSPLIT=2,_jit.GEMM_LATENCY_KSPLIT=2)")
parser.add_argument("--lut", action="store_true",
                    help="gemm_lut.cu only (k = 2, one row of A, E4M4): odd shapes, and units "
                         "across row blocks (the SM count patched to 3)")
args = parser.parse_args()
args.no_cublas = args.no_cublas or bool(args.only)
if args.define:
    import define_ab  # (benchmarks/, this script's directory)

    define_ab.whole_run_with(args.define)
if args.stream_k:
    from kbit_cupy import gemm

    gemm._STREAM_K_SLACK = -10**6

rng = np.random.default_rng(0)
fused = ("mma", "wgmma", "latency") if kc.gemm.has_wgmma() else ("mma", "latency")  # this GPU runs
if _launch.cluster_launch_supported():  # gemm_latency.cu's cluster split (sm_90)
    fused += ("cluster",)
if args.only:
    fused = tuple(f for f in fused if f == args.only)
shapes = [(1, 1, 32), (3, 7, 96), (17, 129, 64), (33, 768, 2048), (65, 130, 288), (8, 4096, 512),
          (1, 768, 14336), (64, 17, 4096), (33, 8449, 256), (64, 1024, 4096), (128, 700, 1024),
          (200, 96, 64),
          (100, 770, 2048), (256, 520, 288),  # wgmma: M chunks (gemm._wg_m_chunks) in clusters
          (100, 2000, 768),  # 32-row chunks (three K tiles)
          (1, 2048, 768), (16, 2050, 1024)]  # the latency launch's half K tiles (few K tiles)
if args.quick:
    shapes = shapes[:2] + [(33, 768, 2048), (1, 768, 14336), (40, 8449, 96), (128, 700, 1024),
                           (256, 520, 288), (100, 2000, 768), (1, 2048, 768), (16, 2050, 1024)]
count = 0
if args.lut:
    from kbit_cupy import gemm

    for sms in (None, 3):
        if sms:
            gemm._sm_count = lambda: 3  # 6 CTAs: units of two row blocks, K ranges split
        for dtype in (np.float16, BFLOAT16):
            lut_shapes = [(1, 32), (17, 256), (1000, 4128), (2051, 96), (20000, 512), (4000, 4128)]
            for N, K_dim in [(17, 256), (4000, 4128)] if args.quick else lut_shapes:
                W = cp.asarray(rng.standard_normal((N, K_dim)).astype(np.float32))
                w = kc.quantize_weight(W, k=2)
                A = cp.asarray(rng.standard_normal((1, K_dim)).astype(np.float32)).astype(dtype)
                C = kc.kbit_gemm(A, w, kernel="lut")
                assert bool(cp.isfinite(C.astype(cp.float32)).all())
                count += 1
    cp.cuda.Device().synchronize()
    print(f"ran {count} cases")
    raise SystemExit(0)
if args.large_m:
    from kbit_cupy import gemm

    gemm._WG_M_CHUNKS = 0  # the 129..256-row launches themselves, not 64-row chunks
    for slack in (0.5, -10**6):  # the default choice, forced stream-K
        gemm._STREAM_K_SLACK = slack
        quick = args.quick  # racecheck: k=4, fp16, E4M4, two shapes
        large_m_shapes = [(193, 129, 64), (256, 768, 2048), (200, 8449, 96), (250, 1000, 2304),
                          # slab chunks (gemm._wg_slab_chunks): split K, 2 x 256, 2 x 192 (k = 5)
                          (512, 300, 1280), (480, 1000, 2304), (384, 520, 288)]
        for k in args.k or ((4,) if quick else (2, 3, 4, 5)):
            for fmt in ("e4m4",) if quick else ("e4m4", "fp16"):
                for dtype in (np.float16,) if quick else (np.float16, BFLOAT16):
                    for M, N, K_dim in large_m_shapes[1::2] if quick else large_m_shapes:
                        W = rng.standard_normal((N, K_dim)).astype(np.float32)
                        w = kc.quantize_weight(W, k=k, absmax_format=fmt).to_device()
                        A = cp.asarray(rng.standard_normal((M, K_dim)).astype(np.float32)).astype(dtype)
                        C = kc.kbit_gemm(A, w, kernel="wgmma")
                        assert bool(cp.isfinite(C.astype(cp.float32)).all())
                        count += 1
    cp.cuda.Device().synchronize()
    print(f"ran {count} cases")
    raise SystemExit(0)
if args.stream_k:  # the fused kernels only, on shapes whose CTAs cross group ends
    for k in (2, 3, 4, 5):
        for dtype in (np.float16, BFLOAT16):
            for M, N, K_dim in [(64, 512, 4608), (5, 1024, 2048), (1, 7, 96), (128, 1000, 2304)]:
                # quantized on the host: the sanitizer looks at the product
                W = rng.standard_normal((N, K_dim)).astype(np.float32)
                w = kc.quantize_weight(W, k=k).to_device()
                A = cp.asarray(rng.standard_normal((M, K_dim)).astype(np.float32)).astype(dtype)
                for kernel in fused:
                    C = kc.kbit_gemm(A, w, kernel=kernel)
                    assert bool(cp.isfinite(C.astype(cp.float32)).all())
                    count += 1
    print(f"ran {count} cases")
    raise SystemExit(0)
for k in args.k or (2, 3, 4, 5):
    for fmt in ("e4m4", "fp16"):
        for dtype in (np.float16, BFLOAT16):
            for M, N, K_dim in shapes:
                W = cp.asarray(rng.standard_normal((N, K_dim)).astype(np.float32)).astype(dtype)
                w = kc.quantize_weight(W, k=k, absmax_format=fmt)
                A = cp.asarray(rng.standard_normal((M, K_dim)).astype(np.float32)).astype(dtype)
                for kernel in fused if args.no_cublas else (*fused, "dequant"):
                    C = kc.kbit_gemm(A, w, kernel=kernel)
                    assert bool(cp.isfinite(C.astype(cp.float32)).all())
                    count += 1
            # the format kernels on odd sizes
            for n in (1, 31, 33, 1000, 4097):
                x = cp.asarray(rng.standard_normal(n).astype(np.float32)).astype(dtype)
                p, a, cb = kc.quantize_kbit(x, k=k, absmax_format=fmt)
                kc.dequantize_kbit(p, a, cb, k, n, dtype=dtype)
                count += 1
cp.cuda.Device().synchronize()
print(f"ran {count} cases")
