"""Mixture-of-experts: quantize_experts, kbit_grouped_gemm, moe_linear.

CPU tests pin the API, the NumPy path and the layout; GPU tests (marked, run
on the device) check the grouped kernel against per-expert kbit_gemm and a
float64 reference (FORMAT.md section 7 bounds), every output element written,
determinism, and the routing corner cases.
"""

from __future__ import annotations

import numpy as np
import pytest

from kbit_cupy import (
    KbitExperts,
    _jit,
    kbit_gemm,
    kbit_grouped_gemm,
    moe_linear,
    quantize_experts,
    quantize_weight,
    repack_for_gemm,
)
from kbit_cupy._arrays import BFLOAT16, gpu_available, to_host
from kbit_cupy.experts import _grouped_wgmma, grouped_m_tiles, grouped_wg_m_tiles, route_pairs

BOUNDS = {np.dtype(np.float16): 2e-3, BFLOAT16: 1e-2}


def weights(E, N, K_dim, seed=0):
    return np.random.default_rng(seed).standard_normal((E, N, K_dim)).astype(np.float32)


def reference(x, ids, experts) -> np.ndarray:
    """float64 ``[T, top_k, N]``: every token through each chosen expert."""
    ids = to_host(ids)
    x64 = to_host(x).astype(np.float64)
    out = np.zeros(ids.shape + (experts.shape[1],))
    for e in np.unique(ids):  # only the experts that are used
        w = to_host(experts.expert(int(e)).dequantize(np.float32)).astype(np.float64)
        t, j = np.nonzero(ids == e)
        out[t, j] = x64[t] @ w.T
    return out


def rel_error(got, want) -> float:
    got = np.asarray(got).astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# --------------------------------------------------------------------------
# CPU: objects, layout, NumPy path, errors


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_experts_are_the_format_encoding_of_the_stacked_tensor(k):
    W = weights(3, 24, 64, seed=k)
    ex = quantize_experts(W, k)
    assert ex.shape == (3, 24, 64) and ex.num_experts == 3
    for e in range(3):
        one = quantize_weight(W[e], k)
        assert np.array_equal(ex.expert(e).packed, one.packed)
        assert np.array_equal(ex.expert(e).absmax, one.absmax)
    listed = quantize_experts(list(W), k)
    assert np.array_equal(listed.packed, ex.packed) and np.array_equal(listed.absmax, ex.absmax)
    assert ex.nbytes == ex.packed.nbytes + ex.absmax.nbytes + ex.codebook.nbytes
    assert ex.bits_per_element == pytest.approx(k + 8 / 32)


@pytest.mark.parametrize("N", [16, 20])
def test_tiles_are_each_experts_repack_one_after_another(N):
    W = weights(3, N, 96)
    ex = quantize_experts(W, 3, absmax_format="fp16").prepare()
    tiles, scales = ex._tiles
    parts = [repack_for_gemm(ex.expert(e).packed, ex.expert(e).absmax, 3, N, 96) for e in range(3)]
    assert np.array_equal(tiles, np.concatenate([t for t, _ in parts]))
    assert np.array_equal(scales, np.concatenate([s for _, s in parts]))


def test_numpy_grouped_gemm_is_each_experts_kbit_gemm():
    W = weights(4, 40, 64)
    ex = quantize_experts(W, 4)
    A = np.random.default_rng(1).standard_normal((9, 64)).astype(np.float16)
    offsets = np.array([0, 3, 3, 8, 9], dtype=np.int32)  # expert 1 has no rows
    C = kbit_grouped_gemm(A, ex, offsets)
    for e in range(4):
        r0, r1 = offsets[e], offsets[e + 1]
        assert np.array_equal(C[r0:r1], kbit_gemm(A[r0:r1], ex.expert(e)))


@pytest.mark.parametrize("top_k", [1, 3])
def test_numpy_moe_linear_matches_the_reference(top_k):
    ex = quantize_experts(weights(6, 32, 64), 4)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 64)).astype(np.float16)
    ids = rng.integers(0, 6, (5, top_k))
    y = moe_linear(x, ids, ex)
    assert y.shape == (5, top_k, 32) and y.dtype == np.float16
    assert rel_error(y, reference(x, ids, ex)) < 2e-3


def test_numpy_moe_linear_out_and_empty_inputs():
    ex = quantize_experts(weights(2, 16, 32), 2)
    x = np.ones((3, 32), np.float16)
    out = np.full((3, 1, 16), np.nan, np.float16)
    assert moe_linear(x, np.zeros((3, 1), np.int32), ex, out=out) is out
    assert not np.isnan(out).any()
    assert moe_linear(x[:0], np.zeros((0, 2), np.int32), ex).shape == (0, 2, 16)
    assert moe_linear(x, np.zeros((3, 0), np.int32), ex).shape == (3, 0, 16)


def test_grouped_m_tiles_follows_rows_per_expert():
    assert grouped_m_tiles(1, 128) == 1
    assert grouped_m_tiles(256, 128) == 1  # 2 rows per expert
    assert grouped_m_tiles(1024, 128) == 2  # 8
    assert grouped_m_tiles(4096, 128) == 4  # 32: capped at 32 rows per problem
    assert grouped_m_tiles(10**6, 4) == 4


@pytest.mark.parametrize("rows, experts, tiles", [
    # the points of results/moe_mtiles_ab_h100_*: the fastest measured problem size
    (1024, 128, 2), (5120, 512, 2), (3840, 512, 2),  # 8, 10, 7.5 rows per expert: 16 rows
    (2048, 128, 4), (3072, 128, 4),  # 16, 24: 32-row problems (few experts need two)
    (4096, 128, 6), (256, 8, 6),  # 32: 48 rows hold almost every expert in one problem
    (512, 8, 8),  # 64: one or two 64-row problems
    (768, 8, 16),  # 96: one 128-row problem each (144 rows: 1.07x the time)
    (2048, 8, 18),  # 256: two 144-row problems each
    # 128: one problem of 160 rows each; 144 rows measured 5% faster on the
    # uniform router (no expert past 142 rows), the model's Poisson tail
    # gives 7% of experts a second 144-row problem (results/moe_mtiles_ab_h100_mixtral_651af31.txt)
    (1024, 8, 20),
])
def test_grouped_wg_m_tiles_measured_picks(rows, experts, tiles):
    assert grouped_wg_m_tiles(rows, experts) == tiles


