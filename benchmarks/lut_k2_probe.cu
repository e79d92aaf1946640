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

// LUT_L2_FETCH = 64, 128 or 256 (A/B runs): the weight loads ask L2 to fetch
// that many bytes around each, so a row's next chunks (64 B each) may come
// from L2 on the CTA's next passes.
#ifndef LUT_L2_FETCH
#define LUT_L2_FETCH 0
#endif
#define LUT_STR2(x) #x
#define LUT_STR(x) LUT_STR2(x)
#define LUT_L2_STR LUT_STR(LUT_L2_FETCH)

#ifndef LUT_CHUNK_MAJOR
#define LUT_CHUNK_MAJOR 0
#endif

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
#if LUT_CHUNK_MAJOR
    // (A/B runs) packed and absmax re-laid [chunk][row][8 blocks], blocks past
    // K_dim zero: a CTA's pass over a chunk reads 32 rows' 64 B contiguously
    const long long first = ((long long)c * N + row_base) * 8 + b;
    const unsigned wstride = 32u * 8u * 8u, sstride = 32u * 8u;
    const int nvs = (N - row_base + 31) >> 5;
#else
    const long long first = (long long)row_base * KB + kb0 + b;
    const unsigned wstride = 32u * (unsigned)KB * 8u, sstride = 32u * (unsigned)KB;
    const int nvs = kb0 + b < KB ? (N - row_base + 31) >> 5 : 0;  // steps whose row exists
