"""kbit_gemm on the GPU: every kernel against float64, poisoned outputs, determinism.

GPU-marked; skipped without a CUDA GPU. The wide sweep is also marked slow.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from kbit_cupy import kbit_gemm, quantize_weight, repack_for_gemm
from kbit_cupy._arrays import BFLOAT16, gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")]

TOL = {np.dtype(np.float16): 2e-3, BFLOAT16: 1e-2}
DTYPES = [np.float16, BFLOAT16]


def needs_kernel(kernel):
    """Skip the wgmma kernel's and the cluster split's cases on GPUs other than sm_90."""
    from kbit_cupy import _launch
    from kbit_cupy.gemm import has_wgmma

    if kernel == "wgmma" and not has_wgmma():
        pytest.skip("the wgmma kernel needs an sm_90 GPU")
    if kernel == "cluster" and not _launch.cluster_launch_supported():
        pytest.skip("the cluster split needs an sm_90 GPU and cuLaunchKernelEx")


def run_case(M, N, K_dim, k, dtype, kernel, fmt="e4m4", seed=0):
    import cupy as cp

    needs_kernel(kernel)
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((N, K_dim)).astype(np.float32)
    A = rng.standard_normal((M, K_dim)).astype(np.dtype(dtype))
    w = quantize_weight(cp.asarray(W), k=k, absmax_format=fmt)
    out = cp.full((M, N), np.nan, dtype=np.dtype(dtype))  # poison: every element must be written
    C = kbit_gemm(cp.asarray(A), w, out=out, kernel=kernel)
    assert C is out
    host = cp.asnumpy(C).astype(np.float64)
    assert np.isfinite(host).all(), "some outputs were not written"
    ref = A.astype(np.float64) @ cp.asnumpy(w.dequantize(np.float32)).astype(np.float64).T
    err = np.linalg.norm(host - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= TOL[np.dtype(dtype)], (M, N, K_dim, k, dtype, kernel, err)
    return w, A, C


@pytest.mark.parametrize("kernel", ["mma", "wgmma", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 4])
def test_output_at_any_alignment_same_bits(kernel, dtype, k):
    """C's rows go out in 8-byte pieces where N % 4 == 0 and `out` is 8-byte
    aligned, in 2-byte stores otherwise (`out` one element off): the same bits."""
    import cupy as cp

    needs_kernel(kernel)
    for M, N, K_dim in [(33, 768, 512), (64, 4096, 256), (16, 2048, 768), (128, 1024, 320)]:
        rng = np.random.default_rng(M + N)
        w = quantize_weight(cp.asarray(rng.standard_normal((N, K_dim)).astype(np.float32)), k=k)
        A = cp.asarray(rng.standard_normal((M, K_dim)).astype(np.dtype(dtype)))
        outs = []
        for shift in (0, 1):
            buf = cp.full(M * N + 4, np.nan, dtype=np.dtype(dtype))
            out = buf[shift:shift + M * N].reshape(M, N)
            outs.append(cp.asnumpy(kbit_gemm(A, w, out=out, kernel=kernel)))
            rest = cp.asnumpy(cp.concatenate([buf[:shift], buf[shift + out.size:]]))
            assert np.isnan(rest.astype(np.float32)).all()  # nothing written outside out
        assert np.isfinite(outs[0].astype(np.float32)).all(), (M, N, K_dim)
        assert np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16)), (M, N, K_dim)


@pytest.mark.parametrize("kernel", ["mma", "wgmma", "latency", "cluster", "dequant", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_small_sweep(kernel, dtype, k):
    for M, N, K_dim in [(1, 1, 32), (3, 7, 96), (17, 129, 64), (33, 768, 2048), (65, 64, 288),
                        (8, 4096, 256), (1, 127, 4096),
                        (33, 8449, 256), (64, 8470, 96),  # two row tiles per warp, odd count
                        (128, 300, 512), (129, 1000, 160),  # wgmma: 16 n8 tiles, 24
                        (190, 520, 288), (256, 300, 512),  # 24 and 32 (slab staging)
                        (257, 1000, 160)]:  # wgmma: 256 rows, two launches
        run_case(M, N, K_dim, k, dtype, kernel)


@pytest.mark.parametrize("kernel", ["mma", "wgmma", "latency", "cluster"])
@pytest.mark.parametrize("fmt", ["e4m4", "fp16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_formats(kernel, fmt, dtype):
    for M in (1, 16, 64, 100):
        run_case(M, 129, 512, 4, dtype, kernel, fmt=fmt)


@pytest.mark.parametrize("kernel", ["mma", "wgmma", "latency", "cluster"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 40])
def test_every_e4m4_code(kernel, dtype, M):
    """Row r of W has every block's absmax equal to E4M4 code r's value, so all
    256 codes (the 15 subnormal ones included) reach the kernel's scale decode;
    each row of W's products must match float64 on its own (a code decoded to zero or to
    the wrong power of two fails its row, whatever the other rows do). The
    reference rounds each effective weight to A's dtype as FORMAT.md section 7
    allows: on rows with subnormal fp16 weights that rounding alone is far
    above the matrix-wide bound."""
    import cupy as cp

    from kbit_cupy.format import decode_absmax_e4m4

    needs_kernel(kernel)
    rng = np.random.default_rng(5)
    K_dim = 256
    values = decode_absmax_e4m4(np.arange(256, dtype=np.uint8)).astype(np.float32)
    W = rng.standard_normal((256, K_dim // 32, 32)).astype(np.float32)
    W *= values[:, None, None] / np.abs(W).max(axis=2, keepdims=True)
    W = W.reshape(256, K_dim)
    w = quantize_weight(cp.asarray(W), k=4)
    np.testing.assert_array_equal(cp.asnumpy(w.absmax).reshape(256, -1),
                                  np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, 1))
    A = rng.standard_normal((M, K_dim)).astype(np.dtype(dtype))
    C = cp.asnumpy(kbit_gemm(cp.asarray(A), w, kernel=kernel)).astype(np.float64)
    eff = cp.asnumpy(w.dequantize(np.float32)).astype(np.dtype(dtype)).astype(np.float64)
    ref = A.astype(np.float64) @ eff.T
    assert not C[:, 0].any()  # code 0: the block is zero
    # per row n of W: the error against the size of the terms summed (a norm of
    # C's column could be near zero by cancellation, at M = 1 especially)
    terms = np.sqrt((A.astype(np.float64) ** 2) @ (eff**2).T).sum(axis=0)
    err = np.abs(C - ref).sum(axis=0)[1:] / terms[1:]
    assert err.max() <= TOL[np.dtype(dtype)], (int(err.argmax()) + 1, float(err.max()))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_wide_sweep(dtype, k):
    from kbit_cupy.gemm import has_wgmma

    Ms = [1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 48, 49, 64, 65, 127, 128, 129, 256, 1024]
    Ns = [1, 7, 64, 127, 128, 129, 768, 4096, 6144]
    Ks = [32, 96, 2048, 4096, 14336]
    rng = np.random.default_rng(k)
    cases = list(itertools.product(Ms, Ns, Ks))
    for i in rng.choice(len(cases), 40, replace=False):
        M, N, K_dim = cases[i]
        run_case(M, N, K_dim, k, dtype, "auto", seed=int(i))
        if M <= 64:
            run_case(M, N, K_dim, k, dtype, "mma", seed=int(i))
            run_case(M, N, K_dim, k, dtype, "latency", seed=int(i))
        if has_wgmma():
            run_case(M, N, K_dim, k, dtype, "wgmma", seed=int(i))


@pytest.mark.parametrize("M", [1, 8, 40])
def test_deterministic_with_split_k(M):
    import cupy as cp

    w, A, C = run_case(M, 768, 14336, 4, np.float16, "mma")  # short and wide: split K
    A_dev = cp.asarray(A)
    for _ in range(3):
        again = kbit_gemm(A_dev, w, kernel="mma")
        assert (again.view(cp.uint16) == C.view(cp.uint16)).all()


@pytest.mark.parametrize("M", [1, 5, 16, 17])
def test_latency_kernel_deterministic_and_warp_counts(monkeypatch, M):
    """gemm_latency.cu with one K tile per warp, several per warp (fewer
    warps than K tiles: the register double buffer), and long rows (fewer
    rows of A per launch): exact to the reference and the same bits again."""
    import cupy as cp

    from kbit_cupy import gemm

    for max_warps in (16, 3):
        monkeypatch.setattr(gemm._jit, "GEMM_LATENCY_MAX_WARPS", max_warps)
        for N, K_dim, k in [(768, 2048, 4), (300, 4352, 3), (40, 14336, 2), (129, 800, 5)]:
            w, A, C = run_case(M, N, K_dim, k, np.float16, "latency")
            for _ in range(2):
                again = kbit_gemm(cp.asarray(A), w, kernel="latency")
                assert (again.view(cp.uint16) == C.view(cp.uint16)).all()


@pytest.mark.parametrize("fmt", ["e4m4", "fp16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_latency_half_tiles_same_bits_as_whole_tiles(monkeypatch, dtype, fmt):
    """Two CTAs per row tile, each decoding 8 of its rows, give the whole
    tile's bits (the mma's rows are independent; both launches here get the
    same warps per CTA, so the same K split), write every element (odd N: a
    last half tile with no rows, or a part of one) and match the reference."""
    import cupy as cp

    from kbit_cupy import gemm

    # whole K tiles a warp in both (the dense half K tiles, gemm._dense_latency_ksplit,
    # would take 129x800's whole row tiles and change their K split)
    monkeypatch.setattr(gemm, "_DENSE_LATENCY_KSPLIT", 1)
    for M, N, K_dim, k in [(1, 8, 32, 2), (3, 40, 2048, 3), (17, 129, 800, 4), (16, 300, 256, 5),
                           (5, 24, 4352, 2), (1, 768, 2048, 4), (8, 2100, 512, 3)]:
        outs = {}
        for mode in (0, 2):  # whole tiles, half tiles
            monkeypatch.setattr(gemm, "_LATENCY_HALF_TILES", mode)
            _, _, C = run_case(M, N, K_dim, k, dtype, "latency", fmt=fmt, seed=N)
            outs[mode] = C
        assert (outs[0].view(cp.uint16) == outs[2].view(cp.uint16)).all(), (M, N, K_dim, k)


@pytest.mark.parametrize("ksplit", [2, 4])
@pytest.mark.parametrize("fmt", ["e4m4", "fp16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_latency_half_k_tiles(monkeypatch, kernels_built_with, dtype, fmt, ksplit):
    """gemm_latency.cu built with KBIT_LATENCY_KSPLIT=2 or 4 (an A/B knob:
    each warp takes half or quarter K tiles, the host gives the CTA up to that
    many times the warps): exact to the reference at every k (a part that
    starts inside a 16-byte load: odd k, and k = 2 at quarters; a quarter
    whose words end in the tile's last load), whole and half row tiles, fewer
    warps than units (the register double buffer), M up to 16, every element
    written, the same bits again."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    kernels_built_with(f"-DKBIT_LATENCY_KSPLIT={ksplit}")
    monkeypatch.setattr(_jit, "GEMM_LATENCY_KSPLIT", ksplit)
    for max_warps, half in ((16, 0), (16, 2), (3, 0)):
        monkeypatch.setattr(gemm._jit, "GEMM_LATENCY_MAX_WARPS", max_warps)
        monkeypatch.setattr(gemm, "_LATENCY_HALF_TILES", half)
        for M, N, K_dim, k in [(1, 2048, 768, 4), (1, 768, 2048, 3), (3, 129, 800, 5),
                               (16, 300, 256, 2), (5, 40, 4352, 5), (8, 24, 32, 3), (1, 7, 96, 4)]:
            w, A, C = run_case(M, N, K_dim, k, dtype, "latency", fmt=fmt, seed=N)
            again = kbit_gemm(cp.asarray(A), w, kernel="latency")
            assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (M, N, K_dim, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 4])
