"""Whether an SM's read speed is a property of the SM (device only).

Issue 20's M = 1 launches end 3-5 us after their median CTA, and which CTAs
are late repeats from replay to replay (NOTES-gemm.md, "M = 1 on the large
layers"). If some SMs read slower than others every time, a kernel could
give each CTA a range by its SM (%smid) instead of its block index.

This launches a plain streaming read: ``--ctas-per-sm`` CTAs per SM, each
reading an equal contiguous share of a buffer of ``--mbytes`` MB (16-byte
loads, evict_first), after a 256 MB overwrite (cold L2, as TARGETS.md). Every
CTA records its SM and its start and end (%globaltimer). Over ``--runs``
launches it prints:
- the spread of the per-SM read time (median over runs of each SM's mean
  CTA time), fastest, median and slowest SM;
- the rank correlation of the per-SM times between the odd and even runs
  (near 1: the slow SMs are the same every time; near 0: chance);
- the same for the per-chunk times (a chunk: the bytes one CTA reads), the
  slowest chunk, and how often a chunk lands on the same SM as in run 0.
``--rotate`` moves chunk c to block (c - r) mod grid in run r (the bytes
apart from the block index); ``--grain-kb g`` makes a chunk g KB blocks
spread over the buffer (CTA c takes blocks c, c + grid, ...) instead of one
contiguous share.

    PYTHONPATH=. python benchmarks/sm_speed_probe.py --mbytes 66 --ctas-per-sm 1 2 --grain-kb 0 16
"""

from __future__ import annotations

import argparse

import numpy as np

_SRC = r"""
extern "C" __global__ void sm_read(const uint4* __restrict__ src, long long n16,
                                   unsigned long long* __restrict__ out,
                                   unsigned* __restrict__ sink, int rot, long long grain) {
  unsigned long long t0, t1;
  unsigned smid;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  // chunk c = (blockIdx + rot) mod grid; grain 0: chunk c is the c-th
  // contiguous share; grain g (16-byte units): blocks of g, chunk c taking
  // blocks c, c + grid, c + 2 grid, ... (n16 a multiple of grid * g)
  const int c = (int)((blockIdx.x + rot) % gridDim.x);
  const long long per = (n16 + gridDim.x - 1) / gridDim.x;
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  unsigned acc = 0u;
  const long long blocks = grain ? per / grain : 1;
  for (long long blk = 0; blk < blocks; ++blk) {
    const long long b = grain ? (blk * gridDim.x + c) * grain : (long long)c * per;
    const long long e = grain ? b + grain : min(n16, b + per);
    for (long long i = b + threadIdx.x; i < e; i += 4 * blockDim.x) {
      uint4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const long long k = i + j * blockDim.x;
        if (k < e) {
          asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                       : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                       : "l"(src + k), "l"(pol));
        } else {
          v[j] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
  }
  __syncthreads();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads
  if (threadIdx.x == 0) {
    out[3 * c] = smid;  // indexed by chunk
    out[3 * c + 1] = t0;
    out[3 * c + 2] = t1;
  }
}
"""


def _rank_corr(a: np.ndarray, b: np.ndarray) -> float:
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mbytes", type=int, default=64, help="bytes read per launch, MB")
    p.add_argument("--ctas-per-sm", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, default=512)
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--rotate", action="store_true",
                   help="run r gives chunk c to block (c - r) mod grid: separates the chunk "
                        "(the bytes) from the block index")
    p.add_argument("--grain-kb", type=int, nargs="+", default=[0],
                   help="0: each CTA one contiguous share; g: CTAs take g KB blocks in turn")
    args = p.parse_args()

    import cupy as cp

    from kbit_cupy.bench import harness

    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    kern = cp.RawKernel(_SRC, "sm_read", options=("-std=c++17",))
    n16 = args.mbytes * (1 << 20) // 16
    src = cp.arange(n16 * 4, dtype=cp.uint32)
    flush = harness._flusher(harness.DEFAULT_FLUSH_BYTES)  # TARGETS.md's 256 MB overwrite
    sink = cp.zeros(1, cp.uint32)
    print(f"{name}: {sms} SMs, {args.mbytes} MB a launch, {args.threads} threads a CTA, "
          f"{args.runs} runs after a 256 MB overwrite each")
    for per_sm, grain_kb in ((a, g) for a in args.ctas_per_sm for g in args.grain_kb):
        ctas = sms * per_sm
        grain = grain_kb * 1024 // 16
        if grain and (n16 % (ctas * grain)):
            print(f"skip: {args.mbytes} MB is not a multiple of {ctas} x {grain_kb} KB")
            continue
        out = cp.zeros(3 * ctas, cp.uint64)
        sm_of = np.zeros((args.runs, ctas), np.int64)
        dur = np.zeros((args.runs, ctas))
        span = np.zeros(args.runs)
        for r in range(args.runs):
            flush()
            rot = r % ctas if args.rotate else 0
            kern((ctas,), (args.threads,), (src, cp.int64(n16), out, sink, np.int32(rot),
                                             np.int64(grain)))
            got = cp.asnumpy(out).reshape(ctas, 3).astype(np.int64)
            sm_of[r] = got[:, 0]
            dur[r] = (got[:, 2] - got[:, 1]) / 1e3
            span[r] = (got[:, 2].max() - got[:, 1].min()) / 1e3
        # per SM: the mean time of its CTAs in each run
        per_sm_t = np.full((args.runs, sms), np.nan)
        for r in range(args.runs):
            for s in range(sms):
                sel = sm_of[r] == s
                if sel.any():
                    per_sm_t[r, s] = dur[r, sel].mean()
        med = np.nanmedian(per_sm_t, axis=0)
        ok = ~np.isnan(med)
        odd, even = np.nanmean(per_sm_t[1::2], axis=0), np.nanmean(per_sm_t[0::2], axis=0)
        both = ok & ~np.isnan(odd) & ~np.isnan(even)
        same_sm = float((sm_of == sm_of[0]).mean())
        chunk_corr = _rank_corr(dur[1::2].mean(axis=0), dur[0::2].mean(axis=0))
        print(f"{per_sm} CTA(s) an SM ({ctas} CTAs), grain {grain_kb or 'contiguous'} KB"
              f"{', rotated' if args.rotate else ''}: span median {np.median(span):.2f} us, "
              f"CTA time median {np.median(dur):.2f} us")
        print(f"  per SM: fastest {np.min(med[ok]):.2f}, median {np.median(med[ok]):.2f}, "
              f"slowest {np.max(med[ok]):.2f} us ({np.max(med[ok]) / np.median(med[ok]):.3f}x median); "
              f"odd/even rank correlation {_rank_corr(odd[both], even[both]):.2f}")
        print(f"  per chunk: odd/even rank correlation {chunk_corr:.2f}; slowest chunk "
              f"{dur.mean(axis=0).max():.2f} us, median {np.median(dur.mean(axis=0)):.2f}; a chunk on the "
              f"same SM as in run 0: {same_sm:.2f} of the time")
        order = np.argsort(med)
        print("  slowest SMs (id: us): " + ", ".join(f"{s}: {med[s]:.2f}" for s in order[::-1][:12]))
        print("  fastest SMs (id: us): " + ", ".join(f"{s}: {med[s]:.2f}" for s in order[:12]))
        # by SM id in groups of 16 (which GPC an id belongs to is not documented)
        print("  mean by SM id / 16: " + " ".join(
            f"{np.nanmean(med[i:i + 16]):.2f}" for i in range(0, sms, 16)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
