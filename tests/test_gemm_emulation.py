"""The mma kernel's data flow, emulated in NumPy on the repacked tiles.

kernels_src/gemm_mma.cu feeds mma.sync m16n8k16 from the tiles built by
repack_for_gemm: lane 4g + t decodes fields 16j + 8h + 2p + e (block j, row
g + 8h, column 8p + 2t + e) into the A fragment registers {a0: row g, slots
2t..2t+1; a1: row g+8; a2: row g, slots 2t+8..; a3: row g+8, slots 2t+8..}
(the Turing-decomposition order, seeds' development record section 8.5) and
takes B in k order (ldmatrix for mma.sync, shared memory for wgmma). This
test rebuilds exactly those fragments on the CPU, multiplies them as the
instruction defines, and checks the product against the float64 reference,
so a layout error shows up without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kbit_cupy import quantize_weight, repack_for_gemm
from kbit_cupy.format import E4M4_VALUES


def lane_fields(tiles, rt, kt, k):
    """[32 lanes, 128 fields] of indices, from the lane's bit string of 4k words."""
    words = tiles[rt, kt].transpose(1, 0, 2).reshape(32, 4 * k)  # [lane, word]
    bits = ((words[..., None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(32, -1)
    fields = bits[:, : 128 * k].reshape(32, 128, k)
    return (fields << np.arange(k)).sum(axis=-1)


# (row, first k-slot) of A-fragment registers a0..a3 for lane (g, t): the kernel's order.
KERNEL_ORDER = ((0, 0), (8, 0), (0, 8), (8, 8))
SWAPPED_ORDER = ((0, 0), (0, 8), (8, 0), (8, 8))  # a1/a2 exchanged: the classic mistake


def emulate(A, w, order=KERNEL_ORDER, wgmma=False, columns=None):
    """C = A @ dequant(W).T computed the way gemm_mma.cu does (fp16 weights, wide accumulation).

    ``order`` says where registers a0..a3 land in the 16x16 tile (row offset,
    k-slot offset), i.e. the m16n8k16 fragment layout the kernel assumes.
    ``wgmma``: emulate the wgmma path, which reads B for 16-wide slab s of
    block j as columns 32j + 16s .. 32j + 16s + 15 of A. ``columns(p, t, e)``:
    the column within a block that the kernel assumes field 2p + e of lane t
    holds (default: the layout's 8p + 2t + e).
    """
    columns = columns or (lambda p, t, e: 8 * p + 2 * t + e)
    N, K_dim = w.shape
    k = w.k
    tiles, scales = repack_for_gemm(w.packed, w.absmax, k, N, K_dim)
    rt_n, kt_n = tiles.shape[:2]
    M = A.shape[0]
    Apad = np.zeros((8 * -(-M // 8), kt_n * 256), np.float64)
    Apad[:M, :K_dim] = A.astype(np.float64)
    cb16 = w.codebook.astype(np.float16)
    out = np.zeros((Apad.shape[0], rt_n * 16))
    for rt in range(rt_n):
        for kt in range(kt_n):
            f = lane_fields(tiles, rt, kt, k)
            sc = scales[rt, kt]  # [16 rows, 8 blocks]
            s16 = (E4M4_VALUES[sc] if sc.dtype == np.uint8 else sc.astype(np.float32)).astype(np.float16)
            for j in range(8):
                for slab in range(2):
                    Afrag = np.zeros((16, 16))
                    Bfrag = np.zeros((16, Apad.shape[0]))
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        # weight pairs p: columns 8p + 2t, 8p + 2t + 1 of block j, row g + 8h
                        wp = {}
                        for h in range(2):
                            for p in range(4):
                                c0 = f[lane, 16 * j + 8 * h + 2 * p]
                                c1 = f[lane, 16 * j + 8 * h + 2 * p + 1]
                                s = s16[g + 8 * h, j]
                                wp[h, p] = (cb16[c0] * s, cb16[c1] * s)  # HMUL2: fp16 products
                        regs = [wp[0, 2 * slab], wp[1, 2 * slab], wp[0, 2 * slab + 1], wp[1, 2 * slab + 1]]
                        for reg, (drow, dslot) in zip(regs, order):
                            Afrag[g + drow, 2 * t + dslot], Afrag[g + drow, 2 * t + dslot + 1] = reg
                        if wgmma:
                            continue
                        # ldmatrix.x4: lane (g, t) gets words t, 4 + t, 8 + t, 12 + t
                        # of row 8mt + g of the block; slab s: b0 = word 8s + t, b1 = 8s + 4 + t
                        base = kt * 256 + 32 * j
                        for mt in range(Apad.shape[0] // 8):
                            m = 8 * mt + g
                            for slot, p in ((0, 2 * slab), (8, 2 * slab + 1)):
                                for e in range(2):
                                    Bfrag[2 * t + slot + e, m] = Apad[m, base + columns(p, t, e)]
                    if wgmma:
                        col = kt * 256 + 32 * j + 16 * slab
                        Bfrag = Apad[:, col : col + 16].T  # wgmma: B in k order
                    out[:, rt * 16 : rt * 16 + 16] += (Afrag @ Bfrag).T
    return out[:M, :N]


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("fmt", ["e4m4", "fp16"])
def test_emulated_kernel_matches_reference(k, fmt):
    rng = np.random.default_rng(k)
    N, K_dim, M = 20, 288, 3  # two row tiles (one partial), two K tiles (one partial)
    w = quantize_weight(rng.standard_normal((N, K_dim)).astype(np.float32), k=k, absmax_format=fmt)
    A = rng.standard_normal((M, K_dim)).astype(np.float16)
    ref = A.astype(np.float64) @ w.dequantize(np.float32).astype(np.float64).T
    got = emulate(A, w)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-3, err  # fp16 effective weights: about one ulp each (FORMAT.md section 7)


@pytest.mark.parametrize("k", [2, 4, 5])
def test_emulated_wgmma_path_matches_reference(k):
    rng = np.random.default_rng(10 + k)
    N, K_dim, M = 20, 288, 3
    w = quantize_weight(rng.standard_normal((N, K_dim)).astype(np.float32), k=k)
    A = rng.standard_normal((M, K_dim)).astype(np.float16)
    ref = A.astype(np.float64) @ w.dequantize(np.float32).astype(np.float64).T
    got = emulate(A, w, wgmma=True)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-3


def test_emulation_detects_a_wrong_column_order():
    # The emulation has teeth for the layout: B read as if lane t held
    # columns 8t .. 8t+7 of a block (the layout before the k-order one) gives
    # a wrong product.
    rng = np.random.default_rng(4)
    w = quantize_weight(rng.standard_normal((16, 256)).astype(np.float32), k=4)
    A = rng.standard_normal((2, 256)).astype(np.float16)
    ref = A.astype(np.float64) @ w.dequantize(np.float32).astype(np.float64).T
    bad = emulate(A, w, columns=lambda p, t, e: 8 * t + 2 * p + e)
    assert np.linalg.norm(bad - ref) / np.linalg.norm(ref) > 0.1


def test_emulation_detects_a_swapped_fragment_order():
    # The emulation has teeth: exchanging a1 and a2 (rows g+8 vs k-slots 2t+8)
    # loses the structure and the product is far off.
    rng = np.random.default_rng(9)
    w = quantize_weight(rng.standard_normal((16, 256)).astype(np.float32), k=4)
    A = rng.standard_normal((2, 256)).astype(np.float16)
    ref = A.astype(np.float64) @ w.dequantize(np.float32).astype(np.float64).T
    bad = emulate(A, w, order=SWAPPED_ORDER)
    assert np.linalg.norm(bad - ref) / np.linalg.norm(ref) > 0.1


def test_e4m4_scale_pair_bits():
    # gemm_mma.cu and gemm_latency.cu decode an E4M4 code u without a table
    # (mma_common.cuh, block_scale_pair): the bits u << 6 (fp16) or u << 3
    # (bf16) times 16 or 2**116. Check that arithmetic for
    # all 256 codes (subnormal codes 1..15 included) against FORMAT.md section 3.
    import ml_dtypes

    u = np.arange(256, dtype=np.uint16)
    half = (u << 6).view(np.float16) * np.float16(16)
    np.testing.assert_array_equal(half, E4M4_VALUES.astype(np.float16))
    bf16 = (u << 3).view(ml_dtypes.bfloat16) * ml_dtypes.bfloat16(2.0**116)
    np.testing.assert_array_equal(bf16.astype(np.float32),
                                  E4M4_VALUES.astype(ml_dtypes.bfloat16).astype(np.float32))
    # the packed constants the kernel multiplies by
    assert np.float16(16).view(np.uint16) == 0x4C00
    assert ml_dtypes.bfloat16(2.0**116).view(np.uint16) == 0x7980


def test_e4m4_scale_after_the_multiply_bits():
    # gemm_mma.cu's kScaleAfter (k = 4, E4M4, one n8 tile) widens the fp16 bits
    # u << 6 of a code to fp32 (s / 16, subnormal codes included) and multiplies
    # the finished sums by 16: exact for all 256 codes, so the only rounding left
    # is that of the fp32 multiply-adds.
    u = np.arange(256, dtype=np.uint16)
    widened = (u << 6).view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(widened * np.float32(16), E4M4_VALUES.astype(np.float32))


def test_codebook_fold_gives_the_same_effective_weights():
    # KBIT_CB_FOLD (mma_common.cuh, an A/B knob) moves the scale pair's factor
    # into the codebook entries: the kernel then multiplies (c * F) by the bare
    # code bits (s / F) instead of c by (s / F) * F, F = 16 (fp16) or 2**116
    # (bf16). cb_bits forms c * F as the kernel does: c rounded to T, widened
    # to float, times F in float (flushing a float subnormal to zero: -ftz),
    # rounded to T. For every fp16 entry up to 4094 in magnitude (and bf16
    # entries from 2^-126 up to 4080, sampled) and all 256 E4M4 codes, the
    # effective weight must have the same bits as today's; past those limits
    # c * F overflows (or a bf16 entry below 2^-126 flushes to zero), which
    # the kernel's comment says the host must keep off the knob.
    import ml_dtypes

    def folded_entry(c, t, factor):  # cb_bits<T, true>
        r = c.astype(np.float32)
        r = np.where(np.abs(r) < np.float32(2.0**-126), np.copysign(np.float32(0), r), r)  # -ftz
        return (r * np.float32(factor)).astype(t)

    u = np.arange(256, dtype=np.uint16)
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    c = bits[np.isfinite(bits) & (np.abs(bits.astype(np.float32)) <= 4094)]
    s_over_16 = (u << 6).view(np.float16)
    with np.errstate(over="ignore"):  # c * s past 65504 is inf either way (bits compared)
        today = c[:, None] * (s_over_16 * np.float16(16))[None, :]  # one rounding of an exact product
        folded = folded_entry(c, np.float16, 16)[:, None] * s_over_16[None, :]
        assert np.isinf(folded_entry(np.float16([4096]), np.float16, 16)[0])  # (the limit is real)
    np.testing.assert_array_equal(today.view(np.uint16), folded.view(np.uint16))

    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    cb = np.concatenate([rng.uniform(-4080, 4080, 20000), 2.0 ** rng.uniform(-126, 12, 20000),
                         [4080.0, -4080.0, 2.0**-126, 0.0]]).astype(bf)
    s_scaled = (u << 3).view(bf)
    today = (cb[:, None].astype(np.float32) * (s_scaled * bf(2.0**116)).astype(np.float32)[None, :])
    folded = (folded_entry(cb, bf, 2.0**116).astype(np.float32)[:, None]
              * s_scaled.astype(np.float32)[None, :])
    np.testing.assert_array_equal(today.astype(bf).view(np.uint16), folded.astype(bf).view(np.uint16))
    assert folded_entry(np.array([2.0**-127], dtype=bf), bf, 2.0**116)[0] == 0  # (that limit too)
