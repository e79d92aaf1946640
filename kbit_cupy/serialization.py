"""Safetensors files without torch, and quantized models stored in them.

``read_safetensors`` / ``write_safetensors`` implement the ecosystem's
safetensors format (the one Hugging Face ``model.safetensors`` files use):

    8 bytes   little-endian uint64 N, the header length
    N bytes   UTF-8 JSON: {"__metadata__": {str: str},                 (optional)
                           "<name>": {"dtype": "F32", "shape": [..],
                                      "data_offsets": [begin, end]}, ...}
              padded with spaces so the data starts 8-byte aligned
    rest      the tensors' bytes, little-endian, C order; offsets are relative
              to the first data byte and the ranges tile the rest exactly

``save_quantized`` / ``load_quantized`` store a quantized model (names mapped
to ``KbitWeight`` objects or plain arrays) in an ordinary safetensors file:
weight ``w`` becomes the tensors ``w.packed`` (uint32, the FORMAT.md section 5
bit-planes, not the kernels' tiles), ``w.absmax`` (uint8 E4M4 codes or
float16) and ``w.codebook`` (float32), and the ``__metadata__`` key
``"kbit_cupy"`` holds a JSON document with the format version and, per
weight, ``k``, ``shape`` and ``absmax_format``, and under ``"crc32"`` one
checksum per tensor (CRC-32 of ``"NAME DTYPE [SHAPE]"``, e.g.
``"w.packed U32 [224]"``, followed by the tensor's bytes, so a changed dtype
or shape fails it too), as 8 hex digits. Any safetensors reader can open
such a file; only ``load_quantized`` turns it back into weights (and checks
the sums). Files written before the checksums existed load unverified.

Every file is written through ``_files.atomic_write`` (a temporary next to
the target, fsynced, then renamed over it): a failed or interrupted save
leaves the old file as it was. Reads open regular files only, so a FIFO or
device path is refused instead of blocking.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ._arrays import (
    BFLOAT16,
    as_module_array,
    check_mapping,
    check_path,
    gpu_available,
    is_device_array,
    to_host,
)
from ._files import atomic_write, open_regular, write_text
from .experts import KbitExperts
from .format import nblocks_for
from .gemm import KbitWeight
from .quantize import ABSMAX_FORMATS

# The safetensors dtype names and the NumPy dtypes they are read into.
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": BFLOAT16,
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}
METADATA_KEY = "kbit_cupy"  # the __metadata__ entry save_quantized writes; reserved
FORMAT_VERSION = 1  # of the METADATA_KEY document; load_quantized reads exactly this
WEIGHT_PARTS = ("packed", "absmax", "codebook")  # weight w -> tensors w.packed, ...
DEVICES = ("cpu", "gpu")

_HEADER_LENGTH_BYTES = 8
_ALIGN = 8  # the data starts at a multiple of this (the reference writer pads so)
_MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit: larger is not a header
# A safetensors header nests 3 deep ({"name": {"shape": [..]}}), our document
# 4; past this it is damage, refused before json (which would recurse per level).
_MAX_JSON_DEPTH = 64
# The checksum: CRC-32 (zlib, stdlib). Measured on a 1 GiB buffer (this
# project's CPU machine, zlib 1.2.13, best of 3): zlib.crc32 0.14 s (7.0 GiB/s),
# hashlib.blake2b 0.71 s (1.4 GiB/s), sha256 0.49 s, a plain memcpy 0.09 s;
# xxhash is not installed (and would be a dependency). CRC-32 catches every
# burst of up to 32 flipped bits and misses other damage with chance 2**-32
# per tensor; it guards against accidents, not against someone forging a file.
_CHECKSUM_KEY = "crc32"  # the document entry {tensor name: 8 hex digits}
_DOCUMENT_KEYS = {"format_version", "weights", _CHECKSUM_KEY}
_CORRUPT = "the file is truncated or damaged; download or write it again"
_RESAVE = "the file is damaged or was edited; write it again with save_quantized"


@dataclass(frozen=True)
class _Entry:
    """One tensor's header entry; ``begin``/``end`` are relative to the data start."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _bad_file(path, problem: str, fix: str = _CORRUPT) -> ValueError:
    return ValueError(f"{os.fspath(path)}: {problem}; {fix}")


def _check_device(device) -> None:
    if device not in DEVICES:
        raise ValueError(f'device must be "cpu" (NumPy) or "gpu" (CuPy), got {device!r}')
    if device == "gpu" and not gpu_available():
        raise RuntimeError(
            'device="gpu" needs CuPy and a CUDA GPU, and none was found; install CuPy '
            '(pip install cupy-cuda12x) on a machine with a GPU, or use device="cpu"'
        )


def _on_device(value, device: str):
    """``value`` (host array or KbitWeight) moved to ``device``."""
    if device == "cpu":
        return value
    if isinstance(value, KbitWeight):
        return value.to_device()
    import cupy

    return cupy.asarray(value)


# --------------------------------------------------------------------------
# reading


def _unique_keys(pairs: list) -> dict:
    # JSON allows repeated keys and json.loads keeps the last; two tensors of
    # one name mean a damaged file, so refuse instead of guessing.
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r} appears twice")
        obj[key] = value
    return obj


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # one string literal, escapes included


