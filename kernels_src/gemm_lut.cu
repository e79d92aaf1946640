// gemm_lut.cu: C = A @ dequant(W).T for k = 2 and one row of A (M = 1) by
// table lookups of four products at a time (LUT-GEMM style), on the mma
// kernels' tiled layout (gemm.py repack_for_gemm: no copy of its own).
//
// Why: at M = 1 the mma kernels decode every weight into an mma fragment,
// scale it and multiply it with a mostly empty B operand; at k = 2 that
// costs more instructions than the H200's bandwidth leaves time for
// (NOTES-gemm.md: "k = 2 on the H200 at M = 1"). Here a byte of codes (four
// 2-bit fields) indexes a 256-entry float table of the four products' sums
// for its four columns of A: one byte-permute for the address, one LDS, one
// add per four weights. Measured (H200, fp16, kernel-only; the prototypes are
// benchmarks/lut_k2_probe.cu): the lookups alone take 33 us on 8192x57344,
// under the weight's best read (35 us); the loads are what is left.
//
// Work: units (row block rb of 128 S rows, K tile c of 256 columns), spread
// evenly over the grid: CTA x takes units [x U / grid, (x + 1) U / grid), so
// a CTA may finish one row block's K range and start the next one's. For each
// unit the CTA builds the K tile's tables (64 groups x 256 entries, 64 KB of
// shared memory), then its 8 warps take one 16-row tile of W each a step
// (tile rb * 8 S + 8 s + warp). At a row block's last unit in the CTA the
// partial sums go to slot (x - first CTA of rb) of the workspace: part[slot][row].
// kbit_gemm_lut<..., SUM = true> then adds row n's slots in slot order into
// C (a fixed order: the same bits on every call).
//
// Tile layout (per 16 x 256 tile, 1 KB): word (kk, 4g + t, q) holds block
// j = 4 kk + q of rows g (bytes 0, 1) and g + 8 (bytes 2, 3); byte ph of a
// row holds the codes of columns 32 j + 16 ph + 2 t + {0, 1, 8, 9} as 2-bit
// fields, so entry i's four codes are (i >> 2e) & 3. Lane 4g + t loads its
// four words of each kk as one 16-byte load (the mma fragment's own): a warp
// step is one whole tile, two loads that each read half of its eight 128-byte
// lines (loads of four whole lines each, with selects, were slower: NOTES
// "The lookup kernel's stalls"). From 8192 rows gemm.py takes the L2_HINT
// variant, whose loads carry the mma kernels' L2 evict_first policy.
//
// Tables: group G = 32 kk + 8 t + 2 q + ph; entry i of group G at word
// i * 64 + G, so a lookup's bank is G mod 32 = 8 t + 2 q + ph. The 8 lanes of
// one t take their 8 (q, ph) in an order rotated by g (lookup_group below),
// so the 32 lanes of a warp hit 32 banks at every lookup. The address is one
// byte-permute of the index byte and the lane's group offset: the table must
// start at shared-window offset TABLE_AT (the reserved shared memory before
// the dynamic allocation; gemm.py passes the device's), which the kernel
// checks at entry.
//
// Sums: per tile a lane adds its two lookups of each (row, block) (the two
// column halves ph); two shuffle rounds over t leave lane t with row
// g + 8 (t >> 1), blocks 4 (t & 1) .. + 3, whose scales are one 4-byte word
// of the tile's scales; four FFMA into one accumulator per tile. fp32
// throughout (codebook entries, activations and products are not rounded to
// fp16 first): within FORMAT.md section 7 of the reference.
#include "common.cuh"
// (mma_common.cuh: ldg_weight and its L2 policy, the L2_HINT loads)
#include "mma_common.cuh"

