"""quantize_kbit / dequantize_kbit: the public entry points of the format.

NumPy arrays run the NumPy path of ``format.py``; CuPy arrays (or any GPU
array CuPy can import) run the CUDA kernels in ``kernels_src/`` on the current
CuPy stream. Both give the same bits (FORMAT.md).
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache

import numpy as np

from . import _jit, _launch
from ._arrays import (
    BFLOAT16,
    FLOAT_DTYPES,
    FLOAT_NAMES,
    as_module_array,
    check_array,
    check_choice,
    check_flat,
    check_shape,
    float_dtype,
    host_float32,
    same_module,
    to_host,
)
from .format import (
    BLOCK,
    E4M4_LIMIT,
    FP16_LIMIT,
    IndexPlan,
    check_codebook,
    check_k,
    create_normal_float_codebook,
    dequantize_blocks,
    e4m4_limit_message,
    make_index_plan,
    nblocks_for,
    quantize_blocks,
)

ABSMAX_FORMATS = {"e4m4": np.dtype(np.uint8), "fp16": np.dtype(np.float16)}
_THREADS = 256
_QUANTIZE_STEP = 1024  # elements per warp step: kStep in kernels_src/quantize.cu


@lru_cache(maxsize=64)
def _plan_for(k: int, codebook_bytes: bytes) -> IndexPlan:
    return make_index_plan(np.frombuffer(codebook_bytes, dtype=np.float32))


def _check_absmax_format(absmax_format) -> str:
    if not isinstance(absmax_format, str):
        check_choice(absmax_format, "absmax_format", tuple(ABSMAX_FORMATS))
    if absmax_format not in ABSMAX_FORMATS:
        raise ValueError(
            f'absmax_format must be "e4m4" (uint8 scales, default) or "fp16", got {absmax_format!r}'
        )
    return absmax_format


def _resolve_codebook(codebook, k: int, xp) -> np.ndarray:
    # The codebook is a small parameter, not data: host or device arrays and
    # lists are all accepted, whatever module the data lives in.
    if codebook is None:
        return _default_codebook(k)
    return check_codebook(to_host(codebook), k)


@lru_cache(maxsize=8)
def _default_codebook(k: int) -> np.ndarray:
    cb = create_normal_float_codebook(k)
    cb.flags.writeable = False  # shared by every call: never handed out to be changed
    return cb


_device_attrs: dict[int, dict] = {}


def _attributes() -> dict:
    """The current device's attributes, read once per device (the query is slow)."""
    import cupy

    dev = _launch.current_device()
    attrs = _device_attrs.get(dev)
    if attrs is None:
        attrs = _device_attrs[dev] = dict(cupy.cuda.Device(dev).attributes)
    return attrs


def _sm_count() -> int:
    return int(_attributes()["MultiProcessorCount"])


