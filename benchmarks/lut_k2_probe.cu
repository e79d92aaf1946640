// Prototype (benchmarks only): k = 2, M = 1 by table lookup of four products
// at a time (LUT-GEMM style), reading FORMAT.md's bit-plane layout directly.
//
// For every group of four consecutive K positions of a 256-column chunk the CTA
// builds a 256-entry float table, entry i = sum_e x[4g + e] * cb[code_e(i)],
// where i = (plane-0 nibble) | (plane-1 nibble) << 4 of the four codes: the
// index a block's two plane words give without unpacking. A lookup then
// stands for four weights (one byte-permute for its address, one LDS, one FADD).
//
// Table layout: word i * 64 + g (g = 8 * block + j, the chunk's 64 groups), so a
// warp whose 32 lanes look up 32 different groups hits 32 banks. Lane roles in
// the lookup loop: block b = lane & 7 of the chunk, row rr = lane >> 3 of the
// warp's four; lanes with the same b & 3 take their 8 groups in a rotated order
// (rot = (b >> 2) + 2 rr) so that at each step the 32 lanes use 32 banks.
//
// Each CTA: 32 * S rows, the chunks [c0, c1) of one split; per lane S float
// accumulators across chunks; the 8 lanes of a row summed by shuffles at the
// end; part[split][row] written. lut_reduce sums the splits in order.
#include <cuda_fp16.h>

#ifndef TABLE_AT
#define TABLE_AT 1024  // the table's shared-window offset (checked at entry)
#endif

