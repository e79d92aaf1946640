"""One config's kbit_grouped_gemm launch, run a few times for a profiler
(device only): ``ncu --kernel-name regex:kbit_gemm_mma --launch-skip 2
--launch-count 1 python benchmarks/profile_moe.py mixtral_8x7b_w13 512 20``.

The inputs are moe_mtiles_ab.py's (seed 0, a uniform top-k router, rows
grouped by expert); the optional third argument forces the Hopper path's
n8 tiles per problem (``_jit.GEMM_GROUPED_WG_M_TILES``). With
``--moe-linear`` (anywhere) the launch is moe_linear's instead, on
moe_gap_probe.py's seeded router ids (its in-launch routing included).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_mtiles_ab import random_experts, uniform_routed_rows
from moe_vs_grouped_mm import CONFIGS


def main() -> int:
    import cupy as cp

    from kbit_cupy import _jit, kbit_grouped_gemm

    argv = [a for a in sys.argv[1:] if a != "--moe-linear"]
    routed = "--moe-linear" in sys.argv[1:]
    name, T = argv[0], int(argv[1])
    if len(argv) > 2:
        _jit.GEMM_GROUPED_WG_M_TILES = (int(argv[2]),)
    E, top_k, N, K_dim, _ = CONFIGS[name]
    experts = random_experts(E, N, K_dim)
    if routed:
        from moe_gap_probe import _routed

        from kbit_cupy import moe_linear

        ids, x, _, _ = _routed(T, E, top_k, K_dim, np.random.default_rng(0))
        for _ in range(4):
            moe_linear(x, ids, experts, validate=False)
    else:
        offsets, A = uniform_routed_rows(np.random.default_rng(0), E, top_k, K_dim, T, cp.float16)
        for _ in range(4):
            kbit_grouped_gemm(A, experts, offsets, validate=False)
    cp.cuda.Device().synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