#endif
    const char* pw = reinterpret_cast<const char*>(packed + first);
    const char* ps = reinterpret_cast<const char*>(absmax + first);
    auto load_group = [&](int grp, uint2* w, unsigned* sc) {
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const unsigned s = grp * G + i;
        w[i] = make_uint2(0u, 0u);
        sc[i] = 0u;
#ifdef PROBE_NO_LOAD  // (diagnostic: wrong results) no weight loads
        w[i] = make_uint2(s * 0x9E3779B9u ^ (unsigned)kb0, s * 0x85EBCA6Bu + (unsigned)first);
        sc[i] = (s * 37u + b) & 255u;
        if (false) {
#else
        if ((int)s < nvs) {
#endif
#if LUT_L2_FETCH
          asm volatile("ld.global.nc.L2::" LUT_L2_STR "B.v2.u32 {%0, %1}, [%2];"
                       : "=r"(w[i].x), "=r"(w[i].y) : "l"(pw + s * wstride));
#else
          w[i] = __ldg(reinterpret_cast<const uint2*>(pw + s * wstride));
#endif
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
#ifdef PROBE_NO_LDS  // (diagnostic: wrong results) no table loads
          v[jp] = __uint_as_float(addr);
#else
          asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(v[jp]) : "r"(addr), "n"(TABLE_AT));
#endif
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

// The staged form (chunk-major layout only): each CTA's pass over a chunk reads
// R = 32 S rows' 64 B contiguously; cp.async copies stages of T CTA steps (32 T
// rows: 2 KB T of weights, 256 T B of scales) into a ring of NSTAGE stages,
// NSTAGE - 1 ahead, across the table builds; a CTA barrier a stage.
template <int S, int T, int NSTAGE>
__global__ void __launch_bounds__(256, 2)
    lut_k2_staged(const uint4* __restrict__ packed, const uint4* __restrict__ absmax,
                  const float* __restrict__ codebook, const __half* __restrict__ A, float* __restrict__ part,
                  int N, int K_dim, int chunks_per_split, int chunks) {
  extern __shared__ __align__(16) float smem[];  // [256][64] table, 256 scales, then the ring
  constexpr int kStageW = 32 * T * 64, kStageS = 32 * T * 8, kStage = kStageW + kStageS;
  constexpr int Q = S / T;  // stages a chunk
  unsigned char* ring = reinterpret_cast<unsigned char*>(smem) + 65536 + 1024;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.y;
  const int c0 = split * chunks_per_split, c1 = min(chunks, c0 + chunks_per_split);
  const int row0 = blockIdx.x * 32 * S;
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
  const int gg = lane + 32 * (warp & 1), q4 = warp >> 1;

  // stage z of this CTA's stream: chunk c0 + z / Q, rows row0 + 32 T (z % Q) ..
  const int Z = (c1 - c0) * Q;
  auto issue = [&](int z) {
    if (z < Z) {
      const int c = c0 + z / Q, r = row0 + 32 * T * (z % Q);
      unsigned char* st = ring + (z % NSTAGE) * kStage;
      const long long wbase = ((long long)c * N + r) * 4;  // 16 B units (64 B a row)
#pragma unroll
      for (int u = tid; u < kStageW / 16; u += 256) {
        const bool ok = r + (u >> 2) < N;
        const unsigned dst = (unsigned)__cvta_generic_to_shared(st + 16 * u);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                     "l"(packed + (ok ? wbase + u : 0)), "r"(ok ? 16 : 0));
      }
      const long long sbase = ((long long)c * N + r) / 2;  // 16 B units (8 B a row; r even)
      if (tid < kStageS / 16) {
        const bool ok = r + 2 * tid < N;  // (the probe pads absmax by 16 B)
        const unsigned dst = (unsigned)__cvta_generic_to_shared(st + kStageW + 16 * tid);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                     "l"(absmax + (ok ? sbase + tid : 0)), "r"(ok ? 16 : 0));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  float acc[S];
#pragma unroll
  for (int s = 0; s < S; ++s) acc[s] = 0.0f;
#pragma unroll
  for (int z = 0; z < NSTAGE - 1; ++z) issue(z);

  for (int c = c0; c < c1; ++c) {
    const int zc = (c - c0) * Q;
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      const int z = zc + q;
      asm volatile("cp.async.wait_group %0;\n" ::"n"(NSTAGE - 2));
      __syncthreads();  // stage z landed for all; stage z - 1 (and the last chunk's table) done with
      issue(z + NSTAGE - 1);
      if (q == 0) {
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
        const int hi2 = q4 & 1, hi3 = q4 >> 1;
        const float x2l = x2 * (hi2 ? cb2 : cb0), x2h = x2 * (hi2 ? cb3 : cb1);
        const float x3l = x3 * (hi3 ? cb2 : cb0), x3h = x3 * (hi3 ? cb3 : cb1);
        const float P23[4] = {x2l + x3l, x2h + x3l, x2l + x3h, x2h + x3h};
#pragma unroll
        for (int ii = 0; ii < 64; ++ii) {
          const int a = (ii & 3) | ((ii >> 4) & 3) << 2, bb = (ii >> 2) & 3;
          smem[(q4 * 64 + ii) * 64 + gg] = P01[a] + P23[bb];
        }
        __syncthreads();
      }
      const unsigned char* st = ring + (z % NSTAGE) * kStage;
#pragma unroll
      for (int i = 0; i < T; ++i) {
        const int rs = 32 * i + warp * 4 + rr;  // row in the stage
        const uint2 w = *reinterpret_cast<const uint2*>(st + rs * 64 + b * 8);
        const unsigned sc = st[kStageW + rs * 8 + b];
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
        asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(scale) : "r"(sc << 2), "n"(TABLE_AT + 65536));
        acc[q * T + i] = fmaf(p0 + p1, scale, acc[q * T + i]);
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
#pragma unroll
  for (int s = 0; s < S; ++s) {
    float v = acc[s];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    const int row = row0 + 32 * s + warp * 4 + rr;
    if (b == 0 && row < N) part[(long long)split * N + row] = v;
  }
}

// The same lookups on the mma kernels' tiled layout (gemm.py repack_for_gemm,
// no extra copy): tiles [rt][kt][2][32][4] words, word (kk, 4g + t, q) holds
// block j = 4 kk + q of rows g (bytes 0, 1) and g + 8 (bytes 2, 3), byte ph
// of a row the codes of columns 32 j + 16 ph + 2t + {0, 1, 8, 9} as 2-bit
// fields (entry index i: code_e = (i >> 2e) & 3). Group G = 8 j + 2 t + ph.
// Lane roles: block j = lane & 7, gq = lane >> 3; a warp step is half a tile
// (g = 4 half + gq, rows g and g + 8): four LDG.32 (t = 0..3) and two scales.
template <int S, int G>
__global__ void __launch_bounds__(256, 2)
    lut_k2_tiles(const unsigned* __restrict__ tiles, const unsigned char* __restrict__ scales,
                 const float* __restrict__ codebook, const __half* __restrict__ A, float* __restrict__ part,
                 int N, int K_dim, int chunks_per_split, int kt_n, int rt_n) {
  extern __shared__ __align__(16) float smem[];  // [256][64] table, then 256 scales
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.y;
  const int c0 = split * chunks_per_split, c1 = min(kt_n, c0 + chunks_per_split);
  if (tid == 0 && (unsigned)__cvta_generic_to_shared(smem) != TABLE_AT) __trap();
  {
    const unsigned u = tid;
    smem[16384 + u] = u < 16 ? (float)u * 6.103515625e-05f : __uint_as_float((u << 19) + (116u << 23));
  }
  const int j = lane & 7, gq = lane >> 3, half = warp & 1, g = 4 * half + gq;
  const int rot = (j >> 2) + 2 * gq;
  unsigned selA = 0, selB = 0, LB[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    selA |= (unsigned)((m + rot) & 7) << (4 * m);
    selB |= (unsigned)((m + 4 + rot) & 7) << (4 * m);
  }
#pragma unroll
  for (int p = 0; p < 4; ++p)
    LB[p] = (unsigned)(4 * (8 * j + ((2 * p + rot) & 7))) | ((unsigned)(4 * (8 * j + ((2 * p + 1 + rot) & 7))) << 8);
  const float cb0 = codebook[0], cb1 = codebook[1], cb2 = codebook[2], cb3 = codebook[3];
  const int gg = lane + 32 * (warp & 1), q4 = warp >> 1;  // build roles
  const int tile0 = blockIdx.x * 4 * S + (warp >> 1);      // + 4 s
  const int nvs = (rt_n - tile0 + 3) >> 2;                  // steps whose tile exists
  // word offsets of the lane's four words in a tile, and its two scale bytes
  const int woff = (j >> 2) * 128 + 16 * g + (j & 3);
  const int soff = g * 8 + j;
  float acc[2 * S];
#pragma unroll
  for (int s = 0; s < 2 * S; ++s) acc[s] = 0.0f;

  for (int c = c0; c < c1; ++c) {
    unsigned wv[2][G][4], sv[2][G][2];
    const unsigned* pw = tiles + ((long long)tile0 * kt_n + c) * 256 + woff;
    const unsigned char* ps = scales + ((long long)tile0 * kt_n + c) * 128 + soff;
    const unsigned tstride = 4u * (unsigned)kt_n;  // 4 tiles of rows, in tiles
    auto load_group = [&](int grp, unsigned (*w)[4], unsigned (*sc)[2]) {
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const unsigned s = grp * G + i;
#pragma unroll
        for (int t = 0; t < 4; ++t) w[i][t] = 0u;
        sc[i][0] = sc[i][1] = 0u;
#ifdef PROBE_NO_LOAD  // (diagnostic: wrong results) no weight loads
#pragma unroll
        for (int t = 0; t < 4; ++t) w[i][t] = (s * 0x9E3779B9u + t) ^ (unsigned)c;
        sc[i][0] = (s * 37u + j) & 255u;
        sc[i][1] = (s * 91u + j) & 255u;
        if (false) {
#else
        if ((int)s < nvs) {
#endif
#pragma unroll
          for (int t = 0; t < 4; ++t) w[i][t] = __ldg(pw + s * tstride * 256u + 4 * t);
          sc[i][0] = __ldg(ps + s * tstride * 128u);
          sc[i][1] = __ldg(ps + s * tstride * 128u + 64);
        }
      }
    };
    load_group(0, wv[0], sv[0]);
    __syncthreads();  // the previous chunk's lookups are done
    {
      const int jb = gg >> 3, tb = (gg >> 1) & 3, ph = gg & 1;
      const int kpos = c * 256 + 32 * jb + 16 * ph + 2 * tb;
      float x0 = 0.f, x1 = 0.f, x2 = 0.f, x3 = 0.f;
      if (kpos < K_dim) {
        const float2 f01 = __half22float2(*reinterpret_cast<const __half2*>(A + kpos));
        const float2 f23 = __half22float2(*reinterpret_cast<const __half2*>(A + kpos + 8));
        x0 = f01.x; x1 = f01.y; x2 = f23.x; x3 = f23.y;
      }
      const float cb[4] = {cb0, cb1, cb2, cb3};
      float P01[16];
#pragma unroll
      for (int a = 0; a < 16; ++a) P01[a] = x0 * cb[a & 3] + x1 * cb[a >> 2];
      const float x3c = x3 * (q4 == 0 ? cb0 : q4 == 1 ? cb1 : q4 == 2 ? cb2 : cb3);
      const float P23[4] = {x2 * cb0 + x3c, x2 * cb1 + x3c, x2 * cb2 + x3c, x2 * cb3 + x3c};
#pragma unroll
      for (int ii = 0; ii < 64; ++ii) smem[(q4 * 64 + ii) * 64 + gg] = P01[ii & 15] + P23[ii >> 4];
    }
    __syncthreads();
#pragma unroll
    for (int grp = 0; grp < S / G; ++grp) {
      const int cur = grp & 1;
      if (grp + 1 < S / G) load_group(grp + 1, wv[cur ^ 1], sv[cur ^ 1]);
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const unsigned* w = wv[cur][i];
        const unsigned X0 = __byte_perm(w[0], w[1], 0x5410), X1 = __byte_perm(w[2], w[3], 0x5410);
        const unsigned Y0 = __byte_perm(w[0], w[1], 0x7632), Y1 = __byte_perm(w[2], w[3], 0x7632);
        const unsigned R[4] = {__byte_perm(X0, X1, selA), __byte_perm(X0, X1, selB),
                               __byte_perm(Y0, Y1, selA), __byte_perm(Y0, Y1, selB)};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v[8];
#pragma unroll
          for (int jp = 0; jp < 8; ++jp) {
            const unsigned sel = (4u + (jp & 1)) | ((unsigned)(jp & 3) << 4) | (6u << 8) | (6u << 12);
            const unsigned addr = __byte_perm(R[2 * h + (jp >> 2)], LB[jp >> 1], sel);
#ifdef PROBE_NO_LDS  // (diagnostic: wrong results) no table loads
            v[jp] = __uint_as_float(addr);
#else
            asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(v[jp]) : "r"(addr), "n"(TABLE_AT));
#endif
          }
          const float p = ((v[0] + v[2]) + (v[4] + v[6])) + ((v[1] + v[3]) + (v[5] + v[7]));
          float scale;
          asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(scale) : "r"(sv[cur][i][h] << 2), "n"(TABLE_AT + 65536));
          acc[2 * (grp * G + i) + h] = fmaf(p, scale, acc[2 * (grp * G + i) + h]);
        }
      }
    }
  }
#pragma unroll
  for (int s = 0; s < 2 * S; ++s) {
    float v = acc[s];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    const int row = (tile0 + 4 * (s >> 1)) * 16 + g + 8 * (s & 1);
    if (j == 0 && row < N) part[(long long)split * N + row] = v;
  }
}

