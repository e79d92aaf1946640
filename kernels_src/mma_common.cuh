// mma_common.cuh: what the tensor-core GEMM kernels share (gemm_mma.cu,
// gemm_latency.cu): the mma.sync wrappers per activation type, the lane's
// index-string field access, the pair-table addressing, scale helpers.
#pragma once
#include "common.cuh"

namespace kbit {

// Phase stamps of the benchmark builds (gemm_latency.cu's latency_phase,
// gemm_mma.cu's mma_phase): the global timer (ns) and this SM's clock, to
// p[0] and p[1].
__device__ __forceinline__ void stamp_clocks(unsigned long long* p) {
  unsigned long long t, c;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory");
  p[0] = t;
  p[1] = c;
}

// Programmatic dependent launch (sm_90). gemm.py may launch the GEMM kernels with
// CUDA's programmatic-stream-serialization attribute, so that a launch queued
// behind another kernel starts as that kernel's CTAs exit (the implicit
// trigger: the kernels never call launch_dependents, which measured slower
// at M = 1 on the H100: the next grid's CTAs took SM slots early and unevenly)
// instead of after its grid has completed. Every CTA first waits until the
// kernels before it have completed and their writes are visible: nothing in
// a kernel touches memory before that, so it reads A, the workspace and
// the counters exactly as a serialized launch would. Without the attribute,
// or before sm_90, the wait is a no-op.
__device__ __forceinline__ void grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Thread-block clusters (sm_90: gemm_latency.cu's cluster split, gemm_mma.cu's
// split K on the Hopper path; no-ops before sm_90).
__device__ __forceinline__ int cluster_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return (int)r;
}
__device__ __forceinline__ int cluster_ranks() {
  unsigned n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
  return (int)n;
}
// Every thread of every CTA of the cluster arrives; shared-memory writes
// before it are visible to the cluster's reads after it (release / acquire).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// The exit barrier: arrive without release semantics, then wait. A thread's
// reads of the other CTAs' shared memory have returned before it arrives, so
// no fence is needed: both cluster sums load only for an output quad whose
// element (n, m) is stored, and that store reads every loaded value (the
// scoreboard waits for each load). A release arrive would also wait for the
// thread's stores of C. H100, kernel-only, this and no CTA
// barrier before the first cluster barrier against both barriers release and
// the CTA barrier (ceaf320's KBIT_CLUSTER_LEAN_SYNC, same bits): 1.04-1.11x on
// the small layers at 17..64 rows (define_ab_h100_ceaf320_cluster_lean_sync.txt).
__device__ __forceinline__ void cluster_sync_exit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n"
               "barrier.cluster.wait.aligned;\n" ::: "memory");
#endif
}
// The float4 at shared address `addr` (16-byte aligned, this CTA's layout) in
// CTA `rank` of the cluster.
__device__ __forceinline__ float4 ld_cluster_f32x4(unsigned addr, int rank) {
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
#endif
  return v;
}

// Lane-replicated decode tables in shared memory (gemm_mma.cu's PRMT table,
// k = 2's byte table, the pair tables of k = 3..5; gemm_latency.cu's k = 3
// pair table): the entry for this lane of byte (or pair) v sits at the
// table's address + 256 v + lane_off. KBIT_TAB_UNIFORM_BASE 1 (default): the
// table's address goes through one redux.sync (every lane holds the same
// value), which leaves it in a uniform register, and each lookup is one
// LDS [R + UR]; 0: ptxas kept the address of the tables after the stages (and
// of the latency kernel's static one) in an ordinary register and added it
// to each lookup's offset, one IMAD.IADD per lookup. sm_90a, instructions per
// two K tiles of the main loop (benchmarks/sass_loop.py): k = 2's 8-warp
// launch at two row tiles 1103 -> 984, k = 4's 8-warp launch 799 -> 673, k = 5's
// 16-warp launch 967 -> 846; the whole k = 3 latency kernel 2424 -> 2232. The
// 4-warp launches' static pair table was already in a uniform register.
#ifndef KBIT_TAB_UNIFORM_BASE
#define KBIT_TAB_UNIFORM_BASE 1
#endif
// The table's shared address for tab_lookup (every lane of the warp active).
__device__ __forceinline__ unsigned tab_base(const void* tab) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(tab);
#if KBIT_TAB_UNIFORM_BASE
  return __reduce_or_sync(0xffffffffu, a);
