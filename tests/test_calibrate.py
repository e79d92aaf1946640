"""Calibrated quantization (kbit_cupy.calibrate): GPTQ in the kbit format.

CPU tests run the NumPy path, and the CUDA block kernel's source compiled as
host C++ (g++, stand-ins for the CUDA built-ins) through the GPU path's own
orchestration: it must give the NumPy path's bits. The GPU tests (``gpu``
marker) check the kernel itself against the NumPy block step, and the CuPy
path against itself, against RTN and against the NumPy path's quality.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kbit_cupy as kc
from kbit_cupy import calibrate
from kbit_cupy._arrays import gpu_available
from kbit_cupy.calibrate import (
    HessianAccumulator,
    allocate_bits,
    bits_per_weight,
    gptq_quantize,
    search_allocation,
)
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


# --------------------------------------------------------------------------
# the CUDA block kernel, compiled for the host

_SHIM = r"""
#include <cmath>
#include <cstring>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __restrict__
#define __shared__ static
struct HostDim { unsigned x; };
static HostDim threadIdx, blockIdx, blockDim;
static inline void __syncthreads() {}
template <typename T, typename F> static inline T bits_as(F f) {
  T t; std::memcpy(&t, &f, sizeof t); return t;
}
static inline float __int_as_float(int i) { return bits_as<float>(i); }
static inline float __uint_as_float(unsigned i) { return bits_as<float>(i); }
static inline unsigned __float_as_uint(float f) { return bits_as<unsigned>(f); }
static inline unsigned __float2uint_rn(float f) { return (unsigned)std::nearbyint(f); }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline unsigned atomicMax(unsigned* p, unsigned v) {
  unsigned o = *p; if (v > o) *p = v; return o;
}
static inline int __shfl_up_sync(unsigned, int v, int) { return v; }
struct __half { _Float16 h; };
struct __nv_bfloat16 { unsigned short x; };
static inline __half __float2half_rn(float f) { return __half{(_Float16)f}; }
static inline float __half2float(__half h) { return (float)h.h; }
static inline unsigned short __half_as_ushort(__half h) { return bits_as<unsigned short>(h.h); }
static inline bool __hisinf(__half h) { return std::isinf((float)h.h); }
static inline float __bfloat162float(__nv_bfloat16 b) { return bits_as<float>((unsigned)b.x << 16); }
"""


class _HostKernel:
    """``kbit_gptq_block`` built by g++ (one "CTA" of one thread per row); called as
    CuPy calls a RawKernel, with NumPy arrays."""

    def __init__(self, lib):
        self.lib, self.launches = lib, 0

    def __call__(self, grid, block, args):
        self.launches += 1
        converted = []
        for a in args:
            if isinstance(a, np.ndarray):
                converted.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.int64):
                converted.append(ctypes.c_longlong(int(a)))
            elif isinstance(a, np.int32):
                converted.append(ctypes.c_int(int(a)))
            elif isinstance(a, np.float32):
                converted.append(ctypes.c_float(float(a)))
            else:
                raise TypeError(f"unexpected kernel argument {type(a)}")
        for row in range(int(args[2])):
            self.lib.set_block(row)
            self.lib.kbit_gptq_block(*converted)


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++ to build the CUDA block kernel for the host")
    from kbit_cupy._jit import render_source

    source = re.sub(r"#include <cuda_(fp16|bf16)\.h>", "",
                    render_source("gptq", calibrate._KERNEL_SOURCE))
    source = (_SHIM + source + '\nextern "C" void set_block(unsigned b) '
              "{ blockIdx.x = b; threadIdx.x = 0; blockDim.x = 1; }\n")
    folder = tmp_path_factory.mktemp("gptq_kernel")
    (folder / "kernel.cpp").write_text(source)
    built = subprocess.run([compiler, "-O2", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC",
                            "-o", str(folder / "kernel.so"), str(folder / "kernel.cpp")],
                           capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr[-4000:]
    return _HostKernel(ctypes.CDLL(str(folder / "kernel.so")))


def _device_path_on_host(monkeypatch, kernel):
    """Route gptq_quantize's NumPy path through _DeviceBlocks and the host-built kernel."""
    monkeypatch.setattr(calibrate, "_gptq_kernel", lambda: kernel)
    monkeypatch.setattr(calibrate, "_HostBlocks",
                        lambda *args: calibrate._DeviceBlocks(np, *args))


