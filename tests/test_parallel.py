"""Tensor parallelism (issue 23): exact shards, sharded products against the
unsharded one, shard files, and the layer's checks.

The NumPy tests need no GPU. The GPU-marked tests run the same sharded math on
one GPU with the collectives replaced by local gathers and sums (the layer
code itself, through a stand-in group), and a real one-rank NCCL group where
CuPy has NCCL; they skip without a GPU.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kbit_cupy as kc
from kbit_cupy import parallel
from kbit_cupy._arrays import BFLOAT16, gpu_available

TOL = {np.dtype(np.float16): 2e-3, BFLOAT16: 1e-2}  # FORMAT.md section 7
DTYPES = [np.float16, BFLOAT16]
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def _weight(N, K_dim, k=4, seed=0, fmt="e4m4", xp=np):
    W = np.random.default_rng(seed).standard_normal((N, K_dim)).astype(np.float32)
    return kc.quantize_weight(xp.asarray(W), k=k, absmax_format=fmt)


def _host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def _rel_error(C, A, w) -> float:
    ref = _host(A).astype(np.float64) @ _host(w.dequantize(np.float32)).astype(np.float64).T
    diff = _host(C).astype(np.float64) - ref
    return float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-30))


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# --------------------------------------------------------------------------
# shards are exact


@settings(max_examples=60, deadline=None)
@given(k=st.integers(2, 5), rows=st.integers(1, 6), blocks=st.integers(1, 6),
       n=st.integers(1, 6), axis=st.sampled_from(parallel.AXES),
       fmt=st.sampled_from(["e4m4", "fp16"]), seed=st.integers(0, 2**31))
def test_shards_hold_the_original_bits_and_join_back(k, rows, blocks, n, axis, fmt, seed):
    N, K_dim = (rows * n, 32 * blocks) if axis == "column" else (rows, 32 * blocks * n)
    w = _weight(N, K_dim, k, seed, fmt)
    shards = kc.shard_weight(w, n, axis)
    assert len(shards) == n
    full = w.dequantize(np.float32)
    for r, s in enumerate(shards):
        assert s.k == k and s.absmax.dtype == w.absmax.dtype
        np.testing.assert_array_equal(s.codebook, w.codebook)
        part = s.dequantize(np.float32)
        if axis == "column":
            assert s.shape == (N // n, K_dim)
            assert _same_bits(part, full[r * N // n:(r + 1) * N // n])
        else:
            assert s.shape == (N, K_dim // n)
            assert _same_bits(part, full[:, r * K_dim // n:(r + 1) * K_dim // n])
    joined = kc.join_shards(shards, axis)
    assert joined.shape == w.shape and joined.k == w.k
    assert _same_bits(joined.packed, w.packed) and _same_bits(joined.absmax, w.absmax)
    assert _same_bits(joined.codebook, w.codebook)


def test_shards_are_copies():
    w = _weight(8, 64)
    before = w.packed.copy()
    for s in kc.shard_weight(w, 2, "column") + kc.shard_weight(w, 2, "row"):
        s.packed[...] = 0
    assert _same_bits(w.packed, before)


def test_join_fuses_weights_of_different_sizes():
    gate, up = _weight(64, 96, seed=1), _weight(32, 96, seed=2)
    fused = kc.join_shards([gate, up], "column")
    assert fused.shape == (96, 96)
    assert _same_bits(fused.dequantize(np.float32),
                      np.concatenate([gate.dequantize(np.float32), up.dequantize(np.float32)]))


@pytest.mark.parametrize("axis, shape, n, words", [
    ("column", (10, 64), 4, "N=10 rows into 4 equal shards"),
    ("row", (4, 96), 2, "3 blocks of 32"),
    ("row", (4, 96), 4, "counts that divide the blocks: 1, 3"),
])
def test_uneven_splits_are_refused_with_the_counts_that_work(axis, shape, n, words):
    with pytest.raises(ValueError, match=words):
        kc.shard_weight(_weight(*shape), n, axis)


@pytest.mark.parametrize("n, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError),
                                      (True, TypeError), ("2", TypeError)])
def test_bad_shard_counts(n, error):
    with pytest.raises(error, match="n_shards"):
        kc.shard_weight(_weight(8, 64), n, "column")


def test_bad_axis_and_weight():
    with pytest.raises(ValueError, match="axis must be one of 'column', 'row'"):
        kc.shard_weight(_weight(8, 64), 2, "rows")
    with pytest.raises(TypeError, match="axis must be a string"):
        kc.shard_weight(_weight(8, 64), 2, 0)
    with pytest.raises(TypeError, match="KbitWeight"):
        kc.shard_weight(np.zeros((8, 64)), 2, "column")


def test_join_refuses_what_is_not_one_split():
    w = _weight(8, 64)
    with pytest.raises(ValueError, match="empty"):
        kc.join_shards([], "column")
    with pytest.raises(TypeError, match="list of KbitWeight"):
        kc.join_shards(w, "column")
    with pytest.raises(ValueError, match="k=3"):
        kc.join_shards([w, _weight(8, 64, k=3)], "column")
    with pytest.raises(ValueError, match="fp16 scales"):
        kc.join_shards([w, _weight(8, 64, fmt="fp16")], "column")
    with pytest.raises(ValueError, match="equal K_dim"):
        kc.join_shards([w, _weight(8, 96)], "column")
    with pytest.raises(ValueError, match="equal N"):
        kc.join_shards([w, _weight(4, 64)], "row")
    other = kc.quantize_weight(np.ones((8, 64), np.float32), k=2,
                               codebook=np.array([-1, -0.3, 0.2, 1], np.float32))
    with pytest.raises(ValueError, match="codebook differs"):
        kc.join_shards([_weight(8, 64, k=2), other], "column")


# --------------------------------------------------------------------------
# sharded products on the NumPy path


def _same_up_to_sum_order(a, b, A, w) -> bool:
    """a and b (one dtype) differ by no more than reordering a float32 sum of
    K_dim products can make them: the sum's error bound, ``K_dim * 2**-24 *
    (|A| @ |W|.T)`` twice, plus one ulp of the rounded result."""
    eps = float(np.finfo(a.dtype).eps) if a.dtype == np.float16 else 2.0**-7
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    magnitude = np.abs(A.astype(np.float64)) @ np.abs(w.dequantize(np.float32)).T.astype(np.float64)
    slack = 2 * A.shape[-1] * 2.0**-24 * magnitude
    return bool((np.abs(a32 - b32) <= eps * np.maximum(np.abs(a32), np.abs(b32)) + slack).all())


@settings(max_examples=50, deadline=None)
@given(M=st.integers(1, 9), rows=st.integers(1, 24), blocks=st.integers(1, 5),
       n=st.integers(1, 8), k=st.integers(2, 5), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31))
def test_column_parallel_equals_unsharded(M, rows, blocks, n, k, dtype, seed):
    """Each rank's columns are its shard's product, placed unchanged, and the
    shard's effective weights are the original rows bit for bit (the test
    above). The product itself matches the unsharded one up to the order of
    the float32 sum: the NumPy path's matmul (OpenBLAS) picks its kernel, and
    with it the summation order, by the output width (sdot / sgemv / small
    sgemm), so a handful of outputs can land one ulp of fp16/bf16 apart
    (more where the sum cancels)."""
    w = _weight(rows * n, 32 * blocks, k, seed)
    A = np.random.default_rng(seed + 1).standard_normal((M, 32 * blocks)).astype(dtype)
    shards = kc.shard_weight(w, n, "column")
    C = kc.simulate_tensor_parallel(A, shards, "column")
    local = kc.simulate_tensor_parallel(A, shards, "column", gather_output=False)
    assert len(local) == n and all(c.shape == (M, rows) for c in local)
    assert _same_bits(C, np.concatenate([kc.kbit_gemm(A, s) for s in shards], axis=-1))
    assert _same_up_to_sum_order(C, kc.kbit_gemm(A, w), A, w)


@settings(max_examples=50, deadline=None)
@given(M=st.integers(1, 9), N=st.integers(64, 160), blocks=st.integers(1, 6),
       n=st.integers(1, 8), k=st.integers(2, 5), dtype=st.sampled_from(DTYPES),
       reduce_dtype=st.sampled_from(parallel.REDUCE_DTYPES), seed=st.integers(0, 2**31))
def test_row_parallel_sum_is_within_the_contract(M, N, blocks, n, k, dtype, reduce_dtype, seed):
    """At least 64 outputs: kbit_gemm rounds each partial product to the
    activation dtype, so on a handful of outputs whose partials cancel the
    relative error can pass the bound (e.g. one bf16 output of 4 shards:
    1.4e-2), whatever dtype the sum runs in; over many outputs it averages
    out (module docstring). A guarantee on every shape needs float32
    partials from kbit_gemm."""
    w = _weight(N, 32 * blocks * n, k, seed)
    A = np.random.default_rng(seed + 1).standard_normal((M, 32 * blocks * n)).astype(dtype)
    C = kc.simulate_tensor_parallel(A, kc.shard_weight(w, n, "row"), "row",
                                    reduce_dtype=reduce_dtype)
    assert C.shape == (M, N) and C.dtype == np.dtype(dtype)
    assert _rel_error(C, A, w) <= TOL[np.dtype(dtype)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_parallel_error_at_llama_like_sizes(dtype):
    """The module docstring's table: 8 shards stay well inside the contract."""
    w = _weight(256, 4096, 4, seed=3)
    A = np.random.default_rng(4).standard_normal((16, 4096)).astype(dtype)
    unsharded = _rel_error(kc.kbit_gemm(A, w), A, w)
    for mode in ("activation", "float32"):
        C = kc.simulate_tensor_parallel(A, kc.shard_weight(w, 8, "row"), "row",
                                        reduce_dtype=mode)
        err = _rel_error(C, A, w)
        assert err <= TOL[np.dtype(dtype)] / 2, (mode, err)
        assert err <= 3 * unsharded, (mode, err, unsharded)


