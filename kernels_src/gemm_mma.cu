// gemm_mma.cu: C = A @ dequant(W).T with k-bit weights, on tensor cores (sm_80+).
//
// The product is computed transposed, C^T = W A^T, with mma.sync m16n8k16:
// the weight tile is operand A (16 rows of W), the activations operand B
// (8 rows of A per n8 tile, M_TILES tiles), fp32 accumulators. A warp owns one
// 16-row tile of W (RPW of them) and a range of 256-wide K tiles (a segment,
// see "Work split" below); it decodes each weight once and feeds it to every
// n8 tile, so decode cost does not grow with M.
//
// Weight layout (made once by kbit_cupy/gemm.py:repack_for_gemm): for row
// tile rt and K tile kt, lane l = 4g + t holds 128 k-bit indices as one bit
// string of 4K words, field f = 16j + 8h + 2p + e = block j (0..7), row
// g + 8h, column 8p + 2t + e of the block (p = 0..3, e = 0..1): pair p is
// A-fragment register p of thread t's k-slots in natural order (k16 step
// p >> 1, slots 2t, 2t+1 or 2t+8, 2t+9), so activations need no permutation.
// Field f sits at bits [f*K, f*K + K) of the string: one funnel shift brings
// any field to the low bits. The words are stored as K uint4 per lane, uint4
// q of all 32 lanes contiguous (coalesced).
//
// Scales: per tile 16 rows x 8 blocks, row-major; lane l loads the 4 entries
// of row l/2, blocks 4(l%2) .. 4(l%2)+3 (uint8 E4M4 codes: one word; fp16:
// two), and shuffles hand each thread the 16 it needs (rows g and g+8).
//
// Codebook lookup: k=3/4 through a lane-replicated pair table in shared
// memory (one LDS per two weights, see pair_tab), k=2 through a pair table in
// lane registers (one shuffle per two weights), k=5 through the codebook in
// lane registers (one shuffle per weight). Where their tables fit: k = 4's
// PRMT-addressed table (kPrmtTable), k = 2's byte table (two pairs per
// 8-byte LDS, kQuadTable) and k = 5's 128 KB pair table (kBigPairTable).
//
// Effective weight: half(codebook[idx]) * half(scale) in the activation type
// (FORMAT.md section 7 allows one unit in the last place against section 6).
//
// Work split: a CTA's warps (4, or WARPS) own a "group" of warps * RPW row tiles and walk its
// K tiles together (they share the staged activations). The (group, K tile)
// units, n_groups * group_units of them, are cut into equal contiguous
// ranges, one per CTA. gemm.py picks one of two shapes:
// - stream-K (group_units = k_tiles): the grid is as large as fits on the GPU
//   at once, so every SM has the same work and there is no partial last wave;
//   a CTA covers some groups whole and at most two in part;
// - split K (group_units = splits * tiles per split, the units past k_tiles
//   padding): every CTA covers exactly one part of one group.
// A part is a "segment" whose fp32 partial tile goes to workspace slot 2c
// (CTA c's first segment) or 2c + 1 (its last); the counter of a row tile adds
// up the K tiles done, and the warp that completes them adds the slots of the
// group's CTAs in CTA order and writes C, so results are deterministic. The
// next unit's loads run across segment ends.
// Split K in clusters (the Hopper path at one warpgroup a CTA, gemm.py
// _wg_cluster_splits): the launch's clusters are a group's splits (cluster
// dims (1, splits, 1), so CTA rank q is segment q). Each CTA leaves its
// partial tile in its own shared memory, and after a cluster barrier the
// ranks take blocks of blockDim.x items in turn (block b: rank b mod ranks),
// add every rank's values of each item (in rank order, from zero: the same
// sums and bits as the workspace path's for the same split) through
// distributed shared memory and write them to C: no workspace, no counters,
// and the reduction spread over the group's CTAs instead of done by the last
// one.
//
// Hopper path (template argument WG > 0, compiled for sm_90a only): the
// same layout, decode, work split and reduction, with the multiply issued as
// wgmma.mma_async: C^T = W A^T,
// the decoded weights are operand A in registers (each warp's 16-row tile in
// the m16n8k16 A-fragment order, which is wgmma's per-warp order too), the
// activations operand B read by the tensor cores from shared memory in k
// order, and the batch M is wgmma's N (8 * M_TILES = 8 .. 256 per launch). A
// CTA is WG warpgroups (4 WG warps, one row tile each) sharing the staged
// activations. wgmma is asynchronous: block j's multiply runs while block
// j + 1 decodes. From 24 n8 tiles (192 and 256 rows: 96 or 128 accumulators
// per thread, two warpgroups) the launch is warp-specialised ("slab
// staging"): a producer warp loads 64-column slabs of A with the tensor copy
// engine into a ring of stages and hands them over through named barriers,
// and setmaxnreg moves the producer warpgroup's registers to the consumers.
//
// Grouped launch (template argument GROUPED; mma.sync, or the Hopper path
// without slab staging for problems of many rows): one launch
// multiplies many experts of one shape, each by its own rows of A
// (mixture-of-experts). Rows group_offsets[e] .. group_offsets[e+1] - 1 of A
// (and of C) belong to expert e, whose tiles follow expert e - 1's. Each
// expert's rows are cut into "problems" of up to 8 * M_TILES rows; the
// (problem, group, K tile) units of all problems are split over the CTAs
// as above (stream-K over every resident CTA, or, when the busiest SM then
// runs fewer tiles, one CTA per group: little work, few K tiles), so every SM
// gets the same share of the experts that have rows, and experts without
// rows cost nothing. The problem
// count is only known on the device: every CTA scans group_offsets into a
// prefix count of problems per expert in shared memory first (no host round
// trip, no extra launch), and finds a unit's expert by binary search in it.
#include "common.cuh"
#include "mma_common.cuh"
#include "wgmma.cuh"

namespace kbit {

// KBIT_SPLITK_RELEASE=1 (default): the split-K counter through one
// release-acquire add per warp; 0: two __threadfence per lane around a relaxed
// add, as before. H100, kernel-only, mma, same bits
// (define_ab_h100_d7af5e2_splitk_release.txt): 2048x768 1.04-1.09x,
// 4096x4096 1.02-1.05x, 4096x28672 and 14336x4096 1.01-1.03x, 8192x57344
// 1.00-1.02x but k=2 M=1 0.974x (68.3 -> 70.1 us); repeated with the fences
// as the variant (define_ab_h100_579d56d_splitk_fences.txt): the release form
// 1.00-1.03x on 8192x57344 (k=2 M=1 68.7 against 69.5 us), 1.06-1.09x on 2048x768.
#ifndef KBIT_SPLITK_RELEASE
#define KBIT_SPLITK_RELEASE 1
#endif
__device__ __forceinline__ int atom_add_acq_rel_gpu(int* addr, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(addr), "r"(v) : "memory");
  return old;
}

// Slab staging of the wgmma path (see the kernel): from this many n8 tiles.
// The ring's stages for M_TILES and WG warpgroups: about 128 KB of
// activations, 4..8 slabs, at most 15 / (WG + 1) (its named barriers).
// kbit_cupy/_jit.py mirrors both (the launch's threads and shared memory).
constexpr int kSlabMinTiles = 24;
// k = 4 with slab staging up to this many n8 tiles: the PRMT-addressed pair
// table (64 KB, before the ring) instead of the 32 KB one; 0: none
// (_jit.GEMM_SLAB_PRMT_MAX_TILES mirrors it: an A/B sets both, e.g.
// define_ab.py --define KBIT_SLAB_PRMT_MAX_TILES=32,_jit.GEMM_SLAB_PRMT_MAX_TILES=32).
// Off: H100, k = 4, fp16, the same bits, time with the table against without
// (results/define_ab_h100_slab_prmt32_off_26fd8a6_*.txt, two runs): 0.990-0.993 on
// 4096x28672 and 14336x4096 at 1024 and 2048 rows (bf16 0.989-0.993), 0.986-0.998
// at 192 and 256 rows; 28672x8192 at 2048 rows 1.031 and 1.055, 8192x57344 at
// 1024 rows 1.015 in one run, 0.989 in the other (benchmarks/NOTES-gemm.md).
#ifndef KBIT_SLAB_PRMT_MAX_TILES
#define KBIT_SLAB_PRMT_MAX_TILES 0
#endif
// Stages (whole K tiles) of the wgmma path below slab staging: three, so
// that a tile's copies need no wait for the previous tile's multiplies; two
// past 16 n8 tiles (the grouped launch's 144 and 160 rows: three stages of
// 72-80 KB do not fit beside the decode tables). _jit.gemm_wg_stages mirrors it.
// KBIT_WG_TWO_STAGES_FROM (A/B runs only; the host still sizes three stages
// below 17 n8 tiles, which is more than two need): two stages from there.
// Never above 17: the host sizes two stages from 17 n8 tiles.
#ifndef KBIT_WG_TWO_STAGES_FROM
#define KBIT_WG_TWO_STAGES_FROM 17
#endif
static_assert(KBIT_WG_TWO_STAGES_FROM <= 17, "the host sizes two stages from 17 n8 tiles");
__host__ __device__ constexpr int gemm_wg_stages(int m_tiles) {
  return m_tiles >= KBIT_WG_TWO_STAGES_FROM ? 2 : 3;
}
__host__ __device__ constexpr int gemm_slab_ring(int m_tiles, int wg) {
  return (128 / m_tiles < 4 ? 4 : 128 / m_tiles > 8 ? 8 : 128 / m_tiles) < 15 / (wg + 1)
             ? (128 / m_tiles < 4 ? 4 : 128 / m_tiles > 8 ? 8 : 128 / m_tiles)
             : 15 / (wg + 1);
}
// setmaxnreg budgets of the warp-specialised launch. ptxas gives the kernel
// its entry cap, 65536 / threads rounded down to 8 (launch bounds with one
// CTA per SM), and setmaxnreg only moves registers within the CTA's
// allocation, so WG consumers and the producer must fit in (WG + 1) x the
// cap: the producer keeps 24 or a little more, the consumers the rest (two:
// 240 + 24 of 168 x 3; three: 160 + 32 of 128 x 4). More would make
// setmaxnreg.inc wait forever.
template <int WG> constexpr int kEntryRegs = 65536 / (128 * (WG + 1)) / 8 * 8;
template <int WG> constexpr int kConsumerRegs = (kEntryRegs<WG> * (WG + 1) - 24) / WG / 8 * 8;
template <int WG> constexpr int kProducerRegs = kEntryRegs<WG> * (WG + 1) - WG * kConsumerRegs<WG>;
static_assert(kConsumerRegs<2> == 240 && kProducerRegs<2> == 24, "two consumer warpgroups");
static_assert(kConsumerRegs<3> == 160 && kProducerRegs<3> == 32, "three consumer warpgroups");

// The last block (0..7) of a K tile whose decode reads a word of the lane's
// 16-byte index word q: block j reads bits from 16jK - 7 on (pair_offset).
// (k = 3's byte lanes, kByteLanes: blocks 2G and 2G + 1 read words 3G .. 3G + 2.)
template <int K>
__host__ __device__ constexpr int kReloadAfter(int q) {
  if (kByteLanes<K>) return 2 * ((4 * q + 3) / 3) + 1 > 7 ? 7 : 2 * ((4 * q + 3) / 3) + 1;
  return (128 * (q + 1) + 7 + 16 * K - 1) / (16 * K) - 1 > 7 ? 7
                                                             : (128 * (q + 1) + 7 + 16 * K - 1) / (16 * K) - 1;
}

// CTAs per SM the register allocation must allow: M_TILES = 4 with two row
// tiles per warp sits just above an occupancy step at k = 2 with E4M4 scales
// (4 CTAs at 128 registers) and at k = 4 (3 CTAs at 168); elsewhere the
// compiler chooses (fp16 scales at k = 2 would spill at 128).
// Scale after the multiply (see kScaleAfter in the kernel): k = 4, E4M4
// scales, mma.sync at one n8 tile; the grouped launch only with 8 warps
// (with 4 it measured 2-12% slower on the H100, -2..+14% on the H200:
// results/moe_gap_probe_h{100,200}_grouped_wide_3ed1ab3.txt).
// KBIT_SCALE_AFTER_WIDE=1 (experiment, default 0): also k = 2 and 5 on their
// wide mma launches (8 and 16 warps, the byte and pair tables).
#ifndef KBIT_SCALE_AFTER_WIDE
#define KBIT_SCALE_AFTER_WIDE 0
#endif
// KBIT_SCALE_AFTER_K3=1 (experiment, default 0): also k = 3's dense mma.sync
// launches at one n8 tile (4 and 8 warps); other bits than without (the
// scale in fp32 after the multiply), within FORMAT.md section 7. Its HMUL2
// per pair is 160 of the 878 instructions of two K tiles
// (results/sass_loop_h200_a4fd5c1.txt); -5..+6% by layer when last measured
// (30318fa, before the 8-warp launch), for A/B runs with KBIT_K3_BYTE_LANES.
#ifndef KBIT_SCALE_AFTER_K3
#define KBIT_SCALE_AFTER_K3 0
#endif
template <int K, int SCALE_BYTES, int M_TILES, int RPW, int WG, bool GROUPED, int WARPS = 4>
constexpr bool kScaleAfterOf =
    SCALE_BYTES == 1 && RPW == 1 && WG == 0 &&
    ((K == 4 && M_TILES == 1 && (!GROUPED || WARPS == 8)) ||
     (KBIT_SCALE_AFTER_WIDE && M_TILES == 1 && (K == 2 || K == 5) && !GROUPED && WARPS >= 8) ||
     (KBIT_SCALE_AFTER_K3 && M_TILES == 1 && K == 3 && !GROUPED));
// With the scale after the multiply, five CTAs: ptxas otherwise hoists the
// decode of later blocks (the multiplies no longer form one chain) and takes
// 144 registers; at five, 96 and no spill, and the 33 KB of tables already
// allow only five CTAs per SM.
template <int K, int SCALE_BYTES, int M_TILES, int RPW, int WG, bool GROUPED>
constexpr int kMinCtas =
    M_TILES == 4 && RPW == 2 ? (K == 2 && SCALE_BYTES == 1 ? 4 : K == 4 ? 3 : 1)
    : kScaleAfterOf<K, SCALE_BYTES, M_TILES, RPW, WG, GROUPED> ? 5 : 1;

