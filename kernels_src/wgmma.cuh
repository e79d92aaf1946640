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

// KBIT_WG_DESC_UNIFORM 1 (default): the non-slab wgmma loop (gemm_mma.cu)
// builds a stage's descriptor once per K tile, its low word through one
// redux.sync (the same value in every lane, so it lands in a uniform
// register), and each wgmma's descriptor is that plus the k16 step's offset / 16
// (exact: the address field is bits 0..13 of the low word and shared
// addresses stay below 2^18). 0: each wgmma's descriptor from its address,
// which ptxas built in ordinary registers (VIADD, LOP3, SHF, LOP3, IMAD.MOV
// and two R2UR per wgmma: 224 of the 1129 instructions per two K tiles of
// k = 4's 16-row grouped launch, benchmarks/sass_loop.py).
#ifndef KBIT_WG_DESC_UNIFORM
#define KBIT_WG_DESC_UNIFORM 1
#endif
// wgmma_desc_sw128(smem_addr), its low word uniform across the warp (every lane
// active and holding the same address).
__device__ __forceinline__ unsigned long long wgmma_desc_sw128_uniform(unsigned smem_addr) {
  const unsigned lo = __reduce_or_sync(0xffffffffu, (unsigned)wgmma_desc_sw128(smem_addr));
  return (unsigned long long)lo | (wgmma_desc_sw128(0u) & 0xFFFFFFFF00000000ull);
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
// N = 48 (six n8 tiles: the grouped launch's 48-row problems)
#define KBIT_D24 KBIT_D16 ", %16, %17, %18, %19, %20, %21, %22, %23"
KBIT_WGMMA(__half, "f16", 48, KBIT_D24, "{%24, %25, %26, %27}, %28", KBIT_ACC16(0), KBIT_ACC4(4),
           KBIT_ACC4(5))
KBIT_WGMMA(__nv_bfloat16, "bf16", 48, KBIT_D24, "{%24, %25, %26, %27}, %28", KBIT_ACC16(0),
           KBIT_ACC4(4), KBIT_ACC4(5))
KBIT_WGMMA(__half, "f16", 64, KBIT_D32, "{%32, %33, %34, %35}, %36", KBIT_ACC32(0))
KBIT_WGMMA(__nv_bfloat16, "bf16", 64, KBIT_D32, "{%32, %33, %34, %35}, %36", KBIT_ACC32(0))
KBIT_WGMMA(__half, "f16", 128, KBIT_D64, "{%64, %65, %66, %67}, %68", KBIT_ACC32(0),
           KBIT_ACC32(8))
KBIT_WGMMA(__nv_bfloat16, "bf16", 128, KBIT_D64, "{%64, %65, %66, %67}, %68", KBIT_ACC32(0),
           KBIT_ACC32(8))
// N = 144 and 160 (the grouped launch's 144- and 160-row problems): 72 and 80 D registers.
#define KBIT_D72 KBIT_D64 ", %64, %65, %66, %67, %68, %69, %70, %71"
#define KBIT_D80 KBIT_D72 ", %72, %73, %74, %75, %76, %77, %78, %79"
KBIT_WGMMA(__half, "f16", 144, KBIT_D72, "{%72, %73, %74, %75}, %76", KBIT_ACC32(0),
           KBIT_ACC32(8), KBIT_ACC4(16), KBIT_ACC4(17))
KBIT_WGMMA(__nv_bfloat16, "bf16", 144, KBIT_D72, "{%72, %73, %74, %75}, %76", KBIT_ACC32(0),
           KBIT_ACC32(8), KBIT_ACC4(16), KBIT_ACC4(17))
KBIT_WGMMA(__half, "f16", 160, KBIT_D80, "{%80, %81, %82, %83}, %84", KBIT_ACC32(0),
           KBIT_ACC32(8), KBIT_ACC16(16))
KBIT_WGMMA(__nv_bfloat16, "bf16", 160, KBIT_D80, "{%80, %81, %82, %83}, %84", KBIT_ACC32(0),
           KBIT_ACC32(8), KBIT_ACC16(16))
// N = 192 and 256 (the slab-staged launch, M_TILES 24 and 32): 96 and 128 D registers.
#define KBIT_D96 \
  KBIT_D80 ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define KBIT_D128                                                                            \
  KBIT_D96 ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, " \
           "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "   \
           "%123, %124, %125, %126, %127"
KBIT_WGMMA(__half, "f16", 192, KBIT_D96, "{%96, %97, %98, %99}, %100", KBIT_ACC32(0),
           KBIT_ACC32(8), KBIT_ACC32(16))
KBIT_WGMMA(__nv_bfloat16, "bf16", 192, KBIT_D96, "{%96, %97, %98, %99}, %100", KBIT_ACC32(0),
           KBIT_ACC32(8), KBIT_ACC32(16))
KBIT_WGMMA(__half, "f16", 256, KBIT_D128, "{%128, %129, %130, %131}, %132", KBIT_ACC32(0),
           KBIT_ACC32(8), KBIT_ACC32(16), KBIT_ACC32(24))
KBIT_WGMMA(__nv_bfloat16, "bf16", 256, KBIT_D128, "{%128, %129, %130, %131}, %132", KBIT_ACC32(0),
           KBIT_ACC32(8), KBIT_ACC32(16), KBIT_ACC32(24))
#endif

__device__ __forceinline__ void wgmma_fence(unsigned (&a)[2][4]) {
#if KBIT_HAS_WGMMA
  // The A fragments are operands so that their writes stay before the fence.
  asm volatile("wgmma.fence.sync.aligned;\n"
               : "+r"(a[0][0]), "+r"(a[0][1]), "+r"(a[0][2]), "+r"(a[0][3]), "+r"(a[1][0]),
                 "+r"(a[1][1]), "+r"(a[1][2]), "+r"(a[1][3])::"memory");
#endif
}
// The same, with the two descriptors the block's wgmmas read as operands too
// (slab staging; added while chasing ptxas's C7513 serialization, which the
// named barriers fixed: the plain fence gives the same instruction count, this
// is the form that was measured).
__device__ __forceinline__ void wgmma_fence(unsigned (&a)[2][4], unsigned long long (&desc)[2]) {
#if KBIT_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n"
               : "+r"(a[0][0]), "+r"(a[0][1]), "+r"(a[0][2]), "+r"(a[0][3]), "+r"(a[1][0]),
                 "+r"(a[1][1]), "+r"(a[1][2]), "+r"(a[1][3]), "+l"(desc[0]), "+l"(desc[1])::"memory");
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

// mbarriers: the producer's wait for its tensor copies (a wait loop: only
// where no wgmma is in flight, or ptxas serializes them).
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
#if KBIT_HAS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(
                   (unsigned)__cvta_generic_to_shared(bar)), "r"(count) : "memory");