def test_auto_reduce_dtype_switches_to_float32_past_the_limit():
    limit = parallel.AUTO_ACTIVATION_MAX_SHARDS
    assert parallel._resolve_reduce("auto", limit) == "activation"
    assert parallel._resolve_reduce("auto", limit + 1) == "float32"
    assert parallel._resolve_reduce("activation", 64) == "activation"
    with pytest.raises(ValueError, match="reduce_dtype"):
        parallel._resolve_reduce("fp32", 2)


def test_row_parallel_takes_split_or_whole_input():
    w = _weight(16, 128)
    shards = kc.shard_weight(w, 4, "row")
    A = np.random.default_rng(0).standard_normal((3, 128)).astype(np.float16)
    whole = parallel._input_slice(A, 2, 4, 32)
    assert _same_bits(whole, A[:, 64:96])
    assert parallel._input_slice(A[:, :32], 0, 4, 32) is not None
    with pytest.raises(ValueError, match="K_dim=32 .* or the whole K_dim=128"):
        parallel._input_slice(A[:, :64], 0, 4, 32)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        kc.simulate_tensor_parallel(A.astype(np.float32), shards, "row")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_mlp_shards_compute_the_unsharded_mlp(dtype, n):
    H, I = 128, 256
    gate, up, down = _weight(I, H, seed=1), _weight(I, H, seed=2), _weight(H, I, seed=3)
    x = np.random.default_rng(5).standard_normal((4, H)).astype(dtype)
    shards = kc.shard_mlp(gate, up, down, n)
    assert all(gu.shape == (2 * I // n, H) and d.shape == (H, I // n) for gu, d in shards)
    ref = parallel.mlp_reference(x, kc.join_shards([gate, up], "column"), down)
    y = parallel.simulate_mlp(x, shards)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    diff = np.linalg.norm(y.astype(np.float64) - ref.astype(np.float64))
    assert diff <= 2 * TOL[np.dtype(dtype)] * np.linalg.norm(ref.astype(np.float64))
    if n == 1:
        assert _same_bits(y, ref)


def test_shard_mlp_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="gate and up must be"):
        kc.shard_mlp(_weight(64, 32), _weight(64, 32), _weight(64, 32), 2)


def test_swiglu_numpy():
    h = np.array([[0.0, 1.0, 2.0, 3.0]], np.float16)
    y = parallel.swiglu(h)
    expect = np.float32([0.0, 1.0 / (1.0 + np.exp(-1.0))]) * np.float32([2.0, 3.0])
    assert y.dtype == np.float16 and np.allclose(y.astype(np.float32), expect, rtol=1e-3)
    with pytest.raises(ValueError, match="even"):
        parallel.swiglu(np.zeros((1, 3), np.float16))


# --------------------------------------------------------------------------
# whole models and shard files


def _model():
    rng = np.random.default_rng(9)
    return {"up": _weight(64, 128, seed=1), "down": _weight(128, 128, seed=2),
            "up.bias": rng.standard_normal(64).astype(np.float16),
            "norm": rng.standard_normal(64).astype(np.float32)}


PLAN = {"up": "column", "down": "row", "up.bias": "column"}


def _assert_same_model(a, b):
    assert set(a) == set(b)
    for name in a:
        if isinstance(a[name], kc.KbitWeight):
            for part in ("packed", "absmax", "codebook"):
                assert _same_bits(getattr(a[name], part), getattr(b[name], part)), name
            assert a[name].shape == b[name].shape
        else:
            assert _same_bits(a[name], b[name]), name


def test_shard_model_round_trip():
    model = _model()
    shards = kc.shard_model(model, 4, PLAN)
    assert shards[1]["up"].shape == (16, 128) and shards[1]["down"].shape == (128, 32)
    assert shards[3]["up.bias"].shape == (16,) and shards[3]["norm"] is model["norm"]
    _assert_same_model(kc.join_model(shards, PLAN), model)
    with pytest.raises(ValueError, match="plan names 'missing'"):
        kc.shard_model(model, 2, {"missing": "row"})
    with pytest.raises(ValueError, match="cannot be split into 3"):
        kc.shard_model({"b": np.zeros(4)}, 3, {"b": "column"})


def test_shard_files_round_trip_and_reshard(tmp_path):
    model = _model()
    paths = kc.save_sharded(tmp_path / "m", kc.shard_model(model, 4, PLAN), PLAN,
                            metadata={"model": "tiny"})
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        f"m-0000{r}-of-00004.safetensors" for r in range(1, 5)]
    place = parallel.read_shard_place(paths[2])
    assert (place.rank, place.n_shards, place.plan) == (2, 4, PLAN)
    assert kc.read_safetensors_metadata(paths[2])["model"] == "tiny"
    one = kc.load_shard(paths[2], rank=2, n_shards=4)
    _assert_same_model(one, kc.shard_model(model, 4, PLAN)[2])
    joined, plan = kc.load_sharded(list(reversed(paths)))
    assert plan == PLAN
    _assert_same_model(joined, model)
    _assert_same_model(kc.shard_model(joined, 2, plan)[1], kc.shard_model(model, 2, PLAN)[1])


