"""The kbit format (FORMAT.md) in NumPy: codebooks, E4M4 scales, index
selection, bit-plane packing. This module is the oracle every CUDA kernel is
checked against; it holds one truth per fact of the format.

Float32 arithmetic on the GPU flushes denormals to zero (CuPy always compiles
with ``-ftz=true``), so every float32 step here flushes the same way
(``flush_denormals``): inputs, quotients, distances, codebook entries and the
dequantized product.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

BLOCK = 32  # elements per quantization block (one warp, one ballot word)
K_VALUES = (2, 3, 4, 5)
FLT_MIN = np.float32(np.finfo(np.float32).tiny)  # smallest normal float32, 2**-126

E4M4_MAX = 31.0  # largest E4M4 value: 2**4 * (1 + 15/16)
E4M4_LIMIT = 31.5  # absmax at or above this would round past E4M4_MAX
E4M4_BIAS = 11
FP16_LIMIT = 65520.0  # absmax at or above this rounds to float16 infinity


# --------------------------------------------------------------------------
# small float32 helpers


def flush_denormals(x: np.ndarray) -> np.ndarray:
    """float32 array with denormals replaced by sign-preserving zeros (GPU FTZ)."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.abs(x) < FLT_MIN, np.copysign(np.float32(0), x), x).astype(np.float32)


def check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or int(k) not in K_VALUES:
        raise ValueError(f"k must be one of {K_VALUES} (bits per element), got {k!r}")
    return int(k)


def nblocks_for(n: int) -> int:
    return -(-int(n) // BLOCK)


# --------------------------------------------------------------------------
# codebooks


def create_normal_float_codebook(k: int) -> np.ndarray:
    """Default codebook: normal quantiles at the midpoints of 2**k equiprobable bins.

    ``v[i] = Phi^-1((i + 0.5) / 2**k)`` in float64, divided by ``max |v|``,
    cast to float32 (FORMAT.md section 2). Returns a float32 array of shape
    ``(2**k,)``, sorted ascending, symmetric, with ``max |v| == 1``.

    Raises ``ValueError`` if ``k`` is not 2, 3, 4 or 5.
    """
    k = check_k(k)
    count = 1 << k
    normal = NormalDist()
    values = np.array([normal.inv_cdf((i + 0.5) / count) for i in range(count)], dtype=np.float64)
    return (values / np.max(np.abs(values))).astype(np.float32)


def check_codebook(codebook, k: int) -> np.ndarray:
    """Validated float32 copy of ``codebook`` (host array) for bit width ``k``."""
    cb = np.asarray(codebook)
    if cb.dtype.kind != "f" and cb.dtype.name != "bfloat16":
        raise TypeError(f"codebook must be a float array (float32 preferred), got dtype {cb.dtype}")
    cb = cb.astype(np.float32).reshape(-1)
    if cb.size != (1 << k):
        raise ValueError(
            f"codebook for k={k} must have exactly 2**k = {1 << k} entries, got {cb.size}; "
            f"use create_normal_float_codebook({k}) or pass k matching the codebook"
        )
    if not np.all(np.isfinite(cb)):
        raise ValueError("codebook entries must be finite; got NaN or infinity")
    return cb


# --------------------------------------------------------------------------
# E4M4 block scales


def _e4m4_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.uint32)
    e, m = codes >> 4, codes & 15
    normal = ((e + (127 - E4M4_BIAS)) << 23) | (m << 19)
    values = np.where(e == 0, m.astype(np.float32) * np.float32(2.0**-14), normal.view(np.float32))
    return values.astype(np.float32)


E4M4_VALUES = _e4m4_table()  # decoded value of every code, ascending


def _e4m4_encode_unchecked(absmax: np.ndarray) -> np.ndarray:
    """E4M4 codes of float32 values in [0, 31.5): round to nearest, ties to even m.

    Mirrors the CUDA encoder bit for bit: below 2**-10 (the subnormal range)
    the code is ``rint(a * 2**14)``; above it the float32 mantissa is rounded
    to 4 bits with carry into the exponent.
    """
    a = np.asarray(absmax, dtype=np.float32)
    sub = np.rint(a * np.float32(16384.0)).astype(np.uint32)
    bits = a.view(np.uint32)
    rounded = (bits + np.uint32(0x3FFFF) + ((bits >> 19) & 1)) >> 19
    normal = rounded.astype(np.int64) - ((127 - E4M4_BIAS) << 4)
    normal = np.clip(normal, 0, 255).astype(np.uint32)
    return np.where(a < np.float32(2.0**-10), sub, normal).astype(np.uint8)


