"""The GPU call path's plumbing: cheap launches, capture-safe setup, buffers
that outlive a CUDA graph, and a cuBLAS GEMM that stream capture accepts.

Everything here exists so that a public call does its one-time work once and
then costs a few microseconds of host time (issue 18):

- ``Launch``: one kernel launch whose argument block (ctypes) is built once;
  a call sets the few arguments that change (activation and output
  pointers) and goes straight to ``cuLaunchKernel`` through CuPy's driver
  binding. Measured on the H100: CuPy's ``RawKernel.__call__`` with the
  GEMM's 21 arguments costs several microseconds of argument conversion per
  call; the prebuilt block costs one attribute store per changed argument.
- ``setup_scope``: one-time work (compiling, repacking a weight, allocating
  workspaces, encoding tensor maps) that a call meets while its stream is
  being captured into a CUDA graph runs on a side stream with the thread's
  capture mode relaxed, so it neither enters the graph nor invalidates the
  capture (``cudaMalloc`` and module loads are "unsafe" in global mode,
  which ``torch.cuda.graph`` uses).
- ``stream_buffer``: workspaces shared by the launches of one (device,
  stream), which run one after another. They only grow; a buffer a plan or a
  captured graph refers to is never freed while the plan lives, because the
  plan holds a reference (CuPy's pool would otherwise hand a graph's memory
  to the next allocation).
- ``cublas_gemm``: ``C = A @ W.T`` through ``cublasGemmEx`` on a handle of
  our own with a fixed workspace (``cublasSetWorkspace``), which stream
  capture accepts; ``cupy.matmul`` refuses to run while a stream captures.

Nothing here validates user input: the public functions do that before they
get here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

import numpy as np

from ._arrays import cupy_or_none as cupy  # the cupy module, imported on first use


def current_device() -> int:
    """The current CUDA device's ordinal (one runtime call, no Device object)."""
    return cupy().cuda.runtime.getDevice()


def ensure_context() -> None:
    """Make the current device's primary context current in this thread.

    The runtime API binds it lazily; a thread whose CuPy work so far needed no
    runtime call that binds it (its arrays came from the pool, its kernels
    were compiled by another thread) has none, and the driver launches this
    module makes (cuLaunchKernel, cuLaunchKernelEx) then fail with
    CUDA_ERROR_INVALID_CONTEXT. cudaFree(NULL) binds it and does nothing else.
    Called where a thread builds its launch plans (outside any capture)."""
    cupy().cuda.runtime.free(0)


def current_stream_ptr() -> int:
    """The current CuPy stream's handle (0: the legacy default stream)."""
    return cupy().cuda.get_current_stream().ptr


# --------------------------------------------------------------------------
# launches

POINTER = ctypes.c_uint64
INT32 = ctypes.c_int32
INT64 = ctypes.c_int64
FLOAT32 = ctypes.c_float


def device_pointer(x) -> int:
    """A kernel argument's address: CuPy arrays give their data pointer, None gives 0."""
    if x is None:
        return 0
    if isinstance(x, (int, np.integer)):
        return int(x)
    return x.data.ptr


# Programmatic dependent launch (sm_90): kernels whose source begins with
# grid_dependency_sync() (gemm_mma.cu) may be launched with CUDA's
# programmatic-stream-serialization attribute, which lets the launch start
# while the previous kernel on the stream drains. KBIT_CUPY_PDL=0 turns it off.
PDL = os.environ.get("KBIT_CUPY_PDL", "1") != "0"
_ATTR_CLUSTER_DIMENSION = 4  # CUlaunchAttributeID
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("value", ctypes.c_int),
                ("dims", ctypes.c_uint * 3)]


class _Attr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


_launch_ex = None


def _launch_kernel_ex():
    """``cuLaunchKernelEx`` (CUDA 12+; CuPy has no binding) or None."""
    global _launch_ex
    if _launch_ex is None:
        lib = libcuda()
        fn = getattr(lib, "cuLaunchKernelEx", None) if lib is not None else None
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _launch_ex = fn or False
    return _launch_ex or None


