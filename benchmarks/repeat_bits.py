"""Whether kbit_gemm gives the same bits on every call (device only).

For each (layer, k, M, kernel): one weight, one A; ``--calls`` calls into
fresh outputs on the harness stream (non-blocking, as the benchmarks use it)
and on the default stream, each output poisoned (NaN) before the call. Prints
how many distinct results there were, the largest difference to the first
and whether any output still holds the poison.

    PYTHONPATH=.:benchmarks python benchmarks/repeat_bits.py --layers 2048x768 --m 64 128 256
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=["2048x768", "768x2048"])
    p.add_argument("--k", nargs="+", type=int, default=[4])
    p.add_argument("--m", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--kernels", nargs="+", default=["auto", "wgmma"])
    p.add_argument("--calls", type=int, default=8)
    args = p.parse_args()

    import cupy as cp

    from kbit_cupy import kbit_gemm, quantize_weight
    from kbit_cupy.bench import harness

    print(harness.gpu_info()["gpu"], flush=True)
    for layer in args.layers:
        K_dim, N = (int(v) for v in layer.lower().split("x"))
        W = (cp.random.default_rng(0).standard_normal((N, K_dim), dtype=cp.float32)
             * np.float32(0.02)).astype(cp.float16)
        for k in args.k:
            w = quantize_weight(W, k=k).prepare()
            cp.cuda.Device().synchronize()
            for M in args.m:
                A = cp.random.default_rng(1).standard_normal((M, K_dim), dtype=cp.float32).astype(
                    cp.float16)
                for kernel in args.kernels:
                    for name, stream in (("harness", harness._bench_stream()),
                                         ("default", cp.cuda.Stream.null)):
                        outs = []
                        with stream:
                            for _ in range(args.calls):
                                out = cp.full((M, N), np.nan, cp.float16)
                                kbit_gemm(A, w, out=out, kernel=kernel)
                                outs.append(out)
                            stream.synchronize()
                        first = outs[0]
                        distinct = len({cp.asnumpy(o).tobytes() for o in outs})
                        diff = max(float(cp.nanmax(cp.abs(o.astype(cp.float32) - first))) for o in outs)
                        poison = sum(int(cp.isnan(o).sum()) for o in outs)
                        print(f"{layer} k={k} M={M} {kernel:>6} {name:>7}: {distinct} distinct of "
                              f"{args.calls}, max diff {diff:.3g}, NaN left {poison}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
