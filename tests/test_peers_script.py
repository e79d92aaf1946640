"""benchmarks/peers.py without a GPU: its arguments, the lead rule, the files it writes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("peers_script", None)


def test_arguments(peers, capsys):
    args = peers.parse_args(["--layers", "2048x768", "4096X28672", "--m", "1", "16"])
    assert args.shapes == [(2048, 768), (4096, 28672)]
    assert args.m == [1, 16] and args.peers == list(peers.PEERS)
    for bad in (["--layers", "4096"], ["--layers", "0x768"], ["--m", "0"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)
        assert "error:" in capsys.readouterr().err


def test_lead_counts_only_peers_with_as_many_bits(peers):
    # k=4 (4.25 bits): tinygemm and gemlite W4 (4.25), bnb (4.5) count; gemlite W2 (2.25) not
    assert peers.lead({"kbit_k4": 10.0, "tinygemm_int4": 12.0, "gemlite_w2": 5.0}, 4) is True
    assert peers.lead({"kbit_k4": 10.0, "tinygemm_int4": 9.0}, 4) is False
    assert peers.lead({"kbit_k4": 10.0, "bnb_nf4": 9.5}, 4) is False
    # k=2 (2.25 bits): every peer counts, gemlite W2 included
    assert peers.lead({"kbit_k2": 10.0, "gemlite_w2": 9.0}, 2) is False
    # k=5 (5.25 bits): no peer spends as many bits; unmeasured ops: no verdict
    assert peers.lead({"kbit_k5": 10.0, "tinygemm_int4": 1.0}, 5) is None
    assert peers.lead({"tinygemm_int4": 1.0}, 4) is None
    assert peers.lead({"kbit_k4": 10.0, "tinygemm_int4": None}, 4) is None


def test_save_writes_each_layer_and_names_the_losses(peers, tmp_path):
    args = peers.parse_args(["--layers", "768x2048", "2048x768", "--out", str(tmp_path / "p")])

    def rec(layer, M, mode, k4, tiny):
        r = {"layer": layer, "M": M, "mode": mode, "cublas_fp16_us": 5.0,
             "kbit_k4_us": k4, "tinygemm_int4_us": tiny, "x_kbit_k4": 5.0 / k4}
        r["lead_k4"] = peers.lead({"kbit_k4": k4, "tinygemm_int4": tiny}, 4)
        return r

    records = [rec("2048x768", 1, "eager", 3.0, 4.0), rec("768x2048", 1, "graph", 3.0, 2.5),
               rec("2048x768", 1, "graph", 3.0, 4.0)]
    info = {"gpu": "test GPU", "commit": "abc1234"}
    bad, lost = peers.save(records, [{"ok": True}], [], info, {}, args, final=False)
    assert bad == [] and lost == ["768x2048 M=1 graph k=4"]
    assert [(r["layer"], r["mode"]) for r in records] == [
        ("768x2048", "graph"), ("2048x768", "graph"), ("2048x768", "eager")]
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["meta"]["complete"] is False and len(data["records"]) == 3
    assert "in progress or cut" in data["meta"]["layers_done"]
    peers.save(records, [], [], info, {}, args, final=True)
    assert json.loads((tmp_path / "p.json").read_text())["meta"]["complete"] is True
    assert "x_kbit_k4" in (tmp_path / "p.md").read_text()