#else
  return a;
#endif
}
// The 4 (V = unsigned) or 8 (uint2) bytes at shared address `a`.
template <typename V>
__device__ __forceinline__ V lds(unsigned a) {
  V v;
  if constexpr (sizeof(V) == 8) {
    asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a) : "memory");
  } else {
    asm("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
  }
  return v;
}
// The entry at table address `base` + 256 * (byte `sel` of `word`) + lane_off
// (lane_off < 256).
template <typename V>
__device__ __forceinline__ V tab_lookup(unsigned base, unsigned lane_off, unsigned word, unsigned sel) {
  return lds<V>(base + __byte_perm(word, lane_off, 0x5504u | (sel << 4)));
}

// Weight tiles and scales are read once per call: their loads carry an L2
// evict_first policy (KBIT_WEIGHT_L2_HINT 1, the default), so a weight's lines
// are the first to go and what else lives in L2 (activations, the lines other
// kernels wrote and have not yet written back) stays. H100, k=4, M=1, cold L2
// after a 256 MB overwrite (benchmarks/l2_hint_probe.py): kbit_gemm on
// 4096x28672 41.9 -> 36.5 us, 8192x57344 112.4 -> 109.5 us, and a flat read
// of 4096x28672's bytes 32.3 -> 28.0 us; after a read of 256 MB (L2 full of
// clean lines) 35.7 -> 34.4 us, 104.5 -> 102.7 us, reads unchanged. 0: plain
// __ldg (for A/B runs); 2: evict_first and no L1 allocation (no faster).
#ifndef KBIT_WEIGHT_L2_HINT
#define KBIT_WEIGHT_L2_HINT 1
#endif
__device__ __forceinline__ unsigned long long weight_l2_policy() {
  unsigned long long policy = 0;
#if KBIT_WEIGHT_L2_HINT
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
  return policy;
}
#if KBIT_WEIGHT_L2_HINT == 2
#define KBIT_LD_WEIGHT "ld.global.nc.L1::no_allocate.L2::cache_hint"
#else
#define KBIT_LD_WEIGHT "ld.global.nc.L2::cache_hint"
#endif
// A read-only load of a weight word V (uint4 index words; unsigned or uint2
// scale words) with that policy.
template <typename V>
__device__ __forceinline__ V ldg_weight(const V* p, unsigned long long policy) {
#if KBIT_WEIGHT_L2_HINT
  V v;
  if constexpr (sizeof(V) == 16) {
    asm(KBIT_LD_WEIGHT ".v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
  } else if constexpr (sizeof(V) == 8) {
    asm(KBIT_LD_WEIGHT ".v2.u32 {%0, %1}, [%2], %3;" : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(policy));
  } else {
    static_assert(sizeof(V) == 4, "weight words are 4, 8 or 16 bytes");
    asm(KBIT_LD_WEIGHT ".u32 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(policy));
  }
  return v;
#else
  return __ldg(p);
#endif
}

// mbarriers from sm_80 on (the dense mma.sync launches' ring of A's stages,
// gemm_mma.cu KBIT_A_RING): initialised with `count` arrivals a phase.
__device__ __forceinline__ void ring_bar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"((unsigned)__cvta_generic_to_shared(bar)),
               "r"(count) : "memory");
}
// One arrival (release: this thread's reads of the stage come first).
__device__ __forceinline__ void ring_bar_arrive(unsigned long long* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared.b64 st, [%0];\n}\n" ::"r"(
                   (unsigned)__cvta_generic_to_shared(bar)) : "memory");
}
// One arrival once this thread's cp.async copies issued so far have landed
// (.noinc: counted in the barrier's `count`).
__device__ __forceinline__ void ring_bar_copies_arrive(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(
                   (unsigned)__cvta_generic_to_shared(bar)) : "memory");
}
// Waits until the phase of parity `parity` has completed (acquire).
__device__ __forceinline__ void ring_bar_wait(unsigned long long* bar, unsigned parity) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred done;\nKBIT_RING_WAIT:\n"
      "mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n"
      "@!done bra KBIT_RING_WAIT;\n}\n" ::"r"(a), "r"(parity) : "memory");
