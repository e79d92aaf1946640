"""The GPU call path (issue 18): no hidden synchronisation, capturable in a
CUDA graph from a fresh weight's first call on (CuPy's capture and
``torch.cuda.graph``), replays bit-identical to eager calls, per-call work
cached, and the clear errors kept on the fast path.

GPU-marked; skipped without a CUDA GPU (torch cases also without torch).
"""

from __future__ import annotations

import numpy as np
import pytest

import kbit_cupy as kc
from kbit_cupy._arrays import gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")]

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
}
"""


def _spin(ms: float):
    """Occupy the current stream for about ``ms`` milliseconds (one thread)."""
    import cupy as cp

    kern = cp.RawKernel(_SPIN, "spin")
    rate = cp.cuda.Device().attributes["ClockRate"]  # kHz
    kern((1,), (1,), (np.int64(ms * rate),))


def _fresh_weight(N, K_dim, k=4, seed=0, fmt="e4m4"):
    import cupy as cp

    rng = np.random.default_rng(seed)
    W = cp.asarray(rng.standard_normal((N, K_dim)).astype(np.float16))
    return kc.quantize_weight(W, k=k, absmax_format=fmt)


def _experts(E=8, N=256, K_dim=512, k=4):
    import cupy as cp

    rng = np.random.default_rng(1)
    W = cp.asarray(rng.standard_normal((E, N, K_dim)).astype(np.float16))
    return kc.quantize_experts(W, k=k)


def _gemm_kernels():
    kernels = ["mma", "latency", "dequant", "auto"]
    if kc.gemm.has_wgmma():
        kernels.append("wgmma")
    if kc._launch.cluster_launch_supported():  # (sm_90: the cluster split)
        kernels.append("cluster")
    return kernels


# Each public GPU call, once its per-shape state exists, as a closure over
# fresh inputs: name -> (setup() -> call()).
def _calls():
    import cupy as cp

    rng = np.random.default_rng(2)
    out = {}
    for kernel in _gemm_kernels():
        for M in (1, 16, 200):
            def setup(kernel=kernel, M=M):
                w = _fresh_weight(768, 2048)
                A = cp.asarray(rng.standard_normal((M, 2048)).astype(np.float16))
                C = cp.full((M, 768), np.nan, cp.float16)  # poison: every element written
                call = lambda: kc.kbit_gemm(A, w, out=C, kernel=kernel)
                call.reference = lambda: (cp.asnumpy(A).astype(np.float64)
                                          @ cp.asnumpy(w.dequantize(np.float32)).T)
                return call
            out[f"kbit_gemm[{kernel},M={M}]"] = setup

    def dequant_setup():
        w = _fresh_weight(512, 1024)
        o = cp.empty((512, 1024), cp.float16)
        return lambda: kc.dequantize_kbit(w.packed, w.absmax, w.codebook, 4, w.shape, out=o)
    out["dequantize_kbit"] = dequant_setup

    def quant_setup():
        X = cp.asarray(rng.standard_normal((512, 1024)).astype(np.float16))
        return lambda: kc.quantize_kbit(X, k=4, validate=False)
    out["quantize_kbit(validate=False)"] = quant_setup

    for T in (4, 64, 640):  # moe_linear at 640: 5120 pairs, past experts._FUSED_ROUTE_MAX_PAIRS
        def grouped_setup(T=T):
            ex = _experts()
            A = cp.asarray(rng.standard_normal((T, 512)).astype(np.float16))
            offs = cp.asarray(np.linspace(0, T, 9).astype(np.int32))
            C = cp.empty((T, 256), cp.float16)
            return lambda: kc.kbit_grouped_gemm(A, ex, offs, out=C, validate=False)
        out[f"kbit_grouped_gemm[T={T}]"] = grouped_setup

        def moe_setup(T=T):
            ex = _experts()
            x = cp.asarray(rng.standard_normal((T, 512)).astype(np.float16))
            # T = 64: routed inside the grouped launch; 640: the routing launch first
            ids = cp.asarray(rng.integers(0, 8, (T, 8)).astype(np.int64))
            C = cp.empty((T, 8, 256), cp.float16)
            return lambda: kc.moe_linear(x, ids, ex, out=C, validate=False)
        out[f"moe_linear[T={T}]"] = moe_setup
    return out


CALLS = list(_calls()) if gpu_available() else []


@pytest.mark.parametrize("name", CALLS)
def test_call_returns_while_a_long_kernel_runs_ahead(name):
    """Issued behind a ~20 ms kernel on the same stream, the call returns
    before that kernel ends: nothing in it waits for the GPU."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        call = _calls()[name]()
        call()  # the first call may compile and build its plan
        stream.synchronize()
        _spin(20)
        ahead = cp.cuda.Event()
        ahead.record(stream)
        call()
        still_running = not ahead.done
        stream.synchronize()
    assert still_running, f"{name} waited for the GPU"