def _json_depth(text: bytes) -> int:
    """How deep ``[`` / ``{`` nest in ``text`` (brackets inside strings do not count)."""
    codes = np.frombuffer(_JSON_STRING.sub(b'""', text), dtype=np.uint8)
    steps = (np.isin(codes, (ord("["), ord("{"))).astype(np.int32)
             - np.isin(codes, (ord("]"), ord("}"))))
    return int(np.cumsum(steps).max(initial=0))


def _loads(text: bytes):
    """``json.loads`` refusing repeated keys and nesting past ``_MAX_JSON_DEPTH`` (ValueError)."""
    depth = _json_depth(text)
    if depth > _MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested {depth} deep, more than the {_MAX_JSON_DEPTH} allowed")
    return json.loads(text.decode("utf-8"), object_pairs_hook=_unique_keys)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _parse_entry(path, name: str, raw) -> _Entry:
    where = f"tensor {name!r}"
    if not isinstance(raw, dict) or not {"dtype", "shape", "data_offsets"} <= raw.keys():
        raise _bad_file(path, f"{where}: header entry {raw!r} lacks dtype, shape or data_offsets")
    dtype = SAFETENSORS_DTYPES.get(raw["dtype"]) if isinstance(raw["dtype"], str) else None
    if dtype is None:
        raise _bad_file(
            path,
            f"{where} has dtype {raw['dtype']!r}, which this reader does not know",
            f"supported: {', '.join(SAFETENSORS_DTYPES)}; convert the tensor when saving it",
        )
    shape, offsets = raw["shape"], raw["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _bad_file(path, f"{where} has shape {shape!r}, not a list of sizes >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets))
            or offsets[0] > offsets[1]):
        raise _bad_file(path, f"{where} has data_offsets {offsets!r}, not [begin, end], begin <= end")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _bad_file(
            path,
            f"{where}: {raw['dtype']} x {shape} needs {nbytes} bytes but data_offsets "
            f"{offsets} span {offsets[1] - offsets[0]}",
        )
    return _Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_tiling(path, entries: list[_Entry], data_bytes: int) -> None:
    """The tensors' byte ranges (sorted by begin) must cover the data exactly once."""
    position = 0
    for entry in entries:
        if entry.begin != position:
            problem = "overlaps the tensor before it" if entry.begin < position else (
                f"leaves a hole of {entry.begin - position} bytes before it")
            raise _bad_file(path, f"tensor {entry.name!r} at data_offsets "
                                  f"[{entry.begin}, {entry.end}] {problem}")
        position = entry.end
    if position != data_bytes:
        problem = (f"the tensors need {position} data bytes but the file has {data_bytes}"
                   if position > data_bytes else
                   f"{data_bytes - position} data bytes at the end belong to no tensor")
        raise _bad_file(path, problem)


def _read_header(f, path) -> tuple[list[_Entry], dict[str, str], int]:
    """(entries sorted by offset, the whole ``__metadata__``, data start) of open file ``f``."""
    file_bytes = os.fstat(f.fileno()).st_size
    if file_bytes < _HEADER_LENGTH_BYTES:
        raise _bad_file(path, f"{file_bytes} bytes is too short for a safetensors file",
                        "it is not a safetensors file, or it is truncated")
    header_bytes = int.from_bytes(f.read(_HEADER_LENGTH_BYTES), "little")
    if header_bytes > min(_MAX_HEADER_BYTES, file_bytes - _HEADER_LENGTH_BYTES):
        raise _bad_file(
            path,
            f"the first 8 bytes give a header length of {header_bytes} bytes for a file of "
            f"{file_bytes} bytes",
            "it is not a safetensors file, or it is truncated",
        )
    try:
        header = _loads(f.read(header_bytes))
    except ValueError as exc:  # also UnicodeDecodeError, repeated keys and deep nesting
        raise _bad_file(path, f"the header is not valid UTF-8 JSON ({exc})",
                        "it is not a safetensors file, or it is damaged") from exc
    if not isinstance(header, dict):
        raise _bad_file(path, f"the header is a JSON {type(header).__name__}, not an object",
                        "it is not a safetensors file")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad_file(path, f"__metadata__ must map strings to strings, got {metadata!r}")
    entries = sorted((_parse_entry(path, name, raw) for name, raw in header.items()),
                     key=lambda e: (e.begin, e.end))
    data_start = _HEADER_LENGTH_BYTES + header_bytes
    _check_tiling(path, entries, file_bytes - data_start)
    return entries, metadata, data_start


def _read_entry(f, path, entry: _Entry, data_start: int | None = None) -> np.ndarray:
    """One tensor from open file ``f``, at the current position or at ``data_start + begin``."""
    if data_start is not None:
        f.seek(data_start + entry.begin)
    # One fresh array per tensor: aligned, writable, freed independently.
    array = np.empty(entry.shape, dtype=entry.dtype)
    if f.readinto(array.reshape(-1).view(np.uint8)) != array.nbytes:
        raise _bad_file(path, f"tensor {entry.name!r}: the file ended early")
    return array