#else
  asm volatile(
      "{\n.reg .pred done;\nKBIT_RING_WAIT:\n"
      "mbarrier.test_wait.parity.shared.b64 done, [%0], %1;\n"
      "@!done bra KBIT_RING_WAIT;\n}\n" ::"r"(a), "r"(parity) : "memory");
#endif
}

template <typename T> struct Mma;
template <> struct Mma<__half> {
  __device__ static void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static unsigned to_bits(float v) { return __half_as_ushort(__float2half_rn(v)); }
  __device__ static unsigned mul2(unsigned x, unsigned y) {
    __half2 r = __hmul2(*reinterpret_cast<__half2*>(&x), *reinterpret_cast<__half2*>(&y));
    return *reinterpret_cast<unsigned*>(&r);
  }
  __device__ static void store(__half* p, float v) { *p = __float2half_rn(v); }
};
template <> struct Mma<__nv_bfloat16> {
  __device__ static void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static unsigned to_bits(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  __device__ static unsigned mul2(unsigned x, unsigned y) {
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&x),
                               *reinterpret_cast<__nv_bfloat162*>(&y));
    return *reinterpret_cast<unsigned*>(&r);
  }
  __device__ static void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
};

// s += v, element by element (the cluster reductions' sums, in their order).
__device__ __forceinline__ void add_f32x4(float4& s, const float4& v) {
  s.x += v.x;
  s.y += v.y;
  s.z += v.z;
  s.w += v.w;
}

// The four values of an m16n8 accumulator lane for rows n, n + 8 of W and
// m, m + 1 of A (.x .. .w: (n, m), (n, m + 1), (n + 8, m), (n + 8, m + 1)),
// stored to C [rows][N] where in bounds (the cluster reductions).
template <typename T>
__device__ __forceinline__ void store_acc_quad(T* C, int N, int rows, int n, int m, float4 s) {
  if (n < N && m < rows) Mma<T>::store(C + (long long)m * N + n, s.x);
  if (n < N && m + 1 < rows) Mma<T>::store(C + (long long)(m + 1) * N + n, s.y);
  if (n + 8 < N && m < rows) Mma<T>::store(C + (long long)m * N + n + 8, s.z);
  if (n + 8 < N && m + 1 < rows) Mma<T>::store(C + (long long)(m + 1) * N + n + 8, s.w);
}

