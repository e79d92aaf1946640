"""The benchmark and figure commands of ``python -m kbit_cupy``.

``bench`` (alias ``bench-gemm``), ``bench-moe``, ``bench-format``,
``bench-decode`` (GPU only) and ``plot`` (no GPU needed). ``add_commands``
adds them to the entry point's subparsers; errors are reported by the entry
point (one line each).
"""

from __future__ import annotations

import argparse
import sys

from .._cli import MAX_REPS, MAX_ROWS, int_in

MAX_ELEMENTS = 1 << 34  # bench-format: more than any GPU holds in fp32 (the run says so)


def _needs_gpu(command: str, extra: str = "") -> bool:
    """True if a GPU is there; otherwise say so on stderr and return False."""
    from .._arrays import gpu_available

    if gpu_available():
        return True
    print(f"{command} needs a CUDA GPU; none found{extra}.", file=sys.stderr)
    return False


def cmd_bench_format(args) -> int:
    """Quantize/dequantize kernel bandwidth vs the measured copy bandwidth."""
    if not _needs_gpu("bench-format"):
        return 1
    from .format import run

    return run(args)


def cmd_bench_gemm(args) -> int:
    """kbit_gemm vs cuBLAS fp16 over layers, M, k and kernels."""
    if not _needs_gpu("bench", " (python -m kbit_cupy plot draws committed results without one)"):
        return 1
    if args.plot and not args.out:
        print("--plot needs --out PREFIX (the PNGs are written next to the JSON)", file=sys.stderr)
        return 2
    from .gemm import run

    return run(args)


def cmd_bench_moe(args) -> int:
    """kbit_grouped_gemm / moe_linear vs cuBLAS fp16 on mixture-of-experts layers."""
    if not _needs_gpu("bench-moe"):
        return 1
    from .moe import run

    return run(args)


def cmd_bench_decode(args) -> int:
    """A Llama-3-8B-shaped decode step (224 linear calls) eager and as one graph, fp16 vs k-bit, and host cost per call."""
    if not _needs_gpu("bench-decode"):
        return 1
    from .decode import run

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


def _layer_shape(text: str) -> str:
    """An argparse ``type`` for ``K_dimxN`` (kept as text; ``gemm.run`` parses it)."""
    from .gemm import parse_shape

    try:
        sizes = parse_shape(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K_dimxN, e.g. 4096x6144") from None
    if not all(1 <= size <= MAX_ROWS for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be 1 to {MAX_ROWS}")
    return text


def add_commands(sub) -> None:
    """Add bench-format, bench / bench-gemm, bench-moe, bench-decode and plot to ``sub``
    (an ``ArgumentParser.add_subparsers`` result); each sets ``func``."""
    from ..gemm import KERNELS
    from .gemm import DEFAULT_M, DEFAULT_SHAPES
    from .moe import CONFIGS, DEFAULT_T

    p = sub.add_parser("bench-format", help=cmd_bench_format.__doc__)
    p.add_argument("--elements", type=int_in(1, MAX_ELEMENTS), default=1 << 28)
    p.add_argument("--reps", type=int_in(1, MAX_REPS), default=30)
    p.add_argument("--out", default=None, help="path prefix for .json and .md results")
    p.set_defaults(func=cmd_bench_format)
    for name in ("bench", "bench-gemm"):
        p = sub.add_parser(name, help=cmd_bench_gemm.__doc__)
        p.add_argument("--shapes", nargs="+", type=_layer_shape, default=DEFAULT_SHAPES,
                       help="layers as K_dimxN")
        p.add_argument("--m", nargs="+", type=int_in(1, MAX_ROWS), default=DEFAULT_M)
        p.add_argument("--k", nargs="+", type=int, default=[2, 3, 4, 5], choices=[2, 3, 4, 5])
        p.add_argument("--kernels", nargs="+", default=["auto"], choices=list(KERNELS))
        p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
        p.add_argument("--reps", type=int_in(1, MAX_REPS), default=20)
        p.add_argument("--bf16-baseline", action="store_true",
                       help="also time cuBLAS bf16 (recorded as kernel cublas_bf16)")
        p.add_argument("--out", default=None, help="path prefix for .json and .md results")
        p.add_argument("--plot", action="store_true",
                       help="also write PREFIX_speedup.png and PREFIX_roofline.png (needs --out, matplotlib)")
        p.set_defaults(func=cmd_bench_gemm)
    p = sub.add_parser("bench-moe", help=cmd_bench_moe.__doc__)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--t", nargs="+", type=int_in(1, MAX_ROWS), default=DEFAULT_T,
                   help="tokens per call")
    p.add_argument("--k", nargs="+", type=int, default=[4], choices=[2, 3, 4, 5])
    p.add_argument("--reps", type=int_in(1, MAX_REPS), default=20)
    p.add_argument("--out", default=None, help="path prefix for .json and .md results")
    p.set_defaults(func=cmd_bench_moe)
    p = sub.add_parser("bench-decode", help=cmd_bench_decode.__doc__)
    p.add_argument("--bits", nargs="+", default=["fp16", "4", "3", "2"],
                   choices=["fp16", "2", "3", "4", "5"])
    p.add_argument("--m", nargs="+", type=int_in(1, 4096), default=[1, 4, 16, 64])
    p.add_argument("--calls", type=int_in(100, 1_000_000), default=10_000,
                   help="back-to-back calls per host-cost figure")
    p.add_argument("--no-host-cost", action="store_true", help="skip the host-cost table")
    p.add_argument("--no-step", action="store_true", help="skip the decode step")
    p.add_argument("--out", default=None, help="path prefix for .json and .md results")
    p.set_defaults(func=cmd_bench_decode)
    p = sub.add_parser("plot", help=cmd_plot.__doc__)
    p.add_argument("results", nargs="+", help="JSON files written by bench --out")
    p.add_argument("--out-dir", default=".", help="where the PNGs go")
    p.set_defaults(func=cmd_plot)
