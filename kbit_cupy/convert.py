"""Quantize a safetensors checkpoint, and say what a quantized one holds.

``python -m kbit_cupy quantize-model IN OUT --k 4`` (``quantize_model``)
reads a Hugging Face checkpoint (one ``model.safetensors``, or shards with
``model.safetensors.index.json``) and writes a k-bit copy to the directory
``OUT``:

- Every 2-D float weight (fp16, bf16, fp32; the name ends in ``weight``)
  whose ``K_dim`` is a multiple of 32, that ``--include`` selects and
  ``--exclude`` does not, becomes a ``KbitWeight``; everything else is copied
  bit for bit. The default ``--exclude`` keeps embedding tables as they are:
  they are looked up by row, never multiplied, so ``kbit_gemm`` cannot serve
  them.
- One output shard per input shard, with the input's file names, and an
  index like the input's when it had one. Each shard is a ``save_quantized``
  file (CRC-32 per tensor), so ``load_quantized`` opens any one of them and
  ``load_quantized_model(OUT)`` the whole checkpoint. The checkpoint
  directory's other small files (config.json, tokenizer files) are copied
  too, and ``kbit_quantize.json`` records the settings and the per-layer
  table.
- Streaming: one input tensor is read at a time, quantized (on the GPU when
  there is one) and written straight to its place in the output shard
  (``QuantizedWriter``), so peak memory is about one layer.
- ``--codebook fit`` fits one codebook per layer: the file stores a
  codebook per weight either way (64 bytes at k = 4), a per-layer fit is the
  best the format allows for each weight, and it needs one pass over the
  checkpoint where one codebook per layer type would need two (or all of a
  type's weights in memory).
- ``--hessians FILE`` (``kbit_cupy.hessians``): layers with statistics are
  quantized with GPTQ (``quantize_weight(..., method="gptq")``), the rest
  round to nearest.

Nothing is half done: the inputs are all checked (headers, shards, index)
before anything is written, the output is built in a temporary directory next
to ``OUT`` and renamed into place only when complete, and any error (a
truncated shard, a full disk, Ctrl-C) removes it. An existing ``OUT`` is
refused unless ``--overwrite``, and even then only if it is empty or an
earlier output of this command.

``python -m kbit_cupy inspect FILE`` (``inspect_model``) prints what a file,
index or directory holds: each quantized layer's shape, k, scale format,
codebook and bytes, the plain tensors, the totals and the metadata. It reads
headers and codebooks only, so it needs no GPU and little time.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ._arrays import FLOAT_DTYPES, gpu_available
from ._files import TEMP_MARKER, write_text
from .format import create_normal_float_codebook
from .gemm import quantize_weight
from .quantize import ABSMAX_FORMATS
from .serialization import (
    METADATA_KEY,
    WEIGHT_PARTS,
    Checkpoint,
    QuantizedWriter,
    SafetensorsReader,
    WeightLayout,
    find_checkpoint,
    write_safetensors_index,
)

CODEBOOKS = ("nf", "fit")
DEFAULT_EXCLUDE = r"embed|(^|\.)(wte|wpe)\."  # embedding tables (BERT, Llama, GPT-2 names)
REPORT_FILE = "kbit_quantize.json"  # marks a directory this command wrote
# The checkpoint directory's other files are copied unless they are weights in
# another format (the output replaces the weights) or larger than this.
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack",
                    ".onnx", ".gguf", ".ot", ".pb", ".tflite", ".npz"}
_MAX_COPIED_FILE_BYTES = 64 << 20  # tokenizer.json of Llama 3 is 9 MB


@dataclass
class LayerReport:
    """One quantized weight: what it was, what it became, and how close it is."""

    name: str
    shape: tuple[int, int]
    dtype: str  # of the input
    k: int
    codebook: str  # "nf" or "fit"
    method: str  # "rtn" or "gptq"
    bits_per_weight: float
    sqnr_db: float
    bytes_in: int
    bytes_out: int


# --------------------------------------------------------------------------
# planning: everything is checked before anything is written


def _quantizable(name: str, dtype: np.dtype, shape: tuple, include, exclude) -> str | None:
    """None if tensor ``name`` is quantized, else why it is copied (for the summary)."""
    if dtype not in FLOAT_DTYPES or len(shape) != 2 or not name.endswith("weight"):
        return "not a 2-D float weight"
    if shape[1] % 32 or shape[0] < 1:
        return "K_dim not a multiple of 32"
    if include is not None and not include.search(name):
        return "not selected by --include"
    if exclude is not None and exclude.search(name):
        return "selected by --exclude"
    return None


@dataclass
class _ShardPlan:
    source: Path
    output_name: str
    layout: dict  # {name: WeightLayout | (dtype, shape)}, file order
    metadata: dict  # the input shard's own __metadata__


def _plan(checkpoint: Checkpoint, k: int, absmax_format: str, include, exclude
          ) -> tuple[list[_ShardPlan], dict[str, list[str]]]:
    """Per shard, what each tensor becomes; and the copied tensors by reason."""
    plans, copied, where = [], {}, {}
    for shard in checkpoint.shards:
        with SafetensorsReader(shard) as reader:  # a truncated or damaged shard fails here
            if METADATA_KEY in reader.metadata:
                raise ValueError(f"{shard}: already quantized by kbit_cupy (it has kbit_cupy "
                                 "metadata); quantize the original checkpoint")
            layout = {}
            for name in reader.names:
                if name in where:
                    raise ValueError(f"tensor {name!r} is in both {where[name]} and {shard}; "
                                     "the checkpoint is inconsistent")
                where[name] = shard
                dtype, shape = reader.info(name)
                reason = _quantizable(name, dtype, shape, include, exclude)
                if reason is None:
                    layout[name] = WeightLayout(k, (shape[0], shape[1]), absmax_format)
                else:
                    layout[name] = (dtype, shape)
                    copied.setdefault(reason, []).append(name)
            plans.append(_ShardPlan(shard, shard.name, layout, dict(reader.metadata)))
    if checkpoint.index is not None:
        _check_index(checkpoint, where)
    return plans, copied


def _check_index(checkpoint: Checkpoint, where: dict[str, Path]) -> None:
    for name, shard_name in checkpoint.weight_map.items():
        if name not in where:
            raise ValueError(f"{checkpoint.index}: maps {name!r} to {shard_name}, which does not "
                             "hold it; the index or the shard is from another download")
        if where[name].name != shard_name:
            raise ValueError(f"{checkpoint.index}: maps {name!r} to {shard_name}, but it is in "
                             f"{where[name].name}")
    unlisted = sorted(where.keys() - checkpoint.weight_map.keys())
    if unlisted:
        raise ValueError(f"{checkpoint.index}: {len(unlisted)} tensors of the shards are not in "
                         f"its weight_map ({', '.join(map(repr, unlisted[:3]))}); the index "
                         "is from another download")


def _check_statistics_match(statistics, plans: list[_ShardPlan]) -> None:
    """ValueError if the statistics name none of the weights to quantize (a naming mismatch)."""
    weights = [name for plan in plans for name, spec in plan.layout.items()
               if isinstance(spec, WeightLayout)]
    if weights and not any(statistics.key_for(name) is not None for name in weights):
        raise ValueError(f"{statistics.path}: none of its {len(statistics.names)} statistics "
                         f"names a weight to quantize (it has e.g. {statistics.names[:1]}, the "
                         f"checkpoint e.g. {weights[:1]}); the names must match")


def _check_output(out: Path, checkpoint: Checkpoint, overwrite: bool) -> None:
    sources = {shard.resolve().parent for shard in checkpoint.shards}
    if out.resolve() in sources or any(out.resolve() in s.parents for s in sources):
        raise ValueError(f"{out}: the output would replace the input's directory; give another "
                         "OUT")
    if not out.parent.resolve().is_dir():
        raise FileNotFoundError(errno.ENOENT, "No such directory (create it first)",
                                str(out.parent))
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise FileExistsError(errno.EEXIST, "already exists; pass --overwrite to replace it, or "
                              "give another OUT", str(out))
    if out.is_symlink() or not out.is_dir():
        raise ValueError(f"{out} is not a directory; --overwrite replaces only a directory this "
                         "command wrote. Remove it yourself or give another OUT")
    if any(out.iterdir()) and not (out / REPORT_FILE).is_file():
        raise ValueError(f"{out} is not empty and has no {REPORT_FILE}, so quantize-model did "
                         "not write it; --overwrite replaces only its own output. Remove it "
                         "yourself or give another OUT")


# --------------------------------------------------------------------------
# quantizing one layer


def _sqnr_db(W32, W_hat32, xp) -> float:
    signal = float(xp.sum(W32.astype(xp.float64) ** 2))
    noise = float(xp.sum((W32 - W_hat32).astype(xp.float64) ** 2))
    return float("inf") if noise == 0 else 10 * math.log10(signal / noise) if signal else 0.0


def _quantize_layer(name: str, W: np.ndarray, spec: WeightLayout, codebook: str, on_gpu: bool,
                    hessians) -> tuple:
    """``(KbitWeight, LayerReport)`` for host weight ``W``."""
    xp = np
    if on_gpu:
        import cupy as xp

        # bf16 goes up as float32: exact (FORMAT.md converts to float32 first),
        # and CuPy needs no bfloat16 support for it.
        W = xp.asarray(W.astype(np.float32) if W.dtype not in (np.float16, np.float32) else W)
    table = None
    if codebook == "fit":
        from .codebook import fit_codebook

        table = fit_codebook(W, spec.k, absmax_format=spec.absmax_format)
    H = hessians.lookup(name, spec.shape[1]) if hessians is not None else None
    if H is not None:
        weight = quantize_weight(W, spec.k, table, spec.absmax_format, method="gptq",
                                 hessian=xp.asarray(H))
    else:
        weight = quantize_weight(W, spec.k, table, spec.absmax_format)
    W32 = W.astype(xp.float32)
    sqnr = _sqnr_db(W32, weight.dequantize(np.float32), xp)
    bytes_out = sum(int(getattr(weight, part).nbytes) for part in WEIGHT_PARTS)
    report = LayerReport(name, spec.shape, str(W.dtype), spec.k, codebook,
                         "gptq" if H is not None else "rtn",
                         8 * bytes_out / math.prod(spec.shape), sqnr, int(W.nbytes), bytes_out)
    return weight, report


# --------------------------------------------------------------------------
# the output directory


@contextlib.contextmanager
def _building(out: Path):
    """A temporary directory next to ``out``, renamed to ``out`` if the block succeeds.

    On any exception (Ctrl-C and SIGTERM through the CLI included) it is
    removed and ``out`` is untouched. An existing ``out`` (checked by the
    caller) is moved aside, replaced, then deleted.
    """
    temp = out.parent / f".{out.name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}"
    temp.mkdir()
    try:
        yield temp
        if out.exists():
            old = out.parent / f".{out.name}.kbit-old-{os.getpid()}-{secrets.token_hex(4)}"
            os.replace(out, old)
            os.replace(temp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    with contextlib.suppress(OSError):  # make the rename durable where the platform allows
        fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _side_files(checkpoint: Checkpoint) -> tuple[list[Path], list[str]]:
    """(files to copy, names skipped with why) from the checkpoint's directory."""
    directory = checkpoint.shards[0].parent
    keep, skipped = [], []
    index_name = checkpoint.index.name if checkpoint.index is not None else None
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(".") or entry.name in (index_name, REPORT_FILE):
            continue
        if not entry.is_file():
            skipped.append(f"{entry.name}/ (a directory)" if entry.is_dir() else entry.name)
            continue
        if entry.suffix in _WEIGHT_SUFFIXES:
            if entry not in checkpoint.shards:
                skipped.append(f"{entry.name} (weights in another format)")
            continue
        if entry.stat().st_size > _MAX_COPIED_FILE_BYTES:
            skipped.append(f"{entry.name} (larger than {_MAX_COPIED_FILE_BYTES >> 20} MiB)")
            continue
        keep.append(entry)
    return keep, skipped


