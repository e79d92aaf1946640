"""The package's NumPy path against the independent reference in _reference.py.

Everything is compared bit for bit: packed words, stored absmax, and the
dequantized fp16 / bf16 / fp32 outputs (as raw uint16 / uint32 patterns, so
the sign of zero counts too).
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from _reference import (
    E4M4_TABLE,
    _e4m4_encode_exact,
    _e4m4_encode_float32_values,
    flush_denormals,
    ref_codebook,
    ref_dequantize,
    ref_e4m4_decode,
    ref_quantize,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kbit_cupy import create_normal_float_codebook, dequantize_kbit, quantize_kbit

BF16 = np.dtype(ml_dtypes.bfloat16)
IN_DTYPES = {"fp16": np.dtype(np.float16), "bf16": BF16, "fp32": np.dtype(np.float32)}
OUT_DTYPES = {"fp16": np.dtype(np.float16), "bf16": BF16, "fp32": np.dtype(np.float32)}
ALL_OUT_DTYPES = tuple(OUT_DTYPES.values())
FORMATS = ["e4m4", "fp16"]
KS = [2, 3, 4, 5]
SIZES = [1, 31, 32, 33, 1000, 4096 + 17]
CODEBOOKS = ["nf", "skewed", "unsorted", "duplicates", "zero", "near_dup", "wide", "grid", "tiny"]


def stable_seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


# ====================================================================== reference self-check
def test_reference_fast_e4m4_encoder_equals_exact_one():
    # _reference encodes float32 absmax with float64 distances (argued exact in
    # its docstring); check that against exact rational arithmetic.
    rng = np.random.default_rng(5)
    mids = ((E4M4_TABLE[1:] + E4M4_TABLE[:-1]) / 2).astype(np.float32)
    values = np.concatenate(
        [
            E4M4_TABLE.astype(np.float32),
            mids,
            np.nextafter(mids, np.float32(0)),
            np.nextafter(mids, np.float32(64)),
            np.abs(rng.standard_normal(300) * np.exp(rng.uniform(-100, 3.4, 300))).astype(
                np.float32
            ),
            np.float32([2.0**-149, 2.0**-126, 2.0**-25, 2.0**-15, 2.0**-14]),
        ]
    )
    values = values[values < 31.5]
    fast = _e4m4_encode_float32_values(values.astype(np.float64))
    exact = np.array([_e4m4_encode_exact(float(v)) for v in values], np.uint8)
    np.testing.assert_array_equal(fast, exact)


# ====================================================================== codebooks
def make_codebook(name: str, k: int) -> np.ndarray:
    size = 2**k
    rng = np.random.default_rng(stable_seed("codebook", name, k))
    nf = ref_codebook(k)
    if name == "nf":
        return nf
    if name == "skewed":  # all positive, bunched near 0, asymmetric
        v = np.sort(rng.uniform(0.0, 1.0, size) ** 3)
        return (0.02 + v / v.max() * 0.98).astype(np.float32)
    if name == "unsorted":
        return rng.permutation(nf).astype(np.float32)
    if name == "duplicates":
        c = nf.copy()
        c[1] = c[0]
        c[size // 2] = c[size // 2 + 1]
        c[-2] = c[-1]
        return rng.permutation(c).astype(np.float32) if k >= 4 else c
    if name == "zero":
        c = nf.copy()
        c[size // 2] = 0.0
        return c
    if name == "near_dup":  # neighbours one ulp apart, both directions
        c = nf.copy()
        c[1] = np.nextafter(c[0], np.float32(np.inf))
        c[size // 2] = np.nextafter(c[size // 2 - 1], np.float32(-np.inf))
        c[-1] = np.nextafter(c[-2], np.float32(np.inf))
        return c
    if name == "wide":  # entries well outside [-1, 1], not symmetric
        return (np.linspace(-2.5, 1.75, size) + rng.uniform(-0.01, 0.01, size)).astype(np.float32)
    if name == "grid":  # dyadic entries: midpoints are exact in every dtype
        return ((np.arange(size) - size // 2) / (size // 2)).astype(np.float32)
    if name == "tiny":  # float32 denormal and tiny-normal entries (flush-to-zero)
        c = nf.copy()
        c[0] = -1e-40  # denormal
        c[1] = 3e-39  # denormal
        c[2] = 2.0**-120  # tiny normal
        c[3] = -(2.0**-126)  # smallest normal
        return c
    raise ValueError(name)


# ====================================================================== data
BLOCK_KINDS = [
    "normal",
    "ties",
    "denormal",
    "zeros",
    "tiny_absmax",
    "limit",
    "absmax_ties",
    "wide_range",
    "codebook_points",
    "one_hot",
]


def _block(kind: str, rng, codebook: np.ndarray, absmax_format: str, in_dtype) -> np.ndarray:
    b = np.zeros(32, np.float64)
    if kind == "normal":
        b = rng.standard_normal(32) * rng.choice([1.0, 0.1, 4.0])
    elif kind in ("ties", "codebook_points"):
        # z = x / s_b lands exactly on codebook midpoints / entries:
        # s_b is a power of two, the absmax lane is +-s_b, so z = x / s_b exactly.
        s = 2.0 ** int(rng.integers(-10, 5))
        c = np.unique(flush_denormals(codebook).astype(np.float64))
        mids = (c[:-1] + c[1:]) / 2 if c.size > 1 else c
        pool = (
            np.concatenate([mids, mids, c, [0.0]]) if kind == "ties" else np.concatenate([c, [0.0]])
        )
        pool = pool[np.abs(pool) <= 1.0]
        if pool.size == 0:
            pool = np.array([0.0])
        b = rng.choice(pool, 32) * s
        b[int(rng.integers(32))] = s * rng.choice([-1.0, 1.0])
    elif kind == "denormal":
        b = rng.uniform(-1, 1, 32) * 2.0**-126  # float32 denormals
        variant = int(rng.integers(3))
        if variant == 1:
            b[::3] = rng.uniform(-1, 1, 11) * 2.0**-120  # tiny normals
        elif variant == 2:
            b[::4] = rng.standard_normal(8) * 1e-3
            b[5] = 2.0**-126 * 1.75  # a normal whose quotient is denormal
    elif kind == "zeros":
        b = np.zeros(32) * rng.choice([-1.0, 1.0], 32)  # +-0.0
    elif kind == "tiny_absmax":  # absmax below, at and just above 2**-15
        b = rng.uniform(-1, 1, 32) * 2.0**-15
        b[int(rng.integers(32))] = rng.choice(
            [2.0**-15, 0.999 * 2.0**-15, 2.0**-14, 1.5 * 2.0**-14, 2.0**-16]
        )
    elif kind == "limit":
        if absmax_format == "e4m4":
            top = rng.choice(
                [31.49, 31.25, 31.0, 30.5, 30.75, np.nextafter(np.float32(31.5), np.float32(0))]
            )
        else:
            top = rng.choice([65000.0, 60000.0, 1000.3, 31.5, 40.0, 100.7])
        b = rng.uniform(-1, 1, 32) * top
        b[int(rng.integers(32))] = top * rng.choice([-1.0, 1.0])
    elif kind == "absmax_ties":  # absmax exactly between two E4M4 codes (or two fp16)
        u = int(rng.integers(0, 254))
        top = (E4M4_TABLE[u] + E4M4_TABLE[u + 1]) / 2
        if absmax_format == "fp16" and rng.integers(2):
            top = float(
                rng.choice([1 + 2.0**-11, 1 + 3 * 2.0**-11, 1000 + 0.25, 2.0**-25, 3 * 2.0**-25])
            )
        b = rng.uniform(-1, 1, 32) * top
        b[int(rng.integers(32))] = top * rng.choice([-1.0, 1.0])
    elif kind == "wide_range":
        b = rng.standard_normal(32) * 10.0 ** rng.uniform(-9, 1, 32)
        b = np.clip(b, -31.0, 31.0)
    elif kind == "one_hot":
        b[int(rng.integers(32))] = rng.choice([1.0, -3.0, 0.3])
    else:
        raise ValueError(kind)
    return b


def make_data(n: int, in_dtype, absmax_format: str, codebook: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    nb = -(-n // 32)
    offset = int(rng.integers(len(BLOCK_KINDS)))
    blocks = [
        _block(BLOCK_KINDS[(offset + i) % len(BLOCK_KINDS)], rng, codebook, absmax_format, in_dtype)
        for i in range(nb)
    ]
    x = np.concatenate(blocks)[:n].astype(np.float32).astype(in_dtype)
    # Keep every block legal for its absmax format after rounding to in_dtype
    # (bf16(31.49) is 31.5, for one); the error paths have their own tests.
    limit, safe = (31.5, 31.25) if absmax_format == "e4m4" else (65520.0, 60000.0)
    x32 = x.astype(np.float32)
    too_big = np.abs(x32) >= limit
    x32[too_big] = np.copysign(np.float32(safe), x32[too_big])
    return x32.astype(in_dtype)


# ====================================================================== comparison
def check_against_reference(x, k, codebook, absmax_format, dequant_dtypes=ALL_OUT_DTYPES):
    """quantize + dequantize with the package and the reference; all bit-identical."""
    x_before = bits(x.copy())
    packed, absmax, cb_out = quantize_kbit(x, k=k, codebook=codebook, absmax_format=absmax_format)
    np.testing.assert_array_equal(bits(x), x_before, err_msg="input modified")
    ref_packed, ref_absmax = ref_quantize(x, k, codebook, absmax_format)

    assert packed.dtype == np.uint32 and packed.shape == ref_packed.shape
    assert absmax.dtype == ref_absmax.dtype and absmax.shape == ref_absmax.shape
    assert cb_out.dtype == np.float32 and cb_out.shape == (2**k,)
    expected_cb = ref_codebook(k) if codebook is None else np.asarray(codebook).astype(np.float32)
    np.testing.assert_array_equal(bits(cb_out), bits(expected_cb), err_msg="returned codebook")
    if absmax.dtype == np.float16:
        np.testing.assert_array_equal(bits(absmax), bits(ref_absmax), err_msg="absmax (fp16)")
    else:
        np.testing.assert_array_equal(absmax, ref_absmax, err_msg="absmax (e4m4)")
    np.testing.assert_array_equal(packed, ref_packed, err_msg="packed")

    n = x.size
    for out_dtype in dequant_dtypes:
        y = dequantize_kbit(packed, absmax, cb_out, k, n, dtype=out_dtype)
        y_ref = ref_dequantize(packed, absmax, expected_cb, k, n, out_dtype)
        assert y.dtype == np.dtype(out_dtype) and y.shape == (n,)
        np.testing.assert_array_equal(
            bits(y), bits(y_ref), err_msg=f"dequantize -> {np.dtype(out_dtype)}"
        )
        # A tuple n gives that shape, same values.
        if n % 4 == 0 and n > 0:
            y2 = dequantize_kbit(packed, absmax, cb_out, k, (4, n // 4), dtype=out_dtype)
            assert y2.shape == (4, n // 4)
            np.testing.assert_array_equal(bits(y2).ravel(), bits(y_ref))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codebook_name", CODEBOOKS)
@pytest.mark.parametrize("absmax_format", FORMATS)
@pytest.mark.parametrize("in_name", list(IN_DTYPES))
@pytest.mark.parametrize("k", KS)
def test_matches_reference(k, in_name, absmax_format, codebook_name, n):
    codebook = make_codebook(codebook_name, k)
    x = make_data(
        n,
        IN_DTYPES[in_name],
        absmax_format,
        codebook,
        stable_seed(k, in_name, absmax_format, codebook_name, n),
    )
    check_against_reference(x, k, codebook, absmax_format)


@pytest.mark.parametrize("k", KS)
def test_default_codebook_matches_reference(k):
    x = make_data(500, np.float16, "e4m4", ref_codebook(k), stable_seed("default", k))
    check_against_reference(x, k, None, "e4m4")


@pytest.mark.parametrize("k", KS)
def test_codebook_as_float64_and_list(k):
    rng = np.random.default_rng(stable_seed("f64cb", k))
    cb64 = rng.uniform(-1.3, 1.1, 2**k)  # float64: rounded to float32 (RN) by both
    x = rng.standard_normal(100).astype(np.float32)
    check_against_reference(x, k, cb64, "e4m4", dequant_dtypes=[np.float32])
    check_against_reference(x, k, list(cb64), "fp16", dequant_dtypes=[np.float32])


@pytest.mark.parametrize("shape", [(3, 5, 7), (64, 2), (1, 1), (2, 17, 1)])
def test_multidimensional_input_read_in_c_order(shape):
    rng = np.random.default_rng(stable_seed("shape", shape))
    x = rng.standard_normal(shape).astype(np.float32)
    packed, absmax, cb = quantize_kbit(x, k=3)
    ref_packed, ref_absmax = ref_quantize(x.ravel(order="C"), 3, None, "e4m4")
    np.testing.assert_array_equal(packed, ref_packed)
    np.testing.assert_array_equal(absmax, ref_absmax)
    y = dequantize_kbit(packed, absmax, cb, 3, shape, dtype=np.float32)
    assert y.shape == shape
    y_ref = ref_dequantize(packed, absmax, cb, 3, shape, np.float32)
    np.testing.assert_array_equal(bits(y), bits(y_ref))


# ====================================================================== hand-made cases
def _quantize_one_block(x, codebook, absmax_format="e4m4", k=2):
    x = np.asarray(x, np.float32)
    packed, absmax, cb = quantize_kbit(
        x, k=k, codebook=np.asarray(codebook, np.float32), absmax_format=absmax_format
    )
    ref_packed, ref_absmax = ref_quantize(x, k, np.asarray(codebook, np.float32), absmax_format)
    np.testing.assert_array_equal(packed, ref_packed)
    np.testing.assert_array_equal(bits(absmax), bits(ref_absmax))
    return packed, absmax, cb


def _indices(packed, k=2):
    lane = np.arange(32)
    return sum((((int(packed[b]) >> lane) & 1) << b) for b in range(k))


def test_index_ties_go_to_lowest_j():
    # grid codebook [-1, -0.5, 0.5, 1]; absmax 1.0 so z = x exactly.
    x = np.zeros(32, np.float32)
    x[0] = 1.0  # idx 3
    x[1] = 0.75  # 0.5 (j=2) vs 1.0 (j=3): tie -> 2
    x[2] = -0.75  # -1 (j=0) vs -0.5 (j=1): tie -> 0
    x[3] = 0.0  # -0.5 (j=1) vs 0.5 (j=2): tie -> 1
    packed, _, _ = _quantize_one_block(x, [-1.0, -0.5, 0.5, 1.0])
    idx = _indices(packed)
    assert list(idx[:5]) == [3, 2, 0, 1, 1]
    # the same entries in descending order: ties now go to the other side
    packed, _, _ = _quantize_one_block(x, [1.0, 0.5, -0.5, -1.0])
    idx = _indices(packed)
    assert list(idx[:5]) == [0, 0, 2, 1, 1]
    # duplicated entries: the lowest j of equal entries wins
    packed, _, _ = _quantize_one_block(x, [0.5, -1.0, 0.5, 1.0])
    idx = _indices(packed)
    assert list(idx[:5]) == [3, 0, 1, 0, 0]


def test_ftz_denormal_input_is_zero():
    # fp16 absmax: s_b = 2**-24 (an fp16 subnormal). x[1] = 2**-130 is a
    # float32 denormal: flushed to 0 -> z = 0 -> the 0.0 entry (j=1). Without
    # flushing z = 2**-106 would pick j=2.
    x = np.zeros(32, np.float32)
    x[0] = 2.0**-24
    x[1] = 2.0**-130
    codebook = [-1.0, 0.0, 2.0**-106, 1.0]
    packed, absmax, _ = _quantize_one_block(x, codebook, "fp16")
    assert absmax[0] == np.float16(2.0**-24)
    assert _indices(packed)[1] == 1


def test_ftz_denormal_quotient_is_zero():
    # s_b = 2, x[1] = 1.75 * 2**-126 (normal) -> z = 1.75 * 2**-127 (denormal)
    # -> 0, equally far from -2**-125 (j=1) and 2**-125 (j=2) -> j=1.
    # Unflushed, z is nearer 2**-125 (both distances are normal floats) -> j=2.
    x = np.zeros(32, np.float32)
    x[0] = 2.0
    x[1] = 1.75 * 2.0**-126
    packed, absmax, _ = _quantize_one_block(x, [-1.0, -(2.0**-125), 2.0**-125, 1.0])
    assert absmax[0] == 0xC0
    assert _indices(packed)[1] == 1


def test_ftz_denormal_distance_is_zero():
    # z = 1.25 * 2**-126; |z - 2**-126| and |z - 1.125 * 2**-126| are both
    # denormal -> both 0 -> tie -> lowest j (1), not the truly nearer j=2.
    x = np.zeros(32, np.float32)
    x[0] = 1.0
    x[1] = 1.25 * 2.0**-126
    packed, _, _ = _quantize_one_block(x, [-1.0, 2.0**-126, 1.125 * 2.0**-126, 1.0])
    assert _indices(packed)[1] == 1


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ftz_denormal_product_is_signed_zero(sign):
    # s_b = 2**-14 (E4M4 code 1); lane 1 is 0 -> idx 1 (entry sign * 2**-120);
    # the product sign * 2**-134 is a float32 denormal -> sign-preserving zero.
    x = np.zeros(32, np.float32)
    x[0] = 2.0**-14
    codebook = np.array([-1.0, sign * 2.0**-120, 0.5, 1.0], np.float32)
    packed, absmax, cb = _quantize_one_block(x, codebook)
    assert absmax[0] == 0x01 and _indices(packed)[1] == 1
    y = dequantize_kbit(packed, absmax, cb, 2, 32, dtype=np.float32)
    assert bits(y)[1] == bits(np.array([sign * 0.0], np.float32))[0]
    y_ref = ref_dequantize(packed, absmax, cb, 2, 32, np.float32)
    np.testing.assert_array_equal(bits(y), bits(y_ref))


def test_ftz_denormal_codebook_entry_dequantizes_to_zero():
    # entry 1e-40 is denormal: flushed before the product, so even a scale of
    # 60000 (product 6e-36 would be a normal float32) gives exactly 0.
    x = np.zeros(32, np.float32)
    x[0] = 60000.0
    codebook = np.array([-1.0, 1e-40, 0.5, 1.0], np.float32)
    packed, absmax, cb = _quantize_one_block(x, codebook, "fp16")
    assert _indices(packed)[1] == 1
    for out in OUT_DTYPES.values():
        y = dequantize_kbit(packed, absmax, cb, 2, 32, dtype=out)
        y_ref = ref_dequantize(packed, absmax, cb, 2, 32, out)
        assert float(y[1]) == 0.0
        np.testing.assert_array_equal(bits(y), bits(y_ref))


def test_dequantize_random_words_match_reference():
    # arbitrary packed words / absmax (not produced by quantize), all codes
    rng = np.random.default_rng(11)
    for k in KS:
        for absmax_format in FORMATS:
            n = 32 * 40 - 5
            packed = rng.integers(0, 2**32, 40 * k, dtype=np.uint64).astype(np.uint32)
            if absmax_format == "e4m4":
                absmax = rng.integers(0, 256, 40).astype(np.uint8)
                absmax[:2] = [0, 255]
            else:
                absmax = (rng.standard_normal(40) * 10.0 ** rng.uniform(-7, 4, 40)).astype(
                    np.float16
                )
                absmax[:3] = [0.0, 65504.0, 2.0**-24]
            codebook = make_codebook("wide", k)
            for out in OUT_DTYPES.values():
                y = dequantize_kbit(packed, absmax, codebook, k, n, dtype=out)
                y_ref = ref_dequantize(packed, absmax, codebook, k, n, out)
                np.testing.assert_array_equal(
                    bits(y), bits(y_ref), err_msg=f"k={k} {absmax_format} {out}"
                )


# ====================================================================== hypothesis
def _raises_value_error(fn):
    try:
        return False, fn()
    except ValueError as exc:
        return True, exc


@st.composite
def codebooks(draw, k):
    size = 2**k
    choice = draw(st.sampled_from(["nf", "floats", "few_values", "named"]))
    if choice == "nf":
        return ref_codebook(k)
    if choice == "named":
        return make_codebook(draw(st.sampled_from(CODEBOOKS)), k)
    if choice == "few_values":  # many duplicates
        pool = draw(st.lists(st.floats(-2, 2, width=32), min_size=1, max_size=3))
        return np.array(
            draw(st.lists(st.sampled_from(pool), min_size=size, max_size=size)), np.float32
        )
    vals = draw(
        st.lists(st.floats(-4, 4, width=32, allow_subnormal=True), min_size=size, max_size=size)
    )
    return np.array(vals, np.float32)


@st.composite
def quantize_cases(draw):
    k = draw(st.sampled_from(KS))
    in_dtype = IN_DTYPES[draw(st.sampled_from(list(IN_DTYPES)))]
    absmax_format = draw(st.sampled_from(FORMATS))
    codebook = draw(codebooks(k))
    n = draw(st.integers(1, 200))
    limit = 31.25 if absmax_format == "e4m4" else 60000.0
    scale = draw(st.sampled_from([1.0, 2.0**-14, 2.0**-120, 16.0]))
    c = np.unique(flush_denormals(codebook).astype(np.float64))
    specials = np.concatenate([c, (c[:-1] + c[1:]) / 2, [0.0, 1.0, -1.0]])
    specials = specials[np.abs(specials) <= 1.0] * scale
    element = st.one_of(
        st.floats(-limit, limit, width=32, allow_subnormal=True),
        st.floats(-limit, limit, width=32).map(lambda v: v * 1e-6),
        st.sampled_from(list(specials.astype(np.float32))),
    )
    x = np.array(draw(st.lists(element, min_size=n, max_size=n)), np.float32)
    if draw(st.booleans()):  # sometimes out of range on purpose
        x[draw(st.integers(0, n - 1))] = draw(st.sampled_from([31.5, -31.5, 40.0, 65520.0, 1e5]))
    with np.errstate(over="ignore"):  # 1e5 -> fp16 inf: a non-finite input case
        x = x.astype(in_dtype)
    return k, x, codebook, absmax_format


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(quantize_cases())
def test_property_matches_reference(case):
    k, x, codebook, absmax_format = case
    ref_raised, _ = _raises_value_error(lambda: ref_quantize(x, k, codebook, absmax_format))
    if ref_raised:
        with pytest.raises(ValueError):
            quantize_kbit(x, k=k, codebook=codebook, absmax_format=absmax_format)
        return
    check_against_reference(x, k, codebook, absmax_format)


# Half the spacing of the output dtype relative to the value (round to nearest).
OUT_REL = {"fp16": 2.0**-11, "bf16": 2.0**-8, "fp32": 2.0**-24}


def error_bound(x, absmax_codes_or_fp16, codebook, out_name):
    """Per-element bound on |dequant(quant(x)) - x| implied by FORMAT.md.

    With z = x / s_b, the nearest entry is at most max(max_gap / 2,
    z - max(c), min(c) - z) away (inside the span half the largest gap
    between sorted neighbours; outside it the distance to the nearer end);
    times s_b that is the quantization error. On top: float32 roundings of
    the quotient, the distance compare and the product (a few 2**-24 relative),
    rounding to the output dtype, and flush-to-zero / fp16-subnormal absolutes.
    With s_b == 0 the output is 0 and the error is |x|.
    """
    c = np.unique(flush_denormals(codebook).astype(np.float64))
    max_gap = np.max(np.diff(c)) if c.size > 1 else 0.0
    cabs = np.max(np.abs(c))
    if absmax_codes_or_fp16.dtype == np.uint8:
        s = ref_e4m4_decode(absmax_codes_or_fp16).astype(np.float64)
    else:
        s = absmax_codes_or_fp16.astype(np.float64)
    n = x.size
    s_el = np.repeat(s, 32)[:n]
    xf = x.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(s_el > 0, xf / s_el, 0.0)
    core = np.maximum.reduce([np.full(n, max_gap / 2), z - c[-1], c[0] - z]) * s_el
    core = np.where(s_el > 0, core, np.abs(xf))
    rel = 8 * 2.0**-24 + OUT_REL[out_name]
    tiny = 2.0**-120 + (2.0**-25 if out_name == "fp16" else 0.0)
    return core * (1 + 2.0**-20) + rel * (np.abs(xf) + cabs * s_el) + tiny, max_gap, s


@st.composite
def bound_cases(draw):
    k = draw(st.sampled_from(KS))
    in_name = draw(st.sampled_from(list(IN_DTYPES)))
    absmax_format = draw(st.sampled_from(FORMATS))
    if draw(st.booleans()):
        codebook = ref_codebook(k)
    else:
        vals = draw(st.lists(st.floats(-3, 3, width=32), min_size=2**k, max_size=2**k))
        codebook = np.array(vals, np.float32)
    nblocks = draw(st.integers(1, 6))
    n = draw(st.integers(32 * nblocks - 31, 32 * nblocks))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.uniform(-7, 1.4, nblocks)  # up to ~25
    x = (rng.standard_normal((nblocks, 32)) * scales[:, None]).ravel()[:n]
    x = np.clip(x, -31.0, 31.0).astype(np.float32).astype(IN_DTYPES[in_name])
    return k, in_name, absmax_format, codebook, x


@settings(
    max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(bound_cases())
def test_property_error_bound(case):
    k, _in_name, absmax_format, codebook, x = case
    n = x.size
    packed, absmax, cb = quantize_kbit(x, k=k, codebook=codebook, absmax_format=absmax_format)
    for out_name, out_dtype in OUT_DTYPES.items():
        y = dequantize_kbit(packed, absmax, cb, k, n, dtype=out_dtype)
        assert y.dtype == out_dtype and y.shape == (n,)
        err = np.abs(y.astype(np.float64) - x.astype(np.float64))
        bound, max_gap, s = error_bound(x, absmax, codebook, out_name)
        bad = np.flatnonzero(err > bound)
        assert bad.size == 0, (out_name, bad[:5], x[bad[:5]], y[bad[:5]], bound[bad[:5]])
        if codebook[0] == -1 and codebook[-1] == 1 and np.all(np.diff(codebook) > 0):
            # NF codebook: the per-block form (max_gap/2) * s_b + |absmax - s_b| + rounding
            xf = np.zeros(s.size * 32)
            xf[:n] = x.astype(np.float64)
            absmax_true = (
                np.abs(flush_denormals(xf.astype(np.float32)))
                .reshape(-1, 32)
                .max(1)
                .astype(np.float64)
            )
            rel = 8 * 2.0**-24 + OUT_REL[out_name]
            tiny = 2.0**-120 + (2.0**-25 if out_name == "fp16" else 0.0)
            block_bound = (
                (max_gap / 2 * s + np.abs(absmax_true - s)) * (1 + 2.0**-20)
                + rel * (absmax_true + s)
                + tiny
            )
            err_pad = np.zeros(s.size * 32)
            err_pad[:n] = err
            assert np.all(err_pad.reshape(-1, 32).max(1) <= block_bound), out_name


# ====================================================================== SQNR
SQNR_FLOOR_DB = {2: 7.3, 3: 14.9, 4: 21.1, 5: 26.1}


@pytest.fixture(scope="module")
def normal_samples():
    return np.random.default_rng(20261122).standard_normal(2**20).astype(np.float32)


@pytest.mark.parametrize("k", KS)
def test_sqnr_floor_nf_e4m4(k, normal_samples):
    x = normal_samples
    codebook = create_normal_float_codebook(k)
    packed, absmax, cb = quantize_kbit(x, k=k, codebook=codebook)
    y = dequantize_kbit(packed, absmax, cb, k, x.size, dtype=np.float32)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    sqnr = 10 * np.log10(np.sum(x64**2) / np.sum((x64 - y64) ** 2))
    assert sqnr >= SQNR_FLOOR_DB[k], f"k={k}: SQNR {sqnr:.3f} dB < {SQNR_FLOOR_DB[k]} dB"
    # and the same bits as the reference on the first 2**16 samples' blocks
    m = 2**16
    ref_packed, ref_absmax = ref_quantize(x[:m], k, codebook, "e4m4")
    np.testing.assert_array_equal(packed[: m // 32 * k], ref_packed)
    np.testing.assert_array_equal(absmax[: m // 32], ref_absmax)
