// gemm_latency.cu: C = A @ dequant(W).T for products whose launch, not their
// bytes, sets the time: small layers (2048x768, 768x2048, 4096x4096) at a few
// rows of A, where gemm_mma.cu's machinery (the work split over every
// resident CTA, fp32 partials in a workspace, per-row-tile counters, a
// double-buffered activation pipeline) costs more than the weight's bytes.
//
// One CTA per 16-row tile of W (or two, each decoding 8 of its rows: half
// tiles, where the row tiles would leave SMs idle); its warps split the K tiles (warp w takes
// K tiles w, w + warps, ...), so every weight byte is read by the first wave
// and all of a warp's loads are issued before anything waits. The CTA stages
// the rows of A it multiplies (at most 8 * M_TILES, the whole K_dim) in shared
// memory once, with one barrier; the warps then decode and multiply exactly
// as gemm_mma.cu does (same tile layout, same lookup, same mma.sync m16n8k16
// with fp32 accumulators, same effective weights), and add their partial
// tiles in shared memory, in warp order: no workspace, no atomics, the same
// bits on every call. The order of the K sum differs from gemm_mma.cu's, so
// the two kernels agree to fp32 rounding (FORMAT.md section 7), not in bits.
//
// Mixture of experts (route_ids non-null, M_TILES = 1; experts.py, few
// (token, expert) pairs): M is the pair count, W the experts' tiles one
// after another, and CTA (pair p, row tile rt) multiplies row p / ids_per_row
// of A by expert route_ids[p]'s row tile rt into row p of C: no grouping,
// no scan, one dependent load before the weight loads. Pairs with an id
// outside [0, experts) write nothing. With group_offsets instead (rows grouped
// by expert, kbit_grouped_gemm with few rows; ids_per_row 1) row p's expert
// is the one whose offsets hold it (expert_of_row: a count over the offsets
// and one more load); rows no expert owns write nothing.
//
// Layout of the staged activations: row r holds 32 chunks of 16 bytes per K
// tile (columns past K_dim zero-filled), chunk c at r * stride + (c ^ (r & 7))
// (the 8 row addresses of one ldmatrix phase hit distinct banks). Rows past M
// are not staged: their ldmatrix lanes read a zero row.
//
// Lookup: k = 2 and 5 as gemm_mma.cu; k = 3 through its pair table (8 KB,
// built per CTA); k = 4 through the lane-register codebook (two shuffles and
// a byte_perm per pair): its 32 KB pair table, built by every CTA, was no
// faster with 8-warp CTAs on 2048x768 at M = 1 (H100: 3.92 against 3.99 us)
// and much slower with small CTAs, so the shuffles keep the shared memory.
//
// Tried and not kept (H100): a cluster of 2..8 CTAs per row tile splitting
// its K tiles, partial sums added through distributed shared memory, so that
// more SMs read the weight (2048x768, 2048x512: 0.3-0.7 us slower at every k
// and M <= 16; the cluster barriers cost more than the extra SMs gain).
//
// Cluster split (template argument CLUSTER, sm_90a only; gemm.py's
// kernel="cluster"): small layers at 17..256 rows of A, where staging A whole
// per row tile costs more than the weight (each CTA would copy rows x K_dim x
// 2 bytes from L2: 256 KB at 64 rows of 2048 columns). A thread-block cluster
// of `ranks` CTAs (launch attribute, <= 8) shares a group of cta_row_tiles row
// tiles; rank r takes K tiles r, r + ranks, ... and stages only those columns
// of A, for the 8 * M_TILES rows of its M chunk (grid y: chunk y is rows
// 8 * M_TILES * y ..). Warp w multiplies row tile w % cta_row_tiles over the
// CTA's K tiles w / cta_row_tiles, w / cta_row_tiles + warps / cta_row_tiles,
// .... The partial tiles sit at the start of each CTA's shared memory; after a
// cluster barrier rank r adds its share of the group's outputs over all ranks
// and warps (rank-major, then warp: a fixed order, the same bits on every
// call) through distributed shared memory, and a second barrier keeps every
// CTA's shared memory alive until all reads are done. (The phase stamps
// below are for the other launches: a cluster CTA returns before the exit
// stamp, and the stamps' slots are per blockIdx.x only.)
#include "common.cuh"
#include "mma_common.cuh"

