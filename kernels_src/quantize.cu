// quantize.cu: float tensor -> k bit-planes per 32-element block + block scale.
//
// Layout of the work. A warp takes a "step" of kVecs * 256 consecutive
// elements; lane l holds 8 consecutive elements of each 256-element slice
// (one 16-byte load for 16-bit input, two for float32), so four neighbouring
// lanes (a "quad") hold one 32-element block, lane q of the quad its elements
// 8q .. 8q+7:
//
//   1  load   the next step's slices are in flight while this step computes
//   2  absmax each lane's max |x| over its 8 elements, then two quad shuffles
//   3  scale  every lane of the quad encodes the block's scale and takes
//             1/scale (4x redundant, cheaper than moving the result around)
//   4  index  z = x / s, idx = argmin; the lane spreads its 8 indices into a
//             word whose byte b holds bit b of each index (bit e = element e)
//   5  planes a 4x4 byte transpose over the quad: lane q ends with plane q of
//             the block (bit 8j+e = bit q of element 8j+e), k=5 also plane 4
//   6  store  lanes q < k store packed[blk * k + q]: a quad writes its block's
//             k words, the warp a contiguous run
//
// Index selection (FORMAT.md section 4) has two exact forms, chosen on the
// host by kbit_cupy/format.py:make_index_plan:
//   FAST   a table in shared memory, indexed by a monotone function of z,
//          holds at most one decision threshold per bin: idx is one compare.
//   BRUTE  argmin over all 2^k entries, ties to the lowest index; used for
//          codebooks whose near-equal entries make float32 rounding matter.
#include "common.cuh"

