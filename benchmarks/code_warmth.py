"""Does the kernel's code, fetched cold after the L2 overwrite, set its time? (device only)

    PYTHONPATH=. python benchmarks/code_warmth.py [--layers 2048x768 768x2048 ...]
        [--k 2 3 4 5] [--m 1 4] [--kernel latency] [--out FILE]

The TARGETS.md method overwrites 256 MB before every op, which evicts the
kernel's instructions from L2 with everything else: every SM then fetches the
kernel's code from DRAM while it runs. For each (layer, k, M) this times, in
one process and kernel-only (harness.time_graph):

- ``cold``: the op after the overwrite (the method);
- ``same``: the op after the overwrite and one call of the *same kernel
  variant* on other weights, activations and output of the same shape (so the
  code is in L2 and perhaps in the SMs' instruction caches, the op's data is
  not), minus that warm-up call alone;
- ``other``: the same with a warm-up call of *another* variant (another k,
  same kernel family and shape): the control, which has the same preceding
  launch (and programmatic dependent launch overlap) but other code.

``other - same`` is what cold code costs the op. Nothing else differs: the
op's weight, activations and output are not touched by either warm-up call.
"""

from __future__ import annotations

import argparse
import os

import cupy as cp
import numpy as np

from kbit_cupy import kbit_gemm, quantize_weight
from kbit_cupy.bench import harness


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=["2048x768", "768x2048", "2048x512", "4096x4096"])
    p.add_argument("--k", nargs="+", type=int, default=[2, 3, 4, 5])
    p.add_argument("--m", nargs="+", type=int, default=[1])
    p.add_argument("--kernel", default="latency")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    info = harness.gpu_info()
    commit = os.environ.get("KBIT_COMMIT", info.get("commit"))
    lines = [
        f"# code warmth: {info['gpu']}, commit {commit}, kernel={args.kernel}, fp16",
        "# us, kernel-only medians; other - same = what the cold code costs",
        f"{'layer':>10} {'M':>3} {'k':>2} {'cold':>8} {'other':>8} {'same':>8} {'other-same':>10}",
    ]
    print("\n".join(lines), flush=True)
    for layer in args.layers:
        K_dim, N = (int(v) for v in layer.lower().split("x"))
        rng = cp.random.default_rng(0)
        Ws = [
            (rng.standard_normal((N, K_dim), dtype=cp.float32) * np.float32(0.02)).astype(
                cp.float16
            )
            for _ in range(2)
        ]
        ks = sorted(set(args.k) | {2, 3})
        w = {(i, k): quantize_weight(Ws[i], k=k).prepare() for i in range(2) for k in ks}
        cp.cuda.Device().synchronize()  # prepare() ran on the default stream
        for M in args.m:
            A = [
                cp.random.default_rng(1 + i)
                .standard_normal((M, K_dim), dtype=cp.float32)
                .astype(cp.float16)
                for i in range(2)
            ]
            outs = [cp.empty((M, N), cp.float16) for _ in range(3)]

            def call(i, k, o, A=A, outs=outs, w=w):
                return lambda: kbit_gemm(A[i], w[(i, k)], out=outs[o], kernel=args.kernel)

            def both(first, then):
                return lambda: (first(), then())[1]

            for k in args.k:
                other = 3 if k == 2 else 2
                op, warm_same, warm_other = call(0, k, 0), call(1, k, 1), call(1, other, 2)
                t = {}
                for name, fn in (
                    ("cold", op),
                    ("same_w", warm_same),
                    ("other_w", warm_other),
                    ("same", both(warm_same, op)),
                    ("other", both(warm_other, op)),
                ):
                    st = harness.time_graph(fn, reps=args.reps)
                    t[name] = st["median_us"] if st else float("nan")
                same = t["same"] - t["same_w"]
                oth = t["other"] - t["other_w"]
                line = (
                    f"{layer:>10} {M:>3} {k:>2} {t['cold']:8.2f} {oth:8.2f} {same:8.2f} "
                    f"{oth - same:10.2f}"
                )
                print(line, flush=True)
                lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