def _read_host(path, checker: Callable[[dict[str, str]], Callable] | None = None
               ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors as NumPy arrays (in file order) and the whole ``__metadata__``.

    ``checker(metadata)``, if given, returns a ``check(name, array)`` called on
    each tensor as soon as it is read (while its bytes are in cache).
    """
    check_path(path)
    with open_regular(path) as f:
        entries, metadata, data_start = _read_header(f, path)
        check = checker(metadata) if checker is not None else None
        f.seek(data_start)  # entries tile the data in order: one sequential read
        tensors = {}
        for entry in entries:
            array = _read_entry(f, path, entry)
            if check is not None:
                check(entry.name, array)
            tensors[entry.name] = array
    return tensors, metadata


def read_safetensors(path: str | os.PathLike, *, device: str = "cpu") -> dict:
    """Read every tensor of a safetensors file (e.g. a Hugging Face ``model.safetensors``).

    path : the file.
    device : ``"cpu"`` (NumPy arrays, the default) or ``"gpu"`` (CuPy arrays on
        the current CUDA device).

    Returns ``{name: array}`` in file order, each array with the stored shape
    and the NumPy dtype of ``SAFETENSORS_DTYPES`` (``BF16`` is
    ``ml_dtypes.bfloat16``), C-contiguous and writable. The file's
    ``__metadata__`` comes from ``read_safetensors_metadata``.

    Raises ValueError (naming the file) if the file is not a regular file (a
    FIFO, device or directory: refused without blocking), is not a
    safetensors file, is truncated, has an absurd header length, malformed or
    absurdly nested JSON, an unknown
    dtype, a byte range that does not match dtype x shape, or byte ranges that
    overlap, leave holes or run past the end; ValueError for a bad ``device``;
    RuntimeError for ``device="gpu"`` without CuPy or a GPU; TypeError for a
    ``path`` that is not a str or os.PathLike; OSError if the file cannot be
    opened.
    """
    _check_device(device)
    tensors, _ = _read_host(path)
    return {name: _on_device(array, device) for name, array in tensors.items()}


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The user metadata (``__metadata__``) of a safetensors file, ``{}`` if it has none.

    Only the header is read. For a file from ``save_quantized`` this is the
    ``metadata`` given there: the reserved ``"kbit_cupy"`` entry (the format
    document) is left out. Raises ValueError as ``read_safetensors`` does.
    """
    check_path(path)
    with open_regular(path) as f:
        _, metadata, _ = _read_header(f, path)
    return {key: value for key, value in metadata.items() if key != METADATA_KEY}


# --------------------------------------------------------------------------
# writing


def _dtype_name(path, name: str, dtype: np.dtype) -> str:
    for dtype_name, stored in SAFETENSORS_DTYPES.items():
        if dtype == stored:
            return dtype_name
    raise TypeError(
        f"{os.fspath(path)}: tensor {name!r} has dtype {dtype}, which safetensors cannot store; "
        f"supported: {', '.join(str(d) for d in SAFETENSORS_DTYPES.values())}; "
        "convert it with .astype(...) first"
    )


def _check_name(path, name) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{os.fspath(path)}: tensor names must be str, got {name!r}")
    if name == "__metadata__":
        raise ValueError(f"{os.fspath(path)}: '__metadata__' is reserved by the format; "
                         "rename the tensor")


def _host_tensor(path, name, value) -> np.ndarray:
    """A validated little-endian NumPy copy (or view) of ``value`` to store as ``name``."""
    _check_name(path, name)
    if not (isinstance(value, np.ndarray) or is_device_array(value)):
        raise TypeError(f"{os.fspath(path)}: tensor {name!r} must be a NumPy or CuPy array, got "
                        f"{type(value).__name__}; wrap it with np.asarray(...)")
    array = to_host(as_module_array(value, name)[1])
    if array.dtype.byteorder == ">":  # the format is little-endian
        array = array.astype(array.dtype.newbyteorder("<"))
    _dtype_name(path, name, array.dtype)
    return array


def _check_metadata(path, metadata) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError(f"{os.fspath(path)}: metadata must map str to str, got {metadata!r}; "
                        "encode other values with json.dumps")
    if METADATA_KEY in metadata:
        raise ValueError(f"{os.fspath(path)}: the metadata key {METADATA_KEY!r} is reserved for "
                         "save_quantized's format document; use another key")
    return dict(metadata)


def _header_bytes(path, specs: dict[str, tuple[np.dtype, tuple]], metadata: dict[str, str]
                  ) -> tuple[dict[str, tuple[int, int]], bytes]:
    """``({name: (begin, end)}, length + header)`` for tensors ``{name: (dtype, shape)}``.

    The offsets dict is in file order: widest items first (stable), so with
    the data 8-byte aligned every tensor starts at a multiple of its item
    size (what the reference writer does).
    """
    order = sorted(specs, key=lambda name: -specs[name][0].itemsize)
    header: dict = {"__metadata__": metadata} if metadata else {}
    offsets = {}
    position = 0
    for name in order:
        dtype, shape = specs[name]
        nbytes = math.prod(shape) * dtype.itemsize
        offsets[name] = (position, position + nbytes)
        header[name] = {"dtype": _dtype_name(path, name, dtype), "shape": list(shape),
                        "data_offsets": [position, position + nbytes]}
        position += nbytes
    header_json = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_json += b" " * (-(_HEADER_LENGTH_BYTES + len(header_json)) % _ALIGN)
    return offsets, len(header_json).to_bytes(_HEADER_LENGTH_BYTES, "little") + header_json


def _write(path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write validated host arrays; ``metadata`` may hold the reserved key."""
    order, header = _header_bytes(
        path, {name: (array.dtype, array.shape) for name, array in tensors.items()}, metadata)
    with atomic_write(path) as f:
        f.write(header)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name]).reshape(-1).view(np.uint8))


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping, metadata: Mapping[str, str] | None = None
) -> None:
    """Write arrays to a safetensors file that any safetensors reader opens.

    path : the file, replaced atomically (the old file stays whole until the
        new one is complete on disk).
    tensors : ``{name: array}``, NumPy or CuPy (copied to the host), any shape
        (0-d and empty included), dtype one of ``SAFETENSORS_DTYPES``
        (bool, u/int8..64, float16, ``ml_dtypes.bfloat16``, float32, float64).
    metadata : optional ``{str: str}``, stored as ``__metadata__`` and
        returned by ``read_safetensors_metadata``.

    Everything is checked before anything is written, and the write goes to
    a temporary file renamed over ``path`` only when complete: an error
    (disk full, Ctrl-C) leaves the old file byte-identical and no partial
    file. Raises TypeError for a ``path`` that is not a str or os.PathLike,
    ``tensors`` that is not a mapping, a non-str name, a value that is not an
    array, an unsupported dtype (complex, object, ...) or metadata that is
    not str -> str; ValueError for the name ``"__metadata__"``, the metadata
    key ``"kbit_cupy"`` (reserved) or a ``path`` that is a directory or
    other non-regular file; OSError as writing does.
    """
    check_path(path)
    check_mapping(tensors, "tensors", "{name: array}")
    metadata = _check_metadata(path, metadata)
    _write(path, {name: _host_tensor(path, name, v) for name, v in tensors.items()}, metadata)


# --------------------------------------------------------------------------
# quantized models


def save_quantized(
    path: str | os.PathLike, model: Mapping, metadata: Mapping[str, str] | None = None
) -> None:
    """Write a quantized model to a safetensors file.

    path : the file, replaced atomically (the old file stays whole until the
        new one is complete on disk).
    model : ``{name: KbitWeight | array}``. Weight ``w`` is stored as the
        tensors ``w.packed`` (uint32, FORMAT.md section 5 layout),
        ``w.absmax`` (uint8 E4M4 codes or float16) and ``w.codebook``
        (float32, ``2**k``); its ``k``, ``shape`` and absmax format go into the
        ``"kbit_cupy"`` metadata document. Arrays (biases, norms, embeddings)
        are stored as they are. NumPy or CuPy. Every tensor's CRC-32 goes
        into the document too, for ``load_quantized`` to verify.
    metadata : optional ``{str: str}`` of your own, returned by
        ``read_safetensors_metadata``.

    Raises ValueError if two entries would produce the same tensor name
    (e.g. an array ``"w.packed"`` next to a weight ``"w"``), TypeError for a
    ``model`` that is not a mapping, plus what ``write_safetensors`` raises.
    """
    check_path(path)
    check_mapping(model, "model", "{name: KbitWeight | array}")
    user_metadata = _check_metadata(path, metadata)
    tensors: dict[str, np.ndarray] = {}
    owner: dict[str, str] = {}  # tensor name -> the model entry that produced it
    weights: dict[str, dict] = {}
    for name, value in model.items():
        if isinstance(value, KbitExperts):
            raise TypeError(f"{os.fspath(path)}: {name!r} is a KbitExperts, which save_quantized "
                            "does not store yet; save each experts.expert(e) as its own weight")
        if isinstance(value, KbitWeight):
            _check_name(path, name)
            parts = {f"{name}.{part}": getattr(value, part) for part in WEIGHT_PARTS}
            weights[name] = {"k": value.k, "shape": list(value.shape),
                             "absmax_format": value.absmax_format}
        else:
            parts = {name: value}
        for tensor_name, array in parts.items():
            if tensor_name in owner:
                raise ValueError(
                    f"{os.fspath(path)}: model entries {owner[tensor_name]!r} and {name!r} both "
                    f"need the tensor name {tensor_name!r}; rename one of them"
                )
            owner[tensor_name] = name
            tensors[tensor_name] = _host_tensor(path, tensor_name, array)
    checksums = {name: _checksum(path, name, array) for name, array in tensors.items()}
    _write(path, tensors, _quantized_metadata(user_metadata, weights, checksums))


def _quantized_metadata(user: dict[str, str], weights: dict, checksums: dict[str, str]
                        ) -> dict[str, str]:
    """The ``__metadata__`` of a quantized file: the user's entries and the format document."""
    document = {"format_version": FORMAT_VERSION, "weights": weights, _CHECKSUM_KEY: checksums}
    return {**user, METADATA_KEY: json.dumps(document)}


def _checksum(path, name: str, array: np.ndarray) -> str:
    """CRC-32 of ``"NAME DTYPE [SHAPE]"`` then the bytes, as 8 hex digits."""
    crc = zlib.crc32(f"{name} {_dtype_name(path, name, array.dtype)} {list(array.shape)}".encode())
    crc = zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8), crc)
    return f"{crc:08x}"


