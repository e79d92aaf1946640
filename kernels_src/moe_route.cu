// moe_route.cu: group a router's choices by expert, on the GPU, in one launch.
//
// Input: R = T * top_k expert ids (pair i = token i / top_k, choice i % top_k).
// Output: offsets[E + 1] (expert e owns sorted rows offsets[e] ..
// offsets[e + 1] - 1) and order[R'] (sorted row -> pair index), R' the valid
// ids. The order is stable: within an expert, pairs keep their index order,
// so the result depends on the ids alone (deterministic, unlike slots taken
// with atomics), and the grouped matmul reads rows through it
// (gemm_mma.cu, GROUPED with row_ids) with no gather or scatter launches.
// Ids outside [0, E) get no row.
//
// One CTA (the routing metadata is small): warp w owns a contiguous slice of
// the pairs. 1) Each warp counts its slice per expert (shared-memory integer
// atomics: the counts do not depend on their order). 2) Per expert, the
// warps' counts become each warp's first slot (warps in order), and a
// block-wide scan over experts gives the offsets. 3) Each warp walks its
// slice 32 pairs at a time in order; lanes with the same expert (ballots of
// the id's bits) take consecutive slots by lane order. Where the shared
// memory holds them, step 1 keeps the ids there for step 3, and the order is
// staged there and written out at the end.
#include "common.cuh"

namespace kbit {

// Phase stamps for benchmarks/route_phases.py (-DKBIT_ROUTE_PHASES): the
// global timer, the latest over the warps that stamp (the array zeroed
// before each launch). Without the define, nothing.
#ifdef KBIT_ROUTE_PHASES
}  // namespace kbit
extern "C" __device__ unsigned long long kbit_route_stamps[8];  // (unmangled: get_global)
namespace kbit {
__device__ __forceinline__ void route_stamp(int i) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  atomicMax(kbit_route_stamps + i, t);
}
#define KBIT_ROUTE_STAMP(i, who) \
  if (who) route_stamp(i)
#else
#define KBIT_ROUTE_STAMP(i, who)
#endif

#ifndef KBIT_ROUTE_EARLY_TRIGGER
#define KBIT_ROUTE_EARLY_TRIGGER 1
#endif

template <int THREADS>
__global__ void __launch_bounds__(THREADS) kbit_moe_route(const int* __restrict__ ids, int pairs,
                                                          int experts, int warps_used,
                                                          int* __restrict__ offsets,
                                                          int* __restrict__ order, int staged) {
  // [warps_used][experts]: counts, then next free slot; then, where `staged`,
  // the order itself ([pairs]), written to memory at the end in whole lines
  extern __shared__ int slot[];
  int* const order_stage = slot + warps_used * experts;
  int* const ids_stage = order_stage + pairs;  // (staged: the ids, [pairs])
  __shared__ int warp_sums[THREADS / 32];
  __shared__ int valid_rows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int per_warp = (pairs + warps_used - 1) / warps_used;
  const int begin = min(pairs, warp * per_warp), end = min(pairs, begin + per_warp);
  auto valid = [&](int e) { return e >= 0 && e < experts; };
  KBIT_ROUTE_STAMP(0, threadIdx.x == 0);
#if KBIT_ROUTE_EARLY_TRIGGER && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // the grouped launch that follows (programmatic dependent launch) may start
  // its CTAs now: they wait (griddepcontrol.wait) for this grid to complete
  // before they touch memory, so only their launch overlaps the routing
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  for (int i = threadIdx.x; i < warps_used * experts; i += THREADS) slot[i] = 0;
  __syncthreads();
  if (warp < warps_used) {  // 1) counts per (warp, expert)
    // unrolled: several loads of ids in flight, not one round trip each
    // (with phase 3's load ahead, H100: 4096 pairs 9.18 -> 8.05 us, 1024
    // pairs 4.31 -> 4.42 us; results/moe_route_pipeline_h100_d8f3e95.txt)
#pragma unroll 4
    for (int i = begin + lane; i < end; i += 32) {
      const int e = __ldg(ids + i);
      if (valid(e)) atomicAdd(slot + warp * experts + e, 1);
      if (staged) ids_stage[i] = e;
    }
  }
  KBIT_ROUTE_STAMP(1, lane == 0);
  __syncthreads();

  // 2) thread t owns experts [t * per, (t + 1) * per): a block-wide scan of
  // the experts' totals gives the offsets, and per expert the warps' counts
  // become each warp's first row (warps in order).
  const int per = (experts + THREADS - 1) / THREADS;
  const int e0 = min(experts, (int)threadIdx.x * per), e1 = min(experts, e0 + per);
  int mine = 0;
  for (int e = e0; e < e1; ++e)
    for (int w = 0; w < warps_used; ++w) mine += slot[w * experts + e];
  KBIT_ROUTE_STAMP(4, lane == 0);
  int row = cta_exclusive_scan(mine, warp_sums);
  KBIT_ROUTE_STAMP(5, lane == 0);
  for (int e = e0; e < e1; ++e) {
    offsets[e] = row;
    for (int w = 0; w < warps_used; ++w) {
      const int count = slot[w * experts + e];
      slot[w * experts + e] = row;
      row += count;
    }
  }
  if (threadIdx.x == THREADS - 1) offsets[experts] = valid_rows = row;  // every valid pair
  KBIT_ROUTE_STAMP(2, lane == 0);
  __syncthreads();

  // 3) rows in pair order: lanes with one expert take consecutive rows.
  if (warp < warps_used) {
    const int id_bits = experts > 1 ? 32 - __clz(experts - 1) : 0;
    // the next 32 ids loaded while these are placed (one load in flight
    // ahead; staged: from shared memory)
    auto id_at = [&](int i) { return i < end ? (staged ? ids_stage[i] : __ldg(ids + i)) : -1; };
    int e_next = id_at(begin + lane);
    for (int i0 = begin; i0 < end; i0 += 32) {
      const int i = i0 + lane;
      const int e = e_next;
      e_next = id_at(i + 32);
      const bool ok = valid(e);
      // the lanes with this lane's expert: one ballot per bit of the id (and
      // one of validity) instead of __match_any_sync, whose time grows with
      // the distinct values in the warp (H100, route_phases.py, 4096 pairs
      // over 128 experts placed in: match_any 4.96 us, staged 4.42 + 0.48
      // written out; ballots 4.42, staged 2.88 + 0.48)
      unsigned peers = __ballot_sync(kFullMask, ok);
      if (!ok) peers = ~peers;
      for (int b = 0; b < id_bits; ++b) {
        const bool bit = (e >> b) & 1;
        const unsigned votes = __ballot_sync(kFullMask, bit);
        peers &= bit ? votes : ~votes;
      }
      const int rank = __popc(peers & ((1u << lane) - 1u));
      int* next = slot + warp * experts + (ok ? e : 0);
      if (ok) {
        if (staged) order_stage[*next + rank] = i;
        else order[*next + rank] = i;
      }
      __syncwarp();
      if (ok && rank == 0) *next += __popc(peers);  // the group's first lane moves it on
      __syncwarp();
    }
  }
  KBIT_ROUTE_STAMP(3, lane == 0);
  // Staged: the order to memory in whole lines (times above).
  if (staged) {
    __syncthreads();
    for (int r = threadIdx.x; r < valid_rows; r += THREADS) order[r] = order_stage[r];
  }
  KBIT_ROUTE_STAMP(6, lane == 0);
}

}  // namespace kbit