// WARPS = 8 (mma.sync at one n8 tile): 8 warps per CTA and two CTAs per SM
// (128 registers) instead of 4 warps and kMinCtas. One CTA's pair table (64
// KB, addressed by PRMT: kPrmtTable) and activation stage then serve 8
// warps. gemm.py takes it for k = 4 with E4M4 scales on the large layers,
// where it measured faster on both GPUs (results/define_ab_h{100,200}_mma_warps_*_a4fd5c1.txt);
// experts.py for the grouped launch at one n8 tile (k = 4, E4M4, sm_90), with
// the scale after the multiply: H200 4-10% less time at T = 2..32 on three
// configs, H100 within 1.2% either way (results/moe_gap_probe_h{100,200}_grouped_wide_3ed1ab3.txt).
// (gemm.py and experts.py size the table's shared memory by _jit.gemm_prmt_table_bytes.)
// The grouped Hopper path (k = 4) reads its pair table through PRMT as the
// 8-warp launch does (64 KB in the dynamic shared memory, experts.py adds it)
// for problems of up to 64 rows: 4-6% less time at T = 128 and 512 on five
// configs on the H100, 5-8% on three on the H200 (results/moe_gap_probe_h{100,200}_wg_prmt_9eefc53.txt,
// same bits; 64-row problems 3-5% on both, moe_gap_probe_h{100,200}_grouped_wg_prmt8_*.txt).
// 128-row problems keep the 32 KB table: with 64 KB their stages no longer
// fit and the launch took smaller problems, 4.6% slower (Mixtral, T = 512).
#ifndef KBIT_GROUPED_WG_PRMT_MAX_TILES
#define KBIT_GROUPED_WG_PRMT_MAX_TILES 8
#endif
constexpr int kGroupedWgPrmtMaxTiles = KBIT_GROUPED_WG_PRMT_MAX_TILES;
// The dense Hopper path (k = 4) the same up to KBIT_DENSE_WG_PRMT_MAX_TILES n8
// tiles (gemm.py adds the 64 KB; _jit.GEMM_DENSE_WG_PRMT_MAX_TILES mirrors it):
// M = 17..64 3-8% less time on four large layers on both GPUs, same bits
// (results/define_ab_h200_dense_wg_prmt_*_7477c30.txt, define_ab_h100_dense_wg_prmt_off_*_2414541.txt).
// At 16 n8 tiles three 64 KB stages leave no room for it.
#ifndef KBIT_DENSE_WG_PRMT_MAX_TILES
#define KBIT_DENSE_WG_PRMT_MAX_TILES 8
#endif
constexpr int kDenseWgPrmtMaxTiles = KBIT_DENSE_WG_PRMT_MAX_TILES;
// k = 2 on the dense Hopper path up to kDenseWgPrmtMaxTiles n8 tiles and on
// the 8-warp mma launch looks up a byte of the index string (two pairs) in a
// 64 KB table ([256 bytes][32 lanes] of two pairs) at the place of the PRMT
// table: one PRMT and one 8-byte load per two pairs instead of two shifts and
// two shuffles (gemm.py adds the 64 KB where _jit.GEMM_K2_QUAD_TABLE; 0 here
// and there: the shuffle decode, for A/B runs). In one process, same bits:
// wgmma at M = 1..32 5-10% less time on three large layers on both GPUs (M =
// 64 within 1.2%; results/define_ab_h{100,200}_k2_quad_table_*.txt); the
// 8-warp mma launch with it, against 4 warps without, M = 1..8: 1-7.5% less
// on the layers with K_dim >= 8192, 2-4.5% more on 4096x28672, where gemm.py
// keeps 4 warps (define_ab_h{100,200}_k2_wide_mma_quad_b424263.txt).
#ifndef KBIT_K2_QUAD_TABLE
#define KBIT_K2_QUAD_TABLE 1
#endif
// k = 5's 128 KB pair table on the dense Hopper path up to this many n8 tiles
// (kBigPairTable in the kernel; _jit.GEMM_DENSE_WG_K5_TABLE_MAX_TILES mirrors it).
#ifndef KBIT_DENSE_WG_K5_TABLE_MAX_TILES
#define KBIT_DENSE_WG_K5_TABLE_MAX_TILES 8
#endif

// C stores without a check per element where a warp's whole tile is in
// bounds, and in the grouped launch one check per row where its row tile is
// (finish_segment; 0: every element checked, for A/B runs).
#ifndef KBIT_FAST_STORE
#define KBIT_FAST_STORE 1
#endif
// With those fast stores, C's rows in 8-byte pieces (acc_quad_rows,
// mma_common.cuh: two shuffles a tile) where N % 4 == 0 and C is 8-byte
// aligned, instead of 2-byte stores (0: those, for A/B runs). H200, in one
// process against 0, the same bits: the grouped Hopper path 1.4-5.0% less
// time at 8-64 rows an expert; dense 4096x4096 1-7% less at 64-256 rows,
// small layers within 3% either way (benchmarks/NOTES-gemm.md).
#ifndef KBIT_QUAD_STORE
#define KBIT_QUAD_STORE 1
#endif
// The grouped launch's next segment's expert searched from the current
// one's (locate; 0: a binary search over all experts, for A/B runs). H200,
// in one process against 0, the same bits: 0.5-4.7% less time on three
// 128- and 512-expert configs at T = 8..512, Mixtral (8 experts) 0.1%.
#ifndef KBIT_LOCATE_HINT
#define KBIT_LOCATE_HINT 1
#endif

#ifndef KBIT_GROUPED_SLACK_HALVES
#define KBIT_GROUPED_SLACK_HALVES 1  // (the grouped launch's split; see its use)
#endif
// Where moe_linear's grouped launch places its rows (see the use): 1, after
// each warp's first weight tile is prefetched; 0, before anything is asked of
// the weights (for A/B runs).
#ifndef KBIT_ROUTED_PREFETCH
#define KBIT_ROUTED_PREFETCH 1
#endif
// KBIT_ROUTED_EARLY_TILE: instead, each warp loads its first weight tile
// into its registers before the rows are placed (the placement inlined, so
// the loads stay in flight across it) and only the activations' copies wait
// for the placement. 2 (default): on the Hopper path's grouped variants up
// to 4 n8 tiles (kEarlyTile below, with the measurements); 1: on every
// grouped variant; 0: on none (A/B runs).
#ifndef KBIT_ROUTED_EARLY_TILE
#define KBIT_ROUTED_EARLY_TILE 2
#endif

// moe_linear's fused routing: the router's ids a thread stages and counts are
// loaded this many at a time, all in flight before the first is stored and
// counted (1: one load, store and count after another, a round trip each:
// ptxas does not hoist a load above the shared atomic before it). H200, k = 4
// fp16, kernel-only, in one process against 1 (the same bits;
// results/moe_gap_probe_h200_route_batch_*_2fa07b3.txt): moe_linear at T = 512
// top-8 on 128 x [2048, 768] 76.65 -> 74.61 us, on 128 x [1536, 2048] 123.73
// -> 121.65; at T = 128 0.1-1.1% less (512 x [512, 2048] top-10 too),
// there at T = 8 and 32 within 0.5%.
#ifndef KBIT_ROUTE_ID_BATCH
#define KBIT_ROUTE_ID_BATCH 8
#endif
#ifndef KBIT_ROUTE_SLICE_ODD
#define KBIT_ROUTE_SLICE_ODD 1
#endif

// Split K in clusters (the Hopper path): splits per cluster at most (the
// portable cluster size; _jit.GEMM_MAX_CLUSTER_SPLITS mirrors it).
constexpr int kMaxClusterSplits = 8;

// Phase stamps, for benchmarks/mma_phases.py only (it builds this file with
// -DKBIT_MMA_PHASES; otherwise they compile to nothing): lane 0 of each warp
// of the first kMmaPhaseCtas CTAs (linear index over x, y, z) writes the
// global timer (ns) and its SM's clock at point p to
// kbit_mma_phases[cta][warp][p][0, 1] (points: benchmarks/mma_phases.py).
// mma_phase_after first stores `dep` (a loaded word) to a sink, so the stamp
// comes after that load's data arrived.
constexpr int kMmaPhaseCtas = 2048, kMmaPhaseWarps = 16, kMmaPhasePoints = 15;
#ifdef KBIT_MMA_PHASES
extern "C" {  // unmangled names: RawModule.get_global finds them
__device__ unsigned long long kbit_mma_phases[kMmaPhaseCtas * kMmaPhaseWarps * kMmaPhasePoints * 2];
__device__ unsigned kbit_mma_phase_sink[kMmaPhaseWarps];
}
#endif
__device__ __forceinline__ void mma_phase(int point) {
#ifdef KBIT_MMA_PHASES
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if ((threadIdx.x & 31) == 0 && cta < kMmaPhaseCtas && threadIdx.x / 32 < kMmaPhaseWarps)
    stamp_clocks(kbit_mma_phases + ((cta * kMmaPhaseWarps + threadIdx.x / 32) * kMmaPhasePoints + point) * 2);
#endif
}
__device__ __forceinline__ void mma_phase_after(int point, unsigned dep) {
#ifdef KBIT_MMA_PHASES
  if ((threadIdx.x & 31) == 0 && threadIdx.x / 32 < kMmaPhaseWarps)
    *reinterpret_cast<volatile unsigned*>(kbit_mma_phase_sink + threadIdx.x / 32) = dep;
  mma_phase(point);
#endif
}

// The dense Hopper path at one warpgroup a CTA (gemm._wg_warpgroups: small
// layers, each CTA one K tile of 64 rows of W) builds the shared-memory
// decode tables above (k = 4's PRMT table, k = 2's byte table, k = 5's 128 KB
// pair table) for k where bit k of KBIT_WG1_TABLES is set
// (_jit.GEMM_WG1_TABLES mirrors it).
#ifndef KBIT_WG1_TABLES
#define KBIT_WG1_TABLES 0x10
#endif

template <int K, int SCALE_BYTES, int M_TILES, int RPW, int WG, bool GROUPED, int WARPS>
constexpr int kLaunchMinCtas = WARPS == 16 ? 1 : WARPS == 8 ? 2 : kMinCtas<K, SCALE_BYTES, M_TILES, RPW, WG, GROUPED>;

// The grouped launch's expert lookups (the last e in [lo, hi) with cum[e] <=
// p, cum non-decreasing and cum[lo] <= p) with all 32 lanes of a warp, on
// warp-uniform arguments: lane l reads the start of chunk l of 32, a ballot
// picks the last chunk that starts at or below p, and the next round searches
// it (two rounds up to 1024 experts) instead of one dependent shared load and
// compare a halving (9 at 512 experts: ncu's stall samples put 0.4-0.5 us of
// each warp's time in each such search at 512 experts, T = 8; the launch ran
// two or three before its first weight tile:
// results/ncu_source_moe_e512_top10_2048x512_T8_h200_8539e96.csv.gz). H200,
// k = 4 fp16, kernel-only, in one process against the halving (the same
// bits; results/moe_gap_probe_h200_warp_search_off_*_e6bf8c8.txt): moe_linear
// on 512 x [512, 2048] top-10 T = 8 23.70 -> 22.92 us, T = 32 54.90 -> 54.24;
// on 128 x [1536, 2048] top-8 T = 128 88.15 -> 87.75; kbit_grouped_gemm
// 0.3-0.6% less. KBIT_WARP_SEARCH=0: the binary search (A/B runs).
#ifndef KBIT_WARP_SEARCH
#define KBIT_WARP_SEARCH 1
#endif
__device__ __forceinline__ int last_at_or_below(const int* cum, int lo, int hi, int p) {
#if KBIT_WARP_SEARCH
  const int lane = threadIdx.x & 31;
  while (hi - lo > 1) {  // (warp-uniform)
    const int step = (hi - lo + 31) >> 5;
    const int idx = lo + lane * step;
    const unsigned below = __ballot_sync(0xffffffffu, idx < hi && cum[idx] <= p);
    lo += (31 - __clz(below | 1u)) * step;  // (chunk 0 at least: cum[lo] <= p is given)
    hi = min(hi, lo + step);
  }
#else
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (cum[mid] <= p) lo = mid; else hi = mid;
  }
#endif
  return lo;
}

// Grouped launch with routed ids (moe_linear): the sorted rows of problems
// p_first .. p_last (consecutive rows), of rows_per_problem rows each. Pair i
// of expert e is sorted row row_start[e] + the pairs before i with expert e,
// a stable sort (moe_route.cu's order). One block-wide count per problem over
// the ids staged in shared memory: thread t counts its slice of them, an
// exclusive scan gives each slice its rank, and the slices that hold the
// problem's rows place them. place_routed_rows_inline is the body, inlined
// where the first weight tile's loads stay in flight across it (kEarlyTile);
// elsewhere the kernel calls place_routed_rows, which is not inlined: inlined
// there, the kernel's k = 5 variant with fp16 scales at 4 n8 tiles and four
// warpgroups spilled 24 bytes (KBIT_PLACE_INLINE=1 inlines it too, for A/B
// runs of the call's cost).
__device__ __forceinline__ void place_routed_rows_inline(const int* route_id, int* route_order,
                                                         const int* tile_cum, const int* row_start,
                                                         int* warp_sums, int M, int experts,
                                                         int p_first, int p_last,
                                                         int rows_per_problem) {
  // An odd slice (KBIT_ROUTE_SLICE_ODD, default 1): the lanes' i-th ids lie
  // an odd number of words apart, in 32 banks; an even one shares banks
  // (8 ids a thread: 8 lanes a bank). The ranks are the same either way.
  // H200, k = 4 fp16, against even slices (results/moe_gap_probe_h200_route_slice_*_9934223.txt):
  // moe_linear at T = 512 top-8 on 128 x [2048, 768] 74.49 -> 73.70 us, on
  // 128 x [1536, 2048] 121.24 -> 120.19; T = 128 the same.
  const int slice = ((M + blockDim.x - 1) / blockDim.x) | KBIT_ROUTE_SLICE_ODD;
  const int i0 = min(M, (int)threadIdx.x * slice), i1 = min(M, i0 + slice);
  for (int p = p_first; p <= p_last; ++p) {
    const int e = last_at_or_below(tile_cum, 0, experts, p);  // (as the kernel's locate())
    const int r0 = (p - tile_cum[e]) * rows_per_problem, r1 = r0 + rows_per_problem;
    if (p == p_first) mma_phase_after(13, r0);  // the first problem's expert found
    int mine = 0;
    for (int i = i0; i < i1; ++i) mine += route_id[i] == e;
    if (p == p_first) mma_phase_after(14, mine);  // its ids counted (the stamping lane's slice)
    int rank = cta_exclusive_scan(mine, warp_sums);
    if (p == p_first) mma_phase(12);  // the first problem's ids counted and scanned
    if (rank < r1 && rank + mine > r0) {
      for (int i = i0; i < i1; ++i) {
        if (route_id[i] != e) continue;
        if (rank >= r0 && rank < r1) route_order[row_start[e] + rank] = i;
        ++rank;
      }
    }
    __syncthreads();  // warp_sums read before the next scan writes it; the rows placed
  }
}
#ifndef KBIT_PLACE_INLINE
#define KBIT_PLACE_INLINE 0
#endif
#if KBIT_PLACE_INLINE
#define KBIT_PLACE_QUALIFIER __forceinline__
#else
#define KBIT_PLACE_QUALIFIER __noinline__
#endif
__device__ KBIT_PLACE_QUALIFIER void place_routed_rows(const int* route_id, int* route_order,
                                                       const int* tile_cum, const int* row_start,
                                                       int* warp_sums, int M, int experts,
                                                       int p_first, int p_last,
                                                       int rows_per_problem) {
  place_routed_rows_inline(route_id, route_order, tile_cum, row_start, warp_sums, M, experts,
                           p_first, p_last, rows_per_problem);
}

