"""Is the dense mma launch's last CTA late by its work or by chance? (device only)

Per CTA of the stamped gemm_mma launch (mma_phases.py's -DKBIT_MMA_PHASES
build; cold L2: graph replays of (256 MB overwrite, call)): the time from the
launch's first entry (global timer) to the CTA's last segment multiplied
(stamp 3, warp 0) in each replay. Printed per (layer, k, M): the median and
slowest CTA, how alike the replays' orders of CTAs are (the mean Spearman
correlation of each replay's per-CTA times with the next replay's: near 1,
the same CTAs are late every time; near 0, chance), the median times of even
and odd CTAs (a pattern by launch order would show there), and the ten latest
CTAs with how often each was among the latest tenth.

    PYTHONPATH=.:benchmarks python benchmarks/cta_spread.py --layers 4096x28672 --k 4 --m 1
"""

from __future__ import annotations

import argparse
import functools
import os

import numpy as np
from latency_kernel import layer_weights
from latency_phases import stamps_view
from mma_phases import POINTS_ALLOCATED, stamped_gemm_mma


def ranks(x: np.ndarray) -> np.ndarray:
    out = np.empty(len(x))
    out[np.argsort(x, kind="stable")] = np.arange(len(x))
    return out


def main() -> int:
    import cupy as cp

    from kbit_cupy import kbit_gemm
    from kbit_cupy.bench import harness

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=["4096x28672"])
    p.add_argument("--k", nargs="+", type=int, default=[4])
    p.add_argument("--m", nargs="+", type=int, default=[1])
    p.add_argument("--replays", type=int, default=20)
    args = p.parse_args()
    info = harness.gpu_info()
    print(f"{info['gpu']}  commit {os.environ.get('KBIT_COMMIT', info.get('commit'))}  float16, "
          f"kernel auto, cold L2, {args.replays} replays; times in us from the launch's first entry "
          "to each CTA's last segment multiplied (warp 0)", flush=True)
    for layer in args.layers:
        K_dim, N, _, weights = layer_weights(layer, args.k)
        for k, w in weights.items():
            stream = harness._bench_stream()
            for M in args.m:
                A = cp.asarray(np.random.default_rng(1).standard_normal((M, K_dim)), cp.float16)
                out = cp.empty((M, N), cp.float16)
                cp.cuda.Device().synchronize()
                with stream:
                    with stamped_gemm_mma() as modules:
                        call = functools.partial(kbit_gemm, A, w, out=out, kernel="auto")
                        call()
                    stream.synchronize()
                    if not modules:
                        print(f"{layer} k={k} M={M}: no gemm_mma launch")
                        continue
                    view = stamps_view(modules[-1], 2048, 16, POINTS_ALLOCATED, "kbit_mma_phases")
                    flush = harness._flusher(harness.DEFAULT_FLUSH_BYTES)

                    def body(flush=flush, call=call):
                        flush()
                        call()

                    graph = harness._capture(stream, body)
                    samples = []
                    for r in range(args.replays + 2):
                        view.fill(0)
                        graph.launch(stream=stream)
                        stream.synchronize()
                        if r >= 2:
                            samples.append(cp.asnumpy(view[:, 0, :, 0]).astype(np.float64))
                    del graph
                used = samples[0][:, 0] > 0
                ctas = int(np.flatnonzero(used).max()) + 1
                done = np.array([(s[:ctas, 3] - s[:ctas, 0].min()) / 1e3 for s in samples])  # [replay, cta]
                med = np.median(done, axis=0)
                rho = np.mean([np.corrcoef(ranks(done[i]), ranks(done[i + 1]))[0, 1]
                               for i in range(len(done) - 1)])
                late = (done >= np.quantile(done, 0.9, axis=1, keepdims=True)).mean(axis=0)
                worst = np.argsort(med)[-10:][::-1]
                print(f"{layer} k={k} M={M}: {ctas} CTAs; per replay median CTA "
                      f"{np.median(np.median(done, axis=1)):.2f}, slowest {np.median(done.max(axis=1)):.2f}; "
                      f"replay-to-replay rank correlation {rho:.2f}; even CTAs {np.median(med[0::2]):.2f}, "
                      f"odd {np.median(med[1::2]):.2f}")
                print("   latest CTAs (median us, share of replays in the latest tenth): "
                      + ", ".join(f"{c}: {med[c]:.2f} ({late[c]:.2f})" for c in worst))
                hist = np.histogram(med, bins=8)
                print("   per-CTA medians histogram: "
                      + ", ".join(f"{lo:.1f}+: {n}" for lo, n in zip(hist[1], hist[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