def test_loading_on_another_shard_count_is_refused(tmp_path):
    paths = kc.save_sharded(tmp_path / "m", kc.shard_model(_model(), 4, PLAN), PLAN)
    with pytest.raises(ValueError, match=r"shard 2 of 4, but this run uses 2 shards.*load_sharded"):
        kc.load_shard(paths[1], rank=1, n_shards=2)
    with pytest.raises(ValueError, match="rank 3 asked for it"):
        kc.load_shard(paths[1], rank=3, n_shards=4)
    with pytest.raises(ValueError, match=r"shards \[2\] of 4 are missing"):
        kc.load_sharded([paths[0], paths[2], paths[3]])
    with pytest.raises(ValueError, match="are both shard 1 of 4"):
        kc.load_sharded([paths[0], paths[0]])
    other = kc.save_sharded(tmp_path / "o", kc.shard_model(_model(), 2, PLAN), PLAN)
    with pytest.raises(ValueError, match="not one model's shards"):
        kc.load_sharded([paths[0], other[1]])


def test_shard_file_errors(tmp_path):
    plain = tmp_path / "plain.safetensors"
    kc.save_quantized(plain, {"w": _weight(8, 64)})
    with pytest.raises(ValueError, match="not a shard file"):
        kc.load_shard(plain, rank=0, n_shards=1)
    shard = kc.shard_model(_model(), 2, PLAN)[0]
    with pytest.raises(ValueError, match="reserved"):
        kc.save_shard(tmp_path / "x", shard, kc.ShardPlace(0, 2, PLAN),
                      metadata={parallel.SHARD_METADATA_KEY: "x"})
    with pytest.raises(ValueError, match="rank must be an integer in 0..1"):
        kc.ShardPlace(2, 2, PLAN)
    bad = tmp_path / "bad.safetensors"
    kc.save_quantized(bad, shard, {parallel.SHARD_METADATA_KEY: json.dumps({"version": 7})})
    with pytest.raises(ValueError, match="metadata is damaged"):
        parallel.read_shard_place(bad)


