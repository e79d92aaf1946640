// permute_act.cu: activations for the wgmma path of gemm_mma.cu, with the
// tile layout's k permutation applied (gemm.py:wgmma_pair_permutation).
//
// Within each 32-column block, column pair 4t + c (thread t's pairs, c = 0..3)
// moves to pair 4c + t: a 4 x 4 transpose of 4-byte words. A thread moves
// one block of one row: four 16-byte loads, four 16-byte stores, no
// arithmetic on the data.
#include "common.cuh"

namespace kbit {

template <typename T>
__global__ void __launch_bounds__(256) kbit_permute_act(const uint4* __restrict__ src,
                                                       uint4* __restrict__ dst, long long blocks) {
  static_assert(sizeof(T) == 2, "16-bit activations");
  for (long long b = blockIdx.x * (long long)blockDim.x + threadIdx.x; b < blocks;
       b += (long long)gridDim.x * blockDim.x) {
    const uint4 p0 = src[4 * b], p1 = src[4 * b + 1], p2 = src[4 * b + 2], p3 = src[4 * b + 3];
    dst[4 * b] = make_uint4(p0.x, p1.x, p2.x, p3.x);
    dst[4 * b + 1] = make_uint4(p0.y, p1.y, p2.y, p3.y);
    dst[4 * b + 2] = make_uint4(p0.z, p1.z, p2.z, p3.z);
    dst[4 * b + 3] = make_uint4(p0.w, p1.w, p2.w, p3.w);
  }
}

}  // namespace kbit
