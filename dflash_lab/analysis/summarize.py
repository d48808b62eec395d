"""RunRecords -> the comparison tables: one row per run (schema.RUN_COLUMNS), per-band details, per-policy means.

Every figure is computed by the one function that defines it (dflash_lab.metrics.*); this module only feeds those
functions the right columns and records what was missing. Finished runs take throughput and final figures from
summary.json (the trainer computed them with `metrics.throughput`); partial runs recompute them from metrics.jsonl
with the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dflash_lab.analysis.schema import (
    COMPARISON_COLUMNS,
    NUMERIC_RUN_COLUMNS,
    RUN_COLUMNS,
    RunRecord,
)
from dflash_lab.metrics import forgetting, jumpiness, throughput


@dataclass
class RunAnalysis:
    """One run's comparison row plus its per-band table and interference matrix."""

    row: dict
    bands: pd.DataFrame
    interference: pd.DataFrame = field(default_factory=pd.DataFrame)


def _finite_or_nan(value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return float("nan")
    return number if np.isfinite(number) else float("nan")


def _column(steps: pd.DataFrame, name: str) -> np.ndarray | None:
    """A numeric steps column, or None when the run did not log it."""
    if name not in steps.columns:
        return None
    values = pd.to_numeric(steps[name], errors="coerce").to_numpy(dtype=np.float64)
    return None if np.all(np.isnan(values)) else values


def _steps_per_epoch(record: RunRecord) -> int | None:
    """Steps per epoch: exact from summary.json (the trainer knows its plan), else estimated from the logged epochs
    (runs written before the trainer recorded it, or W&B runs without the summary field)."""
    exact = record.summary.get("steps_per_epoch")
    if isinstance(exact, list) and exact and all(isinstance(n, int) for n in exact):
        return int(np.median(exact))
    epoch, step = _column(record.steps, "epoch"), _column(record.steps, "step")
    if epoch is None or step is None:
        return None
    spans = pd.DataFrame({"epoch": epoch, "step": step}).dropna().groupby("epoch")["step"].agg(["min", "max"])
    if len(spans) >= 2:
        spans = spans.iloc[:-1]  # the last epoch may be cut short by max_steps
    lengths = spans["max"] - spans["min"] + 1
    return int(np.median(lengths)) if len(lengths) else None


def _step_band_tokens(record: RunRecord, notes: list[str]) -> pd.DataFrame | None:
    """Real tokens per (training step, probe band): exact from presentations, else approximated from mean_len."""
    presentations = record.presentations
    if not presentations.empty and presentations[["step", "band", "length"]].notna().all().all():
        return forgetting.step_band_tokens_from_presentations(presentations)
    probes = record.probes
    edges = probes[["band", "band_lo", "band_hi"]].dropna().drop_duplicates("band").sort_values("band")
    mean_len = _column(record.steps, "mean_len")
    real = _column(record.steps, "real_tokens")
    if edges.empty or mean_len is None or real is None or list(edges["band"]) != list(range(len(edges))):
        return None
    notes.append("interference: band token shares approximated from mean_len (no presentations)")
    return forgetting.step_band_tokens_from_lengths(
        record.steps["step"].to_numpy(), real, mean_len, list(zip(edges["band_lo"], edges["band_hi"]))
    )


def analyse_run(record: RunRecord, theta: float = forgetting.LEARNED_THRESHOLD) -> RunAnalysis:
    """Compute every comparison column for one run.

    Args:
        record: a loaded run (any source).
        theta: learned threshold for example forgetting events.

    Returns:
        RunAnalysis with `row` holding exactly schema.RUN_COLUMNS.

    Example:
        >>> record = RunRecord(run_id="r", source="local", location="/r")
        >>> analyse_run(record).row["status"]
        'no_summary'
    """
    notes = list(record.messages)
    summary = record.summary
    steps = record.steps
    row: dict = {name: np.nan for name in RUN_COLUMNS}
    row.update(
        run_id=record.run_id,
        name=record.name or record.run_id,
        source=record.source,
        location=record.location,
        group=record.group,
        sampler=record.sampler,
        seed=record.seed,
        status=record.status,
        partial=record.partial,
    )
    for key in ("ktok_s", "pad_eff", "eta_s", "full_run_eta_s", "overhead_frac", "final_loss", "final_acc", "tau",
                "tau_baseline", "steps"):
        row[key] = _finite_or_nan(summary.get(key))

    loss = _column(steps, "loss")
    step = _column(steps, "step")
    if step is not None and not np.isfinite(row["steps"]):
        row["steps"] = float(np.nanmax(step))
    # partial runs (or summaries lacking a figure): recompute from the logged steps with the shared definitions
    ktok = _column(steps, "ktok_s")
    if not np.isfinite(row["ktok_s"]) and ktok is not None:
        row["ktok_s"] = throughput.steady_state_ktok_s(ktok)
    real, padded = _column(steps, "real_tokens"), _column(steps, "padded_tokens")
    if not np.isfinite(row["pad_eff"]) and real is not None and padded is not None:
        both = np.isfinite(real) & np.isfinite(padded)
        row["pad_eff"] = throughput.padding_efficiency(real[both], padded[both])
    eta = _column(steps, "eta_s")
    if not np.isfinite(row["eta_s"]) and eta is not None and np.isfinite(eta).any():
        row["eta_s"] = float(eta[np.isfinite(eta)][-1])
    acc = _column(steps, "acc")
    if not np.isfinite(row["final_loss"]) and loss is not None and np.isfinite(loss).any():
        row["final_loss"] = float(loss[np.isfinite(loss)][-1])
    if not np.isfinite(row["final_acc"]) and acc is not None and np.isfinite(acc).any():
        row["final_acc"] = float(acc[np.isfinite(acc)][-1])

    if loss is not None and np.isfinite(loss).sum() >= 3:
        report = jumpiness.jumpiness_report(
            loss, _column(steps, "mean_len"), _column(steps, "max_len"), _bucket_column(steps)
        )
        row.update({k: v for k, v in report.as_dict().items() if k in row})
        if report.steady_start == 0:
            notes.append(f"jumpiness: only {loss.size} steps, no warm-up skipped")
        if not np.isfinite(report.spike_score):
            notes.append("spike_score: fewer than 33 steps")
    else:
        notes.append("no loss series: jumpiness NaN")

    bands = pd.DataFrame()
    interference = pd.DataFrame()
    probes = record.probes.dropna(subset=["step", "band"])
    if not probes.empty:
        bands = forgetting.band_forgetting_table(probes.dropna(subset=["acc"]))
        row["band_forgetting"] = float(bands["forgetting"].mean())
        row["final_drop"] = float(bands["final_drop"].mean())
        row["max_final_drop"] = float(bands["final_drop"].max())
        probe_loss = probes.pivot_table(index="step", columns="band", values="loss", aggfunc="last").sort_index()
        probe_loss = probe_loss.dropna(axis=1, how="all")  # a band whose blocks could never be scored
        step_tokens = _step_band_tokens(record, notes)
        if step_tokens is not None and len(probe_loss) >= 4:
            fractions = forgetting.interval_band_fractions(step_tokens, probe_loss.index.to_numpy())
            interference = forgetting.interference_matrix(probe_loss, fractions)
            row["interference_cross"] = forgetting.mean_cross_interference(interference)
        else:
            notes.append("interference: needs >= 4 evals and band token counts")
        composition = _column(steps, "mean_len")
        composition = composition if composition is not None else _column(steps, "max_len")
        cycle = forgetting.estimate_cycle_lag(
            np.log(np.maximum(composition, 1.0)) if composition is not None else np.array([]),
            _steps_per_epoch(record),
        )
        stride = float(np.median(np.diff(step))) if step is not None and step.size > 1 else 1.0
        if cycle.source == "composition" and stride > 1:
            cycle = forgetting.CycleLag(int(round(cycle.steps * stride)), cycle.source)
        loop = forgetting.loop_score(probe_loss, cycle)
        row["loop_score"] = loop.score
        row["loop_lag_evals"] = float(loop.lag_evals) if loop.lag_evals else np.nan
        if not np.isfinite(loop.score):
            notes.append(
                f"loop_score: cycle of {cycle.steps} steps ({cycle.source}) needs more than "
                f"{len(probe_loss)} evals"
            )
        bands = bands.join(pd.Series(loop.per_band, name="loop", dtype=np.float64), how="left")

    presentations = record.presentations.dropna(subset=["sample_index", "step", "acc"])
    if not presentations.empty:
        summary_all = forgetting.example_forgetting(presentations, theta)
        row["forgetting_events_per_example"] = summary_all.events_per_example
        row["frac_ever_forgotten"] = summary_all.frac_ever_forgotten
        row["frac_never_learned"] = summary_all.frac_never_learned
        if summary_all.n_examples == 0:
            notes.append("forgetting events: no example presented twice (needs >= 2 epochs)")
        by_band = forgetting.example_forgetting_by_band(presentations, theta).add_prefix("examples_")
        bands = by_band if bands.empty else bands.join(by_band, how="outer")
    row["notes"] = "; ".join(dict.fromkeys(notes))
    return RunAnalysis(row=row, bands=bands, interference=interference)


def _bucket_column(steps: pd.DataFrame) -> np.ndarray | None:
    if "bucket" not in steps.columns or steps["bucket"].isna().all():
        return None
    return steps["bucket"].fillna(-1).to_numpy()


def unique_run_ids(records: list[RunRecord]) -> None:
    """Make run_id unique across records (two multiruns may both hold "0_bucketed_s0"): prefix the parent."""
    counts = pd.Series([r.run_id for r in records]).value_counts()
    for record in records:
        if counts.get(record.run_id, 0) > 1:
            parent = record.location.rstrip("/").split("/")[-2] if "/" in record.location else record.source
            record.run_id = f"{parent}/{record.run_id}"


@dataclass
class Comparison:
    """All tables of one comparison."""

    runs: pd.DataFrame
    policies: pd.DataFrame
    bands: pd.DataFrame
    interference: pd.DataFrame


def compare_records(records: list[RunRecord], theta: float = forgetting.LEARNED_THRESHOLD) -> Comparison:
    """Analyse every run and aggregate per policy (mean, std over seeds, n runs).

    Args:
        records: loaded runs (any source).
        theta: learned threshold of example forgetting events (METRICS.md default 0.5).

    Example:
        >>> compare_records([]).runs.columns.tolist() == list(RUN_COLUMNS)
        True
    """
    unique_run_ids(records)
    analyses = [analyse_run(record, theta) for record in records]
    runs = pd.DataFrame([a.row for a in analyses], columns=list(RUN_COLUMNS))
    band_tables, matrices = [], []
    for analysis in analyses:
        ident = {k: analysis.row[k] for k in ("run_id", "sampler", "seed")}
        if not analysis.bands.empty:
            band_tables.append(analysis.bands.reset_index().rename(columns={"index": "band"}).assign(**ident))
        if not analysis.interference.empty:
            long = analysis.interference.stack(future_stack=True).rename("interference").reset_index()
            matrices.append(long.assign(**ident))
    bands = pd.concat(band_tables, ignore_index=True) if band_tables else pd.DataFrame()
    interference = pd.concat(matrices, ignore_index=True) if matrices else pd.DataFrame()
    return Comparison(runs=runs, policies=policy_table(runs), bands=bands, interference=interference)


def policy_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per sampler: n_runs, n_partial, and <col>_mean / <col>_std (ddof 1; NaN for one seed) of numeric columns.

    Example:
        >>> runs = pd.DataFrame({"sampler": ["a", "a"], "partial": [False, True], "ktok_s": [1.0, 3.0]})
        >>> policy_table(runs)[["n_runs", "ktok_s_mean", "ktok_s_std"]].round(3).to_numpy().tolist()
        [[2.0, 2.0, 1.414]]
    """
    if runs.empty:
        return pd.DataFrame()
    numeric = [c for c in NUMERIC_RUN_COLUMNS if c in runs.columns and c != "seed"]
    frame = runs.assign(sampler=runs["sampler"].fillna("unknown"))
    values = frame[numeric].apply(pd.to_numeric, errors="coerce")
    grouped = values.groupby(frame["sampler"], sort=True)
    table = pd.concat([grouped.mean().add_suffix("_mean"), grouped.std(ddof=1).add_suffix("_std")], axis=1)
    table.insert(0, "n_partial", frame.groupby("sampler")["partial"].sum().astype(int))
    table.insert(0, "n_runs", frame.groupby("sampler").size())
    ordered = ["n_runs", "n_partial"] + [f"{c}_{s}" for c in numeric for s in ("mean", "std")]
    return table[ordered]


# ------------------------------------------------------------------------------------------------- markdown
def _format_number(value: float, column: str, digits: int = 4) -> str:
    if value is None or not np.isfinite(value):
        return "n/a"
    if column in {"eta_s", "full_run_eta_s"} or abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown_tables(comparison: Comparison, columns: tuple[str, ...] = COMPARISON_COLUMNS) -> str:
    """comparison.md: per-policy mean +- std over seeds, then one row per run, then notes on partial/missing data.

    Example:
        >>> print(markdown_tables(compare_records([])))
        No runs loaded.
    """
    runs, policies = comparison.runs, comparison.policies
    if runs.empty:
        return "No runs loaded."
    parts = ["## Per policy (mean ± std over seeds)", ""]
    policy_rows = []
    for sampler, stats in policies.iterrows():
        partial = f" ({int(stats['n_partial'])} partial)" if stats["n_partial"] else ""
        cells = [str(sampler), f"{int(stats['n_runs'])}{partial}"]
        for column in columns:
            mean, std = stats[f"{column}_mean"], stats[f"{column}_std"]
            text = _format_number(mean, column)
            if np.isfinite(mean) and np.isfinite(std):
                text += f" ± {_format_number(std, column, digits=2)}"
            cells.append(text)
        policy_rows.append(cells)
    parts += [_markdown(["sampler", "runs", *columns], policy_rows), "", "## Per run", ""]
    run_rows = []
    for _, run in runs.iterrows():
        seed = "n/a" if pd.isna(run["seed"]) else str(int(run["seed"]))
        status = str(run["status"]) + (" (partial)" if run["partial"] else "")
        run_rows.append(
            [str(run["run_id"]), str(run["sampler"]), seed, status]
            + [_format_number(run[c], c) for c in columns]
        )
    parts.append(_markdown(["run", "sampler", "seed", "status", *columns], run_rows))
    noted = runs[runs["notes"].astype(str).str.len() > 0]
    if len(noted):
        parts += ["", "## Notes", ""]
        parts += [f"- `{r['run_id']}`: {r['notes']}" for _, r in noted.iterrows()]
    return "\n".join(parts)
