"""The one place that knows how kernels are built.

- where the CUDA sources live (``kernels_dir``) and how a family's source is
  rendered (``render_source``: local ``#include "x.cuh"`` lines are inlined, so
  CuPy's disk cache, which hashes only the source string, sees header edits);
- how a kernel's name is spelled (``kernel_name``: the exact C++ template-id
  string, which ``RawModule.get_function`` matches literally);
- the compile options (``compile_options``), shared by the runtime path and
  the offline check;
- the caches: compiled kernels in-process (``get_kernel``: one RawModule per
  variant and device, never reloaded) and on disk across processes (CuPy's
  kernel cache, ``CUPY_CACHE_DIR``; CuPy >= 14.2 keeps name mappings there);
- the offline compile check (``compile_check``): NVRTC without a GPU, every
  variant the package can launch, registers/spills/shared memory per kernel.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# --------------------------------------------------------------------------
# sources

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)

# C++ spelling of the dtypes a kernel is templated on.
CXX_TYPES = {
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
    "uint8": "unsigned char",
}


def kernels_dir() -> Path:
    """Directory holding the .cu/.cuh sources (inside an installed package or the source tree)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_src", here.parent / "kernels_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"kbit_cupy: CUDA sources not found next to {here}")


@cache
def render_source(family: str, text: str | None = None) -> str:
    """Source of ``kernels_src/<family>.cu`` (or ``text`` in its place) with
    local headers inlined once each."""
    root = kernels_dir()
    seen: set[str] = set()

    def expand(text: str) -> str:
        def repl(match: re.Match) -> str:
            name = match.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return expand((root / name).read_text())

        return _INCLUDE.sub(repl, text)

    if text is None:
        text = (root / f"{family}.cu").read_text()
    return expand(text).replace("#pragma once", "")


def kernel_name(family: str, *template_args) -> str:
    """Exact template-id, e.g. ``kbit::kbit_quantize<4, __half, unsigned char, false>``."""
    args = []
    for arg in template_args:
        if isinstance(arg, bool):
            args.append("true" if arg else "false")
        elif isinstance(arg, int):
            args.append(str(arg))
        else:
            args.append(CXX_TYPES.get(str(arg), str(arg)))
    return f"kbit::kbit_{family}<{', '.join(args)}>"


@dataclass(frozen=True)
class Variant:
    family: str  # source file stem
    args: tuple  # template arguments, in kernel_name spelling order

    @property
    def name(self) -> str:
        return kernel_name(self.family, *self.args)


