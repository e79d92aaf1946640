"""Which latency-kernel timings of a committed run had another launch geometry.

    PYTHONPATH=. python benchmarks/occupancy_cache_replay.py \
        benchmarks/results/dispatch_audit3_h200_54d6caa_float16.json [...] [--tbps 4.8]

Until 8aae053, gemm.launch_ctas_per_sm cached its answer by (kernel, dynamic
shared bytes) without the threads. latency_geometry asks for one shared size
at several warp counts, and another layer's launch can ask for the same bytes
at other warps, so within one process a launch could take the CTAs-per-SM
count of an earlier query at other warps: too many warps (two waves) or too
few. This replays, offline, the latency kernel's occupancy queries of each
run in the order of its records (one process per run, as the benchmark
scripts run), once with the old cache and once with a fresh one per point,
and lists the points whose (warps a CTA, KSPLIT) differ, with the run's
latency time over the fastest other kernel it timed there. (Runs from
8aae053 on had the fixed cache: for them the list says what the old one
would have launched in the same order.)

Registers come from the offline compile check (sm_90a, NVRTC; no GPU), the
SM's limits are an H100's / H200's (the same: 132 SMs, 64 K registers, 2048
threads, 228 KB of shared memory). The geometry rules are today's, so for
runs of older kernels (other register counts, other rules) the list is an
estimate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_SM = {"MaxRegistersPerMultiprocessor": 65536, "MaxThreadsPerMultiProcessor": 2048,
       "MaxSharedMemoryPerMultiprocessor": 233472, "MaxSharedMemoryPerBlockOptin": 232448,
       "MultiProcessorCount": 132}


class _Kernel:
    """What latency_geometry reads of a RawKernel, from the compile check."""

    def __init__(self, registers: int, static_shared: int):
        self.num_regs, self.shared_size_bytes = registers, static_shared
        self.max_dynamic_shared_size_bytes = 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="committed JSON runs (records with K_dim, N, M, k, kernel, graph_us)")
    p.add_argument("--tbps", type=float, default=4.8, help="the GPU's peak bandwidth (rules keyed on it)")
    args = p.parse_args()

    from kbit_cupy import _jit, gemm, quantize

    quantize._attributes = gemm._attributes = lambda: _SM
    gemm._sm_count = lambda: _SM["MultiProcessorCount"]
    gemm._device_tbps = lambda: args.tbps

    variants = sorted({(k, dt, "uint8", mt, *ks) for k in (2, 3, 4, 5) for dt in ("float16", "bfloat16")
                       for mt in _jit.GEMM_LATENCY_M_TILES
                       for ks in ((), (False, False, 2)) if not ks or k in _jit.DENSE_LATENCY_KSPLIT_KS})
    print(f"compiling {len(variants)} gemm_latency variants for sm_90a (registers) ...", flush=True)
    results = _jit.compile_check(["sm_90a"], [_jit.Variant("gemm_latency", v) for v in variants])
    kernels = {r.variant.args: _Kernel(r.registers, r.smem_bytes) for r in results}

    cache: dict = {}
    keyed_on_threads = [False]

    def ctas_per_sm(kern, threads, shared):
        key = (kern, threads, shared) if keyed_on_threads[0] else (kern, shared)
        if key not in cache:
            cache[key] = quantize._resident_ctas(kern, threads, kern.shared_size_bytes + shared)
        return cache[key]

    gemm.launch_ctas_per_sm = ctas_per_sm

    def geometry(M, N, K_dim, k, dtype):
        rt, kt = gemm._tile_counts(N, K_dim)
        half = gemm._latency_half_tiles(rt)
        ctas = 2 * rt if half else rt
        m_tiles = next(t for t in _jit.GEMM_LATENCY_M_TILES if 8 * t >= M)
        args_ = (k, dtype, "uint8", m_tiles)
        warps, _ = gemm.latency_geometry(kernels[args_], M, kt, 2, m_tiles, ctas)
        ksplit = gemm._dense_latency_ksplit(k, "uint8", half, warps, ctas)
        if ksplit != 1:
            args_ += (False, False, ksplit)
            warps, _ = gemm.latency_geometry(kernels[args_], M, kt, 2, m_tiles, ctas, ksplit)
        return warps, ksplit

    for path in args.runs:
        records = json.loads(Path(path).read_text())["records"]
        times: dict[tuple, dict] = {}
        for r in records:
            key = (r["K_dim"], r["N"], r["M"], r["k"], r.get("dtype", "float16"))
            times.setdefault(key, {})[r["kernel"]] = r.get("graph_us")
        cache.clear()
        seen, lines = set(), []
        for r in records:
            key = (r["K_dim"], r["N"], r["M"], r["k"], r.get("dtype", "float16"))
            if r["kernel"] != "latency" or key in seen:
                continue
            seen.add(key)
            K_dim, N, M, k, dtype = key
            if M > 8 * max(_jit.GEMM_LATENCY_M_TILES):
                continue
            try:
                keyed_on_threads[0] = False
                in_run = geometry(M, N, K_dim, k, dtype)
                kept = dict(cache)
                cache.clear()
                keyed_on_threads[0] = True
                alone = geometry(M, N, K_dim, k, dtype)
                cache.clear()
                cache.update(kept)
            except ValueError:  # (the rows do not fit its shared memory)
                continue
            if in_run != alone:
                t = times[key]
                others = [v for kern, v in t.items() if kern not in ("auto", "latency") and v]
                ratio = t["latency"] / min(others) if others else float("nan")
                lines.append(f"  {K_dim}x{N} M={M} k={k} {dtype}: warps, KSPLIT {in_run} in the run, "
                             f"{alone} alone; latency / fastest other {ratio:.2f}")
        print(f"{Path(path).name}: {len(lines)} points with another geometry")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
