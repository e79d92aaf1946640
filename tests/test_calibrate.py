"""Calibrated quantization (kbit_cupy.calibrate): GPTQ in the kbit format.

CPU tests run the NumPy path; the one GPU test (``gpu`` marker) checks the
CuPy path against itself, against RTN and against the NumPy path's quality.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kbit_cupy as kc
from kbit_cupy._arrays import gpu_available
from kbit_cupy.calibrate import HessianAccumulator, allocate_bits, bits_per_weight, gptq_quantize
from kbit_cupy.format import (
    BLOCK,
    decoded_scales,
    flush_denormals,
    make_index_plan,
    select_indices,
)
from kbit_cupy.gemm import _planes_to_indices


def _layer(rng, N: int, K_dim: int, tokens: int = 512):
    """A weight and the Hessian of correlated inputs with uneven channel scales."""
    W = (rng.standard_normal((N, K_dim)) * 0.05).astype(np.float16)
    mix = np.eye(K_dim) + 0.4 * rng.standard_normal((K_dim, K_dim)) / np.sqrt(K_dim)
    X = (rng.standard_normal((tokens, K_dim)) @ mix) * np.exp(rng.standard_normal(K_dim) * 0.7)
    acc = HessianAccumulator(K_dim)
    acc.add(X.astype(np.float32))
    return W, acc.hessian


def _indices(weight) -> np.ndarray:
    return _planes_to_indices(np, weight.packed, weight.k).astype(np.int64).reshape(weight.shape)


def _reencode(weight) -> np.ndarray:
    """FORMAT.md section 4 indices of the dequantized weight with the weight's own scales."""
    N, K_dim = weight.shape
    y = weight.dequantize(np.float32).reshape(N, K_dim // BLOCK, BLOCK)
    scale = decoded_scales(weight.absmax).reshape(N, K_dim // BLOCK, 1)
    safe = np.where(scale > 0, scale, np.float32(1))
    z = flush_denormals(np.where(scale > 0, y / safe, np.float32(0)))
    return select_indices(z, make_index_plan(np.asarray(weight.codebook))).reshape(N, K_dim)


OPTIONS = [{}, {"scale_search": 4}, {"fit_codebook": 1}, {"absmax_format": "fp16"}]


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_result_is_bit_exact_in_the_format(k, options):
    rng = np.random.default_rng(k)
    W, H = _layer(rng, 24, 160)
    weight, report = gptq_quantize(W, k, hessian=H, block_columns=64, guard_rtn=False,
                                   return_report=True, **options)
    assert weight.packed.dtype == np.uint32 and weight.packed.shape == (24 * 160 // 32 * k,)
    assert weight.absmax.dtype == (np.float16 if options.get("absmax_format") == "fp16"
                                   else np.uint8)
    assert weight.codebook.dtype == np.float32 and weight.codebook.shape == (1 << k,)
    np.testing.assert_array_equal(_reencode(weight), _indices(weight))
    assert report.chosen == "gptq"


def test_same_input_gives_same_bits():
    rng = np.random.default_rng(1)
    W, H = _layer(rng, 32, 256)
    runs = [gptq_quantize(W, 3, hessian=H, scale_search=True, fit_codebook=True)
            for _ in range(2)]
    for name in ("packed", "absmax", "codebook"):
        np.testing.assert_array_equal(getattr(runs[0], name), getattr(runs[1], name))


def test_gptq_beats_rtn_on_correlated_inputs():
    rng = np.random.default_rng(2)
    W, H = _layer(rng, 64, 256)
    rtn = kc.quantize_weight(W, 4)
    for options in ({}, {"scale_search": True}):
        weight = gptq_quantize(W, 4, hessian=H, guard_rtn=False, **options)
        assert kc.hessian_error(W, weight, H) < 0.9 * kc.hessian_error(W, rtn, H)


@settings(max_examples=25, deadline=None)
@given(k=st.sampled_from([2, 3, 4, 5]), N=st.integers(1, 9), blocks=st.integers(1, 4),
       seed=st.integers(0, 2**16), search=st.booleans())
def test_never_worse_than_rtn_on_the_hessian_weighted_error(k, N, blocks, seed, search):
    rng = np.random.default_rng(seed)
    W, H = _layer(rng, N, blocks * BLOCK, tokens=int(rng.integers(4, 200)))
    weight = gptq_quantize(W, k, hessian=H, scale_search=search)
    rtn = kc.quantize_weight(W, k)
    assert kc.hessian_error(W, weight, H) <= kc.hessian_error(W, rtn, H)
    np.testing.assert_array_equal(_reencode(weight), _indices(weight))


def test_identity_hessian_gives_rtn():
    # no correlations: nothing to compensate, each block rounds to nearest with its absmax
    rng = np.random.default_rng(3)
    W = (rng.standard_normal((8, 96)) * 0.1).astype(np.float32)
    weight = gptq_quantize(W, 4, hessian=np.eye(96), damp=0.0, guard_rtn=False)
    rtn = kc.quantize_weight(W, 4)
    np.testing.assert_array_equal(weight.packed, rtn.packed)
    np.testing.assert_array_equal(weight.absmax, rtn.absmax)


def test_unseen_inputs_are_rounded_without_error():
    rng = np.random.default_rng(4)
    W, H = _layer(rng, 16, 64)
    H[:, :5] = 0
    H[:5, :] = 0
    weight = gptq_quantize(W, 3, hessian=H)
    assert np.isfinite(weight.dequantize(np.float32)).all()


def test_hessian_accumulator_respects_masks_and_batches():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 7, 16)).astype(np.float16)
    mask = rng.integers(0, 2, size=(3, 7))
    acc = HessianAccumulator(16)
    acc.add(x[:2], mask[:2].astype(bool))
    acc.add(x[2:], mask[2:])
    rows = x.reshape(-1, 16)[mask.reshape(-1) == 1].astype(np.float64)
    assert acc.count == rows.shape[0]
    np.testing.assert_allclose(acc.total, rows.T @ rows, rtol=1e-12)
    np.testing.assert_allclose(acc.hessian, rows.T @ rows / rows.shape[0], rtol=1e-12)
    single = HessianAccumulator(16, dtype=np.float32)
    single.add(x)
    assert single.total.dtype == np.float32 and single.count == 21


def test_hessian_accumulator_rejects_bad_shapes():
    acc = HessianAccumulator(8)
    with pytest.raises(ValueError, match="in_features=8"):
        acc.add(np.zeros((4, 9), np.float32))
    with pytest.raises(ValueError, match="mask"):
        acc.add(np.zeros((2, 4, 8), np.float32), np.ones((2, 3)))
    with pytest.raises(TypeError, match="float32 or float64"):
        HessianAccumulator(8, dtype=np.int32)


def test_bad_arguments_raise_clear_errors():
    W = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(W, 4, hessian=None)
    with pytest.raises(ValueError, match=r"\[64, 64\]"):
        gptq_quantize(W, 4, hessian=np.eye(32))
    with pytest.raises(ValueError, match="multiple of 32"):
        gptq_quantize(np.zeros((4, 48), np.float32), 4, hessian=np.eye(48))
    with pytest.raises(ValueError, match="block_columns"):
        gptq_quantize(W, 4, hessian=np.eye(64), block_columns=48)
    with pytest.raises(ValueError, match="k must be"):
        gptq_quantize(W, 6, hessian=np.eye(64))


def test_mixed_widths_stay_within_the_budget():
    rng = np.random.default_rng(6)
    sizes = {f"layer{i}": int(s) for i, s in enumerate(rng.integers(1, 20, size=12) * 1024)}
    errors = {}
    for name in sizes:
        base = float(rng.uniform(0.1, 10))
        errors[name] = {k: base * 4.0 ** -k for k in (2, 3, 4, 5)}
    total = sum(sizes.values())
    for budget in (2.25, 2.9, 3.25, 4.25, 4.6, 5.25):
        alloc = allocate_bits(errors, sizes, budget)
        used = sum(sizes[n] * bits_per_weight(alloc[n]) for n in sizes) / total
        assert used <= budget + 1e-9
        # no single layer could move up one width within what is left
        left = (budget - used) * total
        assert all(alloc[n] == 5 or sizes[n] > left + 1e-9 for n in sizes)
    with pytest.raises(ValueError, match="budget"):
        allocate_bits(errors, sizes, 2.0)


def test_quantize_mixed_reports_the_allocation():
    rng = np.random.default_rng(7)
    weights, hessians = {}, {}
    for i in range(4):
        weights[f"l{i}"], hessians[f"l{i}"] = _layer(rng, 16, 64)
    quantized, report = kc.quantize_mixed(weights, hessians, 3.25, ks=(2, 3, 4))
    assert report["bits_per_weight"] <= 3.25
    for name, weight in quantized.items():
        assert weight.k == report["allocation"][name]
        assert set(report["errors"][name]) == {2, 3, 4}


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
def test_gpu_path_is_deterministic_exact_in_the_format_and_beats_rtn():
    # Not bit-identical to NumPy: the error propagation's float32 products sum
    # in another order in cuBLAS, and one changed index propagates (module docstring).
    import cupy as cp

    rng = np.random.default_rng(8)
    W, H = _layer(rng, 96, 512)
    Wd, Hd = cp.asarray(W), cp.asarray(H)
    for options in ({}, {"scale_search": True, "fit_codebook": True}):
        runs = [gptq_quantize(Wd, 3, hessian=Hd, **options) for _ in range(2)]
        assert isinstance(runs[0].packed, cp.ndarray)
        for name in ("packed", "absmax", "codebook"):
            cp.testing.assert_array_equal(getattr(runs[0], name), getattr(runs[1], name))
        host = kc.KbitWeight(runs[0].packed.get(), runs[0].absmax.get(), runs[0].codebook.get(),
                             3, runs[0].shape)
        np.testing.assert_array_equal(_reencode(host), _indices(host))
        on_cpu = gptq_quantize(W, 3, hessian=H, **options)
        error_gpu = kc.hessian_error(W, host, H)
        assert error_gpu <= kc.hessian_error(W, kc.quantize_weight(W, 3), H)
        assert error_gpu <= 1.1 * kc.hessian_error(W, on_cpu, H)