def all_variants() -> list[Variant]:
    """Every kernel variant the package can launch (the compile check's list)."""
    out = []
    for k in (2, 3, 4, 5):
        for dtype in ("float16", "bfloat16", "float32"):
            for scale in ("uint8", "float16"):
                for brute in (False, True):
                    out.append(Variant("quantize", (k, dtype, scale, brute)))
                out.append(Variant("dequantize", (k, dtype, scale)))
                if dtype != "float32":
                    for m_tiles in GEMM_M_TILES:
                        for rpw in (1, 2) if m_tiles >= 4 else (1,):
                            out.append(Variant("gemm_mma", (k, dtype, scale, m_tiles, rpw)))
                    if (k == 4 or (k == 2 and GEMM_K2_QUAD_TABLE)) and scale == "uint8":
                        # 8 warps per CTA (gemm.py _mma_warps; k = 2 also two row tiles a warp)
                        for rpw in (1, 2) if k == 2 else (1,):
                            out.append(Variant("gemm_mma", (k, dtype, scale, 1, rpw, 0, False, 8)))
                    if k == 3 and scale == "uint8":  # 8 warps from gemm._K3_WIDE_MIN_M rows
                        out.append(Variant("gemm_mma", (k, dtype, scale, 1, 1, 0, False, 8)))
                    if scale == "uint8" and k in (2, 4) and (k != 2 or GEMM_K2_QUAD_TABLE):
                        # the 8-warp launches with a ring of A's stages (gemm._mma_ring)
                        for rpw in (1, 2) if k == 2 else (1,):
                            out.append(Variant("gemm_mma", (k, dtype, scale, 1, rpw, 0, False, 8, False,
                                                            GEMM_MMA_RING_STAGES)))
                    if k == 5 and scale == "uint8":  # 16 warps and the 128 KB pair table
                        for m_tiles in (1, 2):
                            out.append(Variant("gemm_mma", (k, dtype, scale, m_tiles, 1, 0, False, 16)))
                        # one n8 tile with the ring variant's stages (gemm._K5_RING_MAX_M: an A/B knob, off)
                        out.append(Variant("gemm_mma", (k, dtype, scale, 1, 1, 0, False, 16, False,
                                                        GEMM_MMA_RING_STAGES)))
                    wg_tiles = gemm_wg_m_tiles(k, scale)
                    if k == 5 and scale == "uint8" and 32 not in wg_tiles:
                        wg_tiles += (32,)  # GEMM_WG_K5_FULL_ROWS's variant, checked while off
                    for m_tiles in wg_tiles:
                        wgs = gemm_wg_warpgroups(m_tiles, k, scale)
                        out.append(Variant("gemm_mma", (k, dtype, scale, m_tiles, 1, wgs)))
                        if m_tiles in GEMM_WG_FILL_M_TILES:  # one warpgroup (gemm._wg_warpgroups)
                            out.append(Variant("gemm_mma", (k, dtype, scale, m_tiles, 1, 1)))
                    for m_tiles in GEMM_GROUPED_M_TILES:  # mixture-of-experts launch
                        out.append(Variant("gemm_mma", (k, dtype, scale, m_tiles, 1, 0, True)))
                    if k == 4 and scale == "uint8":  # the same at 8 warps (experts._grouped_wide)
                        out.append(Variant("gemm_mma", (k, dtype, scale, 1, 1, 0, True, 8)))
                    for m_tiles in gemm_grouped_wg_m_tiles(k):  # the same on the Hopper path
                        wgs = gemm_grouped_wg_warpgroups(m_tiles, k)
                        out.append(Variant("gemm_mma", (k, dtype, scale, m_tiles, 1, wgs, True)))
                    for m_tiles in GEMM_LATENCY_M_TILES:
                        out.append(Variant("gemm_latency", (k, dtype, scale, m_tiles)))
                    if k in DENSE_LATENCY_KSPLIT_KS and scale == "uint8":  # dense half K tiles
                        for m_tiles in GEMM_LATENCY_M_TILES:
                            out.append(Variant("gemm_latency", (k, dtype, scale, m_tiles, False, False, 2)))
                    if (k in MOE_LATENCY_KSPLIT_KS and k not in DENSE_LATENCY_KSPLIT_KS
                            and scale == "uint8"):  # the MoE few-pair launch (one n8 tile)
                        out.append(Variant("gemm_latency", (k, dtype, scale, 1, False, False, 2)))
                    for m_tiles in GEMM_CLUSTER_M_TILES:  # the cluster split (sm_90a)
                        out.append(Variant("gemm_latency", (k, dtype, scale, m_tiles, True)))
    for dtype in ("float16", "bfloat16"):  # k = 2 at M = 1 by table lookups (E4M4 scales)
        for total, l2_hint in ((False, False), (False, True), (True, False)):
            out.append(Variant("gemm_lut", gemm_lut_args(dtype, GEMM_LUT_TABLE_AT, total, l2_hint)))
    out += [Variant(v.family, folded) for v in out
            if (folded := cb_fold_variant(v.family, v.args)) is not None]
    out.append(Variant("moe_route", (MOE_ROUTE_THREADS,)))
    return out


MOE_ROUTE_THREADS = 1024  # one CTA groups a router's choices (kernels_src/moe_route.cu)
GEMM_M_TILES = (1, 2, 4, 8)  # n8 tiles of activation rows per gemm_mma launch (M <= 8..64)
GEMM_GROUPED_M_TILES = (1, 2, 4)  # n8 tiles per problem of the grouped launch (experts.py)
# the same, grouped launch on the Hopper path (sm_90a); 18 and 20 (144 and 160
# rows, two stages: gemm_wg_stages) hold an expert of about 128 rows in one
# problem (not for k = 5: gemm_grouped_wg_m_tiles)
GEMM_GROUPED_WG_M_TILES = (2, 4, 6, 8, 16, 18, 20)


def gemm_grouped_wg_m_tiles(k: int) -> tuple[int, ...]:
    """The grouped Hopper launch's n8 tiles for ``k``: GEMM_GROUPED_WG_M_TILES,
    without 18 and 20 for k = 5 (four of its eight variants there spill 12
    bytes at 255 registers); (16,) where that leaves none."""
    return tuple(t for t in GEMM_GROUPED_WG_M_TILES if k != 5 or t <= 16) or (16,)
