"""Quantized linear-layer weights and the fused product ``C = A @ dequant(W).T``.

``quantize_weight`` turns a ``[N, K_dim]`` weight into a ``KbitWeight``;
``kbit_gemm`` multiplies activations by it. CuPy activations run CUDA kernels
(``kernels_src/gemm_mma.cu`` on tensor cores, or dequantize + cuBLAS); NumPy
activations run the NumPy path (dequantize, float32 matmul) so the API works
without a GPU. FORMAT.md section 7 is the contract.

The kernels read a tiled copy of the indices and scales
(``repack_for_gemm``) built once per weight; ``unpack_from_gemm`` restores the
FORMAT.md layout exactly.
"""

from __future__ import annotations

import collections
import functools
import math
import sys
import threading
import types
from dataclasses import dataclass, field

import numpy as np

from . import _jit, _launch
from ._arrays import (
    BFLOAT16,
    array_module,
    as_module_array,
    check_array,
    check_shape,
    is_device_array,
    same_module,
    to_host,
)
from .format import BLOCK, check_codebook, check_k
from .quantize import (
    _attributes,
    _resident_ctas,
    _sm_count,
    dequantize_kbit,
    dequantize_launch,
    quantize_kbit,
)

ROWS_PER_TILE = 16  # rows of W per mma tile
K_PER_TILE = 256  # columns of W per tile: 8 blocks of 32
BLOCKS_PER_TILE = K_PER_TILE // BLOCK
ACT_DTYPES = (np.dtype(np.float16), BFLOAT16)
KERNELS = ("auto", "mma", "wgmma", "latency", "cluster", "lut", "dequant")
_MMA_MAX_M = 8 * max(_jit.GEMM_M_TILES)  # rows of A per mma launch
_WARPS = 4  # per gemm_mma CTA (mma.sync; 8 where _mma_warps says)
_WIDE_WARPS = 8  # gemm_mma.cu WARPS = 8 (0: never, for A/B runs)
_WG_WARPGROUPS = None  # override of _jit.gemm_wg_warpgroups (for A/B runs)
_CHUNK_WEIGHTS = 1 << 24  # repack works on this many weights at a time


# --------------------------------------------------------------------------
# repacking: FORMAT.md bit-planes <-> the mma kernel's tiles


def _tile_counts(N: int, K_dim: int) -> tuple[int, int]:
    return math.ceil(N / ROWS_PER_TILE), math.ceil(K_dim / K_PER_TILE)


def _check_shape(k: int, N: int, K_dim: int) -> None:
    if N < 1:
        raise ValueError(f"N must be >= 1, got {N}")
    if K_dim < BLOCK or K_dim % BLOCK:
        raise ValueError(
            f"K_dim must be a positive multiple of {BLOCK} (blocks run along it), got {K_dim}; "
            "pad the weight's columns with zeros to the next multiple of 32"
        )


def _planes_to_indices(xp, packed, k: int) -> object:
    """uint8 ``[nblocks, 32]`` indices from ``packed`` bit-planes ``[nblocks * k]``."""
    planes = packed.reshape(-1, k, 1)
    lanes = xp.arange(32, dtype=xp.uint32)
    idx = xp.zeros((planes.shape[0], 32), dtype=xp.uint8)
    for b in range(k):
        idx |= (((planes[:, b] >> lanes) & 1) << b).astype(xp.uint8)
    return idx


def _indices_to_planes(xp, idx, k: int) -> object:
    """Inverse of ``_planes_to_indices``: uint32 ``[nblocks * k]``."""
    lanes = xp.arange(32, dtype=xp.uint32)
    planes = xp.empty((idx.shape[0], k), dtype=xp.uint32)
    wide = idx.astype(xp.uint32)
    for b in range(k):
        planes[:, b] = (((wide >> b) & 1) << lanes).sum(axis=1, dtype=xp.uint32)
    return planes.reshape(-1)


