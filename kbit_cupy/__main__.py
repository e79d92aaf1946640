"""Command line: ``python -m kbit_cupy COMMAND`` (``--help`` lists them).

Every error is one line on stderr (``python -m kbit_cupy CMD: error: ...``)
and a non-zero exit: 2 for bad arguments, 1 for a failed command, 130 / 143
when interrupted / terminated. ``KBIT_CUPY_TRACEBACK=1`` shows the traceback
of an unexpected error instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import types

import numpy as np

from ._cli import int_in

PROG = "python -m kbit_cupy"
DEMO_MAX_SIDE = 1 << 16  # rows or columns
DEMO_MAX_ELEMENTS = 1 << 28  # 512 MiB of fp16 (the NumPy path needs several times that)


def _sqnr_db(x: np.ndarray, y: np.ndarray) -> float:
    x = x.astype(np.float64)
    err = np.sum((x - y.astype(np.float64)) ** 2)
    return float("inf") if err == 0 else float(10 * np.log10(np.sum(x * x) / err))


def cmd_demo(args) -> int:
    """Quantize a random weight matrix at k = 2..5: bits/element, SQNR, throughput."""
    from . import dequantize_kbit, quantize_kbit
    from ._arrays import gpu_available

    rng = np.random.default_rng(0)
    rows, cols = args.rows, args.cols
    W = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)
    on_gpu = gpu_available() and not args.cpu
    if on_gpu:
        import cupy as cp

        from .bench.harness import gpu_info

        info = gpu_info()
        print(f"GPU: {info.get('gpu')} ({info.get('cc')}), CuPy {cp.__version__}")
        W_in = cp.asarray(W)
    else:
        print("No GPU found (or --cpu): running the NumPy path; kernel throughput is not measured.")
        W_in = W
    print(f"weight {rows} x {cols} float16, blocks of 32, E4M4 scales")
    print(f"{'k':>2} {'bits/elem':>9} {'SQNR dB':>8} {'quantize':>14} {'dequantize':>14}")
    for k in (2, 3, 4, 5):
        t0 = time.perf_counter()
        packed, absmax, cb = quantize_kbit(W_in, k=k)
        y = dequantize_kbit(packed, absmax, cb, k, W.shape, dtype=np.float16)
        if on_gpu:
            import cupy as cp

            cp.cuda.Device().synchronize()
            q_rate, d_rate = _gpu_rates(W_in, packed, absmax, cb, k, y)
            y = cp.asnumpy(y)
            rates = (f"{q_rate / 1e9:9.0f} GB/s", f"{d_rate / 1e9:9.0f} GB/s")
        else:
            elapsed = time.perf_counter() - t0
            rates = (f"{elapsed:8.2f} s (q+dq)", "")
        bits = (packed.size * 32 + absmax.size * absmax.dtype.itemsize * 8) / W.size
        print(f"{k:>2} {bits:9.3f} {_sqnr_db(W.astype(np.float32), y):8.2f} {rates[0]:>14} {rates[1]:>14}")
    return 0


def _gpu_rates(W, packed, absmax, cb, k, y):
    """Bytes read + written per second for quantize and dequantize (events, median of 20)."""
    import cupy as cp

    from .quantize import _dequantize_cuda, _plan_for, _quantize_cuda

    plan = _plan_for(k, cp.asnumpy(cb).tobytes())
    host_cb = cp.asnumpy(cb)

    def median_time(fn):
        times = []
        for _ in range(20):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3)
        return float(np.median(times))

    out = y.reshape(-1)
    tq = median_time(lambda: _quantize_cuda(W, k, host_cb, plan, "e4m4"))
    td = median_time(lambda: _dequantize_cuda(packed, absmax, cb, k, W.size, out))
    moved = W.nbytes + packed.nbytes + absmax.nbytes
    return moved / tq, (packed.nbytes + absmax.nbytes + out.nbytes) / td


@contextlib.contextmanager
def _compile_bar(total: int):
    """A tqdm bar over the compile check's variants on stderr where it is a terminal."""
    if not sys.stderr.isatty():
        yield types.SimpleNamespace(update=lambda n=1: None)
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="variant", file=sys.stderr, dynamic_ncols=True) as bar:
        yield bar


def cmd_compile_check(args) -> int:
    """Compile every kernel variant offline (no GPU) and fail on errors or spills."""
    from . import _jit

    archs = args.arch or ["sm_80", "sm_90a"]
    total = sum(len(_jit.variants_for(a)) for a in archs)
    try:
        # a bar on stderr where it is a terminal (each variant is its own
        # NVRTC program, as at run time: a few minutes on two CPUs)
        with _compile_bar(total) as bar:
            results = _jit.compile_check(archs, jobs=args.jobs, on_result=lambda r: bar.update())
    except Exception as exc:  # noqa: BLE001 - NVRTC missing is a failed check
        print(f"{PROG} compile-check: error: could not run NVRTC ({_one_line(exc)}); install "
              "the test extra: pip install -e '.[test]'", file=sys.stderr)
        return 2
    print(f"{'kernel':<58} {'arch':<7} {'regs':>4} {'spill':>5} {'stack':>5} {'smem':>5}  status")
    failed = 0
    for r in results:
        status = "ok" if r.ok else ("SPILL" if r.spill_bytes > 0 else "ERROR")
        failed += not r.ok
        print(f"{r.variant.name:<58} {r.arch:<7} {r.registers:>4} {r.spill_bytes:>5} "
              f"{r.stack_bytes:>5} {r.smem_bytes:>5}  {status}")
    for r in results:
        if not r.ok and r.log:
            print(f"\n--- {r.variant.name} ({r.arch}) ---\n{r.log[-4000:]}", file=sys.stderr)
            break
    print(f"\n{len(results)} variants compiled, {failed} failed (errors or spills)")
    return 1 if failed else 0