# k = 4 on that path up to this many n8 tiles: the 64 KB PRMT-addressed pair
# table in dynamic shared memory (gemm_mma.cu KBIT_GROUPED_WG_PRMT_MAX_TILES)
GEMM_GROUPED_WG_PRMT_MAX_TILES = 8
# and on the dense Hopper path up to this many (gemm_mma.cu
# KBIT_DENSE_WG_PRMT_MAX_TILES; 0: none)
GEMM_DENSE_WG_PRMT_MAX_TILES = 8
# and on the slab-staged path up to this many (gemm_mma.cu KBIT_SLAB_PRMT_MAX_TILES)
GEMM_SLAB_PRMT_MAX_TILES = 0
GEMM_DENSE_WG_K5_TABLE_MAX_TILES = 8  # gemm_mma.cu KBIT_DENSE_WG_K5_TABLE_MAX_TILES (k = 5's 128 KB table)
GEMM_K2_QUAD_TABLE = 1  # gemm_mma.cu KBIT_K2_QUAD_TABLE: k = 2's 64 KB byte table (0: none, A/B runs)
# mma_common.cuh KBIT_K3_BYTE_LANES: 1 (an A/B knob, off; build with
# -DKBIT_K3_BYTE_LANES=1 and set this the same before the weights are
# prepared) lays k = 3's tiles out in byte lanes (gemm.repack_for_gemm), whose
# pairs the kernels decode with one PRMT each instead of a funnel shift and a LOP3
GEMM_K3_BYTE_LANES = 0
PRMT_TABLE_BYTES = 256 * 256  # 256 entries of 256 bytes
BIG_PAIR_TABLE_BYTES = 1024 * 128  # k = 5's pair table: 1024 entries of 128 bytes


def gemm_prmt_table_bytes(k: int, m_tiles: int, wgs: int, grouped: bool, warps: int) -> int:
    """Dynamic shared memory of gemm_mma.cu's decode table after the stages:
    k = 4's PRMT-addressed pair table (kPrmtTable) with 8 warps, or on the
    Hopper path up to GEMM_GROUPED_WG_PRMT_MAX_TILES n8 tiles (grouped) or
    GEMM_DENSE_WG_PRMT_MAX_TILES (dense, below slab staging); k = 2's byte
    table where GEMM_K2_QUAD_TABLE (dense: the Hopper path's places and the
    8-warp mma launch); k = 5's 128 KB pair table (kBigPairTable) on the
    16-warp mma launch and the dense Hopper path up to
    GEMM_DENSE_WG_K5_TABLE_MAX_TILES; on the dense Hopper path at one
    warpgroup only for k in GEMM_WG1_TABLES; 0 elsewhere."""
    dense_wg = bool(wgs and not grouped and m_tiles < GEMM_SLAB_MIN_M_TILES
                    and (wgs != 1 or GEMM_WG1_TABLES >> k & 1))
    slab = bool(wgs and not grouped and m_tiles >= GEMM_SLAB_MIN_M_TILES)
    if k == 4 and (warps == 8 or (grouped and wgs and m_tiles <= GEMM_GROUPED_WG_PRMT_MAX_TILES)
                   or (dense_wg and m_tiles <= GEMM_DENSE_WG_PRMT_MAX_TILES)
                   or (slab and m_tiles <= GEMM_SLAB_PRMT_MAX_TILES)):
        return PRMT_TABLE_BYTES
    if k == 2 and GEMM_K2_QUAD_TABLE and not grouped and (
            warps == 8 or (dense_wg and m_tiles <= GEMM_DENSE_WG_PRMT_MAX_TILES)):
        return PRMT_TABLE_BYTES
    if k == 5 and not grouped and (
            warps == 16 or (dense_wg and m_tiles <= GEMM_DENSE_WG_K5_TABLE_MAX_TILES)):
        return BIG_PAIR_TABLE_BYTES
    return 0


GEMM_LATENCY_M_TILES = (1, 2)  # n8 tiles per gemm_latency launch (M <= 8, 16)
GEMM_LATENCY_MAX_WARPS = 16  # gemm_latency.cu kLatencyMaxWarps: warps per CTA at most
# gemm_lut.cu: 16-row tiles a warp takes per unit (S; a row block is 128 S
# rows), tiles it loads ahead (G), threads per CTA (32 kLutWarps), dynamic
# shared memory (the 64 KB tables and the 1 KB scale table), and the table's
# shared-window offset the compile check builds for (gemm.py passes the
# device's reserved shared memory per block: 1 KB on sm_80 and sm_90).
# S = 8, G = 2 against 16 / 2, 8 / 4, 12 / 4 (H200, fp16, k = 2, M = 1;
# results/lut_probe_h200_1259745.md): 8192x57344 51.8 us against 54.6, 54.6,
# 54.2; 4096x28672 20.1 against 18.8 (224 CTAs of 16 tiles), 20.8, 25.5.
GEMM_LUT_S = 8
GEMM_LUT_G = 2
GEMM_LUT_THREADS = 256
GEMM_LUT_SHARED = 65536 + 1024
GEMM_LUT_TABLE_AT = 1024


def gemm_lut_args(dtype: str, table_at: int, total: bool, l2_hint: bool = False) -> tuple:
    """gemm_lut.cu's template arguments: the lookups (``total`` False) or the
    sum of their slots into C (True); ``l2_hint``: the lookups' weight loads
    with the L2 evict_first policy (gemm.py _LUT_L2_HINT_MIN_N)."""
    args = (GEMM_LUT_S, GEMM_LUT_G, dtype, int(table_at), bool(total))
    return args + (True,) if l2_hint else args