template <int S, int G>
__global__ void __launch_bounds__(256, 2)
    lut_k2_tiles_bal(const unsigned* __restrict__ tiles, const unsigned char* __restrict__ scales,
                 const float* __restrict__ codebook, const __half* __restrict__ A, float* __restrict__ part,
                 int N, int K_dim, int kt_n, int rt_n, int units) {
  extern __shared__ __align__(16) float smem[];  // [256][64] table, then 256 scales
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // units u = rb * kt_n + c (row block of 64 S rows, K tile c); CTA x takes
  // [x U / grid, (x + 1) U / grid); cta_of(u) = ((u + 1) grid - 1) / U
  const long long U = units, Gc = gridDim.x;
  const int u0 = (int)(blockIdx.x * U / Gc), u1 = (int)((blockIdx.x + 1) * U / Gc);
  if (tid == 0 && (unsigned)__cvta_generic_to_shared(smem) != TABLE_AT) __trap();
  {
    const unsigned u = tid;
    smem[16384 + u] = u < 16 ? (float)u * 6.103515625e-05f : __uint_as_float((u << 19) + (116u << 23));
  }
  const int j = lane & 7, gq = lane >> 3, half = warp & 1, g = 4 * half + gq;
  const int rot = (j >> 2) + 2 * gq;
  unsigned selA = 0, selB = 0, LB[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    selA |= (unsigned)((m + rot) & 7) << (4 * m);
    selB |= (unsigned)((m + 4 + rot) & 7) << (4 * m);
  }
#pragma unroll
  for (int p = 0; p < 4; ++p)
    LB[p] = (unsigned)(4 * (8 * j + ((2 * p + rot) & 7))) | ((unsigned)(4 * (8 * j + ((2 * p + 1 + rot) & 7))) << 8);
  const float cb0 = codebook[0], cb1 = codebook[1], cb2 = codebook[2], cb3 = codebook[3];
  const int gg = lane + 32 * (warp & 1), q4 = warp >> 1;  // build roles
  // word offsets of the lane's four words in a tile, and its two scale bytes
  const int woff = (j >> 2) * 128 + 16 * g + (j & 3);
  const int soff = g * 8 + j;
  float acc[2 * S];
  for (int ub = u0; ub < u1;) {
  const int rb = ub / kt_n, cb_end = min(u1 - rb * kt_n, kt_n);
  const int tile0 = rb * 4 * S + (warp >> 1);  // + 4 s
  const int nvs = (rt_n - tile0 + 3) >> 2;     // steps whose tile exists
#pragma unroll
  for (int s = 0; s < 2 * S; ++s) acc[s] = 0.0f;
  for (int c = ub - rb * kt_n; c < cb_end; ++c) {
    unsigned wv[2][G][4], sv[2][G][2];
    const unsigned* pw = tiles + ((long long)tile0 * kt_n + c) * 256 + woff;
    const unsigned char* ps = scales + ((long long)tile0 * kt_n + c) * 128 + soff;
    const unsigned tstride = 4u * (unsigned)kt_n;  // 4 tiles of rows, in tiles
    auto load_group = [&](int grp, unsigned (*w)[4], unsigned (*sc)[2]) {
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const unsigned s = grp * G + i;
#pragma unroll
        for (int t = 0; t < 4; ++t) w[i][t] = 0u;
        sc[i][0] = sc[i][1] = 0u;
#ifdef PROBE_NO_LOAD  // (diagnostic: wrong results) no weight loads
#pragma unroll
        for (int t = 0; t < 4; ++t) w[i][t] = (s * 0x9E3779B9u + t) ^ (unsigned)c;
        sc[i][0] = (s * 37u + j) & 255u;
        sc[i][1] = (s * 91u + j) & 255u;
        if (false) {
#else
        if ((int)s < nvs) {
#endif
#pragma unroll
          for (int t = 0; t < 4; ++t) w[i][t] = __ldg(pw + s * tstride * 256u + 4 * t);
          sc[i][0] = __ldg(ps + s * tstride * 128u);
          sc[i][1] = __ldg(ps + s * tstride * 128u + 64);
        }
      }
    };
    load_group(0, wv[0], sv[0]);
    __syncthreads();  // the previous chunk's lookups are done
    {
      const int jb = gg >> 3, tb = (gg >> 1) & 3, ph = gg & 1;
      const int kpos = c * 256 + 32 * jb + 16 * ph + 2 * tb;
      float x0 = 0.f, x1 = 0.f, x2 = 0.f, x3 = 0.f;
      if (kpos < K_dim) {
        const float2 f01 = __half22float2(*reinterpret_cast<const __half2*>(A + kpos));
        const float2 f23 = __half22float2(*reinterpret_cast<const __half2*>(A + kpos + 8));
        x0 = f01.x; x1 = f01.y; x2 = f23.x; x3 = f23.y;
      }
      const float cb[4] = {cb0, cb1, cb2, cb3};
      float P01[16];
#pragma unroll
      for (int a = 0; a < 16; ++a) P01[a] = x0 * cb[a & 3] + x1 * cb[a >> 2];
      const float x3c = x3 * (q4 == 0 ? cb0 : q4 == 1 ? cb1 : q4 == 2 ? cb2 : cb3);
      const float P23[4] = {x2 * cb0 + x3c, x2 * cb1 + x3c, x2 * cb2 + x3c, x2 * cb3 + x3c};
#pragma unroll
      for (int ii = 0; ii < 64; ++ii) smem[(q4 * 64 + ii) * 64 + gg] = P01[ii & 15] + P23[ii >> 4];
    }
    __syncthreads();
#pragma unroll
    for (int grp = 0; grp < S / G; ++grp) {
      const int cur = grp & 1;
      if (grp + 1 < S / G) load_group(grp + 1, wv[cur ^ 1], sv[cur ^ 1]);
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const unsigned* w = wv[cur][i];
        const unsigned X0 = __byte_perm(w[0], w[1], 0x5410), X1 = __byte_perm(w[2], w[3], 0x5410);
        const unsigned Y0 = __byte_perm(w[0], w[1], 0x7632), Y1 = __byte_perm(w[2], w[3], 0x7632);
        const unsigned R[4] = {__byte_perm(X0, X1, selA), __byte_perm(X0, X1, selB),
                               __byte_perm(Y0, Y1, selA), __byte_perm(Y0, Y1, selB)};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v[8];
#pragma unroll
          for (int jp = 0; jp < 8; ++jp) {
            const unsigned sel = (4u + (jp & 1)) | ((unsigned)(jp & 3) << 4) | (6u << 8) | (6u << 12);
            const unsigned addr = __byte_perm(R[2 * h + (jp >> 2)], LB[jp >> 1], sel);
#ifdef PROBE_NO_LDS  // (diagnostic: wrong results) no table loads
            v[jp] = __uint_as_float(addr);
#else
            asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(v[jp]) : "r"(addr), "n"(TABLE_AT));
#endif
          }
          const float p = ((v[0] + v[2]) + (v[4] + v[6])) + ((v[1] + v[3]) + (v[5] + v[7]));
          float scale;
          asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(scale) : "r"(sv[cur][i][h] << 2), "n"(TABLE_AT + 65536));
          acc[2 * (grp * G + i) + h] = fmaf(p, scale, acc[2 * (grp * G + i) + h]);
        }
      }
    }
  }
  const int slot = (int)blockIdx.x - (int)((((long long)rb * kt_n + 1) * Gc - 1) / U);