// RPW: row tiles per warp. With many n8 tiles the activation fragments
// (shared-memory reads) dominate, so on layers with enough row tiles a warp
// reuses each one for two row tiles (gemm.py chooses).
// WG > 0: the Hopper path (see the header; sm_90a only) with WG warpgroups
// per CTA, RPW = 1, the staged activations in wgmma's layout. WG = 0: mma.sync, WARPS warps.
// GROUPED: the grouped launch (see the header); M is then the rows of C, q
// the GPU's SM count, rem the most problems the host allows for, group_offsets holds experts + 1 row offsets, and
// row_ids (optional) maps sorted rows to rows of C and, divided by
// ids_per_row, of A. route_ids (optional, instead of group_offsets and
// row_ids): the router's M expert ids; every CTA groups them itself (below).
// FOLD: the scale pair's factor in the codebook entries where the pair is
// computed (cb_bits, mma_common.cuh; the same bits); the host asks for it
// only for codebooks whose entries times the factor stay finite (gemm._cb_fold).
template <int K, typename T, typename TScale, int M_TILES, int RPW, int WG = 0,
          bool GROUPED = false, int WARPS = 4, bool FOLD = false, int RING = 0>
__global__ void __launch_bounds__(WG ? 128 * (WG + (M_TILES >= kSlabMinTiles)) : 32 * WARPS,
                                  kLaunchMinCtas<K, sizeof(TScale), M_TILES, RPW, WG, GROUPED, WARPS>)
    kbit_gemm_mma(
    const uint4* __restrict__ tiles, const void* __restrict__ scales,
    const float* __restrict__ codebook, const T* __restrict__ A, T* __restrict__ C,
    int M, int N, int K_dim, int row_tiles, int k_tiles, int group_units, int q, int rem,
    float* __restrict__ workspace, int* __restrict__ counters,
    const int* __restrict__ group_offsets, int experts, const int* __restrict__ row_ids,
    int ids_per_row, const int* __restrict__ route_ids, const void* __restrict__ a_map) {
  static_assert(!WG || (RPW == 1 && M_TILES <= 32), "wgmma: N = 8 .. 256");
  static_assert(!GROUPED || (RPW == 1 && M_TILES < kSlabMinTiles),
                "grouped: one row tile per warp, no slab staging");
  static_assert(WARPS == 4 || (WARPS == 8 && !WG && M_TILES == 1 && (RPW == 1 || (K == 2 && !GROUPED))) ||
                    (WARPS == 16 && K == 5 && !GROUPED && !WG && M_TILES <= 2 && RPW == 1),
                "8 warps: the mma.sync launch at one n8 tile (k = 2: one or two row tiles a "
                "warp); 16: k = 5 at up to two n8 tiles");
  mma_phase(0);
  grid_dependency_sync();
  const unsigned long long l2_policy = weight_l2_policy();
  const int lane = threadIdx.x & 31;
  const unsigned lane4 = 4u * lane;
  const int g = lane >> 2, t = lane & 3;
  // Slab staging (WG, M_TILES >= kSlabMinTiles; see below) is warp-
  // specialised: WG consumer warpgroups plus one producer warpgroup (the
  // last), whose first warp only stages activations; `warps` counts the
  // consumer warps.
  constexpr bool kSlab = WG && M_TILES >= kSlabMinTiles;
  const int warps = kSlab ? 4 * WG : blockDim.x / 32, warp = threadIdx.x / 32;
  // moe_linear (route_ids): the first weight tile loaded before the rows are
  // placed (KBIT_ROUTED_EARLY_TILE) on the Hopper path's grouped variants.
  // H200, k = 4 fp16, kernel-only, in one process against the prefetch and
  // the placement called (the same bits; results/moe_gap_probe_h200_early_tile_*_ded69f3.txt):
  // moe_linear top-8 on 128 x [1536, 2048] T = 128 90.59 -> 87.76 us, T = 512
  // 120.40 -> 118.97; on 128 x [2048, 768] T = 128 54.11 -> 52.44, T = 512
  // 73.26 -> 72.11; kbit_grouped_gemm (which does not run it; the variant's
  // code otherwise) 0.9-2.3% less there. On the mma.sync grouped variants
  // (512 x [512, 2048] top-10 at T = 8..128) both calls took 0.7-2.3% more
  // from T = 32 up: those keep the prefetch. At 6 n8 tiles and four
  // warpgroups it spilled (k = 3: 12 bytes, k = 4 with fp16 scales: 64), so
  // past 4 n8 tiles (6..20, not measured with it) the prefetch stays too.
  constexpr bool kEarlyTile =
      GROUPED && (KBIT_ROUTED_EARLY_TILE == 1 || (KBIT_ROUTED_EARLY_TILE == 2 && WG > 0 && M_TILES <= 4));
  // M chunks (gemm.py's _wg_m_chunks, _wg_slab_chunks): grid z cuts the rows
  // of A and C into chunks of 8 * M_TILES, each its own problem of this
  // launch's geometry, with its own workspace slots and counters. Slab
  // staging's producer reads its chunk's rows through the tensor map of all
  // M rows (rows past M read as zeros); its consumers offset C, M, the
  // workspace and the counters where they use them (chunk_*): parameters
  // changed here would take registers for the whole kernel (the 24-tile slab
  // variants then spill 32-104 bytes). blockIdx.z is 0 without chunks.
  if constexpr (WG && !GROUPED && !kSlab) {
    if (gridDim.z > 1) {
      const int m0 = (int)blockIdx.z * 8 * M_TILES;
      A += (long long)m0 * K_dim;
      C += (long long)m0 * N;
      M = min(M - m0, 8 * M_TILES);
      workspace += (long long)blockIdx.z * (2 * gridDim.x * gridDim.y) * warps * M_TILES * 32 * 4;
      counters += (long long)blockIdx.z * row_tiles;
    }
  }
  // This CTA's units [u_begin, u_end) of n_groups * group_units (see the
  // header; gemm.py keeps the count below 2^31): CTA c gets q units, plus one
  // if c < rem (q, rem: kernel parameters, so they take no registers). A
  // group's units past k_tiles (group_units > k_tiles) are padding that no
  // one computes: gemm.py pads so that ranges start at group boundaries when
  // whole split-K segments beat stream-K.
  // Grouped: q and rem come from the problem count (set below, before use).
  int grouped_q = 0, grouped_rem = 0, grouped_ctas = 0;
  auto range_start = [&](int c) {
    if constexpr (GROUPED) return c * grouped_q + min(c, grouped_rem);
    return c * q + min(c, rem);
  };
  // Stream-K launches (CTAs, 1); split K launches (groups, splits), so
  // CTA (x, y) is segment y of group x and the launch order runs
  // group-fastest (measured 5% faster than segment-fastest). No integer
  // divisions on the way to the first load (each is a ~25-instruction chain).
  const bool split_k = gridDim.y > 1;
  const int cta = blockIdx.x * gridDim.y + blockIdx.y;
  // Grouped: the problems of expert e are problems tile_cum[e] ..
  // tile_cum[e + 1] - 1; row_start[e] is its first row of A (offsets clamped
  // to [0, M], so unchecked offsets never reach outside A or C).
  extern __shared__ uint4 x_stage[];  // [kStages][8 * M_TILES][32 or 8] (WG: from x_stage + x_align)
  // WG with M_TILES >= kSlabMinTiles ("slab staging"): a stage is one 64-column
  // slab (a quarter K tile), kStages of them in a ring that a producer
  // warp fills (see below): a whole K tile of 256 rows would be 128 KB a
  // stage. Otherwise a stage is a K tile (WG: three, two past 16 n8 tiles;
  // mma: two).
  // The ring: k = 5's 16-warp mma.sync launch (one and two n8 tiles) keeps
  // A's K tiles in a ring of 4 stages handed over by mbarriers instead of
  // two stages and a __syncthreads a K tile, so that a warp waits only for
  // the copies of the tile it reads, not for the CTA's slowest warp. The
  // copying warps issue tile t + 2 while the CTA reads tile t, once every
  // warp has arrived done with tile t - 2 (ring_issue below). A probe without
  // the per-tile barrier (KBIT_PROBE_NO_BAR, wrong results) took 2-11% less
  // time on the large layers (H200, results/define_ab_h200_probe_no_bar_aee9c98.txt).
  // H200, kernel auto, in one process against two stages, the same bits
  // (results/define_ab_h200_a_ring_auto_8278b35.txt): k = 5 at 1..8 rows
  // 1.01-1.09x on 8192x57344, 28672x8192, 4096x28672 and 14336x4096,
  // 4096x4096 1.00-1.015x, 4096x6144 0.984-0.994x. Not elsewhere: k = 4 gained
  // 2-4% at 1..2 rows on the large layers but lost up to 2% at 8 and 7-8% on
  // 4096x6144; k = 2 and 3 lost up to 8% and 14% (their tables and the
  // extra stages leave fewer CTAs an SM).
  // The template argument RING = S >= 3 asks for a ring of S stages where
  // the host wants one (gemm._mma_ring, on layers of many K tiles a CTA, on a
  // GPU of 4 TB/s or more: k = 4's 8-warp launch at 1..4 rows; k = 5's
  // 16-warp launch with 8 stages instead of its own 4 under an A/B knob).
  // KBIT_A_RING = S (an A/B knob; -1, the default: the above): S >= 3 a ring
  // of S stages (tile t + S - 2 in flight) on every dense mma.sync launch at
  // up to two n8 tiles, 0 none. gemm.py sizes the stages by
  // _jit.gemm_mma_a_stages (set _jit.GEMM_MMA_A_RING the same).
#ifndef KBIT_A_RING
#define KBIT_A_RING -1
#endif
  constexpr int kRingStages = KBIT_A_RING >= 0 ? KBIT_A_RING : RING ? RING : K == 5 && WARPS == 16 ? 4 : 0;
  // (at four n8 tiles and two row tiles a warp, k = 2 spilled)
  constexpr bool kRing = kRingStages >= 3 && !WG && !GROUPED && M_TILES <= 2;
  constexpr int kStages = kSlab ? gemm_slab_ring(M_TILES, WG) : WG ? gemm_wg_stages(M_TILES) : kRing ? kRingStages : 2;
  constexpr int kRingLead = kRing ? kRingStages - 2 : 1;  // tiles of A in flight ahead of the one read
  // WG with two stages (more than 16 n8 tiles below slab staging: the grouped
  // launch's 144- and 160-row problems, whose three stages would not fit):
  // a tile's copies wait for every multiply of the previous tile (see tile()).
  constexpr bool kTwoStageWg = WG && !kSlab && kStages == 2;
  // The producer publishes slab s when it has issued slab s + kLag: at most
  // kStages - 2, or it would wait for a stage that a consumer frees only
  // after the slab it waits for.
  constexpr int kLag = kStages - 2;
  constexpr int kChunksPerRow = kSlab ? 8 : 32;  // 16-byte chunks of a staged row
  // Compact stages (KBIT_A_COMPACT = 1, an A/B knob, off; the host's
  // _jit.GEMM_MMA_A_COMPACT the same): a RING variant (the host takes those
  // at up to kCompactRows rows of A) stages only kCompactRows rows, not 8,
  // and ldmatrix reads row M - 1 in place of the rows past M. Those rows feed
  // only the columns of C past M, which are never stored (mma.sync's products
  // do not mix columns), so any finite row serves. A quarter of the shared
  // memory a stage: room for 8 stages beside k = 2's 64 KB byte table at
  // three CTAs an SM.
#ifndef KBIT_A_COMPACT
#define KBIT_A_COMPACT 0
#endif
  constexpr int kCompactRows = 2;
  constexpr bool kCompact = KBIT_A_COMPACT && RING > 0 && !WG && !GROUPED && M_TILES == 1;
  constexpr int kStageChunks = (kCompact ? kCompactRows : 8 * M_TILES) * kChunksPerRow;
  // WG: the stages start at x_align (below), so the tables follow them there
  // (gemm.py's 1 KB of alignment slack covers the shift); slab staging with
  // k = 4's PRMT table (kPrmtTable below): the table first (64 KB, a multiple
  // of the 1 KB alignment).
  constexpr int kTableFirst = K == 4 && kSlab && M_TILES <= KBIT_SLAB_PRMT_MAX_TILES ? 256 * 16 : 0;
  const int x_align =
      kTableFirst +
      (WG ? (int)((1024u - ((unsigned)__cvta_generic_to_shared(x_stage) & 1023u)) & 1023u) / 16 : 0);
  // k = 4 with 8 warps, and the Hopper path up to 64 rows (kGroupedWgPrmtMaxTiles,
  // kDenseWgPrmtMaxTiles): the PRMT-addressed pair table (64 KB, kPrmtTable
  // below) follows the stages, the grouped launch's tables follow it.
  constexpr bool kDenseWgTables = WG != 1 || ((KBIT_WG1_TABLES >> K) & 1);  // (above)
  constexpr bool kPrmtTable =
      K == 4 && (WARPS == 8 || (WG && GROUPED && M_TILES <= kGroupedWgPrmtMaxTiles) ||
                 (WG && !GROUPED && !kSlab && M_TILES <= kDenseWgPrmtMaxTiles && kDenseWgTables) ||
                 (kSlab && M_TILES <= KBIT_SLAB_PRMT_MAX_TILES));
  constexpr bool kQuadTable =
      K == 2 && KBIT_K2_QUAD_TABLE && !GROUPED &&
      ((WG && !kSlab && M_TILES <= kDenseWgPrmtMaxTiles && kDenseWgTables) || (!WG && WARPS == 8));
  // k = 5 with 16 warps (the mma launch at up to two n8 tiles, gemm._mma_warps)
  // and on the dense Hopper path up to KBIT_DENSE_WG_K5_TABLE_MAX_TILES n8
  // tiles (0: none; _jit mirrors it; at 8, 225 KB with three stages): the
  // lane-replicated pair table (kPairTable, 1024 entries of 128 bytes: 128
  // KB) after the stages, one CTA per SM, instead of two shuffles of the
  // lane-register codebook a pair. H200, in one process
  // (results/define_ab_h200_k5_table_*_475f501.txt): wgmma 11-23% less time at
  // M = 1..32 on four large layers, same bits (M = 64: 0.6-5%); mma at 16
  // warps against 4 without the table 5-23% at M = 1..16.
  constexpr bool kBigPairTable =
      K == 5 && ((WARPS == 16 && !WG) || (WG && !GROUPED && !kSlab &&
                                          M_TILES <= KBIT_DENSE_WG_K5_TABLE_MAX_TILES && kDenseWgTables));
  // kPrmtTable: [256 entries][16]; with slab staging first, at the dynamic
  // shared memory's start, whose address is a constant (no register for it)
  uint4* const prmt_tab = kTableFirst ? x_stage : x_stage + x_align + kStages * kStageChunks;
  // (tab_lookup, mma_common.cuh; only where a table is read: taking a table's
  // address keeps it, and a static one of 16 bytes moves the dynamic stages.
  // k = 2's byte table on the Hopper path keeps the address in an ordinary
  // register: H200, in one process against it, wgmma at 16 rows took 2.1-3.3%
  // more time on three large layers with it uniform, while k = 3..5 there
  // took 0.6-2.3% less (results/define_ab_h200_tab_base_41f7ae5.txt).)
  const unsigned prmt_base = !(kPrmtTable || kQuadTable || kBigPairTable) ? 0u
                             : WG && K == 2 ? (unsigned)__cvta_generic_to_shared(prmt_tab)
                                            : tab_base(prmt_tab);
  int* tile_cum = reinterpret_cast<int*>(
      prmt_tab + (kPrmtTable || kQuadTable ? 256 * 16 : kBigPairTable ? 1024 * 8 : 0));  // [experts + 1]
  int* row_start = tile_cum + experts + 1;  // [experts + 1]
  // route_ids: the ids (M) and the sorted order (M) follow
  int* route_id = row_start + experts + 1;
  int* route_order = route_id + (route_ids ? M : 0);
  const int problem_groups = (row_tiles + warps * RPW - 1) / (warps * RPW);
  __shared__ int warp_sums[GROUPED ? 32 : 1];  // (grouped: cta_exclusive_scan's)
  if constexpr (GROUPED) {
    // route_ids (moe_linear up to experts._FUSED_ROUTE_MAX_PAIRS pairs): each
    // CTA counts the pairs per expert itself (integer shared atomics:
    // order-free) instead of reading group_offsets, which saves the routing
    // launch.
    if (route_ids) {
      for (int e = threadIdx.x; e <= experts; e += blockDim.x) tile_cum[e] = 0;
      __syncthreads();
      constexpr int kBatch = KBIT_ROUTE_ID_BATCH;
      for (int i0 = threadIdx.x; i0 < M; i0 += kBatch * blockDim.x) {
        int ids[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int i = i0 + j * (int)blockDim.x;  // (< M + kBatch * blockDim.x: no wrap)
          ids[j] = i < M ? __ldg(route_ids + i) : -1;
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int i = i0 + j * (int)blockDim.x, e = ids[j];
          if (i >= M) break;
          route_id[i] = e;
          if (e >= 0 && e < experts) atomicAdd(tile_cum + e, 1);
        }
      }
      __syncthreads();
      mma_phase(8);  // the router's ids staged and counted
    }
    // Block-wide prefix count: thread i scans experts [i * per, (i + 1) * per).
    const int per = (experts + blockDim.x - 1) / blockDim.x;
    const int e0 = min(experts, (int)threadIdx.x * per), e1 = min(experts, e0 + per);
    auto clamped = [&](int e) { return min(max(__ldg(group_offsets + e), 0), M); };
    auto rows_of = [&](int e) { return route_ids ? tile_cum[e] : clamped(e + 1) - clamped(e); };
    auto problems = [&](int rows) { return rows > 0 ? (rows + 8 * M_TILES - 1) / (8 * M_TILES) : 0; };
    // Counts saturate at rem, the host's bound on the problem count (the
    // counters, 32-bit units): only offsets that fall can exceed it
    // (validate=False); the problems past it are dropped, and the sums
    // cannot wrap (experts.py keeps rem * blockDim.x below 2^31).
    int mine = 0, mine_rows = 0;
    for (int e = e0; e < e1; ++e) {
      mine = min(mine + problems(rows_of(e)), rem);
      mine_rows += route_ids ? rows_of(e) : 0;
    }
    int before = min(cta_exclusive_scan(mine, warp_sums), rem);
    int rows_before = 0;
    if (route_ids) {
      __syncthreads();  // every thread has read warp_sums
      rows_before = cta_exclusive_scan(mine_rows, warp_sums);
    }
    for (int e = e0; e < e1; ++e) {
      const int rows = rows_of(e);  // (this thread's own count, read before it is replaced)
      tile_cum[e] = before;
      row_start[e] = route_ids ? rows_before : clamped(e);
      before = min(before + problems(rows), rem);
      rows_before += rows;
    }
    if (threadIdx.x == blockDim.x - 1) {
      tile_cum[experts] = before;
      row_start[experts] = route_ids ? rows_before : clamped(experts);
    }
    __syncthreads();
    mma_phase(9);  // the problems counted and scanned (grouped)
    const int groups = tile_cum[experts] * problem_groups;
    const int units = groups * k_tiles;  // < 2^31: experts.py
    // CTAs used: all (stream-K), or one per group when that leaves the
    // busiest SM fewer tiles (no partial tiles to reduce; gemm.py's
    // _work_split model, in half tiles) and every SM still gets one. Measured
    // on the H100 at T = 1: 8 experts of [2048, 768] 17.6 -> 13.2 us, of
    // [1536, 2048] 20.4 -> 19.2 us; 10 of [512, 2048] (80 groups, fewer than
    // the SMs) 13.7 -> 15.6 us, hence the SM condition. q carries the SM count.
    // KBIT_GROUPED_SLACK_HALVES: stream-K's charge per CTA in half tiles (1:
    // the dense launches' 0.5 tile; other values for A/B runs only). 2 and 4
    // changed no choice on five MoE configs at T = 8..512 (H100, the same bits:
    // results/moe_gap_probe_h100_grouped_slack{2,4}_c22f4b9.txt).
    const int sms = q, grid = (int)gridDim.x;
    int ctas = grid;
    if (groups >= sms && groups <= grid &&
        ((groups + sms - 1) / sms) * 2 * k_tiles <=
            ((grid + sms - 1) / sms) * (2 * ((units + grid - 1) / grid) + KBIT_GROUPED_SLACK_HALVES))
      ctas = max(groups, 1);
    grouped_q = units / ctas;
    grouped_rem = units % ctas;
    grouped_ctas = ctas;
  }
  // Grouped: CTAs past the ones used have no units.
  const int u_begin = GROUPED && cta >= grouped_ctas ? 0 : range_start(cta);
  const int u_end = GROUPED && cta >= grouped_ctas ? 0 : range_start(cta + 1);
#if !KBIT_ROUTED_PREFETCH  // (the rows placed before the weights are asked for)
  if constexpr (GROUPED && !kEarlyTile) {
    if (route_ids && u_begin < u_end) {  // (CTA-uniform)
      mma_phase(11);  // (as below)
      place_routed_rows(route_id, route_order, tile_cum, row_start, warp_sums, M, experts,
                        u_begin / group_units / problem_groups,
                        (u_end - 1) / group_units / problem_groups, 8 * M_TILES);
      mma_phase(10);  // (as below)
    }
  }
#endif
  // The CTA whose range holds unit v (ranges are never empty: ctas <= units;
  // grouped launches may have empty ones at the end, which hold no unit).
  auto cta_of = [&](int v) {
    const int qq = GROUPED ? grouped_q : q, rr = GROUPED ? grouped_rem : rem;
    const int big = rr * (qq + 1);
    return v < big ? v / (qq + 1) : rr + (v - big) / qq;
  };
  // Grouped: where group grp (of all problems) lives: its group within the
  // problem (gl), the problem's first tile (its expert's), rows of A.
  struct Place {
    int gl;        // group within the problem (the group itself when not grouped)
    int p;         // problem (0 when not grouped)
    int e;         // the expert (0 when not grouped): its first tile e * row_tiles * k_tiles
    int row0;      // first row of A and C
    int rows;      // rows of A (<= 8 * M_TILES when grouped)
  };
  // hint: the expert of an earlier group of this CTA (the CTA walks its
  // groups in order, so the answer is there or later), or -1.
  auto locate = [&](int grp_l, int hint) {
    Place pl{grp_l, 0, 0, 0, M};
    if constexpr (GROUPED) {
      pl.p = grp_l / problem_groups;
      pl.gl = grp_l - pl.p * problem_groups;
      int lo = 0, hi = experts;  // the last e with tile_cum[e] <= p (tile_cum[experts] > p)
#if KBIT_LOCATE_HINT
      // From the hint in steps of 1, 2, 4, ..: the next segment's expert is
      // mostly the hint's (another group of its problem) or the next one, one
      // or two shared loads instead of log2(experts) in a dependent chain.
      if (hint >= 0) {
        lo = hint;
        int step = 1;
        while (lo + step < experts && tile_cum[lo + step] <= pl.p) {
          lo += step;
          step *= 2;
        }
        hi = min(lo + step, experts);
      }
#endif
      pl.e = lo = last_at_or_below(tile_cum, lo, hi, pl.p);
      pl.row0 = row_start[lo] + (pl.p - tile_cum[lo]) * 8 * M_TILES;
      pl.rows = min(8 * M_TILES, row_start[lo + 1] - pl.row0);
    }
    return pl;
  };
  // Grouped: sorted row g of a problem is row a_row(g) of A and c_row(g) of
  // C; with row_ids (moe_linear: pair i = row_ids[g], token i / ids_per_row)
  // the rows are read and written in place, no gather or scatter.
  auto c_row = [&](int g) {
    return route_ids ? route_order[g] : row_ids ? __ldg(row_ids + g) : g;
  };
  auto a_row = [&](int g) {  // no division without indirection (kbit_grouped_gemm)
    if (route_ids) return route_order[g] / ids_per_row;
    return row_ids ? __ldg(row_ids + g) / ids_per_row : g;
  };
  // Row tile r of a group's warp; past the last one it is redone as the last
  // one (uniform control flow: barriers and shuffles see every warp and lane)
  // and stores nothing.
  auto row_tile = [&](int grp_l, int r) {
    return min((grp_l * warps + warp) * RPW + r, row_tiles - 1);
  };
  // The first K tile of row tile r of a grouped place's group (its expert's
  // tiles, then the group's row tile); < 2^31: experts.py.
  auto place_tile0 = [&](const Place& pl, int r) {
    return (pl.e * row_tiles + row_tile(pl.gl, r)) * k_tiles;
  };
  // The walk over this CTA's units (CTA-uniform): unit u is K tile kt of
  // group grp. The current segment is K tiles seg_kt0 .. seg_kt0 + seg_n - 1
  // of grp (tile index base[r] + K tile); seg_more: another segment (the
  // next group's, from its K tile 0, tile index next_base[r]) follows in
  // this CTA; its first activation buffer is seg_buf0.
  int u = u_begin, grp = split_k ? (int)blockIdx.x : u_begin / group_units;
  int kt = u_begin - grp * group_units;
  int seg_kt0 = 0, seg_n = 0, seg_buf0 = 0;
  int tiles_done = 0;  // K tiles of the segments before this one (slab staging)
  bool seg_more = false;
  int base[RPW], next_base[RPW];

  // E4M4 code -> (scale, scale) in T, built once per CTA, except where the
  // pair is computed instead. fp16 activations: an E4M4 code c as fp16 bits c << 6 is exactly s / 16
  // (the 15 subnormal codes included), so (s, s) is one byte_perm (c into
  // both halves), one shift and an HMUL2 by (16, 16), with no shared-memory
  // load. Measured on the H100 against the table (in-process A/B at 3349606,
  // same bits): k=2 M=1 +5..9%, k=3 +2%, k=5 +3%, mma M=16 +4.5..6%, wgmma
  // 0..2%; k=4 on the mma path at one n8 tile -2..7% (kept on the table).
  // bf16 activations the same way, as bf16 bits c << 3 (s * 2^-116) times
  // 2^116 (KBIT_BF16_ALU_SCALE, mma_common.cuh, with its measurements).
  constexpr bool kAluScale =
      sizeof(TScale) == 1 && (IsHalf<T>::value || KBIT_BF16_ALU_SCALE) &&
      !(K == 4 && !WG && M_TILES == 1) &&
      !(kSlab && (K == 2 || K == 5));  // (slab staging at k = 2, 5: the table; ALU spills)
  // KBIT_CB_FOLD (mma_common.cuh): the pair's factor in the codebook entries,
  // where the pair is computed and scales the weights.
  // FOLD (the host's choice, gemm._cb_fold) or KBIT_CB_FOLD (an A/B knob, all).
  constexpr bool kCbFold = (FOLD || KBIT_CB_FOLD) && kAluScale &&
                           !kScaleAfterOf<K, sizeof(TScale), M_TILES, RPW, WG, GROUPED, WARPS>;

  // Lane j holds codebook[j mod 2^K] in T: a shuffle by an index whose bits
  // above K are garbage still finds the right entry.
  // k=2: lane a | b << 2 holds (codebook[a], codebook[b]), so one shuffle
  // by two neighbouring fields gives a pair of weights.
  const unsigned cb = cb_bits<T, kCbFold>(codebook[lane & ((1 << K) - 1)]);
  const unsigned cb_pair = cb | (cb_bits<T, kCbFold>(codebook[(lane >> 2) & 3]) << 16);

  // The next tile's index and scale words load while this one computes, into
  // two register sets used in turn (the loop below is unrolled by two, so
  // nothing is copied). M_TILES = 4 with two row tiles per warp copies
  // instead: unrolling costs it 204 instead of 168 registers (two CTAs per SM
  // instead of three, measured 8-10% slower at M = 32).
  using RawScale = typename ScaleWord<TScale>::Raw;
  // Slab staging (96-128 accumulators) keeps one set and refills it 16 bytes
  // at a time as the blocks that read them are decoded (see tile()).
  constexpr bool kCopy = M_TILES == 4 && RPW == 2;
  constexpr int kSets = kSlab ? 1 : 2;
  unsigned w_s[kSets][RPW][4 * K];
  RawScale raw_s[kSets][RPW];
  // Loads tile idx[r] (row tile * k_tiles + K tile) of each row tile.
  auto load_tile = [&](const int (&idx)[RPW], unsigned (&w_next)[RPW][4 * K],
                       RawScale (&raw_next)[RPW]) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const long long tile = idx[r];
#pragma unroll
      for (int q = 0; q < K; ++q) {
        const uint4 v = ldg_weight(tiles + (tile * K + q) * 32 + lane, l2_policy);
        w_next[r][4 * q] = v.x;
        w_next[r][4 * q + 1] = v.y;
        w_next[r][4 * q + 2] = v.z;
        w_next[r][4 * q + 3] = v.w;
      }
      raw_next[r] = ldg_weight(reinterpret_cast<const RawScale*>(scales) + tile * 32 + lane, l2_policy);
    }
  };
  // Asks L2 for tile `tile`'s index and scale words (load_tile's addresses;
  // no registers held).
  auto prefetch_tile = [&](long long tile) {
#pragma unroll
    for (int q = 0; q < K; ++q)
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(tiles + (tile * K + q) * 32 + lane));
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(reinterpret_cast<const RawScale*>(scales) +
                                                        tile * 32 + lane));
  };
  // Activations: the CTA stages A[0 .. 8*M_TILES) x [256 columns of tile kt]
  // in shared memory, double buffered with cp.async (columns past K_dim are
  // zero-filled, rows past M once at the start). Row r's 16-byte chunk c sits
  // at chunk (c & ~7) | ((c ^ r) & 7): the 8 row addresses of one ldmatrix
  // phase (rows 8mt .. 8mt+7, one chunk) hit distinct banks.
  // WG: wgmma reads B = A^T from shared memory itself, in its 128-byte
  // swizzle layout (K-major): four 64-column slabs of 8 * M_TILES rows of 128
  // bytes, chunk c of row r at c ^ (r & 7), each slab 1024-byte aligned (the
  // dynamic buffer is aligned at run time; gemm.py adds 1 KB).
  // WG: three stages (kStages above), so refilling the stage of tile i - 2
  // needs no wait for the tensor cores at the end of every tile (see tile());
  // two past 16 n8 tiles (kTwoStageWg).
  auto x_chunk = [&](int row, int c) {  // chunk c (16 bytes) of staged row `row`
    if constexpr (WG) return (c >> 3) * (8 * M_TILES * 8) + row * 8 + ((c & 7) ^ (row & 7));
    return row * 32 + (c ^ (row & 7));
  };
  // Thread t copies chunk t % 32 of rows t / 32, t / 32 + kThreads / 32, ...:
  // the column, its bounds check and the row stride are fixed per call, so a
  // 16-byte copy costs about 8 instructions (the general form below, index ->
  // row and chunk, takes 29: 35% of the wgmma kernel's instructions at
  // M = 128). At one n8 tile (8 rows, at most 2 per thread) the general form
  // is kept: the hoisted addresses cost registers there (k=5: 96 -> 110, a
  // CTA per SM).
  // Grouped: the rows of a problem (Place: rows row0 .. row0 + rows - 1 of A);
  // all 8 * M_TILES staged rows are written, those past `rows` zero-filled.
  constexpr int kThreads = WG ? 128 * WG : 32 * WARPS;  // the launch's block size
  // The dense launches' copies of A at up to 16 staged rows (M_TILES <= 2):
  // only the CTA's first KBIT_A_COPY_WARPS warps copy (0: every warp, the
  // old form), in the 8-warp mma launch at one n8 tile, the launches of more
  // than four warps at two n8 tiles and the Hopper path's four warpgroups;
  // not k = 5's 16-warp launch at one n8 tile (below), not the grouped
  // launches (see kRowsPerThread). With every warp of an 8-warp CTA
  // copying one row at 8 rows, k = 4 took 6-7% more time than at 4 rows on
  // the large layers (H200), the same as copying only 4 of the 8 rows (a
  // probe, KBIT_PROBE_A_ROWS):
  // so the cost was which warps copy, not the bytes. Four warps copying two
  // rows each took it back (results/define_ab_h200_a_copy_warps_d40119d.txt:
  // M = 8 k = 4 1.035-1.068x, k = 2 1.00-1.02x; M = 16 on the 16-warp
  // Hopper launch 1.02-1.05x; the same bits); one warp copying all 8 lost
  // 6-10%. Against every warp copying, as taken
  // (define_ab_h200_a_copy_warps_off_fcc7b75_float16.txt): k = 4 at 6..16
  // rows 1.00-1.06x, k = 5 at 16 1.02-1.03x, at most 0.2% slower. At M <= 4
  // the same copies as before (warps 0-3, one row each).