def _document(path, metadata: dict[str, str]) -> dict:
    """The kbit_cupy document, its version, keys and weight specs checked."""
    if METADATA_KEY not in metadata:
        raise _bad_file(path, "this is a plain safetensors file (no kbit_cupy metadata)",
                        "read it with read_safetensors, or quantize and save_quantized it first")
    try:
        document = _loads(metadata[METADATA_KEY].encode("utf-8"))
        version = document["format_version"]
    except (ValueError, TypeError, KeyError) as exc:
        raise _bad_file(path, f"the kbit_cupy metadata is not a valid document ({exc!r})") from exc
    if version != FORMAT_VERSION:
        raise _bad_file(path, f"kbit_cupy format version {version!r} is not supported (this "
                              f"kbit_cupy reads version {FORMAT_VERSION})",
                        "load it with the kbit_cupy version that wrote it")
    unknown = sorted(document.keys() - _DOCUMENT_KEYS)
    if unknown:  # a damaged key must not silently turn the checksums off
        raise _bad_file(path, f"the kbit_cupy metadata has unknown entries {unknown}", _RESAVE)
    weights = document.get("weights")
    if not isinstance(weights, dict):
        raise _bad_file(path, f"the kbit_cupy metadata has no 'weights' object: {document!r}")
    for name, spec in weights.items():
        if (not isinstance(spec, dict) or not isinstance(spec.get("k"), int)
                or isinstance(spec.get("k"), bool)
                or not isinstance(spec.get("shape"), list) or len(spec["shape"]) != 2
                or not all(_is_count(d) for d in spec["shape"])
                or spec.get("absmax_format") not in ABSMAX_FORMATS):
            raise _bad_file(path, f"weight {name!r}: kbit_cupy metadata {spec!r} is not "
                                  '{"k": int, "shape": [N, K_dim], "absmax_format": '
                                  f"one of {list(ABSMAX_FORMATS)}}}", _RESAVE)
    checksums = document.get(_CHECKSUM_KEY, {})
    if not isinstance(checksums, dict) or not all(
            isinstance(v, str) and re.fullmatch("[0-9a-f]{8}", v) for v in checksums.values()):
        raise _bad_file(path, f"the kbit_cupy metadata's {_CHECKSUM_KEY!r} entry is not "
                              "{tensor name: 8 hex digits}", _RESAVE)
    return document