// An m16n8 accumulator quad (lane (g, t): W rows n = g, g + 8 by A rows m =
// 2t, 2t + 1, as a[0] (n, m), a[1] (n, m + 1), a[2] (n + 8, m), a[3]
// (n + 8, m + 1)) transposed across the warp by two shuffles, so that each
// lane holds four consecutive columns of one row of C: row 2t + (g & 1),
// columns quad_store_col(lane) .. + 3 of the 16, as 8 bytes of T (one
// 8-byte store instead of four 2-byte ones). Every lane of the warp calls it.
// Round 1 (lane ^ 4, g ^ 1): even g keeps row 2t, odd g row 2t + 1, each
// sends the other row's pair (n, n + 8); round 2 (lane ^ 8, g ^ 2): columns
// g - (g & 1) + (0, 1) and + (8, 9) become four in a row.
__device__ __forceinline__ int quad_store_col(int lane) { return 4 * (lane >> 4) + 8 * ((lane >> 3) & 1); }
template <typename T>
__device__ __forceinline__ uint2 acc_quad_rows(const float (&a)[4], int lane) {
  const bool odd = (lane >> 2) & 1, hi_half = (lane >> 3) & 1;
  const unsigned w02 = (Mma<T>::to_bits(a[2]) << 16) | Mma<T>::to_bits(a[0]);  // (n, n + 8) of row m
  const unsigned w13 = (Mma<T>::to_bits(a[3]) << 16) | Mma<T>::to_bits(a[1]);  // of row m + 1
  const unsigned keep = odd ? w13 : w02;
  const unsigned recv = __shfl_xor_sync(kFullMask, odd ? w02 : w13, 4);  // the neighbour column's pair
  // columns (n0, n0 + 1) and (n0 + 8, n0 + 9) of this lane's row, n0 = g - (g & 1)
  const unsigned x = __byte_perm(keep, recv, odd ? 0x1054 : 0x5410);
  const unsigned y = __byte_perm(keep, recv, odd ? 0x3276 : 0x7632);
  const unsigned other = __shfl_xor_sync(kFullMask, hi_half ? x : y, 8);
  return hi_half ? make_uint2(other, y) : make_uint2(x, other);
}

// Bits [off, off + 32) of a lane's index string (off is a compile-time constant).
template <int K>
__device__ __forceinline__ unsigned field_at(const unsigned (&w)[4 * K], int off) {
  const int word = off >> 5, shift = off & 31;
  if (shift == 0) return w[word];
  if (word + 1 >= 4 * K) return w[word] >> shift;
  return __funnelshift_r(w[word], w[word + 1], shift);
}

// Byte offset in the pair table (entry = the 2K bits at `off`, 128 bytes per
// entry, this lane's word): the string shifted so that those bits land at bit
// 7, masked, or-ed with 4 * lane. Two ALU instructions.
template <int K>
__device__ __forceinline__ unsigned pair_offset(const unsigned (&w)[4 * K], int off,
                                                unsigned lane4) {
  constexpr unsigned kMask = ((1u << (2 * K)) - 1) << 7;
  const unsigned bits = off >= 7 ? field_at<K>(w, off - 7) : w[0] << (7 - off);
  return (bits & kMask) | lane4;
}

// An fp16 scale (low 16 bits of `bits`) as a (scale, scale) pair in T.
template <typename T>
__device__ __forceinline__ unsigned fp16_scale_pair(unsigned bits) {
  const unsigned h = Mma<T>::to_bits(__half2float(__ushort_as_half((unsigned short)(bits & 0xffffu))));
  return h | (h << 16);
}

template <typename T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<__half> { static constexpr bool value = true; };

// KBIT_BF16_ALU_SCALE 1 (default): bf16 activations compute the pair too
// (kAluScale); 0: they read the table (for A/B runs). H100, kernel-only, auto,
// in one process against the table (define_ab_h100_a7cb121_bf16_alu_scale.txt),
// the same scale pairs: k=2 +2..10%, k=3 +1..5%, k=4 0..+13% (4096x4096 at
// M=16), k=5 +1..5% on 4096x4096 .. 8192x57344 at M = 1..64; 2048x768 -2..+3%.
#ifndef KBIT_BF16_ALU_SCALE
#define KBIT_BF16_ALU_SCALE 1
#endif

// The fold (the FOLD template argument of gemm_mma.cu and gemm_latency.cu,
// which the host chooses per weight and launch: gemm._cb_fold; or KBIT_CB_FOLD
// 1, an A/B knob for every variant, default 0): where the scale pair is computed
// (kAluScale) and multiplies the weights (not the scale after the multiply),
// the pair's factor (16, 16) in fp16, (2^116, 2^116) in bf16, moves into the
// codebook entries as the kernel converts them (cb_bits: the entry in T, then
// times the factor in T), so the pair is the shifted code itself: one HMUL2
// fewer per block and row. The same bits wherever entry x factor is finite in
// T (the factor is a power of two: (c 2^a)(s 2^-a) is the same product, rounded
// once): |codebook entry| <= 4094 (fp16) or about 4080 (bf16). Larger entries
// overflow to inf: the host keeps such codebooks off the fold.
#ifndef KBIT_CB_FOLD
#define KBIT_CB_FOLD 0
#endif
template <typename T> struct ScaleFold;  // the scale pair's (factor, factor) in T, the factor in float
template <> struct ScaleFold<__half> {
  static constexpr unsigned kPair = 0x4c004c00u;
  static constexpr float kFactor = 16.0f;
};
template <> struct ScaleFold<__nv_bfloat16> {
  static constexpr unsigned kPair = 0x79807980u;
  static constexpr float kFactor = 8.3076749736557242e34f;  // 2^116
};

