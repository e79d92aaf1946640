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

import json
import math
import os
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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
from ._files import atomic_write, open_regular
from .experts import KbitExperts
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
            # One fresh array per tensor: aligned, writable, freed independently.
            array = np.empty(entry.shape, dtype=entry.dtype)
            if f.readinto(array.reshape(-1).view(np.uint8)) != array.nbytes:
                raise _bad_file(path, f"tensor {entry.name!r}: the file ended early")
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


def _write(path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write validated host arrays; ``metadata`` may hold the reserved key."""
    # Widest items first: with the data 8-byte aligned, every tensor then
    # starts at a multiple of its item size (what the reference writer does).
    order = sorted(tensors, key=lambda name: -tensors[name].dtype.itemsize)
    header: dict = {"__metadata__": metadata} if metadata else {}
    position = 0
    for name in order:
        array = tensors[name]
        header[name] = {
            "dtype": _dtype_name(path, name, array.dtype),
            "shape": list(array.shape),
            "data_offsets": [position, position + array.nbytes],
        }
        position += array.nbytes
    header_json = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_json += b" " * (-(_HEADER_LENGTH_BYTES + len(header_json)) % _ALIGN)
    with atomic_write(path) as f:
        f.write(len(header_json).to_bytes(_HEADER_LENGTH_BYTES, "little"))
        f.write(header_json)
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
    document = {"format_version": FORMAT_VERSION, "weights": weights, _CHECKSUM_KEY: checksums}
    _write(path, tensors, {**user_metadata, METADATA_KEY: json.dumps(document)})


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