def pdl_supported() -> bool:
    """Whether launches on the current device may use programmatic dependent
    launch: compute capability 9.0 or newer, a driver with cuLaunchKernelEx,
    and not turned off with KBIT_CUPY_PDL=0."""
    if not PDL:
        return False
    dev = current_device()
    found = _pdl_devices.get(dev)
    if found is None:
        major = cupy().cuda.Device(dev).compute_capability[:-1]
        found = _pdl_devices[dev] = int(major) >= 9 and _launch_kernel_ex() is not None
    return found


_pdl_devices: dict[int, bool] = {}


def cluster_launch_supported() -> bool:
    """Whether the current device launches thread-block clusters for
    gemm_latency.cu's cluster split and gemm_mma.cu's split K in clusters:
    compute capability 9.0 (their variants are built for sm_90a, which runs
    on sm_90 only) and a driver with cuLaunchKernelEx (the launch attribute
    that sets the cluster size needs it)."""
    dev = current_device()
    found = _cluster_devices.get(dev)
    if found is None:
        cc = cupy().cuda.Device(dev).compute_capability
        found = _cluster_devices[dev] = cc == "90" and _launch_kernel_ex() is not None
    return found


_cluster_devices: dict[int, bool] = {}


class PdlLaunch:
    """A ``Launch`` sent through ``cuLaunchKernelEx`` with programmatic stream
    serialization allowed (the kernel must begin with grid_dependency_sync;
    ``pdl=False`` leaves it out) and, with ``cluster`` > 0, in thread-block
    clusters of ``cluster`` CTAs along x (``cluster_axis`` 1: along y)."""

    __slots__ = ("_attrs", "_config", "_fn", "_launch", "argv", "config_ptr", "func")

    def __init__(self, launch, pdl: bool = True, cluster: int = 0, cluster_axis: int = 0):
        self._launch = launch
        attrs = []
        if pdl:
            attrs.append(_Attr(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION))
            attrs[-1].value.value = 1
        if cluster:
            attrs.append(_Attr(id=_ATTR_CLUSTER_DIMENSION))
            attrs[-1].value.dims[:] = (cluster, 1, 1) if cluster_axis == 0 else (1, cluster, 1)
        self._attrs = (_Attr * max(1, len(attrs)))(*attrs)
        self._config = _Config((ctypes.c_uint * 3)(*launch.grid), (ctypes.c_uint * 3)(*launch.block),
                               launch.shared, None, self._attrs, len(attrs))
        self.config_ptr = ctypes.addressof(self._config)
        self.func, self.argv = launch.func, launch.argv
        self._fn = _launch_kernel_ex()

    def __call__(self, stream_ptr: int) -> None:
        self._config.stream = stream_ptr or None
        rc = self._fn(self.config_ptr, self.func, self.argv, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {rc})")

    def max_active_clusters(self) -> int | None:
        """Clusters of this launch's size and shape resident at once on the
        device (cuOccupancyMaxActiveClusters); None where the driver cannot
        say (no such entry point, or an error): the caller then goes on and
        the launch itself reports a cluster that cannot be placed."""
        lib = libcuda()
        fn = getattr(lib, "cuOccupancyMaxActiveClusters", None) if lib is not None else None
        if fn is None:
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_void_p]
        count = ctypes.c_int(0)
        if fn(ctypes.byref(count), self.func, self.config_ptr) != 0:
            return None
        return count.value