#ifndef KBIT_A_COPY_WARPS
#define KBIT_A_COPY_WARPS 4
#endif
  // The warps that copy in load_x's dense branches below: at two n8 tiles
  // or more (and the Hopper path) kCopyWarps; at one, the 8-warp launch's
  // first KBIT_A_COPY_WARPS (kFewCopiers1), else every warp. The ring
  // (KBIT_A_RING): each thread of kRingCopyWarps arrives on the stage's full
  // barrier.
  constexpr bool kFewCopiers = KBIT_A_COPY_WARPS && M_TILES <= 2 && KBIT_A_COPY_WARPS < kThreads / 32;
  constexpr int kCopyWarps = kFewCopiers ? KBIT_A_COPY_WARPS : kThreads / 32;
  constexpr bool kFewCopiers1 = WARPS == 8 && KBIT_A_COPY_WARPS && KBIT_A_COPY_WARPS < 8;
  constexpr int kRingCopyWarps = M_TILES > 1 ? kCopyWarps : kFewCopiers1 ? KBIT_A_COPY_WARPS : WARPS;
  // Grouped: this thread's staged rows t / 32 + (kThreads / 32) i of the problem whose rows
  // start at sorted row src_key0 (src_key1 of them), as rows of A (-1: past
  // the problem), resolved when the problem changes, not per K tile: with
  // row_ids each lookup is a dependent load (and a division) ahead of the
  // tile's copies, which measured 16-25% of the grouped launch's time at
  // 1024-4096 rows on the H100 (moe_linear against kbit_grouped_gemm).
  // (Every warp copies: the mma.sync grouped launches' copies by the first
  // four warps, as the dense launches', took 1.9-2.9% more time at T = 8 and
  // 32 on three MoE configs, H200,
  // results/moe_gap_probe_h200_grouped_copy_warps_*_0740044.txt.)
  constexpr int kRowsPerThread = GROUPED ? (8 * M_TILES + kThreads / 32 - 1) / (kThreads / 32) : 1;
  int src_row[kRowsPerThread];
  int src_key0 = -1, src_key1 = -1;
  auto load_x = [&](int kt_l, int buf, int from_row0, int from_rows) {
    if constexpr (GROUPED) {
      // All 8 * M_TILES staged rows; row r of the problem is row
      // a_row(from_row0 + r) of A, those past from_rows zero-filled.
      // Thread t copies chunk t % 32 of rows t / 32, t / 32 + kThreads / 32, ...
      if (from_row0 != src_key0 || from_rows != src_key1) {
        src_key0 = from_row0;
        src_key1 = from_rows;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          const int row = (threadIdx.x >> 5) + i * (kThreads / 32);
          src_row[i] = row < from_rows ? a_row(from_row0 + row) : -1;
        }
      }
      const unsigned base =
          (unsigned)__cvta_generic_to_shared(x_stage + x_align + buf * kStageChunks);
      const int c = threadIdx.x & 31;
      const int col = kt_l * 256 + 8 * c;
      const bool col_ok = col < K_dim;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int row = (threadIdx.x >> 5) + i * (kThreads / 32);
        if (8 * M_TILES % (kThreads / 32) != 0 && row >= 8 * M_TILES) break;  // (warp-uniform)
        const bool valid = col_ok && src_row[i] >= 0;
        const T* src = valid ? A + (long long)src_row[i] * K_dim + col : A;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                         base + 16u * x_chunk(row, c)), "l"(src), "r"(valid ? 16 : 0));
      }
    } else if constexpr (WG || M_TILES > 1) {
#if KBIT_PROBE_A_ROWS  // probe only (wrong results): copy at most this many rows of A a K tile
      const int rows = min(min(M, 8 * M_TILES), KBIT_PROBE_A_ROWS);
#else
      const int rows = min(M, 8 * M_TILES);  // rows past M are never read
#endif
      const int c = threadIdx.x & 31;
      const int col = kt_l * 256 + 8 * c;
      const unsigned bytes = col < K_dim ? 16 : 0;  // past K_dim: zero-filled
      const T* src = A + (long long)(threadIdx.x >> 5) * K_dim + (bytes ? col : 0);
      const unsigned base =
          (unsigned)__cvta_generic_to_shared(x_stage + x_align + buf * kStageChunks);
      // Unrolled on the wgmma path (up to 11 rows per thread), except k=5 at
      // 16 n8 tiles, which spills 16 bytes unrolled.
#pragma unroll(WG && !(K == 5 && M_TILES == 16) ? 4 : 1)
      for (int row = threadIdx.x >> 5; row < rows && (!kFewCopiers || (threadIdx.x >> 5) < kCopyWarps);
           row += kCopyWarps) {
        const unsigned dst = base + 16u * x_chunk(row, c);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
        src += (long long)kCopyWarps * K_dim;
      }
    } else {
#if KBIT_PROBE_A_ROWS  // probe only (wrong results): copy at most this many rows of A a K tile
      const int rows = min(min(M, 8 * M_TILES), KBIT_PROBE_A_ROWS);
#else
      const int rows = min(M, 8 * M_TILES);  // rows past M are never read
#endif
      // (the 8-warp launch; k = 5's 16 warps lost 2-5% at 5..8 rows with four
      // copying, where every warp copying leaves eight of them at it)
      const int copiers = kFewCopiers1 ? 32 * KBIT_A_COPY_WARPS : (int)blockDim.x;
      for (int i = threadIdx.x; i < rows * 32 && (!kFewCopiers1 || (int)threadIdx.x < copiers);
           i += copiers) {
        const int row = i >> 5, c = i & 31;
        const int col = kt_l * 256 + 8 * c;
        const bool valid = col < K_dim;  // row < M: rows = min(M, 8 * M_TILES)
        const T* src = valid ? A + (long long)row * K_dim + col : A;
        const unsigned dst = (unsigned)__cvta_generic_to_shared(
            x_stage + x_align + buf * kStageChunks + x_chunk(row, c));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  if constexpr (!GROUPED && !kSlab) {
    // Every staged row is read (ldmatrix, wgmma): rows past M hold zeros (the
    // columns of C they feed are never stored, but they are not left
    // uninitialised). Grouped launches zero-fill them in load_x, the tensor
    // copies of slab staging themselves.
    const int rows_past = kCompact ? 0 : 8 * M_TILES - min(M, 8 * M_TILES);  // (compact: never read)
    for (int i = threadIdx.x; i < rows_past * 32; i += blockDim.x) {
      const int row = M + (i >> 5), c = i & 31;
#pragma unroll
      for (int buf = 0; buf < kStages; ++buf)
        x_stage[x_align + buf * kStageChunks + x_chunk(row, c)] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
#if KBIT_ROUTED_PREFETCH
  // With route_ids the rows are placed (place_routed_rows) here, after each
  // warp has asked L2 for its first weight tile and scale words (a prefetch:
  // no registers held across the call), so that the placement's barriers
  // overlap the first tile's trip from memory; the codebook loads above
  // overlap it too. H100, k = 4 fp16, kernel-only, in one process against
  // the placement first (results/moe_gap_probe_h100_routed_prefetch_8474ae6.txt,
  // the same bits): moe_linear 128 x [2048, 768] top-8 T = 8 28.32 -> 27.64
  // us, 128 x [1536, 2048] T = 8 41.64 -> 40.92, 128 x [4096, 3072] T = 1
  // 30.56 -> 29.80; 512 x [512, 2048] T = 8 0.5% less; T = 128 0-0.9% less;
  // [2048, 768] at T = 512 0.6% more; kbit_grouped_gemm (no route_ids) 0.3%
  // less to 0.5% more.
  if constexpr (GROUPED && !kEarlyTile) {
    if (route_ids && u_begin < u_end) {  // (CTA-uniform)
      {  // (located again after the call: nothing live across it)
        const Place first = locate(grp, -1);
#pragma unroll
        for (int r = 0; r < RPW; ++r) prefetch_tile(place_tile0(first, r) + kt);
      }
      mma_phase(11);  // the first tile asked of L2, the placement about to start
      place_routed_rows(route_id, route_order, tile_cum, row_start, warp_sums, M, experts,
                        u_begin / group_units / problem_groups,
                        (u_end - 1) / group_units / problem_groups, 8 * M_TILES);
      mma_phase(10);  // the rows of this CTA's problems placed (route_ids)
    }
  }
#endif
  Place cur = locate(grp, -1), nxt = cur;  // the current segment's place, the next one's
  auto load_first_tile = [&]() {  // the segment's first weight tile into set 0
    int idx[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
      idx[r] = (GROUPED ? place_tile0(cur, r) : row_tile(grp, r) * k_tiles) + kt;
    load_tile(idx, w_s[0], raw_s[0]);
  };
  bool tile_loaded = false;  // (kEarlyTile: the first tile's loads issued)
  if constexpr (kEarlyTile) {
    if (route_ids && u_begin < u_end) {  // (CTA-uniform)
      load_first_tile();
      tile_loaded = true;
      mma_phase(11);  // the first tile asked for, the placement about to start
      place_routed_rows_inline(route_id, route_order, tile_cum, row_start, warp_sums, M, experts,
                               u_begin / group_units / problem_groups,
                               (u_end - 1) / group_units / problem_groups, 8 * M_TILES);
      mma_phase(10);  // the rows of this CTA's problems placed (route_ids)
    }
  }
  if (u_begin < u_end && (!kSlab || warp < warps)) {  // (slabs: the producer's)
    if constexpr (!kSlab && !kRing) load_x(kt, 0, cur.row0, cur.rows);
    if (!tile_loaded) load_first_tile();
  }
  // The ring (KBIT_A_RING): full[s] completes when the copies of the tile in
  // stage s have landed (one arrival per copying thread, at its copies'
  // completion), empty[s] when every warp has read it. ring_issue copies
  // the CTA's next tile of A (the same walk over units as the loop below).
  // (128 bytes: the static shared memory stays a multiple of 128, so the dynamic stages start on a line)
  static_assert(!kRing || kStages <= 8, "ring: at most 8 stages");
  __shared__ unsigned long long ring_bars[kRing ? 16 : 1];
  unsigned long long* const ring_full = ring_bars;
  unsigned long long* const ring_empty = ring_bars + 8;
  int ring_u = u_begin, ring_kt = kt, ring_next = 0;
  auto ring_issue = [&]() {
    if (ring_u >= u_end || ring_kt >= k_tiles) return;  // (CTA-uniform)
    const int s = ring_next % kStages;
    if (warp < kRingCopyWarps) {  // (warp-uniform)
      if (ring_next >= kStages) ring_bar_wait(ring_empty + s, (ring_next / kStages - 1) & 1);
      load_x(ring_kt, s, 0, M);
      ring_bar_copies_arrive(ring_full + s);
    }
    ++ring_next;
    ++ring_u;
    if (++ring_kt == k_tiles) {  // the next group's K tile 0 (split K: past u_end)
      ring_u += group_units - k_tiles;
      ring_kt = 0;
    }
  };
  if constexpr (kRing) {
    if (threadIdx.x == 0) {
      unsigned dyn;
      asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
      if (dyn < (unsigned)(kStages * kStageChunks * 16)) __trap();  // the host sized fewer stages
      if (kCompact && M > kCompactRows) __trap();  // (the host takes the RING variants at few rows)
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        ring_bar_init(ring_full + s, 32 * kRingCopyWarps);
        ring_bar_init(ring_empty + s, kThreads / 32);  // (lane 0 of each warp)
      }
    }
    __syncthreads();  // the barriers initialised before any arrival
#pragma unroll
    for (int l = 0; l < kRingLead; ++l) ring_issue();
  }

  // The tables are built while the first loads are in flight; the barrier at
  // the top of the loop orders these writes before any read.
  // (none where the scales come after the multiply: kScaleAfter below)
  constexpr bool kScaleTable =
      sizeof(TScale) == 1 && !kAluScale && !kScaleAfterOf<K, sizeof(TScale), M_TILES, RPW, WG, GROUPED, WARPS>;
  // Slab staging (below): lane 0 of the producer warp initialises the slab
  // barriers and issues the CTA's first kStages slabs before the tables are
  // built (they read the codebook from memory), so that the tensor map's and
  // the first slabs' round trips overlap the build instead of following it.
#ifndef KBIT_SLAB_EARLY_ISSUE
#define KBIT_SLAB_EARLY_ISSUE 1
#endif
  __shared__ unsigned long long slab_bar[kSlab ? kStages : 1];
  // slabs issued here: the first kStages of the CTA's (4 a unit); a function
  // of the range, not a variable live across the kernel (k = 5 with fp16
  // scales at 24 n8 tiles spilled 20 bytes with one). Only without M chunks:
  // in one process against issuing them after the build
  // (define_ab_h100_slab_early_issue_off_*.txt, k = 4, fp16) the 192-row
  // launches took 0.971-0.989x the time on four large layers and the
  // 256-row ones 0.992-1.001x, but the chunked launch on 8192x57344 at 1024
  // rows 1.022-1.028x (the other layers 0.993-1.002x).
  auto pre_issued = [&]() {
    return KBIT_SLAB_EARLY_ISSUE && gridDim.z == 1 ? min(kStages, 4 * (u_end - u_begin)) : 0;
  };
  auto issue_slab = [&](int s, int col) {  // slab s: columns col .. col + 63 of this chunk's rows
    const unsigned x_base = (unsigned)__cvta_generic_to_shared(x_stage + x_align);
    mbar_expect_tx(slab_bar + s % kStages, kStageChunks * 16);
    tma_load_2d(x_base + (s % kStages) * (kStageChunks * 16), a_map, col, (int)blockIdx.z * 8 * M_TILES,
                slab_bar + s % kStages);
  };
  if constexpr (kSlab) {
    if (threadIdx.x == 128 * WG) {
      for (int i = 0; i < kStages; ++i) mbar_init(slab_bar + i, 1);
      fence_proxy_async();  // the initialised barriers, visible to the tensor copies
      tensormap_acquire(a_map);
      // the first slabs of the walk below (from K tile kt of group grp)
      int s = 0;
      for (int pu = u_begin, pkt = kt, pg = grp; pu < u_end && s < pre_issued();
           pu = (pg + 1) * group_units, ++pg, pkt = 0) {
        const int n = min(k_tiles, pkt + (u_end - pu)) - pkt;
        for (int i = 0; i < 4 * n && s < pre_issued(); ++i, ++s)
          issue_slab(s, (pkt + i / 4) * 256 + (i % 4) * 64);
      }
    }
  }
  __shared__ unsigned scale_pair[kScaleTable ? 256 : 1];
  if constexpr (kScaleTable) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
      unsigned h = Mma<T>::to_bits(e4m4_decode(i));
      scale_pair[i] = h | (h << 16);
    }
  }
  // k=3, 4: a table of weight pairs, entry b = (codebook[b mod 2^K],
  // codebook[b >> K]) in T, indexed by two neighbouring fields of a lane's
  // index string (2K bits; for k=4 one byte). 32 copies, word 32b + l for lane
  // l: every lane reads bank l, so one lookup per two weights costs one
  // conflict-free shared-memory wavefront, against two shuffles, two shifts
  // and a byte_perm through the lane-register table (k=5: 128 KB, only
  // with one CTA per SM: kBigPairTable).
  // Not for k=4 with M_TILES = 4 and one row tile per warp (mma.sync): there
  // the 32 KB table drops the CTAs per SM from four to three (measured 15%
  // slower).
  // The 8-warp launch (k = 4): the same table with 256-byte entries (64 KB,
  // in the dynamic shared memory after the stages; gemm.py and experts.py add
  // it), so that a pair's byte, which sits at a byte of its index word,
  // becomes the entry's offset (byte << 8 | 4 lane) by one PRMT instead of a funnel shift
  // and a LOP3: 2 instructions per pair instead of 3. In one process against
  // the 32 KB table, the same bits: H200 +1.7..4.3% on 8192x57344, 4096x28672
  // and 14336x4096 at M = 1..8, fp16 and bf16, in three runs
  // (define_ab_h200_k4_prmt_table_*_26f2642.txt, ab_tree_h200_41d04ff_vs_26f2642_*,
  // ab_tree_h200_20a5867_vs_26f2642.txt); H100 within the spread of two
  // weights of the same kernel in one process (+-1.7% on 8192x57344,
  // define_ab_h100_prmt_table_20a5867.txt). (Its two CTAs per SM have the
  // room; the 4-warp launches' five would drop to three.)
  constexpr bool kPairTable =
      kBigPairTable || (!kPrmtTable && (K == 3 || (K == 4 && (WG || !(M_TILES == 4 && RPW == 1)))));
  constexpr int kPairs = 1 << (2 * K);
  __shared__ uint4 pair_tab_static[kPairTable && !kBigPairTable ? kPairs * kPairEntryU4<K> : 1];
  uint4* const pair_tab = kBigPairTable ? prmt_tab : pair_tab_static;
  const unsigned pair_base = kBigPairTable ? prmt_base : kPairTable ? tab_base(pair_tab) : 0u;
  if constexpr (kQuadTable) {  // entry (byte v, lane l) at 256 v + 8 l: pairs v & 15, v >> 4
    for (int i0 = warp * 32; i0 < 256 * 16; i0 += blockDim.x) {
      const int i = i0 + lane, v = i >> 4;
      const unsigned lo = __shfl_sync(kFullMask, cb_pair, v & 15), hi = __shfl_sync(kFullMask, cb_pair, v >> 4);
      prmt_tab[i] = make_uint4(lo, hi, lo, hi);
    }
  } else if constexpr (kPrmtTable && kSlab) {
    // slab staging: from the codebook in memory (built by shuffles of `cb`,
    // the 32-tile variants spilled 112-124 bytes)
    for (int i = threadIdx.x; i < 256 * 8; i += blockDim.x) {
      const int b = i >> 3;
      const unsigned v = cb_bits<T, kCbFold>(codebook[b & 15]) | (cb_bits<T, kCbFold>(codebook[b >> 4]) << 16);
      prmt_tab[b * 16 + (i & 7)] = make_uint4(v, v, v, v);
    }
  } else if constexpr (kPrmtTable) {
    for (int i0 = warp * 32; i0 < 256 * 8; i0 += blockDim.x) {
      const int i = i0 + lane, b = i >> 3;
      const unsigned v = (__shfl_sync(kFullMask, cb, b & 15) & 0xffffu) | (__shfl_sync(kFullMask, cb, b >> 4) << 16);
      prmt_tab[b * 16 + (i & 7)] = make_uint4(v, v, v, v);
    }
  } else if constexpr (kPairTable && !WG) {
    // mma: built by shuffles from the lane-register codebook `cb`, no loads in
    // the loop (a warp-uniform trip count). Measured on the H100 against the
    // loop of codebook loads below (16 dependent L2 round trips per thread at
    // k=4), in two A/B runs: 2048x768 and 768x2048 M=1 +0..14%, 4096x6144
    // +1..7%, the large layers within -1..+1.5%, where the first tile's DRAM
    // loads hide the build.
    for (int i0 = warp * 32; i0 < kPairs * 8; i0 += blockDim.x) {
      const int i = i0 + lane, b = (i >> 3) & (kPairs - 1);
      const unsigned v = (__shfl_sync(kFullMask, cb, b & ((1 << K) - 1)) & 0xffffu) |
                         (__shfl_sync(kFullMask, cb, b >> K) << 16);
      if (i < kPairs * 8) pair_tab[pair_tab_slot<K>(i)] = make_uint4(v, v, v, v);
    }
  } else if constexpr (kPairTable) {
    // wgmma: from the codebook in memory (the shuffle build measured 0..3%
    // slower there).
    for (int i = threadIdx.x; i < kPairs * 8; i += blockDim.x) {
      const int b = i >> 3;
      const unsigned v = cb_bits<T, kCbFold>(codebook[b & ((1 << K) - 1)]) |
                         (cb_bits<T, kCbFold>(codebook[b >> K]) << 16);
      pair_tab[pair_tab_slot<K>(i)] = make_uint4(v, v, v, v);
    }
  }

  mma_phase(6);  // this warp's part of the tables written

  // Warp-specialised slab staging: stage `slot` holds slab s (the CTA's slabs
  // counted from 0) for s = slot mod kStages. One producer warp loads slabs
  // with the tensor copy engine (a_map: A as a 2-D tensor of 64 x 8 * M_TILES
  // boxes in wgmma's 128-byte swizzle, rows past M zero-filled; 16-byte
  // cp.async through the load units measured about 30% slower), completing on
  // slab_bar[slot]. Hand-offs to the consumers go through named barriers (one
  // instruction, no wait loop: ptxas keeps the wgmma pipeline across them,
  // while an mbarrier wait loop among the wgmmas serialized them all, C7513):
  // full(c, slot): the producer warp arrives once slab s has landed, the 128
  // threads of consumer warpgroup c wait (one barrier per warpgroup, so the
  // warpgroups do not wait for each other); empty(slot): every consumer
  // thread arrives when done reading slab s (its wgmma_wait<1> a block into
  // slab s + 1), the producer waits before it refills the stage.
  static_assert(!kSlab || (WG + 1) * kStages <= 15, "named barriers 1 .. 15");
  static_assert(!kSlab || WG >= 2, "slab staging: setmaxnreg budgets for two or more consumer warpgroups");
  auto bar_full = [&](int c, int slot) { return 1 + c * kStages + slot; };
  auto bar_empty = [&](int slot) { return 1 + WG * kStages + slot; };
  constexpr int kFullCount = 32 + 128, kEmptyCount = 32 + 128 * WG;
  if constexpr (kSlab) {
    if (blockDim.x != 128 * (WG + 1)) __trap();  // no producer: the consumers would wait forever
    // Publishes the barriers (to the producer warp's other lanes) and the
    // tables (block 0 decodes before any wait).
    __syncthreads();
    if (warp >= warps) {
      // The producer: this CTA's units in the consumers' order, 4 slabs per
      // K tile; slab s is issued once slab s - kStages is free, and published
      // kLag slabs later (its copy is in flight meanwhile).
      regs_dec<kProducerRegs<WG>>();
      if (warp != warps) return;  // one warp of the producer warpgroup
      int s = 0;
      auto publish = [&](int done) {
        if (done < 0) return;
        mbar_wait(slab_bar + done % kStages, (done / kStages) & 1);
#pragma unroll
        for (int c = 0; c < WG; ++c) named_arrive(bar_full(c, done % kStages), kFullCount);
      };
      int pu = u_begin, pgrp = grp, pkt = kt;
      while (pu < u_end) {
        const int n = min(k_tiles, pkt + (u_end - pu)) - pkt;
        for (int i = 0; i < n; ++i) {
          for (int sl = 0; sl < 4; ++sl, ++s) {
            const int slot = s % kStages;
            if (s >= kStages) named_sync(bar_empty(slot), kEmptyCount);
            if (lane == 0 && s >= pre_issued()) issue_slab(s, (pkt + i) * 256 + sl * 64);
            publish(s - kLag);
          }
        }
        pu = (pgrp + 1) * group_units;
        ++pgrp;
        pkt = 0;
      }
      for (int d = kLag; d > 0; --d) publish(s - d);  // the last slabs
      // The consumers free slabs 0 .. s - 2; the waits above took those
      // before s - kStages. Take the rest, so no barrier is left half done.
      for (int r = max(s - kStages, 0); r <= s - 2; ++r) named_sync(bar_empty(r % kStages), kEmptyCount);
      return;
    }
    regs_inc<kConsumerRegs<WG>>();
  }

  // Scale after the multiply (k = 4, E4M4, one n8 tile, not grouped): block j's
  // weights go into the mma unscaled, into a zeroed accumulator, which is then
  // added to acc times the fp32 scales of rows g and g + 8 (s / 16: the code's
  // fp16 bits c << 6, widened; acc times 16 at the segment's end, exact): four
  // FFMA a block instead of eight HMUL2 and two scale-table loads. Within
  // FORMAT.md section 7 (the effective weight is not rounded to T at all).
  // H200, in one process (define_ab_h200_30318fa_scale_after.txt): k = 4 at M
  // = 1..8 on 8192x57344 +5..6%, 4096x28672 +3..4%, 14336x4096 +1..2.5%,
  // 4096x6144 within 0.3%. Not kept for k = 2 (64 registers: within 2%), k = 3
  // (-5..+6% by layer) and k = 5 (slower), nor for fp16 scales (spills).
  constexpr bool kScaleAfter = kScaleAfterOf<K, sizeof(TScale), M_TILES, RPW, WG, GROUPED, WARPS>;
  // acc[r][mt]: (row g, m 8mt + 2t, +1) and (row g + 8, same m) of row tile
  // row_tile(grp, r), summed over the current segment's K tiles.
  float acc[RPW][M_TILES][4];
  auto zero_acc = [&]() {
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][mt][i] = 0.0f;
  };
  // The end of a segment: store C, or a partial tile (see the header).
  // K tiles seg_kt0 .. seg_kt1 - 1 of group seg_grp are in acc.
  auto finish_segment = [&](int seg_grp, const Place& pl, int seg_kt0, int seg_kt1) {
    if constexpr (kScaleAfter) {  // the E4M4 scales were taken as s / 16
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[0][mt][i] *= 16.0f;
    }
    const bool whole = seg_kt0 == 0 && seg_kt1 == k_tiles;
    if constexpr (WG == 1 && !GROUPED && !kSlab && RPW == 1) {
      // Split K in a cluster (see the header): this CTA's only segment.
      if (split_k && cluster_ranks() > 1) {
        // The host launches clusters of (1, splits, 1): a group's splits, all of
        // them. Any other shape would sum the wrong partials (a host bug).
        if (cluster_ranks() != (int)gridDim.y) __trap();
        // The stages hold the partial tiles: each warp has waited for its
        // multiplies (wgmma_wait<0>), the barrier for all four warps to be
        // done with the stages (no copy is in flight: the segment's last
        // tile loaded nothing).
        __syncthreads();
        float4* const red = reinterpret_cast<float4*>(x_stage + x_align);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
          red[(warp * M_TILES + mt) * 32 + lane] =
              make_float4(acc[0][mt][0], acc[0][mt][1], acc[0][mt][2], acc[0][mt][3]);
        cluster_sync();  // every CTA's partial tile written
        mma_phase(4);
        const unsigned red_addr = (unsigned)__cvta_generic_to_shared(red);
        const int ranks = cluster_ranks(), rank = cluster_rank();
        const int items = warps * M_TILES * 32;
        for (int i = rank * (int)blockDim.x + (int)threadIdx.x; i < items; i += ranks * (int)blockDim.x) {
          const int w = i / (M_TILES * 32), within = i - w * (M_TILES * 32);
          const int mt = within >> 5, l = within & 31;
          const int n = (seg_grp * warps + w) * 16 + (l >> 2);  // elements 2, 3: n + 8
          const int m = mt * 8 + 2 * (l & 3);                   // elements 1, 3: m + 1
          // No element of this quad is stored: no remote load either (the
          // exit barrier relies on every remote load's value being used).
          if (n >= N || m >= M) continue;
          float4 v[kMaxClusterSplits];
#pragma unroll
          for (int q = 0; q < kMaxClusterSplits; ++q)
            if (q < ranks) v[q] = ld_cluster_f32x4(red_addr + 16u * i, q);
          float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
          for (int q = 0; q < kMaxClusterSplits; ++q)
            if (q < ranks) add_f32x4(sum, v[q]);
          store_acc_quad(C, N, M, n, m, sum);  // stores element (n, m): uses every load
        }
        cluster_sync_exit();  // no CTA leaves while another reads its shared memory
        mma_phase(5);
        return;
      }
    }
    const int g_begin = seg_grp * group_units;
    // Slab staging's M chunk (see "M chunks" above): its rows of C, the rows
    // it has, its workspace slots and counters.
    const int chunk_m0 = kSlab ? (int)blockIdx.z * 8 * M_TILES : 0;
    T* const chunk_C = C + (long long)chunk_m0 * N;
    const int chunk_M = kSlab ? min(M - chunk_m0, 8 * M_TILES) : M;
#ifndef KBIT_SLAB_SMEM_STORE
#define KBIT_SLAB_SMEM_STORE 1
#endif
#ifndef KBIT_DENSE_SMEM_STORE
#define KBIT_DENSE_SMEM_STORE 1
#endif
    // (The dense Hopper path at one warpgroup the same way at k = 4, at an
    // even number of n8 tiles: its stages are idle after its last segment's
    // multiplies, no next tile being loaded, and all its threads are
    // consumers. In one process against its 2-byte stores (H100, kernel
    // auto, fp16, define_ab_h100_dense_smem_store_off_8e2f37c+.txt): k = 4
    // 0.965-0.98x the time on 2048x768 and 2048x512 at 65..192 rows,
    // 768x2048 and 4096x4096 0.99-1.01x; k = 2 1.00-1.047x, so not there
    // (k = 3 and 5 not measured). At two to four warpgroups 8 of the
    // variants spilled 12-44 bytes with it.)
    constexpr bool kSmemStore = (kSlab && KBIT_SLAB_SMEM_STORE) ||
        (K == 4 && WG == 1 && !GROUPED && RPW == 1 && M_TILES % 2 == 0 && KBIT_DENSE_SMEM_STORE);
    if constexpr (kSmemStore) {
      // Slab staging, the CTA's last segment and a whole one: C through
      // shared memory. The ring is idle (no slab left to stage, every
      // consumer's multiplies waited for), so each warp writes its 16 x 8
      // M_TILES tile there transposed by stmatrix, rows of C [m][the CTA's
      // 64 WG columns], and the consumers store those rows in 16-byte chunks
      // along C's rows, instead of 2-byte stores 4 rows a warp instruction
      // (H100, 4096x28672 at 1024 rows: 4.3 us of a 49 us CTA from the last
      // multiply to C stored, mma_phases_h100_slab_chunks_53965e4.txt).
      // Barrier 0 (the setup's __syncthreads') among the consumers only.
      if (whole && !seg_more && (N & 7) == 0 && (reinterpret_cast<size_t>(chunk_C) & 15) == 0) {
        constexpr int kRowHalves = 64 * WG + 8;  // + 16 bytes: 8 rows of a matrix on distinct banks
        static_assert(M_TILES % 2 == 0 && 8 * M_TILES * kRowHalves * 2 <= kStages * kStageChunks * 16,
                      "C's tile fits the ring");
        const unsigned base = (unsigned)__cvta_generic_to_shared(x_stage + x_align);
        named_sync(0, 128 * WG);  // every consumer is past its last multiply: the ring is free
        const int i = lane >> 3;
        const unsigned row = (unsigned)((lane & 7) + 8 * (i >> 1)) * kRowHalves + warp * 16 + 8 * (i & 1);
#pragma unroll
        for (int mt = 0; mt < M_TILES; mt += 2) {
          auto pack = [&](float lo, float hi) {
            return (Mma<T>::to_bits(hi) << 16) | Mma<T>::to_bits(lo);
          };
          stmatrix_x4_trans(base + 2u * (row + (unsigned)(8 * mt * kRowHalves)),
                            pack(acc[0][mt][0], acc[0][mt][1]), pack(acc[0][mt][2], acc[0][mt][3]),
                            pack(acc[0][mt + 1][0], acc[0][mt + 1][1]),
                            pack(acc[0][mt + 1][2], acc[0][mt + 1][3]));
        }
        named_sync(0, 128 * WG);
        const int n0 = seg_grp * warps * 16;  // the CTA's first column of C
        const int chunks = min(N - n0, 64 * WG) / 8;  // its 16-byte chunks of a row of C
        for (int q = threadIdx.x; q < chunk_M * 8 * WG; q += 128 * WG) {
          const int m = q / (8 * WG), c = q % (8 * WG);
          if (c < chunks) {
            uint4 v;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(base + 2u * (unsigned)(m * kRowHalves + 8 * c)));
            *reinterpret_cast<uint4*>(chunk_C + (long long)m * N + n0 + 8 * c) = v;
          }
        }
        mma_phase(7);
        return;
      }
    }
    // C's rows in 8-byte pieces (KBIT_QUAD_STORE): rows of a multiple of 4
    // elements from an 8-byte aligned C (chunk_C: C plus whole rows).
    const bool quad_ok = (N & 3) == 0 && (reinterpret_cast<size_t>(C) & 7) == 0;
    // workspace slot of CTA c's segment of this group: its first or its last
    auto slot_part = [&](int c, int r) {
      const int slot = 2 * c + (range_start(c) < g_begin ? 1 : 0);
      const long long chunk = kSlab ? (long long)blockIdx.z * (2 * gridDim.x * gridDim.y) * warps * M_TILES * 32 * 4 : 0;
      return workspace + chunk + ((((long long)slot * warps + warp) * RPW + r) * M_TILES * 32 + lane) * 4;
    };
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int rt = ((GROUPED ? pl.gl : seg_grp) * warps + warp) * RPW + r;
      if (rt >= row_tiles) continue;  // warp-uniform
      // grouped: one counter set per problem (recomputed where used: a pointer
      // kept live across the reduction costs the non-grouped kernels registers)
      auto counter = [&]() {
        return GROUPED ? counters + pl.p * row_tiles + rt
                       : counters + (kSlab ? (int)blockIdx.z * row_tiles : 0) + rt;
      };
      if (!whole) {
        float* mine = slot_part(cta, r);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
          reinterpret_cast<float4*>(mine)[mt * 32] =
              make_float4(acc[r][mt][0], acc[r][mt][1], acc[r][mt][2], acc[r][mt][3]);
        // The counter adds up the K tiles done; the segment that completes
        // them adds the partials (a division only on this path).
        int done = 0;
#if KBIT_SPLITK_RELEASE
        // The warp's stores, ordered before lane 0's release-acquire add by
        // the warp barrier (it orders memory among the lanes; a release is
        // cumulative), instead of a sequentially consistent fence per lane
        // before and after a relaxed add.
        __syncwarp();
        if (lane == 0) done = atom_add_acq_rel_gpu(counter(), seg_kt1 - seg_kt0) + seg_kt1 - seg_kt0;
        done = __shfl_sync(kFullMask, done, 0);
        if (done != k_tiles) continue;  // another segment finishes this tile
        __syncwarp();  // lane 0's acquire, before every lane's loads of the partials
#else
        __threadfence();
        if (lane == 0) done = atomicAdd(counter(), seg_kt1 - seg_kt0) + seg_kt1 - seg_kt0;
        done = __shfl_sync(kFullMask, done, 0);
        if (done != k_tiles) continue;  // another segment finishes this tile
        __threadfence();
#endif
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[r][mt][i] = 0.0f;
        // The group's CTAs in order (deterministic); a counted loop, so the
        // loads of several partials are in flight at once: four at M_TILES *
        // RPW <= 2, two above on mma.sync (H100, 2048x768 at M = 32 and 64,
        // eight splits: 6-10% faster than one; four were 11-18% faster there
        // but 1-6% slower on 768x2048 and 4096x6144, and take 208-255
        // registers), one on the Hopper path (its register budgets are tight).
        const int c_first = split_k ? seg_grp * (int)gridDim.y : cta_of(g_begin);
        const int c_last = split_k ? c_first + (int)gridDim.y - 1 : cta_of(g_begin + k_tiles - 1);
#pragma unroll (M_TILES * RPW <= 2 ? 4 : WG ? 1 : 2)
        for (int c = c_first; c <= c_last; ++c) {
          const float* part = slot_part(c, r);
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(part) + mt * 32);
            acc[r][mt][0] += v.x;
            acc[r][mt][1] += v.y;
            acc[r][mt][2] += v.z;
            acc[r][mt][3] += v.w;
          }
        }
        if (lane == 0) *counter() = 0;  // ready for the next call
      }
      if constexpr (GROUPED) {
        // Through row_ids or the routed order (moe_linear), a row of C is a
        // lookup: this thread's rows (two per n8 tile) are looked up
        // KBIT_CROW_CHUNK n8 tiles at a time before their stores, so the
        // lookups are in flight together instead of each waiting behind the
        // stores before it.
#ifndef KBIT_CROW_CHUNK
#define KBIT_CROW_CHUNK 4
#endif
        constexpr int kChunk = KBIT_CROW_CHUNK < M_TILES ? KBIT_CROW_CHUNK : M_TILES;
        // (warp-uniform) The Hopper path's problems, filled past a quarter:
        // on mma.sync (0.5-2.5 rows an expert) the shuffles of each tile cost
        // more than the skipped stores they save (H200, KBIT_QUAD_STORE=0
        // against it: mma.sync 0.4-1.0% less time, the Hopper path 1.4-5.0%
        // more at 8-64 rows an expert; benchmarks/NOTES-gemm.md).
        if (WG && KBIT_QUAD_STORE && KBIT_FAST_STORE && quad_ok && (rt + 1) * 16 <= N &&
            4 * pl.rows > 8 * M_TILES) {
          // One row a lane an n8 tile (acc_quad_rows): half the lookups, a
          // quarter of the stores. n8 tiles past the problem's rows: none.
          T* const c_col = C + rt * 16 + quad_store_col(lane);
#pragma unroll
          for (int mt0 = 0; mt0 < M_TILES; mt0 += kChunk) {
            int crow[kChunk];
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
              const int m = (mt0 + j) * 8 + 2 * t + (g & 1);
              crow[j] = mt0 + j < M_TILES && m < pl.rows ? c_row(pl.row0 + m) : -1;
            }
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
              if (mt0 + j >= M_TILES || (mt0 + j) * 8 >= pl.rows) break;
              const uint2 v = acc_quad_rows<T>(acc[r][(mt0 + j) % M_TILES], lane);
              if (crow[j] >= 0) *reinterpret_cast<uint2*>(c_col + (long long)crow[j] * N) = v;
            }
          }
          continue;
        }
