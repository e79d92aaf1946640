"""Figures from ``bench`` results (JSON written by ``python -m kbit_cupy bench --out``).

Needs matplotlib (``pip install "kbit-cupy[plot]"``); works without a GPU, so
committed results under ``benchmarks/results/`` can be plotted anywhere:
``python -m kbit_cupy plot benchmarks/results/gemm_sweep_h100_*.json``.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from .._files import atomic_write

# What every bench record must carry for the figures (numbers; speedup for k != 16).
RECORD_KEYS = ("K_dim", "N", "M", "k", "time_us", "GB_s", "TFLOP_s")
_FIX = "give a results JSON file written by python -m kbit_cupy bench --out PREFIX"


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


def _wrapped_title(lines: list[str], fig) -> str:
    """``lines`` joined by newlines, each wrapped to the figure's width.

    Matplotlib's layout engines make room above the axes for a long title but
    never narrow it, so a one-panel figure cut the title at both edges; about
    ten characters of the default 12 pt title font fit per inch.
    """
    chars = max(24, int(fig.get_figwidth() * 10))
    return "\n".join(textwrap.fill(line, chars) for line in lines)


def _save(plt, fig, path) -> Path:
    """Write ``fig`` (made with ``layout="constrained"``) to ``path`` atomically.

    The format comes from the suffix, PNG if none.
    """
    out = Path(path)
    try:
        with atomic_write(out) as f:
            fig.savefig(f, dpi=120, format=out.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return out


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_record(path, index: int, record) -> None:
    # A record of the wrong type is a bad file (a value), not a caller's TypeError.
    if not isinstance(record, dict):
        raise ValueError(  # noqa: TRY004
            f"{path}: record {index} is a {type(record).__name__}, not an object; {_FIX}")
    needed = RECORD_KEYS + (("speedup",) if record.get("k") != 16 else ())
    bad = [key for key in needed if not _is_number(record.get(key))]
    if bad:
        raise ValueError(f"{path}: record {index} lacks numbers for {bad}; {_FIX}")
    if record["time_us"] <= 0 or record["GB_s"] <= 0:
        raise ValueError(f"{path}: record {index} has time_us {record['time_us']} and GB_s "
                         f"{record['GB_s']}; both must be > 0; {_FIX}")


def load(path) -> tuple[list[dict], dict]:
    """(records, meta) of a results JSON file.

    Raises ValueError naming ``path`` for an empty file, one that is not JSON,
    not a results object, has no records or a record without the numbers the
    figures need (``RECORD_KEYS``, and ``speedup`` for k != 16); OSError if it
    cannot be read.
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"{path} is empty; {_FIX}")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path} is not JSON ({exc}); {_FIX}") from None
    if not isinstance(data, dict) or "records" not in data:
        raise ValueError(f"{path} is not a kbit_cupy results file (no 'records'); {_FIX}")
    records, meta = data["records"], data.get("meta", {})
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path} has no records (an empty or interrupted run?); {_FIX}")
    if not isinstance(meta, dict):
        raise ValueError(  # noqa: TRY004
            f"{path}: 'meta' is a {type(meta).__name__}, not an object; {_FIX}")
    for index, record in enumerate(records):
        _check_record(path, index, record)
    return records, meta


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
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False,
                             layout="constrained")
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
    if axes.flat[len(layers) - 1].get_legend_handles_labels()[0]:  # cuBLAS-only: no lines
        axes.flat[len(layers) - 1].legend()
    fig.suptitle(_wrapped_title(["kbit_gemm speedup over cuBLAS fp16, best kernel per point",
                                 _where(meta)], fig))
    return _save(plt, fig, path)


def plot_roofline(records: list[dict], meta: dict, path) -> Path:
    """Achieved TFLOP/s against arithmetic intensity on our bytes, with two ceilings.

    Ceilings: the copy bandwidth measured in the same run (a line of slope 1;
    3 TB/s, marked "assumed", when the results lack it) and the best cuBLAS
    fp16 rate among the run's own records (a flat line). The latter is not the
    GPU's peak: a sweep that stops at M = 256 stays well below it, so the
    legend says which point it came from.
    """
    plt = _pyplot()
    measured_bw = _is_number(meta.get("copy_bandwidth_TB_s")) and meta["copy_bandwidth_TB_s"] > 0
    bw = (float(meta["copy_bandwidth_TB_s"]) if measured_bw else 3.0) * 1e12
    fig, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    cublas = [r for r in records if r["k"] == 16]
    best_cublas = max(cublas, key=lambda r: r["TFLOP_s"], default=None)
    best = list(_best_by_point(records).values())  # the fastest kernel at each point
    for k in sorted({r["k"] for r in best}):
        pts = [r for r in best if r["k"] == k]
        x = [2.0 * r["M"] * r["N"] * r["K_dim"] / (r["GB_s"] * 1e9 * r["time_us"] * 1e-6) for r in pts]
        y = [r["TFLOP_s"] for r in pts]
        ax.scatter(x, y, s=12, label="cuBLAS fp16" if k == 16 else f"k={k}")
    xs = [2.0**e for e in range(-2, 12)]
    copy_label = f"copy {bw / 1e12:.2f} TB/s" + ("" if measured_bw else " (assumed, not in results)")
    if best_cublas is None:
        ax.plot(xs, [bw * x / 1e12 for x in xs], color="black", lw=1, label=copy_label)
    else:
        flat = best_cublas["TFLOP_s"]
        where = f"M={best_cublas['M']}, {best_cublas['K_dim']}x{best_cublas['N']}"
        ax.plot(xs, [min(bw * x / 1e12, flat) for x in xs], color="black", lw=1,
                label=f"{copy_label} / best cuBLAS rate in this run\n"
                      f"{flat:.0f} TFLOP/s ({where}), not the GPU's peak")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("FLOP per byte moved (weights + scales + A + C)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(_wrapped_title([f"roofline - {_where(meta)}"], fig))
    return _save(plt, fig, path)


def plot_results(paths, out_dir) -> list[Path]:
    """Both figures for each results file, written next to each other in ``out_dir``.

    Every file is read and checked before anything is drawn. Raises ValueError
    if ``out_dir`` is an existing file, plus what ``load`` raises.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"the output directory {out_dir} is a file; give a directory "
                         "(it is created if missing)")
    loaded = [(p, *load(p)) for p in paths]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for p, records, meta in loaded:
        stem = Path(p).stem
        written.append(plot_speedup(records, meta, out_dir / f"{stem}_speedup.png"))
        written.append(plot_roofline(records, meta, out_dir / f"{stem}_roofline.png"))
    return written
