// quantize.cu: float tensor -> k bit-planes per 32-element block + block scale.
//
// One warp owns a block at a time: lane l holds element l, the block's absmax
// is a warp reduction, and each bit-plane word is one __ballot_sync. A warp
// takes 32 consecutive blocks per step (a "group") so the per-block scalar
// work (scale encode/decode, reciprocal) runs once per block on one lane
// instead of on all 32:
//
//   step 1  load  v[j] = x[(group*32 + j)*32 + lane]      j = 0..31
//   step 2  absmax of block j = warp max of |v[j]|; lane j keeps it
//   step 3  lane j encodes block j's scale, stores absmax, takes 1/scale
//   step 4  for each block j: z = v[j] / s_j, idx = argmin, k ballots
//   step 5  the group's 32*k packed words leave in k coalesced stores
//
// Index selection (FORMAT.md section 4) has two exact forms, chosen on the
// host by kbit_cupy/format.py:make_index_plan:
//   FAST   a table in shared memory, indexed by a monotone function of z,
//          holds at most one decision threshold per bin: idx is one compare.
//   BRUTE  argmin over all 2^k entries, ties to the lowest index; used for
//          codebooks whose near-equal entries make float32 rounding matter.
#include "common.cuh"

namespace kbit {

// z = RN(x / s) from r = RN(1/s) (r = 0 when s = 0 gives z = 0): two
// remainder corrections (Markstein) make the quotient correctly rounded, as
// IEEE division is, for every |x| >= 2^-100; smaller x cannot change the
// selected index under the FAST plan's preconditions (format.py).
__device__ __forceinline__ float divide_rn(float x, float s, float r) {
  float q = __fmul_rn(x, r);
  float rem = __fmaf_rn(-q, s, x);
  q = __fmaf_rn(rem, r, q);
  rem = __fmaf_rn(-q, s, x);
  return __fmaf_rn(rem, r, q);
}

// Table lookup: bin = clamp(round(z * bin_scale) + bins/2); adding 1.5*2^23
// rounds to an integer in the low mantissa bits (bin_offset holds it plus bins/2).
__device__ __forceinline__ unsigned select_fast(float z, const uint2* table, int bins,
                                                float bin_scale, float bin_offset) {
  float w = __fadd_rn(__fmul_rn(z, bin_scale), bin_offset);
  int bin = min(max(__float_as_int(w) - 0x4B400000, 0), bins - 1);
  uint2 entry = table[bin];  // x: threshold bits, y: index below | index at-or-above << 8
  return z >= __uint_as_float(entry.x) ? (entry.y >> 8) : (entry.y & 0xffu);
}

template <int K>
__device__ __forceinline__ unsigned select_brute(float z, const float* codebook) {
  float best = __int_as_float(0x7f800000);
  unsigned idx = 0;
#pragma unroll
  for (int j = 0; j < (1 << K); ++j) {
    float d = fabsf(__fsub_rn(z, codebook[j]));
    if (d < best) { best = d; idx = j; }
  }
  return idx;
}

// Element `lane` of the 32 blocks of `group` (zeros past n or past the last group).
template <typename TIn>
__device__ __forceinline__ void load_group(const TIn* __restrict__ x, long long n, long long group,
                                           long long ngroups, int lane, TIn (&raw)[32]) {
  const long long base = group * 32 * kBlock + lane;
  if (group < ngroups && (group + 1) * 32 * kBlock <= n) {
    const TIn* p = x + base;  // full group: constant offsets, no per-element checks
#pragma unroll
    for (int j = 0; j < 32; ++j) raw[j] = p[j * kBlock];
  } else {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      long long e = base + (long long)j * kBlock;
      raw[j] = (group < ngroups && e < n) ? x[e] : TIn(0.0f);
    }
  }
}

