"""Comparison plots (matplotlib, Agg backend, PNG): loss curves (per step, real token and second), per-band probe
accuracy, per-band probe loss per arm with the step's bucket shaded, per-arm metric bars, the
throughput trade-off (one point per setting) and probe loss on the three compute axes. Each function takes the
loaded records / comparison tables and a path, draws one figure, and returns the path; a figure with nothing to
draw says so on the canvas instead of failing. Colours follow the arm (setting), the same in every plot.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: CI and Slurm nodes have no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from dflash_lab.analysis.budgets import AXES  # noqa: E402
from dflash_lab.analysis.schema import RunRecord  # noqa: E402
from dflash_lab.analysis.summarize import Comparison  # noqa: E402
from dflash_lab.metrics.jumpiness import ema  # noqa: E402


def _colours(labels: list[str]) -> dict[str, tuple]:
    """One colour per arm label, in name order (tab10, or tab20 beyond 10 arms)."""
    names = sorted(set(labels))
    palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {name: palette(i % palette.N) for i, name in enumerate(names)}


def _arm(record: RunRecord, arms: dict[str, str] | None) -> str:
    return (arms or {}).get(record.run_id) or record.sampler or "unknown"


def _empty(ax: plt.Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _plain_log_y(ax: plt.Axes) -> None:
    """A log y axis labelled in plain numbers (2, 3, 5, 10, 20, ...), never ``5.45x10^0``: a loss axis spans less
    than a decade, where matplotlib's default labels only minor ticks, in scientific notation."""
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_locator(ticker.LogLocator(subs=(2.0, 3.0, 5.0)))
    ax.yaxis.set_minor_formatter(plain)


def _drawable_grid(count: int, columns: int, panel_size: tuple[float, float], **kwargs) -> tuple[plt.Figure, list]:
    """A figure of ``count`` panels (at most ``columns`` a row), no empty cells: panels with nothing to draw are
    left out by the caller and named under the figure (:func:`_note_missing`)."""
    columns = max(1, min(count, columns))
    rows = max(1, int(np.ceil(count / columns)))
    fig, axes = plt.subplots(rows, columns, figsize=(panel_size[0] * columns, panel_size[1] * rows), squeeze=False,
                             **kwargs)
    flat = list(axes.flat)
    for ax in flat[count:]:
        fig.delaxes(ax)
    return fig, flat[:count]


def _note_missing(fig: plt.Figure, missing: list[str]) -> None:
    """Name the panels left out for lack of data, under the figure."""
    if missing:
        fig.text(0.01, 0.005, "n/a (nothing to draw): " + "; ".join(missing), fontsize=7, ha="left", va="bottom")


def _legend(ax: plt.Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0.03, 1, 1))   # room for the n/a note under the panels
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


LOSS_AXES = (("step", "optimizer step"), ("tokens_seen", "real tokens seen"), ("wall_s", "wall-clock s (training)"))


def _loss_axes(steps: pd.DataFrame) -> pd.DataFrame:
    """The training steps with the x axes of the loss plots: step, cumulative real tokens, cumulative step time."""
    steps = steps.dropna(subset=["step", "loss"]).sort_values("step")

    def cumulative(column: str) -> pd.Series:
        if column not in steps.columns:
            return pd.Series(np.nan, index=steps.index)
        return pd.to_numeric(steps[column], errors="coerce").cumsum()

    return steps.assign(tokens_seen=cumulative("real_tokens"), wall_s=cumulative("step_time_s"))


