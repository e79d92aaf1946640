"""User arrays in, normalised arrays out: NumPy/CuPy dispatch and dtype rules.

NumPy input runs the NumPy path; CuPy input (or anything CuPy accepts through
``__cuda_array_interface__`` or DLPack) runs the CUDA kernels. bfloat16 is
``ml_dtypes.bfloat16`` on both sides.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32))
FLOAT_NAMES = "float16, ml_dtypes.bfloat16 or float32"

_cupy = None


def cupy_or_none():
    """The cupy module, or None when it is not installed (NumPy path only)."""
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except Exception:  # noqa: BLE001 - a broken CuPy install means no GPU path
            _cupy = False
        else:
            _cupy = cupy
    return _cupy or None


def gpu_available() -> bool:
    cp = cupy_or_none()
    if cp is None:
        return False
    try:
        return bool(cp.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def is_device_array(x) -> bool:
    """True for arrays that live on the GPU (CuPy, or CUDA array interface / DLPack)."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return False
    cp = cupy_or_none()
    if cp is not None and isinstance(x, cp.ndarray):
        return True
    if hasattr(x, "__cuda_array_interface__"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(dev()[0]) in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
        except Exception:  # noqa: BLE001
            return False
    return False


def array_module(x):
    """``numpy`` or ``cupy``, by where ``x`` lives."""
    if is_device_array(x):
        cp = cupy_or_none()
        if cp is None:
            raise TypeError("got a GPU array but CuPy is not installed; pip install cupy-cuda12x")
        return cp
    return np


def as_module_array(x, name: str):
    """(xp, array) with foreign GPU arrays wrapped as CuPy (zero copy)."""
    xp = array_module(x)
    if xp is np:
        return np, np.asarray(x)
    cp = xp
    if isinstance(x, cp.ndarray):
        return cp, x
    if hasattr(x, "__cuda_array_interface__"):
        return cp, cp.asarray(x)
    try:
        return cp, cp.from_dlpack(x)
    except Exception as exc:
        raise TypeError(f"{name}: cannot import this GPU array into CuPy ({exc})") from exc


def same_module(xp, arrays: dict) -> None:
    """Raise TypeError if any named array lives in another module than ``xp``."""
    for name, arr in arrays.items():
        if arr is None:
            continue
        other = array_module(arr)
        if other is not xp:
            where = "NumPy (host)" if xp is np else "CuPy (GPU)"
            raise TypeError(
                f"{name} is a {'NumPy (host)' if other is np else 'CuPy (GPU)'} array but the "
                f"other inputs are {where} arrays; move them to one place first "
                "(cupy.asarray(...) or .get())"
            )


def float_dtype(dtype, what: str) -> np.dtype:
    """Normalise a user dtype to one of the three float dtypes or raise TypeError."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{what} must be one of {FLOAT_NAMES}, got {dtype!r}") from exc
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{what} must be one of {FLOAT_NAMES}, got {dt}")
    return dt


def host_float32(x) -> np.ndarray:
    """Flat float32 host copy of a host float array (exact for fp16/bf16/fp32)."""
    return np.ascontiguousarray(x).reshape(-1).astype(np.float32)


def to_host(x) -> np.ndarray:
    """A NumPy copy of a host or device array."""
    if isinstance(x, np.ndarray):
        return x
    cp = cupy_or_none()
    if cp is not None and isinstance(x, cp.ndarray):
        return cp.asnumpy(x)
    return np.asarray(x)
