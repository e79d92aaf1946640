"""A deliberately simple, slow reference of FORMAT.md (sections 1-6).

Written straight from the format page, independently of ``kbit_cupy``, so the
tests can compare the package against it bit for bit. Everything here favours
being obviously right over being fast: brute force over all E4M4 codes and
over all codebook entries, explicit flush-to-zero at every float32 step that
FORMAT.md section 4 names, float64 or exact rationals wherever a comparison
must be exact. Use it on small inputs only (up to ~50k elements).
"""

from __future__ import annotations

from fractions import Fraction
from functools import cache
from statistics import NormalDist

import ml_dtypes
import numpy as np

BLOCK = 32
E4M4_MAX = 31.0
E4M4_LIMIT = 31.5  # absmax >= this rounds past the largest code: an error
FLOAT32_MIN_NORMAL = np.float32(2.0**-126)
OUTPUT_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))


# ---------------------------------------------------------------- helpers
def flush_denormals(a) -> np.ndarray:
    """float32 copy of ``a`` with every denormal replaced by a zero of the same sign.

    This is what ``-ftz=true`` does to float32 inputs and results on the GPU
    (FORMAT.md section 4).
    """
    a = np.array(a, dtype=np.float32, copy=True)
    tiny = np.abs(a) < FLOAT32_MIN_NORMAL
    a[tiny] = np.copysign(np.float32(0.0), a[tiny])
    return a