def test_grouped_wg_m_tiles_only_offered_choices():
    for rows in (1, 7, 100, 1000, 5000, 20000):
        assert grouped_wg_m_tiles(rows, 64, (4, 8)) in (4, 8)
        assert grouped_wg_m_tiles(rows, 64, (6,)) == 6


def test_grouped_launch_leaves_mma_sync_below_five_rows_per_expert(monkeypatch):
    from kbit_cupy import experts as ex

    monkeypatch.setattr(ex, "has_wgmma", lambda: True)
    assert not _grouped_wgmma(1280, 512)  # 2.5 rows per expert: mma.sync 9% faster
    assert _grouped_wgmma(2560, 512)  # 5: 16-row wgmma problems 3% faster


@pytest.mark.parametrize("m_tiles", [2, 6, 8, 16])
def test_grouped_hopper_pair_table_where_experts_py_adds_its_shared_memory(m_tiles):
    """k = 4 on the grouped Hopper path: the kernel reads the 64 KB PRMT table
    from dynamic shared memory (its 32 KB static pair table gone) exactly for
    the problem sizes where experts.py adds the 64 KB (offline compile)."""
    pytest.importorskip("cupy")

    wgs = _jit.gemm_grouped_wg_warpgroups(m_tiles, 4)
    (res,) = _jit.compile_check(["sm_90a"], [_jit.Variant("gemm_mma", (4, "float16", "uint8",
                                                                       m_tiles, 1, wgs, True))])
    assert res.ok, res.log
    prmt = m_tiles <= _jit.GEMM_GROUPED_WG_PRMT_MAX_TILES
    assert (res.smem_bytes < 1024) == prmt, (m_tiles, res.smem_bytes)


def test_grouped_eight_warps_only_where_measured(monkeypatch):
    """8 warps a CTA for the grouped mma.sync launch: k = 4 with E4M4 scales
    at one n8 tile on sm_90 (moe_gap_probe_h{100,200}_grouped_wide_3ed1ab3),
    4 warps anywhere else."""
    from kbit_cupy import experts as experts_module

    W = np.random.default_rng(0).standard_normal((2, 16, 64)).astype(np.float32)
    k4, k3 = quantize_experts(W, 4), quantize_experts(W, 3)
    k4_fp16 = quantize_experts(W, 4, absmax_format="fp16")
    monkeypatch.setattr(experts_module, "has_wgmma", lambda: True)
    assert experts_module._grouped_wide(k4, False, 1)
    assert not experts_module._grouped_wide(k4, True, 2)  # the Hopper path
    assert not experts_module._grouped_wide(k4, False, 2)
    assert not experts_module._grouped_wide(k3, False, 1)
    assert not experts_module._grouped_wide(k4_fp16, False, 1)
    monkeypatch.setattr(experts_module, "_GROUPED_WIDE_WARPS", 0)
    assert not experts_module._grouped_wide(k4, False, 1)
    monkeypatch.setattr(experts_module, "_GROUPED_WIDE_WARPS", 8)
    monkeypatch.setattr(experts_module, "has_wgmma", lambda: False)  # sm_80: not measured
    assert not experts_module._grouped_wide(k4, False, 1)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda ex, x: quantize_experts(np.ones((2, 8, 33), np.float32), 4), ValueError, "K_dim"),
        (lambda ex, x: quantize_experts(np.ones((8, 32), np.float32), 4), ValueError, "E, N, K_dim"),
        (lambda ex, x: quantize_experts([np.ones((8, 32)), np.ones((9, 32))], 4), ValueError, "one shape"),
        (lambda ex, x: quantize_experts([], 4), ValueError, "at least one"),
        (lambda ex, x: kbit_grouped_gemm(x.astype(np.float32), ex, [0, 1, 3]), TypeError, "cast"),
        (lambda ex, x: kbit_grouped_gemm(x, ex.expert(0), np.array([0, 1, 3])), TypeError, "KbitExperts"),
        (lambda ex, x: kbit_grouped_gemm(x[:, :16], ex, np.array([0, 1, 3])), ValueError, "K_dim"),
        (lambda ex, x: kbit_grouped_gemm(x, ex, np.array([0, 3])), ValueError, "E \\+ 1"),
        (lambda ex, x: kbit_grouped_gemm(x, ex, np.array([0, 2, 2])), ValueError, "rise from 0"),
        (lambda ex, x: kbit_grouped_gemm(x, ex, np.array([1, 0, 3])), ValueError, "rise from 0"),
        (lambda ex, x: kbit_grouped_gemm(x, ex, np.array([0.0, 1, 3])), TypeError, "integer"),
        (lambda ex, x: kbit_grouped_gemm(x, ex, np.array([0, 1, 3]), out=np.empty((3, 8), np.float16)),
         ValueError, "out must have shape"),
        (lambda ex, x: moe_linear(x, np.array([[0], [2], [1]]), ex), ValueError, "\\[0, 2\\)"),
        (lambda ex, x: moe_linear(x, np.array([[0.0], [1], [1]]), ex), TypeError, "integers"),
        (lambda ex, x: moe_linear(x, np.array([[0], [1]]), ex), ValueError, "same T"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(call, exc, match):
    ex = quantize_experts(weights(2, 16, 32), 4)
    x = np.ones((3, 32), np.float16)
    with pytest.raises(exc, match=match):
        call(ex, x)


# --------------------------------------------------------------------------
# GPU: the grouped kernel

def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")(fn))


def _device_case(E, N, K_dim, T, top_k, k, dtype, seed=0, ids=None, absmax_format="e4m4"):
    import cupy as cp

    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((E, N, K_dim)) * 0.05).astype(np.float32)
    ex = quantize_experts(cp.asarray(W), k, absmax_format=absmax_format)
    x = rng.standard_normal((T, K_dim)).astype(dtype)
    if ids is None:
        ids = np.stack([rng.choice(E, size=top_k, replace=top_k > E) for _ in range(T)])
    return ex, x, np.asarray(ids)


# few pairs: the latency kernel
_LATENCY_CASES = [(8, 48, 64, 1, 2), (16, 100, 96, 3, 4), (1, 64, 32, 5, 1), (64, 256, 2048, 1, 8),
                  (512, 40, 1024, 2, 10)]