// A codebook entry as T bits (low half), times the scale pair's factor where
// kFold (KBIT_CB_FOLD): the entry rounded to T (subnormal entries too), then
// times the factor in float, exact, and back to T, exact. (An HMUL2 of the
// zero-extended bits by kPair gave garbage in gemm_latency.cu's k = 2
// one-tile variant on the H200 at f5c0d49: in the SASS of ptxas 13.0 the
// product's high half was an earlier register's, ORed into the k = 2 pair;
// the PTX reads right.) bf16 entries below float's normal range (2^-126)
// flush to zero under -ftz here.
template <typename T, bool kFold>
__device__ __forceinline__ unsigned cb_bits(float c) {
  if constexpr (kFold) return Mma<T>::to_bits(Elem<T>::to_float(T(c)) * ScaleFold<T>::kFactor);
  return Mma<T>::to_bits(c);
}

// (scale, scale) in T of block j (0..7) of one row, from the lane's scale
// words of that row `sw` (E4M4: 4 codes per word; fp16: 2 per word): with
// kAluScale (E4M4 scales) computed, an E4M4 code c as fp16 bits c << 6 being
// exactly s / 16 (byte_perm c into both halves, shift, HMUL2 by (16, 16)),
// as bf16 bits c << 3 exactly s * 2^-116 (HMUL2 by (2^116, 2^116)); kFold
// (KBIT_CB_FOLD: the factor is in the codebook) without the HMUL2; else
// from the 256-entry table `scale_pair` (E4M4) or converted (fp16 scales).
template <typename T, typename TScale, bool kAluScale, bool kFold = false>
__device__ __forceinline__ unsigned block_scale_pair(const unsigned* sw, int j,
                                                     const unsigned* scale_pair) {
  if constexpr (sizeof(TScale) == 1) {
    if constexpr (kAluScale) {
      const unsigned sel = 0x4040u | ((j & 3) << 8) | (j & 3);  // byte j & 3 -> bytes 0, 2
      if constexpr (kFold)
        return __byte_perm(sw[j >> 2], 0u, sel) << (IsHalf<T>::value ? 6 : 3);
      if constexpr (IsHalf<T>::value)
        return Mma<T>::mul2(__byte_perm(sw[j >> 2], 0u, sel) << 6, ScaleFold<T>::kPair);  // x (16, 16)
      else  // bf16: the bits c << 3 are s * 2^-116 (subnormal codes too), times (2^116, 2^116)
        return Mma<T>::mul2(__byte_perm(sw[j >> 2], 0u, sel) << 3, ScaleFold<T>::kPair);
    } else {
      return scale_pair[(sw[j >> 2] >> (8 * (j & 3))) & 0xffu];
    }
  } else {
    return fp16_scale_pair<T>(sw[j >> 1] >> (16 * (j & 1)));
  }
}

