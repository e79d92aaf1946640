"""quantize-model and inspect (kbit_cupy/convert.py), the streaming writer and sharded
loading they use (serialization.py), and hessians files, on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import kbit_cupy as kc
from kbit_cupy.__main__ import main
from kbit_cupy.convert import REPORT_FILE, inspect_model, quantize_model
from kbit_cupy.hessians import HessiansFile, save_hessians
from kbit_cupy.serialization import (
    INDEX_FILE,
    QuantizedWriter,
    SafetensorsReader,
    WeightLayout,
    load_quantized_model,
    write_safetensors,
    write_safetensors_index,
)

ROOT = Path(__file__).resolve().parent.parent


def _rng():
    return np.random.default_rng(22)


def _sharded_checkpoint(directory: Path) -> dict:
    """A small Llama-like checkpoint in two shards with an index; returns all its tensors."""
    rng = _rng()

    def w(*shape, dtype=np.float16):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(dtype)

    shards = {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": w(100, 64),
            "model.layers.0.self_attn.q_proj.weight": w(64, 64, dtype=ml_dtypes.bfloat16),
            "model.layers.0.mlp.down_proj.weight": w(64, 96),
            "model.layers.0.input_layernorm.weight": w(64),
        },
        "model-00002-of-00002.safetensors": {
            "model.layers.1.self_attn.q_proj.weight": w(48, 64, dtype=np.float32),
            "model.layers.1.odd.weight": w(16, 40),  # K_dim not a multiple of 32: copied
            "model.norm.weight": w(64),
            "lm_head.weight": w(100, 64),
            "model.rotary.inv_freq": np.arange(8, dtype=np.int64),
        },
    }
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in shards.items():
        write_safetensors(directory / shard, tensors, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    write_safetensors_index(directory / INDEX_FILE, weight_map, {"total_size": 1})
    (directory / "config.json").write_text('{"model_type": "toy"}')
    (directory / "pytorch_model.bin").write_bytes(b"old weights")
    return {name: t for tensors in shards.values() for name, t in tensors.items()}


@pytest.fixture
def checkpoint(tmp_path):
    source = tmp_path / "toy"
    return source, _sharded_checkpoint(source)


def _convert(source, out, **options):
    return quantize_model(source, out, device="cpu", progress=False, **options)


def _leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


# --------------------------------------------------------------------------
# converting


def test_sharded_checkpoint_gives_shards_index_and_the_in_memory_bits(checkpoint, tmp_path):
    source, tensors = checkpoint
    out = tmp_path / "q"
    summary = _convert(source, out, k=4)
    assert sorted(os.listdir(out)) == sorted([
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_FILE,
        "config.json", REPORT_FILE])  # pytorch_model.bin is not copied
    quantized = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"}
    assert {r["name"] for r in summary["layers"]} == quantized
    model = load_quantized_model(out)
    assert model.keys() == tensors.keys()
    for name, original in tensors.items():
        if name in quantized:
            expected = kc.quantize_weight(original, k=4)
            assert isinstance(model[name], kc.KbitWeight)
            np.testing.assert_array_equal(model[name].packed, expected.packed)
            np.testing.assert_array_equal(model[name].absmax, expected.absmax)
        else:  # copied bit for bit, dtype included
            assert model[name].dtype == original.dtype
            assert model[name].tobytes() == original.tobytes()
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["weight_map"]["lm_head.weight.packed"] == "model-00002-of-00002.safetensors"
    assert index["metadata"]["total_size"] == summary["totals"]["bytes_out"]
    assert _leftovers(tmp_path) == []


def test_each_shard_is_a_save_quantized_file(checkpoint, tmp_path):
    source, _ = checkpoint
    _convert(source, tmp_path / "q", k=3, absmax_format="fp16")
    part = kc.load_quantized(tmp_path / "q" / "model-00001-of-00002.safetensors")
    weight = part["model.layers.0.mlp.down_proj.weight"]
    assert weight.k == 3 and weight.absmax_format == "fp16"
    assert kc.read_safetensors_metadata(tmp_path / "q" / "model-00001-of-00002.safetensors") == {
        "format": "pt", "kbit_cupy_source": "model-00001-of-00002.safetensors"}


def test_include_and_exclude_select_the_layers(checkpoint, tmp_path):
    source, _ = checkpoint
    summary = _convert(source, tmp_path / "q", include=r"q_proj", exclude=r"layers\.1\.")
    assert [r["name"] for r in summary["layers"]] == ["model.layers.0.self_attn.q_proj.weight"]
    summary = _convert(source, tmp_path / "q2", exclude="^$")  # embeddings too
    assert "model.embed_tokens.weight" in {r["name"] for r in summary["layers"]}


def test_fitted_codebook_is_fitted_per_layer(checkpoint, tmp_path):
    source, tensors = checkpoint
    _convert(source, tmp_path / "q", k=3, codebook="fit")
    model = load_quantized_model(tmp_path / "q")
    for name in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        np.testing.assert_array_equal(model[name].codebook, kc.fit_codebook(tensors[name], 3))


def test_hessians_give_gptq_for_the_layers_they_cover(checkpoint, tmp_path):
    source, tensors = checkpoint
    name = "model.layers.0.mlp.down_proj.weight"
    accumulator = kc.HessianAccumulator(96)
    accumulator.add(_rng().standard_normal((200, 96)).astype(np.float32))
    save_hessians(tmp_path / "h.safetensors", {name.removesuffix(".weight"): accumulator})
    summary = _convert(source, tmp_path / "q", hessians=tmp_path / "h.safetensors")
    methods = {r["name"]: r["method"] for r in summary["layers"]}
    assert methods.pop(name) == "gptq" and set(methods.values()) == {"rtn"}
    with HessiansFile(tmp_path / "h.safetensors") as stored:
        H = stored.lookup(name, 96)
    expected = kc.quantize_weight(tensors[name], 4, hessian=H, method="gptq")
    np.testing.assert_array_equal(load_quantized_model(tmp_path / "q")[name].packed,
                                  expected.packed)


def test_hessians_naming_no_weight_are_refused_before_writing(checkpoint, tmp_path):
    source, _ = checkpoint
    save_hessians(tmp_path / "h.safetensors", {"other.layer": np.eye(64, dtype=np.float32)})
    with pytest.raises(ValueError, match="names a weight"):
        _convert(source, tmp_path / "q", hessians=tmp_path / "h.safetensors")
    assert not (tmp_path / "q").exists() and _leftovers(tmp_path) == []


def test_a_model_file_is_not_a_hessians_file(checkpoint, tmp_path):
    source, _ = checkpoint
    with pytest.raises(ValueError, match="not a hessians file"):
        _convert(source, tmp_path / "q", hessians=source / "model-00001-of-00002.safetensors")


def test_single_file_and_its_directory_convert_alike(tmp_path):
    W = (_rng().standard_normal((32, 64)) * 0.1).astype(np.float16)
    (tmp_path / "in").mkdir()
    write_safetensors(tmp_path / "in" / "model.safetensors", {"fc.weight": W, "fc.bias": W[0]})
    _convert(tmp_path / "in", tmp_path / "a")
    _convert(tmp_path / "in" / "model.safetensors", tmp_path / "b")
    assert ((tmp_path / "a" / "model.safetensors").read_bytes()
            == (tmp_path / "b" / "model.safetensors").read_bytes())
    assert not (tmp_path / "a" / INDEX_FILE).exists()


# --------------------------------------------------------------------------
# the command line and bad input


def _run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code: int, err: str, *words) -> None:
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], err


def test_cli_prints_the_table_and_inspect_reads_it_back(checkpoint, tmp_path, capsys):
    source, _ = checkpoint
    code, out, _ = _run_cli(capsys, "quantize-model", source, tmp_path / "q", "--k", "4",
                            "--cpu")
    assert code == 0
    assert "model.layers.0.mlp.down_proj.weight" in out and "SQNR" in out
    assert "quantized 4 layers" in out and "K_dim not a multiple of 32" in out
    code, out, _ = _run_cli(capsys, "inspect", tmp_path / "q")
    assert code == 0 and "2 shards" in out and "total: 4 quantized weights" in out
    assert "lm_head.weight" in out and "nf [" in out
    result = inspect_model(tmp_path / "q" / "model-00002-of-00002.safetensors")
    assert [w["name"] for w in result["files"][0]["weights"]] == [
        "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"]
    code, out, _ = _run_cli(capsys, "inspect", source)  # a plain checkpoint: says so
    assert code == 0 and "not quantized" in out


def test_existing_output_needs_overwrite_and_overwrite_replaces_only_its_own(
        checkpoint, tmp_path, capsys):
    source, _ = checkpoint
    out = tmp_path / "q"
    assert _run_cli(capsys, "quantize-model", source, out, "--cpu")[0] == 0
    before = (out / "model-00001-of-00002.safetensors").read_bytes()
    code, _, err = _run_cli(capsys, "quantize-model", source, out, "--k", "2", "--cpu")
    _one_line_error(code, err, str(out), "--overwrite")
    assert (out / "model-00001-of-00002.safetensors").read_bytes() == before
    code, _, _ = _run_cli(capsys, "quantize-model", source, out, "--k", "2", "--overwrite",
                          "--cpu")
    assert code == 0 and load_quantized_model(out)["lm_head.weight"].k == 2
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    code, _, err = _run_cli(capsys, "quantize-model", source, foreign, "--overwrite", "--cpu")
    _one_line_error(code, err, REPORT_FILE)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert _leftovers(tmp_path) == []


def test_index_naming_a_missing_shard_is_one_line(checkpoint, tmp_path, capsys):
    source, _ = checkpoint
    (source / "model-00002-of-00002.safetensors").unlink()
    code, _, err = _run_cli(capsys, "quantize-model", source, tmp_path / "q", "--cpu")
    _one_line_error(code, err, "model-00002-of-00002.safetensors", "index")
    assert not (tmp_path / "q").exists() and _leftovers(tmp_path) == []


def test_truncated_shard_is_one_line_and_writes_nothing(checkpoint, tmp_path, capsys):
    source, _ = checkpoint
    shard = source / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    code, _, err = _run_cli(capsys, "quantize-model", source, tmp_path / "q", "--cpu")
    _one_line_error(code, err, "model-00002-of-00002.safetensors", "truncated")
    assert not (tmp_path / "q").exists() and _leftovers(tmp_path) == []


def test_index_and_shards_that_disagree_are_one_line(checkpoint, tmp_path, capsys):
    source, _ = checkpoint
    index = json.loads((source / INDEX_FILE).read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    (source / INDEX_FILE).write_text(json.dumps(index))
    code, _, err = _run_cli(capsys, "quantize-model", source, tmp_path / "q", "--cpu")
    _one_line_error(code, err, "model.ghost.weight")
    del index["weight_map"]["model.ghost.weight"], index["weight_map"]["lm_head.weight"]
    (source / INDEX_FILE).write_text(json.dumps(index))
    code, _, err = _run_cli(capsys, "quantize-model", source, tmp_path / "q", "--cpu")
    _one_line_error(code, err, "lm_head.weight", "weight_map")


def test_missing_input_and_quantized_input_are_one_line(checkpoint, tmp_path, capsys):
    source, _ = checkpoint
    code, _, err = _run_cli(capsys, "quantize-model", tmp_path / "nope", tmp_path / "q")
    _one_line_error(code, err, "nope", "No such file")
    assert _run_cli(capsys, "quantize-model", source, tmp_path / "q", "--cpu")[0] == 0
    code, _, err = _run_cli(capsys, "quantize-model", tmp_path / "q", tmp_path / "q2")
    _one_line_error(code, err, "already quantized")


DISK_FULL = """
    import resource, sys
    from kbit_cupy.__main__ import main

    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
    sys.exit(main(["quantize-model", sys.argv[1], sys.argv[2], "--cpu", "--exclude", "^$"]))