# --------------------------------------------------------------------------
# the layer's checks: raised before any collective


class _RecordingGroup:
    def __init__(self, rank, size, device=0):
        self.rank, self.size, self.device, self.calls = rank, size, device, []

    def all_gather(self, *args):
        self.calls.append("all_gather")

    def all_reduce(self, *args):
        self.calls.append("all_reduce")


def test_local_problems_raise_before_any_collective():
    w = _weight(16, 128)
    shards = kc.shard_weight(w, 4, "column")
    group = _RecordingGroup(rank=1, size=2)
    with pytest.raises(ValueError, match="communicator has 2 ranks but the shard is 1 of 4"):
        kc.TensorParallelLinear(shards[1], "column", group, n_shards=4, check_peers=False)
    group = _RecordingGroup(rank=1, size=4)
    with pytest.raises(ValueError, match="rank 1 of the communicator holds shard 2"):
        kc.TensorParallelLinear(shards[2], "column", group, rank=2, check_peers=False)
    with pytest.raises(ValueError, match="NumPy weight; move it to GPU 0"):
        kc.TensorParallelLinear(shards[1], "column", group, check_peers=False)
    assert group.calls == []


def _table(rows):
    return np.array(rows, dtype=np.int64)


def test_peer_descriptions_that_disagree():
    good = [0, 2, 0, 0, 64, 128, 4, 1, 77]
    assert parallel._disagreement(_table([good, good[:2] + [1] + good[3:]])) is None
    assert "ranks [1] found a problem" in parallel._disagreement(
        _table([good, [1] + good[1:2] + [1] + good[3:]]))
    assert "disagree on n_shards" in parallel._disagreement(
        _table([good, [0, 4, 1] + good[3:]]))
    assert "disagree on axis: ['column', 'row']" in parallel._disagreement(
        _table([good, [0, 2, 1, 1] + good[4:]]))
    assert "holds shard 0" in parallel._disagreement(_table([good, good]))


