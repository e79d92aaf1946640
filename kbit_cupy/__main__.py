"""Command line: ``python -m kbit_cupy COMMAND`` (``--help`` lists them).

Every error is one line on stderr (``python -m kbit_cupy CMD: error: ...``)
and a non-zero exit: 2 for bad arguments, 1 for a failed command, 130 / 143
when interrupted / terminated. ``KBIT_CUPY_TRACEBACK=1`` shows the traceback
of an unexpected error instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

PROG = "python -m kbit_cupy"
DEMO_MAX_SIDE = 1 << 16  # rows or columns
DEMO_MAX_ELEMENTS = 1 << 28  # 512 MiB of fp16 (the NumPy path needs several times that)
MAX_REPS = 100_000
MAX_ROWS = 1 << 24  # M of bench / T of bench-moe
MAX_ELEMENTS = 1 << 34  # bench-format: more than any GPU holds in fp32 (the run says so)


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

        from .bench import gpu_info

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


def cmd_compile_check(args) -> int:
    """Compile every kernel variant offline (no GPU) and fail on errors or spills."""
    from . import _jit

    archs = args.arch or ["sm_80", "sm_90a"]
    try:
        results = _jit.compile_check(archs)
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
    from .bench import gpu_info

    for key, value in gpu_info().items():
        print(f"{key}: {value}")
    return 0


def cmd_bench_format(args) -> int:
    """Quantize/dequantize kernel bandwidth vs the measured copy bandwidth."""
    from ._arrays import gpu_available

    if not gpu_available():
        print("bench-format needs a CUDA GPU; none found.", file=sys.stderr)
        return 1
    from .bench_format import run

    return run(args)


def cmd_bench_gemm(args) -> int:
    """kbit_gemm vs cuBLAS fp16 over layers, M, k and kernels."""
    from ._arrays import gpu_available

    if not gpu_available():
        print("bench needs a CUDA GPU; none found (python -m kbit_cupy plot draws committed "
              "results without one).", file=sys.stderr)
        return 1
    if args.plot and not args.out:
        print("--plot needs --out PREFIX (the PNGs are written next to the JSON)", file=sys.stderr)
        return 2
    from .bench_gemm import run

    return run(args)


def cmd_bench_moe(args) -> int:
    """kbit_grouped_gemm / moe_linear vs cuBLAS fp16 on mixture-of-experts layers."""
    from ._arrays import gpu_available

    if not gpu_available():
        print("bench-moe needs a CUDA GPU; none found.", file=sys.stderr)
        return 1
    from .bench_moe import run

    return run(args)


def cmd_bench_decode(args) -> int:
    """A Llama-3-8B-shaped decode step (224 linear calls) eager and as one graph, fp16 vs k-bit, and host cost per call."""
    from ._arrays import gpu_available

    if not gpu_available():
        print("bench-decode needs a CUDA GPU; none found.", file=sys.stderr)
        return 1
    from .bench_decode import run

    bits = ["fp16" if b == "fp16" else int(b) for b in args.bits]
    run(args.out, bits, args.m, host=not args.no_host_cost, step=not args.no_step,
        calls=args.calls)
    return 0


def cmd_plot(args) -> int:
    """Speedup and roofline PNGs from bench results (no GPU needed)."""
    from .plots import plot_results

    for path in plot_results(args.results, args.out_dir):
        print(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------
# arguments and errors


class _Parser(argparse.ArgumentParser):
    """argparse reporting a usage error in one line (exit code 2), not usage + error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_in(low: int, high: int):
    """An argparse ``type`` accepting integers from ``low`` to ``high``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range; give {low} to {high}")
        return value
    return parse


def _layer_shape(text: str) -> str:
    """An argparse ``type`` for ``K_dimxN`` (kept as text; bench_gemm parses it)."""
    from .bench_gemm import parse_shape

    try:
        sizes = parse_shape(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K_dimxN, e.g. 4096x6144") from None
    if not all(1 <= size <= MAX_ROWS for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be 1 to {MAX_ROWS}")
    return text


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
    p.add_argument("--rows", type=_int_in(1, DEMO_MAX_SIDE), default=4096)
    p.add_argument("--cols", type=_int_in(1, DEMO_MAX_SIDE), default=4096)
    p.add_argument("--cpu", action="store_true", help="force the NumPy path")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("compile-check", help=cmd_compile_check.__doc__)
    p.add_argument("--arch", action="append", help="sm_80, sm_90a, ... (repeatable)")
    p.set_defaults(func=cmd_compile_check)
    p = sub.add_parser("info", help=cmd_info.__doc__)
    p.add_argument("--verbose", "-v", action="store_true", help="list every compiled variant")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("bench-format", help=cmd_bench_format.__doc__)
    p.add_argument("--elements", type=_int_in(1, MAX_ELEMENTS), default=1 << 28)
    p.add_argument("--reps", type=_int_in(1, MAX_REPS), default=30)
    p.add_argument("--out", default=None, help="path prefix for .json and .md results")
    p.set_defaults(func=cmd_bench_format)
    from .bench_gemm import DEFAULT_M, DEFAULT_SHAPES
    from .gemm import KERNELS

    for name in ("bench", "bench-gemm"):
        p = sub.add_parser(name, help=cmd_bench_gemm.__doc__)
        p.add_argument("--shapes", nargs="+", type=_layer_shape, default=DEFAULT_SHAPES,
                       help="layers as K_dimxN")
        p.add_argument("--m", nargs="+", type=_int_in(1, MAX_ROWS), default=DEFAULT_M)
        p.add_argument("--k", nargs="+", type=int, default=[2, 3, 4, 5], choices=[2, 3, 4, 5])
        p.add_argument("--kernels", nargs="+", default=["auto"], choices=list(KERNELS))
        p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
        p.add_argument("--reps", type=_int_in(1, MAX_REPS), default=20)
        p.add_argument("--bf16-baseline", action="store_true",
                       help="also time cuBLAS bf16 (recorded as kernel cublas_bf16)")
        p.add_argument("--out", default=None, help="path prefix for .json and .md results")
        p.add_argument("--plot", action="store_true",
                       help="also write PREFIX_speedup.png and PREFIX_roofline.png (needs --out, matplotlib)")
        p.set_defaults(func=cmd_bench_gemm)
    from .bench_moe import CONFIGS, DEFAULT_T

    p = sub.add_parser("bench-moe", help=cmd_bench_moe.__doc__)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--t", nargs="+", type=_int_in(1, MAX_ROWS), default=DEFAULT_T,
                   help="tokens per call")
    p.add_argument("--k", nargs="+", type=int, default=[4], choices=[2, 3, 4, 5])
    p.add_argument("--reps", type=_int_in(1, MAX_REPS), default=20)
    p.add_argument("--out", default=None, help="path prefix for .json and .md results")
    p.set_defaults(func=cmd_bench_moe)
    p = sub.add_parser("bench-decode", help=cmd_bench_decode.__doc__)
    p.add_argument("--bits", nargs="+", default=["fp16", "4", "3", "2"],
                   choices=["fp16", "2", "3", "4", "5"])
    p.add_argument("--m", nargs="+", type=_int_in(1, 4096), default=[1, 4, 16, 64])
    p.add_argument("--calls", type=_int_in(100, 1_000_000), default=10_000,
                   help="back-to-back calls per host-cost figure")
    p.add_argument("--no-host-cost", action="store_true", help="skip the host-cost table")
    p.add_argument("--no-step", action="store_true", help="skip the decode step")
    p.add_argument("--out", default=None, help="path prefix for .json and .md results")
    p.set_defaults(func=cmd_bench_decode)
    p = sub.add_parser("plot", help=cmd_plot.__doc__)
    p.add_argument("results", nargs="+", help="JSON files written by bench --out")
    p.add_argument("--out-dir", default=".", help="where the PNGs go")
    p.set_defaults(func=cmd_plot)
    args = parser.parse_args(argv)
    if args.command == "demo" and args.rows * args.cols > DEMO_MAX_ELEMENTS:
        demo.error(f"--rows x --cols = {args.rows * args.cols} elements is more than the demo's "
                f"{DEMO_MAX_ELEMENTS}; pick smaller sizes")
    return _run(args.command, args.func, args)


if __name__ == "__main__":
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(main())
