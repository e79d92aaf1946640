"""Figures from ``bench`` results (JSON written by ``python -m kbit_cupy bench --out``).

Needs matplotlib (``pip install "kbit-cupy[plot]"``); works without a GPU, so
committed results under ``benchmarks/results/`` can be plotted anywhere:
``python -m kbit_cupy plot benchmarks/results/gemm_sweep_h100_*.json``.
"""

from __future__ import annotations

import json
from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            'plotting needs matplotlib: pip install "kbit-cupy[plot]" (or pip install matplotlib)'
        ) from exc
    return plt


def _where(meta: dict) -> str:
    return f"{meta.get('gpu', '?')}, commit {meta.get('commit', '?')}"


def _save(plt, fig, path) -> Path:
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def load(path) -> tuple[list[dict], dict]:
    """(records, meta) of a results JSON file."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "records" not in data:
        raise ValueError(f"{path} is not a kbit_cupy results file (no 'records')")
    return data["records"], data.get("meta", {})


def _best_by_point(records: list[dict]) -> dict:
    """{(K_dim, N, dtype, k, M): fastest kbit record} and cuBLAS times under k=16."""
    best: dict = {}
    for r in records:
        key = (r["K_dim"], r["N"], r.get("dtype", "float16"), r["k"], r["M"])
        if key not in best or r["time_us"] < best[key]["time_us"]:
            best[key] = r
    return best


def plot_speedup(records: list[dict], meta: dict, path) -> Path:
    """Speedup over cuBLAS fp16 against M, one panel per layer, one line per k."""
    plt = _pyplot()
    best = _best_by_point(records)
    layers = sorted({(k[0], k[1], k[2]) for k in best})
    cols = min(4, len(layers))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(layers):]:
        ax.set_visible(False)
    for ax, (K_dim, N, dtype) in zip(axes.flat, layers):
        for k in sorted({key[3] for key in best if key[:3] == (K_dim, N, dtype) and key[3] != 16}):
            ms = sorted(key[4] for key in best if key[:4] == (K_dim, N, dtype, k))
            ax.plot(ms, [best[(K_dim, N, dtype, k, m)]["speedup"] for m in ms], marker="o",
                    label=f"k={k}")
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows of A)")
        ax.set_title(f"{K_dim}x{N} ({dtype})")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("speedup vs cuBLAS fp16")
    axes.flat[len(layers) - 1].legend()
    fig.suptitle(f"kbit_gemm, best kernel per point - {_where(meta)}")
    return _save(plt, fig, path)


def plot_roofline(records: list[dict], meta: dict, path) -> Path:
    """Achieved TFLOP/s against arithmetic intensity on our bytes, with the measured ceilings.

    Ceilings: the copy bandwidth measured in the same run (a line of slope
    1) and the best cuBLAS fp16 rate in the results (a flat line).
    """
    plt = _pyplot()
    bw = float(meta.get("copy_bandwidth_TB_s") or 3.0) * 1e12
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    peak = max((r["TFLOP_s"] for r in records if r["k"] == 16), default=0.0)
    best = list(_best_by_point(records).values())  # the fastest kernel at each point
    for k in sorted({r["k"] for r in best}):
        pts = [r for r in best if r["k"] == k]
        x = [2.0 * r["M"] * r["N"] * r["K_dim"] / (r["GB_s"] * 1e9 * r["time_us"] * 1e-6) for r in pts]
        y = [r["TFLOP_s"] for r in pts]
        ax.scatter(x, y, s=12, label="cuBLAS fp16" if k == 16 else f"k={k}")
    xs = [2.0**e for e in range(-2, 12)]
    ax.plot(xs, [min(bw * x / 1e12, peak or 1e9) for x in xs], color="black", lw=1,
            label=f"copy {bw / 1e12:.2f} TB/s / cuBLAS peak {peak:.0f} TFLOP/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("FLOP per byte moved (weights + scales + A + C)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(f"roofline - {_where(meta)}")
    return _save(plt, fig, path)


def plot_results(paths, out_dir) -> list[Path]:
    """Both figures for each results file, written next to each other in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for p in paths:
        records, meta = load(p)
        stem = Path(p).stem
        written.append(plot_speedup(records, meta, out_dir / f"{stem}_speedup.png"))
        written.append(plot_roofline(records, meta, out_dir / f"{stem}_roofline.png"))
    return written