def plot_loss_curves(records: list[RunRecord], path: Path, arms: dict[str, str] | None = None,
                     smooth_alpha: float = 0.1) -> Path:
    """Training loss against optimizer steps, real tokens seen and training wall-clock, every run overlaid
    (EMA-smoothed, faint raw), one colour per arm: a policy that looks worse per step may be ahead per token or
    per second.

    Args:
        arms: run_id -> arm label (`comparison.runs`); default: the sampler.
    """
    fig, axes = plt.subplots(1, len(LOSS_AXES), figsize=(15, 4.2), sharey=True)
    drawable = [r for r in records if not r.steps.empty and r.steps["loss"].notna().any()]
    if not drawable:
        for ax in axes:
            _empty(ax, "no training losses logged")
        return _save(fig, path)
    colours = _colours([_arm(r, arms) for r in drawable])
    for ax, (column, label) in zip(axes, LOSS_AXES):
        labelled: set[str] = set()
        for record in drawable:
            steps = _loss_axes(record.steps)
            if not steps[column].notna().any():
                continue
            arm = _arm(record, arms)
            ax.plot(steps[column], steps["loss"], color=colours[arm], alpha=0.15, linewidth=0.6)
            ax.plot(steps[column], ema(steps["loss"].to_numpy(), smooth_alpha), color=colours[arm], linewidth=1.2,
                    linestyle="--" if record.partial else "-", label=None if arm in labelled else arm)
            labelled.add(arm)
        ax.set(xlabel=label, yscale="log")
        ax.set_title(f"vs {label}", fontsize=9)
        _plain_log_y(ax)
    axes[0].set_ylabel("training loss")
    fig.suptitle("training loss (EMA; faint: raw; dashed: partial run)", fontsize=10)
    _legend(axes[0])
    return _save(fig, path)


def _bucket_spans(steps: pd.DataFrame) -> list[tuple[float, float, int]]:
    """(first step - 1, last step, bucket) of each run of consecutive single-bucket steps (bucket >= 0)."""
    if "bucket" not in steps.columns:
        return []
    rows = steps.dropna(subset=["step", "bucket"]).sort_values("step")
    spans: list[tuple[float, float, int]] = []
    for step, bucket in zip(rows["step"].to_numpy(float), rows["bucket"].to_numpy(float)):
        if bucket < 0:
            continue
        if spans and spans[-1][2] == int(bucket) and spans[-1][1] == step - 1:
            spans[-1] = (spans[-1][0], step, int(bucket))
        else:
            spans.append((step - 1, step, int(bucket)))
    return spans


def plot_band_loss_by_arm(records: list[RunRecord], path: Path, arms: dict[str, str] | None = None) -> Path:
    """Probe loss of every band against the step, one panel per arm (its lowest seed), the background shaded by
    the length bucket each training step came from (same colour as that band's line; unshaded = mixed steps).

    A forgetting loop looks like a band's loss rising while other buckets train and falling when its own bucket
    returns; under shuffled orders the shading is a fine stripe and the lines should stay smooth.
    """
    chosen: dict[str, RunRecord] = {}
    for record in sorted(records, key=lambda r: (r.seed is None, r.seed if r.seed is not None else 0, r.run_id)):
        if not record.probes.empty and record.probes["loss"].notna().any():
            chosen.setdefault(_arm(record, arms), record)
    if not chosen:
        fig, ax = plt.subplots(figsize=(6, 3))
        _empty(ax, "no probe evaluations logged")
        return _save(fig, path)
    fig, axes = _drawable_grid(len(chosen), 3, (5.2, 3.4), sharey=True)
    bands = sorted({int(b) for r in chosen.values() for b in r.probes["band"].dropna().unique()})
    palette = plt.get_cmap("viridis", max(len(bands), 2))
    colour = {band: palette(i) for i, band in enumerate(bands)}
    for ax, (arm, record) in zip(axes, sorted(chosen.items())):
        for start, end, bucket in _bucket_spans(record.steps):
            ax.axvspan(start, end, color=colour.get(bucket, "lightgrey"), alpha=0.12, linewidth=0)
        for band in bands:
            probes = record.probes[record.probes["band"] == band].sort_values("step")
            lo, hi = record_band_edges([record], band)
            ax.plot(probes["step"], probes["loss"], color=colour[band], linewidth=1.1,
                    label=f"band {band}" + (f" ({lo:.0f}, {hi:.0f}]" if np.isfinite(lo) else ""))
        ax.set(xlabel="step", yscale="log")
        ax.set_title(f"{arm} (seed {record.seed})", fontsize=8)
        _plain_log_y(ax)
    axes[0].set_ylabel("probe loss (shading: bucket of the step)")
    axes[0].legend(fontsize=6)
    return _save(fig, path)