#pragma unroll
  for (int s = 0; s < 2 * S; ++s) {
    float v = acc[s];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    const int row = (tile0 + 4 * (s >> 1)) * 16 + g + 8 * (s & 1);
    if (j == 0 && row < N) part[(long long)slot * N + row] = v;
  }
  ub = (rb + 1) * kt_n;
  }
}

// The balanced form's sum: row n's row block rb was covered by the CTAs
// cta_of(rb kt_n) .. cta_of(rb kt_n + kt_n - 1), slots 0.. in that order.
__global__ void lut_reduce_bal(const float* __restrict__ part, __half* __restrict__ C, int N, int rows_per_rb,
                               int kt_n, int units, int grid) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const long long rb = n / rows_per_rb, U = units, Gc = grid;
  const int first = (int)(((rb * kt_n + 1) * Gc - 1) / U), last = (int)(((rb * kt_n + kt_n) * Gc - 1) / U);
  float s = 0.f;
  for (int j = 0; j <= last - first; ++j) s += part[(long long)j * N + n];
  C[n] = __float2half_rn(s);
}

// lut_k2_tiles_bal with its weight and scale words prefetched by cp.async into
// a per-lane ring of D steps instead of registers: each lane copies (4 B at a
// time) the four words and two scale words it alone reads back, D - 1 steps
// ahead, across the table builds; no barrier but the builds' two.
template <int S, int D>
__global__ void __launch_bounds__(256, 2)
    lut_k2_ring(const unsigned* __restrict__ tiles, const unsigned* __restrict__ scales,
                const float* __restrict__ codebook, const __half* __restrict__ A, float* __restrict__ part,
                int N, int K_dim, int kt_n, int rt_n, int units) {
  extern __shared__ __align__(16) float smem[];  // [256][64] table, 256 scales, then the ring
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long U = units, Gc = gridDim.x;
  const int u0 = (int)(blockIdx.x * U / Gc), u1 = (int)((blockIdx.x + 1) * U / Gc);
  if (tid == 0 && (unsigned)__cvta_generic_to_shared(smem) != TABLE_AT) __trap();
  {
    const unsigned u = tid;
    smem[16384 + u] = u < 16 ? (float)u * 6.103515625e-05f : __uint_as_float((u << 19) + (116u << 23));
  }
  // ring: slot z % D of warp w: [32 lanes][4 words] weights, then [32 lanes][2 words] scales
  const unsigned ring = (unsigned)__cvta_generic_to_shared(smem) + 65536 + 1024 + warp * D * 768;
  const int j = lane & 7, gq = lane >> 3, half = warp & 1, g = 4 * half + gq;
  const int rot = (j >> 2) + 2 * gq;
  unsigned selA = 0, selB = 0, LB[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    selA |= (unsigned)((m + rot) & 7) << (4 * m);
    selB |= (unsigned)((m + 4 + rot) & 7) << (4 * m);
  }
#pragma unroll
  for (int p = 0; p < 4; ++p)
    LB[p] = (unsigned)(4 * (8 * j + ((2 * p + rot) & 7))) | ((unsigned)(4 * (8 * j + ((2 * p + 1 + rot) & 7))) << 8);
  const float cb0 = codebook[0], cb1 = codebook[1], cb2 = codebook[2], cb3 = codebook[3];
  const int gg = lane + 32 * (warp & 1), q4 = warp >> 1;  // build roles
  const int woff = (j >> 2) * 128 + 16 * g + (j & 3);       // the lane's words in a tile (+ 4 t)
  const int soff = (g * 8 + j) >> 2;                        // its scale words (+ 16 for row g + 8)
  const unsigned sshift = 8 * (j & 3);
  static_assert(S % D == 0 && D <= S, "ring slots by the step's index");
  const unsigned tstep = 4u * (unsigned)kt_n;  // 4 tiles of rows, in tiles
  // the lane's first words of unit u (row block rb, K tile c), and the row block's first tile
  auto unit_src = [&](int u, const unsigned*& w0, const unsigned*& s0, int& tb) {
    const int rb = u / kt_n, c = u - rb * kt_n;
    tb = rb * 4 * S + (warp >> 1);
    const long long tk = (long long)tb * kt_n + c;
    w0 = tiles + tk * 256 + woff;
    s0 = scales + tk * 32 + soff;
  };
  auto issue = [&](const unsigned* w0, const unsigned* s0, int tb, int sp, bool live, int slot) {
    const bool ok = live && tb + 4 * sp < rt_n;
    const unsigned* src = ok ? w0 + (size_t)sp * tstep * 256u : tiles;
    const unsigned* ssrc = ok ? s0 + (size_t)sp * tstep * 32u : scales;
    const unsigned dst = ring + slot * 768 + lane * 16, sdst = ring + slot * 768 + 512 + lane * 8;
#pragma unroll
    for (int t = 0; t < 4; ++t)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst + 4 * t), "l"(src + 4 * t),
                   "r"(ok ? 4 : 0) : "memory");
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(sdst), "l"(ssrc), "r"(ok ? 4 : 0) : "memory");
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(sdst + 4), "l"(ssrc + (ok ? 16 : 0)),
                 "r"(ok ? 4 : 0) : "memory");
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };

  const unsigned *cw = tiles, *cs = scales, *nw = tiles, *ns = scales;
  int ctb = 0, ntb = 0;
  if (u0 < u1) unit_src(u0, cw, cs, ctb);
