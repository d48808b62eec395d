"""The comparison plots read cleanly: log loss axes labelled in plain numbers (never 5.45x10^0), short panel titles,
and no empty panel where a metric is n/a (left out, and named under the figure). Hand-made run directories
(tests/test_analysis_loading.write_run), no training."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from dflash_lab.analysis import compare_records, load_runs, plots  # noqa: E402
from helpers import write_run  # noqa: E402  (tests/ is on sys.path)


@pytest.fixture
def comparison_inputs(tmp_path):
    root = tmp_path / "sweep"
    for job, (sampler, seed) in enumerate([("full_random", 0), ("full_random", 1), ("bucketed", 0), ("bucketed", 1)]):
        write_run(root / f"{job}_{sampler}_s{seed}", sampler, seed, steps=60)
    records = load_runs([root]).runs
    return records, compare_records(records)


def _figures_of(monkeypatch):
    """Keep every figure a plot function saves (plots close them after saving)."""
    kept = []
    real_save = plots._save

    def keep(fig, path):
        fig.canvas.draw()   # tick labels exist only once drawn
        kept.append(fig)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    return kept, real_save


def test_every_plot_has_plain_tick_labels_and_no_empty_panel(comparison_inputs, tmp_path, monkeypatch):
    records, comparison = comparison_inputs
    figures, _ = _figures_of(monkeypatch)
    written = plots.write_all_plots(records, comparison, tmp_path / "plots")
    assert [p.name for p in written] == list(plots.PLOT_FILES) and all(p.stat().st_size > 0 for p in written)
    for figure in figures:
        for ax in figure.axes:
            assert ax.axison, "an axis left switched off: a blank panel"
            assert ax.lines or ax.patches or ax.collections, f"an empty panel: {ax.get_title()!r}"
            labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)]
            assert not [t for t in labels if "times" in t or "×" in t or "^" in t], labels
            assert len(ax.get_title()) <= 48, ax.get_title()
        plt.close(figure)


def test_na_metrics_are_left_out_and_named_not_drawn_as_blank_panels(comparison_inputs, tmp_path, monkeypatch):
    records, comparison = comparison_inputs
    figures, _ = _figures_of(monkeypatch)
    plots.plot_metric_bars(comparison, tmp_path / "before.png")
    before = [ax.get_title() for ax in figures.pop().axes]
    assert "band forgetting F_b" in before
    comparison.groups["band_forgetting_mean"] = float("nan")   # as for runs without probes
    plots.plot_metric_bars(comparison, tmp_path / "after.png")
    (figure,) = figures
    titles = [ax.get_title() for ax in figure.axes]
    assert titles == [t for t in before if t != "band forgetting F_b"]
    note = " ".join(t.get_text() for t in figure.texts)
    assert note.startswith("n/a (nothing to draw):") and "band forgetting F_b" in note
