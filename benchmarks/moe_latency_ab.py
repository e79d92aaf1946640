"""moe_linear with few pairs: the latency kernel (one CTA per (pair, row
tile), no grouping) against the grouped launch, kernel-only (CUDA graphs,
cold L2), k=4 fp16, and the relative difference of their results.

Usage (GPU): PYTHONPATH=. python benchmarks/moe_latency_ab.py
"""

from __future__ import annotations

import numpy as np

CONFIGS = ((128, 1536, 2048, 8, (1, 2, 4, 8)), (128, 2048, 768, 8, (1, 2, 4)),
           (512, 512, 2048, 10, (1, 2, 3)))  # (E, N, K_dim, top_k, T values)


def _forced(fn, max_ctas):
    """fn() with experts._LATENCY_MOE_MAX_CTAS set to max_ctas during the call
    (plans are per stream: the timing stream's is made at its first call)."""
    from kbit_cupy import experts as ex

    def op():
        saved = ex._LATENCY_MOE_MAX_CTAS
        ex._LATENCY_MOE_MAX_CTAS = max_ctas
        try:
            return fn()
        finally:
            ex._LATENCY_MOE_MAX_CTAS = saved
    return op


def _case(E, N, K_dim, top_k, T, a, b, rng):
    import cupy as cp

    from kbit_cupy import moe_linear
    from kbit_cupy.bench import harness

    ids = cp.asarray(np.stack([rng.choice(E, top_k, replace=False) for _ in range(T)])
                     .astype(np.int32))
    x = cp.asarray(rng.standard_normal((T, K_dim)).astype(np.float16))
    o1, o2 = (cp.empty((T, top_k, N), cp.float16) for _ in range(2))
    grouped = _forced(lambda: moe_linear(x, ids, a, out=o1, validate=False), 0)
    latency = _forced(lambda: moe_linear(x, ids, b, out=o2, validate=False), 10**9)
    r1, r2 = grouped().astype(cp.float32), latency().astype(cp.float32)
    err = float(cp.linalg.norm(r1 - r2) / cp.linalg.norm(r1))
    t1 = harness.time_graph(grouped, reps=20)["median_us"]
    t2 = harness.time_graph(latency, reps=20)["median_us"]
    print(f"E={E} [{N},{K_dim}] top-{top_k} T={T} pairs={T * top_k}: grouped {t1:7.2f} us  "
          f"latency {t2:7.2f} us  ({t1 / t2:4.2f}x)  difference {err:.1e}", flush=True)


def main() -> int:
    import cupy as cp

    from kbit_cupy import quantize_experts
    from kbit_cupy.bench import harness

    rng = np.random.default_rng(0)
    print(harness.gpu_info()["gpu"])
    for E, N, K_dim, top_k, Ts in CONFIGS:
        W = cp.asarray((rng.standard_normal((E, N, K_dim)) * 0.02).astype(np.float16))
        a, b = (quantize_experts(W, k=4).prepare() for _ in range(2))  # own plans each
        del W
        cp.cuda.Device().synchronize()
        for T in Ts:
            _case(E, N, K_dim, top_k, T, a, b, rng)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