namespace kbit {

constexpr int kLatencyMaxWarps = 16;  // _jit.py mirrors it (GEMM_LATENCY_MAX_WARPS)
// The dynamic stage's alignment (bytes; see x_stage in the kernel; 16 only
// for A/B runs, which lets it follow the static shared memory wherever that ends).
#ifndef KBIT_LATENCY_STAGE_ALIGN
#define KBIT_LATENCY_STAGE_ALIGN 128
#endif
// Units of work per K tile (not with CLUSTER; the KSPLIT template argument,
// or for A/B runs of every launch this -D with _jit.GEMM_LATENCY_KSPLIT the
// same on the host): 1, a warp takes whole K tiles; 2 or 4 (the host then
// gives a CTA up to that many times the warps), a warp takes half
// or quarter K tiles: blocks 4p .. 4p + 3 (2p, 2p + 1) of a tile, loading only
// the words, scales and A columns of its part, so a tile's decode is spread
// over two (four) warps. The stamps of 768x2048
// at M = 1 (H100, latency_phases_h100_small_ea9e942.txt: 128 CTAs of 3
// warps) spend 0.73 us of a 2.8 us span on one warp decoding its tile.
// Other bits than 1 (another order of the K sum), within FORMAT.md section 7.
#ifndef KBIT_LATENCY_KSPLIT
#define KBIT_LATENCY_KSPLIT 1
#endif

// Phase stamps, for benchmarks/latency_phases.py only (it builds this file with
// -DKBIT_LATENCY_PHASES; otherwise they compile to nothing): lane 0 of each warp
// of the first kPhaseCtas CTAs writes the global timer (ns) and its SM's clock
// at point p of the kernel to kbit_latency_phases[cta][warp][p][0, 1]
// (points: benchmarks/latency_phases.py).
// latency_phase_after first stores `dep` (a loaded word) to a sink: the store
// waits for the load, so the stamp after it is when that load's data had
// arrived and the code before it had run (the kernel stamps its loads after
// the staging barrier). Point 0 comes before grid_dependency_sync: in stamped
// builds only, a write before the wait, to an array no other kernel touches.
constexpr int kPhaseCtas = 2048, kPhasePoints = 8;
#ifdef KBIT_LATENCY_PHASES
extern "C" {  // unmangled names: RawModule.get_global finds them
__device__ unsigned long long kbit_latency_phases[kPhaseCtas * kLatencyMaxWarps * kPhasePoints * 2];
__device__ unsigned kbit_latency_phase_sink[kLatencyMaxWarps];
}
#endif
__device__ __forceinline__ void latency_phase(int point) {
#ifdef KBIT_LATENCY_PHASES
  if ((threadIdx.x & 31) == 0 && blockIdx.x < kPhaseCtas)
    stamp_clocks(kbit_latency_phases +
                 ((blockIdx.x * kLatencyMaxWarps + (threadIdx.x >> 5)) * kPhasePoints + point) * 2);
#endif
}
__device__ __forceinline__ void latency_phase_after(int point, unsigned dep) {
#ifdef KBIT_LATENCY_PHASES
  if ((threadIdx.x & 31) == 0)
    *reinterpret_cast<volatile unsigned*>(kbit_latency_phase_sink + (threadIdx.x >> 5)) = dep;
  latency_phase(point);
#endif
}

// A half-tile CTA of the upper rows: the lane's index string shifted right by
// 8K bits, so that fields 16j + 8 + i (rows g + 8 of block j) sit where fields
// 16j + i (rows g) were; `upper` false: the string as it is.
template <int K>
__device__ __forceinline__ void select_upper(const unsigned (&w)[4 * K], bool upper,
                                             unsigned (&out)[4 * K]) {
  constexpr int kWords = 8 * K / 32, kBits = 8 * K % 32;
#pragma unroll
  for (int i = 0; i < 4 * K; ++i) {
    unsigned shifted = 0u;
    if (i + kWords < 4 * K) {
      if (kBits == 0) shifted = w[i + kWords];
      else if (i + kWords + 1 < 4 * K) shifted = __funnelshift_r(w[i + kWords], w[i + kWords + 1], kBits);
      else shifted = w[i + kWords] >> kBits;
    }
    out[i] = upper ? shifted : w[i];
  }
}

// Grouped rows (kbit_grouped_gemm, few rows): the expert that owns row r of A,
// offsets[e] <= r < offsets[e + 1] with the offsets clamped to [0, M] (as
// gemm_mma.cu clamps them), or `experts` where none does. Every thread of the
// CTA calls it. The owner's index where the offsets rise is the count of
// experts whose rows end at or before r (r < M). Falling offsets
// (validate=False) give a row to some expert e with offsets[e] <= r, or to
// none: never a read or write outside the arrays.
// KBIT_EXPERT_OF_ROW_BATCHED 1 (default): each thread loads its share of the
// ends, up to 8 per pass, all in flight together, counts them, and the CTA adds
// the counts with one barrier (called once per CTA: `counts` is not reused).
// 0: one __syncthreads_count per blockDim experts, each pass's loads behind
// the previous barrier (for A/B runs). H100, k=4 fp16, kernel-only, in one
// process: 512 x [512, 2048] top-10 T=1 8.66 -> 8.03 us, T=2 13.78 -> 11.58
// us; 128 experts at T=1 -1.3%; the routed and dense launches within 2%
// (results/moe_gap_probe_h100_expert_of_row_batched.txt).
// (One pass with the starts counted too and the counts added through shared
// atomics, no dependent load, measured slower, and slowed the routed launches
// too: moe_linear T=1 on 128 x [1536, 2048] 12.1 -> 14.1 us, H100,
// moe_vs_grouped_mm_h100_7730d7a_*.)
#ifndef KBIT_EXPERT_OF_ROW_BATCHED
#define KBIT_EXPERT_OF_ROW_BATCHED 1
#endif
__device__ __forceinline__ int expert_of_row(const int* __restrict__ offsets, int experts, int r,
                                             int M) {
  int e = 0;
#if KBIT_EXPERT_OF_ROW_BATCHED
  constexpr int kBatch = 8;
  __shared__ int counts[32];  // per warp (blockDim.x <= 1024)
  for (int i0 = (int)threadIdx.x; i0 < experts; i0 += kBatch * (int)blockDim.x) {
    int end[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b * (int)blockDim.x;
      end[b] = i < experts ? min(max(__ldg(offsets + i + 1), 0), M) : M;  // M > r: not counted
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) e += end[b] <= r;
  }
  e = __reduce_add_sync(kFullMask, e);
  if ((threadIdx.x & 31) == 0) counts[threadIdx.x >> 5] = e;
  __syncthreads();
  e = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) e += counts[w];
#else
  for (int i0 = 0; i0 < experts; i0 += blockDim.x) {
    const int i = i0 + (int)threadIdx.x;
    e += __syncthreads_count(i < experts && min(max(__ldg(offsets + i + 1), 0), M) <= r);
  }
#endif
  if (e < experts && min(max(__ldg(offsets + e), 0), M) > r) e = experts;  // unowned
  return e;
}