def e4m4_limit_message(largest) -> str:
    return (
        f"absmax {float(largest):g} is too large for E4M4 scales (largest {E4M4_MAX}, "
        f"values >= {E4M4_LIMIT} cannot be stored); use absmax_format=\"fp16\" "
        "or rescale the tensor"
    )


def encode_absmax_e4m4(x):
    """Encode non-negative block scales as E4M4 codes (FORMAT.md section 3).

    ``x``: float array (NumPy or CuPy) of values in ``[0, 31.5)``. Returns a
    uint8 array of the same shape in the same module: the code whose value is
    nearest, exact ties to the even mantissa, carry into the exponent
    (1.97 -> 2.0); values below ``2**-15`` give code 0.

    Raises ``ValueError`` for negative, non-finite or too-large values (the
    message suggests ``absmax_format="fp16"``).
    """
    from ._arrays import array_module

    xp = array_module(x)
    host = np.asarray(x.get() if xp is not np else x)
    if host.dtype.kind not in "fiu" and host.dtype.name != "bfloat16":
        raise TypeError(f"absmax values must be floats, got dtype {host.dtype}")
    exact = host.astype(np.float64)  # exact for every float dtype up to float64
    if not np.all(np.isfinite(exact)):
        raise ValueError("absmax values must be finite; got NaN or infinity")
    if np.any(exact < 0):
        raise ValueError(f"absmax values must be >= 0; got {float(exact.min()):g}")
    if exact.size and exact.max() >= E4M4_LIMIT:
        raise ValueError(e4m4_limit_message(exact.max()))
    if host.dtype == np.float32:
        exact = flush_denormals(host).astype(np.float64)  # as the kernels see float32
    # Nearest of the two neighbouring codes; both differences are exact in
    # float64 (Sterbenz), so ties are seen exactly and go to the even mantissa.
    values = E4M4_VALUES.astype(np.float64)
    lo = np.clip(np.searchsorted(values, exact, side="right") - 1, 0, 254)
    d_lo, d_hi = exact - values[lo], values[lo + 1] - exact
    up = (d_hi < d_lo) | ((d_hi == d_lo) & ((lo & 1) == 1))
    codes = np.where(exact >= values[255], 255, lo + up).astype(np.uint8)
    return xp.asarray(codes)


def decode_absmax_e4m4(codes):
    """Decode E4M4 codes (uint8, NumPy or CuPy) to float32 values, same shape and module."""
    from ._arrays import array_module

    xp = array_module(codes)
    arr = xp.asarray(codes)
    if arr.dtype != np.uint8:
        raise TypeError(f"E4M4 codes must be uint8, got dtype {arr.dtype}")
    table = xp.asarray(E4M4_VALUES)
    return table[arr.astype(np.int32)]


def scales_from_absmax(absmax: np.ndarray, absmax_format: str) -> tuple[np.ndarray, np.ndarray]:
    """(stored absmax array, decoded float32 scale) for float32 block maxima."""
    if absmax_format == "e4m4":
        if absmax.size and absmax.max() >= E4M4_LIMIT:
            raise ValueError(e4m4_limit_message(absmax.max()))
        codes = _e4m4_encode_unchecked(absmax)
        return codes, E4M4_VALUES[codes]
    if absmax.size and absmax.max() >= FP16_LIMIT:
        raise ValueError(
            f"absmax {float(absmax.max()):g} overflows float16 scales (largest 65504); "
            "rescale the tensor before quantizing"
        )
    stored = absmax.astype(np.float16)
    return stored, stored.astype(np.float32)


def decoded_scales(absmax: np.ndarray) -> np.ndarray:
    """float32 scale of each block from its stored absmax (uint8 E4M4 or float16)."""
    if absmax.dtype == np.uint8:
        return E4M4_VALUES[absmax]
    return absmax.astype(np.float32)


# --------------------------------------------------------------------------
# index selection: argmin_j |z - c[j]|, ties to the lowest j