# --------------------------------------------------------------------------
# quantize-model


def quantize_model(source: str | os.PathLike, out: str | os.PathLike, *, k: int = 4,
                   codebook: str = "nf", absmax_format: str = "e4m4",
                   include: str | None = None, exclude: str | None = DEFAULT_EXCLUDE,
                   hessians: str | os.PathLike | None = None, overwrite: bool = False,
                   device: str | None = None, progress: bool = True) -> dict:
    """Quantize checkpoint ``source`` into directory ``out`` (see the module docstring).

    source : a ``.safetensors`` file, an index, or a directory
        (``serialization.find_checkpoint``).
    out : the output directory; must not exist unless ``overwrite``.
    k : 2..5. codebook : ``"nf"`` or ``"fit"`` (one per layer).
    absmax_format : ``"e4m4"`` or ``"fp16"``.
    include, exclude : regular expressions searched in tensor names
        (``None``: no filter); ``exclude`` defaults to embedding tables.
    hessians : a ``kbit_cupy.hessians`` file, or None.
    device : ``"gpu"``, ``"cpu"`` or None (the GPU when there is one).
    progress : a tqdm bar on stderr (shown only when stderr is a terminal).

    Returns ``{"layers": [LayerReport as dict], "copied": {reason: [names]},
    "totals": {...}, "files": [...], "skipped_files": [...], "settings": {...}}``,
    also written to ``out/kbit_quantize.json``.

    Raises FileNotFoundError for a missing input, shard (naming the index)
    or output parent; FileExistsError for an existing ``out`` without
    ``overwrite``; ValueError for bad arguments, a truncated or damaged
    shard, an inconsistent index, an already-quantized input, a layer the
    scale format cannot hold (E4M4 tops out at 31; ``absmax_format="fp16"``
    holds more) and what the writers raise; OSError from the disk. In every
    failing case ``out`` is as it was and no temporary is left.
    """
    if k not in (2, 3, 4, 5) or isinstance(k, bool):
        raise ValueError(f"k must be 2, 3, 4 or 5, got {k!r}")
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {CODEBOOKS}, got {codebook!r}")
    if absmax_format not in ABSMAX_FORMATS:
        raise ValueError(f"absmax_format must be one of {tuple(ABSMAX_FORMATS)}, "
                         f"got {absmax_format!r}")
    if device not in (None, "cpu", "gpu"):
        raise ValueError(f'device must be "cpu", "gpu" or None, got {device!r}')
    on_gpu = gpu_available() if device is None else device == "gpu"
    if on_gpu and not gpu_available():
        raise RuntimeError('device="gpu" needs CuPy and a CUDA GPU, and none was found')
    patterns = {}
    for option, text in (("include", include), ("exclude", exclude)):
        try:
            patterns[option] = re.compile(text) if text is not None else None
        except re.error as exc:
            raise ValueError(f"--{option} {text!r} is not a regular expression ({exc})") from None
    started = time.perf_counter()
    checkpoint = find_checkpoint(source)
    out = Path(out)
    _check_output(out, checkpoint, overwrite)
    plans, copied = _plan(checkpoint, k, absmax_format, patterns["include"], patterns["exclude"])
    side_files, skipped_files = _side_files(checkpoint)
    settings = {"source": os.fspath(source), "k": k, "codebook": codebook,
                "absmax_format": absmax_format, "include": include, "exclude": exclude,
                "hessians": os.fspath(hessians) if hessians is not None else None,
                "device": "gpu" if on_gpu else "cpu"}
    from .hessians import HessiansFile

    layers: list[LayerReport] = []
    weight_map: dict[str, str] = {}
    bytes_in = bytes_out = 0
    total = sum(len(plan.layout) for plan in plans)
    with contextlib.ExitStack() as stack:
        statistics = None
        if hessians is not None:
            statistics = stack.enter_context(HessiansFile(hessians))
            _check_statistics_match(statistics, plans)
        temp = stack.enter_context(_building(out))
        bar = stack.enter_context(_progress_bar(total, progress))
        for plan in plans:
            metadata = {key: value for key, value in plan.metadata.items()
                        if key != METADATA_KEY}
            metadata["kbit_cupy_source"] = plan.source.name
            with SafetensorsReader(plan.source) as reader, \
                    QuantizedWriter(temp / plan.output_name, plan.layout, metadata) as writer:
                for name, spec in plan.layout.items():
                    bar.set_postfix_str(name[-40:], refresh=False)
                    value = reader.read(name)
                    bytes_in += value.nbytes
                    if isinstance(spec, WeightLayout):
                        try:
                            value, report = _quantize_layer(name, value, spec, codebook, on_gpu,
                                                            statistics)
                        except ValueError as exc:
                            raise ValueError(f"{plan.source.name}: {name}: {exc}") from exc
                        layers.append(report)
                        tensors = spec.tensors(name)
                        bytes_out += report.bytes_out
                    else:
                        tensors = {name: None}
                        bytes_out += value.nbytes
                    writer.add(name, value)
                    del value
                    weight_map.update(dict.fromkeys(tensors, plan.output_name))
                    bar.update(1)
        if checkpoint.index is not None:
            index_metadata = {**checkpoint.index_metadata, "total_size": bytes_out}
            write_safetensors_index(temp / checkpoint.index.name, weight_map, index_metadata)
        for path in side_files:
            shutil.copyfile(path, temp / path.name)
        unused = ([name for name in statistics.names if name not in statistics.used]
                  if statistics is not None else [])
        quantized_params = sum(math.prod(r.shape) for r in layers)
        summary = {
            "settings": settings,
            "layers": [asdict(r) for r in layers],
            "copied": copied,
            "unused_hessians": unused,
            "files": sorted([plan.output_name for plan in plans] + [p.name for p in side_files]
                            + ([checkpoint.index.name] if checkpoint.index else [])
                            + [REPORT_FILE]),
            "skipped_files": skipped_files,
            "totals": {
                "quantized_layers": len(layers),
                "quantized_params": quantized_params,
                "bits_per_quantized_weight": (8 * sum(r.bytes_out for r in layers)
                                              / quantized_params if quantized_params else None),
                "copied_tensors": sum(len(names) for names in copied.values()),
                "bytes_in": bytes_in,
                "bytes_out": bytes_out,
                "seconds": time.perf_counter() - started,
            },
        }
        write_text(temp / REPORT_FILE, json.dumps(summary, indent=1, default=_json_number) + "\n")
    return summary