def cmd_info(args) -> int:
    """GPU, driver, CuPy and NVRTC versions, kernel cache location and size, compiled variants."""
    from . import _jit
    from ._arrays import cupy_or_none, gpu_available

    cp = cupy_or_none()
    print(f"kbit_cupy sources: {_jit.kernels_dir()}")
    print(f"CuPy: {cp.__version__ if cp else 'not installed'}")
    try:
        from cupy_backends.cuda.libs import nvrtc

        print(f"NVRTC: {'.'.join(map(str, nvrtc.getVersion()))}")
    except Exception as exc:  # noqa: BLE001
        print(f"NVRTC: not found ({exc})")
    print(f"CUDA headers: {', '.join(_jit.cuda_include_dirs()) or 'not found'}")
    cache = _jit.cache_dir()
    files = list(cache.rglob("*")) if cache.is_dir() else []
    size = sum(f.stat().st_size for f in files if f.is_file())
    print(f"kernel cache: {cache} ({len(files)} files, {size / 1e6:.1f} MB)")
    print(f"kernel variants the package can launch: {len(_jit.all_variants())}")
    compiled = _jit.compiled_variants()
    by_group: dict[tuple[str, str], int] = {}
    for arch, name in compiled:
        family = name.split("<", 1)[0].removeprefix("kbit::kbit_")
        by_group[(arch, family)] = by_group.get((arch, family), 0) + 1
    summary = ", ".join(f"{fam} {n} ({arch})" for (arch, fam), n in sorted(by_group.items()))
    print(f"variants compiled into the cache: {len(compiled)}" + (f": {summary}" if summary else ""))
    if getattr(args, "verbose", False):
        for arch, name in compiled:
            print(f"  {arch}  {name}")
    if not gpu_available():
        print("GPU: none found (the NumPy path works; kernels need a CUDA GPU)")
        return 0
    from .bench.harness import gpu_info

    for key, value in gpu_info().items():
        print(f"{key}: {value}")
    return 0


# --------------------------------------------------------------------------
# arguments and errors


class _Parser(argparse.ArgumentParser):
    """argparse reporting a usage error in one line (exit code 2), not usage + error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(exc: BaseException) -> str:
    """The exception as one line: what went wrong, with the file for OS errors."""
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    else:
        text = str(exc) or type(exc).__name__
        if not isinstance(exc, (ValueError, TypeError, ImportError, RuntimeError)):
            text = f"{type(exc).__name__}: {text}"
    return " ".join(text.split())


class _Terminated(BaseException):
    """SIGTERM, raised where the program is so that files being written are cleaned up."""


def _on_sigterm(signum, frame):
    raise _Terminated


def _run(command: str, func, args) -> int:
    """``func(args)`` with every failure turned into one stderr line and an exit code."""
    try:
        return func(args)
    except KeyboardInterrupt:
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"{PROG} {command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as exc:
        if os.environ.get("KBIT_CUPY_TRACEBACK"):
            raise
        known = isinstance(exc, (ValueError, TypeError, OSError, ImportError))
        hint = "" if known else " (an unexpected error: KBIT_CUPY_TRACEBACK=1 shows where)"
        print(f"{PROG} {command}: error: {_one_line(exc)}{hint}", file=sys.stderr)
        return 1


def main(argv=None) -> int:
    parser = _Parser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = p = sub.add_parser("demo", help=cmd_demo.__doc__)
    p.add_argument("--rows", type=int_in(1, DEMO_MAX_SIDE), default=4096)
    p.add_argument("--cols", type=int_in(1, DEMO_MAX_SIDE), default=4096)
    p.add_argument("--cpu", action="store_true", help="force the NumPy path")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("compile-check", help=cmd_compile_check.__doc__)
    p.add_argument("--jobs", type=int_in(1, 256), default=None,
                   help="NVRTC compiles at once (default: the CPUs)")
    p.add_argument("--arch", action="append", help="sm_80, sm_90a, ... (repeatable)")
    p.set_defaults(func=cmd_compile_check)
    p = sub.add_parser("info", help=cmd_info.__doc__)
    p.add_argument("--verbose", "-v", action="store_true", help="list every compiled variant")
    p.set_defaults(func=cmd_info)
    from .convert import add_commands as add_convert_commands

    add_convert_commands(sub)
    from .bench.cli import add_commands as add_bench_commands

    add_bench_commands(sub)
    args = parser.parse_args(argv)
    if args.command == "demo" and args.rows * args.cols > DEMO_MAX_ELEMENTS:
        demo.error(f"--rows x --cols = {args.rows * args.cols} elements is more than the demo's "
                f"{DEMO_MAX_ELEMENTS}; pick smaller sizes")
    return _run(args.command, args.func, args)


if __name__ == "__main__":
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(main())