N_ROWS = 40


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("options", OPTIONS + [{"absmax_format": "fp16", "scale_search": 2,
                                                "fit_codebook": 1}],
                         ids=lambda o: ",".join(o) or "plain")
def test_cuda_block_kernel_source_gives_the_numpy_bits(k, options, host_kernel, monkeypatch):
    rng = np.random.default_rng(10 + k)
    W, H = _layer(rng, N_ROWS, 192)
    expected = gptq_quantize(W, k, hessian=H, block_columns=64, guard_rtn=False, **options)
    _device_path_on_host(monkeypatch, host_kernel)
    launches = host_kernel.launches
    got = gptq_quantize(W, k, hessian=H, block_columns=64, guard_rtn=False, **options)
    passes = 1 + (1 if options.get("fit_codebook") else 0)
    assert host_kernel.launches - launches == passes * 192 // BLOCK  # one launch per block
    for name in ("packed", "absmax", "codebook"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name))


def test_cuda_block_kernel_source_brute_force_codebook_and_overflow(host_kernel, monkeypatch):
    rng = np.random.default_rng(11)
    W, H = _layer(rng, N_ROWS, 96)
    codebook = kc.create_normal_float_codebook(3)
    codebook[4] = codebook[3] + np.float32(1e-7)  # near-equal entries: no fast plan
    assert not calibrate._plan_for(3, codebook.tobytes()).fast
    expected = gptq_quantize(W, 3, codebook, hessian=H, scale_search=3, guard_rtn=False)
    with pytest.raises(ValueError, match="too large for E4M4"):  # at the first such block
        gptq_quantize(W * np.float16(800), 3, hessian=H)
    _device_path_on_host(monkeypatch, host_kernel)
    got = gptq_quantize(W, 3, codebook, hessian=H, scale_search=3, guard_rtn=False)
    for name in ("packed", "absmax", "codebook"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name))
    with pytest.raises(ValueError, match="too large for E4M4"):  # the largest, after the pass
        gptq_quantize(W * np.float16(800), 3, hessian=H)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", [{}, {"scale_search": 8}, {"absmax_format": "fp16"}],
                         ids=lambda o: ",".join(o) or "plain")
def test_gpu_block_kernel_matches_the_numpy_block_step(options):
    for k in (2, 3, 4, 5):
        assert calibrate._compare_device_blocks(200, 160, k, seed=k, **options) == 0


def test_search_allocation_never_loses_to_uniform_on_the_measured_loss():
    rng = np.random.default_rng(12)
    sizes = {f"layer{i}": int(s) for i, s in enumerate(rng.choice([1, 4], size=10) * 4096)}
    own = {n: {k: float(rng.uniform(0.1, 10)) * 4.0 ** -k for k in (2, 3, 4, 5)} for n in sizes}
    names = sorted(sizes)

    def evaluate(alloc):  # additive, plus a penalty for neighbouring low widths
        pairs = sum(alloc[a] + alloc[b] <= 6 for a, b in itertools.pairwise(names))
        return sum(own[n][alloc[n]] for n in names) + 0.05 * pairs

    total = sum(sizes.values())
    for budget in (3.25, 3.6, 4.25):
        alloc, report = search_allocation(own, sizes, budget, evaluate, tries=4)
        used = sum(sizes[n] * bits_per_weight(alloc[n]) for n in sizes) / total
        assert used <= budget + 1e-9
        assert report["loss"] == evaluate(alloc)
        uniform = max(k for k in (2, 3, 4, 5) if bits_per_weight(k) <= budget)
        assert report["loss"] <= evaluate(dict.fromkeys(sizes, uniform))
        assert report["loss"] <= evaluate(allocate_bits(own, sizes, budget))
        assert [m["loss"] for m in report["moves"]] == sorted(
            (m["loss"] for m in report["moves"]), reverse=True)
    again = search_allocation(own, sizes, 3.6, evaluate, tries=4)
    assert again[0] == search_allocation(own, sizes, 3.6, evaluate, tries=4)[0]