def _bits_to_words(xp, bits):
    """Little-endian bit strings ``[..., 32 * W]`` (0/1 uint8) -> uint32 ``[..., W]``."""
    shape = bits.shape[:-1] + (bits.shape[-1] // 32, 32)
    weights = xp.left_shift(xp.uint32(1), xp.arange(32, dtype=xp.uint32))
    return (bits.reshape(shape).astype(xp.uint32) * weights).sum(axis=-1, dtype=xp.uint32)


def _words_to_bits(xp, words):
    lanes = xp.arange(32, dtype=xp.uint32)
    return ((words[..., None] >> lanes) & 1).astype(xp.uint8).reshape(words.shape[:-1] + (-1,))


@functools.cache
def _k3_byte_lane_order() -> np.ndarray:
    """int64 ``[384]``: for each bit of a lane's k = 3 string in byte lanes
    (_jit.GEMM_K3_BYTE_LANES; kernels_src/mma_common.cuh kByteLanes), the bit
    of the plain string (index i's bit b at 3 i + b) it holds. Pair P of the
    lane's 64 (indices 2P, 2P + 1; its 6 bits: 3 e + b of index 2P + e) goes
    to group G = P // 16 of three words, as q = P mod 16: q < 12 in the low 6
    bits of byte q mod 4 of word q // 4; q = 12 + s its bits 2c, 2c + 1 in
    bits 6, 7 of byte s of word c (c = 0, 1, 2). Every bit is used once."""
    order = np.full(384, -1, dtype=np.int64)
    for P in range(64):
        G, q = divmod(P, 16)
        for c in range(6):
            src = 3 * (2 * P + c // 3) + c % 3
            if q < 12:
                dst = 96 * G + 32 * (q // 4) + 8 * (q % 4) + c
            else:
                dst = 96 * G + 32 * (c // 2) + 8 * (q - 12) + 6 + c % 2
            order[dst] = src
    assert sorted(order.tolist()) == list(range(384))
    return order


def repack_for_gemm(packed, absmax, k: int, N: int, K_dim: int):
    """FORMAT.md ``(packed, absmax)`` of a ``[N, K_dim]`` weight -> the mma kernel's tiles.

    Returns ``(tiles, scales)`` in the input's module: ``tiles`` uint32 of shape
    ``(row_tiles, k_tiles, k, 32, 4)`` (per 16-row x 256-column tile, lane
    ``4g + t`` holds the 128 indices of rows ``g``/``g+8``, columns ``8p + 2t``,
    ``8p + 2t + 1`` (p = 0..3) of each block as one bit string of k-bit fields:
    its mma A-fragment in k order, see ``kernels_src/gemm_mma.cu``),
    ``scales`` of ``absmax``'s dtype and shape ``(row_tiles, k_tiles, 16, 8)``.
    Rows past ``N`` and columns past ``K_dim`` are padding (index 0, scale 0).
    ``unpack_from_gemm`` inverts it exactly. (k = 3 under the A/B knob
    ``_jit.GEMM_K3_BYTE_LANES``: the string's bits in byte lanes,
    ``_k3_byte_lane_order``.)
    """
    k = check_k(k)
    N, K_dim = check_shape((N, K_dim), "(N, K_dim)")
    _check_shape(k, N, K_dim)
    check_array(packed, "packed")
    check_array(absmax, "absmax")
    xp = array_module(packed)
    nblocks = N * K_dim // BLOCK
    if packed.shape != (nblocks * k,) or absmax.shape != (nblocks,):
        raise ValueError(
            f"packed/absmax shapes {packed.shape}/{absmax.shape} do not match a [{N}, {K_dim}] "
            f"weight at k={k} (expected ({nblocks * k},)/({nblocks},))"
        )
    rt_n, kt_n = _tile_counts(N, K_dim)
    kb, kbp = K_dim // BLOCK, kt_n * BLOCKS_PER_TILE
    tiles = xp.empty((rt_n, kt_n, k, 32, 4), dtype=xp.uint32)
    # Rows are converted in chunks of whole row tiles to bound temporary memory.
    rows_per_chunk = max(ROWS_PER_TILE, _CHUNK_WEIGHTS // (kbp * BLOCK) // 16 * 16)
    for r0 in range(0, rt_n * ROWS_PER_TILE, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, rt_n * ROWS_PER_TILE)
        idx = xp.zeros((r1 - r0, kbp, BLOCK), dtype=xp.uint8)
        real = max(0, min(r1, N) - r0)
        if real:
            blocks = packed[r0 * kb * k : (r0 + real) * kb * k]
            idx[:real, :kb] = _planes_to_indices(xp, blocks, k).reshape(real, kb, BLOCK)
        # row = 16 rt + 8 h + g; col = 256 kt + 32 j + 8 p + 2 t + e
        f = idx.reshape((r1 - r0) // 16, 2, 8, kt_n, 8, 4, 4, 2)
        f = f.transpose(0, 3, 2, 6, 4, 1, 5, 7)  # [rt, kt, g, t, j, h, p, e]
        f = f.reshape((r1 - r0) // 16, kt_n, 32, 128)
        bits = ((f[..., None] >> xp.arange(k, dtype=xp.uint8)) & 1).reshape(f.shape[:-1] + (-1,))
        if k == 3 and _jit.GEMM_K3_BYTE_LANES:
            bits = bits[..., xp.asarray(_k3_byte_lane_order())]
        words = _bits_to_words(xp, bits)  # [rt, kt, lane, 4k]
        tiles[r0 // 16 : r1 // 16] = words.reshape(words.shape[:3] + (k, 4)).transpose(0, 1, 3, 2, 4)
    scales = xp.zeros((rt_n * ROWS_PER_TILE, kbp), dtype=absmax.dtype)
    scales[:N, :kb] = absmax.reshape(N, kb)
    scales = xp.ascontiguousarray(
        scales.reshape(rt_n, ROWS_PER_TILE, kt_n, BLOCKS_PER_TILE).transpose(0, 2, 1, 3)
    )
    return tiles, scales


def unpack_from_gemm(tiles, scales, k: int, N: int, K_dim: int):
    """Inverse of ``repack_for_gemm``: ``(packed, absmax)`` in the FORMAT.md layout."""
    k = check_k(k)
    N, K_dim = int(N), int(K_dim)
    _check_shape(k, N, K_dim)
    xp = array_module(tiles)
    rt_n, kt_n = _tile_counts(N, K_dim)
    if tiles.shape != (rt_n, kt_n, k, 32, 4) or scales.shape != (rt_n, kt_n, 16, 8):
        raise ValueError(f"tiles/scales shapes {tiles.shape}/{scales.shape} do not match [{N}, {K_dim}], k={k}")
    kb = K_dim // BLOCK
    words = tiles.transpose(0, 1, 3, 2, 4).reshape(rt_n, kt_n, 32, 4 * k)
    bits = _words_to_bits(xp, words)
    if k == 3 and _jit.GEMM_K3_BYTE_LANES:
        bits = bits[..., xp.asarray(np.argsort(_k3_byte_lane_order()))]
    bits = bits.reshape(rt_n, kt_n, 32, 128, k)
    f = (bits.astype(xp.uint8) << xp.arange(k, dtype=xp.uint8)).sum(axis=-1, dtype=xp.uint8)
    f = f.reshape(rt_n, kt_n, 8, 4, 8, 2, 4, 2).transpose(0, 5, 2, 1, 4, 6, 3, 7)
    idx = f.reshape(rt_n * ROWS_PER_TILE, kt_n * BLOCKS_PER_TILE, BLOCK)[:N, :kb]
    packed = _indices_to_planes(xp, xp.ascontiguousarray(idx).reshape(-1, BLOCK), k)
    absmax = scales.transpose(0, 2, 1, 3).reshape(rt_n * ROWS_PER_TILE, kt_n * BLOCKS_PER_TILE)
    return packed, xp.ascontiguousarray(absmax[:N, :kb]).reshape(-1)


# --------------------------------------------------------------------------
# the weight object


_WEIGHT_FIELDS = frozenset(("packed", "absmax", "codebook", "k", "shape"))


class _KbitArrays:
    """What the quantized-tensor objects share: ``packed``, ``absmax``, ``codebook``, ``shape``."""

    def __setattr__(self, name, value):
        # Changing the arrays, k or shape makes the tiled copy and the launch
        # plans stale: drop them (they are rebuilt on the next call).
        if name in _WEIGHT_FIELDS and "_plans" in self.__dict__:
            self.__dict__["_plans"] = {}
            self.__dict__["_tiles"] = None
        if name == "codebook":  # its range is known again only from a new weight (_cb_fold)
            self.__dict__["_cb_max"] = self.__dict__["_cb_min"] = None
        object.__setattr__(self, name, value)

    @property
    def absmax_format(self) -> str:
        return "e4m4" if self.absmax.dtype == np.uint8 else "fp16"

    @property
    def nbytes(self) -> int:
        """Bytes of packed indices + scales + codebook (the FORMAT.md arrays; the kernels'
        tiled copy pads rows to 16 and columns to 256)."""
        return int(self.packed.nbytes + self.absmax.nbytes + self.codebook.nbytes)

    @property
    def bits_per_element(self) -> float:
        return 8.0 * (self.packed.nbytes + self.absmax.nbytes) / math.prod(self.shape)


@dataclass
class KbitWeight(_KbitArrays):
    """A k-bit quantized ``[N, K_dim]`` weight (FORMAT.md sections 5 and 7).

    ``packed`` (uint32 bit-planes), ``absmax`` (uint8 E4M4 codes or float16)
    and ``codebook`` (float32, ``2**k``) live in one module (NumPy or CuPy);
    ``shape`` is ``(N, K_dim)``. The kernels' tiled layout is built on first
    use (or by ``prepare()``) and kept. To change the arrays, assign new
    ones (``w.codebook = ...``) rather than writing into them: what is derived
    from them (the tiled copy, launch plans, the codebook's range) is kept
    until an assignment drops it.
    """

    packed: object
    absmax: object
    codebook: object
    k: int
    shape: tuple[int, int]
    _tiles: tuple | None = field(default=None, repr=False)
    # kbit_gemm's launch plans, per (A's shape and dtype, kernel, stream): what
    # depends only on those is resolved on a first call and reused
    _plans: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.k = check_k(self.k)
        N, K_dim = check_shape(self.shape, "shape", ndim=2)
        self.shape = (N, K_dim)
        _check_shape(self.k, N, K_dim)
        xp, self.packed = as_module_array(self.packed, "packed")
        same_module(xp, {"absmax": self.absmax})
        nblocks = N * K_dim // BLOCK
        if self.packed.dtype != np.uint32 or self.packed.shape != (nblocks * self.k,):
            raise ValueError(f"packed must be uint32 of shape ({nblocks * self.k},) for a "
                             f"[{N}, {K_dim}] weight at k={self.k}, got {self.packed.dtype} {self.packed.shape}")
        if self.absmax.dtype not in (np.uint8, np.float16) or self.absmax.shape != (nblocks,):
            raise ValueError(f"absmax must be uint8 (E4M4) or float16 of shape ({nblocks},), "
                             f"got {self.absmax.dtype} {self.absmax.shape}")
        # The codebook follows the data (the kernels read it from device memory).
        host_cb = check_codebook(to_host(self.codebook), self.k)
        self.codebook = xp.asarray(host_cb)
        # its largest and smallest nonzero |entry|, for _cb_fold (a later
        # assignment of codebook drops them)
        magnitudes = np.abs(host_cb)
        self.__dict__["_cb_max"] = float(magnitudes.max())
        self.__dict__["_cb_min"] = float(magnitudes[magnitudes > 0].min(initial=np.inf))

    def dequantize(self, dtype=np.float16):
        """The ``[N, K_dim]`` weight in ``dtype`` (FORMAT.md section 6)."""
        return dequantize_kbit(self.packed, self.absmax, self.codebook, self.k, self.shape, dtype=dtype)

    def prepare(self) -> KbitWeight:
        """Build the kernels' tiled layout now (it is otherwise built on first use)."""
        if self._tiles is None:
            self._tiles = repack_for_gemm(self.packed, self.absmax, self.k, *self.shape)
        return self

    def to_device(self) -> KbitWeight:
        """A copy on the current CUDA device (CuPy arrays)."""
        import cupy as cp

        return KbitWeight(cp.asarray(self.packed), cp.asarray(self.absmax), cp.asarray(self.codebook),
                          self.k, self.shape)


def quantize_weight(W, k: int = 4, codebook=None, absmax_format: str = "e4m4", *,
                    hessian=None, method: str = "rtn", **gptq_options) -> KbitWeight:
    """Quantize a linear layer's weight ``W`` of shape ``[N, K_dim]`` (blocks along K_dim).

    ``W``: float16 / bfloat16 / float32, NumPy or CuPy; ``K_dim % 32 == 0``.
    The result lives in ``W``'s module. See ``quantize_kbit`` for the rest.

    ``method="rtn"`` (default): round to the nearest codebook entry.
    ``method="gptq"`` with ``hessian=H`` (``[K_dim, K_dim]`` = X^T X of the
    layer's inputs, or a ``calibrate.HessianAccumulator``): GPTQ-style error
    compensation (``kbit_cupy.calibrate.gptq_quantize``, same format);
    ``gptq_options`` go to it.
    """
    if method == "gptq":
        from .calibrate import gptq_quantize  # calibrate imports this module

        return gptq_quantize(W, k, codebook, hessian=hessian, absmax_format=absmax_format,
                             **gptq_options)
    if method != "rtn":
        raise ValueError(f'method must be "rtn" or "gptq", got {method!r}')
    if hessian is not None or gptq_options:
        raise ValueError('hessian= and GPTQ options need method="gptq"')
    _, W = as_module_array(W, "W")
    if W.ndim != 2:
        raise ValueError(f"W must be 2-D [N, K_dim], got shape {W.shape}")
    N, K_dim = W.shape
    _check_shape(check_k(k), N, K_dim)
    packed, absmax, cb = quantize_kbit(W, k=k, codebook=codebook, absmax_format=absmax_format)
    return KbitWeight(packed, absmax, cb, int(k), (int(N), int(K_dim)))


# --------------------------------------------------------------------------
# the product


def check_activation_dtype(A) -> None:
    """TypeError unless A is fp16 or bf16 (fp32 and fp64: cast first)."""
    if A.dtype == np.float32 or A.dtype == np.float64:
        raise TypeError(f"A must be float16 or bfloat16, got {A.dtype}; cast it first (A.astype(numpy.float16))")
    if A.dtype not in ACT_DTYPES:
        raise TypeError(f"A must be float16 or ml_dtypes.bfloat16, got {A.dtype}")


def check_same_place(xp, A, packed, noun: str, lives: str, move: str) -> None:
    """A (module ``xp``) and the quantized arrays (``packed``) on the same host or GPU."""
    if is_device_array(packed) != (xp is not np):
        where = "GPU" if is_device_array(packed) else "host"
        raise TypeError(f"A and {noun} must live in the same place; {lives} on the {where} "
                        f"(use {move} or pass a NumPy A)")
    if xp is not np and A.data.device_id != packed.data.device_id:
        raise ValueError(f"A is on GPU {A.data.device_id} but the {noun} on GPU "
                         f"{packed.data.device_id}; call {move} under the right cupy.cuda.Device")


def launch_ctas_per_sm(kern, threads: int, shared: int) -> int:
    """CTAs of ``kern`` resident per SM with ``shared`` dynamic bytes, after
    opting in to dynamic shared memory past 48 KB (static + dynamic) where needed;
    0 where the bytes exceed what a CTA may opt in to (the caller says why)."""
    if kern.shared_size_bytes + shared > int(_attributes()["MaxSharedMemoryPerBlockOptin"]):
        return 0  # the driver would refuse the opt-in (CUDA_ERROR_INVALID_VALUE)
    if kern.shared_size_bytes + shared > 48 * 1024 and kern.max_dynamic_shared_size_bytes < shared:
        kern.max_dynamic_shared_size_bytes = shared
    # Keyed by the kernel object itself, not its id(): the entry keeps it
    # alive, so a freed kernel's id can never be reused by another one and
    # answer with its occupancy (benchmark tools recompile kernels under other
    # defines and drop the old ones). And by the threads: latency_geometry asks
    # for one shared size at several warp counts, and another layer's launch
    # can ask for the same bytes at other warps (a key without them gave
    # 5120x8192 at one row, 4 warps and 12288 bytes, the answer for 8 warps
    # and 12288 bytes of 4096-column layers, asked before: the launch then
    # halved to 2 warps and ran 1.4x slower, H200, dispatch_audit4/5).
    key = (kern, threads, shared)
    if key not in _resident_cache:
        _resident_cache[key] = _resident_ctas(kern, threads, kern.shared_size_bytes + shared)
    return _resident_cache[key]


def _check_activations(A, weight: KbitWeight, out):
    if not isinstance(weight, KbitWeight):
        raise TypeError(f"weight must be a KbitWeight (from quantize_weight), got {type(weight).__name__}")
    xp, A = as_module_array(A, "A")
    check_activation_dtype(A)
    N, K_dim = weight.shape
    if A.ndim < 1 or A.shape[-1] != K_dim:
        raise ValueError(f"A's last dimension must be K_dim={K_dim}, got shape {A.shape}")
    check_same_place(xp, A, weight.packed, "weight", "the weight is", "weight.to_device()")
    out_shape = A.shape[:-1] + (N,)
    if out is not None:
        check_array(out, "out")
        if array_module(out) is not xp:
            raise TypeError("out must be in the same module as A")
        if out.shape != out_shape or out.dtype != A.dtype:
            raise ValueError(f"out must have shape {out_shape} and dtype {A.dtype}, got {out.shape} {out.dtype}")
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        if xp is not np and out.data.device_id != A.data.device_id:
            raise ValueError(f"out is on GPU {out.data.device_id} but A on GPU {A.data.device_id}; "
                             "allocate out on A's device")
    return xp, A, out_shape


def kbit_gemm(A, weight: KbitWeight, out=None, kernel: str = "auto"):
    """``C = A @ dequant(weight).T``, accumulated in float32.

    A : ``[..., K_dim]`` float16 or ``ml_dtypes.bfloat16``, NumPy or CuPy (the
        weight must be in the same place). Non-contiguous A is copied.
    weight : a ``KbitWeight`` of shape ``[N, K_dim]``.
    out : optional C-contiguous ``[..., N]`` array of A's dtype and module.
    kernel : ``"auto"``, ``"mma"`` (fused kernel, mma.sync, sm_80+),
        ``"wgmma"`` (fused kernel, Hopper wgmma; sm_90 GPUs only),
        ``"latency"`` (fused kernel for few rows on small layers: one CTA per
        16 rows of W, no split-K workspace; launches of up to 16 rows of A,
        fewer where K_dim is long), ``"cluster"`` (the latency kernel's
        decode with the K tiles split over a thread-block cluster and A
        staged per M chunk, for small layers at tens to hundreds of rows;
        sm_90 GPUs only; ``"auto"`` takes wgmma there instead:
        benchmarks/NOTES-gemm.md), ``"lut"`` (k = 2, one row of A, E4M4
        scales: table lookups of four products at a time; a split-K
        workspace and a second launch that sums it) or ``"dequant"``
        (dequantize to a scratch weight, then cuBLAS); ignored for NumPy A.

    Returns ``C`` of shape ``[..., N]`` and A's dtype. The same inputs on the
    same GPU give the same bits on every call.

    Raises TypeError (A not fp16/bf16, e.g. fp32: cast it; A and weight in
    different places; ``out`` in another module; weight not a KbitWeight) and
    ValueError (A's last dimension is not K_dim; ``out`` shape, dtype or
    layout; unknown ``kernel``; ``kernel="wgmma"`` or ``"cluster"`` on a GPU
    other than sm_90 (``"cluster"`` also without cuLaunchKernelEx);
    ``kernel="lut"`` for k != 2, fp16 scales or more than one row of A;
    A and weight on different GPUs).
    """
    plans = getattr(weight, "_plans", None)
    if plans and type(A) is _cupy_ndarray:  # the fast path: a plan resolved everything else
        stream = _get_current_stream()
        plan = plans.get((A.shape, A.dtype, kernel, stream.ptr, _thread()))
        if plan is not None and type(weight) is KbitWeight:
            C = plan(A, out, stream)
            if C is not None:
                return C
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    xp, A, out_shape = _check_activations(A, weight, out)
    N, K_dim = weight.shape
    A2 = A.reshape(-1, K_dim)
    M = A2.shape[0]
    if xp is np or M == 0:
        C = out if out is not None else xp.empty(out_shape, dtype=A.dtype)
        if M:
            w = weight.dequantize(np.float32)
            C.reshape(M, N)[...] = (A2.astype(np.float32) @ w.T).astype(A.dtype)
        return C
    _check_current_device(A)
    if kernel == "wgmma" and not has_wgmma():  # "auto" asks choose_kernel, which asks the GPU
        raise ValueError("kernel='wgmma' needs a Hopper GPU (sm_90: H100, H200); use 'mma' or 'auto'")
    if kernel == "cluster" and not _launch.cluster_launch_supported():
        raise ValueError("kernel='cluster' needs a Hopper GPU (sm_90: H100, H200) and a driver "
                         "with cuLaunchKernelEx; use 'mma' or 'auto'")
    stream = xp.cuda.get_current_stream()  # (inside setup_scope it would be the side stream)
    with _launch.setup_scope():  # one-time work stays out of a graph being captured
        plan = _GemmPlan(weight, M, A.dtype, kernel, stream.ptr, out_shape)
    _remember_cupy(xp)
    weight._plans[(A.shape, A.dtype, kernel, stream.ptr, _thread())] = plan
    if A.strides != plan.a_strides or A.data.ptr % 16:
        # copied, every call: the plan takes A in the plain row-major layout,
        # 16-byte aligned (a size-1 dimension may carry any stride and still
        # count as contiguous: compare strides, not the flag)
        A = A2.copy().reshape(A.shape)
    C = plan(A, out, stream)
    if C is None:
        raise TypeError(f"out must be a C-contiguous CuPy array, got {type(out).__name__}")
    return C


# CuPy entry points the fast path calls, bound by _remember_cupy on the first
# GPU call (no module lookups per call; None until then, so the type test fails)
_cupy_ndarray = _get_current_stream = _get_device = _launch_kernel = _alloc = None
_getrefcount = sys.getrefcount
# A plan keeps its last C for reuse only up to this size: the allocation it
# saves (~3 us) matters next to small products, and the memory a plan holds
# on to stays small however many A shapes a weight sees.
_SPARE_MAX_BYTES = 4 << 20
# A plan's argument block is set, then launched: calls from two threads on one
# stream must not share it, so plans are also per thread (cheap: an int).
_thread = threading.get_ident


class _Holder:
    __slots__ = ("spare",)


def _sole_reference_count() -> int:
    """What ``_GemmPlan._output``'s test reads for an object that only the
    plan's attribute holds, measured with the same statements (interpreters
    differ in how many references a local and a call argument add)."""
    holder = _Holder()
    holder.spare = object()
    spare = holder.spare
    return _getrefcount(spare)


_SOLE_REFERENCE = _sole_reference_count()


def _remember_cupy(cp) -> None:
    """The CuPy entry points the fast path calls, bound once (no module lookups per call)."""
    global _cupy_ndarray, _get_current_stream, _get_device, _launch_kernel, _alloc
    _cupy_ndarray, _get_current_stream = cp.ndarray, cp.cuda.get_current_stream
    _get_device, _launch_kernel = cp.cuda.runtime.getDevice, cp.cuda.driver.launchKernel
    _alloc = cp.cuda.alloc


def _check_current_device(A) -> None:
    """The kernels run on the current device: A must live there."""
    dev = _launch.current_device()
    if A.data.device_id != dev:
        raise ValueError(f"A is on GPU {A.data.device_id} but the current device is GPU {dev}; "
                         "call kbit_gemm under cupy.cuda.Device(A.device.id)")


class _GemmPlan:
    """Everything ``kbit_gemm`` needs for one (weight, A shape and dtype,
    kernel, device, stream), resolved once: the kernel choice, compiled
    kernels, launch geometry and argument blocks, workspaces, the dequantize
    scratch. A call checks A and ``out`` against it with a few comparisons,
    allocates C (unless given) and launches."""

    def __init__(self, weight: KbitWeight, M: int, dtype, kernel: str, stream: int, out_shape):
        N, K_dim = weight.shape
        _launch.ensure_context()  # plans are per thread: bind this thread's context
        self.device = _launch.current_device()
        self.dtype = dtype
        self.out_shape = out_shape
        self.out_strides = _c_strides(out_shape, dtype.itemsize)
        self.out_nbytes = math.prod(out_shape) * dtype.itemsize
        self.a_strides = _c_strides(out_shape[:-1] + (K_dim,), dtype.itemsize)
        self.M, self.N, self.K_dim = M, N, K_dim
        self.choice = kernel if kernel != "auto" else choose_kernel(
            M, N, K_dim, weight.k, dtype, scale=weight.absmax.dtype.name)
        if self.choice == "cluster" and kernel == "auto" and not _launch.cluster_launch_supported():
            self.choice = "mma"  # sm_90 but a driver without cuLaunchKernelEx
        if (self.choice == "latency" and kernel == "auto"
                and not _latency_one_wave(min(M, _latency_rows(K_dim, dtype.itemsize)), weight, dtype)):
            self.choice = "mma"  # (the latency kernel's second wave: _latency_one_wave)
        # M chunks of a Hopper-path launch (_wg_m_chunks; 1: none)
        chunks = (_wg_m_chunks(M, weight.k, N, K_dim, weight.absmax.dtype.name)
                  if self.choice == "wgmma" else 1)
        if (self.choice == "wgmma" and kernel == "auto" and M > 128
                and _layer_class(N, K_dim, weight.k, True) == "small" and chunks == 1):
            # the table's small-layer wgmma rows past 128 rows were measured in
            # M chunks; without them (no clusters) what ran there before
            self.choice = "dequant"
        self.launches = []  # (Launch, first row, rows, tensor-map n8 tiles or 0)
        self.scratch = None
        self.single = None
        self.pdl = None  # the single launch through cuLaunchKernelEx (sm_90)
        # gemm_mma launches: CTAs per cluster of split K (0: no clusters: the
        # workspace, stream-K or whole groups)
        self.clusters = []
        self.spare = None  # the last C this plan allocated (see _output)
        self.lut = None  # gemm_lut.cu's two launches (lookups, sum)
        if self.choice == "lut":
            self.lut = _plan_lut_launches(M, weight, dtype, stream)
            return
        if self.choice == "dequant":
            nbytes = N * K_dim * dtype.itemsize
            buf = _launch.stream_buffer("dequant", nbytes, stream)
            self.scratch = buf[:nbytes].view(dtype).reshape(N, K_dim)
            flat = self.scratch.reshape(-1)
            self.dequant = dequantize_launch(
                weight.k, N * K_dim, dtype, weight.absmax.dtype,
                (weight.packed, weight.absmax, weight.codebook, N * K_dim, flat,
                 int(flat.data.ptr % 16 == 0)))
            _launch.blas().bind(stream)  # creates the handle and the stream's workspace now
            return
        weight.prepare()
        wg = self.choice == "wgmma"
        slab_chunks = False
        if self.choice == "latency":
            step = _latency_rows(K_dim, dtype.itemsize)
        elif wg:
            # rows per launch; the 129..256-row launches load A through a tensor
            # map, and their setmaxnreg budgets need the register count ptxas gave
            step = 8 * max(t for t in _jit.GEMM_WG_M_TILES if t < _jit.GEMM_SLAB_MIN_M_TILES)
            if chunks > 1:
                step = M  # one launch, its chunks along grid z
            elif M > step and _tensor_maps_available() and _slab_launch_ok(weight, dtype.name):
                step = 8 * max(_jit.gemm_wg_m_tiles(weight.k, weight.absmax.dtype.name))
                if _wg_slab_chunks(M, step):
                    # one launch, its slab-staged chunks along grid z
                    chunks, step, slab_chunks = math.ceil(M / step), M, True
        elif self.choice == "cluster":
            step = M  # one launch: its M chunks run along grid y
        else:
            step = _MMA_MAX_M
        pdl = _launch.pdl_supported()  # gemm_mma.cu: grid_dependency_sync
        for m0 in range(0, M, step):
            rows = min(M, m0 + step) - m0
            if self.choice == "cluster":
                try:
                    launch, ranks = _plan_cluster_launch(rows, weight, dtype)
                    run = _launch.PdlLaunch(launch, pdl=pdl, cluster=ranks)
                    if run.max_active_clusters() == 0:  # (None: the driver cannot say)
                        raise ValueError(f"a cluster of {ranks} CTAs of {launch.block[0]} threads "
                                         f"and {launch.shared} bytes of shared memory does not "
                                         "fit this GPU; use kernel='mma'")
                    self.launches.append((launch, m0, rows, 0, run))
                    continue
                except ValueError:
                    if kernel != "auto" or rows > _MMA_MAX_M:
                        raise
                    self.choice = "mma"  # auto: what the table ran before the cluster split
            cluster = 0
            if self.choice == "latency":
                launch, map_tiles = _plan_latency_launch(rows, weight, dtype), 0
            else:
                launch, map_tiles, cluster = _plan_launch(rows, weight, dtype, wg, stream, chunks,
                                                          slab_chunks)
            run = _launch.PdlLaunch(launch) if pdl else launch
            if cluster:  # split K in clusters, where they fit (else the workspace: same bits)
                ex = _launch.PdlLaunch(launch, pdl=pdl, cluster=cluster, cluster_axis=1)
                if ex.max_active_clusters() != 0:
                    run = ex
                else:
                    cluster = 0
            self.clusters.append(cluster)
            self.launches.append((launch, m0, rows, map_tiles, run))
        if len(self.launches) == 1 and not self.launches[0][3]:
            # one launch without a tensor map (M <= 64, and wgmma to 128): the
            # call sets two pointers and launches, nothing else
            launch = self.launches[0][0]
            self.single = (launch.prefix, launch.argv, launch.value(_ARG_A),
                           launch.value(_ARG_C))
            run = self.launches[0][4]
            self.pdl = run if run is not launch else None  # through cuLaunchKernelEx

    def _output(self, stream):
        """A new C, or the plan's previous C (up to _SPARE_MAX_BYTES) when
        nothing else refers to it any more (the caller dropped it): the memory
        CuPy's pool would hand back for the same request on the same stream,
        without the 3-4 us of a pool allocation and a new ndarray. Work already queued on this stream that
        read the old C runs before the kernel that overwrites it. While the
        stream is being captured, C is always new and never kept (a graph
        writes it at every replay)."""
        if stream.ptr and stream.is_capturing():
            return _launch.empty(self.out_shape, self.dtype, self.out_nbytes, stream)
        spare = self.spare
        if spare is not None and _getrefcount(spare) <= _SOLE_REFERENCE:
            return spare
        C = _cupy_ndarray(self.out_shape, self.dtype, _alloc(self.out_nbytes))
        if self.out_nbytes <= _SPARE_MAX_BYTES:
            self.spare = C
        return C

    def __call__(self, A, out, stream):
        """C for A (and ``out``) of the shapes this plan was built for, launched
        on ``stream`` (the current stream object); None, before anything is
        written, when A or ``out`` is not what the plan takes (not contiguous,
        not 16-byte aligned, another device, ``out`` of another shape, dtype
        or layout): the caller then takes the checked path."""
        a_mem = A.data
        a = a_mem.ptr
        if (A.strides != self.a_strides or a & 15 or a_mem.device_id != self.device
                or _get_device() != self.device):
            return None
        if out is None:
            C = self._output(stream)
        elif (type(out) is type(A) and out.shape == self.out_shape and out.dtype == self.dtype
                and out.strides == self.out_strides and out.data.device_id == self.device):
            C = out
        else:
            return None
        c = C.data.ptr
        stream = stream.ptr
        single = self.single
        if single is not None:
            single[2].value = a
            single[3].value = c
            if self.pdl is not None:
                self.pdl(stream)
            else:
                _launch_kernel(*single[0], stream, single[1], 0)
            return C
        if self.lut is not None:
            lookups, total = self.lut
            lookups.set(_LUT_ARG_A, a)
            total.set(_LUT_ARG_C, c)
            lookups(stream)
            total(stream)
            return C
        K_bytes, N_bytes = self.K_dim * self.dtype.itemsize, self.N * self.dtype.itemsize
        if self.scratch is not None:
            self.dequant(stream)
            _launch.cublas_gemm(self.M, self.N, self.K_dim, self.dtype.name, a,
                                self.scratch.data.ptr, c, stream)
            return C
        for launch, m0, rows, map_tiles, run in self.launches:
            launch.set(_ARG_A, a + m0 * K_bytes)
            launch.set(_ARG_C, c + m0 * N_bytes)
            if map_tiles:
                launch.set(_ARG_MAP, _activation_map(a + m0 * K_bytes, rows, self.K_dim, map_tiles))
            run(stream)
        return C


def _c_strides(shape, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


_wgmma_cache: dict[int, bool] = {}


def has_wgmma() -> bool:
    """Whether the current GPU runs the wgmma kernel (compute capability 9.0)."""
    import cupy as cp

    dev = _launch.current_device()
    found = _wgmma_cache.get(dev)
    if found is None:
        found = _wgmma_cache[dev] = cp.cuda.Device(dev).compute_capability == "90"
    return found


# --------------------------------------------------------------------------
# kernel="auto": the dispatch table
#
# One row per (GPU kind, layer class, k, activation dtype, weight count): up
# to ``lat_max`` rows of A run the latency kernel, up to ``cl_max`` the
# cluster split (sm_90 with cuLaunchKernelEx; else mma), up to ``mma_max`` the mma
# kernel, up to ``wg_max`` the wgmma kernel (sm_90 only), beyond that
# dequantize + cuBLAS. The first row that
# matches decides. Layer classes (``_layer_class``): "widest" N >= 16384, or
# K_dim >= 16384 at k <= 4; "large" N >= 16384 or K_dim >= 8192; "mid" at
# least 2^24 weights; "small" the rest.
#
# Where the bounds come from (benchmarks/derive_dispatch.py over the
# committed sweeps; worst pick 1.01-1.03x the best measured kernel):
# - sm_90 rows: benchmarks/results/gemm_sweep_h100_e2b299f_*.json (7 layers,
#   M 1..4096, k 2..5, fp16 and bf16; mma and the wgmma path up to 128 rows
#   are the kernels of 09ff1ea, whose sweep the small-M bounds come from). On
#   the large layers mma to M = 16 (fp16: the ALU scale decode made mma 5-8%
#   faster than wgmma at M = 16, k = 4; bf16 to 8 at k = 2 and 4), wgmma to
#   512 (the warp-specialised 192- and 256-row launches), at k = 2..4 to 1024
#   from 2^27 weights (8192x57344, 28672x8192), at k = 5 only to 256 below
#   2^27 weights (its shuffle decode); dequantize + cuBLAS beyond (0.92x
#   cuBLAS at M = 4096). On 4096x6144 mma to 64 (k = 5: 32), wgmma to 256; on
#   2048x768 and 768x2048 wgmma never won (until its split K in clusters, below).
# - lat_max (sm_90): benchmarks/results/latency_h100_*.json (the latency
#   kernel against mma, M 1..16, fp16 and bf16): small layers to M = 16 (1.3-
#   1.85x cuBLAS at M = 1 against mma's 0.8-1.1x), mid layers up to 2^24
#   weights to M = 8 (k = 2 every mid layer), k = 2 fp16 on large layers under
#   2^26 weights to M = 2 (14336x4096). Other GPUs: not measured, mma.
#   Since 1bcd642 (the L2 policy on weight loads; latency_h100_1bcd642 and
#   latency_h200_1bcd642, which agree): k = 3 fp16 on the other mid layers to
#   M = 4 (4096x6144: latency/mma 0.94, 0.94, 0.98 at M = 1, 2, 4 on the H100;
#   0.94, 0.95, 0.97 on the H200; 5120x5120 and 6144x4096 0.89-0.95 on the
#   H100, dispatch_check_h100_1bcd642_float16; bf16 on 5120x5120 lost at M = 1:
#   1.18, dispatch_check_h100_1bcd642_bfloat16) and k = 2 fp16 on large layers under 2^27 weights
#   at M = 1 (4096x28672: 0.935 H100, 0.94 H200). The H100 and the H200 pick
#   the same kernels within 7% at every point of their runs, so the table
#   keys on the GPU's properties (wgmma or not), not on its name.
#   Since 2beb469 (half tiles, the codebook loaded first;
#   latency_h100_2beb469_float16, which adds 5120x5120): k = 5 on 4096x6144
#   (and 6144x4096, same size) to M = 4 (latency/mma 0.91, 0.94, 0.96 at M =
#   1, 2, 4) and on 5120x5120 (0.90, 0.92, 0.93: latency_h100_cf93bb9_5120x5120_*,
#   two runs within 0.5% of each other). That run (2beb469) had the latency
#   kernel on 5120x5120 27% slower at M = 1 than at M = 2 (k = 3: 13.75
#   against 10.79 us); the two later runs of the same kernel have 10.50 and
#   10.51 us (mma 12.1): the run's, not the kernel's.
# - cl_max (sm_90): benchmarks/results/cluster_h100_e0c1b1b.json (the cluster
#   split at 8 geometries against mma, latency and dequantize + cuBLAS, M 8..256,
#   k 2 and 4, fp16, kernel-only). On the small layers (2048x768, 768x2048,
#   2048x512) its best geometry at M = 32 and 64 (32-row chunks, 4 row tiles per
#   CTA: cluster_geometry's choice there) ran 1.12-1.26x what auto ran (mma);
#   at M = 8 and 16 the latency kernel is faster (1.2-1.5x), at M = 128 it won
#   on two of the three layers only and by 5-12%, at 256 it lost. On 4096x4096
#   it lost at every M (0.34-0.71x auto): not on "mid" layers. Since the
#   Hopper path's split K in clusters (below) no row takes it: it stays
#   available as kernel="cluster".
# - min_tbps (sm_90, k = 4, M = 9..16 on the large layers): the GPU's peak
#   memory bandwidth from its properties (_device_tbps). Since the dense
#   Hopper path reads k = 4's pair table through PRMT (2414541), wgmma beats
#   mma there where the weight is large enough for the GPU's bandwidth
#   (results/mma_vs_wgmma_k4_m*_h{100,200}_bc79e7a.md, eager, fp16 and bf16):
#   H200 (4.8 TB/s) 8192x57344 and 28672x8192 8-11% less time, 4096x28672
#   3-5%, 14336x4096 0.6-2.5% more; H100 (3.35 TB/s) 8192x57344 4-6% less
#   (bf16 3.6-5.7%), 28672x8192 -2..+0.4%, 4096x28672 within +-2% (bf16 mma
#   2% faster), 14336x4096 1-5% more. So wgmma from M = 9 from 2^28 weights,
#   and from 2^26 at 4 TB/s or more; at M <= 8 mma (the 8-warp launch) wins
#   by 2-8% on both. bf16 k = 4 below those sizes now stays on mma to 16
#   (its 09ff1ea bound of 8 predates both kernels).
# - k = 2 at M = 9..16 on the large layers (fp16; bf16 took wgmma from 9
#   already): since k = 2's byte table (gemm_mma.cu KBIT_K2_QUAD_TABLE) the
#   dense Hopper path beats mma there from 2^26 weights on both GPUs, in one
#   process (results/define_ab_h{100,200}_k2_quad_table_*.txt): H100 wgmma over
#   mma 0.92 / 0.90 on 8192x57344 (M = 9 / 16), 0.95 / 0.95 on 4096x28672, but
#   1.03 / 1.02 on 14336x4096 (under 2^26); H200 0.91 / 0.90, 0.95 / 0.95, 1.03
#   / 1.02. So mma to 8 rows from 2^26 weights, then wgmma.
# - k = 5 at M = 9..16 on the large layers: with its 128 KB pair table on
#   both kernels (gemm_mma.cu kBigPairTable), wgmma over mma (16 warps) at M
#   = 9 / 16 on the H200 (results/define_ab_h200_k5_table_*_475f501.txt, one
#   process): 8192x57344 0.95 / 0.94, 28672x8192 0.96 / 0.96, 4096x28672 0.98
#   / 0.98, 14336x4096 1.00 / 0.99; on the H100 within 0.5% either way
#   (latency_h100_190c1d2_k5_large.json). So wgmma from 9 rows at 4 TB/s or
#   more, mma to 16 below.
# - small layers at 17..128 rows (sm_90): the Hopper path at one warpgroup a
#   CTA with split K in thread-block clusters (_wg_warpgroups,
#   _wg_cluster_splits; before, its 24-32 CTAs and the last CTA's sum of the
#   partials made it 0.3-0.5x cuBLAS there) against the cluster split, in one
#   process (results/latency_h{100,200}_small_wg_cluster_4bb7b7b_*.json, k
#   2..5, fp16 and bf16 on the H100, fp16 on the H200): wgmma as fast as the
#   cluster split or faster at 17..64 rows on the three small layers except
#   k = 2 and 5 on 768x2048 at 17..48 rows (up to 5.3% slower), and at 65..128
#   rows 0.66-1.0x cuBLAS where the cluster split gives 0.58-0.82x and
#   dequantize + cuBLAS about 0.7x (small_layers_before_h100_f24f01b). So wgmma
#   from 17 to 128 rows, dequantize + cuBLAS beyond (two 128-row launches
#   cost twice one), below 2^22 weights (3072x1024, 3.1M weights, measured
#   1.29x cuBLAS at M = 17..32: NOTES-gemm.md). Small layers of 2^22..2^24
#   weights keep the earlier row (the cluster split to 64 rows): not measured
#   (2048x2048 on wgmma at k = 4 ran 0.65-0.77x cuBLAS at 17..64 rows).
#   Since M chunks (_wg_m_chunks: 65..256 rows as 64-row chunks along grid z
#   of one launch), wgmma to 256 rows there: against dequantize + cuBLAS
#   (0.72-0.78x cuBLAS) on the H200, in one process
#   (results/define_ab_h200_m_chunks_residency_f64540b.txt, k 2..5, fp16), it
#   ran 0.66-0.99x cuBLAS at 129..256 rows, faster than dequantize + cuBLAS
#   at every point, and 0.74-1.04x at 65..128 (3-13% faster than one 128-row
#   launch at k = 3..5; k = 2 within 3% either way). On the layers of 2^22
#   weights (2048x2048, 4096x1024, 1024x4096; results/latency_h{100,200}_smallmid_chunks_6ad48e4_*)
#   wgmma at 65..128 rows against dequantize + cuBLAS: H100 1-30% less time
#   at every point (k 2..5), H200 the same but k = 2 on 4096x1024 at 128
#   rows (1.5% more); at 129..256 (H200) mixed, down to 0.44x cuBLAS against
#   0.58x. So wgmma at 65..128 from 2^22 to 2^23 weights (measured at 2^22
#   only), the cluster split to 64 rows, dequantize + cuBLAS beyond.
# - wg_max (sm_90, k = 2..4) on "large" and "mid" layers since the slab
#   chunks (_wg_slab_chunks: past 256 rows one launch, its 256-row chunks
#   along grid z, whole groups a CTA), in one process against dequantize +
#   cuBLAS (results/define_ab_h{100,200}_slab_chunks_*_20ab445+.txt, fp16):
#   H100 k = 4 wgmma / cuBLAS fp16 at 512 / 1024 / 2048 rows 0.85 / 0.89 /
#   0.89x on 4096x28672, 0.90 / 0.92 / 0.92 on 14336x4096, 0.97 / 0.95 / 0.97
#   on 8192x57344, 0.98 / 0.95 / 0.97 on 28672x8192, where dequantize +
#   cuBLAS ran 0.59-0.89x; k = 2 and 3 the same within 4%. Since C goes
#   out through shared memory (8de506a; large_m_h{100,200}_slab_chunks_8de506a_*):
#   at 3072 rows wgmma 0.93-0.97x the time of dequantize + cuBLAS on the
#   H100, 0.95-1.01x on the H200; at 4096 0.95-1.02x (bf16 1.02 on
#   4096x28672) and 0.97-1.04x. So wgmma to 4096 rows. k = 5 (192-row
#   chunks) lost from 1024 rows (0.60-0.69x against 0.73x): its rows stay.
# - k = 5's wg_max on "large" layers of the H200 since its 256-row launches
#   (_jit.GEMM_WG_K5_FULL_ROWS), in one process against the 192-row launches
#   and dequantize + cuBLAS (results/define_ab_h200_k5_full_rows_c48bd03.txt,
#   fp16, 4096x28672, 14336x4096, 8192x57344, 28672x8192, kernel-only): wgmma
#   faster than dequantize + cuBLAS at 200..1024 rows on all four (at 1024:
#   0.84-0.86x cuBLAS against 0.76-0.79x; at 512 0.75-0.86x against the
#   0.52-0.65x of what auto ran before, 192-row wgmma or dequantize +
#   cuBLAS), 2-5% slower at 2048. So wgmma to 1024 rows there (it was 256
#   and 512); results/dispatch_k5_h200_7cf8d0a_float16.md, every kernel at
#   16..4096 rows: auto within 0.2% of the fastest at every point. The
#   H100's rows are unchanged: not measured since.
#   Mid (4096x6144): wgmma 0.77-0.80x at 512 rows (96 group-chunks) against
#   0.62-0.66x; at 1024 (192 group-chunks: 1.45 waves of one CTA an SM)
#   0.70-0.72x against 0.74-0.78x; at 384 (launches of 256 and 128 rows)
#   0.54-0.57x against 0.61-0.64x. Since the stores through shared memory
#   (8de506a), on four mid layers at 448..4096 rows on both GPUs
#   (large_m_h{100,200}_slab_chunks_mid_ef571d2_float16.md) wgmma wins
#   where its chunks fit one wave or fill the last one to 0.9, and loses
#   elsewhere: _mid_slab_chunks_fill (in choose_kernel), to 4096 rows.
#   k = 5 on the same mid layers on the H200 since its 256-row launches
#   (results/k5_mid_h200_acf4252_float16.md, 384..4096 rows, wgmma against
#   dequantize + cuBLAS): at 512 and 1024 rows where the chunks fill the
#   wave wgmma 0.92-0.93x its time (4096x4096 at 512: 1.00x) but 5120x5120
#   at 512 (1.06x); where they do not 1.17-1.37x; at 2048 1.03-1.06x, at
#   384 1.23-1.38x. So the fill rule to 1024 rows (_WG_K5_MID_MAX). The
#   H100's k = 5 mid rows stop at 256: not measured. (E4M4 scales measured;
#   with fp16 scales k = 5 chunks 192 rows, counted as 256 by the rule, not
#   measured.)
# - the H200's rows for "mid" layers of 2^25 weights or more (k = 2..5) and
#   for k = 2 fp16 "large" layers under 2^26 at 2 rows, from
#   benchmarks/dispatch_audit.py (every kernel at each point, kernel-only, one
#   process): results/dispatch_audit_h200_ebddea3_float16.* (ten layers, 1..256
#   rows), dispatch_audit2_h200_97c1a1e_{float16,bfloat16}.* (4096x14336,
#   5120x13824, 13824x5120, 4096x11008, 14336x4096 at 1..64 rows). With the
#   rows before them, auto ran those mid layers (45.1M..70.8M weights):
#   - mma at 24..64 rows (k = 2..4) where wgmma took 0.76-0.97x its time
#     (4096x14336 k = 4 at 64 rows: 35.96 against 27.76 us), and mma at
#     1..32 rows for k = 5 where wgmma took 0.79-0.98x;
#   - the latency kernel at 3..8 rows (k = 2) and 2..4 (k = 3, fp16), where
#     it ran up to 1.96x mma's time: with 700-900 row tiles its CTAs fit one
#     wave only at few warps each (latency_geometry), and the point where
#     they stop fitting moves with the rows staged (4096x12288 k = 2: 12.40
#     us at 2 rows, 19.10 at 3, 13.50 at 4, mma 12.4-12.6); on 5120x13824 at
#     k = 2 and one row it ran 15.6 us in one run and 23.6 in the next two
#     (fp16, bf16), where mma ran 15.6.
#   So there: the latency kernel at k = 2 and 3 up to 2 rows below 2^26
#   weights (none from 2^26), mma to 16 rows at k = 2..4, wgmma from one row
#   at k = 5 (mma at most 3.8% faster at 1..3 rows on 4096x12288, wgmma up
#   to 3.6% faster on 4096x14336). A third run on 5120x8192 and 4096x12288
#   (not used for the first rows) and 4096x14336 again
#   (dispatch_audit3_h200_54d6caa_*) set k = 2's latency bound from 3 to 2
#   rows (4096x12288 at 3 rows, above) and k = 3's from 0 to 2 (5120x8192:
#   the latency kernel 6-9% faster at 1..4 rows). Over the 1120 points of the
#   five runs auto is within 1.13x the fastest kernel (13824x5120, k = 2,
#   bf16, one row: mma against the latency kernel; wgmma runs its 2..8 rows
#   6-7% faster than mma, but the same row takes 4096x28672, where mma is
#   2-7% faster), within 1.07x on those mid layers; before, 163 of the first
#   784 points were past 1.02x, the worst 1.96x. The H100 keeps its rows: not
#   measured there.
# - Those five runs and two more (0450bcc, b8bb6db) timed the latency kernel
#   with a geometry that could depend on the layers planned before it in the
#   process (launch_ctas_per_sm's cache keyed without the threads, fixed at
#   8aae053: 5120x8192 k = 2 and 3 at one row ran 14.8 and 16.4 us after two
#   4096-column layers, 10.3 and 11.3 alone; 5120x13824 k = 2's 23.6 us
#   above). Timed again at 8aae053 (dispatch_audit{6,7,8}_h200_8aae053_*:
#   4096x11008, 4096x12288, 5120x8192, 4096x14336, 5120x13824, 13824x5120,
#   14336x4096, 11008x4096, 4096x28672, 28672x8192 at 1..8 rows, fp16, and
#   bf16 on four of them), the latency kernel won where the rows had it lose,
#   fp16 and bf16 alike (latency / the fastest other kernel):
#   - "large" layers under 2^26 weights (14336x4096, 11008x4096): k = 2 at
#     2 rows 0.85-0.93 (one row: the lookups, or the latency kernel 6% faster
#     than them on 11008x4096, left), k = 3 at 1 and 2 rows 0.83-0.88; k = 4
#     0.996-1.15, k = 5 0.95-1.035 (not taken); 3 rows and more 1.5-2.2.
#     So the latency kernel to 2 rows at k = 2 and 3, fp16 and bf16 (was k =
#     2 fp16 at one row).
#   - "mid" layers of 2^26 weights or more (5120x13824): k = 2 at 1 and 2
#     rows 0.925-0.97; k = 3..5 1.04-1.29. So k = 2 to 2 rows (was none).
#   - "large" 2^26..2^27, k = 2 bf16 at one row: 13824x5120 0.95 (mma 1.13x
#     it); 4096x28672 takes the lookups there. So bf16 as fp16: one row. At
#     2 rows 13824x5120 0.97 but 4096x28672 1.12 under the same row: left.
#   Over the 272 points of those runs auto is within 1.11x the fastest kernel
#   (was 1.24x; mean 1.006x, was 1.015x).
# - other GPUs (no wgmma): benchmarks/results/gemm_sweep_h100_09ff1ea_*.json
#   run with the mma kernel only: mma won to M = 192 on the layers with N >=
#   16384 (4096x28672, 8192x57344) and on 28672x8192 at k <= 4, to 128 on the
#   other layers with >= 2^24 weights and to 64 on 2048x768 and 768x2048.


@dataclass(frozen=True)
class DispatchRule:
    """One row of the dispatch table (None: any)."""

    wgmma: bool  # the GPU runs the wgmma kernel (sm_90)
    layer: str  # "widest", "large", "mid", "small" (see _layer_class)
    mma_max: int
    wg_max: int
    ks: tuple | None = None
    fp16: bool | None = None  # activations fp16 (True) or bf16 (False)
    min_weights: int = 0
    max_weights: int | None = None  # exclusive
    lat_max: int = 0  # up to this many rows: the latency kernel (before mma)
    cl_max: int = 0  # then up to this many rows: the cluster split (sm_90; before mma)
    min_tbps: float = 0.0  # the GPU's peak memory bandwidth (TB/s, _device_tbps) at least


_HUGE = 1 << 27  # weights
_FAST_TBPS = 4.0  # peak memory bandwidth (TB/s) from which the H200's rows apply (H100: 3.35)
_MID_LATENCY = (1 << 24) + 1  # weights: 4096x4096 and below, of the "mid" layers
# wgmma's last rows (k = 2..4; sm_90) on "large" and "mid" layers since its
# slab chunks (_wg_slab_chunks; see the table's notes)
_WG_LARGE_MAX = 4096
_WG_MID_MAX = 4096
# k = 5's last wgmma rows on "large" layers (sm_90) on the H200 since its
# 256-row launches (_jit.GEMM_WG_K5_FULL_ROWS; see the table's notes)
_WG_K5_LARGE_MAX = 1024
# and on "mid" layers, where its slab chunks fill the wave (_mid_slab_chunks_fill)
_WG_K5_MID_MAX = 1024
DISPATCH_TABLE: tuple[DispatchRule, ...] = (
    # sm_90: mma, then wgmma, then dequantize + cuBLAS
    DispatchRule(True, "large", 8, _WG_LARGE_MAX, ks=(2,), fp16=False, max_weights=1 << 26, lat_max=2,
                 min_tbps=_FAST_TBPS),
    DispatchRule(True, "large", 16, _WG_LARGE_MAX, ks=(2, 3), max_weights=1 << 26, lat_max=2,
                 min_tbps=_FAST_TBPS),
    DispatchRule(True, "large", 8, _WG_LARGE_MAX, ks=(2,), fp16=False, max_weights=_HUGE, lat_max=1,
                 min_tbps=_FAST_TBPS),
    DispatchRule(True, "large", 16, _WG_LARGE_MAX, ks=(2,), fp16=True, max_weights=1 << 26, lat_max=2),
    DispatchRule(True, "large", 8, _WG_LARGE_MAX, ks=(2,), fp16=True, max_weights=_HUGE, lat_max=1),
    DispatchRule(True, "large", 8, _WG_LARGE_MAX, ks=(4,), min_weights=_HUGE, min_tbps=_FAST_TBPS),
    DispatchRule(True, "large", 8, _WG_LARGE_MAX, ks=(4,), min_weights=1 << 26, min_tbps=_FAST_TBPS),
    DispatchRule(True, "large", 8, _WG_LARGE_MAX, ks=(4,), min_weights=1 << 28),
    DispatchRule(True, "large", 8, _WG_LARGE_MAX, ks=(2,), min_weights=_HUGE),
    DispatchRule(True, "large", 8, _WG_LARGE_MAX, ks=(2,), fp16=False),
    DispatchRule(True, "large", 16, _WG_LARGE_MAX, ks=(3, 4), min_weights=_HUGE),
    DispatchRule(True, "large", 8, _WG_K5_LARGE_MAX, ks=(5,), min_tbps=_FAST_TBPS),
    DispatchRule(True, "large", 16, 256, ks=(5,), max_weights=_HUGE),
    DispatchRule(True, "large", 16, 512, ks=(5,)),
    DispatchRule(True, "large", 16, _WG_LARGE_MAX),
    DispatchRule(True, "mid", 16, _WG_MID_MAX, ks=(2,), min_weights=1 << 26, lat_max=2, min_tbps=_FAST_TBPS),
    DispatchRule(True, "mid", 16, _WG_MID_MAX, ks=(3,), min_weights=1 << 26, min_tbps=_FAST_TBPS),
    DispatchRule(True, "mid", 16, _WG_MID_MAX, ks=(2, 3), min_weights=1 << 25, lat_max=2,
                 min_tbps=_FAST_TBPS),
    DispatchRule(True, "mid", 16, _WG_MID_MAX, ks=(4,), min_weights=1 << 25, min_tbps=_FAST_TBPS),
    DispatchRule(True, "mid", 64, _WG_MID_MAX, ks=(2,), lat_max=8),
    DispatchRule(True, "mid", 32, _WG_K5_MID_MAX, ks=(5,), max_weights=_MID_LATENCY, lat_max=8,
                 min_tbps=_FAST_TBPS),
    DispatchRule(True, "mid", 32, _WG_K5_MID_MAX, ks=(5,), max_weights=1 << 25, lat_max=4,
                 min_tbps=_FAST_TBPS),
    DispatchRule(True, "mid", 0, _WG_K5_MID_MAX, ks=(5,), min_tbps=_FAST_TBPS),
    DispatchRule(True, "mid", 32, 256, ks=(5,), max_weights=_MID_LATENCY, lat_max=8),
    DispatchRule(True, "mid", 32, 256, ks=(5,), max_weights=1 << 25, lat_max=4),
    DispatchRule(True, "mid", 32, 256, ks=(5,)),
    DispatchRule(True, "mid", 64, _WG_MID_MAX, max_weights=_MID_LATENCY, lat_max=8),
    DispatchRule(True, "mid", 64, _WG_MID_MAX, ks=(3,), fp16=True, lat_max=4),
    DispatchRule(True, "mid", 64, _WG_MID_MAX),
    DispatchRule(True, "small", 16, 256, max_weights=1 << 22, lat_max=16),
    DispatchRule(True, "small", 64, 128, max_weights=1 << 23, lat_max=16, cl_max=64),
    DispatchRule(True, "small", 64, 64, lat_max=16, cl_max=64),  # (not measured since the above)
    # other GPUs: mma, then dequantize + cuBLAS
    DispatchRule(False, "widest", 192, 0),
    DispatchRule(False, "large", 128, 0),
    DispatchRule(False, "mid", 128, 0),
    DispatchRule(False, "small", 64, 0),
)


def _layer_class(N: int, K_dim: int, k: int, wgmma: bool) -> str:
    """The dispatch table's layer class (sm_90 has no "widest": it is "large")."""
    if not wgmma and (N >= 16384 or (K_dim >= 16384 and k <= 4)):
        return "widest"
    if N >= 16384 or K_dim >= 8192:
        return "large"
    return "mid" if N * K_dim >= 1 << 24 else "small"


@functools.cache
def _dispatch(N: int, K_dim: int, k: int, fp16: bool, wgmma: bool,
              tbps: float = 0.0) -> tuple[int, int, int, int]:
    """(lat_max, cl_max, mma_max, wg_max) from the first DISPATCH_TABLE row that
    matches (``tbps``: the GPU's peak memory bandwidth, TB/s)."""
    layer, weights = _layer_class(N, K_dim, k, wgmma), N * K_dim
    for rule in DISPATCH_TABLE:
        if (rule.wgmma == wgmma and rule.layer == layer and tbps >= rule.min_tbps
                and (rule.ks is None or k in rule.ks)
                and (rule.fp16 is None or rule.fp16 == fp16)
                and weights >= rule.min_weights
                and (rule.max_weights is None or weights < rule.max_weights)):
            return rule.lat_max, rule.cl_max, rule.mma_max, rule.wg_max
    raise AssertionError(f"no dispatch rule for {N}x{K_dim} k={k}")  # the table covers all


def choose_kernel(M: int, N: int, K_dim: int, k: int, dtype, wgmma: bool | None = None,
                  tbps: float | None = None, sms: int | None = None, scale: str = "uint8") -> str:
    """The kernel ``kernel="auto"`` runs for these sizes ("latency", "cluster",
    "mma", "wgmma", "lut" or "dequant"), from ``DISPATCH_TABLE`` and
    ``_lut_wins``. (A "cluster" pick runs mma where the GPU or its driver
    cannot launch clusters, a "latency" pick mma where its launch would not
    fit in one wave on the GPU: _latency_one_wave.) ``scale``: the weight's
    absmax dtype name.

    ``wgmma``: whether the GPU runs the wgmma kernel (sm_90); None asks the
    current device (False without a GPU). ``tbps``: the GPU's peak memory
    bandwidth in TB/s; None asks the current device (0 without a GPU, which
    takes the rows that need no bandwidth). ``sms``: the GPU's SM count;
    None asks the current device (132 without a GPU).
    """
    if wgmma is None:
        wgmma = _device_has_wgmma()
    if tbps is None:
        tbps = _device_tbps()
    if _lut_wins(M, N, K_dim, k, scale, bool(wgmma), float(tbps),
                 _device_sms() if sms is None else sms):
        return "lut"
    lat_max, cl_max, mma_max, wg_max = _dispatch(N, K_dim, k, _is_fp16(dtype), bool(wgmma),
                                                 float(tbps))
    # The latency kernel only in one launch: it stages whole rows of A, so
    # long rows take fewer per launch, and two launches cost twice one (H100,
    # 5120x5120 k=2 bf16 at M = 8, 6 rows per launch: 22.5 us against mma's
    # 11.7; M = 4: 10.1 against 11.5).
    if M <= lat_max and M <= _latency_rows(K_dim, 2):  # A is fp16 or bf16: 2 bytes
        return "latency"
    if M <= cl_max:
        return "cluster"
    if (M > 256 and M <= wg_max and _layer_class(N, K_dim, k, bool(wgmma)) == "mid"
            and not _mid_slab_chunks_fill(M, N, _device_sms() if sms is None else sms)):
        return "dequant"
    return "mma" if M <= mma_max else "wgmma" if M <= wg_max else "dequant"


# gemm_lut.cu (kernel="lut") where "auto" takes it: k = 2, one row of A, E4M4
# scales, on sm_90 GPUs of at least _FAST_TBPS, layers of at least
# _LUT_MIN_N rows and _LUT_MIN_WEIGHTS weights. H200, kernel-only, one
# process, against mma and the latency kernel (results/lut_h200_2135dd2_*.md,
# fp16 / bf16 within 0.7% of each other): 8192x57344 47.3 us against 62.4
# (mma), 4096x28672 17.7 against 21.3 (latency), 14336x4096 11.8 against 12.6
# (latency), 28672x8192 29.6 against 34.7 (mma). Each CTA builds its tables
# for a row block of 1024 rows, so not below 4096 rows; not below 2^25 weights
# (not measured there). Not measured on the H100 (3.35 TB/s), where the mma
# kernel is nearer the read.
_LUT_MIN_N = 4096
_LUT_MIN_WEIGHTS = 1 << 25
# The lookups' weight loads take the mma kernels' L2 evict_first policy
# (gemm_lut.cu L2_HINT) from this many rows: H200, fp16, one process
# (results/define_ab_h200_lut_loads_8a7b051.txt): 8192x57344 49.02 -> 47.24 us,
# 4096x28672 18.61 -> 17.94, 28672x8192 30.76 -> 29.91, but 14336x4096 11.73
# -> 12.34 (4096 rows). The same bits either way.
_LUT_L2_HINT_MIN_N = 8192


# ... and only where its units (1024 rows by 256 columns each, whole units a
# CTA, two CTAs an SM) fill at least this share of the CTAs' unit slots over
# the launch (_lut_fill). H200, fp16, one process
# (results/lut_range_h200_c73e850_float16.md): 5120x13824 (280 units on 264
# CTAs: two rounds, fill 0.53) 16.85 us against mma's 15.65, 13824x5120 (270,
# 0.51) 17.47 against the latency kernel's 15.59, 8192x4096 (128, 0.48) 9.15
# against 8.84; the four layers above fill 0.85-0.97 and 16384x16384 (0.97)
# 29.5 against 37.9. 4096x8192 (128 units, 0.48) is the one loss of the rule:
# 8.59 against the latency kernel's 8.90. It was 0.8 until 4096x11008 (176
# units, fill 0.67) ran 10.28 us against the latency kernel's 10.83-10.91
# (fp16 and bf16; results/dispatch_audit2_h200_97c1a1e_*), so 0.6.
_LUT_MIN_FILL = 0.6
_LUT_CTAS_PER_SM = 2  # gemm_lut.cu's __launch_bounds__ (65 KB of tables a CTA)


def _lut_fill(N: int, K_dim: int, sms: int) -> float:
    """The share of gemm_lut.cu's CTA unit slots that hold a unit: units over
    (rounds x CTAs), a CTA taking whole units (ceil(units / CTAs) rounds)."""
    units = lut_units(N, K_dim)[1]
    slots = _LUT_CTAS_PER_SM * sms
    return units / (math.ceil(units / slots) * slots)


def _lut_wins(M: int, N: int, K_dim: int, k: int, scale: str, wgmma: bool, tbps: float,
              sms: int) -> bool:
    return (M == 1 and k == 2 and scale == "uint8" and wgmma and tbps >= _FAST_TBPS
            and N >= _LUT_MIN_N and N * K_dim >= _LUT_MIN_WEIGHTS
            and _lut_fill(N, K_dim, sms) >= _LUT_MIN_FILL)


# The last wave's fill from which a mid layer's slab chunks beat dequantize +
# cuBLAS past one wave (see _mid_slab_chunks_fill)
_MID_CHUNKS_MIN_FILL = 0.9


def _mid_slab_chunks_fill(M: int, N: int, sms: int) -> bool:
    """Whether wgmma's slab chunks (256 rows, two warpgroups of 64 rows of W
    a CTA, one CTA an SM) run ``M`` rows of a "mid" layer of N rows faster
    than dequantize + cuBLAS: where they are taken (_wg_slab_chunks: else
    launches of 256 rows and the rest, which lost) and their CTAs fit one
    wave on ``sms`` SMs or fill the
    last wave to _MID_CHUNKS_MIN_FILL. Against dequantize + cuBLAS
    (results/large_m_h{100,200}_slab_chunks_mid_ef571d2_float16.md, k = 2
    and 4, 4096x4096, 4096x6144, 5120x5120, 6144x4096 at 448..4096 rows):
    one wave 0.75-0.97x its time, fill 0.91-0.97 0.78-1.01x, fill 0.55-0.87
    1.03-1.30x, launches 1.28-1.81x. (k = 2 with fp16 scales chunks 192 rows:
    counted as 256 here.)"""
    rows = 256
    if not _wg_slab_chunks(M, rows):
        return False
    ctas = math.ceil(M / rows) * math.ceil(_tile_counts(N, K_PER_TILE)[0] / 8)
    return ctas <= sms or ctas / (math.ceil(ctas / sms) * sms) >= _MID_CHUNKS_MIN_FILL


def _is_fp16(dtype) -> bool:
    try:
        return np.dtype(dtype) == np.float16
    except TypeError:  # a name NumPy does not know (bfloat16 without ml_dtypes)
        return str(dtype) == "float16"


def _device_has_wgmma() -> bool:
    try:
        return has_wgmma()
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: the question is moot
        return False


def device_tbps() -> float:
    """The current GPU's peak memory bandwidth in TB/s, from its properties:
    memory clock (kHz) x bus width (bits) x 2 (double data rate) / 8. H100 SXM
    3.35, H200 4.8. 0.0 where the GPU does not report them."""
    attrs = _attributes()
    clock_khz = int(attrs.get("MemoryClockRate", 0) or 0)
    bus_bits = int(attrs.get("GlobalMemoryBusWidth", 0) or 0)
    return round(clock_khz * 1e3 * bus_bits / 8 * 2 / 1e12, 2)


def _device_tbps() -> float:
    try:
        return device_tbps()
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: the rows that need no bandwidth
        return 0.0


def _device_sms() -> int:
    try:
        return _sm_count()
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: the H100's and the H200's
        return 132


_resident_cache: dict[tuple[object, int, int], int] = {}  # (kernel, threads, dynamic shared) -> CTAs per SM
# gemm_mma.cu's parameters that change per call: A, C and A's tensor map
_ARG_A, _ARG_C, _ARG_MAP = 3, 4, 20
_GEMM_ARG_TYPES = (
    (_launch.POINTER,) * 5 + (_launch.INT32,) * 8 + (_launch.POINTER,) * 3 + (_launch.INT32,)
    + (_launch.POINTER, _launch.INT32) + (_launch.POINTER,) * 2)


def _counters(n: int, stream: int | None = None):
    """Zeroed int32 arrival counters for split K, one buffer per (device, stream).

    The kernel's last arriving warp resets its counter, so the buffer is zero
    again when the launch ends and the next launch on the same stream (which
    runs after it) reuses it without a memset. Other streams get their own.
    ``stream``: the stream's handle (default: the current stream's).
    """
    stream = _launch.current_stream_ptr() if stream is None else stream
    buf = _launch.stream_buffer("counters", 4 * max(n, 4096), stream, zeroed=True)
    return buf.view(np.int32)


def _workspace(nfloats: int, stream: int):
    """fp32 partials of split groups, shared by the launches of one stream."""
    return _launch.stream_buffer("gemm_partials", 4 * nfloats, stream).view(np.float32)


_STREAM_K_SLACK = 0.5  # tiles a stream-K CTA pays for ending segments (in the load model)
# The same for the slab-staged wgmma launches (129..256 rows; the producer
# warpgroup: threads > warps * 32) on the "large" layers, whose stream-K
# CTAs each store and add partial tiles of 128 KB. Against 0.5, in one
# process (H100, k = 2 and 4, fp16, 160 / 192 / 256 rows;
# results/define_ab_h100_slab_slack_old_a7ba857+.txt): whole groups in
# two waves instead of stream-K on 4096x28672 0.956-1.016x the time (1.016:
# k = 2 at 192 rows), split K in two on 28672x8192 0.964-0.980x, 8192x57344
# unchanged (stream-K either way); on 4096x6144 (mid) split K in two lost
# 2.5-6.7% to stream-K, so not there.
_SLAB_STREAM_K_SLACK = 8.0
# The same for the 8-warp mma.sync launch (k = 2 and 4 at one n8 tile on the
# large layers, gemm._mma_warps). Against 0.5, in one process, kernel auto:
# 4096x28672 at k = 4, M = 1..8, runs whole groups (224 CTAs of 16 K tiles,
# no partial tiles) instead of stream-K (264 CTAs of 13.6 units): H100 28.4
# against 30.9 us (7-8% less time), H200 within 1% either way; every other
# layer measured keeps its split (results/define_ab_h{100,200}_wide_slack_3d86fe6.txt,
# define_ab_h100_stream_k_slack*_983e7f6.txt). 2 for every launch instead lost
# 3-12% elsewhere (4096x14336 at M = 16, 4096x6144 at M = 64, k = 5 on 8192x57344).
_WIDE_STREAM_K_SLACK = 2.0
# k = 4's 8-warp mma.sync launch (two CTAs an SM): x 100 of the exponent by
# which _work_split charges split K per tile where it leaves an SM one CTA
# (0: not charged), on a GPU of _FAST_TBPS or more (_underfill_charge). Split K
# otherwise took 128 CTAs of 11 K tiles on 11008x4096 (one an SM) over 256
# of 6; with the charge (x 2^0.25), 256. In one process on the H200 against
# no charge (results/define_ab_h200_k4_underfill_0b8e874_{float16,bfloat16}.txt,
# k = 4, M = 1 / 4 / 8, mma and auto): 1.06-1.10x faster on 11008x4096 and
# 8192x5120, 1.09-1.13x on 11008x5120, 14336x5120, 17408x4096 and
# 18944x4096, 1.14-1.21x on 27648x4096, 13824x8192, 18944x8192, 22016x8192
# and 29568x5120, 1.03-1.04x on 22016x2048, 0.99-1.01x on 13824x2048; the
# layers whose split it leaves (14336x4096, 28672x8192) gave the same bits
# and times. Charged for every launch (0b8850e's knob,
# define_ab_h200_underfill_0b8850e.txt) it lost up to 15% elsewhere
# (4-warp launches on 4096x6144 and 5120x5120, k = 2's 8-warp launch on
# 14336x4096 and 13824x5120), so k = 4's 8-warp launch only. Not measured
# on the H100, whose stamps of this launch suggest the same (a lone CTA on
# an SM ran 16 K tiles in 22 us, two together 32 in 25: NOTES-gemm.md,
# "Per CTA, whole groups"): 0 there until measured.
_K4_WIDE_UNDERFILL_PCT = 25
# The same for k = 2's 8-warp launch where the lone CTA would run
# _K2_UNDERFILL_TILES K tiles or more. In one process against no charge
# (results/define_ab_h200_k2_underfill_f8a1cb0.txt, H200, fp16, M = 1..8,
# mma and auto): lone CTAs of 17..29 K tiles split further ran 1.12-1.19x
# faster (17408x4096, 18944x4096, 29568x4096: one row tile a warp),
# 1.08-1.11x (13824x14336) and 1.03-1.05x (18944x8192: two row tiles a warp);
# of 7..11 tiles 0.95-0.99x (13824x5120, 11008x8192, 13824x2048,
# 22016x2048), but 11008x4096 1.02-1.03x.
_K2_WIDE_UNDERFILL_PCT = 25
_K2_UNDERFILL_TILES = 16


def _underfill_charge(wg: bool, warps: int, k: int) -> float:
    """_work_split's ``underfill`` exponent for a dense launch (see
    _K4_WIDE_UNDERFILL_PCT): k = 4's 8-warp mma.sync launch (and k = 2's,
    _K2_WIDE_UNDERFILL_PCT, where _underfill_tiles says) on a GPU of
    _FAST_TBPS or more, else 0."""
    pct = {4: _K4_WIDE_UNDERFILL_PCT, 2: _K2_WIDE_UNDERFILL_PCT}.get(k, 0)
    if wg or warps != 8 or not pct or _device_tbps() < _FAST_TBPS:
        return 0.0
    return pct / 100


def _underfill_tiles(k: int) -> int:
    """_work_split's ``underfill_tiles`` for the launch _underfill_charge charges."""
    return _K2_UNDERFILL_TILES if k == 2 else 0


@functools.cache  # pure
def _work_split(groups: int, k_tiles: int, slots: int, sms: int,
                max_splits: int = 0, split_only: bool = False,
                slack: float | None = None, underfill: float = 0.0,
                underfill_tiles: int = 0) -> tuple[int, int, int]:
    """(units per group, CTAs, splits) for gemm_mma.cu's work split (splits: 0
    for stream-K; split K into at most ``max_splits`` segments where given;
    ``split_only``: never stream-K, for M chunks, whose CTAs must each hold
    one segment of one chunk's group).

    Split K: every group's K tiles in ``s`` whole segments of ``per`` tiles,
    one CTA each (units per group padded to ``s * per`` so that each CTA's
    range is one segment). Stream-K: ``groups * k_tiles`` units cut evenly
    over ``slots`` CTAs (``slots``: CTAs resident at once on ``sms`` SMs);
    most CTAs end two segments and store partial tiles. The choice minimises
    the tiles the busiest SM runs: CTAs per SM x tiles per CTA (plus
    ``slack``, default _STREAM_K_SLACK, per stream-K CTA); ties go to more CTAs. Measured on
    the H100 against waves x tiles per CTA (d9006df): 14336x4096 M=1 +7%,
    4096x6144 +4..10%, 28672x8192 -2..+1%. ``underfill`` (_underfill_charge):
    where split K leaves every SM at most one CTA of the ``slots // sms`` it
    holds, and that CTA ``underfill_tiles`` K tiles or more, its tiles count
    ``(slots // sms) ** underfill`` times.
    """
    units = groups * k_tiles
    ctas = min(units, slots)
    per_sm = max(1, slots // sms)
    best = None
    for s in range(1, max(1, min(k_tiles, slots // groups, max_splits or k_tiles)) + 1):
        per = math.ceil(k_tiles / s)
        s_used = math.ceil(k_tiles / per)
        on_sm = math.ceil(groups * s_used / sms)  # CTAs on the busiest SM
        load = on_sm * per
        if underfill and on_sm == 1 < per_sm and per >= underfill_tiles:
            # an SM left with one CTA of the per_sm it holds moves fewer bytes
            # a microsecond: its tiles count per_sm ^ underfill times
            load = load * per_sm ** underfill
        key = (load, -s_used)
        if best is None or key < best[0]:
            best = (key, s_used, per)
    (split_load, _), s, per = best
    slack = _STREAM_K_SLACK if slack is None else slack
    stream_load = math.ceil(ctas / sms) * (math.ceil(units / ctas) + slack)
    if stream_load < split_load and not split_only:
        return k_tiles, ctas, 0
    return s * per, groups * s, s


# k = 4's 8-warp mma launch with A's K tiles in a ring of mbarrier-handed
# stages (gemm_mma.cu RING, _jit.GEMM_MMA_RING_STAGES) at up to this many rows
# (0: never). H200, kernel auto, in one process against two stages, the same
# bits. With 8 stages, as taken (results/define_ab_h200_k4_ring8_off_d542949*.txt),
# new speed over old at 1 / 2 rows, fp16 and bf16: 8192x57344 1.04 / 1.03x,
# 28672x8192 1.04 / 1.03x, 4096x28672 1.035 / 1.02-1.03x, 14336x4096
# 1.06x. Rows: 8 stages at up to 4 rows against up to 2, as above
# (define_ab_h200_k4_ring8_rows_25a51c1_*.txt), at 3 / 4 rows: 8192x57344
# 1.017x, 28672x8192 1.021 / 1.014x, 4096x28672 1.017-1.019 / 1.008x,
# 14336x4096 1.054-1.056 / 1.045-1.048x, fp16 and bf16; up to 8 rows lost
# 0.8-1.7% at 6 and 8 rows on the three widest (won 4.6-5.1% on 14336x4096),
# so 4. Layers with fewer K tiles a CTA (_RING_MIN_TILES_PER_CTA; 4096x6144,
# 8192x2048) keep two stages (the ring on every launch lost 8% on 4096x6144:
# define_ab_h200_a_ring_auto_8278b35.txt). Not measured on the H100
# (_RING_MIN_TBPS below).
_K4_RING_MAX_M = 4
# k = 5's 16-warp launch (one CTA an SM) has a ring of 4 stages of its own; at
# up to this many rows (0: never) it takes the ring variant's 8 instead where
# a CTA has _RING_MIN_TILES_PER_CTA K tiles or more. Off: H200, kernel auto,
# in one process, 8 stages against 4, M = 1 / 4 / 8: built with
# -DKBIT_A_RING=8 (define_ab_h200_k5_ring8_25a51c1.txt) 8192x57344 1.014 /
# 1.014 / 1.020x, 28672x8192 1.016-1.021x, 4096x28672 1.008-1.014x,
# 14336x4096 1.015-1.021x; as this variant, twice, 8192x57344 0.987-0.995x
# (define_ab_h200_rows_old_50eb206.txt) and 0.993-0.996x
# (define_ab_h200_k5_ring8_again_50eb206.txt, the same variant twice within
# 0.4%), the others 0.99-1.01x: no gain that holds.
_K5_RING_MAX_M = 0
# k = 2's 8-warp launch (its 64 KB byte table, one or two row tiles a warp)
# with the same ring at up to this many rows (0: never). Four full stages
# beside the byte table cost a CTA an SM (three to two,
# define_ab_h200_a_ring_auto_8278b35.txt); with compact stages (gemm_mma.cu
# KBIT_A_COMPACT, _jit.GEMM_MMA_A_COMPACT: 2 rows a stage) it keeps three,
# but lost all the same (define_ab_h200_k2_ring_{auto,mma}_25a51c1.txt, M = 1
# / 2, kernel auto: 8192x57344 0.986-0.988x, 28672x8192 0.972-0.986x,
# 14336x4096 0.945-0.95 / 0.999x; full stages the same within 1%). Compact
# stages on k = 4's ring: 0.994-1.010x (define_ab_h200_compact_ring_k4_25a51c1.txt).
_K2_RING_MAX_M = 0
# ... and only with at least this many K tiles a CTA (units over the CTAs an
# SM holds: two of 8 warps, one of 16)
_RING_MIN_TILES_PER_CTA = 6
# ... and only on a GPU of this peak bandwidth (TB/s, _device_tbps) or more:
# measured on the H200 alone, so the H100 keeps two stages (k = 5: four) until
# knob_first_run.sh ring-h100 (gemm._RING_MIN_TBPS=0 there) says otherwise
_RING_MIN_TBPS = _FAST_TBPS


def _mma_ring(k: int, scale_dtype, M: int, warps: int, per_warp: int, units: int) -> int:
    """The RING template argument of the dense mma.sync launch (0: none; k =
    5's 16-warp launch then has its own ring of 4): k = 4's 8-warp launch at
    up to _K4_RING_MAX_M rows (k = 5's 16-warp launch at up to _K5_RING_MAX_M,
    k = 2's 8-warp launch, one or two row tiles a warp, at up to
    _K2_RING_MAX_M: both off) with ``units`` (groups x K tiles) of at least
    _RING_MIN_TILES_PER_CTA per CTA (two CTAs an SM of 8 warps, one of 16),
    on a GPU of _RING_MIN_TBPS or more."""
    if k == 5 and warps == 16:
        ok = M <= _K5_RING_MAX_M and units >= _RING_MIN_TILES_PER_CTA * _sm_count()
    else:
        max_m = {2: _K2_RING_MAX_M, 4: _K4_RING_MAX_M}.get(k, 0)
        ok = (warps == 8 and (per_warp == 1 or k == 2) and M <= max_m
              and units >= _RING_MIN_TILES_PER_CTA * 2 * _sm_count()
              and (M <= _jit.GEMM_MMA_COMPACT_ROWS or not _jit.GEMM_MMA_A_COMPACT))
    ok = ok and np.dtype(scale_dtype) == np.uint8 and _device_tbps() >= _RING_MIN_TBPS
    return _jit.GEMM_MMA_RING_STAGES if ok else 0


def _mma_warps(k: int, scale_dtype, M: int, per_warp: int, N: int, K_dim: int) -> int:
    """Warps per CTA of the dense mma.sync launch: 8 (two CTAs per SM, one pair
    table for 8 warps) for k = 4 with E4M4 scales at one n8 tile on the large
    layers of an sm_90 GPU, else 4. Kernel-only, in one process against 4 warps
    (results/define_ab_h{100,200}_mma_warps_*_a4fd5c1.txt, fp16 and bf16, M = 1,
    4, 8): H200 8192x57344 +1..6%, 4096x28672 +3..6%, 14336x4096 +2..6.5%; H100
    0..+4% (14336x4096 at M = 1 -0.4%); on 5120x5120 and 4096x6144 4-14% slower
    on both, and k = 3 loses on 4096x28672: not taken there. Not measured
    without wgmma (sm_80): 4.

    k = 2 the same with its byte table (_jit.GEMM_K2_QUAD_TABLE) where K_dim >=
    _K2_WIDE_MIN_K_DIM: at M = 1..8 against 4 warps without the table
    (define_ab_h{100,200}_k2_wide_mma_quad_b424263.txt) H100 8192x57344 2-5%,
    14336x4096 5-6% less time, H200 those 3-7.5% and 28672x8192 1-4%; on
    4096x28672 (16 K tiles) 2-4.5% more on both.

    k = 5: 16 warps (one CTA per SM, its 128 KB pair table) at one and two n8
    tiles on the large layers where _K5_TABLE says (at one only from
    _FAST_TBPS). k = 3: 8 warps from _K3_WIDE_MIN_M rows where K_dim >=
    _K2_WIDE_MIN_K_DIM (see there). ``M``: rows of A."""
    m_tiles = -(-M // 8)  # n8 tiles (only 1 and 2 are asked about: _jit.GEMM_M_TILES)
    if not (_WIDE_WARPS and np.dtype(scale_dtype) == np.uint8 and per_warp == 1):
        return _WARPS
    if k == 5:
        large = m_tiles <= 2 and has_wgmma() and _layer_class(N, K_dim, k, True) == "large"
        fast = m_tiles == 2 or _device_tbps() >= _FAST_TBPS
        return 16 if _K5_TABLE and large and fast else _WARPS
    if m_tiles != 1:
        return _WARPS
    if k == 2 and not (_jit.GEMM_K2_QUAD_TABLE and K_dim >= _K2_WIDE_MIN_K_DIM):
        return _WARPS
    if k == 3 and not (M >= _K3_WIDE_MIN_M and K_dim >= _K2_WIDE_MIN_K_DIM):
        return _WARPS
    if has_wgmma() and _layer_class(N, K_dim, k, True) == "large":
        return _WIDE_WARPS
    return _WARPS


_K2_WIDE_MIN_K_DIM = 8192  # k = 2's 8-warp launch from this K_dim (see _mma_warps)


def _k2_two_row_tiles(k: int, m_tiles: int, warps: int, rt_n: int) -> bool:
    """Whether k = 2's 8-warp launch (one n8 tile) takes two row tiles a warp:
    twice the index bytes in flight per SM (k = 2's tile is 1 KB, 16 KB a CTA
    at one row tile), where there are row tiles for it (rt_n >= 2 x the SMs).
    Against one row tile, in one process (results/define_ab_h{200,100}_k2_rpw2_f89e41d.txt,
    M = 1 / 4 / 8): H200 8192x57344 1.6 / 4.3 / 5.9% and 28672x8192 (512 row
    tiles) 3.7 / 4.9 / 7.0% less time, H100 -0.3 / 0.9 / 4.9% and 3.2 / 3.9 /
    6.9%; 14336x4096 (256 row tiles) 12-13% more on both, 4096x28672 (4 warps)
    7-10% more on the H200."""
    return bool(_K2_RPW2 and k == 2 and m_tiles == 1 and warps == 8 and rt_n >= 2 * _sm_count())


_K2_RPW2 = 1  # k = 2's two row tiles a warp where _k2_two_row_tiles says (0: never, A/B runs)
# k = 3 the same (its 8 KB pair table for 8 warps) from this many rows (65:
# never). H200 against 4 warps at M = 1 / 4 / 8 (define_ab_h200_k35_wide_mma_2355ab4.txt):
# 8192x57344 -1.1 / +1.0 / +3.6%, 28672x8192 -1.4 / +0.8 / +1.7%, 14336x4096
# +2.6..3.0%; again at M = 1 / 2 / 4, kernel auto, fp16 and bf16
# (define_ab_h200_k3_wide_ring_25a51c1_*.txt): 8192x57344 0.98 / 0.99 /
# 1.01-1.02x, 28672x8192 0.985-0.987 / 0.994-0.997 / 1.007-1.012x,
# 14336x4096 0.999-1.01 / 1.006-1.012 / 1.034-1.038x (4096x28672: 4 warps,
# K_dim < _K2_WIDE_MIN_K_DIM). H100, 8 warps against 4 at a4fd5c1
# (define_ab_h100_mma_warps_*_a4fd5c1.txt): M = 4 / 8 8192x57344 1.008 /
# 1.013x, 14336x4096 1.016 / 1.028x. So from 3 rows. (Its ring of A's stages
# lost 4-6% on the two largest at 1..2 rows, 3 CTAs an SM at 80 registers:
# the same files' column gemm._K3_WIDE=1, the knob before this one; not kept.)
_K3_WIDE_MIN_M = 3
# k = 5 on 16 warps at up to two n8 tiles on the large layers, one CTA per
# SM, with its 128 KB pair table (gemm_mma.cu kBigPairTable) instead of two
# shuffles a pair (0: 4 warps, the shuffles; for A/B runs). Against 4 warps,
# in one process (results/define_ab_h200_k5_table_mma_475f501.txt,
# define_ab_h100_k5_table_off_190c1d2.txt): H200 5-23% less time at M = 1..16
# on four large layers; H100 M = 16 2.5-9% less, but M = 1 1.6-4% more (its
# k = 5 reads at about 90% of the read ceiling there either way), so at one
# n8 tile only on a GPU of _FAST_TBPS or more.
_K5_TABLE = 1


def _wg_warpgroups(m_tiles: int, k: int, rt_n: int, kt_n: int, scale: str = "uint8") -> int:
    """Warpgroups per CTA of the Hopper path: as many as the registers allow
    (_jit.gemm_wg_warpgroups), or one where that many leave SMs without a
    (group, K tile) unit, at _jit.GEMM_WG_FILL_M_TILES n8 tiles (_WG_FILL).
    A CTA's warpgroups share one group of row tiles, so on 2048x768 (48 row
    tiles, 8 K tiles) four warpgroups make 24 units and one makes 96."""
    wgs = _jit.gemm_wg_warpgroups(m_tiles, k, scale)
    if (_WG_FILL and m_tiles in _jit.GEMM_WG_FILL_M_TILES
            and math.ceil(rt_n / (4 * wgs)) * kt_n < _sm_count()):
        return 1
    return wgs


_WG_FILL = 1  # _wg_warpgroups' step down to one warpgroup (0: never, A/B runs)
# Split K of the Hopper path in thread-block clusters (gemm_mma.cu, "Split K in
# clusters") where the launch allows it (0: the workspace, A/B runs).
_WG_CLUSTER = 1


def _wg_cluster_capable(wg: bool, wgs: int, threads: int) -> bool:
    """Whether a Hopper-path launch can split K in clusters: one warpgroup a
    CTA (no slab staging), on a GPU and driver that launch clusters. Its
    split K then takes at most _jit.GEMM_MAX_CLUSTER_SPLITS segments (also
    with _WG_CLUSTER off, so that A/B runs compare the same split)."""
    return wg and wgs == 1 and threads == 128 and _launch.cluster_launch_supported()


def _wg_cluster_splits(wg: bool, wgs: int, splits: int, threads: int) -> int:
    """CTAs per cluster of a Hopper-path launch (the group's splits along
    grid y), or 0 for the workspace reduction (or no split): split K into
    2..8 segments (_jit.GEMM_MAX_CLUSTER_SPLITS) where _wg_cluster_capable."""
    if not (_WG_CLUSTER and 1 < splits <= _jit.GEMM_MAX_CLUSTER_SPLITS):
        return 0
    return splits if _wg_cluster_capable(wg, wgs, threads) else 0


# M chunks of the Hopper path (gemm_mma.cu, "M chunks"): on a small layer,
# 65..256 rows run as 2..4 chunks of 64 rows (32 on short layers at 65..128
# rows: _wg_chunk_m_tiles) along grid z, in one launch at
# one warpgroup a CTA with split K in clusters, instead of one 128-row launch
# (or, past 128 rows, dequantize + cuBLAS). 0: never (A/B runs).
_WG_M_CHUNKS = 1
_WG_CHUNK_M_TILES = 8  # n8 tiles of a chunk
# At 65..128 rows only from this k: k = 2 and 3 (no shared-memory table at
# one warpgroup; cheap decode) lose 1-6.6% in chunks against one 128-row
# launch on 2048x768 and 2048x512 at 96..128 rows on the H100 (2-3% on the
# H200), win up to 5% on 768x2048; k = 4 (its PRMT table fits beside 64-row
# stages only) wins 5-9% everywhere, k = 5 0..10%
# (results/define_ab_h{100,200}_m_chunks_*). Beyond 128 rows chunks win at
# every k (one launch against two, or dequantize + cuBLAS).
_WG_CHUNKS_TO_128_MIN_K = 4
_WG_MAX_CHUNKS = 4
# Past the slab-staged variant's rows (256; 192 at k = 5 and k = 2 with fp16
# scales), one launch of that many rows a chunk along grid z, each CTA whole
# groups of one chunk (split K only where the chunks' groups leave SMs idle),
# instead of one launch per 256 rows, each split by stream-K. 0: the launches
# (A/B runs).
_WG_SLAB_CHUNKS = 1


def _wg_slab_chunks(M: int, rows: int) -> bool:
    """Whether ``M`` rows run as one launch of ``rows``-row slab-staged chunks
    (_WG_SLAB_CHUNKS): past ``rows`` rows where the last chunk is more than
    half full; else launches of ``rows`` rows and the rest (384 rows as 256 +
    128, not two chunks of 256). Taking them also where all the chunks'
    groups fit one wave was measured on the mid layers (H100, k = 2 and 4,
    results/large_m_h100_onewave_experiment_*): against dequantize + cuBLAS
    it won at 320..384 rows on 4096x6144 (0.85-0.93x its time) but lost at
    260..384 on 4096x4096 and 5120x5120 (up to 1.5x) and was not measured on
    the large layers (14336x4096: 64 group-chunks at 257..384 rows): not kept."""
    return bool(_WG_SLAB_CHUNKS) and M > rows and (M % rows == 0 or M % rows > rows // 2)
# Layers of at most _WG_SHORT_K_TILES K tiles (768x2048: three) at 65..128
# rows, where their 32-row chunks' groups fit one CTA per SM: chunks of
# _WG_SHORT_K_CHUNK_M_TILES n8 tiles (32 rows), at every k, instead of 64-row
# chunks (or, k = 2 and 3, one 128-row launch). With three K tiles the split K
# of 64-row chunks is 2 + 1 tiles; 32-row chunks give twice the group-chunks
# at half the rows, and two CTAs per SM (k = 4: 113 KB instead of 161). H100,
# kernel-only, in one process, time with over without
# (results/define_ab_h100_short_k_chunks_off_9c54103*.txt, k 2..5, fp16; bf16
# at k = 4): 768x2048 at 112..128 rows 0.89-0.93 at every k, at 65..96 k = 4
# 0.91-0.94 and the others 0.98-1.01; 512x2048 at 65..128 0.78-0.83 (k = 2, 3),
# 0.93-0.99 (k = 4, 5). On 768x4096 (64 groups: 192 group-chunks at 65..96
# rows) k = 4 and 5 were 1.03-1.24x slower (k = 5's 128 KB table: one CTA per
# SM, two waves), hence the fit; on 2048x768 and 2048x512 (8 K tiles) 32-row
# chunks were up to 10% slower at 96..128 rows, and past 128 rows mostly
# slower on every layer (results/define_ab_h100_chunk_rows_684567d.txt).
# 0: never (A/B runs).
_WG_SHORT_K_TILES = 3
_WG_SHORT_K_CHUNK_M_TILES = 4


def _wg_chunk_m_tiles(M: int, N: int, K_dim: int) -> int:
    """n8 tiles of an M chunk (_wg_m_chunks) for ``M`` rows of A on an N x
    K_dim weight: _WG_SHORT_K_CHUNK_M_TILES on short layers at 65..128 rows
    whose chunks' groups (4 row tiles each) fit one CTA per SM, else
    _WG_CHUNK_M_TILES."""
    rt_n, kt_n = _tile_counts(N, K_dim)
    t = _WG_SHORT_K_CHUNK_M_TILES
    if (t and kt_n <= _WG_SHORT_K_TILES and 8 * _WG_CHUNK_M_TILES < M <= 16 * _WG_CHUNK_M_TILES
            and math.ceil(M / (8 * t)) * math.ceil(rt_n / 4) <= _sm_count()):
        return t
    return _WG_CHUNK_M_TILES


def _wg_m_chunks(M: int, k: int, N: int, K_dim: int, scale: str = "uint8") -> int:
    """Chunks of _wg_chunk_m_tiles n8 tiles along grid z for a Hopper-path
    launch of ``M`` rows (1: none; at 65..128 rows in 64-row chunks also 1
    below _WG_CHUNKS_TO_128_MIN_K): 2.._WG_MAX_CHUNKS where a chunk's launch
    takes one warpgroup a CTA (_wg_warpgroups: a small layer) and can split K
    in clusters (its CTAs then reduce without the workspace, whose slots and
    counters the kernel also keeps per chunk)."""
    tiles = _wg_chunk_m_tiles(M, N, K_dim)
    rows = 8 * tiles
    if not (_WG_M_CHUNKS and not _WG_WARPGROUPS and rows < M <= rows * _WG_MAX_CHUNKS):
        return 1  # (_WG_WARPGROUPS: an A/B run's warpgroups, no chunks)
    if tiles == _WG_CHUNK_M_TILES and M <= 2 * rows and k < _WG_CHUNKS_TO_128_MIN_K:
        return 1
    rt_n, kt_n = _tile_counts(N, K_dim)
    if (_wg_warpgroups(tiles, k, rt_n, kt_n, scale) != 1
            or not _wg_cluster_capable(True, 1, 128)):
        return 1
    return math.ceil(M / rows)


_CLUSTER_RESIDENCY = 1  # _plan_launch's split within the resident clusters (0: not, A/B runs)


def _resident_clusters(kern, threads: int, shared: int, cluster: int) -> int | None:
    """Clusters of ``cluster`` CTAs along y of ``kern`` (a loaded RawKernel,
    its dynamic shared memory opted in: launch_ctas_per_sm) resident at once
    (cuOccupancyMaxActiveClusters; None where the driver cannot say, not
    kept). Keyed by the kernel object, as launch_ctas_per_sm is."""
    key = (kern, threads, shared, cluster)
    found = _cluster_cache.get(key)
    if found is None:
        probe = types.SimpleNamespace(func=kern.kernel.ptr, grid=(1, cluster, 1), block=(threads, 1, 1),
                                      shared=shared, argv=None)  # what PdlLaunch reads of a Launch
        found = _launch.PdlLaunch(probe, pdl=False, cluster=cluster, cluster_axis=1).max_active_clusters()
        if found is not None:
            _cluster_cache[key] = found
    return found


_cluster_cache: dict[tuple, int] = {}


def _plan_launch(M: int, weight: KbitWeight, dtype, wg: bool, stream: int, chunks: int = 1,
                 slab_chunks: bool = False):
    """(Launch, tensor-map n8 tiles or 0, CTAs per cluster along y or 0) of
    gemm_mma.cu for ``M`` rows of A: up to 64 (mma) or 256 (wg: the wgmma
    path; 129..256 warp-specialised, which needs a tensor map of A per call),
    or on the wgmma path ``chunks`` > 1 chunks along grid z: of
    _wg_chunk_m_tiles n8 tiles (_wg_m_chunks), or with ``slab_chunks`` of the
    slab-staged variant's rows (_wg_slab_chunks). A and C are set per call."""
    N, K_dim = weight.shape
    tiles, scales = weight._tiles
    rt_n, kt_n = _tile_counts(N, K_dim)
    if wg:
        scale = weight.absmax.dtype.name
        chunk_tiles = (max(_jit.gemm_wg_m_tiles(weight.k, scale)) if slab_chunks
                       else _wg_chunk_m_tiles(M, N, K_dim))
        m_tiles = next(t for t in _jit.gemm_wg_m_tiles(weight.k, scale)
                       if 8 * t >= (M if chunks == 1 else 8 * chunk_tiles))
        wgs = _WG_WARPGROUPS or _wg_warpgroups(m_tiles, weight.k, rt_n, kt_n, scale)
        if chunks > 1 and (m_tiles != chunk_tiles or not (slab_chunks or wgs == 1)):
            raise AssertionError("M chunks need one warpgroup at the chunk's n8 tiles, or slab staging")
        per_warp, warps = 1, 4 * wgs
        kern = _jit.get_kernel("gemm_mma", weight.k, dtype.name, weight.absmax.dtype.name,
                               m_tiles, 1, wgs)
    else:
        m_tiles = next(t for t in _jit.GEMM_M_TILES if 8 * t >= M)
        # Two row tiles per warp where there are row tiles to spare (measured:
        # +20-25% at M = 32..64 on 4096x28672 and larger, -20-30% on 2048x768).
        per_warp = 2 if m_tiles >= 4 and rt_n >= 4 * _sm_count() else 1
        warps = _mma_warps(weight.k, weight.absmax.dtype, M, per_warp, N, K_dim)
        if _k2_two_row_tiles(weight.k, m_tiles, warps, rt_n):
            per_warp = 2
        args = (weight.k, dtype.name, weight.absmax.dtype.name, m_tiles, per_warp,
                *((0, False, warps) if warps != 4 else ()))
        ring = _mma_ring(weight.k, weight.absmax.dtype, M, warps, per_warp,
                         math.ceil(rt_n / (warps * per_warp)) * kt_n)
        if ring:  # (FOLD = false: a ring variant is never folded, _jit.cb_fold_variant)
            args = (*args, False, ring)
        elif _cb_fold(weight, dtype, "mma", m_tiles):
            args = _jit.cb_fold_variant("gemm_mma", args) or args
        kern = _jit.get_kernel("gemm_mma", *args)
    # mma: two stages of a K tile's activations (four in k = 5's ring); wgmma: three, or a ring of
    # 64-column slabs at 24 and 32 n8 tiles, aligned to 1024 bytes (its
    # swizzle) by the kernel
    if wg:
        shared = _jit.gemm_wg_shared_bytes(m_tiles, wgs, dtype.itemsize)
        shared += _jit.gemm_prmt_table_bytes(weight.k, m_tiles, wgs, False, 4)
    else:
        shared = (_jit.gemm_mma_a_stages(weight.k, m_tiles, warps, ring)
                  * _jit.gemm_mma_stage_rows(m_tiles, ring) * K_PER_TILE * dtype.itemsize)
        shared += _jit.gemm_prmt_table_bytes(weight.k, m_tiles, 0, False, warps)
    # static (codebook pair table, up to 33 KB) + dynamic past 48 KB needs the opt-in
    # wgmma with slab staging: one producer warpgroup besides the 4 * wgs warps
    threads = _jit.gemm_wg_threads(m_tiles, wgs) if wg else warps * 32
    per_sm = launch_ctas_per_sm(kern, threads, shared)
    # Work split (gemm_mma.cu, "Work split"): units of (group, K tile), one
    # contiguous range per CTA, at most as many CTAs as are resident at once.
    groups = math.ceil(rt_n / (warps * per_warp))
    # Where this launch can split K in clusters, at most a cluster's CTAs:
    # more went to the workspace (3072x1024 at M = 17..64, twelve splits of
    # one K tile; six of two in clusters are 1.46-1.63x faster on the H100:
    # results/ab_tree_h100_split_cap_c946539_vs_e7228f8.txt)
    capable = _wg_cluster_capable(wg, wgs if wg else 0, threads)
    cap = _jit.GEMM_MAX_CLUSTER_SPLITS if capable else 0
    # M chunks: every chunk's groups count (each CTA one segment of one
    # chunk's group, so the kernel's per-chunk ranges are whole segments)
    if threads > warps * 32 and _layer_class(N, K_dim, weight.k, True) == "large":
        slack = _SLAB_STREAM_K_SLACK  # slab staging's producer warpgroup on a large layer
    elif not wg and warps == 8:
        slack = _WIDE_STREAM_K_SLACK
    else:
        slack = None  # (_work_split's default, _STREAM_K_SLACK)
    underfill, underfill_tiles = _underfill_charge(wg, warps, weight.k), _underfill_tiles(weight.k)
    while True:
        group_units, ctas, splits = _work_split(groups * chunks, kt_n, _sm_count() * per_sm,
                                                _sm_count(), cap, chunks > 1,
                                                slack, underfill, underfill_tiles)
        # The split assumes every CTA resident at once. A GPC holds whole
        # clusters only, so fewer clusters of `splits` CTAs may be resident
        # than SMs x CTAs per SM allow (2048x512 at 65..128 rows in two chunks,
        # k = 4, one CTA per SM: 16 clusters of 8 took 8.3 us on the H200
        # against 6.6 us for one 128-row launch, results/define_ab_h200_m_chunks_28f41db.txt):
        # then at most splits - 1 segments.
        cluster = _wg_cluster_splits(wg, wgs if wg else 0, splits, threads)
        resident = (_resident_clusters(kern, threads, shared, cluster)
                    if cluster and _CLUSTER_RESIDENCY else None)
        if resident is None or resident * cluster >= ctas:
            break
        cap = splits - 1  # (at 1: whole groups or stream-K, no clusters: the loop ends)
    units = groups * chunks * group_units
    if units >= 2**31:
        raise ValueError(f"weight too large for the mma kernel ({N}x{K_dim}); use kernel='dequant'")
    # fp32 partials of split groups: two slots per CTA (its first and last
    # group); none where every CTA runs whole groups (slab chunks at one
    # segment a group: 2 x 128 KB a CTA would be gigabytes there)
    whole = chunks > 1 and splits == 1
    workspace = _workspace(4 if whole else 2 * ctas * warps * per_warp * m_tiles * 32 * 4, stream)
    counters = _counters(rt_n * chunks, stream)
    ctas //= chunks  # per chunk (grid z)
    units //= chunks
    # gemm_mma.cu: CTA (group, segment[, chunk])
    grid = (groups, splits, chunks) if splits > 1 else (ctas, 1, chunks)
    map_tiles = m_tiles if threads > warps * 32 else 0
    launch = _launch.Launch(
        kern, grid, (threads,), shared, _GEMM_ARG_TYPES,
        (tiles, scales, weight.codebook, 0, 0, M, N, K_dim, rt_n, kt_n, group_units,
         units // ctas, units % ctas, workspace, counters, 0, 0, 0, 1, 0, 0))
    return launch, map_tiles, _wg_cluster_splits(wg, wgs if wg else 0, splits, threads)


# gemm_latency.cu stages the rows of A it multiplies, whole, in shared memory:
# at most this many bytes of them per launch (the rest of a CTA's shared
# memory: the pair table, up to 33 KB, and the warps' partial tiles).
_LATENCY_STAGE_BYTES = 64 * 1024


# gemm_lut.cu's parameters that change per call: A (the lookups), C (the sum)
_LUT_ARG_A, _LUT_ARG_C = 3, 5
_LUT_ARG_TYPES = (_launch.POINTER,) * 6 + (_launch.INT32,) * 6


def _reserved_shared() -> int | None:
    """Shared memory the driver reserves per CTA (bytes) before the dynamic
    allocation: where gemm_lut.cu's tables start in the shared window. None
    where the device does not say."""
    value = _attributes().get("ReservedSharedMemoryPerBlock")
    if value is None:
        import cupy

        attr = getattr(cupy.cuda.runtime, "cudaDevAttrReservedSharedMemoryPerBlock", None)
        if attr is None:
            return None
        value = cupy.cuda.runtime.deviceGetAttribute(attr, _launch.current_device())
    return int(value)


def lut_units(N: int, K_dim: int) -> tuple[int, int]:
    """(row blocks, units) of gemm_lut.cu for a [N, K_dim] weight: row blocks
    of 128 * GEMM_LUT_S rows, one unit per (row block, K tile)."""
    rt_n, kt_n = _tile_counts(N, K_dim)
    row_blocks = math.ceil(rt_n / (8 * _jit.GEMM_LUT_S))
    return row_blocks, row_blocks * kt_n


def lut_slots(row_blocks: int, k_tiles: int, ctas: int) -> int:
    """Partial-sum slots a row of gemm_lut.cu's workspace needs: the most CTAs
    that share one row block when ``row_blocks * k_tiles`` units are spread
    over ``ctas`` CTAs (kernels_src/gemm_lut.cu lut_cta_of)."""
    units = row_blocks * k_tiles

    def cta_of(u: int) -> int:
        return ((u + 1) * ctas - 1) // units

    return max(cta_of(rb * k_tiles + k_tiles - 1) - cta_of(rb * k_tiles) + 1
               for rb in range(row_blocks))


def _plan_lut_launches(M: int, weight: KbitWeight, dtype, stream: int):
    """gemm_lut.cu's lookups and sum for one row of A (A and C set per call).
    ValueError where the weight or A is not what it takes."""
    if weight.k != 2:
        raise ValueError(f"kernel='lut' runs k = 2 weights only, this one has k={weight.k}; "
                         "use kernel='auto'")
    if weight.absmax.dtype != np.uint8:
        raise ValueError("kernel='lut' reads E4M4 (uint8) scales, this weight has fp16 absmax; "
                         "use kernel='auto'")
    if M != 1:
        raise ValueError(f"kernel='lut' multiplies one row of A, got {M}; use kernel='auto'")
    table_at = _reserved_shared()  # (the kernel checks it against its shared window at entry)
    if table_at is None:
        raise ValueError("kernel='lut' needs the device's reserved shared memory per block, "
                         "which this device does not report; use kernel='auto'")
    N, K_dim = weight.shape
    tiles, scales = weight.prepare()._tiles
    rt_n, kt_n = _tile_counts(N, K_dim)
    l2_hint = N >= _LUT_L2_HINT_MIN_N
    lookups_k = _jit.get_kernel("gemm_lut", *_jit.gemm_lut_args(dtype.name, table_at, False, l2_hint))
    total_k = _jit.get_kernel("gemm_lut", *_jit.gemm_lut_args(dtype.name, table_at, True))
    per_sm = launch_ctas_per_sm(lookups_k, _jit.GEMM_LUT_THREADS, _jit.GEMM_LUT_SHARED)
    if per_sm < 1:
        raise ValueError("kernel='lut' needs 65 KB of shared memory per CTA; use kernel='auto'")
    row_blocks, units = lut_units(N, K_dim)
    ctas = min(per_sm * _sm_count(), units)
    part = _workspace(lut_slots(row_blocks, kt_n, ctas) * N, stream)
    values = (tiles, scales, weight.codebook, 0, part, 0, N, K_dim, kt_n, rt_n, units, ctas)
    lookups = _launch.Launch(lookups_k, (ctas,), (_jit.GEMM_LUT_THREADS,), _jit.GEMM_LUT_SHARED,
                             _LUT_ARG_TYPES, values)
    total = _launch.Launch(total_k, (math.ceil(N / 256),), (256,), 0, _LUT_ARG_TYPES, values)
    return lookups, total


def _latency_rows(K_dim: int, itemsize: int) -> int:
    """Rows of A per gemm_latency launch: up to 8 * max(GEMM_LATENCY_M_TILES)
    (16), fewer where K_dim is long (the whole rows are staged)."""
    k_pad = _tile_counts(1, K_dim)[1] * K_PER_TILE
    return max(1, min(8 * max(_jit.GEMM_LATENCY_M_TILES), _LATENCY_STAGE_BYTES // (k_pad * itemsize)))


def latency_ksplit(ksplit: int = 1) -> int:
    """The units per K tile a gemm_latency.cu variant of template argument
    KSPLIT ``ksplit`` runs: _jit.GEMM_LATENCY_KSPLIT where an A/B build sets
    KBIT_LATENCY_KSPLIT for every launch, else ``ksplit``."""
    return _jit.GEMM_LATENCY_KSPLIT if _jit.GEMM_LATENCY_KSPLIT != 1 else ksplit


def latency_geometry(kern, rows: int, k_tiles: int, itemsize: int, m_tiles: int,
                     ctas: int, ksplit: int = 1) -> tuple[int, int]:
    """(warps per CTA, dynamic shared bytes) of a gemm_latency.cu launch of
    ``ctas`` CTAs staging ``rows`` rows of ``k_tiles`` K tiles: one warp per K
    tile (per half or quarter K tile where the variant's KSPLIT ``ksplit`` or
    an A/B build's KBIT_LATENCY_KSPLIT is 2 or 4: latency_ksplit) up to
    GEMM_LATENCY_MAX_WARPS, halved (each warp then takes two or more units)
    while the CTAs would not all be resident at once: one wave, whose loads
    are all issued at the start.
    ValueError where the rows do not fit the shared memory."""
    stage = rows * k_tiles * K_PER_TILE * itemsize
    warps = min(_jit.GEMM_LATENCY_MAX_WARPS, k_tiles * latency_ksplit(ksplit))
    while True:
        shared = stage + warps * m_tiles * 32 * 16  # + the warps' partial tiles, fp32
        per_sm = launch_ctas_per_sm(kern, 32 * warps, shared)
        if warps <= _LATENCY_MIN_WARPS or per_sm * _sm_count() >= ctas:
            break
        warps = (warps + 1) // 2
    if per_sm < 1:
        raise ValueError(f"{rows} rows of A of {k_tiles * K_PER_TILE} columns do not fit the "
                         "latency kernel's shared memory; use kernel='mma'")
    return warps, shared


# latency_geometry halves the warps per CTA down to this. H100, k=4, kernel-only:
# moe_linear T=1 (768 CTAs of 8 K tiles) 13.6 -> 12.9 us at 2 warps against 4;
# 4096x6144, 4096x4096, 2048x768 at M=1 unchanged (within 0.1 us) at 4, 2, 1.
_LATENCY_MIN_WARPS = 2


# Half tiles: two CTAs per 16-row tile of W, each decoding 8 of its rows
# (gemm_latency.cu), where the row tiles would leave SMs idle: 1 where the half
# tiles are no more than the SMs, 0 never, 2 always (the last two for A/B runs).
# H200, k=2..5, kernel-only, M = 1 and 4 (define_ab_h200_90c4745_half_tiles.txt):
# 2048x768 (96 half tiles) 0.96-1.01x the whole tiles' time, 2048x512 (64)
# 0.93-0.98x; 768x2048 (256, two CTAs per SM) 1.06-1.09x, so not there.
_LATENCY_HALF_TILES = 1


# The scale pair's factor in the codebook entries (_jit.GEMM_CB_FOLD; the FOLD
# template argument, mma_common.cuh cb_bits): the same bits, one HMUL2 fewer a
# block and row. H200, fp16, kernel-only, auto at M = 1, 4, 8, 16, k = 2..5,
# in one process against the default build (results/define_ab_h200_cb_fold_acf4252.txt,
# ..._small_acf4252.txt, the whole-build knob): k = 2 on the layers of >= 2^27
# weights at M <= 8 (latency and mma) 3-5% faster, k = 5 on the large layers
# (mma) 2-5%; M = 16 within 2%; k = 2 on smaller layers and k = 5's latency
# kernel on small layers 0.5-2.5% slower, k = 3 -4..+7%, k = 4 within 1%.
# bf16 the same (define_ab_h200_cb_fold_bf16_e8db27f.txt: k = 2 on >= 2^27
# weights 3-5%, k = 5 2-4% at M = 1..8; the same bits). Not measured on the
# H100: it keeps the default.
_CB_FOLD_MIN_TBPS = _FAST_TBPS
_CB_FOLD_K2_MIN_WEIGHTS = _HUGE
_CB_FOLD_K5_MIN_WEIGHTS = 1 << 25
# |entry| times the factor within the largest finite value: fp16 4094 x 16 =
# 65504; bf16 4080 x 2^116 (4088 would round to 4096 first). bf16 entries
# also at least 2^-126: smaller ones are float subnormals, which the fold's
# float multiply flushes to zero (-ftz).
_CB_FOLD_MAX_ENTRY = {"float16": 4094.0, "bfloat16": 4080.0}
_CB_FOLD_BF16_MIN_ENTRY = 2.0**-126


def _cb_fold(weight: KbitWeight, dtype, kernel: str, m_tiles: int) -> bool:
    """Whether ``kernel`` ("latency" or "mma", ``m_tiles`` n8 tiles) runs with
    the scale pair's factor folded into ``weight``'s codebook (FOLD)."""
    name = "float16" if _is_fp16(dtype) else "bfloat16"
    if not (_jit.GEMM_CB_FOLD and weight.k in _jit.CB_FOLD_KS and m_tiles <= 2
            and weight.absmax.dtype == np.uint8 and _device_tbps() >= _CB_FOLD_MIN_TBPS):
        return False
    # None: a codebook assigned after construction, its range unknown
    cb_max, cb_min = weight.__dict__.get("_cb_max"), weight.__dict__.get("_cb_min")
    if cb_max is None or cb_min is None or cb_max > _CB_FOLD_MAX_ENTRY[name]:
        return False
    if name == "bfloat16" and cb_min < _CB_FOLD_BF16_MIN_ENTRY:
        return False
    weights = weight.shape[0] * weight.shape[1]
    if weight.k == 2:
        return weights >= _CB_FOLD_K2_MIN_WEIGHTS
    return kernel == "mma" and weights >= _CB_FOLD_K5_MIN_WEIGHTS


def _latency_half_tiles(row_tiles: int) -> bool:
    """Whether gemm_latency runs half tiles for a weight of ``row_tiles`` row tiles."""
    return _LATENCY_HALF_TILES == 2 or (_LATENCY_HALF_TILES == 1 and 2 * row_tiles <= _sm_count())


# Half K tiles a warp in the dense latency launch (gemm_latency.cu KSPLIT = 2;
# 1: whole tiles always, for A/B runs) at the bit widths of
# _jit.DENSE_LATENCY_KSPLIT_KS with E4M4 scales, on a GPU of
# _DENSE_LATENCY_KSPLIT_MIN_TBPS or more, where whole tiles and whole row tiles
# leave an SM at most _DENSE_LATENCY_KSPLIT_MAX_SM_WARPS warps (warps a CTA x
# CTAs an SM): few K tiles on few CTAs, each warp's decode one chain with
# nothing beside it; half tiles double the warps decoding. H200, kernel-only,
# whole tiles' time over half tiles' at M = 1 / 4 / 16:
# - results/define_ab_h200_dense_ksplit_d66b60a.txt (auto, fp16): 768x2048
#   (3 K tiles, 128 CTAs: 3 warps an SM) k = 2 1.064 / 1.045 / 1.024, k = 4
#   1.037 / 1.042 / 1.014; bf16 (..._bf16_d66b60a.txt) 1.054 / 1.057 / 1.036
#   and 1.034 / 1.053 / 1.031. 1024x4096 (4 K tiles, 256 CTAs: 8 warps an SM)
#   0.976-1.005 at k = 2 and 0.984-0.993 at k = 4, fp16 and bf16: whole tiles.
# - results/define_ab_h200_ksplit_c48bd03.txt (the latency kernel forced, the
#   whole-build knob): where whole tiles already give 8 warps a CTA (4096x4096)
#   or half row tiles run (2048x768, 2048x512) 0.954-1.021; k = 3 and 5 (the
#   dropped words of a part that starts inside a load) down to 0.88 on
#   768x2048: whole tiles; 4096x6144 at k = 4 (4 warps a CTA, 3 CTAs an SM)
#   1.05-1.10, where auto runs mma.
# - results/define_ab_h200_dense_ksplit_bound_d98d75e.txt (auto, fp16, the
#   bound raised to 8 against 4 and against whole tiles): 512x2048 (2 warps an
#   SM, half tiles already) 1.08-1.11; 1280x2048 (5 K tiles, 128 CTAs: 5
#   warps) 1.007-1.049; 1536x2048 (6) 1.009-1.045 but k = 4 at M = 4 0.992;
#   768x4096 (3 K tiles, 256 CTAs: 6) 1.036-1.050. So the bound is 6: 8
#   (1024x4096, above) keeps whole tiles; 7 not measured. bf16 at the bound
#   (define_ab_h200_dense_ksplit_bound_bf16_ceb6d33.txt, 768x4096, 1280x2048,
#   1536x2048): 1.007-1.063 at all 18 points.
# Not measured on the H100: whole tiles there.
_DENSE_LATENCY_KSPLIT = 2
_DENSE_LATENCY_KSPLIT_MIN_TBPS = _FAST_TBPS
_DENSE_LATENCY_KSPLIT_MAX_SM_WARPS = 6


def _dense_latency_ksplit(k: int, scale_dtype, half_rows: bool, warps: int, ctas: int) -> int:
    """KSPLIT of the dense latency launch of ``ctas`` CTAs whose whole-tile
    geometry (latency_geometry) gives ``warps`` warps a CTA, with half row
    tiles or not: _DENSE_LATENCY_KSPLIT where the rule above holds, else 1."""
    sm_warps = warps * math.ceil(ctas / _sm_count())
    if (k in _jit.DENSE_LATENCY_KSPLIT_KS and np.dtype(scale_dtype) == np.uint8
            and not half_rows and sm_warps <= _DENSE_LATENCY_KSPLIT_MAX_SM_WARPS
            and _device_tbps() >= _DENSE_LATENCY_KSPLIT_MIN_TBPS):
        return _DENSE_LATENCY_KSPLIT
    return 1


def _latency_launch_geometry(M: int, weight: KbitWeight, dtype):
    """(kernel, CTAs, warps a CTA, dynamic shared bytes, half tiles) of the
    gemm_latency.cu launch for ``M`` (<= _latency_rows) rows of A: one CTA per
    16-row tile of W (or two, each taking 8 of its rows: half tiles), its
    warps splitting the K tiles (latency_geometry)."""
    N, K_dim = weight.shape
    rt_n, kt_n = _tile_counts(N, K_dim)
    half = _latency_half_tiles(rt_n)
    ctas = 2 * rt_n if half else rt_n
    m_tiles = next(t for t in _jit.GEMM_LATENCY_M_TILES if 8 * t >= M)
    fold = _cb_fold(weight, dtype, "latency", m_tiles)

    def kernel(ksplit: int):  # the variant of KSPLIT `ksplit`, folded where _cb_fold says
        args = (weight.k, dtype.name, weight.absmax.dtype.name, m_tiles,
                *((False, False, ksplit) if ksplit != 1 else ()))
        if fold:
            args = _jit.cb_fold_variant("gemm_latency", args) or args
        return _jit.get_kernel("gemm_latency", *args)

    kern = kernel(1)
    warps, shared = latency_geometry(kern, M, kt_n, dtype.itemsize, m_tiles, ctas)
    ksplit = _dense_latency_ksplit(weight.k, weight.absmax.dtype, half, warps, ctas)
    if ksplit != 1:  # (the whole-tile geometry decides; the half-tile one launches)
        kern = kernel(ksplit)
        warps, shared = latency_geometry(kern, M, kt_n, dtype.itemsize, m_tiles, ctas, ksplit)
    return kern, ctas, warps, shared, half


def _latency_one_wave(M: int, weight: KbitWeight, dtype) -> bool:
    """Whether the latency launch for ``M`` rows has all of its CTAs resident
    at once (what latency_geometry aims for; where the stage of A leaves too
    few CTAs an SM even at the fewest warps, it runs in two waves). H200,
    the dispatch audits since 8aae053 (results/dispatch_audit{6,7,8,9}_h200_*,
    up to 8 rows): of the 122 points whose launch is past one wave, the
    latency kernel took 1.041-9.1x the fastest other kernel's time (median
    1.83x), of the 180 within one wave 0.83-2.17x (half at most 1.02x); the
    earlier audits' 420 the same (119 past one wave, 1.047-2.75x). 4096x12288 fp16 at
    k = 2 (cliff_h200_71e17c8_*: 0.97 waves at 4 rows, 1.16 at 5) 12.7 ->
    19.3 us, at k = 3 (the 8.8 KB table in static shared memory: 0.97 waves
    at 3 rows, 1.16 at 4) 13.9 -> 20.6 us, mma 12.5-13.8 at all four."""
    kern, ctas, warps, shared, _ = _latency_launch_geometry(M, weight, dtype)
    return launch_ctas_per_sm(kern, 32 * warps, shared) * _sm_count() >= ctas


def _plan_latency_launch(M: int, weight: KbitWeight, dtype):
    """Launch of gemm_latency.cu for ``M`` (<= _latency_rows) rows of A
    (_latency_launch_geometry). A and C are set per call."""
    N, K_dim = weight.shape
    tiles, scales = weight._tiles
    kt_n = _tile_counts(N, K_dim)[1]
    kern, ctas, warps, shared, half = _latency_launch_geometry(M, weight, dtype)
    return _launch.Launch(kern, (ctas,), (32 * warps,), shared, _LATENCY_ARG_TYPES,
                          (tiles, scales, weight.codebook, 0, 0, M, N, K_dim, kt_n, 0, 1, 0,
                           int(half), 0, 1))


_LATENCY_ARG_TYPES = ((_launch.POINTER,) * 5 + (_launch.INT32,) * 4 + (_launch.POINTER,)
                      + (_launch.INT32,) * 3 + (_launch.POINTER, _launch.INT32))

# The cluster split's geometry (gemm_latency.cu, CLUSTER), for A/B runs; 0: chosen
# by cluster_geometry. _CLUSTER_M_TILES: n8 tiles per M chunk; _CLUSTER_RANKS: CTAs
# per cluster (K splits); _CLUSTER_ROW_TILES: row tiles per CTA.
_CLUSTER_M_TILES = 0
_CLUSTER_RANKS = 0
_CLUSTER_ROW_TILES = 0


_CLUSTER_STAGE_BYTES = 160 * 1024  # staged A per CTA at most (of 227 KB)


def cluster_geometry(M: int, row_tiles: int, k_tiles: int, sms: int,
                     itemsize: int = 2) -> tuple[int, int, int, int]:
    """(n8 tiles per M chunk, CTAs per cluster, row tiles per CTA, warps per
    CTA) of gemm_latency.cu's cluster split for ``M`` rows of A on a weight
    of ``row_tiles`` x ``k_tiles`` tiles and a GPU of ``sms`` SMs.

    Ranks split the K tiles: the largest divisor of k_tiles up to 8 when it
    is at least half of min(k_tiles, 8) (every CTA the same share), else
    min(k_tiles, 8). M chunks (n8 tiles): up to M = 64, 16 or 32 rows,
    whichever pads M the least (on a tie 32, or 16 under 4 ranks); beyond, 64
    rows (longer M runs in more chunks); fewer where a chunk's rows of the
    CTA's K tiles would pass _CLUSTER_STAGE_BYTES. Row tiles per CTA: 4 up to
    M = 64 (measured best on the small layers); beyond, the most (up to 8)
    that still give every SM a CTA, since a CTA's staged A serves all of its
    row tiles. Warps: one per (row tile, share of the CTA's K tiles),
    at most 8, with ranks x warps per row tile <= 16 (the partials an output
    adds).
    """
    top = min(k_tiles, _jit.GEMM_CLUSTER_MAX_RANKS)
    ranks = max(d for d in range(1, top + 1) if k_tiles % d == 0)
    if 2 * ranks < top:
        ranks = top
    ranks = _CLUSTER_RANKS or ranks
    local_tiles = math.ceil(k_tiles / ranks)
    # Up to 64 rows: chunks of at most 32 rows (4 n8 tiles) and 4 row tiles per
    # CTA, the best measured on the small layers at M = 32 and 64 even where
    # that leaves SMs without a CTA (cluster_h100_e0c1b1b: 2048x512 at M = 32
    # 0.98x cuBLAS with 64 CTAs against 0.74x at 256 CTAs of one row tile;
    # 2048x768 at M = 64, 32-row chunks 0.86x against 64-row chunks 0.71x).
    # Of 16- and 32-row chunks the one that pads M the least (cluster_h100_0f6f295:
    # at M = 48 three 16-row chunks ran 1.01-1.08x two of 32 on the three small
    # layers); on a tie the longer, but the shorter under 4 ranks (768x2048, 3
    # ranks, at M = 17 and 32: 16-row chunks 1.03-1.10x on the H100 at cb85d31,
    # 1.02-1.10x on the H200 at 76c399b; with 8 ranks within -5..+3%).
    few = M <= 64
    if few:
        tie = 1 if ranks < 4 else -1  # 1: the shorter chunk wins a tie, -1: the longer
        m_tiles = min((t for t in _jit.GEMM_CLUSTER_M_TILES if t <= 4),
                      key=lambda t: (math.ceil(M / (8 * t)) * 8 * t, tie * t))
    else:
        m_tiles = max(_jit.GEMM_CLUSTER_M_TILES)
    m_tiles = _CLUSTER_M_TILES or m_tiles
    while (m_tiles > min(_jit.GEMM_CLUSTER_M_TILES) and not _CLUSTER_M_TILES
           and min(M, 8 * m_tiles) * local_tiles * K_PER_TILE * itemsize > _CLUSTER_STAGE_BYTES):
        m_tiles = max(t for t in _jit.GEMM_CLUSTER_M_TILES if t < m_tiles)
    chunks = math.ceil(M / (8 * m_tiles))
    per_cta = _CLUSTER_ROW_TILES
    if not per_cta and few:
        per_cta = min(4, row_tiles)
    elif not per_cta:
        per_cta = 1
        for r in (2, 4, 8):
            if r <= row_tiles and ranks * math.ceil(row_tiles / r) * chunks >= sms:
                per_cta = r
    max_warps = _jit.GEMM_CLUSTER_MAX_WARPS
    per_row_tile = max(1, min(local_tiles, max_warps // per_cta,
                              _jit.GEMM_CLUSTER_MAX_READS // ranks))
    return m_tiles, ranks, per_cta, per_cta * per_row_tile


def _plan_cluster_launch(M: int, weight: KbitWeight, dtype):
    """(Launch, CTAs per cluster) of gemm_latency.cu's cluster split for ``M``
    rows of A (any M: chunks of 8 * m_tiles rows along grid y), geometry from
    cluster_geometry. A and C are set per call."""
    N, K_dim = weight.shape
    tiles, scales = weight._tiles
    rt_n, kt_n = _tile_counts(N, K_dim)
    m_tiles, ranks, per_cta, warps = cluster_geometry(M, rt_n, kt_n, _sm_count(), dtype.itemsize)
    kern = _jit.get_kernel("gemm_latency", weight.k, dtype.name, weight.absmax.dtype.name,
                           m_tiles, True)
    rows = min(M, 8 * m_tiles)
    shared = (warps * m_tiles * 32 * 16  # the partial tiles, fp32
              + rows * math.ceil(kt_n / ranks) * K_PER_TILE * dtype.itemsize)
    if launch_ctas_per_sm(kern, 32 * warps, shared) < 1:
        raise ValueError(f"{rows} rows of A of {math.ceil(kt_n / ranks) * K_PER_TILE} columns per "
                         "CTA do not fit the cluster kernel's shared memory; use kernel='mma'")
    grid = (ranks * math.ceil(rt_n / per_cta), math.ceil(M / (8 * m_tiles)))
    if grid[1] >= 1 << 16:
        raise ValueError(f"M={M} is too many rows for kernel='cluster'; use kernel='auto'")
    launch = _launch.Launch(kern, grid, (32 * warps,), shared, _LATENCY_ARG_TYPES,
                            (tiles, scales, weight.codebook, 0, 0, M, N, K_dim, kt_n, 0, 1, 0,
                             0, 0, per_cta))
    return launch, ranks


_map_cache: collections.OrderedDict[tuple, object] = collections.OrderedDict()
_MAP_CACHE_SIZE = 64
_libcuda = None


# Why ctypes and not NVIDIA's cuda-bindings (cuda.bindings.driver has a
# cuTensorMapEncodeTiled wrapper), checked for issue 22: CuPy 14.2.0
# (cupy-cuda12x) requires only numpy and cuda-pathfinder (its "ctk" extra adds
# cuda-toolkit 12.*, not cuda-bindings), so the bindings are not installed
# with CuPy; using them would make them a new dependency, and one whose
# version shares the CUDA Toolkit's major.minor (their support policy; pip
# here offers 13.5.0, the cuda12 extra would need the 12.x line). For one
# driver function with a fixed C signature that is more than the ctypes call
# below costs.
def _libcuda_encoder():
    """``cuTensorMapEncodeTiled`` from the CUDA driver library, or None where
    it cannot be loaded (no driver, or one older than CUDA 12)."""
    import ctypes

    global _libcuda
    if _libcuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuTensorMapEncodeTiled
        except (OSError, AttributeError):
            _libcuda = False
        else:
            fn.restype = ctypes.c_int
            _libcuda = fn
    return _libcuda or None


_slab_ok_cache: dict[tuple, bool] = {}


def _slab_launch_ok(weight: KbitWeight, dtype_name: str) -> bool:
    """Whether the warp-specialised wgmma variants this weight would use got
    exactly the entry register cap their setmaxnreg budgets assume
    (gemm_mma.cu kConsumerRegs; the offline compile check asserts it for the
    NVRTC it runs, this for the one compiling here): with any other count
    setmaxnreg.inc would wait forever, so kbit_gemm then launches 128 rows."""
    scale = weight.absmax.dtype.name
    key = (_launch.current_device(), weight.k, dtype_name, scale,
           _jit.gemm_wg_m_tiles(weight.k, scale))  # (the tiles: _jit.GEMM_WG_K5_FULL_ROWS)
    found = _slab_ok_cache.get(key)
    if found is None:
        found = True
        for m_tiles in _jit.gemm_wg_m_tiles(weight.k, scale):
            if m_tiles < _jit.GEMM_SLAB_MIN_M_TILES:
                continue
            wgs = _jit.gemm_wg_warpgroups(m_tiles, weight.k, scale)
            kern = _jit.get_kernel("gemm_mma", weight.k, dtype_name, scale, m_tiles, 1, wgs)
            found = found and kern.num_regs == _jit.gemm_wg_entry_regs(m_tiles, wgs)
        _slab_ok_cache[key] = found
    return found


def _tensor_maps_available() -> bool:
    """Whether the wgmma kernel's warp-specialised launches (129..256 rows,
    gemm_mma.cu slab staging) can get their tensor map; without it kbit_gemm
    launches at most 128 rows at a time (the 1..16-tile path)."""
    return _libcuda_encoder() is not None


def _activation_map(a_ptr: int, M: int, K_dim: int, m_tiles: int) -> int:
    """Device address of a CUDA tensor map of A ``[M, K_dim]`` (16-bit elements
    at ``a_ptr``) in boxes of 64 columns x ``8 * m_tiles`` rows, 128-byte
    swizzle, elements outside A read as zero: what the wgmma kernel's producer
    warp loads with the tensor copy engine (gemm_mma.cu, slab staging).
    Encoded by the driver (``cuTensorMapEncodeTiled``; CuPy has no wrapper)
    and cached per (device, address, shape, box): the most recent 64, plus
    every map made while a stream was being captured (a graph reads it at
    each replay, so it is never freed)."""
    key = (_launch.current_device(), a_ptr, M, K_dim, m_tiles)
    found = _map_cache.get(key)
    if found is not None:
        _map_cache.move_to_end(key)
        return found[0].data.ptr
    found = _encode_activation_map(a_ptr, M, K_dim, m_tiles)
    if _launch.is_capturing():
        _captured_maps.append(found)
    _map_cache[key] = found
    if len(_map_cache) > _MAP_CACHE_SIZE:
        _map_cache.popitem(last=False)
    return found[0].data.ptr


_captured_maps: list = []


def _encode_activation_map(a_ptr: int, M: int, K_dim: int, m_tiles: int):
    """(device map, its pinned host copy): the 128-byte map, encoded on the
    host, uploaded without blocking (``_launch.upload``)."""
    import ctypes

    encode = _libcuda_encoder()
    if encode is None:
        raise RuntimeError("the CUDA driver library (libcuda.so.1, CUDA 12+) is needed for "
                           "wgmma launches of more than 128 rows")
    raw = ctypes.create_string_buffer(128 + 64)  # CUtensorMap: 128 bytes, 64-byte aligned
    addr = (ctypes.addressof(raw) + 63) & ~63
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = encode(
        ctypes.c_void_p(addr), ctypes.c_int(1),  # CU_TENSOR_MAP_DATA_TYPE_UINT16
        u32(2), ctypes.c_void_p(a_ptr),
        (u64 * 2)(K_dim, M), (u64 * 1)(K_dim * 2),  # sizes; row stride in bytes
        (u32 * 2)(64, 8 * m_tiles), (u32 * 2)(1, 1),  # box; element strides
        ctypes.c_int(0), ctypes.c_int(3),  # no interleave; 128-byte swizzle
        ctypes.c_int(2), ctypes.c_int(0))  # L2 promotion 128 B; out of bounds reads zero
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for A of shape "
                           f"{(M, K_dim)} at {a_ptr:#x}")
    return _launch.upload(np.frombuffer(ctypes.string_at(addr, 128), dtype=np.uint8))


__all__ = [
    "KbitWeight",
    "choose_kernel",
    "kbit_gemm",
    "quantize_weight",
    "repack_for_gemm",
    "unpack_from_gemm",
]
