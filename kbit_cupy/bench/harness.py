"""Benchmark timing harness: cold-L2 kernel timing on CUDA events (TARGETS.md).

How a number is taken (see ``/work/shared/TARGETS.md``, "How a number is taken"):

* ``time_ops`` -- the method that works for everything, cuBLAS included. Per
  repetition and per op: overwrite a 256 MB scratch buffer (evicts L2 and keeps
  the GPU busy while the host queues the op, so host overhead stays out),
  record a start event, run the op, record an end event. Ops are interleaved
  rep by rep so the baseline and ours see the same conditions. One
  synchronization at the end; statistics in microseconds.
* ``time_graph`` -- the figure with launch gaps removed: a CUDA graph of N
  (overwrite, op) pairs minus a graph of N overwrites alone, divided by N.
  CuPy cannot capture cuBLAS calls; for such ops it returns ``None``.
* ``copy_bandwidth`` -- the device-to-device copy ceiling (bytes read + written).
* ``cublas_fp16_matmul_op`` -- the in-run baseline ``A @ W.T`` (fp16 or bf16).

Everything on the GPU is timed with ``cupy.cuda.Event`` and
``cupy.cuda.get_elapsed_time``. Inputs are random, never zeros.

CuPy is imported lazily: this module imports (and ``write_results``,
``progress``, ``git_commit`` work) on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .._files import write_text

__all__ = [
    "DEFAULT_FLUSH_BYTES",
    "METHOD",
    "MatmulOp",
    "copy_bandwidth",
    "cublas_fp16_matmul_op",
    "free_scratch",
    "git_commit",
    "gpu_info",
    "progress",
    "time_graph",
    "time_ops",
    "write_results",
]

DEFAULT_FLUSH_BYTES = 256 << 20

METHOD = (
    "cold L2: per rep a 256 MB scratch overwrite, then CUDA events around the op; "
    "ops interleaved rep by rep in one process; median of reps (us). "
    "Graph figures: graph of N (overwrite, op) pairs minus graph of N overwrites, / N."
)

T = TypeVar("T")


# --------------------------------------------------------------------------
# lazy CuPy


def _cupy() -> Any:
    """Import and return the ``cupy`` module (lazily, so the module imports without a GPU)."""
    import cupy

    return cupy


_STREAMS: dict[int, Any] = {}
_FLUSHERS: dict[tuple[int, int], _Flusher] = {}


def _bench_stream() -> Any:
    """The harness's non-blocking stream for the current device, after a device sync.

    The device synchronization orders any setup work queued on other streams
    (e.g. input generation on the legacy default stream, which a non-blocking
    stream does not implicitly wait for) before the timed work. One stream per
    device is kept for the life of the process: CuPy's memory pool caches
    freed blocks per stream, so a fresh stream per call would strand them.
    """
    cp = _cupy()
    dev = cp.cuda.Device()
    dev.synchronize()
    s = _STREAMS.get(dev.id)
    if s is None:
        s = _STREAMS[dev.id] = cp.cuda.Stream(non_blocking=True)
    return s


def _flusher(flush_bytes: int) -> _Flusher:
    """The cached scratch overwriter of this size on the current device.

    Allocate it with the harness stream current, so its memory comes from and
    returns to that stream's pool.
    """
    key = (int(_cupy().cuda.Device().id), int(flush_bytes))
    f = _FLUSHERS.get(key)
    if f is None:
        f = _FLUSHERS[key] = _Flusher(flush_bytes)
    return f


_READ_ALL = r"""
extern "C" __global__ void kbit_read_all(const uint4* p, long long n, unsigned* sink) {
  unsigned x = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = p[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) sink[0] = x;  // (never, in practice): the reads stay
}
"""


def read_flusher(flush_bytes: int) -> Callable[[], None]:
    """A flush that reads ``flush_bytes`` of scratch instead of overwriting it
    (for ``time_ops(flush_fn=...)`` and probes): L2 is left full of clean
    lines, as after the previous layer's weights, where TARGETS.md's
    overwrite leaves it dirty. One grid-stride kernel of 16-byte loads."""
    cp = _cupy()
    words = max(int(flush_bytes), 16) // 16
    buf = cp.ones(words * 4, cp.uint32)
    sink = cp.zeros(1, cp.uint32)
    kern = cp.RawKernel(_READ_ALL, "kbit_read_all")
    grid = cp.cuda.Device().attributes["MultiProcessorCount"] * 8
    return lambda: kern((grid,), (256,), (buf, cp.int64(words), sink))


def free_scratch() -> None:
    """Drop the cached scratch buffers and streams (their memory returns to CuPy's pool)."""
    _FLUSHERS.clear()
    _STREAMS.clear()


class _Flusher:
    """Overwrites a scratch buffer on the current stream (all bytes, on the GPU).

    ``flush_bytes <= 0`` makes every call a no-op (warm-cache timing).
    The fill value cycles through non-zero values so that each overwrite runs
    the elementwise fill kernel (CuPy uses a memset only for zero) and the
    buffer never holds zeros.
    """

    def __init__(self, flush_bytes: int) -> None:
        """Allocate ``flush_bytes`` (rounded down to 4-byte words) of scratch."""
        cp = _cupy()
        n = max(int(flush_bytes), 0) // 4
        self.nbytes = n * 4
        self.buf = cp.empty(n, dtype=cp.uint32) if n else None
        self._count = 0

    def __call__(self) -> None:
        """Overwrite the whole scratch buffer once, asynchronously."""
        if self.buf is None:
            return
        self._count += 1
        self.buf.fill(np.uint32(1 + self._count % 251))


def _stats_us(samples_us: Sequence[float]) -> dict[str, Any]:
    """Median/min/mean/p10/p90 (microseconds) of a list of samples."""
    a = np.asarray(samples_us, dtype=np.float64)
    if a.size == 0:
        nan = float("nan")
        return {
            "median_us": nan,
            "min_us": nan,
            "mean_us": nan,
            "p10_us": nan,
            "p90_us": nan,
            "n": 0,
        }
    p10, p90 = np.percentile(a, [10.0, 90.0])
    return {
        "median_us": float(np.median(a)),
        "min_us": float(a.min()),
        "mean_us": float(a.mean()),
        "p10_us": float(p10),
        "p90_us": float(p90),
        "n": int(a.size),
    }


# --------------------------------------------------------------------------
# provenance


def _repo_dir() -> Path:
    """The directory holding the ``kbit_cupy`` package (the repository root in a checkout)."""
    return Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    """stdout of ``git *args`` run in the package's parent directory, or None on failure."""
    try:
        r = subprocess.run(
            ["git", *args],
            cwd=_repo_dir(),
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def git_commit() -> str:
    """Short commit hash of the repository holding this package.

    ``$KBIT_COMMIT`` when set (the device machine gets a copy of the tree,
    where git may see some other repository's HEAD), else ``git rev-parse
    --short HEAD`` in the package's parent directory, else ``"unknown"``.
    """
    pinned = os.environ.get("KBIT_COMMIT", "").strip()
    return pinned or (_git("rev-parse", "--short", "HEAD") or "").strip() or "unknown"


def _git_dirty() -> bool | None:
    """True if tracked files differ from HEAD, False if clean, None if not a git checkout
    with commits."""
    if os.environ.get("KBIT_COMMIT", "").strip():
        return None  # a copied tree: git here does not describe it
    if not (_git("rev-parse", "--short", "HEAD") or "").strip():
        return None
    st = _git("status", "--porcelain", "--untracked-files=no")
    return None if st is None else bool(st.strip())


def _cuda_version_str(v: int) -> str:
    """CUDA integer version (e.g. 12080) as ``"12.8"``; 0 (no driver) as ``"none"``."""
    if v <= 0:
        return "none"
    return f"{v // 1000}.{(v % 1000) // 10}"


def gpu_info(device_id: int | None = None) -> dict[str, Any]:
    """Describe the GPU and software stack, for recording with every figure.

    Keys: ``gpu`` (name), ``cc`` (e.g. ``"sm_90"``), ``sm_count``,
    ``l2_bytes``, ``mem_bytes``, ``driver_version``, ``cuda_runtime_version``,
    ``cupy_version``, ``nvrtc_version``, ``date`` (UTC ISO 8601), ``commit``
    (``git_commit()``), ``git_dirty`` and, where the GPU reports it,
    ``peak_TB_s`` (memory clock x bus width). Never raises: fields that cannot be
    read (e.g. no GPU on this machine) read ``"unknown"`` / ``None`` and
    ``gpu`` reads ``"unavailable"``.
    """
    info: dict[str, Any] = {
        "gpu": "unavailable",
        "cc": "unknown",
        "sm_count": None,
        "l2_bytes": None,
        "mem_bytes": None,
        "driver_version": "unknown",
        "cuda_runtime_version": "unknown",
        "cupy_version": "unknown",
        "nvrtc_version": "unknown",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "git_dirty": _git_dirty(),
    }
    try:
        cp = _cupy()
    except Exception:  # noqa: BLE001 - no CuPy at all: still describe the run
        return info
    info["cupy_version"] = str(getattr(cp, "__version__", "unknown"))
    with contextlib.suppress(Exception):
        from cupy_backends.cuda.libs import nvrtc

        major, minor = nvrtc.getVersion()
        info["nvrtc_version"] = f"{major}.{minor}"
    with contextlib.suppress(Exception):
        info["driver_version"] = _cuda_version_str(int(cp.cuda.runtime.driverGetVersion()))
    with contextlib.suppress(Exception):
        info["cuda_runtime_version"] = _cuda_version_str(int(cp.cuda.runtime.runtimeGetVersion()))
    try:
        rt = cp.cuda.runtime
        if not cp.cuda.is_available():
            return info
        dev = int(cp.cuda.Device().id if device_id is None else device_id)
        props = rt.getDeviceProperties(dev)
        name = props.get("name", b"")
        info["gpu"] = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        info["cc"] = f"sm_{props['major']}{props['minor']}"
        info["sm_count"] = int(props["multiProcessorCount"])
        info["l2_bytes"] = int(props["l2CacheSize"])
        info["mem_bytes"] = int(props["totalGlobalMem"])
        info["device_id"] = dev
        with contextlib.suppress(Exception), cp.cuda.Device(dev):  # kernel="auto" keys rows on it
            from ..gemm import device_tbps

            info["peak_TB_s"] = device_tbps()
    except Exception as e:  # noqa: BLE001
        info["gpu_error"] = f"{type(e).__name__}: {e}"
    return info


# --------------------------------------------------------------------------
# timing


def time_ops(
    ops: Mapping[str, Callable[[], object]],
    reps: int = 50,
    warmup: int = 5,
    flush_bytes: int = DEFAULT_FLUSH_BYTES,
    interleave: bool = True,
    flush_fn: Callable[[], object] | None = None,
) -> dict[str, dict[str, Any]]:
    """Time ops cold-L2 with the flush-then-events method (works for cuBLAS too).

    For each rep and each op: overwrite a ``flush_bytes`` scratch buffer,
    record a start event, run ``op()``, record an end event -- all on one
    non-blocking stream that is current while the ops run (ops must launch
    on the current stream, which CuPy kernels and ``cupy.matmul`` do). With
    ``interleave`` the ops alternate within each rep (baseline and ours see the
    same conditions); without it each op runs all its reps in a block. Each op
    first runs ``warmup`` untimed (flush, op) rounds (compilation, module load,
    handle creation). One synchronization after all reps.

    Returns ``{name: {"median_us", "min_us", "mean_us", "p10_us", "p90_us",
    "n", "reps", "warmup", "flush_bytes", "samples_us"}}`` in the order of
    ``ops``.

    ``flush_fn``, where given, replaces the overwrite (for instance a read of
    a large buffer, which leaves L2 full of clean lines instead of dirty ones).
    """
    cp = _cupy()
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    names = list(ops)
    stream = _bench_stream()
    samples: dict[str, list[float]] = {n: [] for n in names}
    with stream:
        flush = flush_fn or _flusher(flush_bytes)
        for _ in range(max(int(warmup), 0)):
            for name in names:
                flush()
                ops[name]()
        stream.synchronize()

        if interleave:
            order = [(r, name) for r in range(reps) for name in names]
        else:
            order = [(r, name) for name in names for r in range(reps)]
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in order]
        for (_, name), (start, end) in zip(order, events):
            op = ops[name]
            flush()
            start.record(stream)
            op()
            end.record(stream)
        stream.synchronize()
        for (_, name), (start, end) in zip(order, events):
            samples[name].append(1e3 * float(cp.cuda.get_elapsed_time(start, end)))

    out: dict[str, dict[str, Any]] = {}
    for name in names:
        st = _stats_us(samples[name])
        st.update(
            reps=int(reps),
            warmup=int(warmup),
            flush_bytes=int(flush_bytes),
            samples_us=samples[name],
        )
        out[name] = st
    return out


def _capture(stream: Any, body: Callable[[], None]) -> Any:
    """Capture ``body()`` (run with ``stream`` current) into a CUDA graph.

    If ``body`` raises, the capture is ended (and its graph discarded) so the
    stream is usable again, then the exception propagates.
    """
    stream.begin_capture()
    try:
        body()
    except BaseException:
        # end the capture so the stream is usable again; it may be invalidated already
        with contextlib.suppress(Exception):
            if stream.is_capturing():
                stream.end_capture()
        raise
    return stream.end_capture()


def time_graph(
    op: Callable[[], object],
    reps: int = 50,
    warmup: int = 3,
    flush_bytes: int = DEFAULT_FLUSH_BYTES,
    replays: int = 10,
) -> dict[str, Any] | None:
    """Time one op as a CUDA graph of (flush, op) pairs minus a graph of flushes.

    Runs ``op`` once (and the flush once) before capture, so compilation and
    module load stay outside. Captures, on a non-blocking stream, graph P of
    ``reps`` (flush, op) pairs and graph F of ``reps`` flushes; launches each
    ``warmup`` times, then ``replays`` times alternately, each launch timed with
    events. Per replay the op time is ``(t_P - t_F) / reps``; reported is the
    median (and min/mean/p10/p90) over the replays.

    The op must not allocate memory it expects to survive between calls
    except through its return value (return values are kept alive while the
    graphs exist); ops should write into preallocated outputs.

    Returns ``{"median_us", "min_us", "mean_us", "p10_us", "p90_us", "n",
    "flush_us", "pairs_us", "n_per_graph", "replays", "flush_bytes",
    "samples_us"}`` or ``None`` if the op cannot be captured (e.g. it calls
    cuBLAS, or does a synchronous call): a note goes to stderr, nothing is
    raised.
    """
    cp = _cupy()
    if reps < 1 or replays < 1:
        raise ValueError(f"reps and replays must be >= 1, got {reps}, {replays}")
    stream = _bench_stream()
    keep: list[object] = []  # op results captured by the graph stay allocated
    with stream:
        flush = _flusher(flush_bytes)
        flush()
        keep.append(op())
        stream.synchronize()

        def pairs() -> None:
            for _ in range(reps):
                flush()
                keep.append(op())

        def flushes() -> None:
            for _ in range(reps):
                flush()

        try:
            g_pairs = _capture(stream, pairs)
            g_flush = _capture(stream, flushes)
        except Exception as e:  # noqa: BLE001 - uncapturable op: report, don't crash
            print(
                f"time_graph: capture failed ({type(e).__name__}: {e}); returning None",
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(Exception):
                stream.synchronize()
            return None

        g_pairs.upload(stream=stream)
        g_flush.upload(stream=stream)
        for _ in range(max(int(warmup), 0)):
            g_pairs.launch(stream=stream)
            g_flush.launch(stream=stream)
        stream.synchronize()

        evs = [(cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()) for _ in range(replays)]
        for e0, e1, e2 in evs:
            e0.record(stream)
            g_pairs.launch(stream=stream)
            e1.record(stream)
            g_flush.launch(stream=stream)
            e2.record(stream)
        stream.synchronize()

        t_pairs = [1e3 * float(cp.cuda.get_elapsed_time(e0, e1)) for e0, e1, _ in evs]
        t_flush = [1e3 * float(cp.cuda.get_elapsed_time(e1, e2)) for _, e1, e2 in evs]
        del g_pairs, g_flush
    keep.clear()

    per_op = [(p - f) / reps for p, f in zip(t_pairs, t_flush)]
    st = _stats_us(per_op)
    st.update(
        flush_us=float(np.median(t_flush)) / reps,
        pairs_us=float(np.median(t_pairs)) / reps,
        n_per_graph=int(reps),
        replays=int(replays),
        flush_bytes=int(flush_bytes),
        samples_us=per_op,
    )
    return st


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written.

    Copies a random float32 buffer of ``nbytes`` (rounded down to 4 bytes)
    into another with ``cupy.copyto``, ``reps`` times after two warm-up
    copies, each timed with events; returns ``2 * nbytes / median time``.
    At 1 GiB per buffer the L2 plays no part (cold-ish). Checks the copy.
    """
    cp = _cupy()
    n = int(nbytes) // 4
    if n <= 0 or reps < 1:
        raise ValueError(f"need nbytes >= 4 and reps >= 1, got {nbytes}, {reps}")
    src = cp.random.RandomState(1234).random_sample(n, dtype=cp.float32)
    src += np.float32(0.5)  # in [0.5, 1.5): never zero
    dst = cp.empty_like(src)
    stream = _bench_stream()
    with stream:
        for _ in range(2):
            cp.copyto(dst, src)
        evs = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
        for start, end in evs:
            start.record(stream)
            cp.copyto(dst, src)
            end.record(stream)
        stream.synchronize()
        times_s = [1e-3 * float(cp.cuda.get_elapsed_time(s, e)) for s, e in evs]
        idx = cp.asarray(np.linspace(0, n - 1, num=min(n, 4097), dtype=np.int64))
        ok = bool(cp.all(dst[idx] == src[idx]).get())
    if not ok:
        raise RuntimeError("copy_bandwidth: destination differs from source")
    return 2.0 * n * 4 / float(np.median(times_s))


# --------------------------------------------------------------------------
# the cuBLAS baseline


def _resolve_dtype(dtype: Any) -> np.dtype:
    """numpy dtype for ``"float16"``/``"fp16"``/``"half"``, ``"bfloat16"``/``"bf16"``, or any
    other dtype-like."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if isinstance(dtype, str) and dtype.lower() in ("fp16", "half"):
        return np.dtype(np.float16)
    return np.dtype(dtype)


class MatmulOp:
    """Callable computing ``out = a @ w.T`` with ``cupy.matmul`` into a preallocated output.

    Attributes ``a`` [M, K_dim], ``w`` [N, K_dim] and ``out`` [M, N] are the
    device arrays (for correctness checks); calling it returns ``out``.
    """

    def __init__(self, a: Any, w: Any, out: Any) -> None:
        """Hold the operands; ``w.T`` is a transposed view (cuBLAS reads it without a copy)."""
        self.a = a
        self.w = w
        self.wt = w.T
        self.out = out
        self._matmul = _cupy().matmul

    def __call__(self) -> Any:
        """Launch the GEMM on the current stream and return the output array."""
        return self._matmul(self.a, self.wt, out=self.out)


def cublas_fp16_matmul_op(
    M: int, N: int, K_dim: int, dtype: Any = "float16", seed: int = 0
) -> tuple[MatmulOp, dict[str, Any]]:
    """The in-run baseline: cuBLAS ``A @ W.T`` with A [M, K_dim], W [N, K_dim].

    A is standard normal, W normal with std 0.02, both drawn in float32 on the
    GPU and cast to ``dtype`` (``"float16"`` or ``"bfloat16"``, the latter via
    ``ml_dtypes``); never zeros. Returns ``(op, info)``: ``op()`` writes into a
    preallocated [M, N] output (fp32 accumulation in cuBLAS) and ``info`` holds
    plain numbers: M, N, K_dim, dtype, weight_bytes, act_bytes, out_bytes,
    bytes (all three) and flops (2*M*N*K_dim).
    """
    cp = _cupy()
    dt = _resolve_dtype(dtype)
    try:
        rs = cp.random.RandomState(seed)
        a = rs.standard_normal((M, K_dim), dtype=cp.float32).astype(dt)
        w = (rs.standard_normal((N, K_dim), dtype=cp.float32) * np.float32(0.02)).astype(dt)
    except Exception:  # noqa: BLE001 - no on-device cast to this dtype: draw on the host
        rng = np.random.default_rng(seed)
        a = cp.asarray(rng.standard_normal((M, K_dim), dtype=np.float32).astype(dt))
        w_host = rng.standard_normal((N, K_dim), dtype=np.float32) * np.float32(0.02)
        w = cp.asarray(w_host.astype(dt))
    out = cp.empty((M, N), dtype=dt)
    op = MatmulOp(a, w, out)
    op()  # fails here, not mid-benchmark, if this dtype/shape is unsupported
    cp.cuda.Device().synchronize()
    item = dt.itemsize
    info: dict[str, Any] = {
        "M": int(M),
        "N": int(N),
        "K_dim": int(K_dim),
        "dtype": str(dt.name if hasattr(dt, "name") else dt),
        "weight_bytes": int(N * K_dim * item),
        "act_bytes": int(M * K_dim * item),
        "out_bytes": int(M * N * item),
        "bytes": int((N * K_dim + M * K_dim + M * N) * item),
        "flops": int(2 * M * N * K_dim),
    }
    return op, info


# --------------------------------------------------------------------------
# results


def _sanitize(obj: Any) -> Any:
    """Make ``obj`` strict-JSON friendly: NaN/inf -> None, numpy scalars/arrays -> Python,
    device arrays -> a short description (never copied to the host)."""
    if isinstance(obj, dict):
        return {str(k): _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, np.generic):
        return _sanitize(obj.item())
    if isinstance(obj, np.ndarray):
        return _sanitize(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return f"<array shape={tuple(obj.shape)} dtype={obj.dtype}>"
    return str(obj)


def _fmt(v: Any) -> str:
    """Format one table cell: floats by magnitude, None as empty, '|' escaped."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (float, np.floating)):
        x = float(v)
        if not math.isfinite(x):
            return str(x)
        a = abs(x)
        if a == 0.0:
            return "0"
        if a >= 1e6 or a < 1e-3:
            return f"{x:.3g}"
        if a >= 100:
            return f"{x:.1f}"
        if a >= 1:
            return f"{x:.2f}"
        return f"{x:.3f}"
    if isinstance(v, (list, tuple, dict)):
        s = json.dumps(_sanitize(v))
        v = s if len(s) <= 60 else s[:57] + "..."
    return str(v).replace("|", "\\|").replace("\n", " ")


def _is_numeric(v: Any) -> bool:
    """True for ints and floats (not bools)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def write_results(
    records: list[dict[str, Any]],
    meta: Mapping[str, Any],
    json_path: str | os.PathLike[str],
    md_path: str | os.PathLike[str],
    columns: list[str] | None = None,
    title: str | None = None,
) -> None:
    """Write ``{"meta": meta, "records": records}`` as JSON and a markdown table.

    The markdown starts with a header: title (``title`` or ``meta["title"]``),
    GPU (name, cc, SMs, L2, driver/runtime/CuPy/NVRTC versions from
    ``meta`` as returned by ``gpu_info()``), commit, date, the method one-liner
    (``meta["method"]`` or ``METHOD``) and any other scalar meta entries; then
    one row per record with ``columns`` (default: all keys, in order of first
    appearance; list-valued keys such as ``samples_us`` are left out by
    default). Numeric columns are right-aligned; floats formatted by magnitude.
    Parent directories are created; each file is replaced atomically.
    """
    meta = dict(meta)
    jp, mp = Path(json_path), Path(md_path)
    jp.parent.mkdir(parents=True, exist_ok=True)
    mp.parent.mkdir(parents=True, exist_ok=True)
    # Both files are replaced atomically: an error (or Ctrl-C) keeps the old ones.
    write_text(jp, json.dumps(_sanitize({"meta": meta, "records": records}), indent=1,
                              allow_nan=False) + "\n")

    if columns is None:
        columns = []
        for r in records:
            for k, v in r.items():
                if k not in columns and not isinstance(v, (list, tuple, dict)):
                    columns.append(k)

    head = title or meta.get("title") or "kbit_cupy benchmark"
    lines = [f"# {head}", ""]
    gpu = meta.get("gpu", "unknown")
    hw = [str(meta[k]) for k in ("cc",) if meta.get(k) not in (None, "unknown")]
    if meta.get("sm_count"):
        hw.append(f"{meta['sm_count']} SMs")
    if meta.get("l2_bytes"):
        hw.append(f"L2 {meta['l2_bytes'] / 2**20:.0f} MiB")
    sw = [
        f"{label} {meta[k]}"
        for label, k in (
            ("driver", "driver_version"),
            ("CUDA runtime", "cuda_runtime_version"),
            ("CuPy", "cupy_version"),
            ("NVRTC", "nvrtc_version"),
        )
        if meta.get(k) not in (None, "unknown")
    ]
    gpu_line = f"- GPU: {gpu}" + (f" ({', '.join(hw)})" if hw else "")
    if sw:
        gpu_line += "; " + ", ".join(sw)
    lines.append(gpu_line)
    commit = meta.get("commit", "unknown")
    if meta.get("git_dirty"):
        commit = f"{commit} (uncommitted changes)"
    lines.append(f"- Commit: {commit}")
    lines.append(f"- Date: {meta.get('date', 'unknown')}")
    lines.append(f"- Method: {meta.get('method', METHOD)}")
    shown = {
        "title",
        "gpu",
        "cc",
        "sm_count",
        "l2_bytes",
        "driver_version",
        "cuda_runtime_version",
        "cupy_version",
        "nvrtc_version",
        "commit",
        "git_dirty",
        "date",
        "method",
    }
    for k, v in meta.items():
        if k not in shown and not isinstance(v, (list, tuple, dict)):
            lines.append(f"- {k}: {_fmt(v)}")
    lines.append("")

    if records and columns:
        numeric = {
            c: all(_is_numeric(r.get(c)) for r in records if r.get(c) is not None)
            and any(r.get(c) is not None for r in records)
            for c in columns
        }
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "|".join("---:" if numeric[c] else "---" for c in columns) + "|")
        for r in records:
            lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
        lines.append("")
    write_text(mp, "\n".join(lines))


# --------------------------------------------------------------------------
# progress


def progress(iterable: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """Yield from ``iterable`` under a tqdm progress bar on stderr labelled ``desc``.

    ``total`` defaults to ``len(iterable)`` where that exists. Where stderr is
    not a terminal (a log file) tqdm still writes, at most one update a second.
    """
    from tqdm import tqdm

    yield from tqdm(iterable, desc=desc, total=total, file=sys.stderr, mininterval=1.0)
