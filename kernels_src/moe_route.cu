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
// atomics: the counts do not depend on their order); its first kHeld rounds
// of 32 ids stay in registers for step 3. 2) The (expert, warp) counts, in
// that order, are cut into one contiguous share per thread; a block-wide
// scan of the shares turns each count into its warp's first row for the
// expert (warps in order), and an expert's first count into its offset.
// 3) Each warp walks its slice 32 pairs at a time in order; lanes with the
// same expert (match_any) take consecutive slots by lane order.
#include "common.cuh"

namespace kbit {

// Rounds of 32 ids a lane keeps from step 1 for step 3 (registers; later
// rounds are loaded again): 8 cover 8192 pairs at 32 warps.
constexpr int kRouteHeld = 8;

template <int THREADS>
__global__ void __launch_bounds__(THREADS) kbit_moe_route(const int* __restrict__ ids, int pairs,
                                                          int experts, int warps_used,
                                                          int* __restrict__ offsets,
                                                          int* __restrict__ order) {
  // slot[w * stride + e]: counts, then next free row. With several warps the
  // stride is experts + 1, so that step 2's threads, which read one expert's
  // counts of consecutive warps, hit different banks.
  extern __shared__ int slot[];
  __shared__ int warp_sums[THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int stride = experts + (warps_used > 1);
  const int per_warp = (pairs + warps_used - 1) / warps_used;
  const int begin = min(pairs, warp * per_warp), end = min(pairs, begin + per_warp);
  auto valid = [&](int e) { return e >= 0 && e < experts; };

  for (int i = threadIdx.x; i < warps_used * stride; i += THREADS) slot[i] = 0;
  // 1) every held round's load issued before any is used (one round trip)
  int held[kRouteHeld];
#pragma unroll
  for (int h = 0; h < kRouteHeld; ++h) {
    const int i = begin + 32 * h + lane;
    held[h] = warp < warps_used && i < end ? __ldg(ids + i) : -1;
  }
  __syncthreads();
  if (warp < warps_used) {  // counts per (warp, expert)
#pragma unroll
    for (int h = 0; h < kRouteHeld; ++h)
      if (valid(held[h])) atomicAdd(slot + warp * stride + held[h], 1);
#pragma unroll 4
    for (int i = begin + 32 * kRouteHeld + lane; i < end; i += 32) {
      const int e = __ldg(ids + i);
      if (valid(e)) atomicAdd(slot + warp * stride + e, 1);
    }
  }
  __syncthreads();

  // 2) thread t owns the counts j in [t * per, (t + 1) * per) of the
  // expert-major order j = e * warps_used + w
  const int total = warps_used * experts;
  const int per = (total + THREADS - 1) / THREADS;
  const int j0 = min(total, (int)threadIdx.x * per), j1 = min(total, j0 + per);
  const int e0 = j0 / warps_used, w0 = j0 - e0 * warps_used;
  int mine = 0;
  for (int j = j0, e = e0, w = w0; j < j1; ++j) {
    mine += slot[w * stride + e];
    if (++w == warps_used) w = 0, ++e;
  }
  int row = cta_exclusive_scan(mine, warp_sums);
  for (int j = j0, e = e0, w = w0; j < j1; ++j) {
    if (w == 0) offsets[e] = row;
    const int count = slot[w * stride + e];
    slot[w * stride + e] = row;
    row += count;
    if (++w == warps_used) w = 0, ++e;
  }
  if (threadIdx.x == THREADS - 1) offsets[experts] = row;  // every valid pair
  __syncthreads();

  // 3) rows in pair order: lanes with one expert take consecutive rows.
  if (warp < warps_used) {
    auto place = [&](int i0, int e) {
      const bool ok = valid(e);
      const unsigned peers = __match_any_sync(kFullMask, ok ? e : -1);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      int* next = slot + warp * stride + (ok ? e : 0);
      if (ok) order[*next + rank] = i0 + lane;
      __syncwarp();
      if (ok && rank == 0) *next += __popc(peers);  // the group's first lane moves it on
      __syncwarp();
    };
#pragma unroll
    for (int h = 0; h < kRouteHeld; ++h)
      if (begin + 32 * h < end) place(begin + 32 * h, held[h]);  // (uniform in the warp)
    // later rounds: the next 32 ids loaded while these are placed
    const int rest = begin + 32 * kRouteHeld;
    int e_next = rest + lane < end ? __ldg(ids + rest + lane) : -1;
    for (int i0 = rest; i0 < end; i0 += 32) {
      const int e = e_next;
      e_next = i0 + 32 + lane < end ? __ldg(ids + i0 + 32 + lane) : -1;
      place(i0, e);
    }
  }
}

}  // namespace kbit