# --------------------------------------------------------------------------
# one GPU: the layer code with the collectives done locally


class _LocalHub:
    """Stands in for NCCL between ranks that all live on one GPU: a
    collective completes when every rank has called it, gathering or summing
    (in rank order, the way ``simulate_tensor_parallel`` does) in place."""

    def __init__(self, size):
        self.size, self.pending = size, {}

    def group(self, rank, device=0):
        hub = self

        class Group:
            def __init__(self):
                self.rank, self.size, self.device, self.calls = rank, hub.size, device, 0

            def group_start(self):
                pass

            def group_end(self):
                pass

            def all_gather(self, buffer, count, stream_ptr):
                self.calls += 1
                hub._arrive("gather", rank, buffer, count)

            def all_reduce(self, buffer, stream_ptr):
                self.calls += 1
                hub._arrive("reduce", rank, buffer, None)

        return Group()

    def _arrive(self, kind, rank, buffer, count):
        bufs = self.pending.setdefault(kind, {})
        bufs[rank] = buffer
        if len(bufs) < self.size:
            return
        del self.pending[kind]
        if kind == "gather":
            flat = [bufs[r].reshape(-1) for r in range(self.size)]
            for r in range(self.size):
                for dst in flat:
                    dst[r * count:(r + 1) * count] = flat[r][r * count:(r + 1) * count]
        else:
            mode = "float32" if bufs[0].dtype == np.float32 else "activation"
            total = parallel._sum_partials(np, [bufs[r].get() for r in range(self.size)], mode)
            for r in range(self.size):
                bufs[r].set(total)


def _gpu_layers(shards, axis, **options):
    hub = _LocalHub(len(shards))
    groups = [hub.group(r) for r in range(len(shards))]
    return kc.TensorParallelLinear.build_all(shards, axis, groups, **options), groups


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("M", [1, 5, 64])
@pytest.mark.parametrize("k", [2, 4, 5])
def test_gpu_layers_match_the_local_simulation(k, M, n, dtype):
    import cupy as cp

    w = _weight(128 * n, 256 * n, k, seed=k + n, xp=cp)
    A = cp.asarray(np.random.default_rng(M).standard_normal((M, 256 * n)).astype(dtype))
    col = kc.shard_weight(w, n, "column")
    layers, _ = _gpu_layers(col, "column")
    outs = kc.parallel_forward(layers, [A] * n)
    expect = kc.simulate_tensor_parallel(A, col, "column")
    assert all(_same_bits(o.get(), expect.get()) for o in outs)
    assert _rel_error(expect, A, w) <= TOL[np.dtype(dtype)]
    for mode in ("activation", "float32"):
        row = kc.shard_weight(w, n, "row")
        layers, _ = _gpu_layers(row, "row", reduce_dtype=mode)
        outs = kc.parallel_forward(layers, [A] * n)
        expect = kc.simulate_tensor_parallel(A, row, "row", reduce_dtype=mode)
        assert all(_same_bits(o.get(), expect.get()) for o in outs), mode
        assert _rel_error(expect, A, w) <= TOL[np.dtype(dtype)], mode