#endif
}
// Arrives and adds `bytes` to the transaction count the phase waits for.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
#if KBIT_HAS_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   (unsigned)__cvta_generic_to_shared(bar)), "r"(bytes) : "memory");
#endif
}
// Waits until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
#if KBIT_HAS_WGMMA
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "KBIT_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra KBIT_WAIT;\n"
      "}\n" ::"r"((unsigned)__cvta_generic_to_shared(bar)), "r"(parity) : "memory");
#endif
}
// The tensor copy engine: box (x, y) of the 2-D tensor map at `map` (global
// memory, written by the host) into shared memory at `dst`, completing on
// `bar`. Rows and columns outside the tensor are zero-filled.
__device__ __forceinline__ void tensormap_acquire(const void* map) {
#if KBIT_HAS_WGMMA
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
#endif
}
__device__ __forceinline__ void tma_load_2d(unsigned dst, const void* map, int x, int y,
                                            unsigned long long* bar) {
#if KBIT_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst), "l"(map), "r"(x), "r"(y),
      "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
#endif
}
// Named barriers (bar.sync / bar.arrive; id 0 is __syncthreads'): the
// warp-specialised launch's hand-offs. `count` threads, whole warps.
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Four 8x8 b16 matrices of a warp's fragments (register i: matrix i, lane
// (g, t) holding row g, columns 2t and 2t + 1) into shared memory, each
// transposed: row j of stored matrix i (its column j) at the 16-byte aligned
// address lane 8i + j gives.
__device__ __forceinline__ void stmatrix_x4_trans(unsigned addr, unsigned r0, unsigned r1,
                                                  unsigned r2, unsigned r3) {
#if KBIT_HAS_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
#endif
}
// Register budget of a warpgroup (setmaxnreg: the kernel's entry cap is moved
// between warpgroups; counts are multiples of 8).
template <int REGS> __device__ __forceinline__ void regs_inc() {
#if KBIT_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}
template <int REGS> __device__ __forceinline__ void regs_dec() {
#if KBIT_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}

}  // namespace kbit
