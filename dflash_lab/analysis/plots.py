"""Comparison plots (matplotlib, Agg backend, PNG): loss curves, per-band probe accuracy, jumpiness and forgetting
bars, throughput versus forgetting. Each function takes the loaded records / comparison tables and a path, draws
one figure, and returns the path; a figure with nothing to draw says so on the canvas instead of failing.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: CI and Slurm nodes have no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from dflash_lab.analysis.schema import RunRecord  # noqa: E402
from dflash_lab.analysis.summarize import Comparison  # noqa: E402
from dflash_lab.metrics.jumpiness import ema  # noqa: E402


KNOWN_POLICIES = ("sorted_static", "full_random", "bucketed", "bucketed_megabatch", "packed")


def _colours(samplers: list[str]) -> dict[str, tuple]:
    """One colour per policy, the same in every plot: known policies first, others after in name order."""
    palette = plt.get_cmap("tab10")
    others = sorted(set(samplers) - set(KNOWN_POLICIES))
    order = list(KNOWN_POLICIES) + others
    return {name: palette(order.index(name) % 10) for name in set(samplers)}


def _empty(ax: plt.Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss_curves(records: list[RunRecord], path: Path, smooth_alpha: float = 0.1) -> Path:
    """Training loss per step, every run overlaid (EMA-smoothed, faint raw), one colour per sampler."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawable = [r for r in records if not r.steps.empty and r.steps["loss"].notna().any()]
    if not drawable:
        _empty(ax, "no training losses logged")
        return _save(fig, path)
    colours = _colours([r.sampler or "unknown" for r in drawable])
    labelled: set[str] = set()
    for record in drawable:
        steps = record.steps.dropna(subset=["step", "loss"])
        sampler = record.sampler or "unknown"
        ax.plot(steps["step"], steps["loss"], color=colours[sampler], alpha=0.15, linewidth=0.6)
        ax.plot(
            steps["step"], ema(steps["loss"].to_numpy(), smooth_alpha), color=colours[sampler], linewidth=1.2,
            linestyle="--" if record.partial else "-", label=None if sampler in labelled else sampler,
        )
        labelled.add(sampler)
    ax.set(xlabel="step", ylabel="training loss", title="Training loss (EMA; dashed = partial run)")
    ax.set_yscale("log")
    ax.legend()
    return _save(fig, path)


def plot_band_accuracy(records: list[RunRecord], path: Path) -> Path:
    """Probe accuracy over steps, one panel per band, one line per run, coloured by sampler."""
    with_probes = [r for r in records if not r.probes.empty and r.probes["acc"].notna().any()]
    bands = sorted({b for r in with_probes for b in r.probes["band"].dropna().unique()}, key=str)
    if not bands:
        fig, ax = plt.subplots(figsize=(6, 3))
        _empty(ax, "no probe evaluations logged")
        return _save(fig, path)
    columns = min(len(bands), 3)
    rows = int(np.ceil(len(bands) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False, sharey=True)
    colours = _colours([r.sampler or "unknown" for r in with_probes])
    for ax, band in zip(axes.flat, bands):
        labelled: set[str] = set()
        for record in with_probes:
            probes = record.probes[record.probes["band"] == band].sort_values("step")
            if probes.empty:
                continue
            sampler = record.sampler or "unknown"
            ax.plot(probes["step"], probes["acc"], color=colours[sampler], linewidth=1,
                    label=None if sampler in labelled else sampler)
            labelled.add(sampler)
        lo, hi = record_band_edges(with_probes, band)
        ax.set_title(f"band {band}" + (f" ({lo:.0f}, {hi:.0f}]" if np.isfinite(lo) else ""))  # lengths in (lo, hi]
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(bands):]:
        ax.set_axis_off()
    axes[0][0].set_ylabel("probe accuracy")
    axes[0][0].legend(fontsize=7)
    return _save(fig, path)


def record_band_edges(records: list[RunRecord], band) -> tuple[float, float]:
    """(band_lo, band_hi) of a probe band from the first run that logged them, else (nan, nan)."""
    for record in records:
        rows = record.probes[(record.probes["band"] == band)][["band_lo", "band_hi"]].dropna()
        if len(rows):
            return float(rows.iloc[0, 0]), float(rows.iloc[0, 1])
    return float("nan"), float("nan")


def _bar_panel(ax: plt.Axes, policies: pd.DataFrame, column: str, title: str) -> None:
    mean_col, std_col = f"{column}_mean", f"{column}_std"
    if policies.empty or mean_col not in policies or not policies[mean_col].notna().any():
        _empty(ax, f"{title}: n/a")
        return
    means = policies[mean_col]
    errors = policies[std_col].fillna(0.0)
    ax.bar(range(len(means)), means.fillna(0.0), yerr=errors, capsize=3,
           color=[_colours(list(policies.index))[s] for s in policies.index])
    ax.set_xticks(range(len(means)), policies.index, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=9)


def plot_metric_bars(comparison: Comparison, path: Path) -> Path:
    """Per-policy mean +- std (over seeds) of jumpiness, spike score, length R^2, band forgetting, forgetting events
    per example, loop score."""
    panels = [
        ("jumpiness", "jumpiness std(d log L)"),
        ("spike_score", "spike score"),
        ("length_r2", "length confound R²"),
        ("band_forgetting", "band forgetting F_b"),
        ("forgetting_events_per_example", "forgetting events / example"),
        ("loop_score", "loop score"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for ax, (column, title) in zip(axes.flat, panels):
        _bar_panel(ax, comparison.policies, column, title)
    return _save(fig, path)


def plot_throughput_vs_forgetting(comparison: Comparison, path: Path) -> Path:
    """Each run: Ktok/s (x) against band forgetting (y), coloured by sampler; partial runs hollow."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    runs = comparison.runs.dropna(subset=["ktok_s", "band_forgetting"])
    if runs.empty:
        _empty(ax, "needs Ktok/s and band forgetting for at least one run")
        return _save(fig, path)
    colours = _colours(list(runs["sampler"].fillna("unknown")))
    for sampler, group in runs.groupby(runs["sampler"].fillna("unknown")):
        finished = group[~group["partial"].astype(bool)]
        partial = group[group["partial"].astype(bool)]
        ax.scatter(finished["ktok_s"], finished["band_forgetting"], color=colours[sampler], label=sampler)
        ax.scatter(partial["ktok_s"], partial["band_forgetting"], facecolors="none", edgecolors=colours[sampler])
    ax.set(xlabel="Ktok/s (steady state)", ylabel="band forgetting F_b (mean over bands)",
           title="Throughput vs forgetting (hollow = partial run)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_all_plots(records: list[RunRecord], comparison: Comparison, out_dir: Path) -> list[Path]:
    """Every comparison plot into `out_dir`; returns the written paths."""
    out = Path(out_dir)
    return [
        plot_loss_curves(records, out / "loss_curves.png"),
        plot_band_accuracy(records, out / "band_accuracy.png"),
        plot_metric_bars(comparison, out / "metric_bars.png"),
        plot_throughput_vs_forgetting(comparison, out / "throughput_vs_forgetting.png"),
    ]