def _ordered_key(values: np.ndarray) -> np.ndarray:
    """int64 keys that sort like the float32 values (-0.0 and +0.0 share key 0)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.int64)
    return np.where(bits >= 0x80000000, -(bits - 0x80000000), bits)


def _key_to_float(keys: np.ndarray) -> np.ndarray:
    mag = np.abs(keys).astype(np.uint32).view(np.float32)
    return np.where(keys < 0, -mag, mag).astype(np.float32)


@dataclass(frozen=True)
class IndexPlan:
    """How indices are selected for one codebook, on every path.

    ``thresholds`` (float32, ascending) are the exact decision points between
    neighbouring distinct codebook values: for ``z`` in float32 the FORMAT.md
    argmin is ``order[count(thresholds <= z)]``. This equals the brute-force
    argmin whenever ``fast`` holds (distinct values far apart relative to
    float32 rounding of the distances, and no tiny non-zero entries, so only
    the two neighbours of ``z`` can win). Otherwise every path falls back to
    the brute-force search over all entries.

    The CUDA kernel finds ``count(thresholds <= z)`` through a table of
    ``bins`` entries indexed by a monotone function of ``z`` (``bin_of``);
    ``table`` is None when no table size separates the thresholds, which also
    sends the GPU to the brute-force kernel.
    """

    codebook: np.ndarray  # float32 (2**k,), denormals flushed
    fast: bool
    thresholds: np.ndarray  # float32 (U-1,)
    order: np.ndarray  # int64 (U,): lowest original index of each distinct value, ascending value
    bin_scale: float  # power of two: bin = round(z * bin_scale) + bins/2, clamped
    table: np.ndarray | None  # uint32 (bins, 2): [threshold bits, lo | hi << 8]

    @property
    def bins(self) -> int:
        return 0 if self.table is None else self.table.shape[0]


_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it rounds |y| < 2**22 to an integer


Z_LIMIT = 1.5  # |x / s_b| < Z_LIMIT for every finite input
MAX_TABLE_BINS = 4096  # 32 KiB of shared memory in the quantize kernel


def bin_of(z: np.ndarray, bin_scale: float, bins: int) -> np.ndarray:
    """The CUDA kernel's table index for float32 ``z`` (monotone in z)."""
    y = np.asarray(z, dtype=np.float32) * np.float32(bin_scale)
    w = flush_denormals(y) + (_MAGIC + np.float32(bins // 2))
    raw = w.astype(np.float32).view(np.int32).astype(np.int64) - int(_MAGIC.view(np.int32))
    return np.clip(raw, 0, bins - 1)


def make_index_plan(codebook: np.ndarray) -> IndexPlan:
    """Precompute index selection for a validated float32 codebook."""
    cb = flush_denormals(codebook)
    values, first = np.unique(cb, return_index=True)  # stable: lowest original index
    order = first.astype(np.int64)
    nonzero = np.abs(values[values != 0])
    span = max(1.0, float(np.max(np.abs(values))))
    gaps = np.diff(values.astype(np.float64))
    fast = bool(
        (gaps.size == 0 or gaps.min() >= span * 2.0**-19)
        and (nonzero.size == 0 or nonzero.min() >= 2.0**-40)
    )
    if not fast:
        return IndexPlan(cb, False, np.zeros(0, np.float32), order, 1.0, None)

    # Threshold between neighbours i and i+1: the smallest float32 z in
    # [u_i, u_i+1] at which i+1 wins, found by bisection on ordered keys.
    lo_v, hi_v = values[:-1], values[1:]
    hi_wins_ties = order[1:] < order[:-1]
    lo_key, hi_key = _ordered_key(lo_v), _ordered_key(hi_v)
    for _ in range(40):
        mid = (lo_key + hi_key) // 2
        z = flush_denormals(_key_to_float(mid))
        d_lo = flush_denormals(z - lo_v)
        d_hi = flush_denormals(hi_v - z)
        upper = (d_hi < d_lo) | ((d_hi == d_lo) & hi_wins_ties)
        active = hi_key - lo_key > 1
        hi_key = np.where(active & upper, mid, hi_key)
        lo_key = np.where(active & ~upper, mid, lo_key)
    thresholds = _key_to_float(hi_key)

    # A table that puts at most one threshold in each bin, as coarse as that
    # allows: data concentrates in few bins, so the kernel's lookups mostly
    # share a shared-memory word or hit distinct banks (fewer bank conflicts).
    table, bin_scale = None, 1.0
    largest = float(np.max(np.abs(thresholds))) if thresholds.size else 1.0
    first_exp = int(np.floor(np.log2(1.0 / max(largest, 2.0**-60)))) - 1
    for exp in range(first_exp, 21):  # 2**20 keeps |z| * scale far below 2**22 for |z| < 1.5
        scale = 2.0**exp
        # The kernel clamps only the top bin, so the table must reach every
        # quotient of finite input: |z| < 1.5 (the decoded scale is at least
        # 2/3 of the block's absmax in both scale formats).
        bins = 2 * (int(np.ceil(max(largest, Z_LIMIT) * scale)) + 2)
        if bins > MAX_TABLE_BINS:
            break
        tbins = bin_of(thresholds, scale, bins)
        if tbins.size and np.any(np.diff(tbins) == 0):
            continue
        below = np.searchsorted(tbins, np.arange(bins), side="left")
        has = np.zeros(bins, bool)
        thr = np.full(bins, np.inf, np.float32)
        has[tbins] = True
        thr[tbins] = thresholds
        lo = order[below]
        hi = order[np.minimum(below + has, values.size - 1)]
        table = np.stack([thr.view(np.uint32), (lo | (hi << 8)).astype(np.uint32)], axis=1)
        bin_scale = scale
        break
    return IndexPlan(cb, True, thresholds, order, bin_scale, table)


def select_indices(z: np.ndarray, plan: IndexPlan) -> np.ndarray:
    """FORMAT.md section 4 argmin for float32 ``z`` (already flushed); int64 indices."""
    if plan.fast:
        return plan.order[np.searchsorted(plan.thresholds, z, side="right")]
    best = np.full(z.shape, np.inf, np.float32)
    idx = np.zeros(z.shape, np.int64)
    for j, c in enumerate(plan.codebook):
        d = np.abs(flush_denormals(z - c))
        better = d < best
        best = np.where(better, d, best)
        idx = np.where(better, j, idx)
    return idx


# --------------------------------------------------------------------------
# quantize / dequantize on the CPU

CHUNK_BLOCKS = 1 << 15  # 1M elements per vectorised step


def quantize_blocks(
    x: np.ndarray, k: int, plan: IndexPlan, absmax_format: str, packed: np.ndarray,
    absmax: np.ndarray,
) -> None:
    """Quantize float32 ``x`` (1-D, any length) into preallocated outputs.

    ``packed``: uint32 (nblocks * k,); ``absmax``: uint8 or float16 (nblocks,).
    Raises ValueError (non-finite input, scale overflow) before writing anything.
    """
    n = x.size
    nblocks = nblocks_for(n)
    # Validate everything first: nothing is written on error.
    if not np.all(np.isfinite(x)):
        bad = int(np.flatnonzero(~np.isfinite(x))[0])
        raise ValueError(
            f"input contains NaN or infinity (first at flat index {bad}); "
            "quantization needs finite values"
        )
    limit = E4M4_LIMIT if absmax_format == "e4m4" else FP16_LIMIT
    largest = float(np.max(np.abs(x))) if n else 0.0
    if largest >= limit:
        scales_from_absmax(np.array([largest], np.float32), absmax_format)  # raises
    planes = np.arange(k, dtype=np.int64)
    for start in range(0, nblocks, CHUNK_BLOCKS):
        stop = min(nblocks, start + CHUNK_BLOCKS)
        chunk = x[start * BLOCK : stop * BLOCK]
        if chunk.size < (stop - start) * BLOCK:
            chunk = np.concatenate([chunk, np.zeros((stop - start) * BLOCK - chunk.size, np.float32)])
        xb = flush_denormals(chunk).reshape(-1, BLOCK)
        amax = np.max(np.abs(xb), axis=1)
        stored, scale = scales_from_absmax(amax, absmax_format)
        safe = np.where(scale > 0, scale, np.float32(1))[:, None]
        z = flush_denormals(np.where(scale[:, None] > 0, xb / safe, np.float32(0)))
        idx = select_indices(z, plan)
        bits = ((idx[:, None, :] >> planes[None, :, None]) & 1).astype(np.uint8)  # (nb, k, 32)
        words = np.packbits(bits, axis=2, bitorder="little").reshape(-1, k, 4)
        packed[start * k : stop * k] = words.copy().view("<u4").reshape(-1)
        absmax[start:stop] = stored


def dequantize_blocks(
    packed: np.ndarray, absmax: np.ndarray, codebook: np.ndarray, k: int, n: int, out: np.ndarray
) -> None:
    """Dequantize into the flat float array ``out`` of ``n`` elements (section 6)."""
    cb = flush_denormals(codebook)
    nblocks = nblocks_for(n)
    weights = (1 << np.arange(k, dtype=np.int64))[None, :, None]
    for start in range(0, nblocks, CHUNK_BLOCKS):
        stop = min(nblocks, start + CHUNK_BLOCKS)
        words = np.ascontiguousarray(packed[start * k : stop * k]).astype("<u4").view(np.uint8)
        bits = np.unpackbits(words.reshape(-1, k, 4), axis=2, bitorder="little")  # (nb, k, 32)
        idx = (bits.astype(np.int64) * weights).sum(axis=1)
        scale = decoded_scales(absmax[start:stop])
        y = flush_denormals(cb[idx] * scale[:, None]).reshape(-1)
        end = min(n, stop * BLOCK)
        with np.errstate(over="ignore"):  # beyond fp16 range rounds to inf, as on the GPU
            out[start * BLOCK : end] = y[: end - start * BLOCK].astype(out.dtype)