#pragma unroll
  for (int sp = 0; sp < D - 1; ++sp) issue(cw, cs, ctb, sp, u0 < u1, sp % D);
  float acc[2 * S];
#pragma unroll
  for (int s = 0; s < 2 * S; ++s) acc[s] = 0.0f;
  for (int u = u0; u < u1; ++u) {
    const int rb = u / kt_n, c = u - rb * kt_n;
    if (u + 1 < u1) unit_src(u + 1, nw, ns, ntb);
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const int z = s;  // the ring slot is z % D (S % D == 0)
      if (s + D - 1 < S) issue(cw, cs, ctb, s + D - 1, true, (s + D - 1) % D);
      else issue(nw, ns, ntb, s + D - 1 - S, u + 1 < u1, (s + D - 1) % D);
      if (s == 0) {
        __syncthreads();  // the previous unit's lookups are done
        const int jb = gg >> 3, tb = (gg >> 1) & 3, ph = gg & 1;
        const int kpos = c * 256 + 32 * jb + 16 * ph + 2 * tb;
        float x0 = 0.f, x1 = 0.f, x2 = 0.f, x3 = 0.f;
        if (kpos < K_dim) {
          const float2 f01 = __half22float2(*reinterpret_cast<const __half2*>(A + kpos));
          const float2 f23 = __half22float2(*reinterpret_cast<const __half2*>(A + kpos + 8));
          x0 = f01.x; x1 = f01.y; x2 = f23.x; x3 = f23.y;
        }
        const float cb[4] = {cb0, cb1, cb2, cb3};
        float P01[16];
#pragma unroll
        for (int a = 0; a < 16; ++a) P01[a] = x0 * cb[a & 3] + x1 * cb[a >> 2];
        const float x3c = x3 * (q4 == 0 ? cb0 : q4 == 1 ? cb1 : q4 == 2 ? cb2 : cb3);
        const float P23[4] = {x2 * cb0 + x3c, x2 * cb1 + x3c, x2 * cb2 + x3c, x2 * cb3 + x3c};
#pragma unroll
        for (int ii = 0; ii < 64; ++ii) smem[(q4 * 64 + ii) * 64 + gg] = P01[ii & 15] + P23[ii >> 4];
        __syncthreads();
      }
      asm volatile("cp.async.wait_group %0;\n" ::"n"(D - 1) : "memory");
      uint4 wq;
      uint2 sq;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(wq.x), "=r"(wq.y), "=r"(wq.z), "=r"(wq.w)
                   : "r"(ring + (z % D) * 768 + lane * 16) : "memory");
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(sq.x), "=r"(sq.y)
                   : "r"(ring + (z % D) * 768 + 512 + lane * 8) : "memory");
      const unsigned X0 = __byte_perm(wq.x, wq.y, 0x5410), X1 = __byte_perm(wq.z, wq.w, 0x5410);
      const unsigned Y0 = __byte_perm(wq.x, wq.y, 0x7632), Y1 = __byte_perm(wq.z, wq.w, 0x7632);
      const unsigned R[4] = {__byte_perm(X0, X1, selA), __byte_perm(X0, X1, selB),
                             __byte_perm(Y0, Y1, selA), __byte_perm(Y0, Y1, selB)};
      const unsigned sc[2] = {((sq.x >> sshift) & 255u) << 2, ((sq.y >> sshift) & 255u) << 2};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v[8];