class Launch:
    """One kernel launch with its argument block built once.

    ``kernel``: a ``cupy.RawKernel`` (compiled and loaded on the current
    device); ``types``: the ctypes type of each kernel parameter, in order;
    ``values``: their initial values (arrays give their data pointer). The
    arrays passed are kept alive by the Launch. ``set(i, value)`` changes
    argument ``i``; ``__call__(stream_ptr)`` launches.

    One Launch belongs to one (device, stream, thread): the package's plans
    are keyed so, since calls from several threads on the same Launch at once
    would race on its argument block.
    """

    __slots__ = ("_argv", "_keep", "_values", "block", "func", "grid", "shared")

    def __init__(self, kernel, grid, block, shared: int, types, values):
        self.func = kernel.kernel.ptr  # CUfunction, loaded on this device
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        self.shared = int(shared)
        self._keep = [v for v in values if v is not None and not isinstance(v, (int, float, np.number))]
        self._values = [t(device_pointer(v) if t is POINTER else v) for t, v in zip(types, values)]
        self._argv = (ctypes.c_void_p * len(self._values))(
            *[ctypes.addressof(v) for v in self._values])

    def set(self, index: int, value) -> None:
        self._values[index].value = value

    def value(self, index: int):
        """The ctypes object behind argument ``index`` (hot paths set ``.value``)."""
        return self._values[index]

    @property
    def prefix(self) -> tuple:
        """``cuLaunchKernel``'s arguments before the stream: function, grid, block, shared."""
        return (self.func, *self.grid, *self.block, self.shared)

    @property
    def argv(self) -> int:
        """Address of the kernel-parameter array (``cuLaunchKernel``'s kernelParams)."""
        return ctypes.addressof(self._argv)

    def __call__(self, stream_ptr: int) -> None:
        g, b = self.grid, self.block
        cupy().cuda.driver.launchKernel(self.func, g[0], g[1], g[2], b[0], b[1], b[2],
                                         self.shared, stream_ptr, ctypes.addressof(self._argv), 0)


# --------------------------------------------------------------------------
# one-time work while a stream is being captured

_libcuda = None


def libcuda():
    """The CUDA driver library (ctypes), or None where it cannot be loaded."""
    global _libcuda
    if _libcuda is None:
        try:
            _libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            _libcuda = False
    return _libcuda or None


_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED


def _exchange_capture_mode(mode: int) -> int:
    """cuThreadExchangeStreamCaptureMode: set this thread's mode, return the old one."""
    lib = libcuda()
    if lib is None:
        return mode
    value = ctypes.c_int(mode)
    rc = lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(value))
    if rc != 0:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed (CUresult {rc})")
    return value.value


_side_streams: dict[int, object] = {}
_setup_lock = threading.RLock()


def is_capturing(stream=None) -> bool:
    """Whether ``stream`` (default: the current stream) is being captured
    into a CUDA graph. The legacy default stream cannot be captured."""
    if stream is None:
        stream = cupy().cuda.get_current_stream()
    return stream.ptr != 0 and stream.is_capturing()


@contextlib.contextmanager
def relaxed():
    """While the current stream captures, relax this thread's capture mode for
    the body: CUDA's global mode (``torch.cuda.graph``'s) refuses the pool's
    cudaMalloc and CuPy's first-time module loads, which would invalidate the
    capture. Work the body launches on the current stream is still captured.
    Without a capture this does nothing."""
    if not is_capturing():
        yield
        return
    with _relaxed_mode():
        yield


@contextlib.contextmanager
def _relaxed_mode():
    """This thread's capture mode relaxed for the body, then restored."""
    with _setup_lock:
        previous = _exchange_capture_mode(_CAPTURE_MODE_RELAXED)
        try:
            yield
        finally:
            _exchange_capture_mode(previous)