def _replay_matches(call, result_of, capture):
    """Capture ``call`` (its first call) with ``capture``, replay, compare with eager."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()  # the inputs (made on other streams) are ready
    with stream:
        graph_result, graph = capture(stream, call)
        stream.synchronize()
        got = cp.asnumpy(result_of(graph_result))
        eager = cp.asnumpy(result_of(call()))
        stream.synchronize()
    del graph
    assert got.tobytes() == eager.tobytes()
    return got


def _cupy_capture(stream, call):
    stream.begin_capture()
    result = call()
    graph = stream.end_capture()
    graph.launch(stream)
    graph.launch(stream)
    return result, graph


def _torch_capture(stream, call):
    import cupy as cp
    import torch

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    # capture_error_mode "global"; CuPy runs on torch's capturing stream
    with torch.cuda.graph(graph, stream=side), cp.cuda.ExternalStream(side.cuda_stream):
        result = call()
    graph.replay()
    torch.cuda.synchronize()
    return result, graph


def _result(value):
    return value[0] if isinstance(value, tuple) else value


def _check_reference(call, got):
    reference = getattr(call, "reference", None)
    if reference is not None:
        ref = reference()
        err = np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref)
        assert err < 2e-3, err


@pytest.mark.parametrize("name", CALLS)
def test_first_call_captures_with_cupy_and_replays_bit_identical(name):
    call = _calls()[name]()
    _check_reference(call, _replay_matches(call, _result, _cupy_capture))


@pytest.mark.parametrize("name", CALLS)
def test_first_call_captures_with_torch_graph_and_replays_bit_identical(name):
    pytest.importorskip("torch")
    call = _calls()[name]()
    _check_reference(call, _replay_matches(call, _result, _torch_capture))


def test_cached_calls_do_no_planning(monkeypatch):
    """After the first call, 1,000 calls run none of the compile, dispatch,
    repack or geometry helpers (what depends on the shapes is cached)."""
    import cupy as cp

    from kbit_cupy import _jit, gemm, quantize

    w = _fresh_weight(768, 2048)
    A = cp.ones((4, 2048), cp.float16)
    for kernel in _gemm_kernels():
        kc.kbit_gemm(A, w, kernel=kernel)
    counts = {}

    def counting(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    for module, name in [(_jit, "get_kernel"), (gemm, "choose_kernel"), (gemm, "_work_split"),
                         (gemm, "launch_ctas_per_sm"), (gemm, "repack_for_gemm"),
                         (gemm, "_check_activations"), (gemm, "_plan_launch"),
                         (quantize, "_sm_count")]:
        counting(module, name)
    for _ in range(1000):
        for kernel in _gemm_kernels():
            kc.kbit_gemm(A, w, kernel=kernel)
    cp.cuda.get_current_stream().synchronize()
    assert counts == {}


def test_fast_path_keeps_the_clear_errors():
    import cupy as cp

    w = _fresh_weight(256, 512)
    A = cp.ones((3, 512), cp.float16)
    kc.kbit_gemm(A, w)  # the plan for (3, 512) fp16 now exists
    with pytest.raises(ValueError, match="last dimension"):
        kc.kbit_gemm(cp.ones((3, 256), cp.float16), w)
    with pytest.raises(TypeError, match="float16 or"):
        kc.kbit_gemm(cp.ones((3, 512), cp.float32), w)
    with pytest.raises(ValueError, match="out must have shape"):
        kc.kbit_gemm(A, w, out=cp.empty((3, 255), cp.float16))
    with pytest.raises(ValueError, match="out must have shape"):
        kc.kbit_gemm(A, w, out=cp.empty((3, 256), cp.float32))
    with pytest.raises(ValueError, match="contiguous"):
        kc.kbit_gemm(A, w, out=cp.empty((256, 3), cp.float16).T)
    with pytest.raises(TypeError, match="same place"):
        kc.kbit_gemm(np.ones((3, 512), np.float16), w)
    # a non-contiguous A is still accepted (copied), with the same result
    wide = cp.ones((3, 1024), cp.float16)[:, ::2]
    assert (kc.kbit_gemm(wide, w) == kc.kbit_gemm(A, w)).all()
    # one row with a long row stride counts as contiguous; the plan still takes it
    row = cp.ones((1, 1024), cp.float16)[:, :512]
    assert (kc.kbit_gemm(row, w) == kc.kbit_gemm(A[:1], w)).all()
    assert (kc.kbit_gemm(row, w) == kc.kbit_gemm(A[:1], w)).all()  # the cached plan
    # changing the weight's arrays drops its plans: the new values are used
    w2 = _fresh_weight(256, 512, seed=5)
    before = kc.kbit_gemm(A, w)
    w.packed, w.absmax = w2.packed, w2.absmax
    assert (kc.kbit_gemm(A, w) == kc.kbit_gemm(A, w2)).all()
    assert not (kc.kbit_gemm(A, w) == before).all()


def test_weight_on_another_gpu_raises_on_the_fast_path():
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    w = _fresh_weight(256, 512)
    A = cp.ones((3, 512), cp.float16)
    kc.kbit_gemm(A, w)
    with cp.cuda.Device(1):
        A1 = cp.ones((3, 512), cp.float16)
        with pytest.raises(ValueError, match="GPU"):
            kc.kbit_gemm(A1, w)


def test_threads_sharing_a_stream_and_a_weight_get_their_own_results():
    """Plans are per thread: two threads calling kbit_gemm on one weight and
    one stream (the default) never launch with each other's pointers."""
    import threading

    import cupy as cp

    w = _fresh_weight(512, 1024)
    inputs = [cp.asarray(np.random.default_rng(s).standard_normal((4, 1024)).astype(np.float16))
              for s in range(4)]
    expected = [cp.asnumpy(kc.kbit_gemm(A, w)) for A in inputs]
    failures = []

    def work(i):
        try:
            with cp.cuda.Device(0):
                for _ in range(300):
                    got = kc.kbit_gemm(inputs[i], w)
                    if not (cp.asnumpy(got) == expected[i]).all():
                        failures.append((i, "wrong result"))
                        return
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            failures.append((i, repr(exc)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    # and the other public calls from a fresh thread (its first calls build its plans)
    errors = []

    def others():
        try:
            with cp.cuda.Device(0):
                ex = _experts()
                A = cp.ones((4, 512), cp.float16)
                offs = cp.asarray(np.linspace(0, 4, 9).astype(np.int32))
                kc.kbit_grouped_gemm(A, ex, offs, validate=False)
                kc.dequantize_kbit(w.packed, w.absmax, w.codebook, 4, w.shape)
                kc.kbit_gemm(inputs[0], w, kernel="dequant")
                cp.cuda.get_current_stream().synchronize()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(repr(exc))

    t = threading.Thread(target=others)
    t.start()
    t.join()
    assert errors == []