#pragma unroll
        for (int jp = 0; jp < 8; ++jp) {
          const unsigned sel = (4u + (jp & 1)) | ((unsigned)(jp & 3) << 4) | (6u << 8) | (6u << 12);
          const unsigned addr = __byte_perm(R[2 * h + (jp >> 2)], LB[jp >> 1], sel);
          asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(v[jp]) : "r"(addr), "n"(TABLE_AT));
        }
        const float p = ((v[0] + v[2]) + (v[4] + v[6])) + ((v[1] + v[3]) + (v[5] + v[7]));
        float scale;
        asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(scale) : "r"(sc[h]), "n"(TABLE_AT + 65536));
        acc[2 * s + h] = fmaf(p, scale, acc[2 * s + h]);
      }
    }
    if (u == u1 - 1 || c == kt_n - 1) {  // the row block's last unit here: its slot
      const int slot = (int)blockIdx.x - (int)((((long long)rb * kt_n + 1) * Gc - 1) / U);
      const int tile0 = rb * 4 * S + (warp >> 1);
#pragma unroll
      for (int s = 0; s < 2 * S; ++s) {
        float v = acc[s];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        const int row = (tile0 + 4 * (s >> 1)) * 16 + g + 8 * (s & 1);
        if (j == 0 && row < N) part[(long long)slot * N + row] = v;
        acc[s] = 0.0f;
      }
    }
    cw = nw;
    cs = ns;
    ctb = ntb;
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// The balanced tiled form with the mma lanes' own 16-byte loads: lane 4g + t
// loads words (kk, 4g + t, 0..3) of a tile (blocks 4 kk .. 4 kk + 3 of rows g
// and g + 8, column set t) as one LDG.128 a kk; a warp step is one whole tile
// (1 KB, two coalesced loads). Group G = 32 kk + 8 t + 2 q + ph (bank 8 t + 2 q
// + ph); lanes of one t take their 8 (q, ph) in an order rotated by g. The
// pair sums (row h, block j) are reduced over t by two shuffle rounds, after
// which lane t holds row g + 8 (t >> 1), blocks 4 (t & 1) .. + 3: one
// 4-byte scale load and four FFMA into one accumulator a tile.
template <int S, int G>
__global__ void __launch_bounds__(256, 2)
    lut_k2_v4(const uint4* __restrict__ tiles, const unsigned* __restrict__ scales,
              const float* __restrict__ codebook, const __half* __restrict__ A, float* __restrict__ part,
              int N, int K_dim, int kt_n, int rt_n, int units) {
  extern __shared__ __align__(16) float smem[];  // [256][64] table, then 256 scales
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long U = units, Gc = gridDim.x;
  const int u0 = (int)(blockIdx.x * U / Gc), u1 = (int)((blockIdx.x + 1) * U / Gc);
  if (tid == 0 && (unsigned)__cvta_generic_to_shared(smem) != TABLE_AT) __trap();
  {
    const unsigned u = tid;
    smem[16384 + u] = u < 16 ? (float)u * 6.103515625e-05f : __uint_as_float((u << 19) + (116u << 23));
  }
  const int g = lane >> 2, t = lane & 3;
  // lookup jp = 2 m + e is (q, ph) = ((m + (g >> 1)) & 3, e ^ (g & 1)): the 8 lanes
  // of one t take 8 different groups at once, and jp = 2m, 2m + 1 are one pair
  auto idx8 = [&](int jp) { return 2 * (((jp >> 1) + (g >> 1)) & 3) + ((jp & 1) ^ (g & 1)); };
  unsigned selA = 0, selB = 0, LB[2][4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    selA |= (unsigned)idx8(m) << (4 * m);
    selB |= (unsigned)idx8(m + 4) << (4 * m);
  }
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    LB[0][p] = (unsigned)(4 * (8 * t + idx8(2 * p))) | ((unsigned)(4 * (8 * t + idx8(2 * p + 1))) << 8);
    LB[1][p] = LB[0][p] | 0x8080u;  // kk = 1: groups + 32
  }
  // the scale word's byte q moved to byte (q - (g >> 1)) & 3: the pair sums' order
  unsigned ssel = 0;