// Thread-block clusters (sm_90; the CLUSTER instantiations are built for sm_90a only;
// the helpers are in mma_common.cuh).
constexpr int kClusterMaxWarps = 8;   // _jit.py mirrors it (GEMM_CLUSTER_MAX_WARPS)
constexpr int kClusterMaxReads = 16;  // ranks x warps per row tile: gemm.py keeps to it

// KBIT_LATENCY_MAXNREG (A/B runs only; unset: the launch bounds below): the
// registers a thread at most, so that gemm.py's latency_geometry (which reads
// the built kernel's registers) fits more warps in one wave. At 80, k = 4
// spills one word outside the tile loop (16 bytes), which the compile check
// rejects; measured in benchmarks/NOTES-gemm.md ("Fewer registers a warp").
// FOLD: the scale pair's factor in the codebook entries (as gemm_mma.cu's FOLD).
// KSPLIT: units of work per K tile (KBIT_LATENCY_KSPLIT above, which overrides
// it where built other than 1); the host chooses it per launch (experts.py
// _MOE_LATENCY_KSPLIT) and sizes the CTA from it (gemm.latency_geometry).
template <int K, typename T, typename TScale, int M_TILES, bool CLUSTER = false, bool FOLD = false,
          int KSPLIT = 1>
#ifdef KBIT_LATENCY_MAXNREG
__global__ void __maxnreg__(KBIT_LATENCY_MAXNREG)
#else
__global__ void __launch_bounds__(32 * (CLUSTER ? kClusterMaxWarps : kLatencyMaxWarps), 1)
#endif
    kbit_gemm_latency(const uint4* __restrict__ tiles, const void* __restrict__ scales,
                      const float* __restrict__ codebook, const T* __restrict__ A,
                      T* __restrict__ C, int M, int N, int K_dim, int k_tiles,
                      const int* __restrict__ route_ids, int ids_per_row, int experts,
                      int half_tiles, const int* __restrict__ group_offsets,
                      int cta_row_tiles) {
  latency_phase(0);  // entry
  grid_dependency_sync();
  const unsigned long long l2_policy = weight_l2_policy();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const unsigned lane4 = 4u * lane;
  const int g = lane >> 2;
  int rt = blockIdx.x;
  // Half tiles (half_tiles != 0, never with route_ids): two CTAs per row tile,
  // CTA 2 rt + upper decoding only rows 8 upper .. 8 upper + 7 of it.
  const bool upper = half_tiles && (blockIdx.x & 1);
  if (half_tiles) rt = blockIdx.x >> 1;
  int rows = min(M, 8 * M_TILES);  // rows of A staged (gemm.py launches M <= 8 * M_TILES)
  long long tile0 = 0;             // the first tile of W (of the pair's expert)
  if (route_ids || group_offsets) {
    const int row_tiles = (N + 15) >> 4, pair = (int)blockIdx.x / row_tiles;
    rt = (int)blockIdx.x - pair * row_tiles;
    const int e = route_ids ? __ldg(route_ids + pair) : expert_of_row(group_offsets, experts, pair, M);
    if (e < 0 || e >= experts) return;  // (the whole CTA, before any other barrier)
    tile0 = (long long)e * row_tiles * k_tiles;
    A += (long long)(pair / ids_per_row) * K_dim;
    C += (long long)pair * N;
    rows = 1;
  }
  // This CTA's K tiles are rank, rank + ranks, ... (local tile i is K tile
  // kt_of(i)); the warp's are local tiles kw, kw + wk, ... of them, for row
  // tile rt. Without CLUSTER: every K tile, the warp's warp, warp + warps, ...
  int rank = 0, ranks = 1, kw = warp, wk = warps, group = 0;
  bool rt_ok = true;  // the warp's row tile exists (CLUSTER: the group's last may not)
  if constexpr (CLUSTER) {
    rank = cluster_rank();
    ranks = cluster_ranks();
    group = (int)blockIdx.x / ranks;
    kw = warp / cta_row_tiles;
    wk = warps / cta_row_tiles;
    rt = group * cta_row_tiles + warp % cta_row_tiles;
    rt_ok = rt < ((N + 15) >> 4);
    const int m0 = (int)blockIdx.y * 8 * M_TILES;
    A += (long long)m0 * K_dim;
    C += (long long)m0 * N;
    rows = min(M - m0, 8 * M_TILES);
  }
  const int local_tiles = CLUSTER ? (k_tiles - rank + ranks - 1) / ranks : k_tiles;
  const int warp_tiles = rt_ok ? local_tiles : 0;  // local tiles this warp may take
  // Units: local tile u / kSplit, its part u % kSplit (KBIT_LATENCY_KSPLIT);
  // the warp's are units kw, kw + wk, ...
  constexpr int kSplit = CLUSTER ? 1 : KBIT_LATENCY_KSPLIT != 1 ? KBIT_LATENCY_KSPLIT : KSPLIT;
  static_assert(kSplit == 1 || kSplit == 2 || kSplit == 4, "KSPLIT, KBIT_LATENCY_KSPLIT: 1, 2 or 4");
  const int warp_units = warp_tiles * kSplit;
  auto kt_of = [&](int i) { return rank + i * ranks; };
  const int stride = local_tiles * 32;   // chunks per staged row

  // This warp's first tile first: its loads are in flight during the staging.
  using RawScale = typename ScaleWord<TScale>::Raw;
  unsigned w_s[2][4 * K];
  RawScale raw_s[2];
  auto load_unit = [&](int u, unsigned (&w)[4 * K], RawScale& raw) {
    const int kt = kt_of(u / kSplit);  // (first: the order of the PTX before units)
    const long long tile = tile0 + (long long)rt * k_tiles + kt;
    if constexpr (kSplit == 1) {
#pragma unroll
      for (int q = 0; q < K; ++q) {
        const uint4 v = ldg_weight(tiles + (tile * K + q) * 32 + lane, l2_policy);
        w[4 * q] = v.x;
        w[4 * q + 1] = v.y;
        w[4 * q + 2] = v.z;
        w[4 * q + 3] = v.w;
      }
    } else if constexpr (kSplit == 2) {
      // Half `part` of the lane's index string: words 2K part .. 2K part + 2K - 1
      // (blocks 4 part .. 4 part + 3) into w[0 .. 2K), zeros above. For odd K
      // the second half starts two words into a 16-byte load.
      const int part = u % kSplit;
      constexpr int kOdd = K & 1, kLoads = (2 * K + 2 * kOdd + 3) / 4;
      const int q0 = (2 * K * part) >> 2;
      unsigned buf[4 * kLoads];
#pragma unroll
      for (int q = 0; q < kLoads; ++q) {
        const uint4 v = ldg_weight(tiles + (tile * K + q0 + q) * 32 + lane, l2_policy);
        buf[4 * q] = v.x;
        buf[4 * q + 1] = v.y;
        buf[4 * q + 2] = v.z;
        buf[4 * q + 3] = v.w;
      }
#pragma unroll
      for (int i = 0; i < 4 * K; ++i)
        w[i] = i >= 2 * K ? 0u : kOdd && part ? buf[i + 2 * kOdd] : buf[i];
    } else {
      // Quarter `part`: words K part .. K part + K - 1 (blocks 2 part, 2 part + 1)
      // into w[0 .. K), zeros above. They start (K part) mod 4 words into a
      // 16-byte load (0 for K = 4; 0 or 2 for K = 2; any for odd K), and a load
      // past the tile's K is not issued (it would read the next tile, or past
      // the array after the last).
      const int part = u % kSplit;
      constexpr int kMaxOff = K % 4 == 0 ? 0 : K % 2 == 0 ? 2 : 3;
      constexpr int kLoads = (K + kMaxOff + 3) / 4;
      const int q0 = (K * part) >> 2, off = (K * part) & 3;
      unsigned buf[4 * kLoads];
#pragma unroll
      for (int q = 0; q < kLoads; ++q) {
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (q0 + q < K) v = ldg_weight(tiles + (tile * K + q0 + q) * 32 + lane, l2_policy);
        buf[4 * q] = v.x;
        buf[4 * q + 1] = v.y;
        buf[4 * q + 2] = v.z;
        buf[4 * q + 3] = v.w;
      }
#pragma unroll
      for (int i = 0; i < 4 * K; ++i) {
        unsigned v = 0u;
        if (i < K) {
          v = buf[i];
#pragma unroll
          for (int o = 1; o <= kMaxOff; ++o)
            if (i + o < 4 * kLoads && off == o) v = buf[i + o];
        }
        w[i] = v;
      }
    }
    raw = ldg_weight(reinterpret_cast<const RawScale*>(scales) + tile * 32 + lane, l2_policy);
  };
  // The codebook's entries (lane j: entry j mod 2^K; k = 2 also entry (j / 4) mod 4)
  // are loaded before the weights. Loaded after the staging, as they were,
  // 4096x4096 at k = 3..5 ran 13-16% slower at M = 1 and 4 (H200,
  // define_ab_h200_30aaba8_cb_first.txt); the small layers within 3%.
  // A's staging copies issued before this first weight tile instead of after
  // it: 0.88-0.98x on the small and mid layers at M = 4..16, 0.97-1.02x at M =
  // 1, MoE T = 1 within 1.5% (H100, define_ab_h100_latency_a_first_2cc6094.txt),
  // though the stamps show A staged 0.2-0.5 us after the first tile arrived.
  const float cb_lane = codebook[lane & ((1 << K) - 1)], cb_hi = codebook[(lane >> 2) & 3];
  if (kw < warp_units) load_unit(kw, w_s[0], raw_s[0]);

  // [rows][stride], then the partial tiles (below); CLUSTER: the partial tiles
  // first, at the same address in every CTA of the cluster (their staged
  // columns differ in number), then the rows.
  // The stage starts on a 128-byte line, whatever the static shared memory
  // before it: 16 bytes more static shared memory (656 instead of 640) put it
  // off one and made moe_linear's T = 1 launches 1.23-1.34x slower on the H200
  // with the same SASS (moe_gap_probe_h200_smem_pad_*.txt), the dense launches
  // up to 1.45x on the H100 (define_ab_h100_smem_align_*.txt).
  extern __shared__ __align__(KBIT_LATENCY_STAGE_ALIGN) uint4 x_stage[];
  uint4* const stage = CLUSTER ? x_stage + warps * M_TILES * 32 : x_stage;
  if constexpr (CLUSTER) {
    // A CTA's rows are short (often one K tile: 32 chunks) and many (up to
    // 64): a warp per (row, local K tile), so that every warp issues copies.
    for (int p = warp; p < rows * local_tiles; p += warps) {
      const int row = p / local_tiles, c = (p - row * local_tiles) * 32 + lane;
      const int col8 = kt_of(c >> 5) * 32 + lane;  // 8-column chunk of A
      const bool valid = 8 * col8 < K_dim;
      const T* src = valid ? A + (long long)row * K_dim + 8 * col8 : A;
      const unsigned dst =
          (unsigned)__cvta_generic_to_shared(stage + row * stride + (c ^ (row & 7)));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                   "r"(valid ? 16 : 0));
    }
  } else {
    for (int row = 0; row < rows; ++row) {
      for (int c = threadIdx.x; c < stride; c += blockDim.x) {
        const bool valid = 8 * c < K_dim;
        const T* src = valid ? A + (long long)row * K_dim + 8 * c : A;
        const unsigned dst =
            (unsigned)__cvta_generic_to_shared(stage + row * stride + (c ^ (row & 7)));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                     "r"(valid ? 16 : 0));
      }
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
  __shared__ uint4 zero_row[32];  // what the ldmatrix lanes of rows past M read
  if (threadIdx.x < 32) zero_row[threadIdx.x] = make_uint4(0u, 0u, 0u, 0u);
#if KBIT_LATENCY_SMEM_PAD  // A/B runs only: this many bytes (a multiple of 16) more static shared memory
  __shared__ uint4 smem_pad[KBIT_LATENCY_SMEM_PAD / 16];
  if (M < 0) reinterpret_cast<volatile unsigned*>(smem_pad)[threadIdx.x % (KBIT_LATENCY_SMEM_PAD / 4)] = 0u;
#endif

  // Tables (as gemm_mma.cu's mma path): the (scale, scale) pair of an E4M4
  // code where it is not computed (bf16 with KBIT_BF16_ALU_SCALE=0), the pair table of
  // weights for k = 3 built by shuffles from the lane-register codebook.
  constexpr bool kAluScale = sizeof(TScale) == 1 && (IsHalf<T>::value || KBIT_BF16_ALU_SCALE);
  __shared__ unsigned scale_pair[sizeof(TScale) == 1 && !kAluScale ? 256 : 1];
  if constexpr (sizeof(TScale) == 1 && !kAluScale) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
      const unsigned h = Mma<T>::to_bits(e4m4_decode(i));
      scale_pair[i] = h | (h << 16);
    }
  }
  // FOLD (the host's choice, gemm._cb_fold) or KBIT_CB_FOLD: the scale pair's
  // factor in the codebook entries (mma_common.cuh).
  constexpr bool kCbFold = (FOLD || KBIT_CB_FOLD) && kAluScale;
  const unsigned cb = cb_bits<T, kCbFold>(cb_lane);
  const unsigned cb_pair = cb | (cb_bits<T, kCbFold>(cb_hi) << 16);
  constexpr bool kPairTable = K == 3;
  constexpr int kPairs = 1 << (2 * K);
  __shared__ uint4 pair_tab[kPairTable ? kPairs * kPairEntryU4<K> : 1];
  const unsigned pair_base = kPairTable ? tab_base(pair_tab) : 0u;  // (mma_common.cuh)
  if constexpr (kPairTable) {
    for (int i0 = warp * 32; i0 < kPairs * 8; i0 += blockDim.x) {
      const int i = i0 + lane, b = (i >> 3) & (kPairs - 1);
      const unsigned v = (__shfl_sync(kFullMask, cb, b & ((1 << K) - 1)) & 0xffffu) |
                         (__shfl_sync(kFullMask, cb, b >> K) << 16);
      if (i < kPairs * 8) pair_tab[pair_tab_slot<K>(i)] = make_uint4(v, v, v, v);
    }
  }
  auto stamp_loads = [&]() {  // (stamped builds only)
    if (kw < warp_units) latency_phase_after(1, w_s[0][0] ^ w_s[0][4 * K / kSplit - 1]);  // first tile in
    if (kw < warp_units) latency_phase_after(6, reinterpret_cast<const unsigned&>(raw_s[0]));  // its scales
    latency_phase_after(7, cb);  // the codebook
  };