# gemm_latency.cu KBIT_LATENCY_KSPLIT: units of work per K tile (1: a warp takes
# whole K tiles; 2 or 4, for A/B runs built with -DKBIT_LATENCY_KSPLIT the same:
# half or quarter tiles)
GEMM_LATENCY_KSPLIT = 1
# gemm_mma.cu KBIT_A_RING: -1 (the default) the kernel's own choice, a ring
# of 4 stages on k = 5's 16-warp launch; A/B runs set both, -DKBIT_A_RING=S
# and this (0: two stages everywhere; S >= 3: a ring of S at up to two n8 tiles)
GEMM_MMA_A_RING = -1
# the stages of the ring variant gemm._mma_ring asks for (its RING template
# argument; gemm_mma.cu takes at most 8). H200, kernel auto, k = 4 at 1..2
# rows, fp16 and bf16, in one process against 4 (results/define_ab_h200_k4_ring_stages*_534d6ba*.txt):
# 8 stages 14336x4096 1.034-1.040x, 4096x28672 1.010-1.019x, 28672x8192 and
# 8192x57344 1.003-1.007x; 6 stages about half that; 3 stages 0.98-0.99x.
GEMM_MMA_RING_STAGES = 8


# gemm_mma.cu KBIT_A_COMPACT: 1 (an A/B knob, off; build with -DKBIT_A_COMPACT=1
# and set this the same) stages only GEMM_MMA_COMPACT_ROWS rows of A in the
# RING variants (gemm._mma_ring takes them at that many rows at most)
GEMM_MMA_A_COMPACT = 0
GEMM_MMA_COMPACT_ROWS = 2  # gemm_mma.cu kCompactRows


def gemm_mma_stage_rows(m_tiles: int, ring: int = 0) -> int:
    """Rows of A in one stage of the dense (not grouped) mma.sync launch of
    gemm_mma.cu at ``m_tiles`` n8 tiles; ``ring``: the variant's RING template
    argument (compact stages, KBIT_A_COMPACT)."""
    return GEMM_MMA_COMPACT_ROWS if GEMM_MMA_A_COMPACT and ring > 0 and m_tiles == 1 else 8 * m_tiles


def gemm_mma_a_stages(k: int, m_tiles: int, warps: int, ring: int = 0) -> int:
    """Stages of A's K tiles that the dense (not grouped) mma.sync launch of
    gemm_mma.cu keeps in shared memory (its kStages; the kernel traps if the
    launch gives it fewer); ``ring``: the variant's RING template argument."""
    if GEMM_MMA_A_RING >= 0:
        ring = GEMM_MMA_A_RING
    elif not ring:
        ring = 4 if k == 5 and warps == 16 else 0
    return ring if ring >= 3 and m_tiles <= 2 else 2
# the bit widths whose MoE few-pair launch takes half K tiles (experts._MOE_LATENCY_KSPLIT)
MOE_LATENCY_KSPLIT_KS = (4,)
# the bit widths whose dense gemm_latency launch may take half K tiles
# (gemm._dense_latency_ksplit: with E4M4 scales, at one and two n8 tiles)
DENSE_LATENCY_KSPLIT_KS = (2, 4)
# gemm_latency.cu's cluster split (CLUSTER, sm_90a): n8 tiles per M chunk (a
# launch covers any M in chunks of 8 * m_tiles rows), warps per CTA at most
# (kClusterMaxWarps), partial tiles one output adds (kClusterMaxReads: ranks x
# warps per row tile), CTAs per cluster at most (the portable cluster size)
GEMM_CLUSTER_M_TILES = (2, 4, 8)
GEMM_CLUSTER_MAX_WARPS = 8
GEMM_CLUSTER_MAX_READS = 16
GEMM_CLUSTER_MAX_RANKS = 8
GEMM_WG_M_TILES = (1, 2, 4, 8, 16, 24, 32)  # the same for the wgmma path (M <= 8 .. 256)
# The Hopper path's n8 tiles at which a small layer's launch takes one warpgroup
# a CTA (gemm._wg_warpgroups; 17..128 rows)
GEMM_WG_FILL_M_TILES = (4, 8, 16)
GEMM_WG1_TABLES = 0x10  # gemm_mma.cu KBIT_WG1_TABLES: bit k, k's decode table at one warpgroup
GEMM_MAX_CLUSTER_SPLITS = 8  # gemm_mma.cu kMaxClusterSplits: split K in clusters of this many CTAs at most
GEMM_SLAB_MIN_M_TILES = 24  # gemm_mma.cu kSlabMinTiles: from here activations stage per slab


