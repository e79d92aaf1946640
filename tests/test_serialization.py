"""Safetensors reading/writing and quantized-model files (kbit_cupy.serialization).

Files are checked against an independent mini-parser and writer kept in this
file, and against the ``safetensors`` package when it is installed (it is not
a dependency).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

import kbit_cupy as kc
from kbit_cupy._arrays import BFLOAT16, gpu_available
from kbit_cupy.serialization import (
    SAFETENSORS_DTYPES,
    load_quantized,
    read_safetensors,
    read_safetensors_metadata,
    save_quantized,
    write_safetensors,
)

# --------------------------------------------------------------------------
# helpers: an independent reader/writer of the format, bit comparisons


def _mini_parse(path) -> tuple[int, dict, bytes]:
    """(header length, header JSON, data bytes), read with nothing but json."""
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    return header_len, json.loads(raw[8 : 8 + header_len]), raw[8 + header_len :]


def _craft_raw(path, header: bytes | dict, data: bytes = b"") -> None:
    """A file with exactly this header (dict -> JSON, unpadded) and data."""
    if isinstance(header, dict):
        header = json.dumps(header).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def _craft(path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """An independent writer: tensors in the given order, no alignment padding."""
    header = {"__metadata__": metadata} if metadata is not None else {}
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    data = b""
    for name, array in tensors.items():
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [len(data), len(data) + array.nbytes]}
        data += np.ascontiguousarray(array).tobytes()
    _craft_raw(path, header, data)


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_same_weight(loaded, original) -> None:
    assert isinstance(loaded, kc.KbitWeight)
    assert (loaded.k, loaded.shape, loaded.absmax_format) == (
        original.k, original.shape, original.absmax_format)
    for part in ("packed", "absmax", "codebook"):
        assert _same_bits(_host(getattr(loaded, part)), _host(getattr(original, part))), part


def _host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _weight(k: int, N: int, K_dim: int, absmax_format: str = "e4m4", seed: int = 0):
    rng = np.random.default_rng(seed)
    codebook = rng.permutation(rng.standard_normal(1 << k)).astype(np.float32)  # unsorted
    W = rng.standard_normal((N, K_dim)).astype(np.float32)
    return kc.quantize_weight(W, k, codebook=codebook, absmax_format=absmax_format)


def _random_array(dtype_name: str, shape: tuple, seed: int = 0) -> np.ndarray:
    """Arbitrary bits (NaN payloads included) of the given dtype; bools stay 0/1."""
    dtype = SAFETENSORS_DTYPES[dtype_name]
    rng = np.random.default_rng(seed)
    if dtype_name == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.fixture
def model_file(tmp_path):
    """A saved model with one weight and one plain array, and its parts."""
    weight = _weight(4, 7, 64)
    bias = np.arange(7, dtype=np.float32)
    path = tmp_path / "model.safetensors"
    save_quantized(path, {"w": weight, "bias": bias}, {"note": "hi"})
    return path, weight, bias


# --------------------------------------------------------------------------
# plain safetensors


@given(dtype_name=st.sampled_from(sorted(SAFETENSORS_DTYPES)),
       shape=array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
       seed=st.integers(0, 2**32 - 1))
def test_plain_tensor_round_trip_is_bit_exact(tmp_path_factory, dtype_name, shape, seed):
    path = tmp_path_factory.mktemp("plain") / "t.safetensors"
    array = _random_array(dtype_name, shape, seed)
    write_safetensors(path, {"t": array})
    assert _same_bits(read_safetensors(path)["t"], array)


def test_every_dtype_in_one_file_with_zero_d_and_empty(tmp_path):
    tensors = {f"x_{name}": _random_array(name, (3, 2), i)
               for i, name in enumerate(SAFETENSORS_DTYPES)}
    tensors["scalar"] = np.array(7, dtype=np.int64)
    tensors["empty"] = np.zeros((0, 4), dtype=BFLOAT16)
    path = tmp_path / "all.safetensors"
    write_safetensors(path, tensors)
    back = read_safetensors(path)
    assert back.keys() == tensors.keys()
    for name, array in tensors.items():
        assert _same_bits(back[name], array), name
        assert back[name].flags.writeable and back[name].flags.c_contiguous


def test_written_file_is_aligned_and_tiled(tmp_path):
    tensors = {"a": np.ones(3, np.uint8), "b": np.ones((2, 3), np.float64),
               "c": np.ones(5, np.float16), "d": np.ones(0, np.int32), "e": np.ones(1, np.int64)}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, {"k": "v"})
    header_len, header, data = _mini_parse(path)
    assert (8 + header_len) % 8 == 0
    assert header.pop("__metadata__") == {"k": "v"}
    position = 0
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        begin, end = entry["data_offsets"]
        assert begin == position, name
        assert begin % tensors[name].dtype.itemsize == 0, name  # aligned to its items
        assert np.frombuffer(data[begin:end], tensors[name].dtype).size == tensors[name].size
        position = end
    assert position == len(data)


def test_reads_unpadded_files_from_other_writers(tmp_path):
    tensors = {"odd": np.arange(3, dtype=np.uint8), "f": np.arange(4, dtype=np.float32)}
    path = tmp_path / "t.safetensors"
    _craft(path, tensors, {"a": "b"})  # no padding: "f" is unaligned in the file
    back = read_safetensors(path)
    assert all(_same_bits(back[n], tensors[n]) for n in tensors)
    assert read_safetensors_metadata(path) == {"a": "b"}


def test_metadata_round_trip_and_default(tmp_path):
    path = tmp_path / "t.safetensors"
    metadata = {"format": "pt", "note": "ünïcode ✓", "json": json.dumps({"x": [1, 2]})}
    write_safetensors(path, {"t": np.zeros(2, np.float32)}, metadata)
    assert read_safetensors_metadata(path) == metadata
    write_safetensors(path, {"t": np.zeros(2, np.float32)})
    assert read_safetensors_metadata(path) == {}


def test_non_contiguous_and_big_endian_inputs_are_stored_as_values(tmp_path):
    path = tmp_path / "t.safetensors"
    transposed = np.arange(12, dtype=np.float32).reshape(3, 4).T
    big_endian = np.arange(5, dtype=">i4")
    write_safetensors(path, {"t": transposed, "b": big_endian})
    back = read_safetensors(path)
    np.testing.assert_array_equal(back["t"], transposed)
    np.testing.assert_array_equal(back["b"], big_endian)
    assert back["b"].dtype == np.dtype("<i4")


@pytest.mark.parametrize("value", [[1.0, 2.0], 3.0, None, np.float32(1.0)])
def test_write_rejects_values_that_are_not_arrays(tmp_path, value):
    with pytest.raises(TypeError, match="must be a NumPy or CuPy array"):
        write_safetensors(tmp_path / "t.safetensors", {"t": value})


@pytest.mark.parametrize("dtype", [np.complex64, object, "U3", "datetime64[s]"])
def test_write_rejects_unsupported_dtypes(tmp_path, dtype):
    path = tmp_path / "t.safetensors"
    with pytest.raises(TypeError, match="safetensors cannot store"):
        write_safetensors(path, {"t": np.zeros(2, dtype=dtype)})
    assert not path.exists()  # checked before the file is opened


def test_write_rejects_bad_names_and_metadata(tmp_path):
    path = tmp_path / "t.safetensors"
    x = np.zeros(2, np.float32)
    with pytest.raises(TypeError, match="names must be str"):
        write_safetensors(path, {1: x})
    with pytest.raises(ValueError, match="reserved"):
        write_safetensors(path, {"__metadata__": x})
    with pytest.raises(TypeError, match="metadata must map str to str"):
        write_safetensors(path, {"t": x}, {"n": 1})
    with pytest.raises(ValueError, match="reserved"):
        write_safetensors(path, {"t": x}, {"kbit_cupy": "{}"})


def test_bad_device_is_a_value_error(model_file):
    path, _, _ = model_file
    with pytest.raises(ValueError, match="device"):
        read_safetensors(path, device="cuda")
    with pytest.raises(ValueError, match="device"):
        load_quantized(path, device=0)


@pytest.mark.skipif(gpu_available(), reason="tests the error without a GPU")
def test_gpu_device_without_gpu_says_what_is_missing(model_file):
    with pytest.raises(RuntimeError, match="CuPy and a CUDA GPU"):
        load_quantized(model_file[0], device="gpu")


# --------------------------------------------------------------------------
# damaged files: ValueError naming the file


def _valid_entry(**changes) -> dict:
    return {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]} | changes


CORRUPT_FILES = {
    "too short": (lambda p: p.write_bytes(b"abc"), "too short"),
    "text file": (lambda p: p.write_bytes(b"this is not a safetensors file" * 4), "header length"),
    "header past end": (lambda p: p.write_bytes((1000).to_bytes(8, "little") + b"{}"),
                        "header length"),
    "absurd header": (lambda p: p.write_bytes(b"\xff" * 8 + b"{}"), "header length"),
    "bad json": (lambda p: _craft_raw(p, b"{not json}"), "not valid UTF-8 JSON"),
    "bad utf8": (lambda p: _craft_raw(p, b'{"\xff": 1}'), "not valid UTF-8 JSON"),
    "json list": (lambda p: _craft_raw(p, b"[1, 2]"), "not an object"),
    "repeated key": (lambda p: _craft_raw(
        p, b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
           b' "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', b"xy"), "twice"),
    "bad metadata": (lambda p: _craft_raw(p, {"__metadata__": {"n": 1}}), "__metadata__"),
    "entry not object": (lambda p: _craft_raw(p, {"a": [1]}, b""), "lacks dtype"),
    "unknown dtype": (lambda p: _craft_raw(p, {"a": _valid_entry(dtype="C64")}, bytes(8)),
                      "dtype 'C64'"),
    "dtype not a string": (lambda p: _craft_raw(p, {"a": _valid_entry(dtype=["F32"])}, bytes(8)),
                           "dtype \\['F32'\\]"),
    "bad shape": (lambda p: _craft_raw(p, {"a": _valid_entry(shape=[-2])}, bytes(8)), "shape"),
    "bad offsets": (lambda p: _craft_raw(p, {"a": _valid_entry(data_offsets=[8, 0])}, bytes(8)),
                    "data_offsets"),
    "size mismatch": (lambda p: _craft_raw(p, {"a": _valid_entry(shape=[3])}, bytes(8)),
                      "needs 12 bytes"),
    "past the end": (lambda p: _craft_raw(p, {"a": _valid_entry()}, bytes(6)), "the file has 6"),
    "trailing bytes": (lambda p: _craft_raw(p, {"a": _valid_entry()}, bytes(12)),
                       "belong to no tensor"),
    "hole": (lambda p: _craft_raw(p, {"a": _valid_entry(data_offsets=[4, 12])}, bytes(12)),
             "hole"),
    "overlap": (lambda p: _craft_raw(p, {"a": _valid_entry(),
                                         "b": _valid_entry(data_offsets=[4, 12])}, bytes(12)),
                "overlaps"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_FILES))
def test_damaged_files_raise_value_error_naming_the_file(tmp_path, case):
    make, what = CORRUPT_FILES[case]
    path = tmp_path / f"{case.replace(' ', '_')}.safetensors"
    make(path)
    for reader in (read_safetensors, load_quantized):
        with pytest.raises(ValueError, match=what) as info:
            reader(path)
        assert str(path) in str(info.value)


def test_truncated_file_is_a_value_error(tmp_path, model_file):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(model_file[0].read_bytes()[:-5])
    with pytest.raises(ValueError, match=str(path)):
        load_quantized(path)


# --------------------------------------------------------------------------
# quantized models


@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (33, 32)])
def test_quantized_round_trip_is_bit_exact(tmp_path, k, absmax_format, shape):
    weight = _weight(k, *shape, absmax_format=absmax_format, seed=k)
    path = tmp_path / "q.safetensors"
    save_quantized(path, {"layer.weight": weight})
    loaded = load_quantized(path)
    assert list(loaded) == ["layer.weight"]
    _assert_same_weight(loaded["layer.weight"], weight)
    np.testing.assert_array_equal(loaded["layer.weight"].dequantize(np.float32),
                                  weight.dequantize(np.float32))


def test_mixed_model_and_user_metadata_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    model = {
        "q_proj": _weight(4, 33, 64),
        "k_proj": _weight(3, 8, 96, absmax_format="fp16", seed=2),
        "q_proj.bias": rng.standard_normal(33).astype(np.float32),
        "norm": rng.standard_normal(64).astype(np.float32).astype(BFLOAT16),
        "embed": rng.standard_normal((10, 64)).astype(np.float16),
        "step": np.array(12, dtype=np.int64),
        "empty": np.zeros((0,), dtype=np.uint8),
    }
    metadata = {"base_model": "tiny", "quantized_by": "test"}
    path = tmp_path / "m.safetensors"
    save_quantized(path, model, metadata)
    loaded = load_quantized(path)
    assert loaded.keys() == model.keys()
    for name, value in model.items():
        if isinstance(value, kc.KbitWeight):
            _assert_same_weight(loaded[name], value)
        else:
            assert _same_bits(loaded[name], value), name
    assert read_safetensors_metadata(path) == metadata
    # An ordinary safetensors file underneath: the parts under their own names.
    raw = read_safetensors(path)
    assert {"q_proj.packed", "q_proj.absmax", "q_proj.codebook", "embed"} <= raw.keys()
    assert raw["k_proj.absmax"].dtype == np.float16
    assert _same_bits(raw["q_proj.packed"], model["q_proj"].packed)
    _, header, _ = _mini_parse(path)
    document = json.loads(header["__metadata__"]["kbit_cupy"])
    assert document["format_version"] == 1
    assert document["weights"]["k_proj"] == {"k": 3, "shape": [8, 96], "absmax_format": "fp16"}


def test_name_collision_is_a_value_error(tmp_path):
    path = tmp_path / "m.safetensors"
    model = {"w": _weight(2, 1, 32), "w.packed": np.zeros(2, np.uint32)}
    with pytest.raises(ValueError, match=r"'w'.*'w.packed'|'w.packed'.*'w'") as info:
        save_quantized(path, model)
    assert str(path) in str(info.value)
    assert not path.exists()


def test_save_rejects_values_that_are_not_arrays_or_weights(tmp_path):
    with pytest.raises(TypeError, match="must be a NumPy or CuPy array"):
        save_quantized(tmp_path / "m.safetensors", {"w": [1, 2, 3]})
    with pytest.raises(TypeError, match="names must be str"):
        save_quantized(tmp_path / "m.safetensors", {("a",): _weight(2, 1, 32)})


def test_experts_objects_are_refused_with_what_to_do(tmp_path):
    from kbit_cupy import quantize_experts

    experts = quantize_experts(np.ones((2, 16, 32), np.float32), 4)
    with pytest.raises(TypeError, match="experts.expert"):
        save_quantized(tmp_path / "m.safetensors", {"moe": experts})


def test_plain_file_given_to_load_quantized_says_use_read_safetensors(tmp_path):
    path = tmp_path / "plain.safetensors"
    write_safetensors(path, {"t": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="plain safetensors file.*read_safetensors") as info:
        load_quantized(path)
    assert str(path) in str(info.value)


def _edited(model_file, tmp_path, *, document=None, tensors=None):
    """A copy of model_file (one weight "w": k=4, [7, 64], e4m4) with edits.

    The checksums are dropped (as a file from before them): the cases using
    this pin the checks that hold with or without checksums.
    """
    source, _, _ = model_file
    raw = read_safetensors(source)
    _, header, _ = _mini_parse(source)
    doc = json.loads(header["__metadata__"]["kbit_cupy"])
    del doc["crc32"]
    if document is not None:
        doc = document(doc)
    if tensors is not None:
        raw = tensors(raw)
    path = tmp_path / "edited.safetensors"
    _craft(path, raw, {"kbit_cupy": doc if isinstance(doc, str) else json.dumps(doc)})
    return path


def _with_spec(**changes):
    def edit(doc):
        doc["weights"]["w"].update(changes)
        return doc
    return edit


def _drop(name):
    return lambda raw: {n: a for n, a in raw.items() if n != name}


def _replace(name, value):
    return lambda raw: raw | {name: value}


MISMATCHES = {
    "k": ({"document": _with_spec(k=3)}, "does not match"),
    "bad k": ({"document": _with_spec(k=9)}, "does not match"),
    "shape": ({"document": _with_spec(shape=[7, 128])}, "does not match"),
    "shape not 2-d": ({"document": _with_spec(shape=[7])}, "is not"),
    "shape not integers": ({"document": _with_spec(shape=[7.0, 64.0])}, "is not"),
    "k a bool": ({"document": _with_spec(k=True)}, "is not"),
    "absmax format": ({"document": _with_spec(absmax_format="fp16")}, "absmax_format='fp16'"),
    "unknown absmax format": ({"document": _with_spec(absmax_format="e8m0")}, "is not"),
    "version": ({"document": lambda d: d | {"format_version": 2}}, "version 2"),
    "not json": ({"document": lambda d: "{oops"}, "not a valid document"),
    "no weights": ({"document": lambda d: {"format_version": 1}}, "'weights'"),
    "missing absmax": ({"tensors": _drop("w.absmax")}, "'w.absmax' is missing"),
    "codebook length": ({"tensors": _replace("w.codebook", np.zeros(17, np.float32))},
                        "does not match"),
    "packed dtype": ({"tensors": lambda r: r | {"w.packed": r["w.packed"].view(np.int32)}},
                     "w.packed is int32"),
    "weight name also plain": ({"tensors": _replace("w", np.zeros(1, np.float32))},
                               "both a plain tensor"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_metadata_not_matching_tensors_is_a_value_error(model_file, tmp_path, case):
    edits, what = MISMATCHES[case]
    path = _edited(model_file, tmp_path, **edits)
    with pytest.raises(ValueError, match=what) as info:
        load_quantized(path)
    assert str(path) in str(info.value)


def test_unedited_copy_loads(model_file, tmp_path):
    """The editing helper itself writes loadable files (so the cases above test the edit)."""
    _, weight, bias = model_file
    loaded = load_quantized(_edited(model_file, tmp_path))
    _assert_same_weight(loaded["w"], weight)
    assert _same_bits(loaded["bias"], bias)


# --------------------------------------------------------------------------
# the safetensors package (optional)


def test_interoperates_with_the_safetensors_package(tmp_path, model_file):
    st_numpy = pytest.importorskip("safetensors.numpy")
    tensors = {name: _random_array(name, (2, 3)) for name in SAFETENSORS_DTYPES if name != "BF16"}
    tensors["scalar"] = np.array(3.5, np.float64)
    tensors["empty"] = np.zeros((0, 2), np.int16)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(ours, tensors, {"a": "b"})
    loaded = st_numpy.load_file(ours)
    assert all(_same_bits(loaded[n], tensors[n]) for n in tensors)
    st_numpy.save_file(tensors, theirs, metadata={"c": "d"})
    back = read_safetensors(theirs)
    assert all(_same_bits(back[n], tensors[n]) for n in tensors)
    assert read_safetensors_metadata(theirs) == {"c": "d"}
    # A quantized model file is an ordinary safetensors file too.
    assert _same_bits(st_numpy.load_file(model_file[0])["w.packed"], model_file[1].packed)


# --------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
def test_gpu_load_gives_the_same_gemm_bits(tmp_path):
    import cupy as cp

    weight = _weight(4, 70, 256)
    bias = np.arange(70, dtype=np.float16)
    path = tmp_path / "m.safetensors"
    save_quantized(path, {"w": weight.to_device(), "b": cp.asarray(bias)})  # CuPy in
    loaded = load_quantized(path, device="gpu")
    assert isinstance(loaded["w"].packed, cp.ndarray) and isinstance(loaded["b"], cp.ndarray)
    _assert_same_weight(loaded["w"], weight)
    A = cp.asarray(np.random.default_rng(3).standard_normal((5, 256)).astype(np.float16))
    expected = kc.kbit_gemm(A, weight.to_device())
    assert _same_bits(kc.kbit_gemm(A, loaded["w"]).get(), expected.get())


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
def test_read_safetensors_on_gpu_returns_cupy_arrays(tmp_path):
    import cupy as cp

    tensors = {"f": np.arange(6, dtype=np.float32).reshape(2, 3), "i": np.array(4, np.int64),
               "h": np.zeros((0, 3), np.float16), "b": np.arange(4, dtype=np.float32).astype(BFLOAT16)}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {n: cp.asarray(a) for n, a in tensors.items()})
    back = read_safetensors(path, device="gpu")
    for name, array in tensors.items():
        assert isinstance(back[name], cp.ndarray)
        assert _same_bits(back[name].get(), array), name