def plot_band_accuracy(records: list[RunRecord], path: Path, arms: dict[str, str] | None = None) -> Path:
    """Probe accuracy over steps, one panel per band, one line per run, coloured by arm."""
    with_probes = [r for r in records if not r.probes.empty and r.probes["acc"].notna().any()]
    bands = sorted({b for r in with_probes for b in r.probes["band"].dropna().unique()}, key=str)
    if not bands:
        fig, ax = plt.subplots(figsize=(6, 3))
        _empty(ax, "no probe evaluations logged")
        return _save(fig, path)
    fig, axes = _drawable_grid(len(bands), 3, (4.2, 3.2), sharey=True)
    colours = _colours([_arm(r, arms) for r in with_probes])
    for ax, band in zip(axes, bands):
        labelled: set[str] = set()
        for record in with_probes:
            probes = record.probes[record.probes["band"] == band].sort_values("step")
            if probes.empty:
                continue
            arm = _arm(record, arms)
            ax.plot(probes["step"], probes["acc"], color=colours[arm], linewidth=1,
                    label=None if arm in labelled else arm)
            labelled.add(arm)
        lo, hi = record_band_edges(with_probes, band)
        ax.set_title(f"band {band}" + (f" ({lo:.0f}, {hi:.0f}]" if np.isfinite(lo) else ""),  # lengths in (lo, hi]
                     fontsize=9)
        ax.set_xlabel("step")
    axes[0].set_ylabel("probe accuracy")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def record_band_edges(records: list[RunRecord], band) -> tuple[float, float]:
    """(band_lo, band_hi) of a probe band from the first run that logged them, else (nan, nan)."""
    for record in records:
        rows = record.probes[(record.probes["band"] == band)][["band_lo", "band_hi"]].dropna()
        if len(rows):
            return float(rows.iloc[0, 0]), float(rows.iloc[0, 1])
    return float("nan"), float("nan")


def _bar_panel(ax: plt.Axes, groups: pd.DataFrame, column: str, title: str) -> None:
    mean_col, std_col = f"{column}_mean", f"{column}_std"
    if groups.empty or mean_col not in groups or not groups[mean_col].notna().any():
        _empty(ax, f"{title}: n/a")
        return
    colours = _colours(list(groups.index))
    ax.bar(range(len(groups)), groups[mean_col].fillna(0.0), yerr=groups[std_col].fillna(0.0), capsize=3,
           color=[colours[arm] for arm in groups.index])
    ax.set_xticks(range(len(groups)), groups.index, rotation=30, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)


def plot_metric_bars(comparison: Comparison, path: Path) -> Path:
    """Per-arm mean +- std (over seeds) of jumpiness, spike score, residual amplitude A, own-share slope beta,
    band forgetting and forgetting events per example."""
    panels = [
        ("jumpiness", "jumpiness std(d log L)"),
        ("spike_score", "spike score"),
        ("residual_amplitude", "residual amplitude A"),
        ("own_share_slope", "own-share slope beta (< 0: recency)"),
        ("band_forgetting", "band forgetting F_b"),
        ("forgetting_events_per_example", "forgetting events / example"),
    ]
    groups = comparison.groups
    present = [(c, t) for c, t in panels if not groups.empty and f"{c}_mean" in groups
               and groups[f"{c}_mean"].notna().any()]
    if not present:
        fig, ax = plt.subplots(figsize=(6, 3))
        _empty(ax, "no metric has a value for any arm")
        return _save(fig, path)
    fig, axes = _drawable_grid(len(present), 3, (4.4, 3.5))
    for ax, (column, title) in zip(axes, present):
        _bar_panel(ax, groups, column, title)
    _note_missing(fig, [t for c, t in panels if (c, t) not in present])
    return _save(fig, path)


