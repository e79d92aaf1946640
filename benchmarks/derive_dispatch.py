"""Derive kbit_gemm's kernel="auto" table from a committed bench-gemm sweep.

usage: python benchmarks/derive_dispatch.py benchmarks/results/gemm_sweep_*.json
For every (layer, k, dtype) prints the fastest kernel at each M, for a GPU
without the wgmma kernel (mma against dequantize + cuBLAS) and, where the
sweep has wgmma records, for an sm_90 GPU (all three); then checks
kbit_cupy.gemm.choose_kernel against every measured point and reports the
slowdown of each wrong choice, for the sweep's GPU's peak memory bandwidth
(its meta's ``peak_TB_s``; sweeps from before it was recorded: the H100's
3.35 TB/s, 4.8 where the GPU is an H200).
"""

import json
import sys

from kbit_cupy.gemm import choose_kernel

# worst pick per (sm_90?, layer with >= 2^24 weights?): the classes the CPU
# test (tests/test_gemm.py) bounds separately
worst = {(wg, big): 1.0 for wg in (False, True) for big in (False, True)}
for path in sys.argv[1:]:
    with open(path) as f:
        data = json.load(f)
    meta = data.get("meta", {})
    tbps = meta.get("peak_TB_s") or (4.8 if "H200" in str(meta.get("gpu", "")) else 3.35)
    times = {}
    for r in data["records"]:
        times[(r["K_dim"], r["N"], r["M"], r["k"], r["dtype"], r["kernel"])] = r["time_us"]
    points = sorted({key[:5] for key in times if key[5] == "mma"})
    layers = sorted({(p[0], p[1], p[3], p[4]) for p in points})
    has_wg = any(key[5] == "wgmma" for key in times)
    for wg in (False, True) if has_wg else (False,):
        kernels = tuple(kern for kern in (("mma", "wgmma", "dequant") if wg else ("mma", "dequant"))
                        if any(key[5] == kern for key in times))  # those the sweep timed
        print(f"== {'sm_90 (mma, wgmma, dequant)' if wg else 'other GPUs (mma, dequant)'}")
        for K_dim, N, k, dtype in layers:
            ms = sorted(p[2] for p in points if p[:2] == (K_dim, N) and p[3:] == (k, dtype))
            best = []
            for M in ms:
                t = {kern: times[(K_dim, N, M, k, dtype, kern)] for kern in kernels}
                best.append(f"{M}:{min(t, key=t.get)[0]}")
            print(f"{dtype:<9} {K_dim:>5}x{N:<6} k={k}: " + " ".join(best))
        for K_dim, N, M, k, dtype in points:
            t = {kern: times[(K_dim, N, M, k, dtype, kern)] for kern in kernels}
            chosen = choose_kernel(M, N, K_dim, k, dtype, wgmma=wg, tbps=tbps)
            if chosen in ("latency", "cluster"):  # not in a bench-gemm sweep: checked by their
                continue  # own runs (tests/test_gemm.py)
            loss = t[chosen] / min(t.values())
            key = (wg, N * K_dim >= 1 << 24)
            worst[key] = max(worst[key], loss)
            if loss > 1.05:
                print(f"  auto picks {chosen:<7} at {K_dim}x{N} M={M} k={k} {dtype}: {loss:.2f}x the best")
for (wg, big), w in worst.items():
    print(f"worst auto choice ({'sm_90' if wg else 'other GPUs'}, "
          f"{'>=' if big else '<'} 2^24 weights): {w:.2f}x the best measured kernel")