namespace kbit {

constexpr int kLutWarps = 8;           // _jit.py mirrors it (GEMM_LUT_THREADS = 32 * kLutWarps)
// Dynamic shared memory: the tables (64 groups x 256 entries x 4 bytes), then
// the E4M4 decode table (256 floats); _jit.py's GEMM_LUT_SHARED is their sum.
constexpr int kLutTableBytes = 65536;
// The next unit's first tiles loaded during this unit's last ones (and so
// across the table build): sm_90 only, where it fits 128 registers (sm_80
// spills 32 bytes; there each unit loads its first tiles before its build).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kLutNextUnit = true;
#else
constexpr bool kLutNextUnit = false;
#endif
// The table build's four values of A for the next unit loaded with its first
// tiles, so the build does not wait for them: sm_90 only too (sm_80 spills
// 32 bytes). ncu of the build loading them itself (8192x57344, d31822c): 5%
// of the stall samples waited on them; 1.3-2.9% less time on the four large
// layers, fp16 and bf16, the same bits (H200, define_ab_h200_lut_a_early_*_4486dbb.txt;
// loading them just before the build's barrier instead was 2.4-5.4% slower).
constexpr bool kLutAEarly = kLutNextUnit;

// The order in which lane (g, t) takes its 8 (q, ph) groups of a (kk, row):
// lookup jp = 2m + e is q = (m + (g >> 1)) & 3, ph = e ^ (g & 1). The 8 lanes
// of one t take 8 different groups at each jp, and jp = 2m, 2m + 1 are one
// block's two halves (summed before the shuffles).
__device__ __forceinline__ int lookup_group(int jp, int g) {
  return 2 * (((jp >> 1) + (g >> 1)) & 3) + ((jp & 1) ^ (g & 1));
}

// The table entry at byte offset `addr` from the table's start (the
// immediate form: no add before the load).
template <int TABLE_AT>
__device__ __forceinline__ float lut_load(unsigned addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(v) : "r"(addr), "n"(TABLE_AT));
  return v;
}

template <typename T> __device__ __forceinline__ float2 load_pair(const T* p);
template <> __device__ __forceinline__ float2 load_pair(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}
template <> __device__ __forceinline__ float2 load_pair(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }

// The table build's four values of A of thread group gg (two values of T in
// each word; zero where past K_dim: 0.0 in both types) for K tile c.
template <typename T>
__device__ __forceinline__ void lut_load_a(const T* __restrict__ A, int c, int gg, int K_dim, unsigned& a01,
                                           unsigned& a23) {
  const int col = c * 256 + 32 * (4 * (gg >> 5) + ((gg >> 1) & 3)) + 16 * (gg & 1) + 2 * ((gg >> 3) & 3);
  a01 = a23 = 0u;
  if (col < K_dim) {  // (K_dim % 32 == 0: a group is wholly in or out)
    a01 = __ldg(reinterpret_cast<const unsigned*>(A + col));
    a23 = __ldg(reinterpret_cast<const unsigned*>(A + col + 8));
  }
}

// A read-only load of a weight word: with mma_common.cuh's L2 evict_first
// policy where HINT (the L2_HINT variant), a plain __ldg where not.
template <bool HINT, typename V>
__device__ __forceinline__ V lut_ldg(const V* p, unsigned long long policy) {
  if constexpr (HINT) return ldg_weight(p, policy);
  else return __ldg(p);
}

// The CTA that takes unit u of `units` over `ctas` CTAs (the largest x with
// x * units / ctas <= u).
__device__ __forceinline__ int lut_cta_of(long long u, long long units, long long ctas) {
  return (int)(((u + 1) * ctas - 1) / units);
}

template <int S,         // 16-row tiles a warp takes per unit (rows per row block: 128 S)
          int G,         // tiles a warp loads ahead, twice (two register groups)
          typename T,    // activations and C: __half or __nv_bfloat16
          int TABLE_AT,  // shared-window offset of the dynamic shared memory
          bool SUM,      // false: the lookups into part; true: part's slots into C
          bool L2_HINT = false>  // the weight loads with mma_common.cuh's L2 evict_first policy
