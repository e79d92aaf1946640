"""A/B of kbit_gemm built with compile-time defines, in one process (device only).

usage: python benchmarks/define_ab.py --define KBIT_L2_PREFETCH=1 [--define ...]
       (or --define gemm._LATENCY_SPLIT=2: a module attribute of kbit_cupy, set while
       the variant's launch plans are made)
       [--layers 4096x28672 ...] [--m 1 16] [--k 4] [--kernel auto [mma ...]] [--dtype float16]

Each variant is the package's own kernels compiled with extra ``-D`` options
(kernels_src read them, for instance mma_common.cuh's KBIT_WEIGHT_L2_HINT),
with its own weight object whose launch plans are made with those kernels on
the harness stream. Kernel-only timing (harness.time_graph: a CUDA graph of
(256 MB overwrite, op) pairs minus the overwrites), cuBLAS fp16 through its
capturable call in the same process; every variant's bits are compared with
the default build's.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib

import cupy as cp
import numpy as np

import kbit_cupy as kc
from kbit_cupy import _jit, _launch
from kbit_cupy._arrays import BFLOAT16
from kbit_cupy.bench import harness as bench


@contextlib.contextmanager
def kernels_built_with(options):
    """Inside: kbit_cupy compiles its kernels with the extra compiler ``options``
    (e.g. ``("-DKBIT_CROW_CHUNK=1",)``), from an empty kernel cache; on exit the
    options and the cache are restored. Plans made inside keep their kernels."""
    saved_opts, saved_cache = _jit.compile_options, dict(_jit._kernels)
    _jit._kernels.clear()
    _jit.compile_options = lambda: (*saved_opts(), *options)
    try:
        yield
    finally:
        _jit.compile_options = saved_opts
        _jit._kernels.clear()
        _jit._kernels.update(saved_cache)


@contextlib.contextmanager
def module_attributes(values: dict, clear: bool = True):
    """Inside: each ``module.ATTR`` of ``values`` (a module of kbit_cupy, e.g.
    ``gemm._LATENCY_HALF_TILES``) set to its value as an int; restored on exit.
    ``clear``: empty the modules' functools caches on entry and exit (off
    where the plans were made under the same values and must stay)."""
    saved = []
    if clear:
        _clear_caches(values)
    try:
        for name, value in values.items():
            mod_name, attr = name.rsplit(".", 1)
            mod = importlib.import_module(f"kbit_cupy.{mod_name}")
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, float(value) if "." in value else int(value))
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)
        if clear:
            _clear_caches(values)


_HELD = contextlib.ExitStack()  # whole_run_with's settings, held until the process exits
# (closed by atexit, while the modules it restores still exist: left to the
# interpreter's teardown, its exit raised ImportError after every sanitizer run)
atexit.register(_HELD.close)


def whole_run_with(spec: str) -> None:
    """For a script's whole run (the sanitizer scripts' ``--define``): kernels
    built with the ``-DNAME=VALUE`` and kbit_cupy module attributes set for the
    ``module.ATTR=VALUE`` of ``spec`` (comma-separated, this script's syntax)."""
    defines = dict(kv.split("=") for kv in spec.split(","))
    _HELD.enter_context(module_attributes({n: v for n, v in defines.items() if "." in n}))
    _HELD.enter_context(kernels_built_with([f"-D{n}={v}" for n, v in defines.items() if "." not in n]))
    print(f"kernels built with {spec}", flush=True)


def _clear_caches(values: dict) -> None:
    """Empties the functools caches of the modules named in ``values``: a cached
    function (gemm._work_split) may read the attribute without taking it as an
    argument, and would otherwise answer with what the other variant made."""
    for name in values:
        mod = importlib.import_module(f"kbit_cupy.{name.rsplit('.', 1)[0]}")
        for obj in vars(mod).values():
            if callable(getattr(obj, "cache_clear", None)):
                obj.cache_clear()


def kbit_variant(W, k: int, defines: dict, As, kernels=("auto",)):
    """A prepared weight whose kernels are compiled with ``-DNAME=VALUE`` for
    each of ``defines``; its launch plans for each A in ``As`` are made here,
    on the harness stream (plans are per stream), with those kernels. A name
    with a dot, ``module.ATTR`` (a module of kbit_cupy), is instead set as
    that module's attribute (an int) while the plans are made, then restored."""
    attrs = {n: v for n, v in defines.items() if "." in n}
    options = [f"-D{n}={v}" for n, v in defines.items() if "." not in n]
    with module_attributes(attrs), kernels_built_with(options):
        w = kc.quantize_weight(W, k=k).prepare()
        cp.cuda.Device().synchronize()
        with bench._bench_stream():
            for A in As:
                for kernel in kernels:
                    kc.kbit_gemm(A, w, kernel=kernel)
        cp.cuda.Device().synchronize()
        return w


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                   help="one variant per option (several defines of one variant: comma-separated)")
    p.add_argument("--layers", nargs="+", default=["4096x28672", "14336x4096", "8192x57344"])
    p.add_argument("--m", nargs="+", type=int, default=[1, 16])
    p.add_argument("--k", nargs="+", type=int, default=[4])
    p.add_argument("--kernel", nargs="+", default=["auto"],
                   help="one line per kernel; every kernel's bits compared with the default build's")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    variants = {"default": {}}
    for spec in args.define:
        variants[spec] = dict(kv.split("=") for kv in spec.split(","))
    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]
    info = bench.gpu_info()
    print(f"{info['gpu']}  commit {info.get('commit')}  kernel {' '.join(args.kernel)}  {args.dtype}",
          flush=True)
    for layer in args.layers:
        K_dim, N = (int(v) for v in layer.lower().split("x"))
        rng = cp.random.default_rng(0)
        W = (rng.standard_normal((N, K_dim), dtype=cp.float32) * np.float32(0.02)).astype(cp.float16)
        As = {m: rng.standard_normal((m, K_dim), dtype=cp.float32).astype(dtype) for m in args.m}
        for k in args.k:
            ws = {name: kbit_variant(W, k, d, As.values(), args.kernel) for name, d in variants.items()}
            for m, A in As.items():
                A16, c16 = A.astype(cp.float16), cp.empty((m, N), cp.float16)

                def cublas(A16=A16, c16=c16, m=m, N=N, K_dim=K_dim, W=W):
                    _launch.cublas_gemm(m, N, K_dim, "float16", A16.data.ptr, W.data.ptr, c16.data.ptr,
                                        cp.cuda.get_current_stream().ptr)
                t_c = bench.time_graph(cublas, reps=args.reps)["median_us"]
                for kernel in args.kernel:
                    head = f" {kernel}" if len(args.kernel) > 1 else ""
                    line, ref = f"{layer:>11s} M={m:<3d} k={k}{head} cuBLAS {t_c:8.2f}", None
                    t0 = None
                    for name, w in ws.items():
                        out = cp.empty((m, N), dtype)
                        op = lambda A=A, w=w, out=out, kernel=kernel: kc.kbit_gemm(A, w, out=out, kernel=kernel)
                        t = bench.time_graph(op, reps=args.reps)["median_us"]
                        with bench._bench_stream():
                            got = op().copy()
                        cp.cuda.Device().synchronize()
                        same = ""
                        if ref is None:
                            ref, t0 = got, t
                        elif not bool((got.view(cp.uint16) == ref.view(cp.uint16)).all()):
                            same = " DIFFERENT bits"
                        line += f"  {name} {t:8.2f} ({t_c / t:4.2f}x, {t0 / t:5.3f}){same}"
                    print(line, flush=True)
            del ws
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