#pragma unroll
  for (int m = 0; m < 4; ++m) ssel |= (unsigned)((m + (g >> 1)) & 3) << (4 * m);
  const float cb0 = codebook[0], cb1 = codebook[1], cb2 = codebook[2], cb3 = codebook[3];
  const int gg = lane + 32 * (warp & 1), q4 = warp >> 1;  // build roles
  const int soff = ((g + 8 * (t >> 1)) * 8 + 4 * (t & 1)) >> 2;  // the lane's scale word in a tile
  float acc[S];
  for (int ub = u0; ub < u1;) {
    const int rb = ub / kt_n, cb_end = min(u1 - rb * kt_n, kt_n);
    const int tile0 = rb * 8 * S + warp;       // + 8 s
    const int nvs = (rt_n - tile0 + 7) >> 3;  // steps whose tile exists
#pragma unroll
    for (int s = 0; s < S; ++s) acc[s] = 0.0f;
    for (int c = ub - rb * kt_n; c < cb_end; ++c) {
      uint4 wv[2][G][2];
      unsigned sv[2][G];
      const uint4* pw = tiles + ((long long)tile0 * kt_n + c) * 64 + lane;
      const unsigned* ps = scales + ((long long)tile0 * kt_n + c) * 32 + soff;
      const unsigned tstride = 8u * (unsigned)kt_n;  // 8 tiles of rows, in tiles
      auto load_group = [&](int grp, uint4 (*w)[2], unsigned* sc) {
#pragma unroll
        for (int i = 0; i < G; ++i) {
          const unsigned s = grp * G + i;
          w[i][0] = w[i][1] = make_uint4(0u, 0u, 0u, 0u);
          sc[i] = 0u;
#ifdef PROBE_NO_LOAD  // (diagnostic: wrong results) no weight loads
          w[i][0] = make_uint4(s * 0x9E3779B9u ^ c, s * 0x85EBCA6Bu, s + lane, s ^ 0x5bd1e995u);
          w[i][1] = make_uint4(s * 0x27d4eb2fu, s ^ c, lane * 0x165667b1u + s, s);
          sc[i] = s * 0x01010101u + lane;
          if (false) {
#else
          if ((int)s < nvs) {
#endif
            w[i][0] = __ldg(pw + s * tstride * 64u);
            w[i][1] = __ldg(pw + s * tstride * 64u + 32);
            sc[i] = __ldg(ps + s * tstride * 32u);
          }
        }
      };
      load_group(0, wv[0], sv[0]);
      __syncthreads();  // the previous chunk's lookups are done
      {
        const int kk = gg >> 5, tb = (gg >> 3) & 3, q = (gg >> 1) & 3, ph = gg & 1;
        const int kpos = c * 256 + 32 * (4 * kk + q) + 16 * ph + 2 * tb;
        float x0 = 0.f, x1 = 0.f, x2 = 0.f, x3 = 0.f;
        if (kpos < K_dim) {
          const float2 f01 = __half22float2(*reinterpret_cast<const __half2*>(A + kpos));
          const float2 f23 = __half22float2(*reinterpret_cast<const __half2*>(A + kpos + 8));
          x0 = f01.x; x1 = f01.y; x2 = f23.x; x3 = f23.y;
        }
        const float cb[4] = {cb0, cb1, cb2, cb3};
        float P01[16];
#pragma unroll
        for (int a = 0; a < 16; ++a) P01[a] = x0 * cb[a & 3] + x1 * cb[a >> 2];
        const float x3c = x3 * (q4 == 0 ? cb0 : q4 == 1 ? cb1 : q4 == 2 ? cb2 : cb3);
        const float P23[4] = {x2 * cb0 + x3c, x2 * cb1 + x3c, x2 * cb2 + x3c, x2 * cb3 + x3c};
#pragma unroll
        for (int ii = 0; ii < 64; ++ii) smem[(q4 * 64 + ii) * 64 + gg] = P01[ii & 15] + P23[ii >> 4];
      }
      __syncthreads();
#pragma unroll
      for (int grp = 0; grp < S / G; ++grp) {
        const int cur = grp & 1;
        if (grp + 1 < S / G) load_group(grp + 1, wv[cur ^ 1], sv[cur ^ 1]);
#pragma unroll
        for (int i = 0; i < G; ++i) {
          float pr[16];  // pair sums, index 8 h + j
#pragma unroll
          for (int kk = 0; kk < 2; ++kk) {
            const uint4 w = wv[cur][i][kk];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const unsigned X0 = __byte_perm(w.x, w.y, h ? 0x7632 : 0x5410);
              const unsigned X1 = __byte_perm(w.z, w.w, h ? 0x7632 : 0x5410);
              const unsigned R0 = __byte_perm(X0, X1, selA), R1 = __byte_perm(X0, X1, selB);
              float v[8];
#pragma unroll
              for (int jp = 0; jp < 8; ++jp) {
                const unsigned sel = (4u + (jp & 1)) | ((unsigned)(jp & 3) << 4) | (6u << 8) | (6u << 12);
                const unsigned addr = __byte_perm(jp < 4 ? R0 : R1, LB[kk][jp >> 1], sel);
#ifdef PROBE_NO_LDS  // (diagnostic: wrong results) no table loads
                v[jp] = __uint_as_float(addr);
#else
                asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(v[jp]) : "r"(addr), "n"(TABLE_AT));
#endif
              }
#pragma unroll
              for (int m = 0; m < 4; ++m) pr[8 * h + 4 * kk + m] = v[2 * m] + v[2 * m + 1];
            }
          }
          // reduce over t: xor 2 keeps h = t >> 1, xor 1 keeps blocks 4 (t & 1) ..
          float r8[8];
#pragma unroll
          for (int m = 0; m < 8; ++m) {
            const float mine = (t >> 1) ? pr[8 + m] : pr[m], other = (t >> 1) ? pr[m] : pr[8 + m];
            r8[m] = mine + __shfl_xor_sync(0xffffffffu, other, 2);
          }
          float r4[4];
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const float mine = (t & 1) ? r8[4 + m] : r8[m], other = (t & 1) ? r8[m] : r8[4 + m];
            r4[m] = mine + __shfl_xor_sync(0xffffffffu, other, 1);
          }
          const unsigned sw = __byte_perm(sv[cur][i], 0u, ssel);
          float a = acc[grp * G + i];
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            float scale;
            asm volatile("ld.shared.f32 %0, [%1+%2];" : "=f"(scale) : "r"(((sw >> (8 * m)) & 255u) << 2),
                         "n"(TABLE_AT + 65536));
            a = fmaf(r4[m], scale, a);
          }
          acc[grp * G + i] = a;
        }
      }
    }
    const int slot = (int)blockIdx.x - (int)((((long long)rb * kt_n + 1) * Gc - 1) / U);
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const float v = acc[s] + __shfl_xor_sync(0xffffffffu, acc[s], 1);
      const int row = (tile0 + 8 * s) * 16 + g + 8 * (t >> 1);
      if ((t & 1) == 0 && row < N) part[(long long)slot * N + row] = v;
    }
    ub = (rb + 1) * kt_n;
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