def _grouped(ids, E):
    """(the pairs' expert ids, their order grouped by expert (stable), the E + 1 offsets)."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    return flat, order, np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E))]).astype(np.int32)


_MOE_CASES = [
    (8, 48, 64, 1, 2),        # T = 1
    (16, 100, 96, 33, 4),     # N not a multiple of 16
    (1, 64, 32, 17, 1),       # E = 1, K_dim = 32
    (64, 128, 256, 65, 8),    # many experts, a few rows each
    (4, 96, 512, 300, 2),     # 150 rows per expert: several problems
    (16, 300, 288, 130, 8),   # 65 rows per expert, 19 row tiles (one group and part of the next)
]


@gpu_test
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("E, N, K_dim, T, top_k", _MOE_CASES)
def test_gpu_moe_linear_within_format_bounds_and_every_element_written(E, N, K_dim, T, top_k, k, dtype):
    import cupy as cp

    ex, x, ids = _device_case(E, N, K_dim, T, top_k, k, dtype, seed=k)
    out = cp.full((T, top_k, N), np.nan, dtype=dtype)
    y = moe_linear(cp.asarray(x), cp.asarray(ids), ex, out=out)
    got = cp.asnumpy(y)
    assert not np.isnan(got.astype(np.float32)).any()
    assert rel_error(got, reference(x, ids, ex)) <= BOUNDS[np.dtype(dtype)]
    again = moe_linear(cp.asarray(x), cp.asarray(ids), ex)
    assert np.array_equal(cp.asnumpy(again).view(np.uint16), got.view(np.uint16))  # same bits


@gpu_test
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("E, N, K_dim, T, top_k", _LATENCY_CASES)
def test_gpu_moe_linear_latency_kernel(E, N, K_dim, T, top_k, k, dtype, monkeypatch):
    """Few pairs: the latency kernel, one CTA per (pair, row tile) with no
    grouping, within the bounds, every element written, the same bits again;
    ids outside [0, E) (validate=False) leave only their own rows unwritten."""
    import cupy as cp

    from kbit_cupy import experts as experts_module

    monkeypatch.setattr(experts_module, "_latency_moe_max_ctas", lambda N, K_dim: 10**9)
    ex, x, ids = _device_case(E, N, K_dim, T, top_k, k, dtype, seed=k + 20)
    out = cp.full((T, top_k, N), np.nan, dtype=dtype)
    got = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex, out=out))
    assert not np.isnan(got.astype(np.float32)).any()
    assert rel_error(got, reference(x, ids, ex)) <= BOUNDS[np.dtype(dtype)]
    again = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex, validate=False))
    assert np.array_equal(again.view(np.uint16), got.view(np.uint16))
    bad = ids.copy()
    bad[0, 0] = E  # out of range: row (0, 0) is not written
    out = cp.full((T, top_k, N), np.nan, dtype=dtype)
    partial = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(bad), ex, out=out, validate=False))
    assert np.isnan(partial[0, 0].astype(np.float32)).all()
    rest = np.ones((T, top_k), bool)
    rest[0, 0] = False
    assert np.array_equal(partial[rest].view(np.uint16), got[rest].view(np.uint16))


def test_few_row_launch_bound_by_bandwidth_and_expert_size(monkeypatch):
    # experts._latency_moe_max_ctas: 1024 CTAs (H100-measured); 1536 on a GPU
    # of >= 4 TB/s for experts of up to 2^22 weights (H200 A/B,
    # moe_gap_probe_h200_latency_cap*_8436f3c.txt); larger experts keep 1024.
    from kbit_cupy import experts as experts_module

    bound = experts_module._latency_moe_max_ctas
    monkeypatch.setattr(experts_module, "_device_tbps", lambda: 3.35)  # the H100
    assert bound(512, 2048) == 1024 and bound(1536, 2048) == 1024
    monkeypatch.setattr(experts_module, "_device_tbps", lambda: 4.8)  # the H200
    assert bound(512, 2048) == 1536 and bound(1536, 2048) == 1536 and bound(2048, 2048) == 1536
    assert bound(3072, 4096) == 1024 and bound(2049, 2048) == 1024
    monkeypatch.setattr(experts_module, "_LATENCY_MOE_MAX_CTAS_FAST", 1024)  # (an A/B's off)
    assert bound(512, 2048) == 1024


def test_few_pair_launch_takes_half_k_tiles_at_k4_with_e4m4_scales(monkeypatch):
    # experts._MOE_LATENCY_KSPLIT: the few-pair launch's KSPLIT = 2 variant at
    # k = 4 with E4M4 scales on a GPU of >= 4 TB/s (H200 A/B,
    # moe_gap_probe_h200_ksplit2_*), which the compile check builds; whole
    # tiles elsewhere and where an A/B sets 1.
    from kbit_cupy import _jit, gemm
    from kbit_cupy import experts as experts_module

    ksplit = experts_module._moe_latency_ksplit
    monkeypatch.setattr(experts_module, "_device_tbps", lambda: 3.35)  # the H100: not measured
    assert ksplit(4, np.uint8) == 1
    monkeypatch.setattr(experts_module, "_device_tbps", lambda: 4.8)  # the H200
    assert ksplit(4, np.uint8) == 2
    assert ksplit(4, np.float16) == 1 and ksplit(2, np.uint8) == 1 and ksplit(5, np.uint8) == 1
    names = {v.name for v in _jit.all_variants()}
    for dtype in ("float16", "bfloat16"):
        assert _jit.kernel_name("gemm_latency", 4, dtype, "uint8", 1, False, False, 2) in names
    monkeypatch.setattr(experts_module, "_MOE_LATENCY_KSPLIT", 1)
    assert ksplit(4, np.uint8) == 1
    # an A/B build's KBIT_LATENCY_KSPLIT overrides the variant's (the kernel does the same)
    assert gemm.latency_ksplit(2) == 2 and gemm.latency_ksplit() == 1
    monkeypatch.setattr(_jit, "GEMM_LATENCY_KSPLIT", 4)
    assert gemm.latency_ksplit(2) == 4 and gemm.latency_ksplit() == 4


@gpu_test
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("E, N, K_dim, T, top_k", _LATENCY_CASES)
def test_gpu_few_pair_launch_half_k_tiles_against_whole_tiles(E, N, K_dim, T, top_k, dtype,
                                                             monkeypatch, kernel_requests):
    """k = 4, E4M4: the few-pair launch runs half K tiles a warp (KSPLIT = 2)
    with up to twice the warps of whole tiles, within the bounds of the
    reference and of the whole-tile launch, every element written, the same
    bits again."""
    import cupy as cp

    from kbit_cupy import experts as experts_module

    monkeypatch.setattr(experts_module, "_latency_moe_max_ctas", lambda N, K_dim: 10**9)
    monkeypatch.setattr(experts_module, "_MOE_LATENCY_KSPLIT_MIN_TBPS", 0.0)  # any GPU
    asked = kernel_requests
    ex, x, ids = _device_case(E, N, K_dim, T, top_k, 4, dtype, seed=40)
    got, blocks = {}, {}
    for ksplit in (2, 1):
        monkeypatch.setattr(experts_module, "_MOE_LATENCY_KSPLIT", ksplit)
        ex._plans = {}
        del asked[:]
        out = cp.full((T, top_k, N), np.nan, dtype=dtype)
        got[ksplit] = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex, out=out))
        assert not np.isnan(got[ksplit].astype(np.float32)).any(), ksplit
        again = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex))
        assert np.array_equal(again.view(np.uint16), got[ksplit].view(np.uint16)), ksplit
        latency = [args for family, args in asked if family == "gemm_latency"]
        assert latency and all(len(a) == (7 if ksplit == 2 else 4) for a in latency), latency
        blocks[ksplit] = {run._launch.block[0] for run in ex._plans.values()}
        assert rel_error(got[ksplit], reference(x, ids, ex)) <= BOUNDS[np.dtype(dtype)], ksplit
    kt = K_dim // 256 + (K_dim % 256 > 0)
    assert max(blocks[2]) <= 32 * min(16, 2 * kt) and max(blocks[1]) <= 32 * min(16, kt), blocks
    assert max(blocks[2]) >= max(blocks[1]), blocks  # as many warps at least, for twice the units
    assert rel_error(got[2], got[1].astype(np.float32)) <= BOUNDS[np.dtype(dtype)]


@gpu_test
@pytest.mark.parametrize("wg", [False, True], ids=["mma", "wgmma"])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("E, N, K_dim, T, top_k", _MOE_CASES)
def test_gpu_grouped_launch_on_both_paths(E, N, K_dim, T, top_k, k, dtype, wg, monkeypatch):
    """The grouped launch forced onto mma.sync or the Hopper path (sm_90):
    within the format's bounds, every element written, the same bits again,
    through moe_linear's routing launch and through kbit_grouped_gemm."""
    import cupy as cp

    from kbit_cupy import experts as experts_module
    from kbit_cupy.gemm import has_wgmma

    if wg and not has_wgmma():
        pytest.skip("the Hopper path needs an sm_90 GPU")
    monkeypatch.setattr(experts_module, "_GROUPED_WG", wg)
    monkeypatch.setattr(experts_module, "_GROUPED_LATENCY", False)  # few rows too
    monkeypatch.setattr(experts_module, "_FUSED_ROUTE_MAX_PAIRS", 0)  # the routing launch
    ex, x, ids = _device_case(E, N, K_dim, T, top_k, k, dtype, seed=k + 10)
    out = cp.full((T, top_k, N), np.nan, dtype=dtype)
    got = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex, out=out))
    assert not np.isnan(got.astype(np.float32)).any()
    assert rel_error(got, reference(x, ids, ex)) <= BOUNDS[np.dtype(dtype)]
    again = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex))
    assert np.array_equal(again.view(np.uint16), got.view(np.uint16))
    _, order, offsets = _grouped(ids, E)
    rows = x[order // top_k]
    C = cp.asnumpy(kbit_grouped_gemm(cp.asarray(rows), ex, cp.asarray(offsets)))
    assert np.array_equal(C.view(np.uint16), got.reshape(-1, N)[order].view(np.uint16))


@gpu_test
@pytest.mark.parametrize("wg", [False, True], ids=["mma", "wgmma"])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("E, N, K_dim, T, top_k, hopper_in_launch", [
    (16, 300, 288, 130, 8, True),    # 1040 pairs, 65 rows per expert: 64-row problems, two each
    (128, 100, 256, 512, 8, True),   # 4096 pairs (the cap), 32 rows per expert
    (8, 96, 512, 200, 2, True),      # 50 rows per expert, 8 experts
    (512, 40, 1024, 200, 10, True),  # 2000 pairs over 512 experts: a CTA's units span many problems
    # 75 rows per expert: 128-row problems, whose three stages and k = 4's
    # pair table leave too little shared memory for 600 routed pairs on the
    # Hopper path, which then routes in its own launch (mma.sync: problems of
    # 32 rows, several an expert, in the launch)
    (8, 96, 512, 300, 2, False),
])
def test_gpu_moe_linear_routing_inside_the_launch_matches_the_routing_launch(
        E, N, K_dim, T, top_k, hopper_in_launch, dtype, wg, monkeypatch):
    """Up to _FUSED_ROUTE_MAX_PAIRS pairs every CTA of the grouped launch
    places the rows of the problems it works on itself, where the ids and
    the order fit its shared memory: the same rows as the routing launch
    (moe_route.cu's stable order), so here, where both launch as many CTAs,
    the same bits; ids outside [0, E) (validate=False) leave only their own
    rows unwritten; within the bounds of the reference. int32 ids take the
    planned launch directly (_fast_launch), also where the plan says to
    route in a launch of its own."""
    import cupy as cp

    from kbit_cupy import experts as experts_module
    from kbit_cupy.gemm import has_wgmma

    if wg and not has_wgmma():
        pytest.skip("the Hopper path needs an sm_90 GPU")
    monkeypatch.setattr(experts_module, "_GROUPED_WG", wg)
    monkeypatch.setattr(experts_module, "_GROUPED_LATENCY", False)  # the grouped launch
    monkeypatch.setattr(experts_module, "_latency_moe_max_ctas", lambda N, K_dim: 0)
    ex, x, ids = _device_case(E, N, K_dim, T, top_k, 4, dtype, seed=E + T)
    bad = ids.copy()
    bad[0, 0], bad[T // 2, top_k - 1] = E, -1  # no rows
    got = {}
    for cap in (T * top_k, 0):  # in the launch, then through the routing launch
        monkeypatch.setattr(experts_module, "_FUSED_ROUTE_MAX_PAIRS", cap)
        out = cp.full((T, top_k, N), np.nan, dtype=dtype)
        got[cap] = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(bad), ex, out=out,
                                         validate=False))
        if cap:  # the routed plan: a launch, or False (routed in their own launch)
            (routed,) = [run for key, run in ex._plans.items() if key[2]]
            assert bool(routed) == (hopper_in_launch or not wg)
            ids32 = cp.asarray(np.where((bad >= 0) & (bad < E), bad, -1).astype(np.int32))
            for _ in range(2):  # the second call: _fast_launch with the plan made
                out = cp.full((T, top_k, N), np.nan, dtype=dtype)
                again = cp.asnumpy(moe_linear(cp.asarray(x), ids32, ex, out=out, validate=False))
                assert np.array_equal(again.view(np.uint16), got[cap].view(np.uint16))
    assert np.array_equal(got[T * top_k].view(np.uint16), got[0].view(np.uint16))
    written = np.ones((T, top_k), bool)
    written[0, 0] = written[T // 2, top_k - 1] = False
    assert np.isnan(got[0][~written].astype(np.float32)).all()
    assert not np.isnan(got[0][written].astype(np.float32)).any()
    assert rel_error(got[0][written], reference(x, ids, ex)[written]) <= BOUNDS[np.dtype(dtype)]


@gpu_test
@pytest.mark.parametrize("routing", ["in_launch", "routing_launch"])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("E, N, K_dim, T, top_k", [
    (64, 100, 96, 8, 4),      # 7 row tiles: one short group of 8 warps
    (128, 300, 288, 16, 8),   # 19 row tiles: two groups and a short one
    (512, 40, 1024, 37, 10),  # 3 row tiles, 512 experts
    (8, 2064, 2048, 3, 2),    # 129 row tiles, 8 K tiles
])
def test_gpu_grouped_eight_warp_launch(E, N, K_dim, T, top_k, dtype, routing, monkeypatch):
    """k = 4, E4M4, about one row per expert on sm_90: the grouped mma.sync
    launch at 8 warps a CTA (experts._grouped_wide: the PRMT-addressed pair
    table, the scale after the multiply) through moe_linear (routing inside the
    launch or the routing launch) and kbit_grouped_gemm: within the format's
    bounds, every element written, the same bits again; the 4-warp launch of
    the same calls within the bounds too."""
    import cupy as cp

    from kbit_cupy import experts as experts_module
    from kbit_cupy.gemm import has_wgmma

    if not has_wgmma():
        pytest.skip("the 8-warp grouped launch is taken on sm_90 only")
    monkeypatch.setattr(experts_module, "_GROUPED_LATENCY", False)  # few rows: the grouped launch
    monkeypatch.setattr(experts_module, "_latency_moe_max_ctas", lambda N, K_dim: 0)  # few pairs too
    if routing == "routing_launch":
        monkeypatch.setattr(experts_module, "_FUSED_ROUTE_MAX_PAIRS", 0)
    ex, x, ids = _device_case(E, N, K_dim, T, top_k, 4, dtype, seed=E + N)
    assert not experts_module._grouped_wgmma(T * top_k, E)
    assert experts_module.grouped_m_tiles(T * top_k, E) == 1
    assert experts_module._grouped_wide(ex, False, 1)
    _, order, offsets = _grouped(ids, E)
    rows = cp.asarray(x[order // top_k])
    ref = reference(x, ids, ex)
    results = {}
    for warps in (8, 0):
        monkeypatch.setattr(experts_module, "_GROUPED_WIDE_WARPS", warps)
        ex._plans.clear()
        out = cp.full((T, top_k, N), np.nan, dtype=dtype)
        got = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex, out=out))
        assert not np.isnan(got.astype(np.float32)).any(), warps
        assert rel_error(got, ref) <= BOUNDS[np.dtype(dtype)], warps
        again = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex))
        assert np.array_equal(again.view(np.uint16), got.view(np.uint16)), warps
        C = cp.full((T * top_k, N), np.nan, dtype=dtype)
        C = cp.asnumpy(kbit_grouped_gemm(rows, ex, cp.asarray(offsets), out=C))
        assert np.array_equal(C.view(np.uint16), got.reshape(-1, N)[order].view(np.uint16)), warps
        blocks = {run._launch.block[0] for run in ex._plans.values()}
        assert blocks == ({256} if warps else {128}), (warps, blocks)
        results[warps] = got
    assert rel_error(results[8], results[0].astype(np.float32)) <= BOUNDS[np.dtype(dtype)]