namespace kbit {

constexpr int kVecs = 4;                      // 256-element slices per warp step
constexpr int kStep = kVecs * 8 * kBlock;     // elements per warp step

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

// Table lookup. w = z * bin_scale + 1.5*2^23 + bins/2 rounds z * bin_scale
// to an integer in w's low mantissa bits (bin_scale is a power of two, so the
// FMA rounds once, as format.py:bin_of does); bin = bits(w) - bits(1.5*2^23).
// Every float32 quotient of finite input has |z| < 1.5 and the table covers
// that range, so only an upper clamp is needed: NaN, infinities and negative
// w (from blocks already flagged as errors) have large unsigned bits and land
// in the last bin; nothing reads outside the table.
constexpr unsigned kBinBase = 0x4B400000u;  // bits of 1.5*2^23
__device__ __forceinline__ unsigned select_fast(float z, const uint2* table, unsigned last_bits,
                                                float bin_scale, float bin_offset) {
  const float w = __fmaf_rn(z, bin_scale, bin_offset);
  const unsigned bin = min(__float_as_uint(w), last_bits) - kBinBase;
  const uint2 entry = table[bin];  // x: threshold bits, y: index below | index at-or-above << 8
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

// 8 consecutive elements as raw 16-byte words: one for 16-bit types, two for float.
template <typename TIn> struct Slice {
  static constexpr int kWords = sizeof(TIn) * 8 / 16;
  uint4 w[kWords];
};

template <typename TIn>
__device__ __forceinline__ void to_float8(const Slice<TIn>& s, float (&v)[8]);
template <>
__device__ __forceinline__ void to_float8<__half>(const Slice<__half>& s, float (&v)[8]) {
  const unsigned u[4] = {s.w[0].x, s.w[0].y, s.w[0].z, s.w[0].w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
template <>
__device__ __forceinline__ void to_float8<__nv_bfloat16>(const Slice<__nv_bfloat16>& s,
                                                         float (&v)[8]) {
  const unsigned u[4] = {s.w[0].x, s.w[0].y, s.w[0].z, s.w[0].w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // bf16 is the top half of a float32
    v[2 * i] = __uint_as_float(u[i] << 16);
    v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void to_float8<float>(const Slice<float>& s, float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    v[4 * i] = __uint_as_float(s.w[i].x);
    v[4 * i + 1] = __uint_as_float(s.w[i].y);
    v[4 * i + 2] = __uint_as_float(s.w[i].z);
    v[4 * i + 3] = __uint_as_float(s.w[i].w);
  }
}

// max |x| over a slice as float32 bits. |x| as bits orders like the value,
// NaN above infinity, so integer max finds it and keeps NaN visible. 16-bit
// types compare two elements per instruction on the raw words.
__device__ __forceinline__ unsigned max_abs_halves(const uint4& w) {
  unsigned m = __vmaxu2(__vmaxu2(w.x & 0x7fff7fffu, w.y & 0x7fff7fffu),
                        __vmaxu2(w.z & 0x7fff7fffu, w.w & 0x7fff7fffu));
  return max(m & 0xffffu, m >> 16);
}
__device__ __forceinline__ unsigned slice_absmax_bits(const Slice<__half>& s) {
  return __float_as_uint(__half2float(__ushort_as_half((unsigned short)max_abs_halves(s.w[0]))));
}
__device__ __forceinline__ unsigned slice_absmax_bits(const Slice<__nv_bfloat16>& s) {
  return max_abs_halves(s.w[0]) << 16;
}
__device__ __forceinline__ unsigned slice_absmax_bits(const Slice<float>& s) {
  unsigned m = 0;
#pragma unroll
  for (int i = 0; i < 2; ++i)
    m = max(max(m, max(s.w[i].x & 0x7fffffffu, s.w[i].y & 0x7fffffffu)),
            max(s.w[i].z & 0x7fffffffu, s.w[i].w & 0x7fffffffu));
  return m;
}

// This lane's slices of warp step `step` (zeros past n; nothing past the last step).
template <typename TIn>
__device__ __forceinline__ void load_step(const TIn* __restrict__ x, long long n, long long step,
                                          long long nsteps, int lane, Slice<TIn> (&raw)[kVecs]) {
  const long long base = step * kStep + lane * 8;
  if (step < nsteps && (step + 1) * kStep <= n) {  // full step: 16-byte loads (x is 16-byte aligned)
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      const uint4* p = reinterpret_cast<const uint4*>(x + base + u * 256);
#pragma unroll
      for (int i = 0; i < Slice<TIn>::kWords; ++i) raw[u].w[i] = __ldg(p + i);
    }
  } else {
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      // Raw bits, element by element (zero bits are 0.0 in every type).
      unsigned bits[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        long long i = base + u * 256 + e;
        bool in = step < nsteps && i < n;
        if (sizeof(TIn) == 2)
          bits[e] = in ? reinterpret_cast<const unsigned short*>(x)[i] : 0u;
        else
          bits[e] = in ? reinterpret_cast<const unsigned*>(x)[i] : 0u;
      }
      if (sizeof(TIn) == 2) {
        raw[u].w[0] = make_uint4(bits[0] | bits[1] << 16, bits[2] | bits[3] << 16,
                                 bits[4] | bits[5] << 16, bits[6] | bits[7] << 16);
      } else {
        raw[u].w[0] = make_uint4(bits[0], bits[1], bits[2], bits[3]);
        raw[u].w[Slice<TIn>::kWords - 1] = make_uint4(bits[4], bits[5], bits[6], bits[7]);
      }
    }
  }
}

template <int K, typename TIn, typename TScale, bool BRUTE>
__global__ void __launch_bounds__(256) kbit_quantize(
    const TIn* __restrict__ x, long long n,
    const uint2* __restrict__ table, int bins, float bin_scale, float bin_offset,
    const float* __restrict__ codebook,
    unsigned* __restrict__ packed, TScale* __restrict__ absmax, int* __restrict__ flags) {
  extern __shared__ uint2 shared_table[];  // FAST: bins entries; BRUTE: the codebook
  if (BRUTE) {
    float* cb = reinterpret_cast<float*>(shared_table);
    for (int i = threadIdx.x; i < (1 << K); i += blockDim.x) cb[i] = codebook[i];
  } else {
    for (int i = threadIdx.x; i < bins; i += blockDim.x) shared_table[i] = table[i];
  }
  __syncthreads();

  const unsigned last_bits = kBinBase + (unsigned)bins - 1u;
  const int lane = threadIdx.x & 31;
  const int q = lane & 3;              // this lane's quarter of its block
  const unsigned quad = lane & ~3u;    // first lane of its quad
  const long long nblocks = (n + kBlock - 1) / kBlock;
  const long long nsteps = (n + kStep - 1) / kStep;
  const long long warps_per_cta = blockDim.x / 32;
  const long long warps = (long long)gridDim.x * warps_per_cta;
  int error = 0;

  // The loop bound is uniform over the CTA, so every warp is converged at the
  // shuffles; a warp whose step lies past the end works on zeros and stores nothing.
  Slice<TIn> raw[kVecs];
  const long long first = blockIdx.x * warps_per_cta;
  load_step(x, n, first + (threadIdx.x >> 5), nsteps, lane, raw);
  for (long long cta_step = first; cta_step < nsteps; cta_step += warps) {
    const long long step = cta_step + (threadIdx.x >> 5);
    Slice<TIn> cur[kVecs];
#pragma unroll
    for (int u = 0; u < kVecs; ++u) cur[u] = raw[u];
    load_step(x, n, step + warps, nsteps, lane, raw);

    const long long step_block = step * (kStep / kBlock);  // first block of this step

    // steps 2-3 for every slice first, so the index loop below is one
    // branch-free stretch the compiler can interleave (table-load latency).
    float scale[kVecs], inv_scale[kVecs];
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      // |x| as bits orders like the value, NaN above infinity
      unsigned m = slice_absmax_bits(cur[u]);
      m = max(m, __shfl_xor_sync(kFullMask, m, 1));
      m = max(m, __shfl_xor_sync(kFullMask, m, 2));
      if (m >= 0x7f800000u) error |= kFlagNonFinite;
      if (m < 0x00800000u) m = 0;  // denormal maxima flush (FTZ)
      const TScale stored = Scale<TScale>::encode(__uint_as_float(m), error);
      // Once this lane has seen bad input its results are discarded (Python
      // raises); an infinite scale makes every z 0 or NaN, which the table
      // lookup keeps in bounds.
      scale[u] = error ? __int_as_float(0x7f800000) : Scale<TScale>::decode(stored);
      inv_scale[u] = scale[u] > 0.0f ? __frcp_rn(scale[u]) : 0.0f;
      const long long blk = step_block + u * 8 + (lane >> 2);
      if (q == 0 && blk < nblocks) absmax[blk] = stored;
    }

    // step 4: byte b of spread[u] = bit b of the slice's 8 indices (bit e =
    // element e); top[u] = bit 4 (k=5). BRUTE keeps its slices in a loop:
    // IEEE division calls a slow path whose saved registers would spill.
    unsigned spread[kVecs], top[kVecs];
    constexpr int kUnroll = BRUTE ? 1 : kVecs;
#pragma unroll kUnroll
    for (int u = 0; u < kVecs; ++u) {
      float v[8];
      to_float8<TIn>(cur[u], v);
      spread[u] = 0;
      top[u] = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        unsigned idx;
        if (BRUTE) {
          float z = scale[u] > 0.0f ? __fdiv_rn(v[e], scale[u]) : 0.0f;
          idx = select_brute<K>(z, reinterpret_cast<const float*>(shared_table));
        } else {
          idx = select_fast(divide_rn(v[e], scale[u], inv_scale[u]), shared_table, last_bits,
                            bin_scale, bin_offset);
        }
        // idx * (0x00204081 << e) puts bit b of idx at 8b + e; the shifted copies
        // of idx do not overlap, so nothing carries into the kept bits.
        spread[u] |= (idx * (0x00204081u << e)) & (0x01010101u << e);
        if (K == 5) top[u] |= (idx << e) & (0x10u << e);
      }
    }

#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      // step 5: byte q of each quad lane's spread, in lane order
      const unsigned s0 = __shfl_sync(kFullMask, spread[u], quad + 0);
      const unsigned s1 = __shfl_sync(kFullMask, spread[u], quad + 1);
      const unsigned s2 = __shfl_sync(kFullMask, spread[u], quad + 2);
      const unsigned s3 = __shfl_sync(kFullMask, spread[u], quad + 3);
      const unsigned sel = q | ((q + 4) << 4);
      const unsigned word = __byte_perm(__byte_perm(s0, s1, sel), __byte_perm(s2, s3, sel), 0x5410);
      unsigned word4 = 0;
      if (K == 5) {
        word4 = (top[u] >> 4) << (8 * q);
        word4 |= __shfl_xor_sync(kFullMask, word4, 1);
        word4 |= __shfl_xor_sync(kFullMask, word4, 2);
      }
      // step 6
      const long long blk = step_block + u * 8 + (lane >> 2);
      if (blk < nblocks) {
        if (q < K) packed[blk * K + q] = word;
        if (K == 5 && q == 0) packed[blk * K + 4] = word4;
      }
    }
  }
  if (error) atomicOr(flags, error);
}

}  // namespace kbit