template <int K, typename TIn, typename TScale, bool BRUTE>
__global__ void __launch_bounds__(256, 2) kbit_quantize(
    const TIn* __restrict__ x, long long n,
    const uint2* __restrict__ table, int bins, float bin_scale, float bin_offset,
    const float* __restrict__ codebook,
    unsigned* __restrict__ packed, TScale* __restrict__ absmax, int* __restrict__ flags) {
  extern __shared__ uint2 shared_table[];  // FAST: bins entries; BRUTE: the codebook
  // Per warp: the group's 32 absmax values, then (scale, 1/scale) per block,
  // and the 32*K packed words on their way out. Uniform values written by all
  // lanes to one address and read back as broadcasts: no selects, no shuffles.
  __shared__ unsigned warp_absmax[8][32];
  __shared__ float2 warp_scale[8][32];
  __shared__ unsigned warp_words[8][32 * K];
  const int warp_in_block = threadIdx.x >> 5;
  if (BRUTE) {
    float* cb = reinterpret_cast<float*>(shared_table);
    for (int i = threadIdx.x; i < (1 << K); i += blockDim.x) cb[i] = codebook[i];
  } else {
    for (int i = threadIdx.x; i < bins; i += blockDim.x) shared_table[i] = table[i];
  }
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const long long nblocks = (n + kBlock - 1) / kBlock;
  const long long ngroups = (nblocks + 31) / 32;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  int error = 0;

  // step 1 runs one group ahead: the next group's loads are in flight while
  // this group computes (a warp has ~2 KB of loads outstanding at all times).
  // The loop runs per CTA (its bound is uniform over the block), so the
  // compiler knows every warp is converged at the ballots and reductions; a
  // warp whose group lies past the end works on zeros and stores nothing.
  const long long warps_per_cta = blockDim.x / 32;
  TIn raw[32];
  load_group(x, n, blockIdx.x * warps_per_cta + warp_in_block, ngroups, lane, raw);
  for (long long cta_group = blockIdx.x * warps_per_cta; cta_group < ngroups;
       cta_group += warps) {
    const long long group = cta_group + warp_in_block;
    const long long first_block = group * 32;
    float v[32];  // element `lane` of the group's 32 blocks; padding lanes are 0.0
#pragma unroll
    for (int j = 0; j < 32; ++j) v[j] = Elem<TIn>::to_float(raw[j]);
    load_group(x, n, group + warps, ngroups, lane, raw);

    // step 2: |v| as bits orders like the float
#pragma unroll
    for (int j = 0; j < 32; ++j)
      warp_absmax[warp_in_block][j] = __reduce_max_sync(kFullMask, __float_as_uint(v[j]) & 0x7fffffffu);
    __syncwarp();
    unsigned my_absmax_bits = warp_absmax[warp_in_block][lane];

    // step 3: this lane's block `first_block + lane`
    if (my_absmax_bits >= 0x7f800000u) error |= kFlagNonFinite;
    if (my_absmax_bits < 0x00800000u) my_absmax_bits = 0;  // denormal maxima flush (FTZ)
    TScale stored = Scale<TScale>::encode(__uint_as_float(my_absmax_bits), error);
    float scale = Scale<TScale>::decode(stored);
    float inv_scale = scale > 0.0f ? __frcp_rn(scale) : 0.0f;
    if (first_block + lane < nblocks) absmax[first_block + lane] = stored;
    warp_scale[warp_in_block][lane] = make_float2(scale, inv_scale);
    __syncwarp();

    // step 4: word j*K + b of the group is plane b of block j
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const float2 sr = warp_scale[warp_in_block][j];
      unsigned idx;
      if (BRUTE) {
        float z = sr.x > 0.0f ? __fdiv_rn(v[j], sr.x) : 0.0f;
        idx = select_brute<K>(z, reinterpret_cast<const float*>(shared_table));
      } else {
        idx = select_fast(divide_rn(v[j], sr.x, sr.y), shared_table, bins, bin_scale, bin_offset);
      }
#pragma unroll
      for (int b = 0; b < K; ++b)
        warp_words[warp_in_block][j * K + b] = __ballot_sync(kFullMask, (idx >> b) & 1u);
    }
    __syncwarp();

    // step 5
    const long long word0 = first_block * K;
#pragma unroll
    for (int q = 0; q < K; ++q) {
      long long w = word0 + q * 32 + lane;
      if (w < nblocks * K) packed[w] = warp_words[warp_in_block][q * 32 + lane];
    }
    __syncwarp();  // the next group overwrites the staging arrays
  }
  if (error) atomicOr(flags, error);
}

}  // namespace kbit