@gpu_test
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("E, N, K_dim, T, top_k", [*_LATENCY_CASES, (600, 24, 64, 1, 1)])
def test_gpu_grouped_gemm_few_rows_on_the_latency_kernel(E, N, K_dim, T, top_k, k, dtype,
                                                         monkeypatch):
    """Few rows: kbit_grouped_gemm on the latency kernel, each CTA finding its
    row's expert in the offsets (experts without rows between; 600 experts:
    more than a CTA's threads), gives the bits of moe_linear's latency launch
    for the same (row, expert) pairs, writes every element, and leaves the
    rows no expert owns unwritten (validate=False, offsets ending early)."""
    import cupy as cp

    from kbit_cupy import experts as experts_module

    monkeypatch.setattr(experts_module, "_latency_moe_max_ctas", lambda N, K_dim: 10**9)
    ex, x, ids = _device_case(E, N, K_dim, T, top_k, k, dtype, seed=k + 30)
    routed = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex)).reshape(-1, N)
    flat, order, offsets = _grouped(ids, E)
    rows = cp.asarray(x[order // top_k])
    out = cp.full((len(flat), N), np.nan, dtype=dtype)
    C = cp.asnumpy(kbit_grouped_gemm(rows, ex, cp.asarray(offsets), out=out))
    assert np.array_equal(C.view(np.uint16), routed[order].view(np.uint16))
    short = np.minimum(offsets, len(flat) - 1)  # the offsets end a row early
    out = cp.full((len(flat), N), np.nan, dtype=dtype)
    part = cp.asnumpy(kbit_grouped_gemm(rows, ex, cp.asarray(short), out=out, validate=False))
    assert np.isnan(part[-1].astype(np.float32)).all()  # no expert owns the last row
    # the other rows keep their expert (only the last offsets moved), so their bits
    assert np.array_equal(part[:-1].view(np.uint16), C[:-1].view(np.uint16))


@gpu_test
def test_gpu_grouped_gemm_few_rows_longer_than_the_latency_kernel_stages():
    """Few rows of A too long for the latency kernel's shared memory (2^17
    columns of fp16: 256 KB a row) take the grouped launch instead of an error."""
    import cupy as cp

    ex, x, _ = _device_case(2, 16, 1 << 17, 2, 1, 4, np.float16)
    offsets = np.array([0, 1, 2], np.int32)
    C = cp.asnumpy(kbit_grouped_gemm(cp.asarray(x), ex, cp.asarray(offsets)))
    want = np.concatenate([x[e:e + 1].astype(np.float64)
                           @ to_host(ex.expert(e).dequantize(np.float32)).astype(np.float64).T
                           for e in range(2)])
    assert rel_error(C, want) <= BOUNDS[np.dtype(np.float16)]


@gpu_test
@pytest.mark.parametrize("k, tiles", [(k, t) for k in (2, 3, 4, 5) for t in _jit.gemm_grouped_wg_m_tiles(k)])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
def test_gpu_grouped_hopper_path_every_problem_size(tiles, k, dtype, monkeypatch):
    """The Hopper path with problems of 8 * tiles rows (16..160; 65 rows per
    expert: one to five problems, the last one partial, 19 row tiles; 144
    and 160 rows, two stages: 330 rows per expert, three problems, and five
    K tiles, the last partial): poisoned output all written, within the
    bound, the same bits again."""
    import cupy as cp

    from kbit_cupy import experts as experts_module
    from kbit_cupy.gemm import has_wgmma

    if not has_wgmma():
        pytest.skip("the Hopper path needs an sm_90 GPU")
    monkeypatch.setattr(experts_module, "_GROUPED_WG", True)
    monkeypatch.setattr(_jit, "GEMM_GROUPED_WG_M_TILES", (tiles,))
    E, N, K_dim, T, top_k = 16, 300, 288, 130, 8
    if _jit.gemm_wg_stages(tiles) == 2:
        K_dim, T = 1120, 660
    ex, x, ids = _device_case(E, N, K_dim, T, top_k, k, dtype, seed=tiles + k)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    offsets = cp.asarray(np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E))])
                         .astype(np.int32))
    rows = cp.asarray(x[order // top_k])
    out = cp.full((T * top_k, N), np.nan, dtype=dtype)
    got = cp.asnumpy(kbit_grouped_gemm(rows, ex, offsets, out=out))
    assert not np.isnan(got.astype(np.float32)).any()
    want = reference(x, ids, ex).reshape(-1, N)[order]
    assert rel_error(got, want) <= BOUNDS[np.dtype(dtype)]
    again = cp.asnumpy(kbit_grouped_gemm(rows, ex, offsets))
    assert np.array_equal(again.view(np.uint16), got.view(np.uint16))


@gpu_test
@pytest.mark.parametrize("E", [8, 256])
def test_gpu_grouped_128_row_problems_or_smaller_where_shared_memory_ends(E, monkeypatch):
    """~100 rows per expert picks problems of 128 rows or more (8 experts);
    offered at most 128 (256 experts), with k=4's pair table their three
    stages and the tables pass the shared-memory limit, and the launch takes
    64-row problems instead of failing. (128 experts did, with bf16's 1 KB
    scale table; bf16 computes the scale pair since c32e066.)"""
    import cupy as cp

    from kbit_cupy.gemm import has_wgmma

    if not has_wgmma():
        pytest.skip("the Hopper path needs an sm_90 GPU")
    if E == 256:  # (144 and 160 rows take two stages, which fit)
        monkeypatch.setattr(_jit, "GEMM_GROUPED_WG_M_TILES",
                            tuple(t for t in _jit.GEMM_GROUPED_WG_M_TILES if t <= 16))
    N, K_dim, rows = 40, 96, 100
    rng = np.random.default_rng(E)
    W = (rng.standard_normal((E, N, K_dim)) * 0.05).astype(np.float32)
    ex = quantize_experts(cp.asarray(W), 4)
    counts = rng.integers(rows - 10, rows + 40, size=E)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    A = rng.standard_normal((int(offsets[-1]), K_dim)).astype(BFLOAT16)
    got = cp.asnumpy(kbit_grouped_gemm(cp.asarray(A), ex, cp.asarray(offsets)))
    want = np.concatenate([A[offsets[e]:offsets[e + 1]].astype(np.float64)
                           @ to_host(ex.expert(e).dequantize(np.float32)).astype(np.float64).T
                           for e in range(E)])
    assert rel_error(got, want) <= BOUNDS[BFLOAT16]
    # its dynamic shared memory: the stages of a problem's rows, the problem
    # tables and (64-row problems) the PRMT-addressed pair table
    (run,) = ex._plans.values()
    tiles = _jit.GEMM_GROUPED_WG_M_TILES
    rows_per_problem = 8 * grouped_wg_m_tiles(int(offsets[-1]), E, tiles) if E == 8 else 64
    assert rows_per_problem >= 128 or E != 8
    table = _jit.gemm_prmt_table_bytes(4, rows_per_problem // 8, 2, True, 4)
    assert table == (0 if E == 8 else _jit.PRMT_TABLE_BYTES)
    stages = _jit.gemm_wg_stages(rows_per_problem // 8)
    stage_rows = (run._launch.shared - 2 * (E + 1) * 4 - 1024 - table) // (stages * 256 * 2)
    assert stage_rows == rows_per_problem


@gpu_test
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
def test_gpu_grouped_gemm_matches_per_expert_kbit_gemm(dtype):
    """Each expert's rows agree with that expert's own kbit_gemm within the bound."""
    import cupy as cp

    E, N, K_dim = 12, 200, 320
    ex, x, _ = _device_case(E, N, K_dim, 90, 1, 4, dtype)
    sizes = np.array([0, 9, 0, 0, 30, 1, 2, 0, 17, 8, 23, 0])  # zeros: experts without rows
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    A = cp.asarray(x)
    out = cp.full((90, N), np.nan, dtype=dtype)
    C = cp.asnumpy(kbit_grouped_gemm(A, ex, cp.asarray(offsets), out=out))
    assert not np.isnan(C.astype(np.float32)).any()  # every row is some expert's
    for e in range(E):
        r0, r1 = offsets[e], offsets[e + 1]
        if r1 > r0:
            own = cp.asnumpy(kbit_gemm(A[r0:r1], ex.expert(e)))
            w = ex.expert(e).dequantize(np.float32).get().astype(np.float64)
            want = x[r0:r1].astype(np.float64) @ w.T
            assert rel_error(C[r0:r1], want) <= BOUNDS[np.dtype(dtype)]
            # the same weights through the dense kernel: both round once to dtype
            assert rel_error(C[r0:r1], own.astype(np.float64)) <= BOUNDS[np.dtype(dtype)]


@gpu_test
@pytest.mark.parametrize("case", ["one_expert_takes_all", "top_k_10", "E_512", "T_1_top_1",
                                  "one_cta_per_group"])
def test_gpu_routing_corner_cases(case):
    import cupy as cp

    if case == "one_expert_takes_all":
        ex, x, ids = _device_case(32, 64, 128, 70, 1, 4, np.float16, ids=np.full((70, 1), 5))
    elif case == "top_k_10":
        ex, x, ids = _device_case(40, 64, 128, 9, 10, 3, np.float16)
    elif case == "E_512":
        ex, x, ids = _device_case(512, 32, 64, 40, 10, 4, np.float16)
    elif case == "T_1_top_1":
        ex, x, ids = _device_case(8, 64, 64, 1, 1, 5, BFLOAT16)
    else:  # 8 experts x 32 groups >= the SMs, 3 K tiles: one CTA per group (no stream-K)
        ex, x, ids = _device_case(128, 2048, 768, 1, 8, 4, np.float16)
    y = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex))
    assert rel_error(y, reference(x, ids, ex)) <= BOUNDS[np.dtype(x.dtype)]


@gpu_test
@pytest.mark.parametrize("few_rows_path", [True, False], ids=["latency", "grouped"])
def test_gpu_unvalidated_bad_offsets_stay_inside_the_arrays(few_rows_path, monkeypatch):
    """validate=False: offsets outside [0, T] are clamped on the device, nothing outside
    A or C is touched; on the few-rows (latency) path and on the grouped launch."""
    import cupy as cp

    from kbit_cupy import experts as experts_module

    monkeypatch.setattr(experts_module, "_GROUPED_LATENCY", few_rows_path)
    ex, x, _ = _device_case(4, 32, 64, 10, 1, 4, np.float16)
    A = cp.asarray(x)
    bad = cp.asarray(np.array([-5, 4, 4, 30, 20], np.int32))  # clamped: 0, 4, 4, 10, 10
    C = kbit_grouped_gemm(A, ex, bad, validate=False)
    cp.cuda.Device().synchronize()
    # after clamping expert 0 owns rows 0..3 and expert 2 rows 4..9: those are right
    for e, (r0, r1) in ((0, (0, 4)), (2, (4, 10))):
        w = ex.expert(e).dequantize(np.float32).get().astype(np.float64)
        assert rel_error(cp.asnumpy(C[r0:r1]), x[r0:r1].astype(np.float64) @ w.T) <= 2e-3
    with pytest.raises(ValueError, match="rise from 0"):
        kbit_grouped_gemm(A, ex, bad)



@gpu_test
@pytest.mark.parametrize("few_rows_path", [True, False], ids=["latency", "grouped"])
def test_gpu_unvalidated_falling_offsets_past_the_problem_bound_are_cut(few_rows_path,
                                                                         monkeypatch):
    """16 experts with offsets 0, 10, 0, 10, ...: 8 experts claim all 10 rows. The
    grouped launch has 16 problems, past its bound of 11, and drops the rest; the
    few-rows launch gives each row one expert. Both stay inside the arrays, and
    every element holds one of the claiming experts' values (on the grouped launch
    different experts' CTAs may write different elements of one row last)."""
    import cupy as cp

    from kbit_cupy import experts as experts_module

    monkeypatch.setattr(experts_module, "_GROUPED_LATENCY", few_rows_path)
    ex, x, _ = _device_case(16, 32, 64, 10, 1, 4, np.float16)
    zigzag = cp.asarray(np.resize(np.array([0, 10], np.int32), 17))
    out = cp.full((10, 32), np.nan, np.float16)
    C = cp.asnumpy(kbit_grouped_gemm(cp.asarray(x), ex, zigzag, out=out, validate=False))
    candidates = [x.astype(np.float64) @ to_host(ex.expert(e).dequantize(np.float32)).T
                  for e in range(0, 16, 2)]
    nearest = np.min([np.abs(C.astype(np.float64) - c) for c in candidates], axis=0)
    assert nearest.max() <= 2e-3 * max(np.abs(c).max() for c in candidates)


@gpu_test
def test_gpu_experts_object_moves_between_host_and_device():
    import cupy as cp

    ex = quantize_experts(weights(3, 16, 64), 4)
    dev = ex.to_device()
    assert isinstance(dev.packed, cp.ndarray) and isinstance(dev, KbitExperts)
    x = np.ones((2, 64), np.float16)
    with pytest.raises(TypeError, match="same place"):
        kbit_grouped_gemm(cp.asarray(x), ex, cp.asarray(np.array([0, 2, 2, 2], np.int32)))



@gpu_test
@pytest.mark.parametrize("T, top_k, E", [(1, 1, 1), (1, 8, 128), (37, 10, 512), (4096, 8, 128),
                                         (300, 2, 3000), (512, 2, 8), (1000, 3, 7000),
                                         (3, 3, 11264), (257, 1, 33), (1025, 8, 2),
                                         (1024, 8, 128), (8192, 8, 128)])
def test_gpu_routing_is_a_stable_sort_of_the_ids(T, top_k, E):
    """Every routing geometry: one warp (from 5632 experts), warps with fewer
    pairs than lanes, many rounds a warp; the ids and the order staged in
    shared memory (past 48 KB at 1024 x 8 pairs) and, at 4096 x 8 and 8192 x 8
    pairs (more than the shared memory holds), read and stored in memory."""
    import cupy as cp

    ids = np.random.default_rng(T).integers(0, E, (T, top_k)).astype(np.int32)
    offsets, order = route_pairs(cp.asarray(ids), E)
    flat = ids.reshape(-1)
    want = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E))])
    assert np.array_equal(cp.asnumpy(offsets), want)
    assert np.array_equal(cp.asnumpy(order), np.argsort(flat, kind="stable"))