def _resident_ctas(kernel, threads: int, shared: int) -> int:
    """CTAs of ``threads`` that fit on one SM at once (registers, shared memory, warps)."""
    attrs = _attributes()
    warps = threads // 32
    regs_per_warp = -(-max(kernel.num_regs, 1) * 32 // 256) * 256  # allocated in units of 256
    by_regs = attrs["MaxRegistersPerMultiprocessor"] // (regs_per_warp * warps)
    by_warps = attrs["MaxThreadsPerMultiProcessor"] // threads
    by_shared = attrs["MaxSharedMemoryPerMultiprocessor"] // max(shared + 1024, 1)
    return max(1, min(by_regs, by_warps, by_shared, 32))


def quantize_kbit(A, k: int = 4, codebook=None, absmax_format: str = "e4m4",
                  validate: bool = True):
    """Quantize ``A`` to k-bit codebook indices with one scale per 32 elements.

    Parameters
    ----------
    A : array (NumPy, CuPy or any GPU array CuPy imports), any shape, dtype
        float16, ``ml_dtypes.bfloat16`` or float32. Read in C order;
        non-contiguous arrays are copied. Must be finite.
    k : bits per element, 2..5.
    codebook : optional, ``2**k`` finite floats (any order, duplicates
        allowed; a host or device array or a list, whatever module ``A`` is
        in). Defaults to ``create_normal_float_codebook(k)``.
    absmax_format : ``"e4m4"`` (uint8 scales, largest 31.0) or ``"fp16"``.
    validate : on the GPU, read back the kernel's one flag word (NaN or
        infinity in ``A``, a block absmax past the scale format) and raise.
        That read waits for the GPU (the call returns when the kernel has
        run) and cannot be captured in a CUDA graph. ``validate=False``:
        the caller vouches for the data; nothing is read back, the call
        returns at once and can be captured, and bad input gives undefined
        indices and scales for its blocks (never writes outside the
        outputs). A codebook given as a CuPy array is read to the host once
        per call to build its lookup plan: pass it as a NumPy array or list
        to keep the call free of host reads. The NumPy path always checks.

    Returns
    -------
    (packed, absmax, codebook) in ``A``'s module: ``packed`` uint32 of shape
    ``(nblocks * k,)`` (bit-planes, FORMAT.md section 5), ``absmax`` uint8 or
    float16 of shape ``(nblocks,)``, ``codebook`` float32 ``(2**k,)``, where
    ``nblocks = ceil(A.size / 32)``.

    Raises
    ------
    ValueError: bad ``k``/``absmax_format``/codebook values, NaN or infinity
    in ``A``, a block absmax too large for the scale format.
    TypeError: unsupported dtypes, arrays from different modules.
    """
    k = check_k(k)
    absmax_format = _check_absmax_format(absmax_format)
    xp, A = as_module_array(A, "A")
    if A.dtype not in FLOAT_DTYPES:
        raise TypeError(f"A must have dtype {FLOAT_NAMES}, got {A.dtype}; cast it first")
    cb = _resolve_codebook(codebook, k, xp)
    plan = _plan_for(k, cb.tobytes())
    n = int(A.size)
    nblocks = nblocks_for(n)
    if xp is np:
        packed = np.empty(nblocks * k, np.uint32)
        absmax = np.empty(nblocks, ABSMAX_FORMATS[absmax_format])
        quantize_blocks(host_float32(A), k, plan, absmax_format, packed, absmax)
        return packed, absmax, cb.copy()
    packed, absmax, flags = _quantize_cuda(A, k, cb, plan, absmax_format)
    if flags is not None and validate:
        _raise_for_flags(int(flags.get()[0]), A, absmax_format)
    return packed, absmax, _launch.copy(_device_plan(plan)[1])


_device_plans: dict[tuple, tuple] = {}


def _device_plan(plan: IndexPlan):
    """(table, codebook) of a plan on the current device, uploaded once."""
    key = (id(plan), _launch.current_device())
    entry = _device_plans.get(key)
    if entry is None or entry[0] is not plan:
        table = np.zeros((1, 2), np.uint32) if plan.table is None else plan.table
        # uploads that neither block the host nor enter a graph being captured
        entry = (plan, _launch.upload(table), _launch.upload(np.asarray(plan.codebook, np.float32)))
        _device_plans[key] = entry
    return entry[1][0], entry[2][0]


def _quantize_cuda(A, k: int, cb: np.ndarray, plan: IndexPlan, absmax_format: str,
                   outputs=None):
    """Launch the quantize kernel; returns (packed, absmax, flags) without syncing.

    ``outputs``: optional preallocated (packed, absmax, flags) for benchmarks;
    ``flags`` must be zeroed by the caller.
    """
    import cupy as cp

    x = cp.ascontiguousarray(A).reshape(-1)
    if x.data.ptr % 16:  # the kernel reads 16-byte vectors (a view at an odd offset)
        x = x.copy()
    n = int(x.size)
    nblocks = nblocks_for(n)
    if outputs is None:
        packed = _launch.empty(nblocks * k, cp.uint32)
        absmax = _launch.empty(nblocks, ABSMAX_FORMATS[absmax_format])
        flags = _launch.empty(1, cp.int32) if n else None
        if flags is not None:  # a memset: capturable, nothing to compile
            flags.data.memset_async(0, 4, cp.cuda.get_current_stream())
    else:
        packed, absmax, flags = outputs
    if n == 0:
        return packed, absmax, None
    brute = plan.table is None
    table, codebook = _device_plan(plan)
    kernel = _jit.get_kernel(
        "quantize", k, x.dtype.name, ABSMAX_FORMATS[absmax_format].name, brute
    )
    steps = math.ceil(n / _QUANTIZE_STEP)
    shared = 4 * (1 << k) if brute else 8 * plan.bins
    # Two waves of resident CTAs measured 4% faster than one on the H100
    # (benchmarks/tune_quantize.py): CTAs that finish early get replaced.
    per_sm = _resident_ctas(kernel, _THREADS, shared)
    grid = max(1, min(math.ceil(steps / (_THREADS // 32)), _sm_count() * per_sm * 2))
    bin_offset = np.float32(12582912.0) + np.float32(plan.bins // 2)
    kernel(
        (grid,), (_THREADS,),
        (x, np.int64(n), table, np.int32(plan.bins), np.float32(plan.bin_scale), bin_offset,
         codebook, packed, absmax, flags),
        shared_mem=shared,
    )
    return packed, absmax, flags


def _raise_for_flags(flags: int, A, absmax_format: str) -> None:
    if not flags:
        return
    import cupy as cp

    x = cp.ascontiguousarray(A).reshape(-1).astype(cp.float32)
    if flags & 1:
        bad = int(cp.flatnonzero(~cp.isfinite(x))[0])
        raise ValueError(
            f"input contains NaN or infinity (first at flat index {bad}); "
            "quantization needs finite values"
        )
    largest = float(cp.abs(x).max())
    if absmax_format == "e4m4":
        raise ValueError(e4m4_limit_message(largest))
    raise ValueError(
        f"absmax {largest:g} overflows float16 scales (largest 65504, limit {FP16_LIMIT}); "
        "rescale the tensor before quantizing"
    )


def _check_n(n) -> tuple[int, tuple]:
    if isinstance(n, (tuple, list)):
        shape = check_shape(n, "shape")
        return math.prod(shape), shape
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int (element count) or a shape tuple, got {n!r}")
    return int(n), (int(n),)


def dequantize_kbit(packed, absmax, codebook, k: int, n, dtype=np.float16, out=None):
    """Rebuild ``n`` values from bit-planes, scales and codebook (FORMAT.md section 6).

    Parameters
    ----------
    packed : uint32 array of ``ceil(n / 32) * k`` words (from ``quantize_kbit``).
    absmax : uint8 (E4M4) or float16 array of ``ceil(n / 32)`` block scales.
    codebook : ``2**k`` floats (host or device array or list).
    k : bits per element, 2..5.
    n : element count, or a shape tuple for the result.
    dtype : float16 (default), ``ml_dtypes.bfloat16`` or float32.
    out : optional contiguous array of ``n`` elements and ``dtype`` in the same
        module, written in place and returned.

    Returns
    -------
    Array of shape ``(n,)`` (or the given shape) and ``dtype``, in the module of
    ``packed``: ``codebook[idx] * scale`` in float32, rounded to ``dtype``.

    Raises ValueError (sizes that do not fit ``n``/``k``, bad ``out`` size or
    layout) and TypeError (dtypes, arrays from different modules).
    """
    if _cupy_ndarray is not None and type(packed) is _cupy_ndarray:
        done = _dequantize_fast(packed, absmax, codebook, k, n, dtype, out)
        if done is not None:
            return done
    k = check_k(k)
    total, shape = _check_n(n)
    if out is not None:
        check_array(out, "out")
    xp, packed = as_module_array(packed, "packed")
    same_module(xp, {"absmax": absmax, "out": out})
    absmax = xp.asarray(absmax)
    check_flat(packed, "packed")
    check_flat(absmax, "absmax")
    dtype_given, dtype = dtype, float_dtype(dtype, "dtype")
    dtype_checked = dtype
    if packed.dtype != np.uint32:
        raise TypeError(f"packed must be uint32 (from quantize_kbit), got {packed.dtype}")
    if absmax.dtype not in (np.uint8, np.float16):
        raise TypeError(f"absmax must be uint8 (E4M4) or float16, got {absmax.dtype}")
    nblocks = nblocks_for(total)
    if packed.size != nblocks * k:
        raise ValueError(
            f"packed has {packed.size} words but n={total}, k={k} needs ceil(n/32)*k = "
            f"{nblocks * k}; pass the n and k used for quantize_kbit"
        )
    if absmax.size != nblocks:
        raise ValueError(
            f"absmax has {absmax.size} entries but n={total} needs ceil(n/32) = {nblocks}"
        )
    cb = check_codebook(to_host(codebook), k) if xp is np else device_codebook(codebook, k)
    if out is None:
        out = xp.empty(shape, dtype) if xp is np else _launch.empty(shape, dtype)
    else:
        if out.dtype != dtype:
            raise TypeError(f"out has dtype {out.dtype} but dtype={dtype}; pass matching dtypes")
        if out.size != total:
            raise ValueError(f"out has {out.size} elements, expected n = {total}")
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous; pass a fresh array or out=None")
    if total == 0:
        return out
    flat = out.reshape(-1)
    if xp is np:
        dequantize_blocks(np.ascontiguousarray(packed), np.ascontiguousarray(absmax), cb, k,
                          total, flat)
        return out
    _dequantize_cuda(xp.ascontiguousarray(packed), xp.ascontiguousarray(absmax), cb, k, total,
                     flat)
    _learn_fast(n, dtype_given, total, shape, dtype_checked)
    return out


_cupy_ndarray = None  # cupy.ndarray once a GPU call has run (the fast path's type test)
_fast_shapes: dict = {}  # n as given -> (element count, result shape)
_FAST_DTYPES: dict = {}  # dtype as given -> numpy dtype (the three float dtypes)
_U32, _U8, _F16, _F32 = (np.dtype(t) for t in (np.uint32, np.uint8, np.float16, np.float32))


def _dequantize_fast(packed, absmax, codebook, k, n, dtype, out):
    """dequantize_kbit for CuPy arrays that need no conversion: every input
    already what the kernel takes (1-D contiguous packed and absmax of the
    right sizes and dtypes, a float32 codebook of 2**k on the device, a known
    dtype, ``out`` None or contiguous of the right size and dtype, all on the
    current device). Returns None when anything is not so: the checked path
    then runs (and raises its clear errors)."""
    if type(k) is not int or not 2 <= k <= 5 or type(absmax) is not _cupy_ndarray:
        return None
    try:
        total, shape = _fast_shapes[n]
        dt = _FAST_DTYPES[dtype]
    except (KeyError, TypeError):  # unhashable or not seen yet: the checked path learns it
        return None
    nblocks = -(-total // 32)
    dev = _get_device()
    if (packed.dtype != _U32 or packed.strides != (4,) or packed.size != nblocks * k
            or absmax.strides != (absmax.itemsize,) or absmax.size != nblocks
            or (absmax.dtype != _U8 and absmax.dtype != _F16) or total == 0
            or type(codebook) is not _cupy_ndarray or codebook.dtype != _F32
            or codebook.strides != (4,) or codebook.size != (1 << k)
            or packed.data.device_id != dev or absmax.data.device_id != dev
            or codebook.data.device_id != dev):
        return None
    stream = _get_current_stream()
    if out is None:
        out = _launch.empty(shape, dt, total * dt.itemsize, stream)
    elif (type(out) is not _cupy_ndarray or out.dtype != dt or out.size != total
          or out.data.device_id != dev or not out.flags.c_contiguous):
        return None
    _dequantize_cuda(packed, absmax, codebook, k, total, out, stream.ptr, dev)
    return out


_get_device = _get_current_stream = None


def _learn_fast(n, dtype, total, shape, dt) -> None:
    """Remember what the checked path accepted, for the fast path."""
    global _cupy_ndarray, _get_device, _get_current_stream
    cp = _launch.cupy()
    _cupy_ndarray, _get_current_stream = cp.ndarray, cp.cuda.get_current_stream
    _get_device = cp.cuda.runtime.getDevice
    try:
        if len(_fast_shapes) < 1024:
            _fast_shapes[n] = (total, shape)
        _FAST_DTYPES[dtype] = dt
    except TypeError:  # unhashable (a list shape)
        pass


_device_codebooks: dict[tuple, tuple] = {}
_DEVICE_CODEBOOKS_MAX = 256


def device_codebook(codebook, k: int):
    """The codebook as a contiguous float32 CuPy array of ``2**k`` entries,
    without reading device memory back to the host.

    A CuPy codebook of the right size is used as it is (cast to float32 on
    the device where needed); its values are not checked, since that would
    mean a synchronising read (FORMAT.md requires finite entries; a non-finite
    one gives non-finite outputs where it is used). A host codebook (NumPy
    array or list) is checked and uploaded once per device and content.
    """
    import cupy as cp

    if isinstance(codebook, cp.ndarray):
        if codebook.dtype.kind != "f":
            raise TypeError(f"codebook must be a float array (float32 preferred), got dtype "
                            f"{codebook.dtype}")
        if codebook.size != (1 << k):
            raise ValueError(
                f"codebook for k={k} must have exactly 2**k = {1 << k} entries, got "
                f"{codebook.size}; use create_normal_float_codebook({k}) or pass k matching "
                "the codebook")
        if codebook.dtype != np.float32 or codebook.ndim != 1 or not codebook.flags.c_contiguous:
            codebook = cp.ascontiguousarray(codebook.reshape(-1), dtype=cp.float32)
        return codebook
    host = check_codebook(to_host(codebook), k)
    key = (_launch.current_device(), k, host.tobytes())
    found = _device_codebooks.get(key)
    if found is None:
        if len(_device_codebooks) >= _DEVICE_CODEBOOKS_MAX:  # users' ad hoc codebooks
            _device_codebooks.clear()
        found = _device_codebooks[key] = _launch.upload(host)
    return found[0]


def _dequantize_geometry(n: int) -> tuple[tuple, tuple]:
    """(grid, block) of the dequantize kernel for ``n`` elements: a warp per
    8 blocks of 32, at most 32 CTAs of 256 threads per SM."""
    warps = -(-n // (32 * 8))
    return (max(1, min(-(-warps // (_THREADS // 32)), _sm_count() * 32)),), (_THREADS,)


_DTYPE_NAMES = {np.dtype(d): np.dtype(d).name for d in (np.float16, np.float32, np.uint8)}
_DTYPE_NAMES[BFLOAT16] = "bfloat16"
_dequantize_launches: dict[tuple, tuple] = {}
_DEQUANTIZE_ARGS = (_launch.POINTER,) * 3 + (_launch.INT64, _launch.POINTER, _launch.INT32)


def dequantize_launch(k: int, n: int, out_dtype, absmax_dtype, values) -> _launch.Launch:
    """A Launch of the dequantize kernel for ``n`` elements (its kernel and
    geometry); ``values``: (packed, absmax, codebook, n, flat_out, out
    aligned), arrays or placeholder zeros (arrays given are kept alive)."""
    kernel = _jit.get_kernel("dequantize", k, _DTYPE_NAMES[out_dtype], _DTYPE_NAMES[absmax_dtype])
    grid, block = _dequantize_geometry(n)
    return _launch.Launch(kernel, grid, block, 0, _DEQUANTIZE_ARGS, values)


def _dequantize_cuda(packed, absmax, codebook, k: int, n: int, flat_out,
                     stream: int | None = None, dev: int | None = None) -> None:
    """Launch the dequantize kernel into the flat contiguous ``flat_out``.

    One argument block per (variant, size, device, stream), built on first
    use; a call sets five pointers and launches (CuPy's kernel call costs
    about 20 us of host time here, this a few)."""
    if stream is None:
        stream = _launch.current_stream_ptr()
    if dev is None:
        dev = _launch.current_device()
    key = (k, flat_out.dtype, absmax.dtype, n, dev, stream, threading.get_ident())
    found = _dequantize_launches.get(key)
    if found is None:
        with _launch.setup_scope():
            _launch.ensure_context()  # per thread: bind this thread's context
            launch = dequantize_launch(k, n, flat_out.dtype, absmax.dtype, (0, 0, 0, n, 0, 0))
        if len(_dequantize_launches) > 4096:  # many sizes: start over rather than grow
            _dequantize_launches.clear()
        found = _dequantize_launches[key] = (launch.prefix, launch.argv,
                                             [launch.value(i) for i in (0, 1, 2, 4, 5)], launch)
    prefix, argv, values, _ = found
    out_ptr = flat_out.data.ptr
    values[0].value = packed.data.ptr
    values[1].value = absmax.data.ptr
    values[2].value = codebook.data.ptr
    values[3].value = out_ptr
    values[4].value = 0 if out_ptr & 15 else 1
    _launch.cupy().cuda.driver.launchKernel(*prefix, stream, argv, 0)


__all__ = ["BLOCK", "E4M4_LIMIT", "dequantize_kbit", "quantize_kbit"]
