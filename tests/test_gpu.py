"""CUDA path: bit-identical to the NumPy path, bounds, errors, caching.

Every test here carries the ``gpu`` marker and is skipped when no CUDA GPU is
present (conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kbit_cupy as kc
from kbit_cupy._arrays import BFLOAT16, gpu_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU"),
]

DTYPES = [np.float16, BFLOAT16, np.float32]


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _codebooks(k: int, rng) -> dict[str, np.ndarray]:
    size = 1 << k
    nf = kc.create_normal_float_codebook(k)
    dup = nf.copy()
    dup[1] = dup[0]
    near = nf.copy()
    near[2] = np.nextafter(near[3], np.float32(-2))  # forces the brute-force kernel
    return {
        "nf": nf,
        "asym": np.sort(rng.uniform(-0.3, 1.0, size)).astype(np.float32),
        "unsorted": rng.permutation(nf).astype(np.float32),
        "dup": dup,
        "near_dup_brute": near,
        "wide": (rng.standard_normal(size) * 3).astype(np.float32),
    }


def _assert_same(x_host, k, codebook, absmax_format):
    import cupy as cp

    p_np, a_np, _ = kc.quantize_kbit(x_host, k=k, codebook=codebook, absmax_format=absmax_format)
    p_cu, a_cu, cb_cu = kc.quantize_kbit(cp.asarray(x_host), k=k, codebook=codebook,
                                         absmax_format=absmax_format)
    assert isinstance(p_cu, cp.ndarray) and isinstance(cb_cu, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(p_cu), p_np)
    np.testing.assert_array_equal(_bits(cp.asnumpy(a_cu)), _bits(a_np))
    for out_dtype in DTYPES:
        y_np = kc.dequantize_kbit(p_np, a_np, codebook, k, x_host.size, dtype=out_dtype)
        y_cu = kc.dequantize_kbit(p_cu, a_cu, cb_cu, k, x_host.size, dtype=out_dtype)
        np.testing.assert_array_equal(_bits(cp.asnumpy(y_cu)), _bits(y_np))


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16"])
def test_cuda_matches_numpy_bit_for_bit(k, dtype, absmax_format):
    rng = np.random.default_rng(1000 * k + len(absmax_format))
    for cb in _codebooks(k, rng).values():
        for n in (1, 31, 32, 33, 1000, 4096 + 17):
            x = (rng.standard_normal(n) * rng.choice([1e-3, 0.5, 3.0])).astype(dtype)
            _assert_same(x, k, cb, absmax_format)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_cuda_matches_numpy_on_millions(k):
    rng = np.random.default_rng(k)
    x = (rng.standard_normal(3_000_017) * 2).astype(np.float16)
    _assert_same(x, k, kc.create_normal_float_codebook(k), "e4m4")


@pytest.mark.parametrize("k", [2, 4, 5])
def test_quotients_next_to_thresholds_round_like_ieee_division(k):
    """Values placed 0-2 ulps around every decision threshold, times awkward scales."""
    from kbit_cupy.format import E4M4_VALUES, make_index_plan

    rng = np.random.default_rng(7)
    cb = kc.create_normal_float_codebook(k)
    thresholds = make_index_plan(cb).thresholds
    blocks = []
    for s in E4M4_VALUES[1:250:3]:
        z = np.concatenate([thresholds, np.nextafter(thresholds, np.float32(9)),
                            np.nextafter(thresholds, np.float32(-9))])
        vals = (z.astype(np.float64) * s).astype(np.float32)
        vals = np.concatenate([vals, vals * np.float32(1 + 2**-23)])[:31]
        block = np.concatenate([[np.float32(s)], vals, np.zeros(31 - vals.size, np.float32)])
        blocks.append(block)
    x = np.concatenate(blocks).astype(np.float32)
    x = np.concatenate([x, rng.standard_normal(10_000).astype(np.float32)])
    _assert_same(x, k, cb, "e4m4")
    _assert_same(x, k, cb, "fp16")


def test_special_values_and_denormals():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(32 * 20).astype(np.float32)
    x[:32] = 0.0
    x[32:64] = 1e-40  # float32 denormals flush to zero
    x[64:96] = -1e-39
    x[96:128] = 2.0**-16  # absmax below 2**-15: scale code 0
    x[128] = 31.4
    x[160:192] = np.float32(2.0**-14) * 1.5
    for k in (2, 3, 4, 5):
        _assert_same(x, k, kc.create_normal_float_codebook(k), "e4m4")
        _assert_same(x, k, kc.create_normal_float_codebook(k), "fp16")


def test_dequantize_writes_exactly_n_elements():
    import cupy as cp

    for n in (1, 31, 33, 257, 1000):
        x = cp.asarray(np.random.default_rng(n).standard_normal(n).astype(np.float16))
        packed, absmax, cb = kc.quantize_kbit(x, k=3)
        for dtype in DTYPES:
            for offset in (0, 1):  # offset 1: an unaligned out takes the scalar path
                buf = cp.full(n + 64, 1234, dtype=cp.float32).astype(dtype)  # poison
                before = _bits(cp.asnumpy(buf))
                out = buf[offset:offset + n]
                kc.dequantize_kbit(packed, absmax, cb, 3, n, dtype=dtype, out=out)
                after = _bits(cp.asnumpy(buf))
                np.testing.assert_array_equal(after[:offset], before[:offset])
                np.testing.assert_array_equal(after[offset + n:], before[offset + n:])
                expected = kc.dequantize_kbit(cp.asnumpy(packed), cp.asnumpy(absmax),
                                              cp.asnumpy(cb), 3, n, dtype=dtype)
                np.testing.assert_array_equal(_bits(cp.asnumpy(out)), _bits(expected))


def test_quantize_noncontiguous_and_shapes():
    import cupy as cp

    x = np.random.default_rng(5).standard_normal((64, 96)).astype(np.float32)
    view = x[:, ::3]
    p_np, a_np, _ = kc.quantize_kbit(view, k=4)
    p_cu, a_cu, _ = kc.quantize_kbit(cp.asarray(x)[:, ::3], k=4)
    np.testing.assert_array_equal(cp.asnumpy(p_cu), p_np)
    np.testing.assert_array_equal(cp.asnumpy(a_cu), a_np)
    y = kc.dequantize_kbit(p_cu, a_cu, kc.create_normal_float_codebook(4).tolist(), 4, view.shape)
    assert y.shape == view.shape and y.dtype == np.float16


def test_cuda_errors_are_raised_and_typed():
    import cupy as cp

    x = cp.asarray(np.random.default_rng(0).standard_normal(100).astype(np.float32))
    bad = x.copy()
    bad[77] = cp.nan
    with pytest.raises(ValueError, match="NaN or infinity"):
        kc.quantize_kbit(bad)
    bad[77] = cp.inf
    with pytest.raises(ValueError, match="NaN or infinity"):
        kc.quantize_kbit(bad, absmax_format="fp16")
    with pytest.raises(ValueError, match='absmax_format="fp16"'):
        kc.quantize_kbit(x * 40)
    with pytest.raises(ValueError, match="overflows float16"):
        kc.quantize_kbit(x * 1e5, absmax_format="fp16")
    packed, absmax, cb = kc.quantize_kbit(x)
    with pytest.raises(TypeError, match="NumPy"):
        kc.dequantize_kbit(packed, cp.asnumpy(absmax), cb, 4, 100)
    # a host codebook is a parameter, not data: accepted with GPU arrays
    kc.quantize_kbit(x, codebook=kc.create_normal_float_codebook(4))
    with pytest.raises(ValueError, match="needs ceil"):
        kc.dequantize_kbit(packed, absmax, cb, 4, 200)
    with pytest.raises(TypeError, match="dtype"):
        kc.dequantize_kbit(packed, absmax, cb, 4, 100, out=cp.empty(100, cp.float32))
    with pytest.raises(TypeError):
        kc.dequantize_kbit(packed, absmax, cb, 4, 100, out=np.empty(100, np.float16))


def test_repeated_calls_are_bitwise_identical():
    import cupy as cp

    x = cp.asarray(np.random.default_rng(9).standard_normal(1 << 16).astype(np.float16))
    first = [cp.asnumpy(a) for a in kc.quantize_kbit(x, k=5)]
    second = [cp.asnumpy(a) for a in kc.quantize_kbit(x, k=5)]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_dlpack_input_is_accepted():
    import cupy as cp

    x = cp.asarray(np.random.default_rng(2).standard_normal(4096).astype(np.float16))

    class Foreign:  # a GPU array known only through __cuda_array_interface__
        def __init__(self, arr):
            self.__cuda_array_interface__ = arr.__cuda_array_interface__

    packed, _, _ = kc.quantize_kbit(Foreign(x), k=4)
    ref, _, _ = kc.quantize_kbit(x, k=4)
    np.testing.assert_array_equal(cp.asnumpy(packed), cp.asnumpy(ref))


_CHILD = textwrap.dedent(
    """
    import numpy as np, cupy as cp
    from cupy_backends.cuda.libs import nvrtc
    # Count NVRTC compiles of programs holding our kernels. (CuPy also compiles
    # an empty program once per process to read the compiler version for its
    # cache key; that one is not a kernel compile.)
    ours, calls = set(), []
    original_create, original_compile = nvrtc.createProgram, nvrtc.compileProgram
    def create(src, *args, **kwargs):
        prog = original_create(src, *args, **kwargs)
        if "kbit_quantize" in src or "kbit_dequantize" in src:
            ours.add(prog)
        return prog
    def compile_(prog, *args, **kwargs):
        if prog in ours:
            calls.append(1)
        return original_compile(prog, *args, **kwargs)
    nvrtc.createProgram, nvrtc.compileProgram = create, compile_
    import kbit_cupy as kc
    x = cp.asarray((np.arange(1000) % 17 / 10).astype(np.float16))
    for _ in range(3):  # in-process: one compile at most, however many calls
        p, a, cb = kc.quantize_kbit(x, k=3)
        kc.dequantize_kbit(p, a, cb, 3, 1000)
    cp.cuda.Device().synchronize()
    print("COMPILES", len(calls))
    """
)


def test_second_process_does_not_recompile(tmp_path):
    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp_path / "cache"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    counts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, check=False,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        counts.append(int(done.stdout.split("COMPILES")[1]))
    assert counts[0] >= 1, "the first process should compile (empty cache)"
    assert counts[1] == 0, "the second process must load from the disk cache"