#pragma unroll
        for (int mt0 = 0; mt0 < M_TILES; mt0 += kChunk) {
          int crow[kChunk][2];
#pragma unroll
          for (int j = 0; j < kChunk; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int m = (mt0 + j) * 8 + 2 * t + h;
              crow[j][h] = mt0 + j < M_TILES && m < pl.rows ? c_row(pl.row0 + m) : -1;
            }
          // With the row tile in bounds (warp-uniform), one check a row
          // instead of one an element (see the dense stores below). H100, in
          // one process against the checked form (KBIT_FAST_STORE=0, same
          // bits), kbit_grouped_gemm at T = 8 / 32 / 128 / 512 on the three
          // issue-21 configs: 0.1-0.9% less time at T = 8..32, 0.3-1.1% at
          // 128, 0.7-3.7% at 512 (768x2048), never more
          // (results/moe_gap_probe_h100_grouped_fast_store_off_*.txt).
          if (KBIT_FAST_STORE && (rt + 1) * 16 <= N) {
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
              if (mt0 + j >= M_TILES) break;
#pragma unroll
              for (int h = 0; h < 2; ++h) {  // one check a row: elements h (n) and 2 + h (n + 8)
                if (crow[j][h] < 0) continue;
                T* c = C + (long long)crow[j][h] * N + rt * 16 + g;
                Mma<T>::store(c, acc[r][(mt0 + j) % M_TILES][h]);
                Mma<T>::store(c + 8, acc[r][(mt0 + j) % M_TILES][2 + h]);
              }
            }
            continue;
          }