def _verifier(path, checksums: dict[str, str]) -> Callable[[str, np.ndarray], None]:
    """``check(name, array)`` raising ValueError for a tensor that fails its checksum."""
    def check(name: str, array: np.ndarray) -> None:
        if name not in checksums:
            raise _bad_file(path, f"tensor {name!r} has no checksum in the kbit_cupy metadata "
                                  "(a damaged name, or a tensor added after saving)", _RESAVE)
        actual = _checksum(path, name, array)
        if actual != checksums[name]:
            raise _bad_file(
                path, f"tensor {name!r} fails its checksum (stored crc32 {checksums[name]}, "
                      f"read {actual}): its bytes, dtype or shape changed after it was saved",
                "write or download the file again (load_quantized(..., verify=False) skips "
                "the check)")
    return check


def _check_finite_scales(path, name: str, parts: dict) -> None:
    """Refuse NaN / infinite / negative float16 scales and non-finite codebook entries."""
    absmax, codebook = parts["absmax"], parts["codebook"]
    if absmax.dtype == np.float16:  # E4M4 codes all decode to finite scales
        bad = np.flatnonzero(~(np.isfinite(absmax) & (absmax >= 0)))
        if bad.size:
            raise _bad_file(path, f"weight {name!r}: {name}.absmax block {bad[0]} holds "
                                  f"{absmax[bad[0]]}, not a finite scale >= 0 ({bad.size} such "
                                  "blocks)", _RESAVE)
    bad = np.flatnonzero(~np.isfinite(codebook))
    if bad.size:
        raise _bad_file(path, f"weight {name!r}: {name}.codebook entry {bad[0]} is "
                              f"{codebook[bad[0]]}, not finite", _RESAVE)


def _weight_from_tensors(path, name: str, spec: dict, tensors: dict) -> KbitWeight:
    """Take weight ``name``'s tensors out of ``tensors`` and check them against ``spec``."""
    parts = {}
    for part in WEIGHT_PARTS:
        tensor_name = f"{name}.{part}"
        if tensor_name not in tensors:
            raise _bad_file(path, f"weight {name!r}: the tensor {tensor_name!r} is missing",
                            _RESAVE)
        parts[part] = tensors.pop(tensor_name)
    expected = {"packed": np.dtype(np.uint32), "absmax": ABSMAX_FORMATS[spec["absmax_format"]],
                "codebook": np.dtype(np.float32)}
    for part, dtype in expected.items():
        if parts[part].dtype != dtype:
            raise _bad_file(path, f"weight {name!r}: {name}.{part} is {parts[part].dtype}, but "
                                  f"the metadata (absmax_format={spec['absmax_format']!r}) "
                                  f"says {dtype}", _RESAVE)
    _check_finite_scales(path, name, parts)
    try:  # KbitWeight checks that the sizes fit k and shape
        return KbitWeight(k=spec["k"], shape=tuple(spec["shape"]), **parts)
    except (ValueError, TypeError) as exc:
        raise _bad_file(path, f"weight {name!r} does not match its kbit_cupy metadata ({exc})",
                        _RESAVE) from exc


