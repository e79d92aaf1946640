// dequantize.cu: bit-planes + scales -> y = codebook[idx] * scale (FORMAT.md 6).
//
// Four lanes share a block, each producing 8 consecutive outputs (one 16-byte
// store for fp16/bf16), so a warp writes 8 blocks = 256 outputs per step.
// Lane l reads byte (l & 3) of each of the block's k plane words: bit e of
// that byte is bit b of output e's index. The codebook sits in shared memory;
// the product is float32 and rounds once to the output type.
#include "common.cuh"

namespace kbit {

template <typename T> struct Store8;
template <> struct Store8<float> {
  __device__ static void vector(float* p, const float (&y)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(y[0], y[1], y[2], y[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(y[4], y[5], y[6], y[7]);
  }
  __device__ static void scalar(float* p, float y) { *p = y; }
};
template <> struct Store8<__half> {
  __device__ static void vector(__half* p, const float (&y)[8]) {
    __half2 h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(y[2 * i], y[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<uint4*>(h);
  }
  __device__ static void scalar(__half* p, float y) { *p = __float2half_rn(y); }
};
template <> struct Store8<__nv_bfloat16> {
  __device__ static void vector(__nv_bfloat16* p, const float (&y)[8]) {
    __nv_bfloat162 h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(y[2 * i], y[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<uint4*>(h);
  }
  __device__ static void scalar(__nv_bfloat16* p, float y) { *p = __float2bfloat16_rn(y); }
};

// Bit e of an 8-bit value moves to bit 4e: three shift-or-mask steps place
// 8 indices' bits of one plane in 8 nibbles at once.
__device__ __forceinline__ unsigned spread_to_nibbles(unsigned byte) {
  unsigned x = (byte | (byte << 12)) & 0x000F000Fu;
  x = (x | (x << 6)) & 0x03030303u;
  return (x | (x << 3)) & 0x11111111u;
}

template <int K, typename TOut, typename TScale>
__global__ void __launch_bounds__(256) kbit_dequantize(
    const unsigned* __restrict__ packed, const TScale* __restrict__ absmax,
    const float* __restrict__ codebook, long long n, TOut* __restrict__ out, int out_aligned) {
  __shared__ float cb[1 << K];
  for (int i = threadIdx.x; i < (1 << K); i += blockDim.x) cb[i] = codebook[i];
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const int quarter = lane & 3;  // which 8 of the block's 32 outputs
  const long long nblocks = (n + kBlock - 1) / kBlock;
  const long long stride = (long long)gridDim.x * (blockDim.x / 32) * 8;

#pragma unroll 4  // four blocks' loads in flight per lane
  for (long long block = ((long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * 8 + (lane >> 2);
       block < nblocks; block += stride) {
    unsigned bytes[K];
#pragma unroll
    for (int b = 0; b < K; ++b) bytes[b] = (packed[block * K + b] >> (8 * quarter)) & 0xffu;
    const float scale = Scale<TScale>::decode(absmax[block]);

    // Nibble e of `low` holds bits 0..3 of output e's index; bit 4e of `high` its bit 4.
    unsigned low = 0, high = 0;
#pragma unroll
    for (int b = 0; b < (K < 4 ? K : 4); ++b) low |= spread_to_nibbles(bytes[b]) << b;
    if (K == 5) high = spread_to_nibbles(bytes[K - 1]);

    float y[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      unsigned idx = ((low >> (4 * e)) & 15u) | (((high >> (4 * e)) & 1u) << 4);
      y[e] = __fmul_rn(cb[idx], scale);  // float32 product, FTZ like every path
    }

    const long long first = block * kBlock + quarter * 8;
    if (out_aligned && first + 8 <= n) {
      Store8<TOut>::vector(out + first, y);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (first + e < n) Store8<TOut>::scalar(out + first + e, y[e]);
    }
  }
}

}  // namespace kbit