# k = 5 with E4M4 scales at 32 n8 tiles (256 rows a CTA). It once spilled;
# compiled offline on 2026-11-28 it has no spill (168 registers, the entry cap
# its setmaxnreg budgets need), while k = 5 and k = 2 with float16 scales
# still spill 140 and 120 bytes there. On (True): kbit_gemm runs k = 5's
# 129..256 rows as one launch and its slab chunks at 256 rows instead of 192.
# Its A/B on the H200 (results/define_ab_h200_k5_full_rows_c48bd03.txt, fp16,
# four large layers, 200..2048 rows, kernel-only): wgmma 1.14-1.62x faster at
# every point (28672x8192 at 512 rows 589 -> 363 us, 0.52x -> 0.85x cuBLAS).
# Not measured on the H100 (none lent that session); the same SASS runs there.
# False keeps the 192-row launches for A/B runs. The compile check builds both.
GEMM_WG_K5_FULL_ROWS = True


# The scale pair's factor in the codebook entries (the FOLD template argument
# of gemm_mma.cu's mma.sync path and gemm_latency.cu; mma_common.cuh cb_bits):
# the same bits, one HMUL2 fewer a block and row. gemm._cb_fold chooses where
# (E4M4 scales, k = 2 and 5, <= 2 n8 tiles, a GPU of >= 4 TB/s: the H200 measured);
# False turns it off (A/B runs). The compile check builds the variants it
# can ask for (cb_fold_variant).
GEMM_CB_FOLD = True
CB_FOLD_KS = (2, 5)  # the bit widths gemm._cb_fold may fold (k = 2: latency and mma; 5: mma)


# The template arguments with defaults, from the first (gemm_latency: CLUSTER,
# FOLD, KSPLIT; gemm_mma: WG, GROUPED, WARPS, FOLD, RING), and FOLD's position
_DEFAULT_ARGS = {"gemm_latency": (4, (False, False, 1), 5), "gemm_mma": (5, (0, False, 4, False, 0), 8)}


def cb_fold_variant(family: str, args: tuple) -> tuple | None:
    """``args`` with FOLD = true (the defaults before it spelled out, those
    after it left off where they are the defaults), or None where gemm._cb_fold
    never asks for this variant (or FOLD is set already)."""
    if family not in _DEFAULT_ARGS:
        return None
    first, defaults, fold_at = _DEFAULT_ARGS[family]
    k, dtype, scale, m_tiles = args[:4]
    if k not in CB_FOLD_KS or dtype not in ("float16", "bfloat16") or scale != "uint8" or m_tiles > 2:
        return None
    full = [*args, *defaults[len(args) - first:]]
    if full[fold_at]:
        return None
    if family == "gemm_latency" and (k != 2 or full[4]):  # (k = 5: mma only; not the cluster split)
        return None
    if family == "gemm_mma" and (full[5] != 0 or full[6] or full[9]):  # mma.sync, not grouped, no ring
        return None
    full[fold_at] = True
    while len(full) > fold_at + 1 and full[-1] == defaults[len(full) - 1 - first]:
        full.pop()
    return tuple(full)


def gemm_wg_m_tiles(k: int, scale: str) -> tuple[int, ...]:
    """The wgmma variants' n8 tiles for ``k`` and the scale dtype name: all of
    GEMM_WG_M_TILES except 32 where its 128 accumulators spill (k = 2 and 5
    with float16 scales: 120-140 bytes) and for k = 5 with E4M4 scales when
    GEMM_WG_K5_FULL_ROWS is off (A/B runs); those launch 192 rows at a time."""
    if (k == 5 and not (GEMM_WG_K5_FULL_ROWS and scale == "uint8")) or (k == 2 and scale == "float16"):
        return tuple(t for t in GEMM_WG_M_TILES if t <= 24)
    return GEMM_WG_M_TILES


