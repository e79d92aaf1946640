"""Hand-written vectors from FORMAT.md, run against the package's NumPy path.

Every expected value here is derived by hand from the format page (comments
say how), so a failure points at one concrete clause of FORMAT.md.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kbit_cupy import (
    create_normal_float_codebook,
    decode_absmax_e4m4,
    dequantize_kbit,
    encode_absmax_e4m4,
    quantize_kbit,
)

try:  # tests/ as a package or as a plain directory on sys.path
    from ._reference import E4M4_TABLE, ref_codebook
except ImportError:
    from _reference import E4M4_TABLE, ref_codebook

BF16 = np.dtype(ml_dtypes.bfloat16)
OUT_DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]
FP16_FIX = r"absmax_format\s*=\s*[\"']fp16[\"']"  # the fix the E4M4 error must name
NOT_FINITE = r"(?i)finite|nan|inf"


def u32(words):
    return np.array(words, dtype=np.uint32)


def e4m4(value: float) -> int:
    """The code of an exactly representable E4M4 value (by table lookup)."""
    (hits,) = np.nonzero(E4M4_TABLE == value)
    assert hits.size == 1, value
    return int(hits[0])


# ===================================================================== E4M4
def _hand_table() -> list[float]:
    """The 256 E4M4 values written out from section 3, independent of _reference."""
    table = []
    for e in range(16):
        for m in range(16):
            if e == 0:
                table.append(math.ldexp(m, -14))
            else:
                table.append(math.ldexp(16 + m, e - 11 - 4))
    return table


def test_e4m4_decode_full_table():
    got = decode_absmax_e4m4(np.arange(256, dtype=np.uint8))
    assert got.dtype == np.float32
    assert got.shape == (256,)
    expected = np.array(_hand_table(), dtype=np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    np.testing.assert_array_equal(expected.astype(np.float64), E4M4_TABLE)


@pytest.mark.parametrize(
    "code, value",
    [
        (0x00, 0.0),  # code 0 is exactly 0
        (0x01, 2.0**-14),  # smallest non-zero
        (0x02, 2.0**-13),
        (0x0F, 15 * 2.0**-14),  # largest subnormal
        (0x10, 2.0**-10),  # smallest normal == 16 * 2**-14: no gap
        (0x11, 2.0**-10 * 17 / 16),
        (0xB0, 1.0),  # e = 11: 2**0
        (0xB8, 1.5),
        (0xBF, 1.9375),
        (0xC0, 2.0),
        (0xF0, 16.0),
        (0xFE, 30.0),
        (0xFF, 31.0),  # largest
    ],
)
def test_e4m4_decode_spot_values(code, value):
    got = decode_absmax_e4m4(np.array([code], dtype=np.uint8))
    assert got.dtype == np.float32
    assert got[0] == np.float32(value)


def test_e4m4_table_is_strictly_increasing_and_bounded():
    t = decode_absmax_e4m4(np.arange(256, dtype=np.uint8)).astype(np.float64)
    assert np.all(np.diff(t) > 0)
    assert t[0] == 0.0 and t[-1] == 31.0 and t[1] == 2.0**-14


def test_e4m4_encode_every_code_value_round_trips():
    values = np.array(_hand_table(), dtype=np.float32)
    codes = encode_absmax_e4m4(values)
    assert codes.dtype == np.uint8
    np.testing.assert_array_equal(codes, np.arange(256, dtype=np.uint8))
    codes64 = encode_absmax_e4m4(values.astype(np.float64))
    np.testing.assert_array_equal(codes64, np.arange(256, dtype=np.uint8))


def test_e4m4_encode_carries_into_exponent():
    # 1.97 lies between 1.9375 (0xBF) and 2.0 (0xC0); 2.0 is nearer.
    assert encode_absmax_e4m4(np.array([1.97], np.float32))[0] == 0xC0
    assert encode_absmax_e4m4(np.array([1.97], np.float64))[0] == 0xC0
    # The same at every exponent boundary: just above the midpoint between
    # (e, m=15) and (e+1, m=0) goes up to (e+1, 0), never wraps to (e, 0).
    t = _hand_table()
    for e in range(15):
        lo, hi = (e << 4) | 15, (e + 1) << 4
        mid = (t[lo] + t[hi]) / 2
        above = np.nextafter(np.float32(mid), np.float32(np.inf))
        below = np.nextafter(np.float32(mid), np.float32(0))
        got = encode_absmax_e4m4(np.array([above, below], np.float32))
        assert list(got) == [hi, lo], (e, mid)


def test_e4m4_encode_exact_ties_go_to_even_mantissa():
    t = _hand_table()
    mids, expected = [], []
    for u in range(255):
        mid = (t[u] + t[u + 1]) / 2  # exact in float64 and float32 (6 bits)
        assert float(np.float32(mid)) == mid
        mids.append(mid)
        expected.append(u if (u & 15) % 2 == 0 else u + 1)
    for dtype in (np.float32, np.float64):
        got = encode_absmax_e4m4(np.array(mids, dtype=dtype))
        np.testing.assert_array_equal(got, np.array(expected, np.uint8), err_msg=str(dtype))


@pytest.mark.parametrize(
    "value, code",
    [
        (2.0**-15, 0x00),  # tie between 0 (m=0) and 2**-14 (m=1): even -> 0
        (1.5 * 2.0**-14, 0x02),  # tie between m=1 and m=2 -> m=2
        (2.5 * 2.0**-14, 0x02),  # tie between m=2 and m=3 -> m=2
        (15.5 * 2.0**-14, 0x10),  # subnormal/normal boundary: 0x0F (m=15) vs 0x10 (m=0)
        (1.03125, 0xB0),  # 1.0 (m=0) vs 1.0625 (m=1) -> 1.0
        (1.09375, 0xB2),  # 1.0625 (m=1) vs 1.125 (m=2) -> 1.125
        (1.96875, 0xC0),  # 1.9375 (0xBF) vs 2.0 (0xC0) -> carry, m=0
        (30.5, 0xFE),  # 30.0 (m=14) vs 31.0 (m=15) -> 30.0
        (15.75, 0xF0),  # 15.5 (0xEF, m=15) vs 16.0 (0xF0, m=0) -> 16.0
    ],
)
def test_e4m4_encode_named_ties(value, code):
    got = encode_absmax_e4m4(np.array([value], np.float32))
    assert got[0] == code


def test_e4m4_encode_below_half_smallest_is_zero():
    tiny = np.array(
        [
            0.0,
            2.0**-149,
            2.0**-126,
            1e-10,
            2.0**-16,
            np.nextafter(np.float32(2.0**-15), np.float32(0)),
            2.0**-15,
        ],
        dtype=np.float32,
    )
    np.testing.assert_array_equal(encode_absmax_e4m4(tiny), np.zeros(tiny.size, np.uint8))
    just_above = np.nextafter(np.float32(2.0**-15), np.float32(1))
    assert encode_absmax_e4m4(np.array([just_above], np.float32))[0] == 0x01


def test_e4m4_encode_just_below_limit_is_largest_code():
    below = [
        np.nextafter(np.float32(31.5), np.float32(0)),
        31.49,
        31.25,
        31.0,
        30.51,
    ]
    got = encode_absmax_e4m4(np.array(below, np.float32))
    np.testing.assert_array_equal(got, np.full(len(below), 0xFF, np.uint8))


def test_e4m4_encode_float64_input_is_not_double_rounded():
    # A float64 absmax is encoded from its own value: rounding it to float32
    # first would land these on 31.5 (an error) or on an exact tie.
    cases = [
        (np.nextafter(31.5, 0.0), 0xFF),  # < 31.5: encodes to 31.0
        (1.03125 + 2.0**-40, 0xB1),  # just above the 1.0 / 1.0625 tie -> 1.0625
        (2.0**-15 + 2.0**-60, 0x01),  # just above the 0 / 2**-14 tie -> 2**-14
        (30.5 + 2.0**-30, 0xFF),  # just above the 30 / 31 tie -> 31
    ]
    for value, code in cases:
        assert float(np.float32(value)) != value  # not a float32: a real float64 case
        got = encode_absmax_e4m4(np.array([value], np.float64))
        assert got[0] == code, (value, code, got)


@pytest.mark.parametrize("value", [31.5, 31.5000001, 32.0, 100.0, 65504.0, 1e30])
def test_e4m4_encode_at_or_above_limit_raises(value):
    with pytest.raises(ValueError, match="fp16"):
        encode_absmax_e4m4(np.array([1.0, value], np.float64))
    if np.isfinite(np.float32(value)):
        with pytest.raises(ValueError, match="fp16"):
            encode_absmax_e4m4(np.array([value], np.float32))


@pytest.mark.parametrize("value", [-1.0, -(2.0**-20), np.nan, np.inf, -np.inf])
def test_e4m4_encode_rejects_negative_and_non_finite(value):
    with pytest.raises(ValueError):
        encode_absmax_e4m4(np.array([0.5, value], np.float32))


# ===================================================================== codebook
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_normal_float_codebook_properties(k):
    c = create_normal_float_codebook(k)
    assert isinstance(c, np.ndarray)
    assert c.dtype == np.float32
    assert c.shape == (2**k,)
    assert np.all(np.diff(c) > 0), "sorted ascending, no duplicates"
    np.testing.assert_array_equal(c, -c[::-1])  # symmetric, exactly
    assert not np.any(c == 0), "no zero entry"
    assert np.max(np.abs(c)) == np.float32(1.0)
    assert c[0] == -1 and c[-1] == 1
    np.testing.assert_array_equal(c.view(np.uint32), ref_codebook(k).view(np.uint32))


def test_normal_float_codebook_k2_hand_values():
    # Phi^-1(1/8) = -1.1503493803760079, Phi^-1(3/8) = -0.3186393639643752
    expected = np.array(
        [
            -1.0,
            -0.3186393639643752 / 1.1503493803760079,
            0.3186393639643752 / 1.1503493803760079,
            1.0,
        ]
    )
    np.testing.assert_array_equal(create_normal_float_codebook(2), expected.astype(np.float32))


def test_default_codebook_is_normal_float():
    for k in (2, 3, 4, 5):
        _, _, c = quantize_kbit(np.zeros(32, np.float16), k=k)
        assert c.dtype == np.float32 and c.shape == (2**k,)
        np.testing.assert_array_equal(c.view(np.uint32), ref_codebook(k).view(np.uint32))


# ===================================================================== bit planes
def test_bitplanes_k3_each_lane_its_index_mod_8():
    codebook = (np.arange(8) / 7).astype(np.float32)
    x = codebook[np.arange(32) % 8]  # lane 7 holds 1.0, so absmax = 1.0 exactly
    packed, absmax, _ = quantize_kbit(x, k=3, codebook=codebook)
    # idx[l] = l % 8. Word b, bit l = (idx[l] >> b) & 1:
    #   b=0: odd lanes                 -> 0b...10101010 = 0xAAAAAAAA
    #   b=1: l % 8 in {2, 3, 6, 7}      -> 0xCC per byte = 0xCCCCCCCC
    #   b=2: l % 8 in {4, 5, 6, 7}      -> 0xF0 per byte = 0xF0F0F0F0
    assert packed.dtype == np.uint32
    np.testing.assert_array_equal(packed, u32([0xAAAAAAAA, 0xCCCCCCCC, 0xF0F0F0F0]))
    assert absmax.dtype == np.uint8
    np.testing.assert_array_equal(absmax, np.array([0xB0], np.uint8))  # 1.0
    y = dequantize_kbit(packed, absmax, codebook, 3, 32, dtype=np.float32)
    np.testing.assert_array_equal(y, x)


def test_bitplanes_k3_single_lanes():
    codebook = (np.arange(8) / 7).astype(np.float32)
    x = np.zeros(32, np.float32)
    x[0] = 1.0  # idx 7 = 0b111
    x[5] = codebook[6]  # idx 6 = 0b110
    packed, absmax, _ = quantize_kbit(x, k=3, codebook=codebook)
    np.testing.assert_array_equal(packed, u32([0x00000001, 0x00000021, 0x00000021]))
    np.testing.assert_array_equal(absmax, np.array([0xB0], np.uint8))


def test_bitplanes_k5_lane31_is_the_top_bit():
    codebook = (np.arange(32) / 31).astype(np.float32)
    x = np.zeros(32, np.float32)
    x[31] = 1.0  # idx 31 = 0b11111 in lane 31, idx 0 elsewhere
    packed, absmax, _ = quantize_kbit(x, k=5, codebook=codebook)
    np.testing.assert_array_equal(packed, u32([0x80000000] * 5))
    np.testing.assert_array_equal(absmax, np.array([0xB0], np.uint8))


def test_bitplanes_word_order_is_block_major():
    codebook = np.array([0.0, 1 / 3, 2 / 3, 1.0], np.float32)
    x = np.zeros(64, np.float32)  # block 0: all zeros -> absmax code 0, idx 0
    x[32:63] = codebook[1]  # block 1: lanes 0..30 -> idx 1 (z = 1/3 exactly)
    x[63] = 1.0  # lane 31 -> idx 3, absmax 1.0
    packed, absmax, _ = quantize_kbit(x, k=2, codebook=codebook)
    # packed[blk * k + b]
    np.testing.assert_array_equal(packed, u32([0, 0, 0xFFFFFFFF, 0x80000000]))
    np.testing.assert_array_equal(absmax, np.array([0x00, 0xB0], np.uint8))


def test_padding_is_quantized_as_zero_nf_k2():
    # NF k=2 = [-1, -a, a, 1]: 0.0 is equally far from -a (j=1) and a (j=2);
    # the tie goes to the lowest j, so every padding lane holds idx 1 = 0b01.
    x = np.full(33, -1.0, np.float32)  # block 0: idx 0 everywhere
    x[32] = 1.0  # block 1 lane 0: idx 3 = 0b11
    packed, absmax, _ = quantize_kbit(x, k=2)
    np.testing.assert_array_equal(packed, u32([0, 0, 0xFFFFFFFF, 0x00000001]))
    np.testing.assert_array_equal(absmax, np.array([0xB0, 0xB0], np.uint8))
    # Padding (0.0) never raises absmax: a lone -0.5 gives absmax 0.5 = 0xA0.
    x[32] = -0.5
    packed, absmax, _ = quantize_kbit(x, k=2)
    np.testing.assert_array_equal(packed, u32([0, 0, 0xFFFFFFFE, 0x00000000]))
    np.testing.assert_array_equal(absmax, np.array([0xB0, 0xA0], np.uint8))


def test_dequantize_hand_built_words():
    codebook = np.array([-1.0, -0.5, 0.5, 1.0], np.float32)
    # lanes 0..15: even -> idx 0, odd -> idx 1; lanes 16..31: even -> 2, odd -> 3
    packed = u32([0xAAAAAAAA, 0xFFFF0000])
    absmax = np.array([0xC0], np.uint8)  # 2.0
    lane = np.arange(32)
    idx = (lane % 2) + 2 * (lane >= 16)
    expected = codebook[idx] * 2
    for dtype in OUT_DTYPES:
        y = dequantize_kbit(packed, absmax, codebook, 2, 20, dtype=dtype)
        assert y.dtype == np.dtype(dtype) and y.shape == (20,)
        np.testing.assert_array_equal(y.astype(np.float32), expected[:20])
    # The same with an fp16 absmax of 2.0.
    y = dequantize_kbit(packed, np.array([2.0], np.float16), codebook, 2, 32, dtype=np.float32)
    np.testing.assert_array_equal(y, expected)


def test_dequantize_zero_scale_block_is_signed_zero_product():
    # s_b = 0 -> y = c[idx] * 0.0 in float32: -0.0 for negative entries.
    codebook = np.array([-1.0, -0.5, 0.5, 1.0], np.float32)
    packed = u32([0xAAAAAAAA, 0xFFFF0000])
    lane = np.arange(32)
    idx = (lane % 2) + 2 * (lane >= 16)
    expected = (codebook[idx] * np.float32(0.0)).astype(np.float32)
    for absmax in (np.array([0], np.uint8), np.array([0.0], np.float16)):
        y = dequantize_kbit(packed, absmax, codebook, 2, 32, dtype=np.float32)
        np.testing.assert_array_equal(y.view(np.uint32), expected.view(np.uint32))


# ===================================================================== sizes
@pytest.mark.parametrize("n", [1, 31, 32, 33, 64, 65])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_lengths_and_no_padding_written(n, k):
    rng = np.random.default_rng(n * 10 + k)
    x = rng.standard_normal(n).astype(np.float16)
    packed, absmax, codebook = quantize_kbit(x, k=k)
    nblocks = -(-n // 32)
    assert packed.dtype == np.uint32 and packed.shape == (nblocks * k,)
    assert absmax.dtype == np.uint8 and absmax.shape == (nblocks,)
    for dtype in OUT_DTYPES:
        y = dequantize_kbit(packed, absmax, codebook, k, n, dtype=dtype)
        assert y.shape == (n,) and y.dtype == np.dtype(dtype)
        # out= a view into a larger sentinel buffer: nothing past n is touched
        big = np.full(n + 40, 7.0, dtype=dtype)
        res = dequantize_kbit(packed, absmax, codebook, k, n, dtype=dtype, out=big[:n])
        np.testing.assert_array_equal(big[:n].astype(np.float32), y.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(res).astype(np.float32), y.astype(np.float32))
        assert np.all(big[n:].astype(np.float32) == 7.0)


def test_dequantize_tuple_n_gives_shape():
    x = np.random.default_rng(1).standard_normal((3, 11)).astype(np.float32)
    packed, absmax, codebook = quantize_kbit(x, k=4)
    assert packed.shape == (2 * 4,) and absmax.shape == (2,)
    y = dequantize_kbit(packed, absmax, codebook, 4, (3, 11), dtype=np.float32)
    assert y.shape == (3, 11)
    y_flat = dequantize_kbit(packed, absmax, codebook, 4, 33, dtype=np.float32)
    np.testing.assert_array_equal(y.ravel(), y_flat)


def test_input_is_read_in_c_order():
    x = np.random.default_rng(2).standard_normal((40, 24)).astype(np.float32)
    packed_c, absmax_c, _ = quantize_kbit(np.ascontiguousarray(x), k=3)
    packed_f, absmax_f, _ = quantize_kbit(np.asfortranarray(x), k=3)
    packed_1d, absmax_1d, _ = quantize_kbit(x.ravel(), k=3)
    np.testing.assert_array_equal(packed_c, packed_f)
    np.testing.assert_array_equal(absmax_c, absmax_f)
    np.testing.assert_array_equal(packed_c, packed_1d)
    np.testing.assert_array_equal(absmax_c, absmax_1d)
    # a non-contiguous view too
    view = x[:, ::2]
    packed_v, _, _ = quantize_kbit(view, k=3)
    packed_vc, _, _ = quantize_kbit(np.ascontiguousarray(view), k=3)
    np.testing.assert_array_equal(packed_v, packed_vc)


# ===================================================================== fp16 absmax
def test_fp16_absmax_dtype_and_value():
    x = np.zeros(96, np.float32)
    x[3] = -40.0  # beyond E4M4, fine in fp16
    x[40] = 0.1  # float16(0.1) = 0.0999755859375
    x[70] = 65519.0  # rounds down to 65504 (midpoint to "65536" is 65520)
    packed, absmax, codebook = quantize_kbit(x, k=4, absmax_format="fp16")
    assert absmax.dtype == np.float16 and absmax.shape == (3,)
    np.testing.assert_array_equal(absmax, np.array([40.0, 0.1, 65504.0], np.float16))
    y = dequantize_kbit(packed, absmax, codebook, 4, 96, dtype=np.float32)
    assert y[3] == -40.0 and y[70] == 65504.0


@pytest.mark.parametrize("big", [65520.0, 70000.0, 1e30])
def test_fp16_absmax_overflow_raises(big):
    x = np.zeros(64, np.float32)
    x[40] = big
    with pytest.raises(ValueError):
        quantize_kbit(x, k=4, absmax_format="fp16")


def test_e4m4_absmax_overflow_names_the_fix():
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        x = np.zeros(64, dtype)
        x[40] = 31.5
        with pytest.raises(ValueError, match=FP16_FIX):
            quantize_kbit(x, k=4)
        with pytest.raises(ValueError, match=FP16_FIX):
            quantize_kbit(x, k=4, absmax_format="e4m4")
    x = np.zeros(64, np.float32)
    x[5] = -1000.0
    with pytest.raises(ValueError, match=FP16_FIX):
        quantize_kbit(x, k=2)
    # just below the limit is fine and encodes to 31.0
    x = np.zeros(64, np.float32)
    x[5] = np.nextafter(np.float32(31.5), np.float32(0))
    _, absmax, _ = quantize_kbit(x, k=2)
    np.testing.assert_array_equal(absmax, np.array([0xFF, 0x00], np.uint8))


# ===================================================================== errors
@pytest.mark.parametrize("k", [0, 1, 6, 8])
def test_bad_k_raises(k):
    with pytest.raises(ValueError, match=r"\bk\b"):
        quantize_kbit(np.zeros(32, np.float16), k=k)
    with pytest.raises(ValueError, match=r"\bk\b"):
        dequantize_kbit(
            np.zeros(max(k, 1), np.uint32),
            np.zeros(1, np.uint8),
            np.zeros(2 ** max(k, 1), np.float32),
            k,
            32,
        )


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("delta", [-1, 1, "double"])
def test_wrong_codebook_length_raises(k, delta):
    size = 2 ** (k + 1) if delta == "double" else 2**k + delta
    codebook = np.linspace(-1, 1, size).astype(np.float32)
    with pytest.raises(ValueError, match="codebook"):
        quantize_kbit(np.zeros(32, np.float16), k=k, codebook=codebook)
    with pytest.raises(ValueError, match="codebook"):
        dequantize_kbit(np.zeros(k, np.uint32), np.zeros(1, np.uint8), codebook, k, 32)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_codebook_raises(bad):
    codebook = np.linspace(-1, 1, 16).astype(np.float32)
    codebook[5] = bad
    with pytest.raises(ValueError, match=NOT_FINITE):
        quantize_kbit(np.zeros(32, np.float16), k=4, codebook=codebook)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_raises(dtype, bad):
    x = np.zeros(70, dtype)
    x[50] = bad
    with pytest.raises(ValueError, match=NOT_FINITE):
        quantize_kbit(x, k=4)
    with pytest.raises(ValueError, match=NOT_FINITE):
        quantize_kbit(x, k=4, absmax_format="fp16")


def test_bad_absmax_format_raises():
    with pytest.raises(ValueError, match="absmax_format"):
        quantize_kbit(np.zeros(32, np.float16), k=4, absmax_format="fp8")


@pytest.mark.parametrize(
    "n, nwords, nabsmax",
    [
        (33, 4 * 2 - 1, 2),
        (33, 4 * 2 + 1, 2),
        (33, 4, 1),
        (33, 8, 1),
        (33, 8, 3),
        (32, 4, 2),
        (1, 8, 1),
    ],
)
def test_lengths_not_fitting_n_and_k_raise(n, nwords, nabsmax):
    codebook = create_normal_float_codebook(4)
    with pytest.raises(ValueError):
        dequantize_kbit(np.zeros(nwords, np.uint32), np.zeros(nabsmax, np.uint8), codebook, 4, n)
    with pytest.raises(ValueError):
        dequantize_kbit(np.zeros(nwords, np.uint32), np.zeros(nabsmax, np.float16), codebook, 4, n)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.float64, np.complex64, np.bool_])
def test_unsupported_input_dtype_raises_type_error(dtype):
    with pytest.raises(TypeError):
        quantize_kbit(np.zeros(32, dtype), k=4)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int8])
def test_unsupported_output_dtype_raises_type_error(dtype):
    packed, absmax, codebook = quantize_kbit(np.zeros(32, np.float16), k=4)
    with pytest.raises(TypeError):
        dequantize_kbit(packed, absmax, codebook, 4, 32, dtype=dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.float64])
def test_unsupported_absmax_dtype_raises_type_error(dtype):
    packed, absmax, codebook = quantize_kbit(np.zeros(32, np.float16), k=4)
    with pytest.raises(TypeError):
        dequantize_kbit(packed, absmax.astype(dtype), codebook, 4, 32)


def test_quantize_leaves_input_alone():
    x = np.random.default_rng(3).standard_normal(100).astype(BF16)
    before = x.copy()
    quantize_kbit(x, k=3)
    np.testing.assert_array_equal(x.view(np.uint16), before.view(np.uint16))