def test_dense_latency_half_k_tiles_against_whole_tiles(monkeypatch, kernel_requests, dtype, k):
    """The dense latency launch where gemm._dense_latency_ksplit takes half K
    tiles (its bandwidth gate lowered and its warps bound raised: any GPU,
    whatever its SM count): the KSPLIT = 2 variant within the reference's
    bounds and of the whole-tile launch, every element written, the same bits
    again; M = 1, 3 and 16, K_dim of 3 and 4 K tiles and one that ends inside
    a tile."""
    import cupy as cp

    from kbit_cupy import gemm

    monkeypatch.setattr(gemm, "_DENSE_LATENCY_KSPLIT_MIN_TBPS", 0.0)
    asked = kernel_requests
    monkeypatch.setattr(gemm, "_DENSE_LATENCY_KSPLIT_MAX_SM_WARPS", 64)  # (fewer SMs: more CTAs an SM)
    for M, N, K_dim in [(1, 2048, 768), (3, 2048, 768), (16, 2050, 1024), (1, 1100, 704)]:
        got = {}
        for ksplit in (2, 1):
            monkeypatch.setattr(gemm, "_DENSE_LATENCY_KSPLIT", ksplit)
            del asked[:]
            w, A, C = run_case(M, N, K_dim, k, dtype, "latency", seed=K_dim + M)
            # (the whole-tile variant is asked first: its geometry decides)
            half = [args for family, args in asked if family == "gemm_latency" and len(args) == 7]
            assert all(a[-1] == 2 for a in half) and bool(half) == (ksplit == 2), (M, N, K_dim, asked)
            again = kbit_gemm(cp.asarray(A), w, kernel="latency")
            assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (M, N, K_dim, ksplit)
            got[ksplit] = cp.asnumpy(C).astype(np.float32)
        err = np.linalg.norm(got[2] - got[1]) / max(np.linalg.norm(got[1]), 1e-30)
        assert err <= TOL[np.dtype(dtype)], (M, N, K_dim, err)