def gemm_slab_ring(m_tiles: int, wgs: int) -> int:
    """Stages (64-column slabs) of the wgmma variant's ring for ``m_tiles``
    and ``wgs`` consumer warpgroups when it stages by slab (gemm_mma.cu
    ``gemm_slab_ring``, which this mirrors): about 128 KB, 4..8 slabs, at most
    15 // (wgs + 1) (one named barrier per slab and warpgroup, one per slab)."""
    return min(min(8, max(4, 128 // m_tiles)), 15 // (wgs + 1))


def gemm_wg_threads(m_tiles: int, wgs: int) -> int:
    """Threads of a wgmma launch: the consumer warpgroups, plus a producer
    warpgroup where it stages by slab."""
    return 128 * wgs + (128 if m_tiles >= GEMM_SLAB_MIN_M_TILES else 0)


def gemm_wg_entry_regs(m_tiles: int, wgs: int) -> int:
    """Registers per thread ptxas must give a warp-specialised wgmma variant:
    its launch-bound cap, 65536 / threads rounded down to 8, the allocation
    gemm_mma.cu's setmaxnreg budgets (kEntryRegs) move registers within."""
    return 65536 // gemm_wg_threads(m_tiles, wgs) // 8 * 8


def gemm_wg_stages(m_tiles: int) -> int:
    """Stages (whole K tiles) of a wgmma variant below slab staging
    (gemm_mma.cu ``gemm_wg_stages``, which this mirrors): three, two past 16
    n8 tiles (three of 72-80 KB do not fit beside the decode tables)."""
    return 2 if m_tiles > 16 else 3


def gemm_wg_shared_bytes(m_tiles: int, wgs: int, itemsize: int) -> int:
    """Dynamic shared memory of a wgmma launch: its activation stages plus
    1 KB for the run-time alignment to the 1024-byte swizzle atom."""
    if m_tiles >= GEMM_SLAB_MIN_M_TILES:
        return gemm_slab_ring(m_tiles, wgs) * 8 * m_tiles * 64 * itemsize + 1024
    return gemm_wg_stages(m_tiles) * 8 * m_tiles * 256 * itemsize + 1024


def gemm_wg_warpgroups(m_tiles: int, k: int, scale: str = "uint8") -> int:
    """Warpgroups per CTA of the wgmma variant (gemm_mma<k, ..., m_tiles, 1, WG>)
    for ``k``, ``m_tiles`` n8 tiles and the scale dtype name.

    As many as the registers allow without spills (launch bounds 128 * WG
    threads): measured on the H100 at 90e40ee, three beat two by 10-25% at
    M = 128 on the large layers and four beat two by 5-10% at M = 64. k = 5
    with 8 n8 tiles spills 20 bytes at four. With float16 scales (their
    wider scale words) one fewer where the uint8 count spills when the
    variant is compiled alone, as the runtime compiles it: k = 4 at 8 n8
    tiles (16 bytes at four) and k = 5 at 16 (16 bytes at three).
    """
    if m_tiles > 16:  # 96 or 128 accumulators per thread
        return 2
    wgs = 3 if m_tiles == 16 or (k == 5 and m_tiles == 8) else 4
    if scale == "float16" and ((k == 4 and m_tiles == 8) or (k == 5 and m_tiles == 16)):
        wgs -= 1
    return wgs


def gemm_grouped_wg_warpgroups(m_tiles: int, k: int) -> int:
    """Warpgroups per CTA of the grouped launch on the Hopper path: as
    gemm_wg_warpgroups, but three at 8 n8 tiles and at 6 for k = 5 (four
    spill 8-148 bytes at 8, 12-124 at 6 with k = 5: the grouped launch's
    problem tables and row lookups); two at 16 (three spill at k = 3..5)."""
    if m_tiles >= 16:
        return 2
    return 3 if m_tiles >= 8 or (k == 5 and m_tiles >= 6) else gemm_wg_warpgroups(m_tiles, k)


def needs_sm90a(family: str, args: tuple) -> bool:
    """True for variants built only for sm_90a (the wgmma path of gemm_mma.cu,
    its ring variants of the 8-warp launches, which gemm._mma_warps takes on
    sm_90 only, the cluster split of gemm_latency.cu)."""
    if family == "gemm_latency":
        return len(args) >= 5 and bool(args[4])
    return family == "gemm_mma" and ((len(args) >= 6 and args[5] > 0) or (len(args) >= 10 and args[9] > 0))


def variants_for(arch: str) -> list[Variant]:
    """The variants the compile check builds for ``arch`` (sm_90a-only ones need it)."""
    return [v for v in all_variants() if arch == "sm_90a" or not needs_sm90a(v.family, v.args)]


# --------------------------------------------------------------------------
# options


@cache
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories with cuda_fp16.h / cuda_bf16.h for NVRTC (pip wheels or a toolkit)."""
    dirs: list[str] = []
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            dirs.append(str(found))
    except Exception:  # noqa: BLE001, S110 - pathfinder missing or no wheel headers
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(env)
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            dirs.append(str(Path(root) / "include"))
    if (Path("/usr/local/cuda/include") / "cuda_fp16.h").is_file():
        dirs.append("/usr/local/cuda/include")
    unique = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return tuple(unique[:1])  # one CUDA release's headers, never a mix


def compile_options() -> tuple[str, ...]:
    """NVRTC options for every kernel (CuPy adds -ftz=true and -arch itself)."""
    return ("--std=c++17", *(f"-I{d}" for d in cuda_include_dirs()))


# --------------------------------------------------------------------------
# runtime cache

_kernels: dict[tuple, object] = {}


def get_kernel(family: str, *template_args):
    """Compiled ``cupy.RawKernel`` for one variant on the current device (cached)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (family, template_args, device)
    kernel = _kernels.get(key)
    if kernel is None:
        name = kernel_name(family, *template_args)
        options = compile_options()
        sm90a = needs_sm90a(family, template_args)
        if sm90a:
            # NVRTC keeps the "a" of any -arch it is given (NOTES-cupy-nvrtc.md),
            # so CuPy's own -arch=sm_90 that follows still builds for sm_90a.
            options = (*options, "-arch=sm_90a")
        module = cupy.RawModule(code=render_source(family), options=options, name_expressions=[name])
        kernel = module.get_function(name)
        _kernels[key] = kernel
        _note_compiled(name, "sm_90a" if sm90a else None)
    return kernel


def cache_dir() -> Path:
    """CuPy's on-disk kernel cache directory."""
    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


_INDEX_NAME = "kbit_cupy_variants.txt"  # in cache_dir(): one "arch<TAB>kernel name" line per compile


def _note_compiled(name: str, arch: str | None = None) -> None:
    """Record a compiled variant next to CuPy's cache (whose file names are hashes).

    ``arch`` defaults to the current device's. Append-only lines, so concurrent
    processes cannot corrupt each other's entries; never raises (the index only
    feeds ``python -m kbit_cupy info``).
    """
    try:
        if arch is None:
            import cupy

            arch = f"sm_{cupy.cuda.Device().compute_capability}"
        cache_dir().mkdir(parents=True, exist_ok=True)
        with open(cache_dir() / _INDEX_NAME, "a", encoding="utf-8") as f:
            f.write(f"{arch}\t{name}\n")
    except Exception:  # noqa: BLE001, S110 - bookkeeping must never break a launch
        pass


def compiled_variants() -> list[tuple[str, str]]:
    """Sorted unique (arch, kernel name) pairs this package has compiled into the cache."""
    try:
        text = (cache_dir() / _INDEX_NAME).read_text(encoding="utf-8")
    except OSError:
        return []
    pairs = {tuple(line.split("\t", 1)) for line in text.splitlines() if "\t" in line}
    return sorted(pairs)


# --------------------------------------------------------------------------
# offline compile check (no GPU needed)

_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame")


@dataclass
class CompileResult:
    variant: Variant
    arch: str
    ok: bool
    registers: int = -1
    spill_bytes: int = -1
    stack_bytes: int = -1
    smem_bytes: int = -1
    log: str = ""


def _nvrtc_compile(source: str, names: list[str], options: list[str]):
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "kbit.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, options)
            ok = True
        except nvrtc.NVRTCError:
            ok = False
        log = nvrtc.getProgramLog(prog)
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names} if ok else {}
    finally:
        nvrtc.destroyProgram(prog)
    return ok, log, lowered


def _parse_ptxas(log: str) -> dict[str, dict]:
    """Per mangled kernel: registers, spill bytes, stack, smem from a -v ptxas log."""
    stats: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            current = stats.setdefault(m.group(1), {"registers": -1, "spill": 0, "stack": 0, "smem": 0})
            continue
        if current is None:
            continue
        if (m := _PTXAS_USED.search(line)):
            current["registers"] = int(m.group(1))
            if (s := _PTXAS_SMEM.search(line)):
                current["smem"] = int(s.group(1))
        if (m := _PTXAS_SPILL.search(line)):
            current["spill"] = int(m.group(1)) + int(m.group(2))
        if (m := _PTXAS_STACK.search(line)):
            current["stack"] = int(m.group(1))
    return stats


def compile_check(archs: list[str], variants: list[Variant] | None = None,
                  jobs: int | None = None, on_result=None) -> list[CompileResult]:
    """Compile every variant for each arch with NVRTC, no GPU needed.

    Each variant is its own NVRTC program with one name expression, as
    ``get_kernel`` builds it at run time: the same source and options (plus
    the options CuPy adds: ``-ftz=true`` and the arch) and
    ``--ptxas-options=-v``. One program per family with every variant in it
    compiled differently: NVVM inlines by call count across the program, so
    a variant could spill alone (as it runs) and not there (k = 4 with
    float16 scales at 8 n8 tiles and four warpgroups: 16 bytes alone, none in
    the family's program). ``jobs`` processes compile at once (default: the
    CPUs); ``on_result(result)`` is called as each finishes (progress).
    Results come in the order of ``archs`` x ``variants``.
    """
    import concurrent.futures
    import os

    variants = variants or all_variants()
    tasks = [(v, arch) for arch in archs for v in variants
             if arch == "sm_90a" or not needs_sm90a(v.family, v.args)]
    sources = {v.family: render_source(v.family) for v, _ in tasks}
    base = [*compile_options(), "-ftz=true", "--ptxas-options=-v"]
    jobs = max(1, jobs or os.cpu_count() or 1)
    results: list[CompileResult | None] = [None] * len(tasks)

    def finish(i: int, ok: bool, log: str, lowered: dict) -> None:
        v, arch = tasks[i]
        st = _parse_ptxas(log).get(lowered.get(v.name, ""), None) if ok else None
        if not ok:
            r = CompileResult(v, arch, False, log=log)
        elif st is None:
            r = CompileResult(v, arch, False, log="no ptxas report for kernel")
        else:
            problems = _variant_problems(v, st, log, lowered.get(v.name, ""))
            r = CompileResult(v, arch, not problems, st["registers"], st["spill"], st["stack"],
                              st["smem"], log="; ".join(problems))
        results[i] = r
        if on_result is not None:
            on_result(r)

    args = [(sources[v.family], [v.name], [*base, f"-arch={arch}"]) for v, arch in tasks]
    cached: list[int] = []  # compiled, but ptxas did not run: NVRTC's cache (below)

    def done(i: int, ok: bool, log: str, lowered: dict, again: bool = True) -> None:
        if again and ok and lowered.get(tasks[i][0].name, "") not in _parse_ptxas(log):
            cached.append(i)
        else:
            finish(i, ok, log, lowered)

    if jobs == 1 or len(tasks) == 1:
        for i, a in enumerate(args):
            done(i, *_nvrtc_compile(*a))
    else:
        # processes, not threads: NVRTC holds the GIL for most of a compile
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            futures = {pool.submit(_nvrtc_compile, *a): i for i, a in enumerate(args)}
            for fut in concurrent.futures.as_completed(futures):
                done(futures[fut], *fut.result())
    if cached:
        # Where a GPU driver is installed, NVRTC 13 reuses a cubin it built
        # before from the same PTX (the driver's compute cache) and then runs
        # no ptxas, so -v reports nothing: on an H200 the same check passed in
        # one process and failed in the next (benchmarks/results/
        # nvrtc_cache_probe_h200_82fc7bd.txt). CUDA_CACHE_DISABLE=1 turns that
        # off only where it is set before NVRTC loads, so those variants compile
        # again in a fresh interpreter started with it.
        for i, out in zip(cached, _compile_uncached([args[i] for i in cached])):
            done(i, *out, again=False)
    return results


_UNCACHED_CHILD = (
    "import pickle, sys\n"
    "from kbit_cupy._jit import _nvrtc_compile\n"
    "tasks = pickle.load(sys.stdin.buffer)\n"
    "pickle.dump([_nvrtc_compile(*t) for t in tasks], sys.stdout.buffer)\n"
)


def _compile_uncached(tasks: list) -> list:
    """_nvrtc_compile of each (source, names, options) in one new Python
    process whose NVRTC starts with CUDA_CACHE_DISABLE=1 (see compile_check)."""
    import pickle
    import subprocess
    import sys

    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, CUDA_CACHE_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", _UNCACHED_CHILD], input=pickle.dumps(tasks),
                          capture_output=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError("the uncached compile process failed: "
                           + done.stderr.decode(errors="replace")[-2000:])
    return pickle.loads(done.stdout)  # (our own child's output)


def _variant_problems(v: Variant, st: dict, log: str, mangled: str) -> list[str]:
    """What fails a compiled variant: spills; ptxas serializing its wgmma
    (C751x performance warnings, which name the function); for the
    warp-specialised wgmma variants a register count other than the entry cap
    that gemm_mma.cu's setmaxnreg budgets assume (else setmaxnreg.inc would
    wait forever on the GPU); for the launches whose dynamic shared memory
    follows the static one unaligned (gemm_latency.cu aligns its stage to 128
    bytes, gemm_mma.cu's mma.sync path does not; its Hopper path aligns to 1
    KB itself) static shared memory that is not a multiple of 128 bytes: the
    stage then starts off a 128-byte line, which made the latency launches
    up to 1.45x slower with the same SASS (H100 and H200,
    benchmarks/results/*_smem_align*, *_smem_pad_*)."""
    problems = []
    if st["spill"]:
        problems.append(f"{st['spill']} bytes spilled")
    wg = v.family == "gemm_mma" and len(v.args) >= 6 and v.args[5] > 0
    if v.family in ("gemm_latency", "gemm_mma") and not wg and st["smem"] % 128:
        problems.append(f"{st['smem']} bytes of static shared memory, not a multiple of 128: "
                        "the dynamic stage after it would start off a 128-byte line")
    serial = [line for line in log.splitlines() if "C751" in line and mangled and mangled in line]
    if serial:
        problems.append("wgmma serialized: " + serial[0].split(")", 1)[-1].strip()[:160])
    if wg:
        threads = gemm_wg_threads(v.args[3], v.args[5])
        if threads > 128 * v.args[5]:  # a producer warpgroup: setmaxnreg
            cap = gemm_wg_entry_regs(v.args[3], v.args[5])
            if st["registers"] != cap:
                problems.append(f"{st['registers']} registers, not the entry cap {cap} "
                                "the setmaxnreg budgets assume")
    return problems