// k = 3's byte lanes (KBIT_K3_BYTE_LANES=1, an A/B knob, off; set
// _jit.GEMM_K3_BYTE_LANES the same, which lays the tiles out so): the lane's
// 12 index words as four groups of three, group G holding blocks 2G and 2G + 1
// (pairs P = 0..15: P = 8 (block - 2G) + 4 h + p). Pair P < 12 sits in the low
// 6 bits of byte P mod 4 of word P / 4 of the group (masked once a word,
// then one PRMT makes its table offset); pair 12 + s takes the top two bits
// of byte s of the group's words 0, 1, 2 as its bits 0-1, 2-3, 4-5 (three
// shifts and three masks give all four). The pair table has 256-byte
// entries (16 KB) for the PRMT. Per 16 pairs 3 + 6 + 16 ALU instructions
// instead of 32 (a funnel shift and a LOP3 a pair), the same 16 loads; the
// same pairs, so the same bits. gemm.py repack_for_gemm lays it out.
#ifndef KBIT_K3_BYTE_LANES
#define KBIT_K3_BYTE_LANES 0
#endif
template <int K>
constexpr bool kByteLanes = K == 3 && KBIT_K3_BYTE_LANES;
// uint4 per pair-table entry: 8 (128 bytes, the 32 lanes' words), 16 with
// byte lanes (the offset byte << 8 of a PRMT; the upper half unused)
template <int K>
constexpr int kPairEntryU4 = kByteLanes<K> ? 16 : 8;
// Where the pair tables' builders store uint4 i (i < 8 x pairs; 8 a pair):
// i itself, or with byte lanes at 16 a pair.
template <int K>
__device__ __forceinline__ int pair_tab_slot(int i) {
  return kByteLanes<K> ? (i >> 3) * 16 + (i & 7) : i;
}

// Pair f / 2 of k = 3's byte-lane string `w` (see kByteLanes): its entry of
// the 256-byte-entry pair table at `pair_base`.
__device__ __forceinline__ unsigned k3_byte_lane_pair(const unsigned (&w)[12], int f, unsigned pair_base,
                                                      unsigned lane4) {
  const int group = f >> 5, P = (f >> 1) & 15;
  const unsigned* g = w + 3 * group;
  unsigned word;
  if (P < 12) {
    word = g[P >> 2] & 0x3f3f3f3fu;
  } else {
    word = ((g[0] >> 6) & 0x03030303u) | ((g[1] >> 4) & 0x0c0c0c0cu) | ((g[2] >> 2) & 0x30303030u);
  }
  return tab_lookup<unsigned>(pair_base, lane4, word, P & 3);
}

// The codebook entries of fields f and f + 1 of the lane's index string `w`
// as a pair in T: k = 2 one shuffle of the lane-register pair table
// `cb_pair` (lane a | b << 2 holds (codebook[a], codebook[b])); with
// kPairTable (k = 3, 4, 5) one load from the lane-replicated pair table in
// shared memory at address `pair_base` (tab_base); otherwise two shuffles of
// the lane-register codebook `cb` (lane j holds codebook[j mod 2^K]) and a
// byte_perm.
template <int K, bool kPairTable>
__device__ __forceinline__ unsigned weight_pair(const unsigned (&w)[4 * K], int f, unsigned cb,
                                                unsigned cb_pair, unsigned pair_base,
                                                unsigned lane4) {
  if constexpr (K == 2) {
    return __shfl_sync(kFullMask, cb_pair, field_at<K>(w, f * K));
  } else if constexpr (kPairTable && kByteLanes<K>) {
    return k3_byte_lane_pair(w, f, pair_base, lane4);
  } else if constexpr (kPairTable) {
    return lds<unsigned>(pair_base + pair_offset<K>(w, f * K, lane4));
  } else {
    const unsigned e0 = __shfl_sync(kFullMask, cb, field_at<K>(w, f * K));
    const unsigned e1 = __shfl_sync(kFullMask, cb, field_at<K>(w, (f + 1) * K));
    return __byte_perm(e0, e1, 0x5410);
  }
}

// Scale entries a lane loads: 4 codes of one row (the tile layout: gemm_mma.cu).
template <typename TScale> struct ScaleWord;
template <> struct ScaleWord<unsigned char> {
  using Raw = unsigned;
  static constexpr int kBytes = 4;
};
template <> struct ScaleWord<__half> {
  using Raw = uint2;
  static constexpr int kBytes = 8;
};


}  // namespace kbit