"""


def test_disk_full_mid_write_leaves_no_output_and_no_temporary(checkpoint, tmp_path):
    source, _ = checkpoint
    out = tmp_path / "q"
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(DISK_FULL), str(source),
                            str(out), "6000"], check=False, capture_output=True, text=True,
                           cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    _one_line_error(child.returncode, child.stderr, "File too large")
    assert not out.exists() and _leftovers(tmp_path) == []


# --------------------------------------------------------------------------
# the streaming writer and reader


def _small_model():
    W = (_rng().standard_normal((64, 96)) * 0.1).astype(np.float16)
    return {"a.weight": kc.quantize_weight(W, 4), "a.bias": np.arange(5, dtype=np.float32),
            "b": kc.quantize_weight(W, 3, absmax_format="fp16"), "c": np.ones(3, np.uint8)}


def _layout(model):
    return {name: (WeightLayout(v.k, v.shape, v.absmax_format) if isinstance(v, kc.KbitWeight)
                   else (v.dtype, v.shape)) for name, v in model.items()}


def test_streaming_writer_in_any_order_writes_the_save_quantized_bytes(tmp_path):
    model = _small_model()
    kc.save_quantized(tmp_path / "ref.safetensors", model, {"x": "y"})
    with QuantizedWriter(tmp_path / "s.safetensors", _layout(model), {"x": "y"}) as writer:
        for name in reversed(list(model)):
            writer.add(name, model[name])
    assert ((tmp_path / "s.safetensors").read_bytes()
            == (tmp_path / "ref.safetensors").read_bytes())


def test_streaming_writer_with_an_entry_missing_writes_nothing(tmp_path):
    model = _small_model()
    with (pytest.raises(ValueError, match="never added"),
          QuantizedWriter(tmp_path / "s.safetensors", _layout(model)) as writer):
        writer.add("a.bias", model["a.bias"])
    assert os.listdir(tmp_path) == []


def test_streaming_writer_refuses_values_unlike_their_layout(tmp_path):
    model = _small_model()
    with (pytest.raises(ValueError, match="layout says"),
          QuantizedWriter(tmp_path / "s.safetensors", _layout(model)) as writer):
        writer.add("a.bias", np.arange(6, dtype=np.float32))
    with (pytest.raises(TypeError, match="KbitWeight"),
          QuantizedWriter(tmp_path / "s.safetensors", _layout(model)) as writer):
        writer.add("b", np.zeros(3))
    assert os.listdir(tmp_path) == []


def test_reader_reads_one_tensor_at_a_time(tmp_path):
    tensors = {"x": np.arange(6, dtype=np.float32).reshape(2, 3),
               "y": np.ones(4, ml_dtypes.bfloat16)}
    write_safetensors(tmp_path / "t.safetensors", tensors)
    with SafetensorsReader(tmp_path / "t.safetensors") as reader:
        assert sorted(reader.names) == ["x", "y"]
        assert reader.info("x") == (np.dtype(np.float32), (2, 3))
        np.testing.assert_array_equal(reader.read("x"), tensors["x"])
        assert dict(iter(reader)).keys() == tensors.keys()
        with pytest.raises(KeyError, match="z"):
            reader.read("z")