@pytest.mark.gpu
@needs_gpu
def test_gpu_mlp_simulation_matches_unsharded(pytestmark=needs_gpu):
    import cupy as cp

    H, I = 512, 1024
    gate, up = _weight(I, H, seed=1, xp=cp), _weight(I, H, seed=2, xp=cp)
    down = _weight(H, I, seed=3, xp=cp)
    for dtype in DTYPES:
        x = cp.asarray(np.random.default_rng(0).standard_normal((16, H)).astype(dtype))
        ref = parallel.mlp_reference(x, kc.join_shards([gate, up], "column"), down).get()
        for n in (2, 4):
            y = parallel.simulate_mlp(x, kc.shard_mlp(gate, up, down, n)).get()
            diff = np.linalg.norm(y.astype(np.float64) - ref.astype(np.float64))
            assert diff <= 2 * TOL[np.dtype(dtype)] * np.linalg.norm(ref.astype(np.float64))


@pytest.mark.gpu
@needs_gpu
def test_gpu_checks_raise_on_every_rank_before_the_data_moves(pytestmark=needs_gpu):
    import cupy as cp

    w = _weight(64, 256, xp=cp)
    shards = kc.shard_weight(w, 2, "column")
    # rank 1 holds a shard of a 4-way split: every rank raises, after only the check exchange
    four = kc.shard_weight(w, 4, "column")
    hub = _LocalHub(2)
    groups = [hub.group(0), hub.group(1)]
    with pytest.raises(ValueError, match="disagree on N: \\[64, 32\\]"):
        kc.TensorParallelLinear.build_all([shards[0], four[1]], "column", groups)
    assert [g.calls for g in groups] == [1, 1]
    # a shard on another GPU than its communicator's: found on that rank
    layer = kc.TensorParallelLinear.__new__(kc.TensorParallelLinear)
    away = _LocalHub(2).group(1, device=7)
    layer._init_local(shards[1], "column", away, None, None, True, "auto")
    assert "shard is on GPU 0 but its communicator on GPU 7" in layer._problem
    # peers whose shards come from different weights
    hub = _LocalHub(2)
    other = kc.shard_weight(_weight(64, 512, xp=cp), 2, "column")
    with pytest.raises(ValueError, match="disagree on K_dim"):
        kc.TensorParallelLinear.build_all([shards[0], other[1]], "column",
                                          [hub.group(0), hub.group(1)])


def _nccl_available():
    if not gpu_available():
        return False
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001
        return False
    return bool(nccl.available)


@pytest.mark.gpu
@pytest.mark.skipif(not _nccl_available(), reason="needs a CUDA GPU and CuPy's NCCL")
def test_gpu_one_rank_nccl_layer_and_graph_capture():
    import cupy as cp

    group = kc.NcclGroup.create(parallel.new_unique_id(), 1, 0, 0)
    w = _weight(256, 512, xp=cp)
    A = cp.asarray(np.random.default_rng(0).standard_normal((4, 512)).astype(np.float16))
    for axis in parallel.AXES:
        for mode in ("activation", "float32"):
            layer = kc.TensorParallelLinear(kc.shard_weight(w, 1, axis)[0], axis, group,
                                            reduce_dtype=mode)
            assert _same_bits(layer(A).get(), kc.kbit_gemm(A, w).get())
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                layer(A)  # plans built eagerly first
                stream.begin_capture()
                C = layer(A)
                keep = layer.buffers
                graph = stream.end_capture()
                graph.launch(stream)
            stream.synchronize()
            assert keep is not None and _same_bits(C.get(), kc.kbit_gemm(A, w).get())