@gpu_test
@pytest.mark.parametrize("pairs, E", [(100, 8), (9000, 128), (20000, 64)])
def test_gpu_routing_skips_ids_outside_the_range(pairs, E):
    """Ids outside [0, E), among the ones kept in registers and past them: no
    row, and the rest still a stable sort."""
    import cupy as cp

    rng = np.random.default_rng(pairs)
    ids = rng.integers(-3, E + 3, pairs).astype(np.int32)
    offsets, order = route_pairs(cp.asarray(ids), E)
    keep = (ids >= 0) & (ids < E)
    want = np.concatenate([[0], np.cumsum(np.bincount(ids[keep], minlength=E))])
    assert np.array_equal(cp.asnumpy(offsets), want)
    sorted_pairs = np.flatnonzero(keep)[np.argsort(ids[keep], kind="stable")]
    assert np.array_equal(cp.asnumpy(order)[: keep.sum()], sorted_pairs)


@gpu_test
def test_gpu_unvalidated_bad_ids_leave_only_their_rows_unwritten():
    import cupy as cp

    ex, x, ids = _device_case(6, 32, 64, 12, 2, 4, np.float16)
    ids[3, 1], ids[7, 0] = 6, -2  # out of range
    out = cp.full((12, 2, 32), np.nan, np.float16)
    moe_linear(cp.asarray(x), cp.asarray(ids), ex, out=out, validate=False)
    got = cp.asnumpy(out).astype(np.float32)
    bad = np.zeros((12, 2), bool)
    bad[3, 1] = bad[7, 0] = True
    assert np.isnan(got[bad]).all() and not np.isnan(got[~bad]).any()
    good = np.where(bad, 0, ids)
    want = reference(x, good, ex)
    assert rel_error(got[~bad], want[~bad]) <= 2e-3