template <int S, int G>
__global__ void __launch_bounds__(256, 2)
    lut_k2(const uint2* __restrict__ packed, const unsigned char* __restrict__ absmax,
           const float* __restrict__ codebook, const __half* __restrict__ A, float* __restrict__ part,
           int N, int K_dim, int chunks_per_split, int chunks) {
  extern __shared__ __align__(16) float smem[];  // [256][64] table, then 256 scales
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int KB = K_dim >> 5;
  const int split = blockIdx.y;
  const int c0 = split * chunks_per_split, c1 = min(chunks, c0 + chunks_per_split);
  if (tid == 0 && (unsigned)__cvta_generic_to_shared(smem) != TABLE_AT) __trap();
  {
    const unsigned u = tid;
    smem[16384 + u] = u < 16 ? (float)u * 6.103515625e-05f : __uint_as_float((u << 19) + (116u << 23));
  }
  const int b = lane & 7, rr = lane >> 3;
  const int rot = (b >> 2) + 2 * rr;
  unsigned selA = 0, selB = 0, LB[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int ja = (m + rot) & 7, jb = (m + 4 + rot) & 7;
    selA |= (unsigned)((ja & 1) * 4 + (ja >> 1)) << (4 * m);
    selB |= (unsigned)((jb & 1) * 4 + (jb >> 1)) << (4 * m);
  }
#pragma unroll
  for (int p = 0; p < 4; ++p)
    LB[p] = (unsigned)(4 * (8 * b + ((2 * p + rot) & 7))) | ((unsigned)(4 * (8 * b + ((2 * p + 1 + rot) & 7))) << 8);
  const float cb0 = codebook[0], cb1 = codebook[1], cb2 = codebook[2], cb3 = codebook[3];
  // build roles: group gg of the chunk, quarter q of the 256 entries
  const int gg = lane + 32 * (warp & 1), q = warp >> 1;

  const int row_base = blockIdx.x * 32 * S + warp * 4 + rr;  // + 32 s
  float acc[S];
#pragma unroll
  for (int s = 0; s < S; ++s) acc[s] = 0.0f;

  for (int c = c0; c < c1; ++c) {
    const int kb0 = c * 8;
    // first group's loads before the build (they do not need the table)
    uint2 wv[2][G];
    unsigned sv[2][G];
    // the lane's block of its first row; step s adds 32 s rows (32-bit byte
    // offsets: a layer's 32 rows of blocks are far below 4 GB)
    const long long first = (long long)row_base * KB + kb0 + b;
    const char* pw = reinterpret_cast<const char*>(packed + first);
    const char* ps = reinterpret_cast<const char*>(absmax + first);
    const unsigned wstride = 32u * (unsigned)KB * 8u, sstride = 32u * (unsigned)KB;
    const int nvs = kb0 + b < KB ? (N - row_base + 31) >> 5 : 0;  // steps whose row exists
    auto load_group = [&](int grp, uint2* w, unsigned* sc) {
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const unsigned s = grp * G + i;
        w[i] = make_uint2(0u, 0u);
        sc[i] = 0u;
        if ((int)s < nvs) {
          w[i] = __ldg(reinterpret_cast<const uint2*>(pw + s * wstride));
          sc[i] = __ldg(reinterpret_cast<const unsigned char*>(ps + s * sstride));
        }
      }
    };
    load_group(0, wv[0], sv[0]);
    __syncthreads();  // the previous chunk's lookups are done
    {
      const int kpos = c * 256 + 4 * gg;
      float x0 = 0.f, x1 = 0.f, x2 = 0.f, x3 = 0.f;
      if (kpos < K_dim) {
        const uint2 xv = __ldg(reinterpret_cast<const uint2*>(A + kpos));
        const float2 f01 = __half22float2(*reinterpret_cast<const __half2*>(&xv.x));
        const float2 f23 = __half22float2(*reinterpret_cast<const __half2*>(&xv.y));
        x0 = f01.x; x1 = f01.y; x2 = f23.x; x3 = f23.y;
      }
      const float cb[4] = {cb0, cb1, cb2, cb3};
      float P01[16];
#pragma unroll
      for (int a = 0; a < 16; ++a) {
        const int ca = (a & 1) | ((a >> 2) & 1) << 1, cc = ((a >> 1) & 1) | ((a >> 3) & 1) << 1;
        P01[a] = x0 * cb[ca] + x1 * cb[cc];
      }
      const int hi2 = q & 1, hi3 = q >> 1;
      const float x2l = x2 * (hi2 ? cb2 : cb0), x2h = x2 * (hi2 ? cb3 : cb1);
      const float x3l = x3 * (hi3 ? cb2 : cb0), x3h = x3 * (hi3 ? cb3 : cb1);
      const float P23[4] = {x2l + x3l, x2h + x3l, x2l + x3h, x2h + x3h};
#pragma unroll
      for (int ii = 0; ii < 64; ++ii) {
        const int a = (ii & 3) | ((ii >> 4) & 3) << 2, bb = (ii >> 2) & 3;
        smem[(q * 64 + ii) * 64 + gg] = P01[a] + P23[bb];
      }
    }
    __syncthreads();
#pragma unroll
    for (int grp = 0; grp < S / G; ++grp) {
      const int cur = grp & 1;
      if (grp + 1 < S / G) load_group(grp + 1, wv[cur ^ 1], sv[cur ^ 1]);
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const uint2 w = wv[cur][i];
        const unsigned t = (w.x & 0x0F0F0F0Fu) | ((w.y << 4) & 0xF0F0F0F0u);
        const unsigned u = ((w.x >> 4) & 0x0F0F0F0Fu) | (w.y & 0xF0F0F0F0u);
        const unsigned R0 = __byte_perm(t, u, selA), R1 = __byte_perm(t, u, selB);
        float v[8];
#pragma unroll
        for (int jp = 0; jp < 8; ++jp) {
          const unsigned sel = (4u + (jp & 1)) | ((unsigned)(jp & 3) << 4) | (6u << 8) | (6u << 12);
          const unsigned addr = __byte_perm(jp < 4 ? R0 : R1, LB[jp >> 1], sel);
          asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(v[jp]) : "r"(addr), "n"(TABLE_AT));
        }
        const float p0 = (v[0] + v[2]) + (v[4] + v[6]), p1 = (v[1] + v[3]) + (v[5] + v[7]);
        float scale;
        asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(scale) : "r"(sv[cur][i] << 2), "n"(TABLE_AT + 65536));
        acc[grp * G + i] = fmaf(p0 + p1, scale, acc[grp * G + i]);
      }
    }
  }
#pragma unroll
  for (int s = 0; s < S; ++s) {
    float v = acc[s];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    const int row = row_base + 32 * s;
    if (b == 0 && row < N) part[(long long)split * N + row] = v;
  }
}

__global__ void shared_base(unsigned* out) {
  extern __shared__ __align__(16) float smem[];
  *out = (unsigned)__cvta_generic_to_shared(smem);
}

__global__ void lut_reduce(const float* __restrict__ part, __half* __restrict__ C, int N, int splits) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  float s = 0.f;
  for (int j = 0; j < splits; ++j) s += part[(long long)j * N + n];
  C[n] = __float2half_rn(s);
}