def _json_number(value):
    """inf SQNR (a weight that quantizes exactly) as a string: JSON has no infinity."""
    return str(value)


class _NoBar:
    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def _progress_bar(total: int, enabled: bool):
    """A tqdm bar over the tensors on stderr; nothing where stderr is not a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield _NoBar()
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="tensor", file=sys.stderr, dynamic_ncols=True) as bar:
        yield bar


def format_summary(summary: dict) -> str:
    """The per-layer table and the totals of ``quantize_model``'s result, as text."""
    layers, totals = summary["layers"], summary["totals"]
    width = max([len("layer")] + [len(r["name"]) for r in layers])
    header = f"{'layer':<{width}}  {'shape':>13}  k  {'bits/w':>6}  {'SQNR dB':>7}  codebook  method"
    lines = [header]
    for r in layers:
        shape = f"{r['shape'][0]}x{r['shape'][1]}"
        lines.append(f"{r['name']:<{width}}  {shape:>13}  {r['k']:>1}  "
                     f"{r['bits_per_weight']:>6.3f}  {r['sqnr_db']:>7.2f}  "
                     f"{r['codebook']:<8}  {r['method']}")
    lines.append("")
    if layers:
        sqnr = [r["sqnr_db"] for r in layers]
        lines.append(f"quantized {totals['quantized_layers']} layers, "
                     f"{totals['quantized_params']:,} weights at "
                     f"{totals['bits_per_quantized_weight']:.3f} bits/weight; SQNR "
                     f"{min(sqnr):.2f} to {max(sqnr):.2f} dB (mean {sum(sqnr) / len(sqnr):.2f})")
    else:
        lines.append("quantized no layer (check --include / --exclude)")
    for reason, names in summary["copied"].items():
        example = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
        lines.append(f"copied {len(names)} tensors bit for bit: {reason} ({example})")
    gptq = sum(r["method"] == "gptq" for r in layers)
    if summary["settings"]["hessians"] is not None:
        lines.append(f"GPTQ with statistics: {gptq} layers; round to nearest: "
                     f"{len(layers) - gptq}; statistics for no quantized weight: "
                     f"{len(summary['unused_hessians'])}")
    ratio = totals["bytes_in"] / totals["bytes_out"] if totals["bytes_out"] else float("nan")
    lines.append(f"{totals['bytes_in'] / 1e6:.2f} MB in, {totals['bytes_out'] / 1e6:.2f} MB out "
                 f"({ratio:.2f}x smaller), {totals['seconds']:.1f} s on the "
                 f"{summary['settings']['device'].upper()}")
    lines.append(f"wrote {', '.join(summary['files'])}")
    if summary["skipped_files"]:
        lines.append(f"not copied: {', '.join(summary['skipped_files'])}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# inspect


def inspect_model(path: str | os.PathLike) -> dict:
    """What a (quantized) checkpoint holds, from headers and codebooks only (no GPU).

    path : a file, an index or a directory (``find_checkpoint``).
    Returns ``{"files": [{"file", "metadata", "weights": [...], "arrays":
    [...]}], "totals": {...}}``: per quantized weight its name, shape, k,
    absmax format, codebook (``"nf"`` when it is ``create_normal_float_codebook(k)``,
    else ``"custom"``, and the values) and bytes; per plain tensor its name,
    dtype, shape and bytes. Raises what ``find_checkpoint`` and
    ``SafetensorsReader`` raise; ValueError for a damaged kbit_cupy document.
    """
    checkpoint = find_checkpoint(path)
    files = []
    totals = {"weights": 0, "weight_params": 0, "weight_bytes": 0, "arrays": 0,
              "array_bytes": 0}
    for shard in checkpoint.shards:
        with SafetensorsReader(shard) as reader:
            specs = reader.document()["weights"] if METADATA_KEY in reader.metadata else {}
            weights, parts = [], set()
            for name, spec in specs.items():
                tensors = {f"{name}.{part}" for part in WEIGHT_PARTS}
                parts |= tensors
                table = reader.read(f"{name}.codebook")
                nbytes = sum(math.prod(reader.info(t)[1]) * reader.info(t)[0].itemsize
                             for t in tensors)
                is_nf = (table.shape == (1 << spec["k"],) and np.array_equal(
                    table, create_normal_float_codebook(spec["k"])))
                weights.append({"name": name, "shape": spec["shape"], "k": spec["k"],
                                "absmax_format": spec["absmax_format"],
                                "codebook": "nf" if is_nf else "custom",
                                "codebook_values": table.tolist(), "bytes": nbytes})
                totals["weights"] += 1
                totals["weight_params"] += math.prod(spec["shape"])
                totals["weight_bytes"] += nbytes
            arrays = []
            for name in reader.names:
                if name in parts:
                    continue
                dtype, shape = reader.info(name)
                nbytes = math.prod(shape) * dtype.itemsize
                arrays.append({"name": name, "dtype": str(dtype), "shape": list(shape),
                               "bytes": nbytes})
                totals["arrays"] += 1
                totals["array_bytes"] += nbytes
            metadata = {key: value for key, value in reader.metadata.items()
                        if key != METADATA_KEY}
            files.append({"file": os.fspath(shard), "metadata": metadata, "weights": weights,
                          "arrays": arrays, "quantized": METADATA_KEY in reader.metadata})
    return {"index": os.fspath(checkpoint.index) if checkpoint.index else None,
            "files": files, "totals": totals}


def format_inspection(result: dict) -> str:
    """``inspect_model``'s result as text: per file its weights, arrays and metadata."""
    lines = []
    if result["index"]:
        lines.append(f"index {result['index']}: {len(result['files'])} shards")
    for f in result["files"]:
        kind = "kbit_cupy quantized" if f["quantized"] else "plain safetensors (not quantized)"
        lines.append(f"{f['file']}: {kind}")
        if f["weights"]:
            width = max(len(w["name"]) for w in f["weights"])
            lines.append(f"  {'weight':<{width}}  {'shape':>13}  k  scales  bits/w  "
                         f"{'bytes':>10}  codebook")
            for w in f["weights"]:
                shape = f"{w['shape'][0]}x{w['shape'][1]}"
                bits = 8 * w["bytes"] / math.prod(w["shape"])
                values = " ".join(f"{v:.3g}" for v in w["codebook_values"][:4])
                lines.append(f"  {w['name']:<{width}}  {shape:>13}  {w['k']}  "
                             f"{w['absmax_format']:<6}  {bits:6.3f}  {w['bytes']:>10}  "
                             f"{w['codebook']} [{values} ...]")
        if f["arrays"]:
            by_dtype: dict[str, list] = {}
            for a in f["arrays"]:
                by_dtype.setdefault(a["dtype"], []).append(a)
            kinds = ", ".join(f"{len(v)} {dtype} ({sum(a['bytes'] for a in v):,} bytes)"
                              for dtype, v in by_dtype.items())
            lines.append(f"  plain tensors: {kinds}")
            for a in f["arrays"][:8]:
                lines.append(f"    {a['name']}  {a['dtype']} {a['shape']}")
            if len(f["arrays"]) > 8:
                lines.append(f"    ... {len(f['arrays']) - 8} more")
        for key, value in f["metadata"].items():
            lines.append(f"  metadata {key}: {value[:200]}")
    t = result["totals"]
    bits = 8 * t["weight_bytes"] / t["weight_params"] if t["weight_params"] else 0.0
    lines.append(f"total: {t['weights']} quantized weights ({t['weight_params']:,} weights, "
                 f"{t['weight_bytes']:,} bytes, {bits:.3f} bits/weight), {t['arrays']} plain "
                 f"tensors ({t['array_bytes']:,} bytes)")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# command line


def cmd_quantize_model(args) -> int:
    """Quantize a safetensors checkpoint (file, shards + index, or directory) into a directory."""
    summary = quantize_model(
        args.source, args.out, k=args.k, codebook=args.codebook, absmax_format=args.scales,
        include=args.include, exclude=args.exclude, hessians=args.hessians,
        overwrite=args.overwrite, device="cpu" if args.cpu else None)
    print(format_summary(summary))
    return 0


def cmd_inspect(args) -> int:
    """What a quantized file, index or directory holds (layers, k, codebooks, bytes, metadata)."""
    result = inspect_model(args.path)
    print(json.dumps(result, indent=1) if args.json else format_inspection(result))
    return 0


def add_commands(sub) -> None:
    """Add quantize-model and inspect to ``sub`` (``ArgumentParser.add_subparsers``)."""
    p = sub.add_parser("quantize-model", help=cmd_quantize_model.__doc__)
    p.add_argument("source", metavar="IN",
                   help="model.safetensors, model.safetensors.index.json or their directory")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist)")
    p.add_argument("--k", type=int, default=4, choices=[2, 3, 4, 5], help="bits per weight")
    p.add_argument("--codebook", choices=CODEBOOKS, default="nf",
                   help="normal-float codebook, or one fitted per layer")
    p.add_argument("--scales", choices=list(ABSMAX_FORMATS), default="e4m4",
                   help="block scale format")
    p.add_argument("--include", default=None, metavar="REGEX",
                   help="quantize only weights whose name matches")
    p.add_argument("--exclude", default=DEFAULT_EXCLUDE, metavar="REGEX",
                   help=f"keep weights whose name matches as they are (default {DEFAULT_EXCLUDE!r}"
                   ", embedding tables; --exclude '^$' excludes nothing)")
    p.add_argument("--hessians", default=None, metavar="FILE",
                   help="calibration statistics (kbit_cupy.hessians.save_hessians): GPTQ for "
                   "the layers they cover")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is an earlier output of this command")
    p.add_argument("--cpu", action="store_true", help="the NumPy path even with a GPU")
    p.set_defaults(func=cmd_quantize_model)
    p = sub.add_parser("inspect", help=cmd_inspect.__doc__)
    p.add_argument("path", metavar="FILE", help="a .safetensors file, an index or a directory")
    p.add_argument("--json", action="store_true", help="the full result as JSON")
    p.set_defaults(func=cmd_inspect)


__all__ = ["LayerReport", "format_inspection", "format_summary", "inspect_model",
           "quantize_model"]