@gpu_test
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_gpu_fp16_scales(k):
    import cupy as cp

    ex, x, ids = _device_case(16, 100, 96, 33, 4, k, np.float16, absmax_format="fp16")
    assert ex.absmax_format == "fp16"
    y = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex))
    assert rel_error(y, reference(x, ids, ex)) <= 2e-3


@gpu_test
def test_gpu_wide_ids_outside_the_range_do_not_wrap_into_it():
    import cupy as cp

    ids = cp.asarray(np.array([[3, 2**32 + 1], [-1, 2**40]], np.int64))
    offsets, order = route_pairs(ids, 4)
    assert cp.asnumpy(offsets).tolist() == [0, 0, 0, 0, 1]  # only the id 3 gets a row
    assert int(order[0]) == 0


@gpu_test
@pytest.mark.parametrize("T, top_k, E", [(1, 8, 128), (32, 8, 64), (25, 10, 512)])
def test_gpu_routing_inside_the_launch_gives_the_same_bits_as_the_routing_launch(
        T, top_k, E, monkeypatch):
    """Up to _FUSED_ROUTE_MAX_PAIRS pairs every CTA groups them itself; both paths sort stably, so the
    rows, the problems and the bits are the same. (The latency kernel, which
    takes the fewest pairs, is off here: its sums run in another order.)"""
    import cupy as cp

    from kbit_cupy import experts as experts_module

    monkeypatch.setattr(experts_module, "_latency_moe_max_ctas", lambda N, K_dim: 0)
    ex, x, ids = _device_case(E, 64, 128, T, top_k, 4, np.float16)
    x, ids = cp.asarray(x), cp.asarray(ids)
    fused = cp.asnumpy(moe_linear(x, ids, ex))
    monkeypatch.setattr(experts_module, "_FUSED_ROUTE_MAX_PAIRS", 0)
    launched = cp.asnumpy(moe_linear(x, ids, ex))
    assert np.array_equal(fused.view(np.uint16), launched.view(np.uint16))