@pytest.mark.parametrize("dtype", DTYPES)
def test_codebook_fold_same_bits(kernels_built_with, dtype):
    """gemm_mma.cu and gemm_latency.cu built with KBIT_CB_FOLD=1 (an A/B knob:
    the scale pair's factor moved into the codebook entries) give the same
    bits as the default build, on every kernel and the launches whose decode
    differs (the k = 2 byte table's 8 warps, k = 5's 16, slab staging, half
    tiles), for random index strings, every E4M4 code and codebooks with
    entries in fp16's subnormal range and up to 2048."""
    import cupy as cp

    from kbit_cupy import KbitWeight, _launch, create_normal_float_codebook
    from kbit_cupy.gemm import has_wgmma

    rng = np.random.default_rng(5)
    cases = [("latency", 1, 2048, 768), ("latency", 16, 129, 800), ("cluster", 40, 768, 2048),
             ("mma", 1, 1024, 8192), ("mma", 16, 1024, 8192), ("mma", 33, 300, 512),
             ("wgmma", 64, 520, 288), ("wgmma", 200, 300, 1280), ("wgmma", 256, 768, 2048)]
    runs = {"wgmma": has_wgmma(), "cluster": _launch.cluster_launch_supported()}  # (sm_90)
    cases = [case for case in cases if runs.get(case[0], True)]
    codebooks = {k: [create_normal_float_codebook(k),
                     np.concatenate([[2048.0, -3e-6, 1e-7], rng.uniform(-1, 1, 2**k - 3)])]
                 for k in (2, 3, 4, 5)}
    inputs = []
    for kernel, M, N, K_dim in cases:
        blocks = N * K_dim // 32
        for k in (2, 3, 4, 5):
            for cb in codebooks[k]:
                packed = rng.integers(0, 2**32, blocks * k, dtype=np.uint64).astype(np.uint32)
                codes = rng.integers(0, 256, blocks, dtype=np.uint8)  # every E4M4 code
                A = (rng.standard_normal((M, K_dim)) * 0.01).astype(np.dtype(dtype))
                inputs.append((kernel, k, KbitWeight(packed, codes, cb.astype(np.float32), k,
                                                     (N, K_dim)), A))
    outs = {}
    for fold in (0, 1):
        kernels_built_with(*(("-DKBIT_CB_FOLD=1",) if fold else ()))
        for i, (kernel, k, w, A) in enumerate(inputs):
            wd = w.to_device()  # a fresh weight: no launch plans of the other build
            out = cp.full((A.shape[0], w.shape[0]), np.nan, dtype=np.dtype(dtype))
            outs[fold, i] = cp.asnumpy(kbit_gemm(cp.asarray(A), wd, out=out, kernel=kernel))
    for i, (kernel, k, w, A) in enumerate(inputs):
        same = outs[0, i].view(np.uint16) == outs[1, i].view(np.uint16)
        assert same.all(), (kernel, k, A.shape, w.shape, int((~same).sum()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_k3_byte_lanes_same_bits(monkeypatch, kernels_built_with, dtype):
    """k = 3's tiles in byte lanes (the A/B knob _jit.GEMM_K3_BYTE_LANES with
    kernels built with KBIT_K3_BYTE_LANES=1: gemm.repack_for_gemm's layout,
    mma_common.cuh's decode) give the same bits as the plain layout on every
    kernel that decodes k = 3: the latency launch (and its cluster split),
    mma at 4 and 8 warps, wgmma with and without slab staging, the grouped
    launch and moe_linear's routed one; random index strings, every E4M4 code."""
    import cupy as cp

    from kbit_cupy import KbitWeight, _jit, _launch, kbit_grouped_gemm, moe_linear, quantize_experts
    from kbit_cupy.gemm import has_wgmma

    rng = np.random.default_rng(7)
    cases = [("latency", 1, 2048, 768), ("latency", 16, 129, 800), ("cluster", 40, 768, 2048),
             ("mma", 1, 1024, 8192), ("mma", 4, 1040, 8448), ("mma", 16, 1024, 8192), ("mma", 33, 300, 512),
             ("wgmma", 64, 520, 288), ("wgmma", 200, 300, 1280), ("wgmma", 256, 768, 2048)]
    runs = {"wgmma": has_wgmma(), "cluster": _launch.cluster_launch_supported()}  # (sm_90)
    cases = [case for case in cases if runs.get(case[0], True)]
    inputs = []
    for kernel, M, N, K_dim in cases:
        blocks = N * K_dim // 32
        packed = rng.integers(0, 2**32, blocks * 3, dtype=np.uint64).astype(np.uint32)
        codes = rng.integers(0, 256, blocks, dtype=np.uint8)  # every E4M4 code
        A = (rng.standard_normal((M, K_dim)) * 0.01).astype(np.dtype(dtype))
        cb = np.sort(rng.uniform(-1, 1, 8)).astype(np.float32)
        inputs.append((kernel, KbitWeight(packed, codes, cb, 3, (N, K_dim)), A))
    experts = quantize_experts(rng.standard_normal((8, 520, 1024)).astype(np.float32), k=3)
    x = rng.standard_normal((24, 1024)).astype(np.dtype(dtype))
    ids = rng.integers(0, 8, (24, 2)).astype(np.int32)
    offsets = np.array([0, 1, 4, 4, 9, 16, 17, 20, 24], np.int32)
    outs = {}
    for lanes in (0, 1):
        kernels_built_with(*(("-DKBIT_K3_BYTE_LANES=1",) if lanes else ()))
        monkeypatch.setattr(_jit, "GEMM_K3_BYTE_LANES", lanes)
        for i, (kernel, w, A) in enumerate(inputs):
            wd = w.to_device()  # a fresh weight: tiles and plans of this layout and build
            out = cp.full((A.shape[0], w.shape[0]), np.nan, dtype=np.dtype(dtype))
            outs[lanes, i] = cp.asnumpy(kbit_gemm(cp.asarray(A), wd, out=out, kernel=kernel))
        ex = experts.to_device()
        outs[lanes, "grouped"] = cp.asnumpy(kbit_grouped_gemm(cp.asarray(x), ex, cp.asarray(offsets)))
        outs[lanes, "moe"] = cp.asnumpy(moe_linear(cp.asarray(x), cp.asarray(ids), ex))
    for key in [*range(len(inputs)), "grouped", "moe"]:
        assert np.isfinite(outs[1, key].astype(np.float32)).all(), key
        same = outs[0, key].view(np.uint16) == outs[1, key].view(np.uint16)
        assert same.all(), (key, int((~same).sum()))


@pytest.mark.parametrize("split", ["stream-k", "split-k"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_k3_scale_after_within_contract(monkeypatch, kernels_built_with, dtype, split):
    """k = 3's dense mma launches at one n8 tile built with
    KBIT_SCALE_AFTER_K3=1 (an A/B knob: the block scale applied in fp32 after
    the multiply), with and without byte lanes (KBIT_K3_BYTE_LANES): close to
    the reference, every element written (run_case), the same bits again; 4
    warps and 8 (from 3 rows where K_dim >= 8192), one K tile, a short group."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    needs_kernel("mma")
    monkeypatch.setattr(gemm, "_STREAM_K_SLACK", -10**6 if split == "stream-k" else 10**6)
    for lanes in (0, 1):
        kernels_built_with("-DKBIT_SCALE_AFTER_K3=1", *(("-DKBIT_K3_BYTE_LANES=1",) if lanes else ()))
        monkeypatch.setattr(_jit, "GEMM_K3_BYTE_LANES", lanes)
        for M, N, K_dim in [(1, 40, 8192), (3, 1040, 8448), (8, 16400, 256), (5, 300, 512)]:
            w, A, C = run_case(M, N, K_dim, 3, dtype, "mma", seed=M + lanes)
            again = kbit_gemm(cp.asarray(A), w, kernel="mma")
            assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (lanes, M, N, K_dim)


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_codebook_fold_chosen_per_weight(monkeypatch, kernel_requests, dtype, k):
    """The fold as the host chooses it (gemm._cb_fold; its bandwidth and size
    thresholds lowered so that it runs on any GPU and on small layers): the
    same bits as without it (_jit.GEMM_CB_FOLD off) on the latency and mma
    launches it covers (1 and 2 n8 tiles), for random index strings, every
    E4M4 code and codebooks with entries in fp16's subnormal range and up to
    the largest the fold takes (4094 fp16, 4080 bf16); a codebook past that
    (or, bf16, with a float subnormal entry) or assigned after construction
    runs without it; with the NF codebook every output is written and finite."""
    import cupy as cp

    from kbit_cupy import KbitWeight, _jit, create_normal_float_codebook, gemm

    monkeypatch.setattr(gemm, "_CB_FOLD_MIN_TBPS", 0.0)
    monkeypatch.setattr(gemm, "_CB_FOLD_K2_MIN_WEIGHTS", 0)
    monkeypatch.setattr(gemm, "_CB_FOLD_K5_MIN_WEIGHTS", 0)
    asked = kernel_requests
    rng = np.random.default_rng(k)
    cases = [("mma", 1, 1024, 8192), ("mma", 16, 1024, 8192), ("mma", 5, 8192, 2048),
             ("mma", 3, 300, 512)]
    if k == 2:
        cases += [("latency", 1, 2048, 768), ("latency", 16, 129, 800), ("latency", 8, 4096, 4096)]
    rest = rng.uniform(-1, 1, 2**k - 3)
    top = 4094.0 if np.dtype(dtype) == np.float16 else 4080.0
    codebooks = {"nf": (create_normal_float_codebook(k), True),  # (codebook, folded)
                 "edge": (np.r_[top, -3e-6, 1e-7, rest], True),
                 "past": (np.r_[-(top + 1), 0.5, 1e-3, rest], False),
                 "tiny": (np.r_[1e-39, 0.5, -1.0, rest], np.dtype(dtype) == np.float16)}
    folded = set()
    for kernel, M, N, K_dim in cases:
        blocks = N * K_dim // 32
        packed = rng.integers(0, 2**32, blocks * k, dtype=np.uint64).astype(np.uint32)
        codes = rng.integers(0, 256, blocks, dtype=np.uint8)  # every E4M4 code
        A = cp.asarray((rng.standard_normal((M, K_dim)) * 0.01).astype(np.dtype(dtype)))
        for name, (cb, expect) in codebooks.items():
            w = KbitWeight(packed, codes, cb.astype(np.float32), k, (N, K_dim))
            outs = []
            for fold in (True, False):
                monkeypatch.setattr(_jit, "GEMM_CB_FOLD", fold)
                del asked[:]
                out = cp.full((M, N), np.nan, dtype=np.dtype(dtype))
                outs.append(cp.asnumpy(kbit_gemm(A, w.to_device(), out=out, kernel=kernel)))
                used = [a for a in asked if a[0] == f"gemm_{kernel}"]
                assert used, (kernel, asked)
                with_fold = [a for a in used if a[1][-1] is True]
                assert bool(with_fold) == (fold and expect), (kernel, M, N, K_dim, name, used)
                folded.update(with_fold)
            same = outs[0].view(np.uint16) == outs[1].view(np.uint16)
            assert same.all(), (kernel, M, N, K_dim, name, int((~same).sum()))
            if name == "nf":  # (entries past 1 times the largest scales overflow, fold or not)
                assert np.isfinite(outs[0].astype(np.float32)).all(), (kernel, M, N, K_dim, name)
        # a codebook assigned after construction: its range unknown, no fold
        monkeypatch.setattr(_jit, "GEMM_CB_FOLD", True)
        wd = w.to_device()
        wd.codebook = cp.asarray(codebooks["nf"][0])
        del asked[:]
        kbit_gemm(A, wd, kernel=kernel)
        assert not [a for a in asked if a[1][-1] is True], asked
    print(sorted(folded))
    assert {a[1][3] for a in folded if a[0] == "gemm_mma"} == {1, 2}, folded
    if k == 2:
        assert {a[1][3] for a in folded if a[0] == "gemm_latency"} == {1, 2}, folded


@pytest.mark.parametrize("M", [1, 17, 64, 100, 257])
def test_cluster_split_geometries(monkeypatch, M):
    """gemm_latency.cu's cluster split under forced geometries: ranks that do
    and do not divide the K tiles (and more ranks than K tiles: CTAs with no
    K tile), 1..8 row tiles per CTA over N that leaves the last group short,
    one and several M chunks; each exact to the reference, every element
    written, the same bits on a second call."""
    import cupy as cp

    from kbit_cupy import gemm

    needs_kernel("cluster")
    shapes = [(768, 2048, 4), (129, 800, 5), (40, 1280, 2), (300, 256, 3), (8, 32, 4)]
    for ranks, per_cta, m_tiles in [(0, 0, 0), (1, 1, 2), (3, 2, 4), (8, 8, 8), (5, 4, 2),
                                    (2, 3, 8)]:
        monkeypatch.setattr(gemm, "_CLUSTER_RANKS", ranks)
        monkeypatch.setattr(gemm, "_CLUSTER_ROW_TILES", per_cta)
        monkeypatch.setattr(gemm, "_CLUSTER_M_TILES", m_tiles)
        for N, K_dim, k in shapes:
            w, A, C = run_case(M, N, K_dim, k, np.float16, "cluster", seed=N + ranks)
            again = kbit_gemm(cp.asarray(A), w, kernel="cluster")
            assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (ranks, per_cta, m_tiles, N)


@pytest.mark.parametrize("split", ["stream-k", "split-k"])
@pytest.mark.parametrize(
    ("kernel", "M"),
    # one launch each: the mma kernel takes up to 64 rows, wgmma up to 256
    [("mma", 1), ("mma", 17), ("mma", 64), ("wgmma", 1), ("wgmma", 17), ("wgmma", 64),
     ("wgmma", 128), ("wgmma", 150), ("wgmma", 256)],
)
def test_both_work_splits(monkeypatch, kernel, split, M):
    """Forced stream-K (CTAs ending two segments, partials across group ends)
    and forced split K, each exact to the reference and deterministic."""
    import cupy as cp

    from kbit_cupy import gemm

    monkeypatch.setattr(gemm, "_STREAM_K_SLACK", -10**6 if split == "stream-k" else 10**6)
    for N, K_dim, k in [(2048, 8192, 4), (1040, 4352, 3), (4096, 2048, 2), (3000, 2048, 5)]:
        w, A, C = run_case(M, N, K_dim, k, np.float16, kernel)
        again = kbit_gemm(cp.asarray(A), w, kernel=kernel)
        assert (again.view(cp.uint16) == C.view(cp.uint16)).all()


def _same_bits_again_and_without_clusters(monkeypatch, w, A, C):
    """kbit_gemm(A, w, kernel="wgmma") gives C's bits again, and again through
    the plan's fallback where the cluster does not fit (max_active_clusters
    0: the split-K workspace), whose plan (no clusters) it returns."""
    import cupy as cp

    from kbit_cupy import _launch

    again = kbit_gemm(cp.asarray(A), w, kernel="wgmma")
    assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (A.shape, w.shape)
    with monkeypatch.context() as mp:
        mp.setattr(_launch.PdlLaunch, "max_active_clusters", lambda self: 0)
        w._plans.clear()
        plain = kbit_gemm(cp.asarray(A), w, kernel="wgmma")
        plain_plan = next(iter(w._plans.values()))
        assert plain_plan.clusters == [0]
    assert (plain.view(cp.uint16) == C.view(cp.uint16)).all(), (A.shape, w.shape)
    return plain_plan


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_wgmma_split_k_in_clusters(monkeypatch, dtype, k):
    """The Hopper path on layers whose units leave SMs idle: one warpgroup a
    CTA (gemm._wg_warpgroups) and split K in thread-block clusters of 2..8
    CTAs (gemm._wg_cluster_splits; one K tile a CTA, and two), N leaving the
    last group short, K_dim past the last whole K tile, 17..128 rows: exact
    to the reference, every element written, the same bits again, and the
    same bits as the workspace reduction of the same split (the plan's
    fallback where the cluster does not fit: max_active_clusters 0)."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    needs_kernel("wgmma")
    monkeypatch.setattr(gemm, "_WG_M_CHUNKS", 0)  # 65..128 rows in one chunk (see test_wgmma_m_chunks)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    # (N, K_dim, splits): 8, 3, 5 and 2 K tiles over few groups; 12 K tiles in six
    # splits of two (at most a cluster's 8); 17 K tiles in one group (stream-K:
    # split K would take more than a cluster)
    shapes = [(770, 2048, 8), (2000, 768, 3), (300, 1280, 5), (520, 288, 2), (1040, 3072, 6),
              (64, 4352, 0)]
    checked = 0
    for M in (17, 40, 100, 128):
        m_tiles = next(t for t in (4, 8, 16) if 8 * t >= M)
        for N, K_dim, splits in shapes:
            rt_n, kt_n = (N + 15) // 16, (K_dim + 255) // 256
            wgs = _jit.gemm_wg_warpgroups(m_tiles, k)
            if math.ceil(rt_n / (4 * wgs)) * kt_n >= sms:  # (a GPU of few SMs: not these launches)
                continue
            assert gemm._wg_warpgroups(m_tiles, k, rt_n, kt_n) == 1, (N, K_dim)
            w, A, C = run_case(M, N, K_dim, k, dtype, "wgmma", seed=N + M)
            plan = next(p for p in w._plans.values() if p.choice == "wgmma")
            assert plan.clusters == [splits], (M, N, K_dim, plan.clusters)
            _same_bits_again_and_without_clusters(monkeypatch, w, A, C)
            checked += 1
    assert checked >= 12 or sms < 132, checked


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_wgmma_m_chunks(monkeypatch, dtype, k):
    """65..256 rows on small layers: one Hopper-path launch whose 64-row
    chunks (32-row on layers of at most three K tiles at 65..128 rows) run
    along grid z (gemm._wg_m_chunks; gemm_mma.cu "M chunks"), a last chunk of
    1..64 rows, N leaving the last group short, K_dim past the
    last whole K tile: exact to the reference, every element written, the
    same bits again, and the same bits through the workspace (the plan's
    fallback where the cluster does not fit), whose slots and counters are
    per chunk."""
    import cupy as cp

    from kbit_cupy import gemm

    needs_kernel("wgmma")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    checked = clustered = 0
    for M in (65, 100, 128, 129, 200, 256):
        for N, K_dim in [(770, 2048), (2000, 768), (300, 1280), (520, 288)]:
            chunks = gemm._wg_m_chunks(M, k, N, K_dim)
            rows = 8 * gemm._wg_chunk_m_tiles(M, N, K_dim)  # 32 on the short layers at 65..128 rows
            assert rows == (32 if M <= 128 and K_dim <= 768 else 64) or sms < 132, (M, K_dim, rows)
            if M <= 128 and k < gemm._WG_CHUNKS_TO_128_MIN_K and rows == 64:
                assert chunks == 1  # one 128-row launch there (test_wgmma_split_k_in_clusters)
                continue
            if chunks == 1:  # (a GPU of few SMs: not these launches)
                continue
            assert chunks == math.ceil(M / rows), (M, N, K_dim, chunks)
            w, A, C = run_case(M, N, K_dim, k, dtype, "wgmma", seed=N + M)
            plan = next(p for p in w._plans.values() if p.choice == "wgmma")
            assert len(plan.launches) == 1 and plan.launches[0][0].grid[2] == chunks, plan.launches
            splits = plan.launches[0][0].grid[1]
            assert plan.clusters == [splits if splits > 1 else 0], (plan.clusters, splits)
            clustered += splits > 1
            plain_plan = _same_bits_again_and_without_clusters(monkeypatch, w, A, C)
            assert plain_plan.launches[0][0].grid[2] == chunks
            checked += 1
    # (k = 2, 3: 129..256 rows and the short layers at 65..128, 18 cases; on
    # 132 SMs 2000x768 past 128 rows runs whole groups, no clusters)
    assert (checked >= 12 and clustered >= 8) or sms < 132, (checked, clustered)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wgmma_k5_full_rows_one_launch(monkeypatch, dtype):
    """k = 5 at 193..256 rows with _jit.GEMM_WG_K5_FULL_ROWS (on by default;
    False is the A/B run's 192-row launches): one launch of the 256-row
    variant instead of 192 rows and the rest; close to the reference, every
    element written, the same bits again. The M chunks (gemm._WG_M_CHUNKS,
    which run a small layer's 193..256 rows as one launch of 64-row chunks
    whatever the scales) are off, so the rows a launch takes are the
    variant's."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    needs_kernel("wgmma")
    monkeypatch.setattr(_jit, "GEMM_WG_K5_FULL_ROWS", True)
    monkeypatch.setattr(gemm, "_WG_M_CHUNKS", 0)
    for M, N, K_dim in [(256, 300, 512), (200, 1000, 2304), (193, 129, 64)]:
        for fmt in ("e4m4", "fp16"):  # fp16 scales keep their 192-row launches
            w, A, C = run_case(M, N, K_dim, 5, dtype, "wgmma", fmt=fmt, seed=M)
            plan = next(p for p in w._plans.values() if p.choice == "wgmma")
            rows = [launch[2] for launch in plan.launches]
            assert rows == ([M] if fmt == "e4m4" else [192, M - 192]), (M, fmt, rows)
            again = kbit_gemm(cp.asarray(A), w, kernel="wgmma")
            assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (M, N, K_dim, fmt)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, k5_full_rows", [(2, False), (3, False), (4, False), (5, False),
                                             (5, True)])
def test_wgmma_slab_chunks(monkeypatch, dtype, k, k5_full_rows):
    """Past the slab-staged variant's rows (256; 192 at k = 5 with
    _jit.GEMM_WG_K5_FULL_ROWS off, the A/B runs' setting: k5_full_rows): one launch of
    that many rows a chunk along grid z (gemm._wg_slab_chunks), whole groups
    a CTA or, where the chunks' groups leave SMs idle, split K through the
    workspace with slots and counters per chunk. A last chunk of a few rows
    more than half of one, N leaving the last group short, K_dim past the last
    whole K tile: close to the reference, every element written and nothing
    past C's last row, the same bits again; and M whose last chunk would be
    at most half full runs as launches, as with the chunks off."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    needs_kernel("wgmma")
    monkeypatch.setattr(_jit, "GEMM_WG_K5_FULL_ROWS", k5_full_rows)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    rows = 8 * max(_jit.gemm_wg_m_tiles(k, "uint8"))
    assert rows == (192 if k == 5 and not k5_full_rows else 256)
    split = whole = 0
    for M, N, K_dim, expect in [(2 * rows, 1000, 1280, True), (3 * rows - 40, 300, 4096, True),
                                (4 * rows, 4100, 512, True), (2 * rows + rows // 2 + 3, 2000, 2304, True),
                                (2 * rows + 16, 1000, 1280, False), (2 * rows + 16, 8200, 256, False)]:
        chunks = math.ceil(M / rows) if gemm._wg_slab_chunks(M, rows) else 1
        assert (chunks > 1) == expect or sms < 132, (M, N, rows, chunks)
        rng = np.random.default_rng(M + N)
        A = cp.asarray(rng.standard_normal((M, K_dim)).astype(np.dtype(dtype)))
        w = quantize_weight(cp.asarray(rng.standard_normal((N, K_dim)).astype(np.float32)), k=k)
        buf = cp.full((M + 8, N), np.nan, dtype=np.dtype(dtype))  # poison, 8 rows past C too
        C = kbit_gemm(A, w, out=buf[:M], kernel="wgmma")
        host = cp.asnumpy(buf).astype(np.float64)
        assert np.isfinite(host[:M]).all(), (M, N, K_dim, "some outputs were not written")
        assert np.isnan(host[M:]).all(), (M, N, K_dim, "written past C's last row")
        ref = cp.asnumpy(A).astype(np.float64) @ cp.asnumpy(w.dequantize(np.float32)).astype(np.float64).T
        err = np.linalg.norm(host[:M] - ref) / np.linalg.norm(ref)
        assert err <= TOL[np.dtype(dtype)], (M, N, K_dim, err)
        again = kbit_gemm(A, w, kernel="wgmma")
        assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (M, N, K_dim)
        plan = next(p for p in w._plans.values() if p.choice == "wgmma")
        if chunks == 1:
            assert len(plan.launches) == math.ceil(M / rows), plan.launches
            continue
        assert len(plan.launches) == 1 and plan.launches[0][0].grid[2] == chunks, plan.launches
        assert plan.launches[0][3] == rows // 8  # the slab variant, its tensor map of all M rows
        splits = plan.launches[0][0].grid[1]
        split += splits > 1
        whole += splits == 1
    assert split >= 2 and whole >= 1, (split, whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wgmma_float16_scales_take_fewer_warpgroups(dtype):
    """float16 scales where their variant with the uint8 count of warpgroups
    spills (_jit.gemm_wg_warpgroups): k = 4 at 8 n8 tiles on three
    warpgroups, k = 5 at 16 on two, on a layer whose units fill the SMs (no
    step down to one warpgroup); exact to the reference, every element
    written."""
    from kbit_cupy import _jit

    needs_kernel("wgmma")
    for k, M, wgs in ((4, 64, 3), (5, 128, 2)):
        m_tiles = 8 if M == 64 else 16
        assert _jit.gemm_wg_warpgroups(m_tiles, k, "float16") == wgs
        w, _, _ = run_case(M, 2048, 4096, k, dtype, "wgmma", fmt="fp16", seed=k)
        plan = next(p for p in w._plans.values() if p.choice == "wgmma")
        assert plan.launches[0][0].block[0] == 128 * wgs, plan.launches[0][0].block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_wgmma_small_sweep_without_m_chunks(monkeypatch, dtype, k):
    """The small sweep's 65..257-row cases with M chunks off: the 128-row
    launch, the slab-staged 24 and 32 n8 tiles and the two-launch split (what
    larger layers run) on these shapes too."""
    from kbit_cupy import gemm

    monkeypatch.setattr(gemm, "_WG_M_CHUNKS", 0)
    for M, N, K_dim in [(65, 64, 288), (128, 300, 512), (129, 1000, 160), (190, 520, 288),
                        (256, 300, 512), (257, 1000, 160)]:
        run_case(M, N, K_dim, k, dtype, "wgmma")


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("split", ["stream-k", "split-k"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_eight_warp_mma_launch(monkeypatch, dtype, split, k):
    """k = 4 (and k = 2 with its byte table, _jit.GEMM_K2_QUAD_TABLE, where
    K_dim >= 8192; with two row tiles a warp on wide_n; k = 3 there from 3
    rows, gemm._K3_WIDE_MIN_M), E4M4, M <= 8 on a
    large layer: 8 warps per CTA (gemm.py _mma_warps) over row
    tiles that leave the last group short (3 row tiles, 1025, 66), under both
    work splits; exact to the reference, every element written, the same bits
    again, and the 4-warp launch of the same call just as close to the
    reference."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    needs_kernel("wgmma")  # the 8-warp launch is taken on sm_90 only
    monkeypatch.setattr(gemm, "_STREAM_K_SLACK", -10**6 if split == "stream-k" else 10**6)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    wide_n = 32 * sms + 80  # 2 x SMs + 5 row tiles: k = 2 two row tiles a warp
    for M, N, K_dim in [(1, 40, 8192), (3, 16400, 256), (8, 1040, 8448), (5, 40, 16384),
                        (4, wide_n, 8192)]:
        wide = k == 4 or (K_dim >= gemm._K2_WIDE_MIN_K_DIM
                          and (_jit.GEMM_K2_QUAD_TABLE if k == 2 else M >= gemm._K3_WIDE_MIN_M))
        assert gemm._mma_warps(k, np.uint8, M, 1, N, K_dim) == (8 if wide else 4), (N, K_dim)
        two = gemm._k2_two_row_tiles(k, 1, 8 if wide else 4, (N + 15) // 16)
        assert two == (k == 2 and N == wide_n and bool(gemm._K2_RPW2)), (k, N, K_dim)
        w, A, C = run_case(M, N, K_dim, k, dtype, "mma", seed=N)
        again = kbit_gemm(cp.asarray(A), w, kernel="mma")
        assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (M, N, K_dim)
        monkeypatch.setattr(gemm, "_WIDE_WARPS", 0)
        run_case(M, N, K_dim, k, dtype, "mma", seed=N)
        monkeypatch.setattr(gemm, "_WIDE_WARPS", 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_copied_by_four_warps_same_bits(monkeypatch, dtype):
    """The dense launches of 8 and 16 warps at 5..16 rows: A's copies are
    issued by the CTA's first four warps (gemm_mma.cu, KBIT_A_COPY_WARPS);
    the 8-warp mma launch (k = 4 and 2), the 16-warp k = 5 launch at two n8
    tiles (at one, where every warp still copies, the same check) and the
    Hopper path's four warpgroups, over row counts that
    leave a copy warp short (5, 6, 7, 13 rows): close to the reference,
    every element written, and the same bits as the kernels built with
    every warp copying (-DKBIT_A_COPY_WARPS=0)."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    needs_kernel("wgmma")  # the 8- and 16-warp launches are sm_90's
    monkeypatch.setattr(gemm, "_device_tbps", lambda: 4.8)  # k = 5's 16 warps at one n8 tile
    cases = [("mma", 4, 5, 16400, 512), ("mma", 4, 7, 1040, 8448), ("mma", 2, 6, 1040, 8448),
             ("mma", 5, 6, 16400, 256), ("mma", 5, 13, 16400, 256),
             ("wgmma", 4, 6, 2064, 4096), ("wgmma", 2, 13, 2064, 4096), ("wgmma", 4, 16, 2064, 4096)]
    for kernel, k, M, N, K_dim in cases:
        m_tiles = 1 if M <= 8 else 2
        if kernel == "mma":
            assert gemm._mma_warps(k, np.uint8, M, 1, N, K_dim) in (8, 16), (k, M, N, K_dim)
        else:
            assert gemm._wg_warpgroups(m_tiles, k, (N + 15) // 16, K_dim // 256) == 4, (k, M, N)
    results = [run_case(M, N, K_dim, k, dtype, kernel, seed=M)[2] for kernel, k, M, N, K_dim in cases]
    options = _jit.compile_options
    monkeypatch.setattr(_jit, "compile_options", lambda: (*options(), "-DKBIT_A_COPY_WARPS=0"))
    monkeypatch.setattr(_jit, "_kernels", {})
    for (kernel, k, M, N, K_dim), C in zip(cases, results):
        again = run_case(M, N, K_dim, k, dtype, kernel, seed=M)[2]
        assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (kernel, k, M, N, K_dim)


@pytest.mark.parametrize("split", ["stream-k", "split-k"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_ring_same_bits(monkeypatch, dtype, split):
    """A's K tiles in a ring of mbarrier-handed stages (gemm_mma.cu
    KBIT_A_RING): k = 5's 16-warp launch by default, over row counts that
    leave copying warps idle (1, 3, 7, 13), a short last group, one K tile
    (K_dim = 256) and CTAs that run across groups (stream-K) or stop inside one
    (split K): close to the reference, every element written, and the same bits
    as two stages and a barrier a tile (-DKBIT_A_RING=0). k = 4's 8-warp ring
    variant (gemm._mma_ring, taken at up to 4 rows) at 1..4 rows: the same
    bits as without (gemm._K4_RING_MAX_M = 0), and k = 5's 16-warp launch
    with the variant's 8 stages (an A/B knob) at 1, 5, 8 rows the same as
    with its own 4; the rings, with their stages refilled, the same bits
    over 16 repeats. Then the ring forced (3 and 4 stages) on the 4- and
    8-warp launches of k = 2..4: close to the reference, every element
    written, the same bits twice."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    needs_kernel("wgmma")  # the 16-warp launch is taken on sm_90 only
    monkeypatch.setattr(gemm, "_STREAM_K_SLACK", -10**6 if split == "stream-k" else 10**6)
    monkeypatch.setattr(gemm, "_device_tbps", lambda: 4.8)  # k = 5's 16 warps at one n8 tile
    cases = [(1, 40, 8192), (3, 16400, 256), (7, 1040, 8448), (13, 16400, 512), (16, 40, 16384)]
    for M, N, K_dim in cases:
        assert gemm._mma_warps(5, np.uint8, M, 1, N, K_dim) == 16, (M, N, K_dim)
        assert _jit.gemm_mma_a_stages(5, 1 if M <= 8 else 2, 16) == 4
    results = [run_case(M, N, K_dim, 5, dtype, "mma", seed=M)[2] for M, N, K_dim in cases]
    # k = 4's 8-warp launch with its ring variant (gemm._mma_ring, taken at
    # 1..4 rows): the same bits as without (the same CTAs an SM, the same split)
    for M, N, K_dim in [(1, 16400, 4096), (2, 16400, 4096), (3, 16400, 4096), (4, 16400, 4096)]:
        assert gemm._mma_warps(4, np.uint8, M, 1, N, K_dim) == 8
        units = math.ceil(math.ceil(N / 16) / 8) * math.ceil(K_dim / 256)
        assert gemm._mma_ring(4, np.uint8, M, 8, 1, units) == _jit.GEMM_MMA_RING_STAGES
        ring = run_case(M, N, K_dim, 4, dtype, "mma", seed=M)[2]
        monkeypatch.setattr(gemm, "_K4_RING_MAX_M", 0)
        assert gemm._mma_ring(4, np.uint8, M, 8, 1, units) == 0
        C = run_case(M, N, K_dim, 4, dtype, "mma", seed=M)[2]
        assert (ring.view(cp.uint16) == C.view(cp.uint16)).all(), (M, N, K_dim)
        monkeypatch.setattr(gemm, "_K4_RING_MAX_M", 4)
    # k = 5's 16-warp launch with the ring variant's 8 stages (an A/B knob,
    # gemm._K5_RING_MAX_M, off; set here and for the repeats below) at 1, 5
    # and 8 rows: the same bits as with its own 4
    assert gemm._K5_RING_MAX_M == 0
    for M in (1, 5, 8):
        monkeypatch.setattr(gemm, "_K5_RING_MAX_M", 8)
        assert gemm._mma_warps(5, np.uint8, M, 1, 16400, 8192) == 16
        units = math.ceil(math.ceil(16400 / 16) / 16) * 8192 // 256
        assert gemm._mma_ring(5, np.uint8, M, 16, 1, units) == _jit.GEMM_MMA_RING_STAGES
        ring = run_case(M, 16400, 8192, 5, dtype, "mma", seed=M)[2]
        monkeypatch.setattr(gemm, "_K5_RING_MAX_M", 0)
        C = run_case(M, 16400, 8192, 5, dtype, "mma", seed=M)[2]
        assert (ring.view(cp.uint16) == C.view(cp.uint16)).all(), (5, M)
    # Each stage refilled about once a CTA or more (k = 4: 8 stages; k = 5: its
    # own 4, and the knob's 8): the same bits over repeats. (racecheck
    # cannot check the stages' hand-over: it reports the mbarrier-ordered
    # refills as hazards, benchmarks/racecheck_mbarrier_probe.py.)
    for k, M, K_dim, k5_ring in [(4, 1, 8192, 0), (5, 1, 4096, 0), (5, 12, 4096, 0), (5, 1, 8192, 8)]:
        monkeypatch.setattr(gemm, "_K5_RING_MAX_M", k5_ring)
        warps = 8 if k == 4 else 16
        assert gemm._mma_warps(k, np.uint8, M, 1, 16400, K_dim) == warps
        units = math.ceil(math.ceil(16400 / 16) / warps) * K_dim // 256
        ctas = (2 if k == 4 else 1) * cp.cuda.Device().attributes["MultiProcessorCount"]
        stages = _jit.gemm_mma_a_stages(k, 1 if M <= 8 else 2, warps,
                                        gemm._mma_ring(k, np.uint8, M, warps, 1, units))
        assert stages == (4 if k == 5 and not k5_ring else _jit.GEMM_MMA_RING_STAGES), (k, M)
        assert units >= 1.5 * ctas * stages, (k, units)
        w, A, C = run_case(M, 16400, K_dim, k, dtype, "mma", seed=k)
        A = cp.asarray(A)
        for _ in range(16):
            again = kbit_gemm(A, w, kernel="mma")
            assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (k, M)
    monkeypatch.setattr(gemm, "_K5_RING_MAX_M", 0)
    options = _jit.compile_options
    monkeypatch.setattr(_jit, "compile_options", lambda: (*options(), "-DKBIT_A_RING=0"))
    monkeypatch.setattr(_jit, "GEMM_MMA_A_RING", 0)
    monkeypatch.setattr(_jit, "_kernels", {})
    for (M, N, K_dim), C in zip(cases, results):
        assert _jit.gemm_mma_a_stages(5, 1 if M <= 8 else 2, 16) == 2
        again = run_case(M, N, K_dim, 5, dtype, "mma", seed=M)[2]
        assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (M, N, K_dim)
    for stages in (3, 4):
        monkeypatch.setattr(_jit, "compile_options", lambda s=stages: (*options(), f"-DKBIT_A_RING={s}"))
        monkeypatch.setattr(_jit, "GEMM_MMA_A_RING", stages)
        monkeypatch.setattr(_jit, "_kernels", {})
        for k, M, N, K_dim in [(4, 5, 16400, 512), (4, 1, 1040, 8448), (2, 6, 1040, 8448),
                               (3, 13, 2064, 4096), (4, 16, 40, 8192)]:
            w, A, C = run_case(M, N, K_dim, k, dtype, "mma", seed=M + stages)
            again = kbit_gemm(cp.asarray(A), w, kernel="mma")
            assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (stages, k, M, N, K_dim)


@pytest.mark.parametrize("split", ["stream-k", "split-k"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compact_ring_stages(monkeypatch, kernels_built_with, dtype, split):
    """The RING variants built with KBIT_A_COMPACT=1 (an A/B knob: stages of 2
    rows of A, rows past M read from row M - 1): k = 4 at 1 and 2 rows gives
    the same bits as its full stages; k = 2's ring (gemm._K2_RING_MAX_M, off by default) at one and two
    row tiles a warp is close to the reference, every element written; each
    the same bits over 8 repeats, with every stage refilled."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    needs_kernel("wgmma")  # the 8-warp launches are taken on sm_90 only
    monkeypatch.setattr(gemm, "_STREAM_K_SLACK", -10**6 if split == "stream-k" else 10**6)
    monkeypatch.setattr(gemm, "_device_tbps", lambda: 4.8)  # (the rings' bandwidth gate)
    monkeypatch.setattr(gemm, "_K2_RING_MAX_M", 2)
    # k = 2: two row tiles a warp on 16400 rows (1025 row tiles, two for each
    # SM's), one on 4112 (257), each with enough K tiles a CTA for the ring
    cases = [(4, M, 16400, 8192) for M in (1, 2)]
    cases += [(2, M, N, K_dim) for M in (1, 2) for N, K_dim in [(16400, 8192), (4112, 16384)]]
    full = {}
    for k, M, N, K_dim in cases:
        assert gemm._mma_warps(k, np.uint8, M, 1, N, K_dim) == 8, (k, N)
        if k != 2:
            full[k, M] = run_case(M, N, K_dim, k, dtype, "mma", seed=M)[2]
    kernels_built_with("-DKBIT_A_COMPACT=1")
    monkeypatch.setattr(_jit, "GEMM_MMA_A_COMPACT", 1)
    for k, M, N, K_dim in cases:
        per_warp = 2 if gemm._k2_two_row_tiles(k, 1, 8, (N + 15) // 16) else 1
        assert per_warp == (2 if k == 2 and N == 16400 else 1), (k, N)
        units = math.ceil(math.ceil(N / 16) / (8 * per_warp)) * K_dim // 256
        assert gemm._mma_ring(k, np.uint8, M, 8, per_warp, units) == _jit.GEMM_MMA_RING_STAGES, (k, M, N)
        w, A, C = run_case(M, N, K_dim, k, dtype, "mma", seed=M)
        if k != 2:
            assert (C.view(cp.uint16) == full[k, M].view(cp.uint16)).all(), (k, M)
        A = cp.asarray(A)
        for _ in range(8):
            again = kbit_gemm(A, w, kernel="mma")
            assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (k, M, N)


@pytest.mark.parametrize("split", ["stream-k", "split-k"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sixteen_warp_k5_launch(monkeypatch, dtype, split):
    """k = 5, E4M4, M <= 16 on a large layer: 16 warps per CTA and the 128 KB
    pair table (gemm.py _mma_warps, _K5_TABLE) at one n8 tile (taken at 4 TB/s
    or more: forced here on a slower GPU) and at two, over
    row tiles that leave the last group short, under both work splits; exact
    to the reference, every element written, the same bits again, and the
    4-warp launch just as close."""
    import cupy as cp

    from kbit_cupy import gemm

    needs_kernel("wgmma")  # the 16-warp launch is taken on sm_90 only
    monkeypatch.setattr(gemm, "_STREAM_K_SLACK", -10**6 if split == "stream-k" else 10**6)
    for M, N, K_dim in [(1, 40, 8192), (3, 16400, 256), (9, 1040, 8448), (16, 40, 16384),
                        (12, 16400, 512)]:
        m_tiles = 1 if M <= 8 else 2
        if m_tiles == 1 and gemm.device_tbps() < gemm._FAST_TBPS:  # (at one n8 tile: 4 TB/s)
            monkeypatch.setattr(gemm, "_device_tbps", lambda: 4.8)
        assert gemm._mma_warps(5, np.uint8, M, 1, N, K_dim) == 16, (M, N, K_dim)
        w, A, C = run_case(M, N, K_dim, 5, dtype, "mma", seed=N)
        again = kbit_gemm(cp.asarray(A), w, kernel="mma")
        assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (M, N, K_dim)
        monkeypatch.setattr(gemm, "_K5_TABLE", 0)
        assert gemm._mma_warps(5, np.uint8, M, 1, N, K_dim) == 4
        run_case(M, N, K_dim, 5, dtype, "mma", seed=N)
        monkeypatch.setattr(gemm, "_K5_TABLE", 1)


def test_dispatch_keys_on_this_gpus_bandwidth():
    """kernel="auto" reads the GPU's peak memory bandwidth from its properties
    (H100 SXM 3.35 TB/s, H200 4.8) and picks the rows it keys: k = 4 at M = 12
    on 4096x28672 runs wgmma at 4 TB/s or more, mma below; auto gives the
    bits of the kernel it picks, again on a second call. k = 4's 8-warp
    launch takes its ring of A's stages at M = 1 on 8192x57344 only at 4 TB/s
    or more (gemm._RING_MIN_TBPS: measured on the H200 alone)."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    needs_kernel("wgmma")
    tbps = gemm.device_tbps()
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    if "H200" in name:
        assert 4.5 <= tbps <= 5.2, (name, tbps)
    elif "H100" in name and "HBM3" in name:
        assert 3.0 <= tbps < 4.0, (name, tbps)
    else:
        assert tbps >= 0.0
    expected = "wgmma" if tbps >= gemm._FAST_TBPS else "mma"
    units = math.ceil(math.ceil(57344 / 16) / 8) * 8192 // 256
    ring = _jit.GEMM_MMA_RING_STAGES if tbps >= gemm._RING_MIN_TBPS else 0
    assert gemm._mma_ring(4, np.uint8, 1, 8, 1, units) == ring, (name, tbps)
    N, K_dim, M = 28672, 4096, 12
    assert gemm.choose_kernel(M, N, K_dim, 4, np.float16) == expected
    rng = cp.random.default_rng(0)
    W = rng.standard_normal((N, K_dim), dtype=cp.float32).astype(cp.float16)
    w = quantize_weight(W, k=4)
    A = rng.standard_normal((M, K_dim), dtype=cp.float32).astype(cp.float16)
    picked = kbit_gemm(A, w, kernel=expected)
    for _ in range(2):
        auto = kbit_gemm(A, w)
        assert (auto.view(cp.uint16) == picked.view(cp.uint16)).all()


def test_wgmma_refused_off_sm90():
    import cupy as cp

    from kbit_cupy.gemm import has_wgmma

    if has_wgmma():
        pytest.skip("this GPU runs the wgmma kernel")
    w = quantize_weight(cp.ones((4, 64), cp.float16), k=4)
    with pytest.raises(ValueError, match="sm_90"):
        kbit_gemm(cp.ones((2, 64), cp.float16), w, kernel="wgmma")


def test_repack_on_gpu_equals_cpu():
    import cupy as cp

    W = np.random.default_rng(3).standard_normal((300, 800)).astype(np.float16)
    for k in (2, 3, 4, 5):
        w = quantize_weight(W, k=k)
        t_cpu, s_cpu = repack_for_gemm(w.packed, w.absmax, k, 300, 800)
        t_gpu, s_gpu = repack_for_gemm(cp.asarray(w.packed), cp.asarray(w.absmax), k, 300, 800)
        np.testing.assert_array_equal(cp.asnumpy(t_gpu), t_cpu)
        np.testing.assert_array_equal(cp.asnumpy(s_gpu), s_cpu)


def test_noncontiguous_and_batched_activations():
    import cupy as cp

    rng = np.random.default_rng(4)
    w = quantize_weight(cp.asarray(rng.standard_normal((50, 128)).astype(np.float16)), k=4)
    A = cp.asarray(rng.standard_normal((2, 5, 256)).astype(np.float16))[..., ::2]
    C = kbit_gemm(A, w)
    assert C.shape == (2, 5, 50)
    ref = kbit_gemm(cp.ascontiguousarray(A).reshape(10, 128), w)
    assert (C.reshape(10, 50) == ref).all()


def test_errors_on_gpu():
    import cupy as cp

    w = quantize_weight(cp.ones((4, 64), cp.float16), k=4)
    with pytest.raises(TypeError, match="cast"):
        kbit_gemm(cp.ones((2, 64), cp.float32), w)
    with pytest.raises(TypeError, match="same place"):
        kbit_gemm(np.ones((2, 64), np.float16), w)
    with pytest.raises(ValueError, match="contiguous"):
        kbit_gemm(cp.ones((2, 64), cp.float16), w, out=cp.empty((4, 2), cp.float16).T)


def test_wgmma_without_tensor_maps_falls_back_to_128_row_launches(monkeypatch):
    """Where libcuda's tensor-map encoder is missing, M > 128 runs as 128-row
    launches (the 1..16-tile path), with the same contract."""
    from kbit_cupy import gemm

    monkeypatch.setattr(gemm, "_tensor_maps_available", lambda: False)
    # M chunks would run these 200 rows in one launch of 64-row chunks, which
    # needs no tensor maps: off, so the launch is the slab path's to fall back from
    monkeypatch.setattr(gemm, "_WG_M_CHUNKS", 0)
    calls = []
    real = gemm._plan_launch
    monkeypatch.setattr(gemm, "_plan_launch",
                        lambda M, *args: (calls.append(M), real(M, *args))[1])
    run_case(200, 300, 512, 4, np.float16, "wgmma")
    assert calls == [128, 72]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K_dim", [(1, 32), (17, 256), (1000, 4128), (2051, 96), (20000, 512)])
def test_lut_kernel_against_float64(dtype, N, K_dim):
    """kernel="lut" (k = 2, one row of A): within the contract at odd shapes
    (one row, 17 rows, K_dim of one block, K tiles past K_dim, row blocks past
    N), every element written, the same bits on a second call."""
    import cupy as cp

    w, A, C = run_case(1, N, K_dim, 2, dtype, "lut")
    again = kbit_gemm(cp.asarray(A), w, kernel="lut")
    assert np.array_equal(cp.asnumpy(C).view(np.uint16), cp.asnumpy(again).view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lut_kernel_units_across_row_blocks(monkeypatch, dtype):
    """With few CTAs (the SM count patched to 3: 6 CTAs for 4 row blocks x 17
    K tiles) a CTA takes units of two row blocks and a row block's K range is
    split over two CTAs (slots): within the contract, and near the launch of
    one CTA a unit (the sums' order differs)."""
    import cupy as cp

    from kbit_cupy import gemm

    N, K_dim = 4000, 4128
    rows, units = gemm.lut_units(N, K_dim)
    assert (rows, units) == (4, 68)
    assert gemm.lut_slots(rows, 17, 6) == 2
    ref_w, A, C_many = run_case(1, N, K_dim, 2, dtype, "lut", seed=3)
    monkeypatch.setattr(gemm, "_sm_count", lambda: 3)
    ref_w._plans.clear()
    C_few = kbit_gemm(cp.asarray(A), ref_w, kernel="lut")
    ref = A.astype(np.float64) @ cp.asnumpy(ref_w.dequantize(np.float32)).astype(np.float64).T
    host = cp.asnumpy(C_few).astype(np.float64)
    assert np.linalg.norm(host - ref) / np.linalg.norm(ref) <= TOL[np.dtype(dtype)]
    diff = np.abs(host - cp.asnumpy(C_many).astype(np.float64))
    assert diff.max() <= 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_lut_kernel_l2_hint_from_8192_rows(monkeypatch, dtype):
    """From gemm._LUT_L2_HINT_MIN_N rows the lookups load the weights with the
    L2 evict_first policy (the L2_HINT variant), below it without; either
    way the same bits."""
    import cupy as cp

    from kbit_cupy import _jit, gemm

    needs_kernel("lut")
    table_at = gemm._reserved_shared()
    for N, hinted in [(8200, True), (8191, False)]:
        w, A, C = run_case(1, N, 512, 2, dtype, "lut", seed=N)
        lookups = next(iter(w._plans.values())).lut[0]
        kern = _jit.get_kernel("gemm_lut", *_jit.gemm_lut_args(np.dtype(dtype).name, table_at, False, hinted))
        assert lookups.func == kern.kernel.ptr
        monkeypatch.setattr(gemm, "_LUT_L2_HINT_MIN_N", 1 if not hinted else 10**9)
        w._plans.clear()
        other = kbit_gemm(cp.asarray(A), w, kernel="lut")
        assert next(iter(w._plans.values())).lut[0].func != lookups.func
        assert np.array_equal(cp.asnumpy(other).view(np.uint16), cp.asnumpy(C).view(np.uint16))
        monkeypatch.undo()


def test_lut_kernel_refuses_what_it_cannot_run():
    import cupy as cp

    rng = np.random.default_rng(0)
    W = cp.asarray(rng.standard_normal((64, 256)).astype(np.float32))
    A1 = cp.asarray(rng.standard_normal((1, 256)).astype(np.float16))
    with pytest.raises(ValueError, match="k = 2"):
        kbit_gemm(A1, quantize_weight(W, k=4), kernel="lut")
    with pytest.raises(ValueError, match="fp16 absmax"):
        kbit_gemm(A1, quantize_weight(W, k=2, absmax_format="fp16"), kernel="lut")
    with pytest.raises(ValueError, match="one row of A"):
        kbit_gemm(cp.concatenate([A1, A1]), quantize_weight(W, k=2), kernel="lut")


def test_lut_kernel_in_a_cuda_graph():
    """The lookups and their sum capture into a graph and replay to the same bits."""
    import cupy as cp

    rng = np.random.default_rng(5)
    w = quantize_weight(cp.asarray(rng.standard_normal((3000, 2048)).astype(np.float32)), k=2)
    A = cp.asarray(rng.standard_normal((1, 2048)).astype(np.float16))
    out = cp.full((1, 3000), np.nan, dtype=np.float16)
    eager = cp.asnumpy(kbit_gemm(A, w, kernel="lut"))
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with stream:
        kbit_gemm(A, w, out=out, kernel="lut")  # the plan for this stream, outside the capture
        stream.begin_capture()
        kbit_gemm(A, w, out=out, kernel="lut")
        graph = stream.end_capture()
        out.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    assert np.array_equal(cp.asnumpy(out).view(np.uint16), eager.view(np.uint16))


def test_auto_leaves_the_latency_kernel_past_one_wave(monkeypatch):
    """Where the table says "latency" but the launch would not fit in one wave
    on this GPU (_latency_one_wave), auto runs mma, with mma's bits; within
    one wave it runs the latency kernel, with its bits. 4096x12288 k = 3 fp16
    (the latency kernel taken up to 8 rows by a patched table)."""
    import cupy as cp

    from kbit_cupy import gemm

    needs_kernel("latency")
    N, K_dim, k = 12288, 4096, 3
    monkeypatch.setattr(gemm, "choose_kernel", lambda *a, **kw: "latency")
    rng = cp.random.default_rng(0)
    W = (rng.standard_normal((N, K_dim), dtype=cp.float32) * 0.02).astype(cp.float16)
    w = quantize_weight(W, k=k).prepare()
    seen = {}
    for M in range(1, 9):
        A = rng.standard_normal((M, K_dim), dtype=cp.float32).astype(cp.float16)
        one_wave = gemm._latency_one_wave(M, w, np.dtype(np.float16))
        seen[M] = one_wave
        expected = kbit_gemm(A, w, kernel="latency" if one_wave else "mma")
        auto = kbit_gemm(A, w)
        plan = [p for key, p in w._plans.items() if key[0] == A.shape and key[2] == "auto"]
        assert [p.choice for p in plan] == ["latency" if one_wave else "mma"], (M, one_wave)
        assert (auto.view(cp.uint16) == expected.view(cp.uint16)).all(), M
    # more rows, more shared memory a CTA: the rows that fit are a prefix; 8
    # rows (64 KB of A a CTA, 3 CTAs an SM at most) never fit 768 CTAs
    fits = [M for M, one in seen.items() if one]
    assert fits and fits == list(range(1, len(fits) + 1)) and len(fits) < 8, seen


def test_latency_geometry_does_not_depend_on_the_layers_planned_before():
    """The latency launch for 5120x8192 at one row is the same whether or not
    a 4096-column layer's launch was planned first (it asks for the same
    shared bytes, 12288, at 8 warps that 5120x8192 asks for at 4: the
    occupancy cache keyed without the threads answered with 8 warps' count,
    and the launch halved to 2 warps, 1.4x slower on the H200)."""
    import cupy as cp

    from kbit_cupy import gemm

    f16 = np.dtype(np.float16)
    first = quantize_weight(cp.zeros((8192, 5120), cp.float16), k=2)
    other = quantize_weight(cp.zeros((11008, 4096), cp.float16), k=2)
    gemm._resident_cache.clear()
    alone = gemm._latency_launch_geometry(1, first, f16)[1:4]
    gemm._resident_cache.clear()
    gemm._latency_launch_geometry(1, other, f16)
    after = gemm._latency_launch_geometry(1, first, f16)[1:4]
    assert after == alone, (alone, after)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "K_dim", "knob", "splits"),
                         [(4, 11008, "_K4_WIDE_UNDERFILL_PCT", 8),
                          (2, 17408, "_K2_WIDE_UNDERFILL_PCT", 12)])
def test_wide_launch_charged_for_lone_ctas(monkeypatch, dtype, k, K_dim, knob, splits):
    """The 8-warp launch where split K would leave one CTA an SM: k = 4 on
    11008x4096 (32 groups of 43 K tiles), k = 2 on 17408x4096 (32 of 68). On
    a 132-SM GPU of 4 TB/s or more (the H200) split K in eight (k = 4, 256
    CTAs) or twelve (k = 2, 384), with the underfill charge
    (gemm._underfill_charge); elsewhere and without the charge in four, 128
    CTAs. Each within the reference's bounds, every element written, the same
    bits again."""
    import cupy as cp

    from kbit_cupy import gemm

    needs_kernel("wgmma")  # the 8-warp launch is sm_90's
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    charged = gemm._device_tbps() >= gemm._FAST_TBPS
    for pct in (getattr(gemm, knob), 0):
        monkeypatch.setattr(gemm, knob, pct)
        for M in (1, 5):
            w, A, C = run_case(M, 4096, K_dim, k, dtype, "mma", seed=M + pct)
            plan = next(iter(w._plans.values()))
            grid = plan.launches[0][0].grid
            assert grid[0] == 32, grid  # (groups, splits, chunks)
            if sms == 132:
                assert grid[1] == (splits if pct and charged else 4), (pct, charged, grid)
            again = kbit_gemm(cp.asarray(A), w, kernel="mma")
            assert (again.view(cp.uint16) == C.view(cp.uint16)).all(), (pct, M)
