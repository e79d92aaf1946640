"""User arrays in, normalised arrays out: NumPy/CuPy dispatch and dtype rules.

NumPy input runs the NumPy path; CuPy input (or anything CuPy accepts through
``__cuda_array_interface__`` or DLPack) runs the CUDA kernels. bfloat16 is
``ml_dtypes.bfloat16`` on both sides.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

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


# --------------------------------------------------------------------------
# argument checks: what was given, what is allowed, by the argument's name


def check_shape(value, name: str = "shape", ndim: int | None = None) -> tuple[int, ...]:
    """``value`` (a tuple or list of sizes) as a tuple of Python ints.

    Sizes may be Python or NumPy integers; floats (even ``10.0``), bools and
    strings are refused, never truncated. Raises TypeError naming ``name`` for
    a value that is not a sequence of integers, ValueError for a negative size
    or (with ``ndim``) the wrong number of dimensions.
    """
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of integers, got {type(value).__name__} "
                        f"{value!r}")
    sizes = []
    for size in value:
        if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)):
            raise TypeError(f"{name} must be a tuple of integers, got {tuple(value)!r} "
                            f"({type(size).__name__} {size!r}); sizes are never rounded")
        if size < 0:
            raise ValueError(f"{name} must hold sizes >= 0, got {tuple(value)!r}")
        sizes.append(int(size))
    if ndim is not None and len(sizes) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got {tuple(value)!r}")
    return tuple(sizes)


def check_array(value, name: str):
    """``value`` itself if it is a NumPy or GPU array, else TypeError naming ``name``.

    For arguments that must already be arrays (``out=`` is written in place);
    arguments that take array-likes go through ``as_module_array`` instead.
    """
    if isinstance(value, np.ndarray) or is_device_array(value):
        return value
    raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(value).__name__}; "
                    "create it with np.empty(...) / cupy.empty(...) or np.asarray(...)")


def check_flat(array, name: str, source: str = "quantize_kbit"):
    """``array`` if it is 1-D, else ValueError naming ``name`` (one rule at every size)."""
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, as {source} returns it, got shape "
                         f"{tuple(array.shape)}; pass {name}.reshape(-1)")
    return array


def check_choice(value, name: str, choices) -> str:
    """``value`` if it is one of the strings ``choices``; TypeError for a non-string."""
    allowed = ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {allowed}, got "
                        f"{type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def check_mapping(value, name: str, what: str):
    """``value`` if it is a mapping, else TypeError naming ``name`` and what it maps."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping {what}, got {type(value).__name__}; "
                        "e.g. dict(zip(names, values))")
    return value


def check_path(value, name: str = "path"):
    """``value`` if it is a str or os.PathLike path, else TypeError naming ``name``."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike file path, got "
                        f"{type(value).__name__} {value!r}")
    return value