#pragma unroll
          for (int j = 0; j < kChunk; ++j) {
            if (mt0 + j >= M_TILES) break;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int n = rt * 16 + g + 8 * (i >> 1);
              const int cr = crow[j][i & 1];
              if (n < N && cr >= 0)
                Mma<T>::store(C + (long long)cr * N + n, acc[r][(mt0 + j) % M_TILES][i]);
            }
          }
        }
      } else if (KBIT_FAST_STORE && (rt + 1) * 16 <= N && 8 * M_TILES <= chunk_M) {
        // The whole 16 x 8 M_TILES tile in bounds (warp-uniform): stores
        // without a check each, from one row pointer per n8 tile. The checked
        // form below compiles to a branch around each store (about 12
        // instructions an element). On 768x2048 at 256 rows (one warpgroup a
        // CTA, one CTA per SM) the stamps put 1.1 us of a 5.9 us kernel
        // between the last multiply and the stores' end (H200, mma_phases.py,
        // results/mma_phases_h200_*_15759a0.txt). In one process against the
        // checked form (KBIT_FAST_STORE=0, same bits), H200: 768x2048 at 192
        // and 256 rows 7-8% less time, 4096x4096 at 32..64 rows 1.8%, the
        // other small-layer points within 1.9% either way
        // (define_ab_h200_fast_store_whole_only_off_15759a0.txt). The same
        // form in the cluster sum's store_acc_quad was 2-9% slower there
        // (define_ab_h200_fast_store_off_15759a0.txt), so that one keeps its checks.
        if (KBIT_QUAD_STORE && quad_ok) {  // 8-byte pieces of rows (acc_quad_rows)
          T* c = chunk_C + (long long)(2 * t + (g & 1)) * N + rt * 16 + quad_store_col(lane);
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt, c += 8LL * N)
            *reinterpret_cast<uint2*>(c) = acc_quad_rows<T>(acc[r][mt], lane);
          continue;
        }
        T* c = chunk_C + (long long)(2 * t) * N + rt * 16 + g;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt, c += 8LL * N) {
          Mma<T>::store(c, acc[r][mt][0]);
          Mma<T>::store(c + N, acc[r][mt][1]);
          Mma<T>::store(c + 8, acc[r][mt][2]);
          Mma<T>::store(c + N + 8, acc[r][mt][3]);
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int n = rt * 16 + g + 8 * (i >> 1);
            const int m = mt * 8 + 2 * t + (i & 1);
            if (n < N && m < chunk_M) Mma<T>::store(chunk_C + (long long)m * N + n, acc[r][mt][i]);
          }
        }
      }
    }
    mma_phase(7);
  };

  // Tile i of the current segment: weights and scale words in (w, raw),
  // the next unit's (the next K tile, or the next group's first) loaded into
  // (w_next, raw_next) meanwhile, so the pipeline runs across segments.
  // The next tile's activations into the stage after `buf`.
  auto refill = [&](int buf, int next_kt, bool in_seg) {
    if constexpr (GROUPED) {
      load_x(next_kt, WG ? (buf + 1) % kStages : buf ^ 1, in_seg ? cur.row0 : nxt.row0,
             in_seg ? cur.rows : nxt.rows);
    } else {
      load_x(next_kt, WG ? (buf + 1) % kStages : buf ^ 1, 0, M);
    }
  };
  auto tile = [&](int i, const unsigned (&w)[RPW][4 * K], const RawScale (&raw)[RPW],
                  unsigned (&w_next)[RPW][4 * K], RawScale (&raw_next)[RPW]) {
    // (Slab staging: each slab's stage follows from its index, slab_s below.)
    const int buf = WG ? (seg_buf0 + i) % kStages : kRing ? (tiles_done + i) % kStages : (seg_buf0 ^ i) & 1;
    const unsigned x_base = (unsigned)__cvta_generic_to_shared(x_stage + x_align);
    // mma: lane l gives ldmatrix the address of row 8mt + (l & 7), chunk
    // 4j + (l >> 3) of the stage (matrix l >> 3 of the x4 load): chunk
    // 8(j >> 1) + ((4(j & 1) + (l >> 3)) ^ (l & 7)), so one address for even
    // and one for odd j, the rest immediate offsets.
    // (compact stages: rows past M read row M - 1 instead)
    const int x_row = kCompact ? min(lane & 7, M - 1) : lane & 7;
    const int x_sw = (lane >> 3) ^ x_row;
    const unsigned x_even = x_base + buf * (kStageChunks * 16) + x_row * 512 + x_sw * 16;
    const unsigned x_odd = x_even + (x_sw & 4 ? -64 : 64);
    // The wgmma path below slab staging: the stage's descriptor (KBIT_WG_DESC_UNIFORM).
    unsigned long long stage_desc = 0;
    if constexpr (WG && !kSlab && KBIT_WG_DESC_UNIFORM)
      stage_desc = wgmma_desc_sw128_uniform(x_base + buf * (kStageChunks * 16));
    const bool in_seg = i + 1 < seg_n;
    const bool has_next = in_seg || seg_more;
    const int next_kt = in_seg ? seg_kt0 + i + 1 : 0;
    // One barrier per tile: it publishes this tile's activations (the only
    // copy group in flight) and marks every warp done with the stage the next
    // tile's copies overwrite: mma.sync, the previous tile's stage (its
    // ldmatrix reads are synchronous); wgmma, the stage of tile i - 2 (three
    // stages; every warpgroup waited for tile i - 2's multiplies at block 1 of
    // tile i - 1, wgmma_wait<1>, before arriving here). Two stages
    // (kTwoStageWg): the previous tile's stage, so every warpgroup first waits
    // for all of its multiplies; its last block's then does not overlap this
    // tile's first decode. (Copies issued later in the tile, once block 1's
    // wait had retired the previous tile, made ptxas serialize every wgmma
    // of the loop: "non wgmma instructions defining input registers".)
    // (Slab staging: the producer warp's named barriers, per slab, below.)
    auto publish = [&]() {
      asm volatile("cp.async.wait_group 0;\n" ::);
      if constexpr (WG) fence_proxy_async();  // the tensor cores read what cp.async wrote
#if KBIT_PROBE_NO_BAR  // probe only (wrong results): the dense mma.sync launches without this barrier
      if constexpr (WG || GROUPED) __syncthreads();
#else
      __syncthreads();
#endif
      if (i == 0 && tiles_done == 0) {  // (stamped builds only)
        mma_phase(2);
        mma_phase_after(1, w[0][0]);
      }
      if (has_next) refill(buf, next_kt, in_seg);
    };
    if constexpr (kTwoStageWg) wgmma_wait<0>();
    if constexpr (kRing) {
      // This tile's copies landed; then the one kRingLead tiles on
      ring_bar_wait(ring_full + buf, ((tiles_done + i) / kStages) & 1);
      if (i == 0 && tiles_done == 0) {  // (stamped builds only)
        mma_phase(2);
        mma_phase_after(1, w[0][0]);
      }
      ring_issue();
    } else if constexpr (!kSlab) {
      publish();
    }
    // Scale words of rows g (lo) and g + 8 (hi): blocks 4*half .. 4*half+3.
    unsigned sw_lo[RPW][2 * ScaleWord<TScale>::kBytes / 4], sw_hi[RPW][2 * ScaleWord<TScale>::kBytes / 4];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if constexpr (sizeof(TScale) == 1) {
          sw_lo[r][half] = __shfl_sync(kFullMask, raw[r], 2 * g + half);
          sw_hi[r][half] = __shfl_sync(kFullMask, raw[r], 2 * g + 16 + half);
        } else {
          sw_lo[r][2 * half] = __shfl_sync(kFullMask, raw[r].x, 2 * g + half);
          sw_lo[r][2 * half + 1] = __shfl_sync(kFullMask, raw[r].y, 2 * g + half);
          sw_hi[r][2 * half] = __shfl_sync(kFullMask, raw[r].x, 2 * g + 16 + half);
          sw_hi[r][2 * half + 1] = __shfl_sync(kFullMask, raw[r].y, 2 * g + 16 + half);
        }
      }
    }
    int idx[RPW];  // the next unit's tiles
    if constexpr (kSlab) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) idx[r] = (in_seg ? base[r] : next_base[r]) + next_kt;
      // The scale words were shuffled out above; the index words are
      // refilled after their last block (below).
      if (has_next) {
#pragma unroll
        for (int r = 0; r < RPW; ++r)
          raw_next[r] = ldg_weight(reinterpret_cast<const RawScale*>(scales) + (long long)idx[r] * 32 + lane, l2_policy);
        // The next tile's index words into L2 now; each 16-byte word loads
        // into registers only after its last block here (below), 5-6 blocks
        // before its use. Measured on the H100 at 3428573 (k=4 fp16, in one
        // process): M=192..1024 +3.4..5.6%; the tile after next as well: no
        // better; the same on the 8..16-tile path, which loads a whole tile
        // ahead into a second register set: 1-4% slower.
#pragma unroll
        for (int r = 0; r < RPW; ++r)
#pragma unroll
          for (int q = 0; q < K; ++q)
            asm volatile("prefetch.global.L2 [%0];\n" ::"l"(tiles + ((long long)idx[r] * K + q) * 32 + lane));
      }
    } else if (has_next) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) idx[r] = (in_seg ? base[r] : next_base[r]) + next_kt;
      load_tile(idx, w_next, raw_next);
    }