def empty(shape, dtype, nbytes: int | None = None, stream=None):
    """``cupy.empty`` that also works during a global-mode capture (``relaxed``).
    Memory a graph writes must outlive the graph: keep the result.

    ``nbytes`` (the array's size, if the caller knows it) and ``stream`` (the
    current stream object) save work on hot paths: the array is then made
    from one pool allocation, about 3 us less than ``cupy.empty``.
    """
    cp = cupy()
    if stream is None:
        stream = cp.cuda.get_current_stream()
    if stream.ptr == 0 or not stream.is_capturing():
        if nbytes is None:
            return cp.empty(shape, dtype=dtype)
        return cp.ndarray(shape, dtype, cp.cuda.alloc(nbytes))
    with _relaxed_mode():  # (the stream captures: checked above)
        return cp.empty(shape, dtype=dtype)


def copy(src):
    """A device copy of the contiguous CuPy array ``src`` (an async memcpy on the
    current stream: capturable, no elementwise kernel to compile)."""
    out = empty(src.shape, src.dtype)
    out.data.copy_from_device_async(src.data, src.nbytes, cupy().cuda.get_current_stream())
    return out


def upload(host: np.ndarray):
    """A device copy of a small host array, without blocking the host: staged
    through pinned memory and copied on the current stream (a copy from
    pageable memory may wait for the GPU), or, while the stream is being
    captured, on a side stream now (``setup_scope``). Returns (device array,
    pinned buffer); keep both until the copy has run."""
    cp = cupy()
    host = np.ascontiguousarray(host)
    with setup_scope():
        pinned = cp.cuda.alloc_pinned_memory(max(host.nbytes, 1))
        staged = np.frombuffer(pinned, dtype=host.dtype, count=host.size).reshape(host.shape)
        staged[...] = host
        device = cp.empty(host.shape, dtype=host.dtype)
        device.set(staged, stream=cp.cuda.get_current_stream())
    return device, pinned


@contextlib.contextmanager
def setup_scope():
    """Run one-time setup outside any capture of the current stream.

    Without a capture this does nothing. While the current stream captures,
    the body runs with the thread's capture mode relaxed, on a side stream of
    this device that is synchronised before the scope ends: what the body
    launches (repacking, zero fills, uploads) runs now, once, and is not
    recorded into the graph; its allocations and module loads do not
    invalidate the capture. Code in the body must take the captured stream's
    handle from before the scope (``current_stream_ptr()`` inside it names
    the side stream).
    """
    if not is_capturing():
        yield
        return
    with _relaxed_mode():
        dev = current_device()
        side = _side_streams.get(dev)
        if side is None:
            side = _side_streams[dev] = cupy().cuda.Stream(non_blocking=True)
        with side:
            yield
        side.synchronize()


# --------------------------------------------------------------------------
# workspaces per (device, stream)

_buffers: dict[tuple, object] = {}


def stream_buffer(kind: str, nbytes: int, stream_ptr: int, zeroed: bool = False):
    """A device buffer of at least ``nbytes`` for the launches of one stream.

    Launches on one stream run in order, so they can share one workspace of
    each ``kind``. The buffer only grows: a larger request allocates a new
    one and later plans use it, while plans (and graphs) that hold the old
    one keep it alive. ``zeroed``: filled with zeros when allocated (the
    split-K counters, which every launch leaves at zero again).
    """
    cp = cupy()
    key = (kind, current_device(), stream_ptr)
    buf = _buffers.get(key)
    if buf is None or buf.nbytes < nbytes:
        size = max(int(nbytes), 2 * (buf.nbytes if buf is not None else 0), 1 << 16)
        with setup_scope():  # allocated (and zeroed) now, not as part of a graph
            buf = cp.empty(size, dtype=cp.uint8)
            if zeroed:
                buf.data.memset_async(0, size, cp.cuda.get_current_stream())
        _buffers[key] = buf
    return buf


# --------------------------------------------------------------------------
# a capturable cuBLAS GEMM

_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUDA_TYPES = {"float16": 2, "bfloat16": 14, "float32": 0}  # cudaDataType
# 32 MiB: cuBLAS's recommended workspace on Hopper (its guide, cublasSetWorkspace)
_CUBLAS_WORKSPACE_BYTES = 32 << 20
_ONE = np.ones(1, np.float32)  # alpha and beta: host pointers (cuBLAS's default mode)
_ZERO = np.zeros(1, np.float32)
_ONE_PTR, _ZERO_PTR = _ONE.ctypes.data, _ZERO.ctypes.data


