// common.cuh: what every kbit kernel shares. Dtype traits, the E4M4 scale
// format, error flags. The format itself is FORMAT.md; kbit_cupy/format.py is
// its NumPy oracle and every function here mirrors one there bit for bit.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace kbit {

constexpr int kBlock = 32;                 // elements per quantization block = warp width
constexpr unsigned kFullMask = 0xffffffffu;

// Error bits a kernel raises; Python turns them into ValueError after the launch.
constexpr int kFlagNonFinite = 1;          // NaN or infinity in the input
constexpr int kFlagScaleOverflow = 2;      // absmax too large for the scale format

// ---- element types: everything is computed in float32 -------------------
template <typename T> struct Elem;
template <> struct Elem<float> {
  __device__ static float to_float(float v) { return v; }
};
template <> struct Elem<__half> {
  __device__ static float to_float(__half v) { return __half2float(v); }
};
template <> struct Elem<__nv_bfloat16> {
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};

// ---- block scales --------------------------------------------------------
// E4M4: code (e << 4) | m; e == 0: m * 2^-14; else 2^(e-11) * (1 + m/16).
constexpr int kE4M4Bias = 11;

__device__ __forceinline__ float e4m4_decode(unsigned code) {
  unsigned e = code >> 4, m = code & 15u;
  // Build the float32 directly: exponent e - 11 + 127, mantissa m in its top 4 bits.
  float normal = __uint_as_float(((e + (127u - kE4M4Bias)) << 23) | (m << 19));
  return e == 0 ? float(m) * 0x1p-14f : normal;
}

// Nearest code, exact ties to even m, carry into the exponent. Valid for
// 0 <= a < 31.5 (the caller flags larger values).
__device__ __forceinline__ unsigned e4m4_encode(float a) {
  const unsigned subnormal = __float2uint_rn(a * 16384.0f);  // a < 2^-10: rint(a * 2^14)
  const unsigned bits = __float_as_uint(a);
  const unsigned rounded = (bits + 0x3FFFFu + ((bits >> 19) & 1u)) >> 19;  // RNE to 4 mantissa bits
  return a < 0x1p-10f ? subnormal : rounded - ((127u - kE4M4Bias) << 4);  // a select, no branch
}

// How each stored scale type is written and read back.
template <typename TScale> struct Scale;
template <> struct Scale<unsigned char> {
  __device__ static unsigned char encode(float a, int& flags) {
    if (a >= 31.5f) flags |= kFlagScaleOverflow;
    return (unsigned char)(a >= 31.5f ? 0xffu : e4m4_encode(a));
  }
  __device__ static float decode(unsigned char code) { return e4m4_decode(code); }
};
template <> struct Scale<__half> {
  __device__ static __half encode(float a, int& flags) {
    __half h = __float2half_rn(a);
    if (__hisinf(h)) flags |= kFlagScaleOverflow;
    return h;
  }
  __device__ static float decode(__half h) { return __half2float(h); }
};

// ---- CTA-wide exclusive prefix sum --------------------------------------
// Every thread of the CTA calls it once with its value and gets the sum of the
// values of the threads before it (in thread order). warp_sums: shared memory
// for one int per warp. Contains one __syncthreads.
__device__ inline int cta_exclusive_scan(int value, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  int inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(kFullMask, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int before = inclusive - value;
  for (int w = 0; w < warp; ++w) before += warp_sums[w];
  return before;
}

}  // namespace kbit