def plot_tradeoff(comparison: Comparison, path: Path) -> Path:
    """One point per setting (arm): Ktok/s (x) against jumpiness, residual amplitude and band forgetting (y),
    mean +- std over seeds: what a policy or boundary sweep is run to draw."""
    panels = [("jumpiness", "jumpiness"), ("residual_amplitude", "residual amplitude A"),
              ("band_forgetting", "band forgetting F_b")]
    groups = comparison.groups
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    if groups.empty or not groups["ktok_s_mean"].notna().any():
        for ax in axes:
            _empty(ax, "needs Ktok/s for at least one setting")
        return _save(fig, path)
    present = [(c, t) for c, t in panels if f"{c}_mean" in groups
               and not groups.dropna(subset=["ktok_s_mean", f"{c}_mean"]).empty]
    if not present:
        for ax in axes:
            _empty(ax, "needs Ktok/s and a forgetting metric for one setting")
        return _save(fig, path)
    plt.close(fig)
    fig, axes = _drawable_grid(len(present), 3, (5.0, 4.8))
    colours = _colours(list(groups.index))
    for ax, (column, title) in zip(axes, present):
        drawable = groups.dropna(subset=["ktok_s_mean", f"{column}_mean"])
        for arm, stats in drawable.iterrows():
            ax.errorbar(stats["ktok_s_mean"], stats[f"{column}_mean"], xerr=np.nan_to_num(stats["ktok_s_std"]),
                        yerr=np.nan_to_num(stats[f"{column}_std"]), fmt="o", color=colours[arm], capsize=3,
                        label=arm)
            ax.annotate(arm, (stats["ktok_s_mean"], stats[f"{column}_mean"]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="Ktok/s (steady state)", ylabel=title)
        ax.set_title(f"throughput vs {title}", fontsize=9)
    _note_missing(fig, [t for c, t in panels if (c, t) not in present])
    _legend(axes[0])
    return _save(fig, path)


def plot_equal_compute(comparison: Comparison, path: Path) -> Path:
    """Mean probe loss per run against optimizer steps, real tokens and modelled time, with the common budgets
    (dashed) where the equal-compute endpoints are read."""
    labels = {"steps": "optimizer steps", "real_tokens": "real tokens", "modelled_time_s": "modelled time (s)"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    curves = comparison.curves
    if curves.empty:
        for ax in axes:
            _empty(ax, "no probe evaluations logged")
        return _save(fig, path)
    present = [axis for axis in AXES if curves[axis].notna().any()]
    if not present:
        for ax in axes:
            _empty(ax, "no probe evaluations on any compute axis")
        return _save(fig, path)
    plt.close(fig)
    fig, axes = _drawable_grid(len(present), 3, (5.0, 4.2), sharey=True)
    colours = _colours(list(curves["arm"].fillna("unknown")))
    for ax, axis in zip(axes, present):
        labelled: set[str] = set()
        for (_, arm), curve in curves.groupby(["run_id", curves["arm"].fillna("unknown")], sort=False):
            ax.plot(curve[axis], curve["probe_loss"], color=colours[arm], linewidth=1,
                    label=None if arm in labelled else arm)
            labelled.add(arm)
        budget = comparison.budgets.get(axis, float("nan"))
        if np.isfinite(budget):
            ax.axvline(budget, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel=labels[axis], yscale="log")
        ax.set_title(f"probe loss at equal {labels[axis]}", fontsize=9)
        _plain_log_y(ax)
    axes[0].set_ylabel("mean probe loss over bands")
    _note_missing(fig, [labels[axis] + (" (no cost model)" if axis == "modelled_time_s" else "")
                        for axis in AXES if axis not in present])
    _legend(axes[0])
    return _save(fig, path)


PLOT_FILES = ("loss_curves.png", "band_accuracy.png", "band_loss_by_arm.png", "metric_bars.png", "tradeoff.png",
              "equal_compute.png")


def write_all_plots(records: list[RunRecord], comparison: Comparison, out_dir: Path) -> list[Path]:
    """Every comparison plot (PLOT_FILES) into `out_dir`; returns the written paths."""
    out = Path(out_dir)
    arms = dict(zip(comparison.runs["run_id"], comparison.runs["arm"])) if len(comparison.runs) else {}
    return [
        plot_loss_curves(records, out / "loss_curves.png", arms),
        plot_band_accuracy(records, out / "band_accuracy.png", arms),
        plot_band_loss_by_arm(records, out / "band_loss_by_arm.png", arms),
        plot_metric_bars(comparison, out / "metric_bars.png"),
        plot_tradeoff(comparison, out / "tradeoff.png"),
        plot_equal_compute(comparison, out / "equal_compute.png"),
    ]