@gpu_test
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
def test_gpu_moe_codebook_fold_same_bits(dtype, monkeypatch, kernels_built_with):
    """The MoE launches (the routed latency kernel, the grouped mma.sync and
    Hopper launches, the 8-warp one) built with KBIT_CB_FOLD=1 (an A/B knob,
    mma_common.cuh) give the same bits as the default build, at k = 2..5."""
    import cupy as cp

    from kbit_cupy import experts as experts_module
    from kbit_cupy.gemm import has_wgmma

    cases = [(64, 256, 2048, 1, 8), (16, 300, 288, 130, 8), (4, 96, 512, 300, 2),
             (128, 100, 256, 512, 8)]
    outs = {}
    for fold in (0, 1):
        kernels_built_with(*(("-DKBIT_CB_FOLD=1",) if fold else ()))
        for wg in (False, True) if has_wgmma() else (False,):
            monkeypatch.setattr(experts_module, "_GROUPED_WG", wg)
            for case in cases:
                for k in (2, 3, 4, 5):
                    ex, x, ids = _device_case(*case, k, dtype, seed=k)
                    outs[fold, wg, case, k] = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex))
    for key, got in outs.items():
        if key[0] == 1:
            same = got.view(np.uint16) == outs[(0, *key[1:])].view(np.uint16)
            assert same.all(), (key, int((~same).sum()))