#ifdef KBIT_LATENCY_PHASES_LOADS_FIRST  // the loads' own arrival, before the staging's wait
  stamp_loads();
#endif
  asm volatile("cp.async.wait_group 0;\n" ::);
  __syncthreads();  // the staged rows, the zero row and the tables
  latency_phase(2);  // staging done
#ifndef KBIT_LATENCY_PHASES_LOADS_FIRST
  stamp_loads();
#endif

  // ldmatrix: lane l gives the address of row 8mt + (l & 7), chunk 4j + (l >> 3)
  // of the K tile (block j): with the swizzle, 8(j >> 1) + ((4(j & 1) + (l >> 3))
  // ^ (row & 7)), so one address for even and one for odd j plus immediate
  // offsets. Rows past M read the zero row instead.
  const unsigned zero_addr = (unsigned)__cvta_generic_to_shared(zero_row);
  const unsigned x_base = (unsigned)__cvta_generic_to_shared(stage);
  const int my_row = lane & 7, my_chunk = lane >> 3;

  // One accumulator chain per row tile: 2 or 4 independent chains (mma i of a
  // K tile into chain i mod chains) were no faster (H100, 9914dc2,
  // define_ab_h100_9914dc2_chains.txt): a warp's 16 dependent mma per K tile
  // are not what its time waits on.
  float acc[M_TILES][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][i] = 0.0f;

  // One K tile: decode, scale, multiply. kHalf (a half-tile CTA): only the
  // rows of `upper`, brought to the places of rows g by shifting the lane's
  // index string (select_upper) and decoded as rows g; rows g + 8 of the mma
  // are zero, so its rows g are the CTA's rows, in the same bits as a whole
  // tile's mma gives them.
  // u: the unit, of local K tile i (its staged columns), part `part` (blocks
  // 8 / kSplit part ..).
  auto tile = [&](bool kHalf, int u, const unsigned (&w_in)[4 * K], const RawScale& raw,
                  unsigned (&w_next)[4 * K], RawScale& raw_next) {
    if (u + wk < warp_units) load_unit(u + wk, w_next, raw_next);
    const int i = u / kSplit, part = u % kSplit;
    unsigned w[4 * K];
    if (kHalf) {  // a constant where inlined (all_tiles)
      select_upper<K>(w_in, upper, w);
    } else {
#pragma unroll
      for (int i = 0; i < 4 * K; ++i) w[i] = w_in[i];
    }
    unsigned sw_lo[2 * ScaleWord<TScale>::kBytes / 4], sw_hi[2 * ScaleWord<TScale>::kBytes / 4];
    const int lo_lane = 2 * g + (kHalf && upper ? 16 : 0);  // kHalf: the CTA's rows in sw_lo
    // Lane 2g + s holds the codes of blocks 4s .. 4s + 3 of row g (2g + 16 + s:
    // row g + 8). kSplit 4: the part's two, brought to the word's first two
    // (bytes; halves of the first word for float16 scales).
    if constexpr (kSplit == 4) {
      const int src = part >> 1;
      if constexpr (sizeof(TScale) == 1) {
        const unsigned shift = 16u * (part & 1);
        sw_lo[0] = __shfl_sync(kFullMask, raw, lo_lane + src) >> shift;
        if (!kHalf) sw_hi[0] = __shfl_sync(kFullMask, raw, 2 * g + 16 + src) >> shift;
      } else {
        const unsigned word = part & 1 ? raw.y : raw.x;
        sw_lo[0] = __shfl_sync(kFullMask, word, lo_lane + src);
        if (!kHalf) sw_hi[0] = __shfl_sync(kFullMask, word, 2 * g + 16 + src);
      }
    }
#pragma unroll
    for (int half = 0; half < (kSplit == 4 ? 0 : 2 / kSplit); ++half) {  // kSplit 2: the part's scales only
      const int src = half + part;
      if constexpr (sizeof(TScale) == 1) {
        sw_lo[half] = __shfl_sync(kFullMask, raw, lo_lane + src);
        if (!kHalf) sw_hi[half] = __shfl_sync(kFullMask, raw, 2 * g + 16 + src);
      } else {
        sw_lo[2 * half] = __shfl_sync(kFullMask, raw.x, lo_lane + src);
        sw_lo[2 * half + 1] = __shfl_sync(kFullMask, raw.y, lo_lane + src);
        if (!kHalf) {
          sw_hi[2 * half] = __shfl_sync(kFullMask, raw.x, 2 * g + 16 + src);
          sw_hi[2 * half + 1] = __shfl_sync(kFullMask, raw.y, 2 * g + 16 + src);
        }
      }
    }
    unsigned x_even[M_TILES], x_odd[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      const int row = 8 * mt + my_row;
      const unsigned base = x_base + 16u * (row * stride + i * 32 + part * (32 / kSplit));
      x_even[mt] = row < rows ? base + 16u * (my_chunk ^ my_row) : zero_addr;
      x_odd[mt] = row < rows ? base + 16u * ((4 + my_chunk) ^ my_row) : zero_addr;
    }
#pragma unroll
    for (int j = 0; j < 8 / kSplit; ++j) {
      unsigned wp[2][4];  // [h][pair p]: columns (8p + 2t, +1) of row g + 8h, block j
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (kHalf && h == 1) {
#pragma unroll
          for (int p = 0; p < 4; ++p) wp[1][p] = 0u;
          continue;
        }
        // (scale, scale) of row g + 8h, block j
        const unsigned sp = block_scale_pair<T, TScale, kAluScale, kCbFold>(h ? sw_hi : sw_lo, j, scale_pair);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const unsigned pair =
              weight_pair<K, kPairTable>(w, 16 * j + 8 * h + 2 * p, cb, cb_pair, pair_base, lane4);
          wp[h][p] = Mma<T>::mul2(pair, sp);
        }
      }
      // A block is 4 chunks: ldmatrix.x4 gives lane (g, t) words t, 4 + t,
      // 8 + t, 12 + t of row 8mt + g: b0, b1 of both k16 steps.
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        uint4 x;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                     : "r"((j & 1 ? x_odd[mt] : x_even[mt]) + (j >> 1) * 128));
#pragma unroll
        for (int slab = 0; slab < 2; ++slab) {
          const unsigned a[4] = {wp[0][2 * slab], wp[1][2 * slab], wp[0][2 * slab + 1],
                                 wp[1][2 * slab + 1]};
          Mma<T>::run(acc[mt], a, slab ? x.z : x.x, slab ? x.w : x.y);
        }
      }
    }
  };
  auto all_tiles = [&](bool kHalf) {
    for (int u = kw; u < warp_units; u += 2 * wk) {
      tile(kHalf, u, w_s[0], raw_s[0], w_s[1], raw_s[1]);
      if (u + wk < warp_units) tile(kHalf, u + wk, w_s[1], raw_s[1], w_s[0], raw_s[0]);
    }
  };
  if (half_tiles)  // two inlined copies (ptxas reports no stack), each for its constant
    all_tiles(true);
  else
    all_tiles(false);

  latency_phase(3);  // this warp's tiles decoded and multiplied
  // The warps' partial tiles ([warps][M_TILES][32], after the staged rows;
  // CLUSTER: before them), added in warp order.
  float4* red = reinterpret_cast<float4*>(CLUSTER ? x_stage : x_stage + rows * stride);
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
    red[(warp * M_TILES + mt) * 32 + lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
  if (!CLUSTER) __syncthreads();  // (CLUSTER: the cluster barrier below orders the CTA too)
  latency_phase(4);  // partial tiles in shared memory
  // One thread per accumulator (mt, lane l, element c): the warps' values are
  // all loaded, then added in warp order. Element c of lane l is row
  // rt * 16 + l / 4 + 8 (c / 2) of W (of a half tile: rt * 16 + 8 upper + l / 4,
  // c < 2), row mt * 8 + 2 (l % 4) + c % 2 of A.
  const float* red_f = reinterpret_cast<const float*>(red);
  if constexpr (CLUSTER) {
    // Output float4 (row tile r of the group, mt, lane l): item
    // (r * M_TILES + mt) * 32 + l, the items of rank q those with
    // item / blockDim.x = q mod ranks. Its sum over ranks, then over the
    // warps of row tile r (warp kw * cta_row_tiles + r), element by element.
    cluster_sync();  // every CTA's partial tiles written
    const unsigned red_addr = (unsigned)__cvta_generic_to_shared(red);
    const int items = cta_row_tiles * M_TILES * 32, reads = ranks * wk;
    for (int i = rank * blockDim.x + threadIdx.x; i < items; i += ranks * blockDim.x) {
      const int r = i / (M_TILES * 32), within = i - r * (M_TILES * 32);
      const int mt = within >> 5, l = within & 31;
      const int n = (group * cta_row_tiles + r) * 16 + (l >> 2);  // elements 2, 3: n + 8
      const int m = mt * 8 + 2 * (l & 3);                         // elements 1, 3: m + 1
      // No element of this quad is stored: no remote load either (the exit
      // barrier relies on every remote load's value being used).
      if (n >= N || m >= rows) continue;
      float4 v[kClusterMaxReads];
#pragma unroll
      for (int j = 0; j < kClusterMaxReads; ++j) {
        if (j < reads) {
          const int q = j / wk, w = j - q * wk;
          v[j] = ld_cluster_f32x4(red_addr + 16u * ((w * cta_row_tiles + r) * M_TILES * 32 + within), q);
        }
      }
      float4 s = v[0];
#pragma unroll
      for (int j = 1; j < kClusterMaxReads; ++j)
        if (j < reads) add_f32x4(s, v[j]);
      store_acc_quad(C, N, rows, n, m, s);  // stores element (n, m): uses every load
    }
    cluster_sync_exit();  // no CTA leaves while another reads its shared memory
    return;
  }
  for (int i = threadIdx.x; i < M_TILES * 128; i += blockDim.x) {
    const int mt = i >> 7, l = (i >> 2) & 31, c = i & 3;
    if (half_tiles && c >= 2) continue;
    float v[kLatencyMaxWarps];
#pragma unroll
    for (int w = 0; w < kLatencyMaxWarps; ++w)
      if (w < warps) v[w] = red_f[(w * M_TILES + mt) * 128 + 4 * l + c];
    float s = v[0];
#pragma unroll
    for (int w = 1; w < kLatencyMaxWarps; ++w)
      if (w < warps) s += v[w];
    const int n = rt * 16 + (l >> 2) + 8 * (half_tiles ? (int)upper : c >> 1);
    const int m = mt * 8 + 2 * (l & 3) + (c & 1);
    if (n < N && m < rows) Mma<T>::store(C + (long long)m * N + n, s);
  }
  latency_phase(5);  // exit
}

}  // namespace kbit
