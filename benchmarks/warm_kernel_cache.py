"""Compile kernel variants into CuPy's on-disk cache in parallel processes (device only).

    PYTHONPATH=. python benchmarks/warm_kernel_cache.py [--families gemm_mma gemm_latency ...] [-j 16]
        [--define KBIT_CB_FOLD=1]

A fresh device machine starts with an empty kernel cache, and the GPU test
files compile hundreds of variants one after another (NVRTC, a second or more
each): the GEMM and call-path tests took over 300 s on the H100 that way
(0f6f295). Each worker process compiles and loads its share through
``_jit.get_kernel``, which writes CuPy's cache; a later process (pytest) then
loads the cubins from the cache. ``--define NAME=VALUE`` (repeatable) builds
them with ``-DNAME=VALUE`` after the package's options, as define_ab.py's
kernels_built_with does, so that an A/B run of that knob finds them cached.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time


def _compile(variants, options=()) -> int:
    from kbit_cupy import _jit

    if options:
        saved = _jit.compile_options
        _jit.compile_options = lambda: (*saved(), *options)
    for family, args in variants:
        _jit.get_kernel(family, *args)
    return len(variants)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+",
                   default=["gemm_mma", "gemm_latency", "quantize", "dequantize", "moe_route"])
    p.add_argument("-j", "--jobs", type=int, default=16)
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                   help="build with -DNAME=VALUE too (repeatable)")
    args = p.parse_args()
    options = tuple(f"-D{d}" for d in args.define)

    import cupy as cp

    from kbit_cupy import _jit

    arch = "sm_90a" if cp.cuda.Device().compute_capability == "90" else "sm_80"
    todo = [(v.family, v.args) for v in _jit.variants_for(arch) if v.family in args.families]
    shares = [todo[i::args.jobs] for i in range(args.jobs)]
    start = time.perf_counter()
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        done = sum(pool.starmap(_compile, [(share, options) for share in shares]))
    print(f"compiled {done} variants in {time.perf_counter() - start:.0f} s ({args.jobs} processes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