#pragma unroll
    for (int j = 0; j < 8; ++j) {
      // Slab staging: slab s = 4 (tiles_done + i) + j / 2 of the CTA. The wait
      // for block j - 2 comes before the decode (at most block j - 1 still
      // runs while block j decodes), so two sets of A fragments are live, not
      // three (96-128 accumulators leave no room for a third).
      const int slab_s = 4 * (tiles_done + i) + (j >> 1);
      if constexpr (kSlab) {
        wgmma_wait<1>();
        // Second block of slab s: the first block of slab s - 1 finished
        // here, its second before it, so slab s - 1 is read.
        if ((j & 1) == 1 && slab_s > 0) named_arrive(bar_empty((slab_s - 1) % kStages), kEmptyCount);
      }
      // Weights of block j: 8 per row half, decoded to T, times the block's scale.
      unsigned wp[RPW][2][4];  // [r][h][pair p]: columns (8p + 2t, +1) of row g + 8h
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // (scale, scale) of row g + 8h, block j
          const unsigned sp = kScaleAfter ? 0u :
              block_scale_pair<T, TScale, kAluScale, kCbFold>(h ? sw_hi[r] : sw_lo[r], j, scale_pair);
          uint2 quad = make_uint2(0u, 0u);
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            unsigned pair;
            if constexpr (kQuadTable) {  // pairs 2q, 2q + 1 of row half h: byte 2h + q of word j
              if ((p & 1) == 0) {
                quad = tab_lookup<uint2>(prmt_base, lane4 << 1, w[r][j], 2 * h + (p >> 1));
              }
              pair = (p & 1) ? quad.y : quad.x;
            } else if constexpr (kPrmtTable) {  // pair p of word 2j + h: its byte p
              pair = tab_lookup<unsigned>(prmt_base, lane4, w[r][2 * j + h], p);
            } else {
              pair = weight_pair<K, kPairTable>(w[r], 16 * j + 8 * h + 2 * p, cb, cb_pair, pair_base,
                                                lane4);
            }
            wp[r][h][p] = kScaleAfter ? pair : Mma<T>::mul2(pair, sp);
          }
        }
      }
      if constexpr (WG) {
        // Both 16-wide slabs of block j in one commit group; they run while
        // the next block decodes. Slab s is k16 step 2j + s of the tile: 64-column
        // slab (2j + s) / 4 of the stage, 32 bytes per step within it.
        unsigned a[2][4];
#pragma unroll
        for (int slab = 0; slab < 2; ++slab) {
          a[slab][0] = wp[0][0][2 * slab];
          a[slab][1] = wp[0][1][2 * slab];
          a[slab][2] = wp[0][0][2 * slab + 1];
          a[slab][3] = wp[0][1][2 * slab + 1];
        }
        if constexpr (kSlab) {
          if ((j & 1) == 0) named_sync(bar_full(warp >> 2, slab_s % kStages), kFullCount);
        }
        // At most block j - 1's multiply still runs: block j - 2's A registers
        // are free again, so a tile needs three sets of fragments, not eight,
        // and block j decodes while j - 1 multiplies. (Slab staging: above.)
        // (Two stages: at block 0 the previous tile's were waited for at the top.)
        if constexpr (!kSlab) {
          if (!kTwoStageWg || j != 0) wgmma_wait<1>();
        }
        if constexpr (kSlab) {
          // Slab j / 2's stage; both descriptors are fence operands (defined before it).
          const unsigned stage_addr = x_base + (slab_s % kStages) * (kStageChunks * 16) + (j & 1) * 64;
          unsigned long long desc[2] = {wgmma_desc_sw128(stage_addr), wgmma_desc_sw128(stage_addr + 32)};
          wgmma_fence(a, desc);
#pragma unroll
          for (int slab = 0; slab < 2; ++slab) Wgmma<T, 8 * M_TILES>::run(acc[0], a[slab], desc[slab]);
        } else {
          wgmma_fence(a);
#pragma unroll
          for (int slab = 0; slab < 2; ++slab) {
            const int step = 2 * j + slab;
            const unsigned step_off = (step >> 2) * (8 * M_TILES * 128) + (step & 3) * 32;
#if KBIT_WG_DESC_UNIFORM
            Wgmma<T, 8 * M_TILES>::run(acc[0], a[slab], stage_desc + (step_off >> 4));
#else
            Wgmma<T, 8 * M_TILES>::run(acc[0], a[slab],
                                       wgmma_desc_sw128(x_base + buf * (kStageChunks * 16) + step_off));
#endif
          }
        }
        wgmma_commit();
        if constexpr (kSlab) {
          // One set of index words (w_next is w): uint4 q of the next tile
          // loads once block j, the last one whose decode reads a word of
          // uint4 q (pair_offset reads from 7 bits before a field), is done.
#pragma unroll
          for (int q = 0; q < K; ++q) {
            if (j == kReloadAfter<K>(q) && has_next) {
#pragma unroll
              for (int r = 0; r < RPW; ++r) {
                const uint4 v = ldg_weight(tiles + ((long long)idx[r] * K + q) * 32 + lane, l2_policy);
                w_next[r][4 * q] = v.x;
                w_next[r][4 * q + 1] = v.y;
                w_next[r][4 * q + 2] = v.z;
                w_next[r][4 * q + 3] = v.w;
              }
            }
          }
        }
      } else {
      // Activations: the B fragments of n8 tile mt, block j: ldmatrix.x4 of
      // the block's four 16-byte column chunks of rows 8mt .. 8mt+7 gives
      // lane (g, t) words t, 4 + t, 8 + t, 12 + t of row 8mt + g, i.e. b0, b1
      // of slab 0 and of slab 1. (Skipping n8 tiles wholly past M with a
      // warp-uniform branch was measured 10-25% slower at M = 16..64: the
      // branches cut the unrolled block into pieces the scheduler cannot
      // interleave.)
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        uint4 x;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                     : "r"((j & 1 ? x_odd : x_even) + mt * 8 * 512 + (j >> 1) * 128));
        if constexpr (kScaleAfter) {
          float s_lo, s_hi;  // fp32 scales of rows g, g + 8 (E4M4: s / 16)
          {
            // byte j of each row's scale word into bytes 0 and 2, as fp16 bits c << 6
            const unsigned codes = (__byte_perm(sw_lo[0][j >> 2], sw_hi[0][j >> 2],
                                                (j & 3) | ((4 + (j & 3)) << 8)) & 0x00ff00ffu) << 6;
            const __half2 hs = *reinterpret_cast<const __half2*>(&codes);
            s_lo = __low2float(hs);
            s_hi = __high2float(hs);
          }
          float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int slab = 0; slab < 2; ++slab) {
            const unsigned a[4] = {wp[0][0][2 * slab], wp[0][1][2 * slab], wp[0][0][2 * slab + 1],
                                   wp[0][1][2 * slab + 1]};
            Mma<T>::run(part, a, slab ? x.z : x.x, slab ? x.w : x.y);
          }
          acc[0][mt][0] = fmaf(s_lo, part[0], acc[0][mt][0]);
          acc[0][mt][1] = fmaf(s_lo, part[1], acc[0][mt][1]);
          acc[0][mt][2] = fmaf(s_hi, part[2], acc[0][mt][2]);
          acc[0][mt][3] = fmaf(s_hi, part[3], acc[0][mt][3]);
        } else {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
#pragma unroll
          for (int slab = 0; slab < 2; ++slab) {
            const unsigned a[4] = {wp[r][0][2 * slab], wp[r][1][2 * slab], wp[r][0][2 * slab + 1],
                                   wp[r][1][2 * slab + 1]};
            Mma<T>::run(acc[r][mt], a, slab ? x.z : x.x, slab ? x.w : x.y);
          }
        }
        }  // kScaleAfter
      }
      }  // WG
    }
    if constexpr (kRing) {  // the warp's reads of the stage done (ldmatrix: warp-wide, synchronous)
      __syncwarp();
      if (lane == 0) ring_bar_arrive(ring_empty + buf);
    }
  };
  auto copy_set = [&]() {  // set 1 -> set 0
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
#pragma unroll
      for (int i = 0; i < 4 * K; ++i) w_s[0][r][i] = w_s[kSets - 1][r][i];
      raw_s[0][r] = raw_s[kSets - 1][r];
    }
  };
  // The ring: the tables and the zeroed rows past M written before any read
  // (without it the first tile's barrier orders them)
  if constexpr (kRing) __syncthreads();
  while (u < u_end) {  // segments
    seg_kt0 = kt;
    seg_n = min(k_tiles, kt + (u_end - u)) - kt;
    const int after = (grp + 1) * group_units;
    seg_more = after < u_end;
    if (GROUPED && seg_more) nxt = locate(grp + 1, cur.e);
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      base[r] = GROUPED ? place_tile0(cur, r) : row_tile(grp, r) * k_tiles;
      next_base[r] = GROUPED ? place_tile0(nxt, r)
                             : row_tile(grp + 1, r) * k_tiles;
    }
    zero_acc();
    if constexpr (!kCopy) {
      for (int i = 0; i < seg_n; i += kSets) {
#pragma unroll
        for (int j = 0; j < kSets; ++j)
          if (i + j < seg_n)
            tile(i + j, w_s[j], raw_s[j], w_s[(j + 1) % kSets], raw_s[(j + 1) % kSets]);
      }
      // The next segment's first tile is in set seg_n % 2; the loop starts at 0.
      if (seg_n % kSets) copy_set();
    } else {
      for (int i = 0; i < seg_n; ++i) {
        tile(i, w_s[0], raw_s[0], w_s[1], raw_s[1]);
        copy_set();
      }
    }
    if constexpr (WG) {
      wgmma_wait<0>();  // the segment's multiplies are in acc
      fence_acc<M_TILES>(acc[0]);
    }
    mma_phase(3);
    finish_segment(grp, cur, seg_kt0, seg_kt0 + seg_n);
    tiles_done += seg_n;
    if constexpr (WG) {
      seg_buf0 = (seg_buf0 + seg_n) % kStages;
    } else {
      seg_buf0 ^= seg_n & 1;
    }
    u = after;
    ++grp;
    kt = 0;
    cur = GROUPED ? nxt : locate(grp, -1);  // not grouped: {grp, 0, 0, 0, M}
  }
  mma_phase(5);
}

}  // namespace kbit
