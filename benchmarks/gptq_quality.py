"""Calibrated quantization (GPTQ and its additions) against RTN on all-MiniLM-L6-v2.

Usage: python benchmarks/gptq_quality.py [--ks 2,3,4,5] [--out DIR] [--commit HASH]

Every encoder linear weight (36) is quantized, then the 134 sentences of
examples/sentences.txt are embedded and compared with sentence-transformers'
fp32 embeddings of them (tests/data/minilm_reference_embeddings.npz, an H100
run): the mean cosine over the sentences, as in benchmarks/minilm_compare.py.
Calibration statistics come from examples/calibration_sentences.txt, which
shares no sentence with the evaluation set. Rows, per k = 2..5:

- RTN nf / RTN fit: round to nearest, NF codebook / one codebook fitted to
  all 36 weights (what ``MiniLM.quantized`` does today);
- GPTQ: error compensation, NF codebook, statistics of the fp16 model;
- + scale search: each block's scale searched below its absmax;
- + fitted codebook: codebook fitted per weight (RTN fit as the start) and
  refitted jointly with the GPTQ passes;
- + sequential: as the previous, each encoder layer's statistics through the
  already-quantized layers before it.

Then mixed widths (k = 2..5 per layer) at average budgets of bits per weight,
from the "+ fitted codebook" weights of every k, allocated three ways:

- H-error: ``allocate_bits`` on each layer's relative H-weighted error (its
  output noise-to-signal), the per-layer measure of ``quantize_mixed``;
- embedding sensitivity: ``allocate_bits`` on each layer's own effect on the
  final embeddings (1 - mean cosine to the float16 model's embeddings of
  calibration sentences with only that layer quantized at k);
- embedding search: ``search_allocation`` on the same sensitivities, the
  allocations measured as a whole on the calibration sentences, starting from
  the better of uniform k and the previous row, moving layers up and down while
  the measured loss falls (so never worse there than uniform k).

The sensitivities and the search use the first ``--search-sentences`` (96)
calibration sentences, with dequantized float32 weights (``EmbeddingLoss``);
evaluation sentences are never used to choose.
Each row also gives the H-weighted error over all layers relative to RTN with
the same starting codebook, and the quantization time on this CPU. Writes
``gptq_quality_minilm_<commit>.json`` and ``.md`` to ``--out``. NumPy path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

import kbit_cupy
from kbit_cupy.calibrate import allocate_bits, bits_per_weight, search_allocation

REFERENCE = REPO / "tests" / "data" / "minilm_reference_embeddings.npz"
TARGETS = {"k=4": 0.982, "k=3": 0.915, "mixed 4.25": 0.985, "mixed 3.25": 0.93}
BUDGETS = (2.5, 3.25, 4.25)
# the "+ fitted codebook" step, the base of the sequential row and of mixed widths
BEST = {"scale_search": True, "fit_codebook": True, "codebook": "fit"}


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="2,3,4,5")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--commit")
    ap.add_argument("--search-sentences", type=int, default=96,
                    help="calibration sentences for the mixed-width sensitivities and search")
    args = ap.parse_args()
    commit = args.commit or _commit()
    ks = [int(k) for k in args.ks.split(",")]

    reference = np.load(REFERENCE)
    sentences = str(reference["sentences"]).split("\n")
    expected = reference["embeddings"]
    calibration = minilm.calibration_sentences()
    assert not set(calibration) & set(sentences), "calibration and evaluation sets overlap"
    model = minilm.load_minilm(xp=np)
    start = time.perf_counter()
    hessians = minilm.collect_hessians(model, calibration)
    stats_seconds = time.perf_counter() - start
    tokens = next(iter(hessians.values())).count
    print(f"{len(calibration)} calibration sentences ({tokens} tokens), {stats_seconds:.1f} s; "
          f"{len(sentences)} evaluation sentences", flush=True)

    rows = []

    def measure(label: str, k, quantized, seconds: float, reports=None, **extra) -> dict:
        cosines = (quantized.encode(sentences) * expected).sum(axis=1)
        row = {"config": label, "k": k, "mean_cos": float(cosines.mean()),
               "min_cos": float(cosines.min()), "quantize_seconds": seconds, **extra}
        if reports:
            row["h_error_vs_rtn"] = (sum(r.error for r in reports.values())
                                     / sum(r.rtn_error for r in reports.values()))
            row["rtn_kept"] = sum(r.chosen == "rtn" for r in reports.values())
        rows.append(row)
        ratio = f", H-error x{row['h_error_vs_rtn']:.3f} of RTN" if reports else ""
        print(f"{label}: mean cos {row['mean_cos']:.4f} (min {row['min_cos']:.4f}){ratio}, "
              f"{seconds:.1f} s", flush=True)
        return row

    def timed(fn):
        begin = time.perf_counter()
        value = fn()
        return value, time.perf_counter() - begin

    best_reports = {}
    best_weights = {}
    for k in ks:
        for codebook in ("nf", "fit"):
            quantized, seconds = timed(lambda c=codebook, k=k: model.quantized(k, codebook=c))
            measure(f"k={k} RTN {codebook}", k, quantized, seconds)
        steps = [("GPTQ", {}), ("GPTQ + scale search", {"scale_search": True}),
                 ("GPTQ + scale search + fitted codebook", BEST)]
        for label, options in steps:
            (quantized, reports), seconds = timed(lambda o=options, k=k: minilm.calibrated(
                model, k, calibration, hessians=hessians, **o))
            measure(f"k={k} {label}", k, quantized, seconds, reports)
        best_reports[k] = reports
        best_weights[k] = {n: lin.weight for n, lin in quantized.linears.items()}
        (quantized, reports), seconds = timed(lambda k=k: minilm.calibrated(
            model, k, calibration, sequential=True, **BEST))
        measure(f"k={k} GPTQ + scale search + fitted codebook + sequential", k, quantized,
                seconds, reports)

    if len(ks) > 1:
        sizes = {n: int(w.size) for n, w in model.source_weights.items()}
        signal = {n: kbit_cupy.hessian_error(w.astype(np.float32), np.zeros(w.shape, np.float32),
                                             hessians[n]) for n, w in model.source_weights.items()}
        h_errors = {n: {k: best_reports[k][n].error / signal[n] for k in ks} for n in sizes}
        begin = time.perf_counter()
        loss = minilm.EmbeddingLoss(model, calibration[:args.search_sentences])
        dequantized = {k: {n: w.dequantize(np.float32) for n, w in best_weights[k].items()}
                       for k in ks}
        sensitivity = {n: {k: loss({n: dequantized[k][n]}) for k in ks} for n in sizes}
        sensitivity_seconds = time.perf_counter() - begin
        print(f"embedding sensitivities: {loss.evaluations} evaluations, "
              f"{sensitivity_seconds:.1f} s", flush=True)

        def evaluate(alloc):
            return loss({n: dequantized[alloc[n]][n] for n in alloc})

        def mixed_row(label, alloc, seconds, budget, **extra):
            linears = {n: minilm.Linear(best_weights[alloc[n]][n], model.linears[n].bias)
                       for n in sizes}
            quantized = minilm.MiniLM(model.config, model.tokenizer, np, model.params, linears,
                                      model.source_weights)
            used = sum(sizes[n] * bits_per_weight(alloc[n]) for n in sizes) / sum(sizes.values())
            counts = {k: sum(v == k for v in alloc.values()) for k in ks}
            measure(label, None, quantized, seconds,
                    {n: best_reports[alloc[n]][n] for n in sizes}, budget=budget,
                    bits_per_weight=used, allocation=alloc, layers_per_k=counts,
                    calibration_loss=evaluate(alloc), **extra)

        for budget in BUDGETS:
            if budget < bits_per_weight(min(ks)):
                continue
            mixed_row(f"mixed {budget} (H-error)", allocate_bits(h_errors, sizes, budget), 0.0,
                      budget)
            mixed_row(f"mixed {budget} (embedding sensitivity)",
                      allocate_bits(sensitivity, sizes, budget), sensitivity_seconds, budget)
            begin, count = time.perf_counter(), loss.evaluations
            alloc, search = search_allocation(sensitivity, sizes, budget, evaluate)
            search = {**search, "evaluations": loss.evaluations - count}
            mixed_row(f"mixed {budget} (embedding search)", alloc,
                      sensitivity_seconds + time.perf_counter() - begin, budget, search=search)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gptq_quality_minilm_{commit}"
    results = {"commit": commit, "model": "sentence-transformers/all-MiniLM-L6-v2",
               "evaluation": f"{len(sentences)} sentences of examples/sentences.txt, mean cosine "
                             "to sentence-transformers fp32 embeddings",
               "calibration": f"{len(calibration)} sentences of "
                              f"examples/calibration_sentences.txt, {tokens} tokens",
               "hessian_seconds": stats_seconds, "absmax_format": "e4m4",
               "machine": f"{platform.processor() or platform.machine()}, "
                          f"{os.cpu_count()} CPUs, NumPy {np.__version__}",
               "targets": TARGETS, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    stem.with_suffix(".md").write_text(_markdown(results))
    print(f"wrote {stem}.json/.md")


def _markdown(results: dict) -> str:
    lines = [
        f"# Calibrated quantization on all-MiniLM-L6-v2, commit {results['commit']}",
        "",
        (f"Evaluation: {results['evaluation']}. Calibration: {results['calibration']} "
         f"(disjoint). E4M4 scales (k + 0.25 bits per weight). NumPy path on "
         f"{results['machine']}."),
        "",
        ("H-error: the H-weighted output error of all 36 layers against RTN with the same "
         "starting codebook (lower is better); RTN kept: layers where the guard kept RTN."),
        "",
        "| config | bits/weight | mean cos | min cos | H-error vs RTN | RTN kept | quantize s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        bits = r.get("bits_per_weight") or (r["k"] + 0.25)
        h = f"{r['h_error_vs_rtn']:.3f}" if "h_error_vs_rtn" in r else ""
        kept = str(r.get("rtn_kept", ""))
        lines.append(f"| {r['config']} | {bits:.3f} | {r['mean_cos']:.4f} | {r['min_cos']:.4f} | "
                     f"{h} | {kept} | {r['quantize_seconds']:.1f} |")
    mixed = [r for r in results["rows"] if "allocation" in r]
    if mixed:
        lines += ["", ("Mixed-width allocations (layers per k; calibration loss: 1 - mean cosine "
                       "to the float16 model on the search sentences, what the search "
                       "minimises):"), ""]
        for r in mixed:
            line = (f"- {r['config']}: {r['layers_per_k']}, {r['bits_per_weight']:.3f} "
                    f"bits/weight, calibration loss {r['calibration_loss']:.5f}")
            if "search" in r:
                starts = ", ".join(f"{k} {v:.5f}" for k, v in r["search"]["starts"].items())
                line += (f"; search: starts {starts}, {len(r['search']['moves'])} moves kept, "
                         f"{r['search']['evaluations']} evaluations")
            lines.append(line)
    lines += ["", "Targets (issue 19): " + ", ".join(f"{k} >= {v}"
                                                     for k, v in results["targets"].items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