def load_quantized(path: str | os.PathLike, *, device: str = "cpu", verify: bool = True) -> dict:
    """Read a model written by ``save_quantized``: the exact bits that were saved.

    path : the file.
    device : ``"cpu"`` (NumPy, the default) or ``"gpu"`` (CuPy on the current
        CUDA device, ready for ``kbit_gemm``).
    verify : check every tensor against the CRC-32 ``save_quantized``
        recorded (default). Each tensor is hashed right after it is read:
        about 0.14 s per GiB. Measured on a 1 GiB file (the project's CPU
        machine): from the page cache 0.09 s plain, 0.23 s verified; the
        first, uncached read took 2.1 s, so from disk it adds about 7%.
        ``False`` skips it. Files saved before checksums existed load
        unverified either way.

    Whatever ``verify`` says, NaN, infinite or negative float16 scales and
    non-finite codebook entries are refused (naming the tensor and block).

    Returns ``{name: KbitWeight | array}``: a ``KbitWeight`` with the saved
    ``packed``, ``absmax``, ``codebook``, ``k``, ``shape`` and absmax format
    per quantized weight, and the plain arrays as stored. The user metadata
    comes from ``read_safetensors_metadata(path)``.

    Raises ValueError (naming the file) for everything ``read_safetensors``
    rejects, for a plain safetensors file without kbit_cupy metadata (use
    ``read_safetensors``), an unsupported format version, and metadata that
    does not match the tensors (k, shape, absmax format, codebook length, a
    missing tensor), for a tensor that fails its checksum or has none (the
    message names it), and for bad scales or codebooks; ValueError for a bad
    ``device``, TypeError for a non-bool ``verify`` or a ``path`` that is not
    a str or os.PathLike, RuntimeError for ``device="gpu"`` without CuPy or
    a GPU; OSError if the file cannot be opened.
    """
    _check_device(device)
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {verify!r}")
    document: dict = {}

    def checker(metadata: dict[str, str]):
        # Runs once the header is read: a plain or damaged document is refused
        # before any data is read, and the checksums are there to check against.
        document.update(_document(path, metadata))
        if verify and _CHECKSUM_KEY in document:
            return _verifier(path, document[_CHECKSUM_KEY])
        return lambda name, array: None

    tensors, _ = _read_host(path, checker)
    if verify:
        missing = sorted(document.get(_CHECKSUM_KEY, {}).keys() - tensors.keys())
        if missing:
            raise _bad_file(path, f"the tensors {missing} have checksums but are not in the file",
                            _RESAVE)
    model = {}
    for name, spec in document["weights"].items():
        model[name] = _weight_from_tensors(path, name, spec, tensors)
    for name, array in tensors.items():  # what is left are the plain arrays
        if name in model:
            raise _bad_file(path, f"{name!r} is both a plain tensor and a quantized weight")
        model[name] = array
    return {name: _on_device(value, device) for name, value in model.items()}


# --------------------------------------------------------------------------
# streaming and sharded checkpoints (python -m kbit_cupy quantize-model, inspect)
#
# Kept here rather than taken from the safetensors package: its NumPy API
# (safe_open(framework="numpy")) reads one tensor at a time too, but has no
# bfloat16 (most LLM checkpoints) and no writer that fills a file tensor by
# tensor; and this module already owns the checks above.

