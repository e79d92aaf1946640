"""Does compute-sanitizer's racecheck see mbarrier hand-overs? (device only)

usage: compute-sanitizer --tool racecheck python benchmarks/racecheck_mbarrier_probe.py

One CTA of two warps hands a shared-memory buffer back and forth through two
mbarriers, the way gemm_mma.cu's ring of A's stages does (ring_bar_* in
mma_common.cuh): warp 0 fills the buffer by cp.async and arrives on `full`
with cp.async.mbarrier.arrive.noinc; warp 1 waits on `full`, reads the buffer,
and lane 0 arrives on `empty` after __syncwarp; warp 0 waits on `empty` before
its next fill. Correctly ordered by the PTX memory model (the arrivals
release, the waits acquire), so every hazard racecheck reports here is the
tool not modelling mbarriers, not a race. ROUNDS fills of one buffer: the
write-after-read and read-after-write hand-overs both occur.
"""

import cupy as cp
import numpy as np

from kbit_cupy import _jit

SRC = r"""
#include "mma_common.cuh"
using namespace kbit;
extern "C" __global__ void probe(const uint4* src, unsigned* out, int rounds) {
  __shared__ __align__(16) uint4 buf[32];
  __shared__ unsigned long long bars[2];  // full, empty
  if (threadIdx.x == 0) {
    ring_bar_init(bars, 32);
    ring_bar_init(bars + 1, 1);
  }
  __syncthreads();
  const int lane = threadIdx.x % 32;
  unsigned sum = 0;
  for (int r = 0; r < rounds; ++r) {
    if (threadIdx.x < 32) {  // the copying warp
      if (r > 0) ring_bar_wait(bars + 1, (r - 1) & 1);
      const unsigned dst = (unsigned)__cvta_generic_to_shared(buf + lane);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src + 32 * r + lane) : "memory");
      ring_bar_copies_arrive(bars);
    } else {  // the reading warp
      ring_bar_wait(bars, r & 1);
      sum += buf[(lane + r) % 32].x;
      __syncwarp();
      if (lane == 0) ring_bar_arrive(bars + 1);
    }
  }
  if (threadIdx.x >= 32) out[lane] = sum;
}
"""

ROUNDS = 8
mod = cp.RawModule(code=_jit.render_source("probe", SRC), options=_jit.compile_options())
probe = mod.get_function("probe")
src = cp.arange(32 * ROUNDS * 4, dtype=cp.uint32)
out = cp.zeros(32, cp.uint32)
probe((1,), (64,), (src, out, np.int32(ROUNDS)))
cp.cuda.Device().synchronize()
host = src.get()
want = [sum(int(host[4 * (32 * r + (lane + r) % 32)]) for r in range(ROUNDS)) for lane in range(32)]
assert out.get().tolist() == want, (out.get().tolist(), want)
print(f"probe ran {ROUNDS} rounds, sums as expected")