class _Blas:
    """Our cuBLAS handle on one device, its stream and a workspace per stream.

    Called through ctypes, not CuPy's binding: CuPy's ``cublas.setStream``
    raises while a stream captures ("calling cuBLAS API during stream capture
    is currently unsupported"), though cuBLAS itself supports capture.
    """

    def __init__(self):
        self.lib = _libcublas()
        handle = ctypes.c_void_p()
        _check_blas(self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        self.stream = None
        self.workspaces: dict[int, object] = {}
        gemm = self.lib.cublasGemmEx
        gemm.restype = ctypes.c_int
        i, p = ctypes.c_int, ctypes.c_void_p
        gemm.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        self.gemm = gemm

    def bind(self, stream_ptr: int) -> None:
        """Point the handle at ``stream_ptr`` with that stream's fixed workspace
        (setStream resets the workspace to cuBLAS's own pool, so both go together)."""
        if self.stream == stream_ptr:
            return
        ws = self.workspaces.get(stream_ptr)
        if ws is None:  # first use of this stream: allocate outside any capture
            with setup_scope():
                ws = self.workspaces[stream_ptr] = cupy().empty(_CUBLAS_WORKSPACE_BYTES, np.uint8)
        _check_blas(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream_ptr)),
                    "cublasSetStream")
        _check_blas(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(ws.data.ptr),
                                                   ctypes.c_size_t(ws.nbytes)),
                    "cublasSetWorkspace")
        self.stream = stream_ptr


def _check_blas(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed (cublasStatus_t {status})")


def _libcublas():
    """The cuBLAS library CuPy loads (found among the process's mapped files
    once CuPy's binding has loaded it), through ctypes."""
    from cupy_backends.cuda.libs import cublas  # noqa: F401 - loads libcublas

    with open("/proc/self/maps", encoding="utf-8") as f:
        paths = sorted({line.split()[-1] for line in f
                        if "libcublas.so" in line and "libcublasLt" not in line})
    if not paths:
        raise RuntimeError("libcublas is not loaded in this process; the dequantize + cuBLAS "
                           "path needs CuPy's cuBLAS")
    return ctypes.CDLL(paths[0])


_blas: dict[tuple, _Blas] = {}


def blas() -> _Blas:
    """This device's and thread's handle (created on first use, outside any
    capture): a handle's stream and workspace are set per call, which two
    threads sharing one handle would race on."""
    key = (current_device(), threading.get_ident())
    found = _blas.get(key)
    if found is None:
        with setup_scope():
            found = _blas[key] = _Blas()
    return found


def cublas_gemm(M: int, N: int, K: int, dtype_name: str, a_ptr: int, w_ptr: int, c_ptr: int,
                stream_ptr: int) -> None:
    """``C[M, N] = A[M, K] @ W[N, K].T`` for C-contiguous 16-bit (or fp32)
    arrays at the given device addresses, float32 accumulation, on
    ``stream_ptr``; capturable.

    Row-major ``C = A W^T`` is column-major ``C^T = W A^T``: ``W`` read
    transposed (``OP_T``, leading dimension K), ``A`` as is.
    """
    b = blas()
    b.bind(stream_ptr)
    t = _CUDA_TYPES[dtype_name]
    _check_blas(b.gemm(b.handle, _CUBLAS_OP_T, _CUBLAS_OP_N, N, M, K, _ONE_PTR, w_ptr, t, K,
                       a_ptr, t, K, _ZERO_PTR, c_ptr, t, N, _CUBLAS_COMPUTE_32F,
                       _CUBLAS_GEMM_DEFAULT), "cublasGemmEx")