SINGLE_FILE = "model.safetensors"  # Hugging Face's names for a checkpoint's files
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsReader:
    """A safetensors file read one tensor at a time (peak memory: one tensor).

    ``with SafetensorsReader(path) as reader:`` reads and checks the header
    as ``read_safetensors`` does, so a truncated or damaged file is refused
    before any tensor is read. Then:

    - ``reader.names``: the tensor names in file order;
    - ``reader.info(name)``: ``(dtype, shape)``;
    - ``reader.read(name)``: a fresh C-contiguous NumPy array;
    - ``iter(reader)``: ``(name, array)`` pairs in file order;
    - ``reader.metadata``: the whole ``__metadata__`` (``{}`` if none);
    - ``reader.document()``: the kbit_cupy document of a ``save_quantized``
      file, checked as ``load_quantized`` checks it (ValueError for a plain
      file).

    Raises what ``read_safetensors`` raises, naming the file.
    """

    def __init__(self, path: str | os.PathLike):
        check_path(path)
        self.path = path
        self._file = open_regular(path)
        try:
            entries, self.metadata, self._data_start = _read_header(self._file, path)
        except BaseException:
            self._file.close()
            raise
        self._entries = {entry.name: entry for entry in entries}
        self.names = list(self._entries)
        self.data_bytes = sum(entry.end - entry.begin for entry in entries)

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        entry = self._entry(name)
        return entry.dtype, entry.shape

    def read(self, name: str) -> np.ndarray:
        return _read_entry(self._file, self.path, self._entry(name), self._data_start)

    def document(self) -> dict:
        return _document(self.path, self.metadata)

    def __iter__(self):
        for name in self.names:
            yield name, self.read(name)

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            raise KeyError(f"{os.fspath(self.path)} has no tensor {name!r}")
        return self._entries[name]

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@dataclass(frozen=True)
class WeightLayout:
    """What ``QuantizedWriter`` reserves for one ``KbitWeight``: ``k``, ``shape``
    ``(N, K_dim)`` and the scale format (``"e4m4"`` or ``"fp16"``)."""

    k: int
    shape: tuple[int, int]
    absmax_format: str = "e4m4"

    def tensors(self, name: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The stored tensors ``{name.packed: (dtype, shape), ...}`` (module docstring)."""
        nblocks = nblocks_for(math.prod(self.shape))
        return {f"{name}.packed": (np.dtype(np.uint32), (nblocks * self.k,)),
                f"{name}.absmax": (ABSMAX_FORMATS[self.absmax_format], (nblocks,)),
                f"{name}.codebook": (np.dtype(np.float32), (1 << self.k,))}


_PLACEHOLDER_CRC = "0" * 8  # as wide as every real checksum: the header's length is final


class QuantizedWriter:
    """``save_quantized`` one entry at a time, for models larger than memory.

    layout : ``{name: WeightLayout | (dtype, shape)}``, every entry of the
        model in the order ``save_quantized`` would be given them.
    metadata : optional ``{str: str}``, as for ``save_quantized``.

    ``with QuantizedWriter(path, layout, metadata) as out: out.add(name, value)``
    for every entry, in any order (``value`` a ``KbitWeight`` for a
    ``WeightLayout``, else an array of that dtype and shape; NumPy or CuPy).
    Each tensor goes straight to its place in the file and is not kept, so
    memory holds one entry at a time. The header is written first with
    placeholder checksums and rewritten, at the same length, when the
    ``with`` block ends. The result is byte for byte the file
    ``save_quantized(path, model, metadata)`` writes for the same model.

    The file is written through ``atomic_write``: an error inside the block,
    an entry never added (ValueError naming it), a full disk or Ctrl-C leaves
    no file under ``path`` (an old one stays as it was) and no temporary.
    ``add`` raises ValueError for a name not in the layout, one added twice,
    or a value whose k, shape, scale format or dtype differ from its layout;
    TypeError for a ``KbitWeight`` where an array was laid out or the reverse.
    """

    def __init__(self, path: str | os.PathLike, layout: Mapping,
                 metadata: Mapping[str, str] | None = None):
        check_path(path)
        check_mapping(layout, "layout", "{name: WeightLayout | (dtype, shape)}")
        self.path = path
        self._user = _check_metadata(path, metadata)
        self._specs: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}  # tensor -> dtype, shape
        self._parts: dict[str, list[str]] = {}  # layout entry -> its tensor names
        self._weights: dict[str, dict] = {}  # the document's "weights"
        for name, spec in layout.items():
            _check_name(path, name)
            if isinstance(spec, WeightLayout):
                tensors = spec.tensors(name)
                self._weights[name] = {"k": spec.k, "shape": list(spec.shape),
                                       "absmax_format": spec.absmax_format}
            else:
                dtype, shape = spec
                tensors = {name: (np.dtype(dtype), tuple(int(d) for d in shape))}
            for tensor_name, (dtype, _) in tensors.items():
                if tensor_name in self._specs:
                    raise ValueError(f"{os.fspath(path)}: two layout entries need the tensor "
                                     f"name {tensor_name!r}; rename one of them")
                _dtype_name(path, tensor_name, dtype)
            self._specs.update(tensors)
            self._parts[name] = list(tensors)
        self._checksums = dict.fromkeys(self._specs, _PLACEHOLDER_CRC)
        self._offsets, header = self._header()
        self._data_start = len(header)
        self._added: set[str] = set()
        self._stack: contextlib.ExitStack | None = None
        self._file = None

    def _header(self) -> tuple[dict[str, tuple[int, int]], bytes]:
        metadata = _quantized_metadata(self._user, self._weights, self._checksums)
        return _header_bytes(self.path, self._specs, metadata)

    def __enter__(self):
        with contextlib.ExitStack() as stack:
            self._file = stack.enter_context(atomic_write(self.path))
            self._file.write(self._header()[1])
            self._stack = stack.pop_all()
        return self

    def add(self, name: str, value) -> None:
        """Write entry ``name`` (see the class docstring)."""
        if self._file is None:
            raise ValueError("QuantizedWriter.add needs an open writer: use it in a with block")
        where = f"{os.fspath(self.path)}: {name!r}"
        if name not in self._parts:
            raise ValueError(f"{where} is not in the layout given to QuantizedWriter")
        if name in self._added:
            raise ValueError(f"{where} was added twice")
        if (name in self._weights) != isinstance(value, KbitWeight):
            wanted = "a KbitWeight" if name in self._weights else "an array"
            raise TypeError(f"{where} was laid out as {wanted}, got {type(value).__name__}")
        if isinstance(value, KbitWeight):
            spec = self._weights[name]
            given = {"k": value.k, "shape": list(value.shape),
                     "absmax_format": value.absmax_format}
            if given != spec:
                raise ValueError(f"{where} is {given}, the layout says {spec}")
            parts = {f"{name}.{part}": getattr(value, part) for part in WEIGHT_PARTS}
        else:
            parts = {name: value}
        for tensor_name, array in parts.items():
            host = _host_tensor(self.path, tensor_name, array)
            if (host.dtype, host.shape) != self._specs[tensor_name]:
                dtype, shape = self._specs[tensor_name]
                raise ValueError(f"{os.fspath(self.path)}: {tensor_name!r} is {host.dtype} "
                                 f"{host.shape}, the layout says {dtype} {shape}")
            self._file.seek(self._data_start + self._offsets[tensor_name][0])
            self._file.write(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
            self._checksums[tensor_name] = _checksum(self.path, tensor_name, host)
        self._added.add(name)

    def _finish(self) -> None:
        missing = [name for name in self._parts if name not in self._added]
        if missing:
            raise ValueError(f"{os.fspath(self.path)}: {len(missing)} layout entries were never "
                             f"added ({', '.join(map(repr, missing[:3]))}...); nothing was written")
        header = self._header()[1]
        assert len(header) == self._data_start, "a checksum changed the header's length"
        self._file.seek(0)
        self._file.write(header)

    def __exit__(self, *exc_info) -> bool:
        # atomic_write (held open in the stack) renames on a clean exit and
        # removes the temporary on an exception, ours from _finish included.
        stack, self._stack = self._stack, None
        try:
            if exc_info[0] is None:
                self._finish()
        except BaseException:
            self._file = None
            if not stack.__exit__(*sys.exc_info()):
                raise
            return False
        self._file = None
        return stack.__exit__(*exc_info)


@dataclass(frozen=True)
class Checkpoint:
    """The files of a safetensors checkpoint: one file, or shards and their index.

    ``shards``: the files, in the order the index first names them;
    ``index``: the ``*.safetensors.index.json`` of a sharded checkpoint, else
    None; ``weight_map``: the index's ``{tensor name: shard file name}``;
    ``index_metadata``: the index's ``"metadata"`` object (``{}`` if none).
    """

    shards: tuple[Path, ...]
    index: Path | None = None
    weight_map: dict = field(default_factory=dict)
    index_metadata: dict = field(default_factory=dict)


def find_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Where the files of checkpoint ``path`` are, and (for shards) that they exist.

    ``path``: a ``.safetensors`` file; an index (``*.safetensors.index.json``,
    whose ``weight_map`` names shards beside it, as Hugging Face writes); or
    a directory holding ``model.safetensors``, ``model.safetensors.index.json``
    (``model.safetensors`` wins if both are there, as in ``transformers``) or
    exactly one ``.safetensors`` file.

    Raises FileNotFoundError naming the path, or the shard an index names
    that does not exist (and the index); ValueError naming the file for an
    index that is not JSON with a ``weight_map`` of ``{tensor: file name}``,
    names a shard outside its directory, or a directory with several
    ``.safetensors`` files and no index.
    """
    check_path(path)
    path = Path(path)
    if path.is_dir():
        for name in (SINGLE_FILE, INDEX_FILE):
            if (path / name).is_file():
                return find_checkpoint(path / name)
        found = sorted(p.name for p in path.glob("*.safetensors"))
        if len(found) != 1:
            raise ValueError(
                f"{path}: no {SINGLE_FILE} or {INDEX_FILE}, and "
                + (f"{len(found)} .safetensors files ({', '.join(found[:4])})" if found else
                   "no .safetensors file") + "; give the file or the index itself")
        return Checkpoint((path / found[0],))
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
    if not path.name.endswith(".json"):
        return Checkpoint((path,))
    return _read_index(path)


def _read_index(index: Path) -> Checkpoint:
    with open_regular(index) as f:
        try:
            document = _loads(f.read(_MAX_HEADER_BYTES + 1))
        except ValueError as exc:
            raise _bad_file(index, f"the index is not valid UTF-8 JSON ({exc})",
                            "download or write the index again") from exc
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise _bad_file(index, "the index has no \"weight_map\" of {tensor name: shard file}",
                        "download or write the index again")
    metadata = document.get("metadata") or {}
    shards: dict[str, Path] = {}
    for shard_name in weight_map.values():
        if shard_name in shards:
            continue
        if Path(shard_name).name != shard_name or shard_name in ("", ".", ".."):
            raise _bad_file(index, f"the index names the shard {shard_name!r}, which is not a "
                                   "file name in the index's directory",
                            "fix the index (shards sit next to it)")
        shard = index.parent / shard_name
        if not shard.is_file():
            raise FileNotFoundError(errno.ENOENT, f"No such file, named by the index {index}; "
                                    "the download is incomplete: fetch the missing shard",
                                    str(shard))
        shards[shard_name] = shard
    return Checkpoint(tuple(shards.values()), index, dict(weight_map),
                      metadata if isinstance(metadata, dict) else {})


def write_safetensors_index(path: str | os.PathLike, weight_map: Mapping[str, str],
                            metadata: Mapping | None = None) -> None:
    """Write a Hugging Face style index: ``{"metadata": ..., "weight_map": ...}``, atomically."""
    document = {"metadata": dict(metadata or {}), "weight_map": dict(weight_map)}
    write_text(path, json.dumps(document, indent=2) + "\n")


def load_quantized_model(path: str | os.PathLike, *, device: str = "cpu",
                         verify: bool = True) -> dict:
    """``load_quantized`` for one file or for shards with an index (what
    ``python -m kbit_cupy quantize-model`` writes).

    path : a file, an index, or a directory, as ``find_checkpoint`` takes.
    Returns ``{name: KbitWeight | array}`` over all shards. Raises what
    ``find_checkpoint`` and ``load_quantized`` raise, and ValueError (naming
    the index) when a shard holds tensors the index does not map to it, or
    the index maps tensors that no shard holds.
    """
    checkpoint = find_checkpoint(path)
    model: dict = {}
    seen: set[str] = set()
    for shard in checkpoint.shards:
        part = load_quantized(shard, device=device, verify=verify)
        for name, value in part.items():
            tensors = ([f"{name}.{p}" for p in WEIGHT_PARTS] if isinstance(value, KbitWeight)
                       else [name])
            for tensor in tensors:
                if checkpoint.index is not None and checkpoint.weight_map.get(tensor) != shard.name:
                    raise _bad_file(checkpoint.index, f"{shard.name} holds {tensor!r}, which the "
                                                      "index does not map to it",
                                    "write the index again")
            seen.update(tensors)
            if name in model:
                raise _bad_file(shard, f"{name!r} is in more than one shard",
                                "write the checkpoint again")
            model[name] = value
    missing = sorted(checkpoint.weight_map.keys() - seen)
    if missing:
        raise _bad_file(checkpoint.index, f"the index maps {len(missing)} tensors no shard holds "
                                          f"({', '.join(map(repr, missing[:3]))})",
                        "write the checkpoint again")
    return model
