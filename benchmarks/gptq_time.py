"""Time ``gptq_quantize`` on a random layer: CuPy (GPU) and NumPy (CPU).

Usage:
    python benchmarks/gptq_time.py                 # GPU 4096x14336 and CPU 1024x4096
    python benchmarks/gptq_time.py --cpu-only      # no GPU needed
    python benchmarks/gptq_time.py --gpu-only --k 4 --shape 4096x14336

The weight ``W`` is ``[N, K_dim]`` fp16 N(0, 0.02); the Hessian is
``X^T X / T`` of ``T = 2 K_dim`` correlated Gaussian input rows (random SPD,
fixed seed), built on the device it is used on. Per configuration (plain
GPTQ, + scale search, + scale search + fitted codebook) one untimed warm-up
on a small layer compiles the kernels, then ``--repeat`` synchronised calls
are timed (the whole call: the inverse Hessian's Cholesky factor, the GPTQ
passes, the RTN guard): ``seconds`` is the fastest, ``first_seconds`` the
first. ``phases`` times the parts of a plain call once: the factorisation
(``_inverse_cholesky``) and one GPTQ pass (``_gptq_pass``). On the GPU,
``check`` first compares the CUDA block kernel with the NumPy block step bit
for bit (k = 2..5, 8 candidate scales, the refit's outputs; 0 mismatches
expected) and stops with exit status 1 if they differ. Prints one JSON line:
``{"gpu": {...seconds per config...}, "cpu": {...}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kbit_cupy import calibrate
from kbit_cupy.calibrate import gptq_quantize

CONFIGS = {
    "gptq": {},
    "gptq+scale_search": {"scale_search": True},
    "gptq+scale_search+fit_codebook": {"scale_search": True, "fit_codebook": True},
}


def _shape(text: str) -> tuple[int, int]:
    n, k = text.lower().split("x")
    return int(n), int(k)


def random_layer(xp, N: int, K_dim: int, seed: int = 0):
    """(W fp16 [N, K_dim], H float64 [K_dim, K_dim]) in ``xp``, deterministic."""
    if xp is np:
        generator = np.random.default_rng(seed)
        normal = lambda *shape: generator.standard_normal(shape, dtype=np.float32)
    else:
        state = xp.random.RandomState(seed)
        normal = lambda *shape: state.standard_normal(shape, dtype=np.float32)
    W = (normal(N, K_dim) * np.float32(0.02)).astype(np.float16)
    tokens = 2 * K_dim
    # correlated inputs with uneven channel scales, like a real layer's activations
    X = normal(tokens, K_dim) + normal(tokens, 64) @ (normal(K_dim, 64) / np.float32(8)).T
    X *= xp.exp(normal(K_dim) * np.float32(0.5))
    H = (X.T @ X).astype(xp.float64) / tokens
    return W, H


def time_configs(xp, N: int, K_dim: int, k: int, sync, repeat: int = 1) -> dict:
    warm_W, warm_H = random_layer(xp, 64, 256, seed=1)
    W, H = random_layer(xp, N, K_dim)
    sync()
    out = {"shape": [N, K_dim], "k": k, "phases": phases(xp, W, H, k, sync)}
    for name, options in CONFIGS.items():
        gptq_quantize(warm_W, k, hessian=warm_H, **options)
        sync()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            _, report = gptq_quantize(W, k, hessian=H, return_report=True, **options)
            sync()
            times.append(round(time.perf_counter() - start, 3))
        out[name] = {"seconds": min(times), "first_seconds": times[0],
                     "h_error_vs_rtn": round(report.error / report.rtn_error, 4),
                     "chosen": report.chosen}
    return out


def phases(xp, W, H, k: int, sync) -> dict:
    """Seconds of the factorisation and of one plain GPTQ pass (after a small warm-up)."""
    small = random_layer(xp, 64, 256, seed=2)
    W32 = xp.ascontiguousarray(W.astype(xp.float32))
    codebook = calibrate.create_normal_float_codebook(k)
    timings = {}
    for label, (weight, hessian) in (("warm-up", small), ("timed", (W32, H))):
        sync()
        start = time.perf_counter()
        U, _ = calibrate._inverse_cholesky(xp, hessian.astype(xp.float64), calibrate.DEFAULT_DAMP)
        sync()
        middle = time.perf_counter()
        calibrate._gptq_pass(xp, xp.ascontiguousarray(weight.astype(xp.float32)), U, codebook, k,
                             "e4m4", np.ones(1), 128, False)
        sync()
        if label == "timed":
            timings = {"inverse_cholesky_seconds": round(middle - start, 3),
                       "one_pass_seconds": round(time.perf_counter() - middle, 3)}
    return timings


def gpu_check() -> int:
    """Mismatching outputs of the CUDA block kernel against the NumPy block step."""
    return sum(calibrate._compare_device_blocks(192, 256, k, scale_search=8, seed=k)
               + calibrate._compare_device_blocks(64, 128, k, absmax_format="fp16", seed=k)
               for k in (2, 3, 4, 5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--shape", default="4096x14336", help="GPU layer N x K_dim")
    ap.add_argument("--cpu-shape", default="1024x4096", help="CPU layer N x K_dim")
    ap.add_argument("--repeat", type=int, default=None,
                    help="timed calls per configuration (default: 2 on the GPU, 1 on the CPU)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--cpu-only", action="store_true")
    group.add_argument("--gpu-only", action="store_true")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True, check=False).stdout.strip()
    result = {"commit": commit or "unknown"}
    if not args.cpu_only:
        import cupy as cp

        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        result["gpu_name"] = props["name"].decode()
        result["check_mismatches"] = gpu_check()
        if result["check_mismatches"]:
            print(json.dumps(result))
            sys.exit("the CUDA block kernel does not match the NumPy block step")
        result["gpu"] = time_configs(cp, *_shape(args.shape), args.k,
                                     cp.cuda.Device().synchronize, args.repeat or 2)
    if not args.gpu_only:
        result["cpu_name"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
        result["cpu"] = time_configs(np, *_shape(args.cpu_shape), args.k, lambda: None,
                                     args.repeat or 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
