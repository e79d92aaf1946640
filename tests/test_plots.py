"""bench figures from results JSON, without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kbit_cupy.__main__ import main

pytest.importorskip("matplotlib")
from kbit_cupy.bench.plots import load, plot_results, plot_roofline, plot_speedup

RESULTS = sorted(Path(__file__).parent.parent.glob("benchmarks/results/gemm_sweep_h100_*_float16.json"))


def synthetic_records():
    recs = []
    for M in (1, 16, 64):
        base = 100.0
        recs.append({"K_dim": 4096, "N": 4096, "M": M, "k": 16, "kernel": "cublas", "dtype": "float16",
                     "time_us": base, "speedup": 1.0, "GB_s": 340.0, "copy_frac": 0.11,
                     "TFLOP_s": 2 * M * 4096 * 4096 / base / 1e6})
        for k in (2, 4):
            t = base / (4 - k / 2) * (1 + M / 32)
            recs.append({"K_dim": 4096, "N": 4096, "M": M, "k": k, "kernel": "mma", "dtype": "float16",
                         "time_us": t, "speedup": base / t, "GB_s": 100.0, "copy_frac": 0.03,
                         "TFLOP_s": 2 * M * 4096 * 4096 / t / 1e6})
    return recs


def test_figures_from_synthetic_records(tmp_path):
    meta = {"gpu": "test", "commit": "abc", "copy_bandwidth_TB_s": 3.0}
    for fn in (plot_speedup, plot_roofline):
        out = fn(synthetic_records(), meta, tmp_path / f"{fn.__name__}.png")
        assert out.stat().st_size > 10_000
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not RESULTS, reason="no committed sweep results")
def test_plot_command_on_committed_results(tmp_path, capsys):
    assert main(["plot", str(RESULTS[-1]), "--out-dir", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(pngs) == 2 and all(p.startswith(RESULTS[-1].stem) for p in pngs)
    assert "wrote" in capsys.readouterr().out


def test_load_rejects_other_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="records"):
        load(bad)


def test_plot_results_writes_two_per_file(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"records": synthetic_records(), "meta": {"gpu": "g"}}))
    assert len(plot_results([f], tmp_path / "figs")) == 2


def _drawn_figures(monkeypatch):
    """Figures the plot functions would save, drawn but left open for inspection."""
    from kbit_cupy.bench import plots

    figures = []

    def keep(plt, fig, path):
        fig.draw_without_rendering()
        figures.append(fig)
        return Path(path)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def test_titles_fit_inside_a_one_panel_figure(monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    figures = _drawn_figures(monkeypatch)
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "commit": "e2b299f", "copy_bandwidth_TB_s": 3.0}
    plot_speedup(synthetic_records(), meta, tmp_path / "s.png")  # one layer: one 4.2-inch panel
    plot_roofline(synthetic_records(), meta, tmp_path / "r.png")
    try:
        for fig in figures:
            renderer = fig.canvas.get_renderer()
            titles = [t for t in [fig._suptitle, *(ax.title for ax in fig.axes)] if t and t.get_text()]
            for title in titles:
                box = title.get_window_extent(renderer)
                assert box.x0 >= 0 and box.x1 <= fig.bbox.width, title.get_text()
                assert box.y1 <= fig.bbox.height, title.get_text()
    finally:
        for fig in figures:
            plt.close(fig)


def test_roofline_labels_the_cublas_line_as_this_runs_best(monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    figures = _drawn_figures(monkeypatch)
    plot_roofline(synthetic_records(), {"gpu": "g"}, tmp_path / "r.png")
    labels = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    plt.close(figures[0])
    ceiling = next(label for label in labels if "TB/s" in label)
    best = max(r["TFLOP_s"] for r in synthetic_records() if r["k"] == 16)
    assert "best cuBLAS rate in this run" in ceiling and f"{best:.0f} TFLOP/s" in ceiling
    assert "peak" not in ceiling.replace("not the GPU's peak", "")
    assert "assumed" in ceiling  # no copy_bandwidth_TB_s in meta