@gpu_test
@pytest.mark.parametrize("wg", [False, True], ids=["mma", "wgmma"])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("N", [256, 250])
def test_gpu_grouped_output_at_any_alignment_over_sparse_experts(N, dtype, wg, monkeypatch):
    """C's rows go out in 8-byte pieces where N % 4 == 0 and `out` is 8-byte
    aligned, in 2-byte stores otherwise (N = 250, or `out` one element off):
    the same bits either way. The experts with rows sit among long runs of
    empty ones and some have several problems, so a CTA's next segment's
    expert is found from its current one across gaps of many sizes."""
    import cupy as cp

    from kbit_cupy import experts as experts_module
    from kbit_cupy.gemm import has_wgmma

    if wg and not has_wgmma():
        pytest.skip("the Hopper path needs an sm_90 GPU")
    monkeypatch.setattr(experts_module, "_GROUPED_WG", wg)
    monkeypatch.setattr(experts_module, "_GROUPED_LATENCY", False)
    E, K_dim = 96, 320
    sizes = np.zeros(E, dtype=np.int64)
    sizes[[0, 1, 5, 6, 7, 30, 31, 64, 90, 95]] = [3, 40, 1, 70, 9, 16, 150, 2, 33, 65]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    rows = int(offsets[-1])
    ex, x, _ = _device_case(E, N, K_dim, rows, 1, 4, dtype, seed=N)
    A = cp.asarray(x)
    outs = []
    for shift in (0, 1):
        buf = cp.full(rows * N + 4, np.nan, dtype=dtype)
        out = buf[shift:shift + rows * N].reshape(rows, N)
        outs.append(cp.asnumpy(kbit_grouped_gemm(A, ex, cp.asarray(offsets), out=out)))
        rest = cp.asnumpy(cp.concatenate([buf[:shift], buf[shift + out.size:]]))
        assert np.isnan(rest.astype(np.float32)).all()  # nothing written outside out
    assert not np.isnan(outs[0].astype(np.float32)).any()
    assert np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))
    want = np.concatenate([x[offsets[e]:offsets[e + 1]].astype(np.float64)
                           @ to_host(ex.expert(e).dequantize(np.float32)).astype(np.float64).T
                           for e in range(E) if sizes[e]])
    assert rel_error(outs[0], want) <= BOUNDS[np.dtype(dtype)]
