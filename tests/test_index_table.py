"""The quantize kernel's threshold-table lookup, emulated in NumPy.

The CUDA kernel picks an index with one table read and one compare
(kernels_src/quantize.cu:select_fast); the NumPy path uses the thresholds
directly. This checks the table the plan builds gives the brute-force argmin
of FORMAT.md section 4 for every codebook kind, so a table bug shows up on the
CPU and not only on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from _reference import flush_denormals
from hypothesis import given, settings
from hypothesis import strategies as st
from test_format_reference import CODEBOOKS, KS, make_codebook

from kbit_cupy.format import MAX_TABLE_BINS, Z_LIMIT, bin_of, make_index_plan, scales_from_absmax


def brute_argmin(z: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    d = np.abs(flush_denormals(z[:, None] - codebook[None, :].astype(np.float32)))
    return np.argmin(d, axis=1)  # first minimum: ties to the lowest index


def table_select(z: np.ndarray, plan) -> np.ndarray:
    """What select_fast computes for float32 z."""
    entry = plan.table[bin_of(z, plan.bin_scale, plan.bins)]
    threshold = entry[:, 0].view(np.float32)
    below, above = entry[:, 1] & 0xFF, entry[:, 1] >> 8
    return np.where(z >= threshold, above, below).astype(np.int64)


def probe_points(plan, rng) -> np.ndarray:
    """Quotients a kernel can see (|z| < 1.5), plus every threshold and its float32 neighbours."""
    t = plan.thresholds
    near = np.concatenate([t, np.nextafter(t, np.float32(-np.inf)), np.nextafter(t, np.float32(np.inf))])
    spread = rng.uniform(-1.5, 1.5, 20000).astype(np.float32)
    normal = (rng.standard_normal(20000) * 0.4).astype(np.float32)
    fixed = np.array([0.0, -0.0, 1.0, -1.0, 1.49, -1.49, 1e-30, -1e-30], np.float32)
    return flush_denormals(np.concatenate([near, spread, normal, fixed]).astype(np.float32))


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("codebook_name", CODEBOOKS)
def test_table_lookup_equals_brute_force(k, codebook_name):
    codebook = make_codebook(codebook_name, k)
    plan = make_index_plan(codebook)
    if plan.table is None:
        pytest.skip("no table for this codebook: the GPU runs the brute-force kernel")
    assert plan.bins % 2 == 0 and plan.bins <= MAX_TABLE_BINS
    z = probe_points(plan, np.random.default_rng(k))
    np.testing.assert_array_equal(table_select(z, plan), brute_argmin(z, plan.codebook))


@pytest.mark.parametrize("k", KS)
def test_default_codebook_table_is_small(k):
    # Coarse bins keep the kernel's lookups on few shared-memory banks.
    plan = make_index_plan(make_codebook("nf", k))
    assert plan.table is not None and plan.bins <= 128


def raw_bin(z: np.ndarray, plan) -> np.ndarray:
    """The kernel's bin before its (upper-only) clamp."""
    magic = np.float32(1.5 * 2**23)
    y = flush_denormals(np.asarray(z, np.float32) * np.float32(plan.bin_scale))
    w = (y + (magic + np.float32(plan.bins // 2))).astype(np.float32)
    return w.view(np.int32).astype(np.int64) - int(magic.view(np.int32))


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("codebook_name", CODEBOOKS)
def test_table_covers_every_reachable_quotient(k, codebook_name):
    # The kernel clamps only the top bin: every |z| < Z_LIMIT must map inside.
    plan = make_index_plan(make_codebook(codebook_name, k))
    if plan.table is None:
        pytest.skip("no table for this codebook: the GPU runs the brute-force kernel")
    edge = np.nextafter(np.float32(Z_LIMIT), np.float32(0))
    z = np.concatenate([[-edge, edge, 0.0], np.linspace(-edge, edge, 4001, dtype=np.float32)])
    b = raw_bin(z.astype(np.float32), plan)
    assert b.min() >= 0 and b.max() < plan.bins


@settings(max_examples=3000, deadline=None)
@given(st.floats(min_value=0.0, max_value=65000.0, width=32, allow_subnormal=False))
def test_decoded_scale_keeps_quotients_below_limit(absmax):
    # |x / s| <= absmax / s < Z_LIMIT whenever s > 0 (s == 0 gives z = 0).
    a = np.array([absmax], np.float32)
    for fmt in ("e4m4", "fp16") if absmax < 31.0 else ("fp16",):
        _, s = scales_from_absmax(a, fmt)
        if s[0] > 0:
            assert np.float32(a[0]) / np.float32(s[0]) < Z_LIMIT, (absmax, fmt, s[0])
