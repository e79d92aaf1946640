"""Derive kbit_gemm's kernel="auto" table from a committed bench-gemm sweep.

usage: python benchmarks/derive_dispatch.py benchmarks/results/gemm_sweep_*.json
For every (layer, k, dtype) prints the largest M at which the mma kernel beat
dequantize + cuBLAS, then checks kbit_cupy.gemm.choose_kernel against every
measured point and reports the slowdown of each wrong choice.
"""

import json
import sys

from kbit_cupy.gemm import choose_kernel

worst = 1.0
for path in sys.argv[1:]:
    with open(path) as f:
        data = json.load(f)
    times = {}
    for r in data["records"]:
        times[(r["K_dim"], r["N"], r["M"], r["k"], r["dtype"], r["kernel"])] = r["time_us"]
    points = sorted({key[:5] for key in times if key[5] in ("mma", "dequant")})
    layers = sorted({(p[0], p[1], p[3], p[4]) for p in points})
    for K_dim, N, k, dtype in layers:
        ms = sorted(p[2] for p in points if p[:2] == (K_dim, N) and p[3:] == (k, dtype))
        wins = [M for M in ms if times[(K_dim, N, M, k, dtype, "mma")] < times[(K_dim, N, M, k, dtype, "dequant")]]
        print(f"{dtype:<9} {K_dim:>5}x{N:<6} k={k}: mma wins up to M={max(wins) if wins else 0}")
    for K_dim, N, M, k, dtype in points:
        t = {kern: times[(K_dim, N, M, k, dtype, kern)] for kern in ("mma", "dequant")}
        chosen = choose_kernel(M, N, K_dim, k, dtype)
        loss = t[chosen] / min(t.values())
        worst = max(worst, loss)
        if loss > 1.0:
            print(f"  auto picks {chosen:<7} at {K_dim}x{N} M={M} k={k} {dtype}: {loss:.2f}x the best")
print(f"worst auto choice: {worst:.2f}x the best measured kernel")