__global__ void __launch_bounds__(32 * kLutWarps, 2)
    kbit_gemm_lut(const uint4* __restrict__ tiles, const unsigned* __restrict__ scales,
                  const float* __restrict__ codebook, const T* __restrict__ A, float* __restrict__ part,
                  T* __restrict__ C, int N, int K_dim, int kt_n, int rt_n, int units, int ctas) {
  static_assert(S % G == 0, "whole load groups");
  if constexpr (SUM) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const long long rb = n / (128 * S);
    const int first = lut_cta_of(rb * kt_n, units, ctas), last = lut_cta_of(rb * kt_n + kt_n - 1, units, ctas);
    float s = 0.0f;
    for (int slot = 0; slot <= last - first; ++slot) s += part[(long long)slot * N + n];
    C[n] = from_float<T>(s);
    return;
  } else {
    extern __shared__ __align__(16) float smem[];  // the tables, then the scale decode table
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int u0 = (int)((long long)blockIdx.x * units / ctas);
    const int u1 = (int)((long long)(blockIdx.x + 1) * units / ctas);
    if (tid == 0 && (unsigned)__cvta_generic_to_shared(smem) != (unsigned)TABLE_AT) __trap();
    smem[kLutTableBytes / 4 + tid] = e4m4_decode((unsigned)tid);  // 256 threads, 256 codes
    const int g = lane >> 2, t = lane & 3;
    // Each lane takes its own row (g + 8 (t >> 1)) and its own K half (kk = t & 1)
    // as "mine" and the others as "theirs": the two shuffle rounds below then
    // send "theirs" and keep "mine" without selects. row_sel[0] gathers mine's
    // bytes, row_sel[1] theirs'; w[0] is loaded from kk = t & 1.
    const unsigned row_sel[2] = {(t >> 1) ? 0x7632u : 0x5410u, (t >> 1) ? 0x5410u : 0x7632u};
    // byte-permute selectors: R0 / R1 = a row's group bytes in lookup order;
    // LB[x][p]: the group offsets (4 G) of lookups 2p and 2p + 1 in bytes 0, 1
    // of K half x (0: mine)
    unsigned order_lo = 0, order_hi = 0, LB[2][4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      order_lo |= (unsigned)lookup_group(m, g) << (4 * m);
      order_hi |= (unsigned)lookup_group(m + 4, g) << (4 * m);
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const unsigned lb = (unsigned)(4 * (8 * t + lookup_group(2 * p, g))) |
                          ((unsigned)(4 * (8 * t + lookup_group(2 * p + 1, g))) << 8);
      LB[0][p] = (t & 1) ? lb | 0x8080u : lb;  // kk = 1: groups 32..63
      LB[1][p] = (t & 1) ? lb : lb | 0x8080u;
    }
    // the scale word's byte q to byte (q - (g >> 1)) & 3: the order of the pair sums
    unsigned scale_order = 0;
#pragma unroll
    for (int m = 0; m < 4; ++m) scale_order |= (unsigned)((m + (g >> 1)) & 3) << (4 * m);
    const float cb0 = codebook[0], cb1 = codebook[1], cb2 = codebook[2], cb3 = codebook[3];
    // table building: thread (group gg, quarter q4) writes entries q4 * 64 .. + 63 of group gg
    const int gg = lane + 32 * (warp & 1), q4 = warp >> 1;
    const int scale_word = ((g + 8 * (t >> 1)) * 8 + 4 * (t & 1)) >> 2;  // of a tile's 32
    const int lane_word = lane + 32 * (t & 1);                           // w[0]'s 16 bytes (w[1]: ^ 32)
    const unsigned step_tiles = kLutWarps * (unsigned)kt_n;              // tiles between a warp's steps

    // The loads of unit u's group grp into one of two register groups. The
    // first group of the next unit is loaded during the last group of this
    // one (kLutNextUnit).
    uint4 wv[2][G][2];
    unsigned sv[2][G];
    const unsigned long long policy = L2_HINT ? weight_l2_policy() : 0ull;
    auto load_group = [&](int u, int grp, uint4 (*w)[2], unsigned* sc) {
      const int rb = u / kt_n, c = u - rb * kt_n;
      const int tile0 = rb * kLutWarps * S + warp;
      const int steps = (rt_n - tile0 + kLutWarps - 1) / kLutWarps;  // tiles of this warp that exist
      const uint4* w_ptr = tiles + ((long long)tile0 * kt_n + c) * 64 + lane_word;
      const uint4* w_ptr1 = w_ptr + ((t & 1) ? -32 : 32);  // the other K half
      const unsigned* s_ptr = scales + ((long long)tile0 * kt_n + c) * 32 + scale_word;
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const unsigned s = grp * G + i;
        w[i][0] = w[i][1] = make_uint4(0u, 0u, 0u, 0u);
        sc[i] = 0u;
        if ((int)s < steps) {
          w[i][0] = lut_ldg<L2_HINT>(w_ptr + s * step_tiles * 64u, policy);
          w[i][1] = lut_ldg<L2_HINT>(w_ptr1 + s * step_tiles * 64u, policy);
          sc[i] = lut_ldg<L2_HINT>(s_ptr + s * step_tiles * 32u, policy);
        }
      }
    };
    static_assert((S / G) % 2 == 0, "a unit starts in register group 0");
    if (u0 < u1) load_group(u0, 0, wv[0], sv[0]);

    unsigned a_next01 = 0u, a_next23 = 0u;  // (kLutAEarly) the next unit's values of A
    if (kLutAEarly && u0 < u1) lut_load_a(A, u0 % kt_n, gg, K_dim, a_next01, a_next23);
    float acc[S];
    for (int u = u0; u < u1; ++u) {
      const int rb = u / kt_n, c = u - rb * kt_n;
      if (u == u0 || c == 0) {
#pragma unroll
        for (int s = 0; s < S; ++s) acc[s] = 0.0f;
      }
      if (!kLutNextUnit && u > u0) load_group(u, 0, wv[0], sv[0]);
      __syncthreads();  // the previous unit's lookups are done
      {
        unsigned a01 = a_next01, a23 = a_next23;
        if (!kLutAEarly) lut_load_a(A, c, gg, K_dim, a01, a23);
        const float2 x01 = load_pair(reinterpret_cast<const T*>(&a01));
        const float2 x23 = load_pair(reinterpret_cast<const T*>(&a23));
        const float cb[4] = {cb0, cb1, cb2, cb3};
        float p01[16];  // codes (a & 3, a >> 2) of columns 0 and 1
#pragma unroll
        for (int a = 0; a < 16; ++a) p01[a] = x01.x * cb[a & 3] + x01.y * cb[a >> 2];
        const float x3c = x23.y * (q4 == 0 ? cb0 : q4 == 1 ? cb1 : q4 == 2 ? cb2 : cb3);
        const float p23[4] = {x23.x * cb0 + x3c, x23.x * cb1 + x3c, x23.x * cb2 + x3c, x23.x * cb3 + x3c};
#pragma unroll
        for (int ii = 0; ii < 64; ++ii) smem[(q4 * 64 + ii) * 64 + gg] = p01[ii & 15] + p23[ii >> 4];
      }
      __syncthreads();
#pragma unroll
      for (int grp = 0; grp < S / G; ++grp) {
        const int cur = grp & 1;
        if (grp + 1 < S / G) load_group(u, grp + 1, wv[cur ^ 1], sv[cur ^ 1]);
        else if (kLutNextUnit && u + 1 < u1) load_group(u + 1, 0, wv[cur ^ 1], sv[cur ^ 1]);
        if (kLutAEarly && grp + 1 == S / G && u + 1 < u1) lut_load_a(A, (u + 1) % kt_n, gg, K_dim, a_next01, a_next23);
#pragma unroll
        for (int i = 0; i < G; ++i) {
          float pair[16];  // index 8 x + 4 y + m: row x (0: mine), K half y (0: mine), block m in lookup order
#pragma unroll
          for (int y = 0; y < 2; ++y) {
            const uint4 w = wv[cur][i][y];
#pragma unroll
            for (int x = 0; x < 2; ++x) {
              const unsigned X0 = __byte_perm(w.x, w.y, row_sel[x]);  // groups q = 0, 1
              const unsigned X1 = __byte_perm(w.z, w.w, row_sel[x]);  // q = 2, 3
              const unsigned R0 = __byte_perm(X0, X1, order_lo), R1 = __byte_perm(X0, X1, order_hi);
              float v[8];
#pragma unroll
              for (int jp = 0; jp < 8; ++jp) {
                // byte 0: the group offset, byte 1: the index, bytes 2, 3: zero (LB's)
                const unsigned sel = (4u + (jp & 1)) | ((unsigned)(jp & 3) << 4) | 0x6600u;
                v[jp] = lut_load<TABLE_AT>(__byte_perm(jp < 4 ? R0 : R1, LB[y][jp >> 1], sel));
              }
#pragma unroll
              for (int m = 0; m < 4; ++m) pair[8 * x + 4 * y + m] = v[2 * m] + v[2 * m + 1];
            }
          }
          // over t: xor 2 (the other row's lanes) then xor 1 (the other K half's)
          float r8[8];
#pragma unroll
          for (int m = 0; m < 8; ++m) r8[m] = pair[m] + __shfl_xor_sync(kFullMask, pair[8 + m], 2);
          const unsigned sw = __byte_perm(sv[cur][i], 0u, scale_order);
          float a = acc[grp * G + i];
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const float r = r8[m] + __shfl_xor_sync(kFullMask, r8[4 + m], 1);
            a = fmaf(r, lut_load<TABLE_AT>(kLutTableBytes + (((sw >> (8 * m)) & 255u) << 2)), a);
          }
          acc[grp * G + i] = a;
        }
      }
      if (u == u1 - 1 || c == kt_n - 1) {
        // the row block's partial sums: lanes t and t ^ 1 hold the two block halves
        const int tile0 = rb * kLutWarps * S + warp;
        const int slot = (int)blockIdx.x - lut_cta_of((long long)rb * kt_n, units, ctas);
#pragma unroll
        for (int s = 0; s < S; ++s) {
          const float v = acc[s] + __shfl_xor_sync(kFullMask, acc[s], 1);
          const int row = (tile0 + kLutWarps * s) * 16 + g + 8 * (t >> 1);
          if ((t & 1) == 0 && row < N) part[(long long)slot * N + row] = v;
        }
      }
    }
  }
}

}  // namespace kbit