def nblocks_for(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


# ---------------------------------------------------------------- codebook
def ref_codebook(k: int) -> np.ndarray:
    """Section 2: midpoint quantiles of 2**k equiprobable normal bins, / max|v|."""
    nd = NormalDist()
    size = 2**k
    v = [nd.inv_cdf((i + 0.5) / size) for i in range(size)]  # float64
    top = max(abs(x) for x in v)
    return np.array([x / top for x in v], dtype=np.float64).astype(np.float32)


# ---------------------------------------------------------------- E4M4
def e4m4_value(code: int) -> float:
    """Exact value of one E4M4 code, as a Python float (exact in float64/32)."""
    e, m = code >> 4, code & 15
    if e == 0:
        return m * 2.0**-14
    return 2.0 ** (e - 11) * (1 + m / 16)


E4M4_TABLE = np.array([e4m4_value(u) for u in range(256)], dtype=np.float64)


def ref_e4m4_decode(codes) -> np.ndarray:
    codes = np.asarray(codes)
    return E4M4_TABLE[codes.astype(np.int64)].astype(np.float32)


def _check_e4m4_encodable(a: float) -> None:
    if not np.isfinite(a):
        raise ValueError(f"absmax {a!r} is not finite")
    if a < 0:
        raise ValueError(f"absmax {a!r} is negative")
    if a >= E4M4_LIMIT:
        raise ValueError(
            f"absmax {a!r} >= {E4M4_LIMIT}: the largest E4M4 absmax is {E4M4_MAX}; "
            'use absmax_format="fp16"'
        )


def _pick_even_on_tie(candidates: list[int]) -> int:
    """Among equally near codes (at most two, neighbours) take the even mantissa."""
    if len(candidates) == 1:
        return candidates[0]
    assert len(candidates) == 2, candidates
    even = [u for u in candidates if (u & 15) % 2 == 0]
    assert len(even) == 1, candidates
    return even[0]


@cache
def _e4m4_encode_exact(a: float) -> int:
    """Brute force over all 256 codes with exact rational distances."""
    _check_e4m4_encodable(a)
    fa = Fraction(a)
    dists = [abs(fa - Fraction(e4m4_value(u))) for u in range(256)]
    best = min(dists)
    return _pick_even_on_tie([u for u in range(256) if dists[u] == best])


def _e4m4_encode_float32_values(a: np.ndarray) -> np.ndarray:
    """Brute force over all 256 codes, float64 distances, for float32-exact inputs.

    Why float64 is exact here: every code value is a multiple of 2**-14 below
    32. If a >= 2**-25, a (24 significant bits) is a multiple of 2**-48, so
    |a - v| is a multiple of 2**-48 below 2**5: 53 bits, exact in float64.
    If a < 2**-25 code 0 (distance a) is nearer than every other code by far
    more than any rounding, and rounding is monotone, so the argmin is right
    and no false tie appears. (Cross-checked against the exact version in
    the tests.)
    """
    out = np.empty(a.shape, dtype=np.uint8)
    for i, v in enumerate(a.ravel()):
        v = float(v)
        _check_e4m4_encodable(v)
        dists = np.abs(v - E4M4_TABLE)
        best = dists.min()
        out.flat[i] = _pick_even_on_tie([int(u) for u in np.flatnonzero(dists == best)])
    return out


def ref_e4m4_encode(a) -> np.ndarray:
    """Nearest E4M4 code, exact ties to the even mantissa; ValueError >= 31.5."""
    a64 = np.asarray(a, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        float32_exact = bool(np.all(a64.astype(np.float32).astype(np.float64) == a64))
    if float32_exact:
        return _e4m4_encode_float32_values(a64)
    out = np.empty(a64.shape, dtype=np.uint8)
    for i, v in enumerate(a64.ravel()):
        out.flat[i] = _e4m4_encode_exact(float(v))
    return out


# ---------------------------------------------------------------- fp16 absmax
def ref_fp16_encode(a) -> np.ndarray:
    a32 = np.asarray(a, dtype=np.float32)
    with np.errstate(over="ignore"):
        h = a32.astype(np.float16)  # numpy: round to nearest even
    if not np.all(np.isfinite(h)):
        raise ValueError("absmax rounds to float16 infinity")
    return h


# ---------------------------------------------------------------- quantize
def _as_codebook(codebook, k: int) -> np.ndarray:
    if codebook is None:
        return ref_codebook(k)
    c = np.asarray(codebook).astype(np.float32).ravel()
    if c.size != 2**k:
        raise ValueError(f"codebook must have {2**k} entries")
    if not np.all(np.isfinite(c)):
        raise ValueError("codebook must be finite")
    return c


def _scales(absmax_stored: np.ndarray) -> np.ndarray:
    """Decoded stored absmax s_b as float32 (section 3, last point)."""
    if absmax_stored.dtype == np.uint8:
        return ref_e4m4_decode(absmax_stored)
    assert absmax_stored.dtype == np.float16
    return absmax_stored.astype(np.float32)


def ref_indices(x_flat, k: int, codebook, absmax_format: str = "e4m4"):
    """Sections 1, 3, 4: (idx per padded lane, stored absmax per block)."""
    if k not in (2, 3, 4, 5):
        raise ValueError("k must be 2..5")
    c = flush_denormals(_as_codebook(codebook, k))
    x = np.asarray(x_flat).astype(np.float32).ravel(order="C")
    if not np.all(np.isfinite(x)):
        raise ValueError("input not finite")
    n = x.size
    nb = nblocks_for(n)
    padded = np.zeros(nb * BLOCK, dtype=np.float32)  # padding lanes are 0.0
    padded[:n] = flush_denormals(x)
    blocks = padded.reshape(nb, BLOCK)

    absmax = np.abs(blocks).max(axis=1)  # float32, exact
    if absmax_format == "e4m4":
        stored = ref_e4m4_encode(absmax)
    elif absmax_format == "fp16":
        stored = ref_fp16_encode(absmax)
    else:
        raise ValueError("absmax_format must be 'e4m4' or 'fp16'")
    s = _scales(stored)

    z = np.zeros_like(blocks)
    for b in range(nb):
        if s[b] > 0:
            z[b] = blocks[b] / s[b]  # float32 / float32: IEEE round to nearest
        # else: z stays 0.0
    z = flush_denormals(z)

    idx = np.zeros(blocks.shape, dtype=np.int64)
    best = np.full(blocks.shape, np.inf, dtype=np.float32)
    for j in range(2**k):  # ascending j + strict '<' = ties to lowest j
        d = flush_denormals(np.abs(z - c[j]))  # float32 subtraction
        better = d < best
        idx[better] = j
        best[better] = d[better]
    return idx, stored


def ref_pack(idx: np.ndarray, k: int) -> np.ndarray:
    """Section 5: word b of a block holds bit b of the 32 indices, lane l at bit l.

    ``packed[blk * k + b]`` is word b of block blk.
    """
    idx = np.asarray(idx, dtype=np.uint64).reshape(-1, BLOCK)
    nb = idx.shape[0]
    words = np.zeros((nb, k), dtype=np.uint64)
    for b in range(k):
        for lane in range(BLOCK):
            bit = (idx[:, lane] >> np.uint64(b)) & np.uint64(1)
            words[:, b] |= bit << np.uint64(lane)
    return words.astype(np.uint32).reshape(nb * k)


def ref_unpack(packed, k: int, nblocks: int) -> np.ndarray:
    words = np.asarray(packed, dtype=np.uint32).astype(np.uint64).reshape(nblocks, k)
    idx = np.zeros((nblocks, BLOCK), dtype=np.uint64)
    for b in range(k):
        for lane in range(BLOCK):
            bit = (words[:, b] >> np.uint64(lane)) & np.uint64(1)
            idx[:, lane] |= bit << np.uint64(b)
    return idx.astype(np.int64)


def ref_quantize(x_flat, k: int, codebook=None, absmax_format: str = "e4m4"):
    """-> (packed uint32 [nblocks*k], absmax uint8 or float16 [nblocks])."""
    idx, stored = ref_indices(x_flat, k, codebook, absmax_format)
    return ref_pack(idx, k), stored


# ---------------------------------------------------------------- dequantize
def ref_dequantize(packed, absmax, codebook, k: int, n, out_dtype=np.float16) -> np.ndarray:
    """Section 6: y = c[idx] * s_b in float32 (FTZ), rounded RNE to out_dtype."""
    shape = (n,) if isinstance(n, (int, np.integer)) else tuple(n)
    count = int(np.prod(shape, dtype=np.int64))
    nb = nblocks_for(count)
    absmax = np.asarray(absmax)
    assert absmax.size == nb and np.asarray(packed).size == nb * k
    c = flush_denormals(np.asarray(codebook).astype(np.float32))
    s = _scales(absmax)
    idx = ref_unpack(packed, k, nb)
    y = np.empty((nb, BLOCK), dtype=np.float32)
    for blk in range(nb):
        y[blk] = c[idx[blk]] * s[blk]  # float32 * float32, round to nearest
    y = flush_denormals(y).ravel()[:count]
    out_dtype = np.dtype(out_dtype)
    assert out_dtype in OUTPUT_DTYPES
    with np.errstate(over="ignore"):  # beyond the fp16 range: inf, as RNE says
        return y.astype(out_dtype).reshape(shape)  # numpy / ml_dtypes: RNE
