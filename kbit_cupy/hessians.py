"""Calibration statistics in a file: what ``quantize-model --hessians FILE`` reads.

A hessians file is a plain safetensors file (``write_safetensors``), so any
reader opens it:

- one float32 tensor ``[K_dim, K_dim]`` per linear layer: ``H``, the mean
  ``X^T X`` of the layer's inputs (``HessianAccumulator.hessian``), named as
  the layer's weight is named in the checkpoint
  (``model.layers.0.mlp.down_proj.weight``) or as its module
  (``model.layers.0.mlp.down_proj``, what ``examples/minilm.py``'s
  ``collect_hessians`` keys by); the converter tries the weight's name first;
- ``__metadata__["kbit_cupy_hessians"]``: JSON ``{"format_version": 1,
  "rows": {name: rows averaged}}``, which marks the file as statistics.

float32 halves the file against the accumulators' float64 (a Llama-3-8B
down_proj alone is 14336^2 values); GPTQ factors ``H`` in float32 anyway.
The file is read one tensor at a time, so the statistics of a whole model
need not fit in memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np

from ._arrays import check_mapping, to_host
from .serialization import SafetensorsReader, write_safetensors

HESSIANS_KEY = "kbit_cupy_hessians"  # the __metadata__ entry that marks a hessians file
HESSIANS_VERSION = 1


def save_hessians(path: str | os.PathLike, hessians: Mapping) -> None:
    """Write ``{name: HessianAccumulator | array [K_dim, K_dim]}`` as a hessians file.

    Accumulators are stored as their ``hessian`` (mean ``X^T X``) with their
    row count; arrays (NumPy or CuPy, any float dtype) as given, row count
    unknown (``null``). Written atomically. Raises ValueError for a value
    that is not a square 2-D float array with finite entries, TypeError for a
    non-mapping; what ``write_safetensors`` raises.
    """
    check_mapping(hessians, "hessians", "{name: HessianAccumulator | array}")
    tensors, rows = {}, {}
    for name, value in hessians.items():
        count = getattr(value, "count", None)
        H = to_host(value.hessian if count is not None else value)
        _check_square(f"hessian {name!r}", H)
        tensors[name] = np.ascontiguousarray(H, dtype=np.float32)
        rows[name] = count
    document = {"format_version": HESSIANS_VERSION, "rows": rows}
    write_safetensors(path, tensors, {HESSIANS_KEY: json.dumps(document)})


def _check_square(where: str, H) -> None:
    if (not isinstance(H, np.ndarray) or H.ndim != 2 or H.shape[0] != H.shape[1]
            or H.dtype.kind != "f"):
        raise ValueError(f"{where} must be a square 2-D float array [K_dim, K_dim], got "
                         f"{getattr(H, 'dtype', type(H).__name__)} {getattr(H, 'shape', '')}")
    if not np.isfinite(H).all():
        raise ValueError(f"{where} has non-finite entries; recollect the statistics")


class HessiansFile:
    """An open hessians file: ``lookup(weight_name)`` reads one layer's ``H``.

    ``with HessiansFile(path) as hessians:``; ``hessians.names`` lists what
    the file holds, ``hessians.used`` what ``lookup`` found. Raises
    ValueError (naming the file) for a file without the hessians marker (a
    model file given by mistake) and what ``SafetensorsReader`` raises.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self._reader = SafetensorsReader(path)
        if HESSIANS_KEY not in self._reader.metadata:
            self._reader.close()
            raise ValueError(f"{os.fspath(path)}: not a hessians file (no {HESSIANS_KEY!r} "
                             "metadata); write one with kbit_cupy.hessians.save_hessians")
        self.names = list(self._reader.names)
        self.used: list[str] = []

    def key_for(self, weight_name: str) -> str | None:
        """The stored name for ``weight_name``: itself, or without ``.weight``; None if neither."""
        for key in (weight_name, weight_name.removesuffix(".weight")):
            if key in self._reader.names:
                return key
        return None

    def lookup(self, weight_name: str, K_dim: int) -> np.ndarray | None:
        """``H`` (float32 ``[K_dim, K_dim]``) for the weight, or None if the file has none.

        Raises ValueError naming the file and the tensor if it is not
        ``[K_dim, K_dim]`` float or has non-finite entries.
        """
        key = self.key_for(weight_name)
        if key is None:
            return None
        H = self._reader.read(key)
        _check_square(f"{os.fspath(self.path)}: {key!r}", H)
        if H.shape[0] != K_dim:
            raise ValueError(f"{os.fspath(self.path)}: {key!r} is {H.shape[0]} x {H.shape[1]} "
                             f"but the weight {weight_name!r} has K_dim = {K_dim}; the "
                             "statistics come from another model")
        self.used.append(key)
        return H.astype(np.float32, copy=False)

    def close(self) -> None:
        self._reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
