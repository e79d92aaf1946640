// wgmma.cuh: the warpgroup matrix instructions (sm_90a) of gemm_mma.cu's
// Hopper path (WG > 0). Without the sm_90a features the helpers are empty
// and Wgmma has no specialisations, so only the WG = 0 kernels compile.
#pragma once

namespace kbit {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_HAS_WGMMA 1
#else
#define KBIT_HAS_WGMMA 0
#endif

// Shared-memory matrix descriptor for a K-major operand in the 128-byte
// swizzle layout: rows of 64 elements (128 bytes), 8-row atoms of 1024 bytes
// stacked along the rows (stride 1024), the atom 1024-byte aligned.
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(unsigned smem_addr) {
  return (unsigned long long)((smem_addr & 0x3FFFFu) >> 4) | (1ull << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// D[64 x N] += A[64 x 16] (registers: each warp its 16 rows, the m16n8k16
// A-fragment order) * B[16 x N] (shared memory, descriptor), fp32 D.
template <typename T, int N> struct Wgmma;
#if KBIT_HAS_WGMMA
#define KBIT_ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define KBIT_ACC16(i) KBIT_ACC4(i), KBIT_ACC4(i + 1), KBIT_ACC4(i + 2), KBIT_ACC4(i + 3)
#define KBIT_ACC32(i)                                                                   \
  KBIT_ACC4(i), KBIT_ACC4(i + 1), KBIT_ACC4(i + 2), KBIT_ACC4(i + 3), KBIT_ACC4(i + 4), \
      KBIT_ACC4(i + 5), KBIT_ACC4(i + 6), KBIT_ACC4(i + 7)
#define KBIT_D4 "%0, %1, %2, %3"
#define KBIT_D8 KBIT_D4 ", %4, %5, %6, %7"
#define KBIT_D16 KBIT_D8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define KBIT_D32 \
  KBIT_D16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define KBIT_D64                                                                          \
  KBIT_D32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, " \
           "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "  \
           "%62, %63"
// D registers, then A (4 registers) and the descriptor; scale-d 1 (accumulate),
// A and B not negated, B K-major.
#define KBIT_WGMMA(CT, TY, N, DREGS, OPS, ...)                                          \
  template <> struct Wgmma<CT, N> {                                                     \
    __device__ static void run(float (&d)[N / 8][4], const unsigned (&a)[4],           \
                               unsigned long long desc) {                               \
      asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY         \
                   " {" DREGS "}, " OPS ", 1, 1, 1, 0;\n"                              \
                   : __VA_ARGS__                                                        \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));            \
    }                                                                                   \
  };
KBIT_WGMMA(__half, "f16", 8, KBIT_D4, "{%4, %5, %6, %7}, %8", KBIT_ACC4(0))
KBIT_WGMMA(__nv_bfloat16, "bf16", 8, KBIT_D4, "{%4, %5, %6, %7}, %8", KBIT_ACC4(0))
KBIT_WGMMA(__half, "f16", 16, KBIT_D8, "{%8, %9, %10, %11}, %12", KBIT_ACC4(0), KBIT_ACC4(1))
KBIT_WGMMA(__nv_bfloat16, "bf16", 16, KBIT_D8, "{%8, %9, %10, %11}, %12", KBIT_ACC4(0),
           KBIT_ACC4(1))
KBIT_WGMMA(__half, "f16", 32, KBIT_D16, "{%16, %17, %18, %19}, %20", KBIT_ACC16(0))
KBIT_WGMMA(__nv_bfloat16, "bf16", 32, KBIT_D16, "{%16, %17, %18, %19}, %20", KBIT_ACC16(0))
KBIT_WGMMA(__half, "f16", 64, KBIT_D32, "{%32, %33, %34, %35}, %36", KBIT_ACC32(0))
KBIT_WGMMA(__nv_bfloat16, "bf16", 64, KBIT_D32, "{%32, %33, %34, %35}, %36", KBIT_ACC32(0))
KBIT_WGMMA(__half, "f16", 128, KBIT_D64, "{%64, %65, %66, %67}, %68", KBIT_ACC32(0),
           KBIT_ACC32(8))
KBIT_WGMMA(__nv_bfloat16, "bf16", 128, KBIT_D64, "{%64, %65, %66, %67}, %68", KBIT_ACC32(0),
           KBIT_ACC32(8))
#endif

__device__ __forceinline__ void wgmma_fence(unsigned (&a)[2][4]) {
#if KBIT_HAS_WGMMA
  // The A fragments are operands so that their writes stay before the fence.
  asm volatile("wgmma.fence.sync.aligned;\n"
               : "+r"(a[0][0]), "+r"(a[0][1]), "+r"(a[0][2]), "+r"(a[0][3]), "+r"(a[1][0]),
                 "+r"(a[1][1]), "+r"(a[1][2]), "+r"(a[1][3])::"memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if KBIT_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N_PENDING> __device__ __forceinline__ void wgmma_wait() {
#if KBIT_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N_PENDING) : "memory");
#endif
}
// Orders later reads of the accumulators after a wait (they are not operands of it).
template <int M_TILES> __device__ __forceinline__ void fence_acc(float (&d)[M_TILES][4]) {
#pragma unroll
  for (int i = 0; i < M_TILES; ++i)
    asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
}
// Shared memory written by the generic proxy (cp.async, st.shared), read next by wgmma.
__device__ __forceinline__ void fence_proxy_async() {
#if KBIT_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

}  // namespace kbit
