"""RunRecords -> the comparison tables: one row per run (schema.RUN_COLUMNS, then the swept keys), per-band details,
per-arm means, and paired differences against the baseline arm.

Every figure is computed by the one function that defines it (dflash_lab.metrics.*, analysis.budgets,
analysis.paired); this module only feeds those functions the right columns and records what was missing. Finished
runs take throughput and final figures from summary.json (the trainer computed them with `metrics.throughput`);
partial runs recompute them from metrics.jsonl with the same functions. Arms, strata and the baseline follow
analysis.arms; what is tested (baseline, endpoints, margins, cost model) follows analysis.protocol.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dflash_lab.analysis import arms as arms_module
from dflash_lab.analysis import budgets
from dflash_lab.analysis.paired import PAIRED_COLUMNS, paired_table
from dflash_lab.analysis.protocol import RULES, Protocol, resolve_protocol
from dflash_lab.analysis.verdict import build_verdict, finish_verdict
from dflash_lab.analysis.schema import (
    COMPARISON_COLUMNS,
    NUMERIC_RUN_COLUMNS,
    RUN_COLUMNS,
    RunRecord,
)
from dflash_lab.metrics import forgetting, gradients, jumpiness, throughput


@dataclass
class RunAnalysis:
    """One run's comparison row, its per-band table, cross-band matrix and probe-loss curve on every compute axis."""

    row: dict
    bands: pd.DataFrame
    cross: pd.DataFrame = field(default_factory=pd.DataFrame)
    curve: pd.DataFrame = field(default_factory=pd.DataFrame)


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


def explains(notes: str, column: str) -> bool:
    """Whether a run's notes name `column` as a whole word: the note that says why that cell is empty.

    Example:
        >>> explains("cross_band_effect: 9 probe evals", "cross_band_effect")
        True
        >>> explains("residual_jumpiness: 3 steps", "jumpiness")
        False
    """
    return re.search(rf"(?<!\w){re.escape(column)}(?!\w)", notes) is not None


def _note_undefined(notes: list[str], reasons: dict[str, str]) -> None:
    """One note per distinct reason, naming the columns it leaves NaN: "a, b: reason"."""
    by_reason: dict[str, list[str]] = {}
    for column, reason in reasons.items():
        by_reason.setdefault(reason, []).append(column)
    notes.extend(f"{', '.join(columns)}: {reason}" for reason, columns in by_reason.items())


def _dynamics_reasons(dynamics: forgetting.ProbeDynamics, start_step: float, period: int | None,
                      tokens_known: bool) -> dict[str, str]:
    """Why each probe-dynamics comparison column of a run is NaN (the documented minima of metrics.forgetting).

    Example:
        >>> short = forgetting.probe_dynamics(pd.DataFrame({b: [3.0, 2.9, 2.8] for b in range(6)}, index=[0, 5, 10]),
        ...                                   None)
        >>> reasons = _dynamics_reasons(short, 0.0, None, False)
        >>> reasons["residual_amplitude"]
        '3 probe evals from the steady-state start (step 0), minimum 8'
        >>> reasons["cross_band_effect"].split(", ")[1]
        'minimum 11 with 6 probe bands (forgetting.cross_band_min_evals)'
    """
    reasons: dict[str, str] = {}
    window = f"{dynamics.window_evals} probe evals from the steady-state start (step {start_step:.0f})"
    short = dynamics.window_evals < forgetting.MIN_EVALS
    no_tokens = "no per-step band token counts (no presentations, no mean_len)"
    rank_deficient = "every band's share fit is rank-deficient (band shares barely vary in the window)"
    if not np.isfinite(dynamics.residual_amplitude):
        reasons["residual_amplitude"] = (f"{window}, minimum {forgetting.MIN_EVALS}" if short
                                         else "undefined on the window's probe losses")
    if not np.isfinite(dynamics.own_share_slope):
        if short:
            reasons["own_share_slope"] = f"{window}, minimum {forgetting.MIN_EVALS}"
        elif not tokens_known:
            reasons["own_share_slope"] = no_tokens
        elif dynamics.share_intervals < forgetting.MIN_EVALS - 1:
            reasons["own_share_slope"] = (f"{dynamics.share_intervals} intervals with training tokens in the window, "
                                          f"minimum {forgetting.MIN_EVALS - 1}")
        else:
            reasons["own_share_slope"] = rank_deficient
    if not np.isfinite(dynamics.cross_band_effect):
        needed = forgetting.cross_band_min_evals(dynamics.n_bands)
        if dynamics.n_bands < 3:
            reasons["cross_band_effect"] = f"{dynamics.n_bands} probe bands in the window, minimum 3"
        elif dynamics.window_evals < needed:
            reasons["cross_band_effect"] = (f"{window}, minimum {needed} with {dynamics.n_bands} probe bands "
                                            "(forgetting.cross_band_min_evals)")
        elif not tokens_known:
            reasons["cross_band_effect"] = no_tokens
        elif dynamics.share_intervals + 1 < needed:
            reasons["cross_band_effect"] = (f"{dynamics.share_intervals} intervals with training tokens in the window, "
                                            f"minimum {needed - 1} with {dynamics.n_bands} probe bands")
        else:
            reasons["cross_band_effect"] = rank_deficient
    if period and not np.isfinite(dynamics.loop_score):
        reasons["loop_score"] = (
            f"a period of {period} steps ({dynamics.loop_lag_evals} evals) needs at least 2 periods of probe evals "
            f"after the steady-state start, {window}"
            if dynamics.loop_lag_evals > dynamics.window_evals // 2 else "undefined on the window's band residuals")
    return reasons


# Why a comparison column read from the summary is NaN when nothing more specific is known.
_FALLBACK_REASONS = {
    "ktok_s": "not in summary.json and no ktok_s in metrics.jsonl",
    "pad_eff": "not in summary.json and no real/padded tokens in metrics.jsonl",
    "final_loss": "not in summary.json and no logged loss",
    "tau": "not in summary.json (measured at the end of training)",
    "tau_band_min": "not in summary.json (tau per band: measured at the end of training)",
    "tau_band_mean": "not in summary.json (tau per band: measured at the end of training)",
}


_ENDPOINTS = frozenset(budgets.ENDPOINT_OF_AXIS.values())


def _throughput_and_final(row: dict, steps: pd.DataFrame) -> None:
    """Fill figures a partial run (or a summary lacking them) did not report from the logged steps."""
    step, loss, acc = _column(steps, "step"), _column(steps, "loss"), _column(steps, "acc")
    if step is not None and not np.isfinite(row["steps"]):
        row["steps"] = float(np.nanmax(step))
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
    if not np.isfinite(row["final_loss"]) and loss is not None and np.isfinite(loss).any():
        row["final_loss"] = float(loss[np.isfinite(loss)][-1])
    if not np.isfinite(row["final_acc"]) and acc is not None and np.isfinite(acc).any():
        row["final_acc"] = float(acc[np.isfinite(acc)][-1])


def analyse_run(record: RunRecord, theta: float = forgetting.LEARNED_THRESHOLD,
                cost: tuple[float, float, float] | None = None, window: float | str = "steady") -> RunAnalysis:
    """Compute every per-run comparison column for one run (the budget columns need all runs: `compare_records`).

    Args:
        record: a loaded run (any source).
        theta: learned threshold for example forgetting events.
        cost: (c0, c1, c2) of the step-time model for the modelled-time axis (None: that axis is NaN).
        window: where the analysis window of jumpiness and probe dynamics starts (`analysis.window`): a share of
            the run's end step (summary.json `end_step`, else its last logged step), the same step for every arm
            of a sweep; or ``steady``, the run's own loss steady state.

    Returns:
        RunAnalysis with `row` holding exactly schema.RUN_COLUMNS.

    Example:
        >>> record = RunRecord(run_id="r", source="local", location="/r")
        >>> analyse_run(record).row["status"]
        'no_summary'
    """
    notes = list(record.messages)
    row = _recorded_columns(record)
    steady_start_step = _jumpiness_columns(row, notes, record, window)
    period = forgetting.order_period_steps(record.sampler, _steps_per_epoch(record))
    bands, cross = _probe_columns(row, notes, record, steady_start_step, period)
    bands = _example_columns(row, notes, record, theta, bands)
    curve = _budget_columns(row, record, cost)
    _note_unexplained(row, notes, applies_loop=bool(period),
                      tau_off=(record.config.get("trainer") or {}).get("measure_tau") is False)
    row["notes"] = "; ".join(dict.fromkeys(notes))
    return RunAnalysis(row=row, bands=bands, cross=cross, curve=curve)


def _recorded_columns(record: RunRecord) -> dict:
    """The run's row, every column NaN but what the run recorded: its identity, its summary's figures (with the
    throughput and final loss from metrics.jsonl where the summary lacks them) and its target."""
    summary = record.summary
    row: dict = {name: np.nan for name in RUN_COLUMNS}
    row.update(
        run_id=record.run_id, name=record.name or record.run_id, source=record.source, location=record.location,
        group=record.group, sampler=record.sampler, seed=record.seed, arm=None, stratum=None, status=record.status,
        partial=record.partial,
    )
    for key in ("ktok_s", "pad_eff", "eta_s", "full_run_eta_s", "overhead_frac", "final_loss", "final_acc", "tau",
                "tau_baseline", "tau_band_min", "tau_band_mean", "tau_se", "tau_prompts", "steps"):
        row[key] = _finite_or_nan(summary.get(key))
    _throughput_and_final(row, record.steps)
    row["target_seed"] = _finite_or_nan(summary.get("target_seed"))
    row["target_digest"] = arms_module.recorded_digest(record, "target_digest")
    row["topology"] = str(summary.get("topology") or "")
    rank_nodes = summary.get("rank_nodes")
    row["nodes"] = ",".join(dict.fromkeys(map(str, rank_nodes))) if isinstance(rank_nodes, list) else ""
    return row


def _jumpiness_columns(row: dict, notes: list[str], record: RunRecord, window: float | str) -> float:
    """The loss jumpiness columns over the analysis window (``metrics.jumpiness``); returns the window's first step
    (the steady-state start with ``window: steady``), where the probe dynamics start too."""
    steps = record.steps
    loss, step = _column(steps, "loss"), _column(steps, "step")
    nan_note = _nonfinite_loss_note(loss, step)
    if nan_note:
        notes.append(nan_note)
    fixed_start = _window_start_index(window, step, record.summary)
    steady_start_step = float(step[fixed_start]) if fixed_start is not None else 0.0
    if loss is None or np.isfinite(loss).sum() < 3:
        count = 0 if loss is None else int(np.isfinite(loss).sum())
        _note_undefined(notes, {c: f"{count} logged losses, minimum 3" for c in ("jumpiness", "spike_score")})
        return steady_start_step
    report = jumpiness.jumpiness_report(
        loss, _column(steps, "mean_len"), _column(steps, "max_len"), _bucket_column(steps), steady_start=fixed_start,
    )
    row.update({k: v for k, v in report.as_dict().items() if k in row})
    steady_start_step = float(step[report.steady_start]) if step is not None else float(report.steady_start)
    row["steady_start_step"] = steady_start_step
    if report.steady_steps < 8:
        notes.append(f"jumpiness: only {report.steady_steps} steady-state steps")
    if not np.isfinite(report.spike_score):
        notes.append(f"spike_score: {len(loss)} logged losses, a step is scored once {jumpiness.SPIKE_MIN_HISTORY} "
                     f"losses precede it (minimum {jumpiness.SPIKE_MIN_HISTORY + 1})")
    return steady_start_step


def _nonfinite_loss_note(loss: np.ndarray | None, step: np.ndarray | None, shown: int = 10) -> str | None:
    """The steps whose logged loss is not a number (null in metrics.jsonl: a non-finite loss whose update was
    skipped, ``trainer.skip_nonfinite``), counted and named: the loss columns are computed without them.

    Example:
        >>> _nonfinite_loss_note(np.array([2.0, np.nan, 1.9, np.inf]), np.array([1.0, 2.0, 3.0, 4.0]))
        'loss: 2 of 4 steps logged no finite loss (steps [2, 4], updates skipped by trainer.skip_nonfinite): jumpiness, spike_score, the steady-state start and final_loss are computed without them'
    """
    if loss is None or np.isfinite(loss).all():
        return None
    bad = np.flatnonzero(~np.isfinite(loss))
    named = [int(s) for s in step[bad]] if step is not None and np.isfinite(step[bad]).all() else None
    where = (f"steps {named[:shown]}{f' and {len(named) - shown} more' if len(named) > shown else ''}, "
             if named is not None else "")
    # no "; " inside: a run's notes are joined with it
    return (f"loss: {bad.size} of {loss.size} steps logged no finite loss ({where}updates skipped by "
            f"trainer.skip_nonfinite): jumpiness, spike_score, the steady-state start and final_loss are computed "
            f"without them")


def _probe_columns(row: dict, notes: list[str], record: RunRecord, steady_start_step: float,
                   period: int | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The probe bands' forgetting and dynamics columns from the regular probe evaluations
    (``metrics.forgetting``); returns the per-band table and the cross-band matrix."""
    probes = record.probes.dropna(subset=["step", "band"])
    if probes.empty:
        _note_undefined(notes, {c: "no probe evals" for c in ("band_forgetting", "residual_amplitude",
                                                              "own_share_slope", "cross_band_effect")}
                        | ({"loop_score": "no probe evals"} if period else {}))
        return pd.DataFrame(), pd.DataFrame()
    probes = regular_probes(probes, record)   # the warmup's extra evals stay out of the forgetting figures
    bands = forgetting.band_forgetting_table(probes.dropna(subset=["acc"]))
    row["band_forgetting"] = float(bands["forgetting"].mean())
    row["final_drop"] = float(bands["final_drop"].mean())
    row["max_final_drop"] = float(bands["final_drop"].max())
    probe_loss = probes.pivot_table(index="step", columns="band", values="loss", aggfunc="last").sort_index()
    probe_loss = probe_loss.dropna(axis=1, how="all")  # a band whose blocks could never be scored
    step_band_tokens = _step_band_tokens(record, notes)
    dynamics = forgetting.probe_dynamics(probe_loss, step_band_tokens, start_step=steady_start_step,
                                         period_steps=period)
    row.update(
        forgetting_window_evals=dynamics.window_evals, residual_amplitude=dynamics.residual_amplitude,
        own_share_slope=dynamics.own_share_slope, own_share_slope_se=dynamics.own_share_slope_se,
        cross_band_effect=dynamics.cross_band_effect, loop_score=dynamics.loop_score,
        loop_lag_evals=float(dynamics.loop_lag_evals) if dynamics.loop_lag_evals else np.nan,
        order_period_steps=float(period) if period else np.nan,
    )
    _note_undefined(notes, _dynamics_reasons(dynamics, steady_start_step, period, step_band_tokens is not None))
    return bands.join(dynamics.per_band, how="left"), dynamics.cross_matrix


def _example_columns(row: dict, notes: list[str], record: RunRecord, theta: float,
                     bands: pd.DataFrame) -> pd.DataFrame:
    """The example forgetting columns from the presentation records (``metrics.forgetting``); returns the per-band
    table with the examples' figures joined."""
    presentations = record.presentations.dropna(subset=["sample_index", "step", "acc"])
    if presentations.empty:
        notes.append("forgetting_events_per_example: no example presentations")
        return bands
    summary_all = forgetting.example_forgetting(presentations, theta)
    row["forgetting_events_per_example"] = summary_all.events_per_example
    row["frac_ever_forgotten"] = summary_all.frac_ever_forgotten
    row["frac_never_learned"] = summary_all.frac_never_learned
    if summary_all.n_examples == 0:
        notes.append(f"forgetting_events_per_example: no example presented {forgetting.MIN_PRESENTATIONS} "
                     f"times (needs >= {forgetting.MIN_PRESENTATIONS} epochs)")
    by_band = forgetting.example_forgetting_by_band(presentations, theta).add_prefix("examples_")
    return by_band if bands.empty else bands.join(by_band, how="outer")


def _budget_columns(row: dict, record: RunRecord, cost: tuple[float, float, float] | None) -> pd.DataFrame:
    """The run's totals on the budget axes (real tokens, modelled time: ``analysis.budgets``) and its final probe
    loss; returns its probe-loss curve on those axes."""
    world = _finite_or_nan(record.summary.get("world_size"))
    axes = budgets.compute_axes(record.steps, cost, int(world) if np.isfinite(world) and world >= 1 else 1)
    curve = budgets.probe_curve(record.probes, axes)
    if len(axes):
        row["real_tokens_total"] = float(axes["real_tokens"].iloc[-1])
        row["modelled_time_s"] = float(axes["modelled_time_s"].iloc[-1])
    if len(curve):
        row["probe_loss_final"] = float(curve["probe_loss"].iloc[-1])
    return curve


def _note_unexplained(row: dict, notes: list[str], applies_loop: bool, tau_off: bool = False) -> None:
    """Never a silent empty cell: a NaN comparison column no note names yet gets its fallback reason (tau of a run
    that switched it off: not measured). Not here: the equal-compute endpoints (set across runs,
    `_budget_endpoints`) and loop_score of a shuffled order (NaN by definition; order_period_steps is NaN too)."""
    text = "; ".join(notes)
    unmeasured = [c for c in COMPARISON_COLUMNS if tau_off and c.startswith("tau") and not np.isfinite(row[c])]
    if unmeasured:
        notes.append(f"{', '.join(unmeasured)}: not measured (trainer.measure_tau=false)")
        text = "; ".join(notes)
    for column in COMPARISON_COLUMNS:
        if column in _ENDPOINTS or (column == "loop_score" and not applies_loop) or np.isfinite(row[column]):
            continue
        if not explains(text, column):
            notes.append(f"{column}: {_FALLBACK_REASONS.get(column, 'undefined on this run')}")


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
    """All tables of one comparison.

    Attributes:
        runs: one row per run: RUN_COLUMNS, then the swept keys (and boundaries / K when buckets are swept).
        groups: one row per arm (setting): its swept values, n_runs, n_partial, seeds, <col>_mean / <col>_std.
        bands: per run and band: forgetting, probe dynamics and example-forgetting figures.
        cross: per run, the cross-band matrix C[a, b] in long form.
        paired: paired.PAIRED_COLUMNS, one row per (arm, endpoint); empty without a baseline.
        curves: per run, the mean probe loss at each eval with its position on every compute axis.
        swept: the swept keys (sampler first) and the extra setting columns (boundaries, K).
        budgets: the common budget on each compute axis (steps, real_tokens, modelled_time_s).
        protocol: what was tested (baseline, endpoints, margins, cost, alpha, verdict roles).
        notes: comparison-level notes (strata without a baseline, too few seeds, ...).
        verdict: verdict.json's content when the protocol declares verdict roles (analysis.verdict), else None.
        target: the time-to-target level as fixed (`_target_endpoints`), None when analysis.target declares none.
        gradients: per run, bucket and phase (warmup / after): the pre-clip gradient norm and clip fraction
            (GRADIENT_TABLE_COLUMNS, ``metrics.gradients``).
    """

    runs: pd.DataFrame
    groups: pd.DataFrame
    bands: pd.DataFrame
    cross: pd.DataFrame
    paired: pd.DataFrame
    curves: pd.DataFrame
    swept: list[str]
    budgets: dict[str, float]
    protocol: Protocol
    notes: list[str]
    verdict: dict | None = None
    target: dict | None = None
    gradients: pd.DataFrame = field(default_factory=pd.DataFrame)


def compare_records(records: list[RunRecord], theta: float = forgetting.LEARNED_THRESHOLD,
                    protocol: Protocol | None = None, duplicates: str = "error",
                    mixed_digests: str = "error") -> Comparison:
    """Analyse every run, place it in its arm, read the equal-compute endpoints, and pair arms with the baseline.

    Args:
        records: loaded runs (any source).
        theta: learned threshold of example forgetting events (default 0.5).
        protocol: baseline / endpoints / margins / cost / alpha; default: what the runs declared
            (`protocol.resolve_protocol`).
        duplicates: runs sharing an arm and a seed (separate runs, not replicates: `arms.drop_duplicate_runs`):
            "error" refuses them, "latest" / "first" keep one and note it.
        mixed_digests: runs of one setting (all swept keys outside the sampler equal) trained against different
            target weights or data (summary `target_digest` / `data_digest`; `arms.check_digests`): "error"
            refuses them, "allow" compares them and says so in their notes. A run without digests is noted.

    Raises:
        ValueError: runs that declare different protocols, a baseline selector that is unknown or ambiguous,
            (duplicates="error") two runs of one arm with one seed, or (mixed_digests="error") runs of one setting
            with different target or data digests.

    Example:
        >>> comparison = compare_records([])
        >>> comparison.runs.columns.tolist() == list(RUN_COLUMNS), comparison.paired.empty
        (True, True)
    """
    unique_run_ids(records)
    protocol = protocol if protocol is not None else resolve_protocol(records)
    arms = place_arms(records, protocol.baseline, duplicates, mixed_digests)   # a bad selector fails first
    records, pairing, notes = arms.records, arms.pairing, list(arms.notes)
    analyses = [analyse_run(record, theta, protocol.cost, protocol.window) for record in records]
    runs = _runs_table(analyses, arms, notes)
    curves = _budget_endpoints(runs, analyses)
    budget = curves.attrs.pop("budgets", {axis: float("nan") for axis in budgets.AXES})
    target = _target_endpoints(runs, analyses, protocol.target, budget,
                               pairing.arms["baseline"].to_dict() if pairing is not None else {}, notes)
    paired, left_out = _paired_endpoints(runs, records, pairing, protocol, target, notes)
    bands, cross = _long_tables(analyses, runs)
    verdict = None
    if protocol.verdict and pairing is not None:
        try:
            verdict = build_verdict(runs, paired, protocol.verdict, small_answer=RULES[protocol.rules]["small"],
                                    state_costs=RULES[protocol.rules]["costs"], left_out=left_out,
                                    nested=RULES[protocol.rules]["nested"],
                                    controls_by_equivalence=RULES[protocol.rules]["controls_by_equivalence"],
                                    baselines=pairing.arms["baseline"].to_dict(),
                                    config_values=lambda key: arms_module.config_values(records, key))
        except ValueError as error:  # a selector that matches several arms, or names a key no run has
            notes.append(f"verdict.json not written: {error}")
        if verdict is not None:
            finish_verdict(verdict, runs, paired, protocol.verdict, RULES[protocol.rules], target,
                           budgets.EARLY_SHARE * budget["steps"], protocol.alpha,
                           lambda key: arms_module.config_values(records, key))
    return Comparison(runs=runs, groups=group_table(runs, arms.swept), bands=bands, cross=cross, paired=paired,
                      curves=curves, swept=arms.swept, budgets=budget, protocol=protocol, notes=notes, verdict=verdict,
                      target=target, gradients=gradient_table(records, runs))


@dataclass
class ArmPlacement:
    """Where each run stands: its arm (``labels``: run_id -> arm label), the settings its sweep varies
    (``settings``, by run_id; ``swept``: their names, the sampler first), the pairing with the baseline (None
    without one), the runs kept (duplicates resolved), and the notes of the placement and of each run's digests."""

    records: list[RunRecord]
    labels: pd.Series | None = None
    settings: pd.DataFrame | None = None
    swept: list[str] = field(default_factory=list)
    pairing: arms_module.Pairing | None = None
    notes: list[str] = field(default_factory=list)
    digest_notes: dict[str, list[str]] = field(default_factory=dict)


def place_arms(records: list[RunRecord], baseline: str | None, duplicates: str, mixed_digests: str) -> ArmPlacement:
    """Place every run in its arm (``arms.sweep_of``), resolve duplicate runs (``duplicates``), check the digests of
    each setting's runs (``mixed_digests``) and pair the arms with the baseline; before any run is analysed, so a
    bad selector fails first."""
    if not records:
        return ArmPlacement(records=records)
    sweep = arms_module.sweep_of(records)
    labels = sweep.values.apply(arms_module.arm_label, axis=1)
    kept, notes = arms_module.drop_duplicate_runs(records, labels, duplicates)
    if len(kept) < len(records):
        records = kept
        sweep = arms_module.sweep_of(records)
        labels = sweep.values.apply(arms_module.arm_label, axis=1)
    digest_notes = arms_module.check_digests(records, sweep, mixed_digests)
    notes += arms_module.pooled_launch_notes(records, labels)
    # a swept topology is the runs table's own topology column (summary.topology): not joined a second time
    topology = [arms_module.TOPOLOGY_KEY] if arms_module.TOPOLOGY_KEY in sweep.keys else []
    settings = sweep.values.drop(columns=["sampler", *topology]).join(arms_module.bucket_columns(records, sweep))
    pairing = arms_module.pair_arms(sweep, labels, baseline) if baseline else None
    return ArmPlacement(records=records, labels=labels, settings=settings,
                        swept=["sampler", *settings.columns, *topology],
                        pairing=pairing, notes=notes, digest_notes=digest_notes)


def _runs_table(analyses: list[RunAnalysis], arms: ArmPlacement, notes: list[str]) -> pd.DataFrame:
    """One row per run (``schema.RUN_COLUMNS``) with its arm, the settings its sweep varies and its digest notes."""
    runs = pd.DataFrame([a.row for a in analyses], columns=list(RUN_COLUMNS))
    if not arms.records:
        return runs
    runs["arm"] = runs["run_id"].map(arms.labels)
    runs = runs.join(arms.settings, on="run_id")
    runs["notes"] = [_joined(text, arms.digest_notes.get(run_id, []))
                     for run_id, text in zip(runs["run_id"], runs["notes"])]
    mixed = sum(any("compared anyway" in note for note in run_notes) for run_notes in arms.digest_notes.values())
    if mixed:
        notes.append(f"{mixed} run(s) were compared with runs of their setting trained against other target "
                     "weights or data (--mixed-digests=allow): see their notes")
    return runs


def _paired_endpoints(runs: pd.DataFrame, records: list[RunRecord], pairing: arms_module.Pairing | None,
                      protocol: Protocol, target: dict | None, notes: list[str]) -> tuple[pd.DataFrame, list[dict]]:
    """Each arm against its baseline on the protocol's endpoints (``paired.paired_table``; the time-to-target
    endpoints too where the rules state them), over finished runs; returns the paired table and the runs left out
    (each arm's stratum is set on ``runs``)."""
    if pairing is None:
        return pd.DataFrame(columns=list(PAIRED_COLUMNS)), []
    runs["stratum"] = runs["arm"].map(pairing.arms["stratum"])
    left_out = left_out_runs(records, runs)   # paired statistics and the verdict: finished runs only
    finished = runs[runs["status"] == "finished"]
    states_target = bool(RULES[protocol.rules]["time_to_target"] and target is not None)
    margins = {**(_target_margins(finished, target, pairing.arms) if states_target else {}), **protocol.margins}
    paired, paired_notes = paired_table(finished, pairing.arms, protocol.endpoints, margins,
                                        protocol.alpha, test=protocol.test,
                                        nested=RULES[protocol.rules]["nested"])
    notes += pairing.notes + paired_notes
    if states_target:
        paired, target_notes = _pair_target_endpoints(finished, pairing.arms, protocol, margins, paired, target)
        notes += [note for note in target_notes if note not in notes]
    if left_out:
        notes.append("paired comparisons and the verdict use finished runs only; left out: " + "; ".join(
            f"{entry['run']} ({entry['arm']} seed {entry['seed']}): {entry['reason']}" for entry in left_out))
    return paired, left_out


# ------------------------------------------------------------------------------------------------- gradients
GRADIENT_TABLE_COLUMNS = ("arm", "seed", *gradients.GRADIENT_COLUMNS, "grouped_by")


def run_warmup_steps(record: RunRecord) -> int | None:
    """The run's warmup W: summary.json ``warmup_steps``, else the LR schedule's rule
    (``metrics.gradients.warmup_steps``) on ``trainer.warmup_frac`` and summary ``end_step``; None when unknown.

    Example:
        >>> run_warmup_steps(RunRecord("r", "local", "/r", config={"trainer": {"warmup_frac": 0.04}},
        ...                            summary={"end_step": 390}))
        16
    """
    summary, trainer = record.summary, record.config.get("trainer") or {}
    if summary.get("warmup_steps") is not None:
        return int(summary["warmup_steps"])
    if trainer.get("warmup_frac") is not None and summary.get("end_step") is not None:
        return gradients.warmup_steps(float(trainer["warmup_frac"]), int(summary["end_step"]))
    return None


def regular_probes(probes: pd.DataFrame, record: RunRecord) -> pd.DataFrame:
    """The probe evals the forgetting figures read: all but the extra ones inside the warmup
    (``probes.warmup_evals``, ``metrics.gradients.warmup_probe_steps``) that are off the ``probes.every`` grid
    and not the run's last eval.
    band_forgetting and final_drop average over every eval they are given, so denser early evals would change
    them; without the extra evals they are what they were before the warmup had its own evals.

    Example:
        >>> record = RunRecord("r", "local", "/r", config={"probes": {"every": 15, "warmup_evals": 4}},
        ...                    summary={"warmup_steps": 16})
        >>> regular_probes(pd.DataFrame({"step": [0, 4, 8, 12, 15, 16, 30]}), record)["step"].tolist()
        [0, 15, 30]
    """
    section = record.config.get("probes") or {}
    warmup, every = run_warmup_steps(record), section.get("every")
    if not section.get("warmup_evals") or warmup is None or not every:
        return probes
    last = probes["step"].max()   # the run's final eval stays, wherever the run ended
    extra = [step for step in gradients.warmup_probe_steps(warmup, int(section["warmup_evals"]))
             if step % int(every) and step != last]
    return probes[~probes["step"].isin(extra)]


def run_gradients(record: RunRecord) -> tuple[list[dict], str]:
    """One run's gradient rows (``metrics.gradients.gradient_stats``) and what its groups are (bucket or
    probe_band): a finished run's summary.json ``gradients`` as the trainer wrote them; other runs (partial, or
    recorded before the summary held them) computed from their metrics rows with the same function, W from
    summary ``warmup_steps`` (else the LR schedule's rule on ``trainer.warmup_frac`` and ``end_step``), the clip
    from ``trainer.grad_clip`` and the bands from ``probe_bands``. ([], "") when nothing says enough.

    Example:
        >>> record = RunRecord("r", "local", "/r", summary={"status": "finished", "gradients": {
        ...     "rows": [{"bucket": 0, "phase": "after", "steps": 3}], "grouped_by": "bucket"}})
        >>> run_gradients(record)
        ([{'bucket': 0, 'phase': 'after', 'steps': 3}], 'bucket')
    """
    summary = record.summary
    recorded = summary.get("gradients")
    if not record.partial and isinstance(recorded, dict) and isinstance(recorded.get("rows"), list):
        return recorded["rows"], str(recorded.get("grouped_by") or "")
    warmup, grad_clip, steps = run_warmup_steps(record), run_grad_clip(record), record.steps
    if warmup is None or grad_clip is None or "grad_norm" not in steps.columns or steps.empty:
        return [], ""
    frame = steps[[c for c in ("step", "grad_norm", "clipped", "bucket", "max_len") if c in steps.columns]]
    rows = [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in row.items()}
            for row in frame.to_dict("records")]
    return (gradients.gradient_stats(rows, warmup=int(warmup), grad_clip=float(grad_clip),
                                     bands=summary.get("probe_bands")),
            gradients.grouped_by(_has_buckets(record)))


def run_grad_clip(record: RunRecord) -> float | None:
    """The clip the run trained with: summary.json ``gradients.grad_clip``, else ``trainer.grad_clip``; None when
    neither says."""
    recorded = record.summary.get("gradients")
    grad_clip = recorded.get("grad_clip") if isinstance(recorded, dict) else None
    return (record.config.get("trainer") or {}).get("grad_clip") if grad_clip is None else grad_clip


def _has_buckets(record: RunRecord) -> bool:
    """Whether the run's steps come from buckets: its summary's boundaries, else a bucket column it logged."""
    if "boundaries" in record.summary:
        return record.summary["boundaries"] is not None
    buckets = _column(record.steps, "bucket")
    return buckets is not None and bool((buckets >= 0).any())


def gradient_table(records: list[RunRecord], runs: pd.DataFrame) -> pd.DataFrame:
    """gradients.csv: one row per run, group and phase (GRADIENT_TABLE_COLUMNS), from :func:`run_gradients`.

    Example:
        >>> gradient_table([], pd.DataFrame()).columns.tolist() == list(GRADIENT_TABLE_COLUMNS)
        True
    """
    arms = dict(zip(runs["run_id"], runs["arm"])) if "arm" in runs.columns else {}
    rows = []
    for record in records:
        table, grouping = run_gradients(record)
        rows += [{"arm": arms.get(record.run_id, record.sampler), "seed": record.seed, **row, "grouped_by": grouping}
                 for row in table]
    return pd.DataFrame(rows, columns=list(GRADIENT_TABLE_COLUMNS))


def gradients_markdown(table: pd.DataFrame) -> str:
    """comparison.md's gradient section: per arm, group and phase, the mean over seeds of the pre-clip gradient
    norm (mean and median over steps) and of the clip fraction.

    Example:
        >>> print(gradients_markdown(pd.DataFrame(columns=list(GRADIENT_TABLE_COLUMNS))))
        No gradient norms recorded (runs without grad_norm, warmup or grad_clip records).
    """
    if table.empty:
        return "No gradient norms recorded (runs without grad_norm, warmup or grad_clip records)."
    numeric = ["steps", "grad_norm_mean", "grad_norm_median", "clip_frac"]
    values = table.assign(**{c: pd.to_numeric(table[c], errors="coerce") for c in numeric})
    keys = ["arm", "grouped_by", "bucket", "phase"]
    means = values.groupby(keys, sort=False)[numeric].mean()
    seeds = values.groupby(keys, sort=False)["seed"].nunique()
    order = {phase: i for i, phase in enumerate(gradients.PHASES)}
    rows = []
    for (arm, grouping, bucket, phase), stats in sorted(means.iterrows(),
                                                        key=lambda item: (str(item[0][0]), item[0][2],
                                                                          order.get(item[0][3], 9))):
        rows.append([str(arm), f"{grouping} {bucket}", str(phase), str(int(seeds[(arm, grouping, bucket, phase)])),
                     _format_number(stats["steps"], "", 3), _format_number(stats["grad_norm_mean"], "", 3),
                     _format_number(stats["grad_norm_median"], "", 3), _format_number(stats["clip_frac"], "", 2)])
    return _markdown(["arm", "group", "phase", "seeds", "steps", "grad norm mean", "grad norm median", "clip frac"],
                     rows)


def left_out_reason(record: RunRecord) -> str:
    """Why a run that did not finish is left out of paired statistics (its status, and its error if recorded).

    Example:
        >>> left_out_reason(RunRecord("r", "local", "/r", summary={"status": "failed", "error": "loss is nan"}))
        'failed: loss is nan'
        >>> left_out_reason(RunRecord("r", "local", "/r"))
        'no summary.json: crashed, killed or still running'
    """
    status = record.status
    if status == "failed":
        error = str(record.summary.get("error") or "no error recorded")
        return f"failed: {error[:200]}{'...' if len(error) > 200 else ''}"
    return {"no_summary": "no summary.json: crashed, killed or still running",
            "running": "status running: killed, or still running",
            "preempted": "preempted: its requeued job has not finished",
            "summary_unreadable": "summary.json unreadable (truncated or not JSON): killed while it was written, "
                                  "or damaged"}.get(status, f"status {status}")


def left_out_runs(records: list[RunRecord], runs: pd.DataFrame) -> list[dict]:
    """The runs that did not finish (status other than finished): run, arm, seed, status and why, in run order."""
    arm_of = dict(zip(runs["run_id"], runs["arm"]))
    return [{"run": record.run_id, "arm": arm_of.get(record.run_id), "seed": record.seed, "status": record.status,
             "reason": left_out_reason(record)} for record in records if record.status != "finished"]


def _window_start_index(window: float | str, step: np.ndarray | None, summary: dict) -> int | None:
    """The index of the first logged step inside a fixed analysis window (None: ``steady``, each run's own)."""
    if window == "steady" or step is None or not len(step):
        return None
    end = summary.get("end_step")
    end = float(end) if isinstance(end, (int, float)) and end > 0 else float(np.nanmax(step))
    return min(int(np.searchsorted(step, float(window) * end, side="right")), len(step) - 1)


def _joined(text, more: list[str]) -> str:
    """A run's notes with `more` appended (each once), "; "-separated."""
    parts = [text] if isinstance(text, str) and text else []
    return "; ".join(dict.fromkeys(parts + list(more)))


def _budget_endpoints(runs: pd.DataFrame, analyses: list[RunAnalysis]) -> pd.DataFrame:
    """Fill probe_loss_at_<axis> at the common budgets of the finished runs, and probe_loss_early over the first
    EARLY_SHARE of the common step budget; returns every run's curve (long)."""
    finished = [a.curve for a, partial in zip(analyses, runs["partial"]) if not partial and len(a.curve)]
    common = budgets.common_budgets(finished) if finished else {axis: float("nan") for axis in budgets.AXES}
    for axis, endpoint in budgets.ENDPOINT_OF_AXIS.items():
        runs[endpoint] = [budgets.probe_loss_at(a.curve, axis, common[axis]) for a in analyses]
        if endpoint not in COMPARISON_COLUMNS:
            continue
        for index, analysis in zip(runs.index, analyses):
            if np.isfinite(runs.at[index, endpoint]):
                continue
            end = budgets.curve_end(analysis.curve, axis)
            if not np.isfinite(end):
                reason = f"no probe curve on the {axis} axis"
            elif not np.isfinite(common[axis]):
                reason = f"no common {axis} budget (a finished run cannot be placed on that axis)"
            elif end < common[axis]:
                reason = f"the probe curve ends at {end:.0f} {axis}, before the common budget {common[axis]:.0f}"
            else:
                reason = f"no probe loss at the common budget {common[axis]:.0f} {axis}"
            runs.at[index, "notes"] = "; ".join(filter(None, [runs.at[index, "notes"], f"{endpoint}: {reason}"]))
    early_end = budgets.EARLY_SHARE * common["steps"]
    runs["probe_loss_early"] = [budgets.mean_probe_loss_until(a.curve, "steps", early_end) for a in analyses]
    curves = [a.curve.assign(run_id=a.row["run_id"]) for a in analyses if len(a.curve)]
    frame = pd.concat(curves, ignore_index=True) if curves else pd.DataFrame()
    if len(frame):
        frame = frame.merge(runs[["run_id", "arm", "seed"]], on="run_id", how="left")
    frame.attrs["budgets"] = common
    return frame


TIME_TO_TARGET_ENDPOINTS = (*budgets.TARGET_ENDPOINT_OF_AXIS.values(), "probe_loss_early")


def _add_note(runs: pd.DataFrame, index, note: str) -> None:
    runs.at[index, "notes"] = "; ".join(filter(None, [runs.at[index, "notes"], note]))


def _target_endpoints(runs: pd.DataFrame, analyses: list[RunAnalysis], declared: dict | None,
                      common: dict[str, float], baseline_of: dict, notes: list[str]) -> dict | None:
    """Fix the time-to-target level (analysis.target) and fill steps/tokens/time_to_target of every run.

    A fixed level (probe_loss) applies to every run. Rule baseline_mean_at: each baseline arm's level is the mean
    over its finished runs of the probe loss at `at` x the common step budget; every arm is read at its own
    stratum's baseline level, so the level depends on the baseline's curves alone, never on the arms compared with
    it. A run whose curve never reaches its level keeps NaN and a note (it is left out of the paired rows).

    Returns:
        None without a declared target, else {rule, at, step, margin, levels (baseline arm -> level; "all" for a
        fixed level), fixed_by (in words), not_reached (run, arm, seed, level, lowest probe loss, last eval step)}.
    """
    if declared is None:
        return None
    finished = ~runs["partial"].astype(bool)
    target, level_of_run = _target_levels(runs, analyses, declared, common, baseline_of, finished, notes)
    for index, analysis, level in zip(runs.index, analyses, level_of_run):
        for axis, endpoint in budgets.TARGET_ENDPOINT_OF_AXIS.items():
            runs.at[index, endpoint] = budgets.time_to_target(analysis.curve, axis, level)
        if not np.isfinite(level):
            continue
        if not np.isfinite(runs.at[index, "steps_to_target"]):
            missed = _never_reached(runs, index, analysis.curve, level)
            if finished[index]:
                target["not_reached"].append(missed)
        elif not np.isfinite(runs.at[index, "time_to_target"]):
            _add_note(runs, index, "time_to_target: no modelled time (give analysis.cost or --cost)")
    return target


def _target_levels(runs: pd.DataFrame, analyses: list[RunAnalysis], declared: dict, common: dict[str, float],
                   baseline_of: dict, finished: pd.Series, notes: list[str]) -> tuple[dict, list[float]]:
    """The target (``_target_endpoints``' record, its levels fixed) and the level each run is read at: the declared
    probe loss for every run, or its stratum's baseline arm's mean at ``at`` x the common step budget."""
    rule = declared.get("rule", "fixed")
    target = {"rule": rule, "at": declared.get("at"), "step": None, "margin": declared.get("margin"),
              "levels": {}, "fixed_by": "", "not_reached": []}
    if rule == "fixed":
        target["levels"] = {"all": float(declared["probe_loss"])}
        target["fixed_by"] = "declared before the runs (analysis.target.probe_loss)"
        return target, [target["levels"]["all"]] * len(runs)
    step = float(declared["at"]) * common["steps"]
    target["step"] = step if np.isfinite(step) else None
    for baseline in dict.fromkeys(b for b in baseline_of.values() if isinstance(b, str)):
        own = [budgets.probe_loss_at(a.curve, "steps", step)
               for a, arm, done in zip(analyses, runs["arm"], finished) if arm == baseline and done]
        own = [value for value in own if np.isfinite(value)]
        if own:
            target["levels"][baseline] = float(np.mean(own))
    target["fixed_by"] = (f"the baseline arm's mean probe loss at {declared['at']:g} x the common step budget "
                          f"(step {step:.0f}), over its finished runs, before the arms were compared")
    if not target["levels"]:
        notes.append("analysis.target: rule baseline_mean_at needs a baseline arm with finished runs whose "
                     "curves reach the step it names (declare analysis.baseline): no time-to-target endpoints")
    return target, [target["levels"].get(baseline_of.get(arm), float("nan")) for arm in runs["arm"]]


def _never_reached(runs: pd.DataFrame, index, curve: pd.DataFrame, level: float) -> dict:
    """Note on the run's row that its curve never reached ``level``; returns the ``not_reached`` entry."""
    curve = curve.dropna(subset=["probe_loss"])
    lowest = float(curve["probe_loss"].min()) if len(curve) else float("nan")
    last = float(curve["steps"].max()) if len(curve) else float("nan")
    _add_note(runs, index, f"steps_to_target, tokens_to_target, time_to_target: never reached the target "
                           f"probe loss {level:.4g} (lowest {lowest:.4g}, last eval at step {last:.0f}); "
                           "not extrapolated")
    seed = runs.at[index, "seed"]
    return {"run": runs.at[index, "run_id"], "arm": runs.at[index, "arm"],
            "seed": None if pd.isna(seed) else int(seed), "level": level, "lowest": lowest, "last_step": last}


def _target_margins(finished: pd.DataFrame, target: dict | None, arms: pd.DataFrame) -> dict[str, float]:
    """The TOST margins of the time-to-target endpoints in their own units: the declared ratio margin x the
    baseline arm's mean (the smallest over baseline arms: the strictest); {} without a ratio margin.

    Example:
        >>> runs = pd.DataFrame({"arm": ["b", "b", "q"], "steps_to_target": [100.0, 120.0, 150.0]})
        >>> _target_margins(runs, {"margin": 0.1}, pd.DataFrame({"baseline": ["b", "b"]}, index=["b", "q"]))
        {'steps_to_target': 11.0}
    """
    if target is None or target.get("margin") is None:
        return {}
    baselines = set(arms["baseline"].dropna())
    margins = {}
    for endpoint in budgets.TARGET_ENDPOINT_OF_AXIS.values():
        if endpoint not in finished.columns:
            continue
        means = [pd.to_numeric(finished.loc[finished["arm"] == b, endpoint], errors="coerce").mean()
                 for b in baselines]
        means = [m for m in means if np.isfinite(m) and m > 0]
        if means:
            margins[endpoint] = float(target["margin"] * min(means))
    return margins


def _pair_target_endpoints(finished: pd.DataFrame, arms: pd.DataFrame, protocol: Protocol,
                           margins: dict[str, float], paired: pd.DataFrame,
                           target: dict) -> tuple[pd.DataFrame, list[str]]:
    """Add the time-to-target endpoints and probe_loss_early to the paired table (rules version >= 5, a target
    declared): those not among analysis.endpoints form a Holm family of their own, so the declared endpoints'
    p_holm is what it was; and say which seed pairs a never-reaching run removed."""
    notes = []
    extra = tuple(name for name in TIME_TO_TARGET_ENDPOINTS if name not in protocol.endpoints)
    if extra:
        more, more_notes = paired_table(finished, arms, extra, margins, protocol.alpha, test=protocol.test,
                                        nested=RULES[protocol.rules]["nested"])
        paired = pd.concat([paired, more], ignore_index=True) if len(paired) else more
        notes += more_notes + [f"{', '.join(extra)}: paired as a Holm family of their own (analysis.target is "
                               "declared; not among analysis.endpoints), so the declared endpoints' p_holm is "
                               "unchanged"]
    for entry in target["not_reached"]:
        notes.append(f"steps_to_target, tokens_to_target, time_to_target: {entry['run']} ({entry['arm']} seed "
                     f"{entry['seed']}) never reached probe loss {entry['level']:.4g} (lowest {entry['lowest']:.4g} "
                     f"by step {entry['last_step']:.0f}): its seed pair is left out, so those paired rows rest on "
                     "fewer pairs (n_pairs); the run left out is a slow one, so the paired difference understates "
                     "the gap")
    return paired, notes


def _long_tables(analyses: list[RunAnalysis], runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    band_tables, matrices = [], []
    for analysis, arm in zip(analyses, runs["arm"]):
        ident = {k: analysis.row[k] for k in ("run_id", "sampler", "seed")} | {"arm": arm}
        if not analysis.bands.empty:
            band_tables.append(analysis.bands.reset_index().rename(columns={"index": "band"}).assign(**ident))
        if not analysis.cross.empty:
            long = analysis.cross.stack(future_stack=True).rename("cross_effect").dropna().reset_index()
            matrices.append(long.assign(**ident))
    bands = pd.concat(band_tables, ignore_index=True) if band_tables else pd.DataFrame()
    cross = pd.concat(matrices, ignore_index=True) if matrices else pd.DataFrame()
    return bands, cross


def group_table(runs: pd.DataFrame, setting_columns: list[str]) -> pd.DataFrame:
    """One row per arm: its setting columns, n_runs, n_partial, seeds, and <col>_mean / <col>_std (ddof 1; NaN for
    one seed) of the numeric run columns.

    Example:
        >>> runs = pd.DataFrame({"arm": ["a", "a"], "sampler": ["a", "a"], "seed": [0, 1],
        ...                      "partial": [False, True], "ktok_s": [1.0, 3.0]})
        >>> group_table(runs, ["sampler"])[["n_runs", "seeds", "ktok_s_mean", "ktok_s_std"]].round(3).values.tolist()
        [[2, '0 1', 2.0, 1.414]]
    """
    if runs.empty:
        return pd.DataFrame()
    frame = runs.assign(arm=runs["arm"].fillna(runs["sampler"]).fillna("unknown"))
    numeric = [c for c in NUMERIC_RUN_COLUMNS if c in frame.columns and c != "seed"]
    values = frame[numeric].apply(pd.to_numeric, errors="coerce")
    grouped = values.groupby(frame["arm"], sort=False)
    stats = pd.concat([grouped.mean().add_suffix("_mean"), grouped.std(ddof=1).add_suffix("_std")], axis=1)
    by_arm = frame.groupby("arm", sort=False)
    settings = by_arm[[c for c in [*setting_columns, "stratum"] if c in frame.columns]].first()
    counts = pd.DataFrame({
        "n_runs": by_arm.size(),
        "n_partial": by_arm["partial"].sum().astype(int),
        "seeds": by_arm["seed"].agg(lambda s: " ".join(str(int(v)) for v in sorted(s.dropna()))),
    })
    ordered = [f"{c}_{suffix}" for c in numeric for suffix in ("mean", "std")]
    table = pd.concat([settings, counts, stats[ordered]], axis=1).rename_axis("arm")
    return table.sort_values([c for c in ("stratum", "sampler") if c in table.columns] or ["n_runs"], kind="stable")


# ------------------------------------------------------------------------------------------------- markdown
def _format_number(value: float, column: str, digits: int = 4) -> str:
    if value is None or pd.isna(value) or not np.isfinite(value):
        return "n/a"
    if column in {"eta_s", "full_run_eta_s", "real_tokens"} or abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def paired_markdown(paired: pd.DataFrame) -> str:
    """The paired table as markdown: arm, endpoint, better direction, n, diff [t CI], bootstrap CI, the three
    tests' p, p_holm, margin, verdict, minimum detectable difference and the seeds the margin needs.

    Example:
        >>> print(paired_markdown(pd.DataFrame(columns=list(PAIRED_COLUMNS))))
        No paired comparison (give --baseline or declare analysis.baseline).
    """
    if paired.empty:
        return "No paired comparison (give --baseline or declare analysis.baseline)."
    rows = []
    for _, r in paired.iterrows():
        rows.append([
            str(r["policy"]), str(r["baseline"]), str(r["endpoint"]), f"{r['better']} is better", _pairs_cell(r),
            f"{_format_number(r['diff'], r['endpoint'])} [{_format_number(r['ci_low'], '')}, "
            f"{_format_number(r['ci_high'], '')}]",
            f"[{_format_number(r['boot_low'], '')}, {_format_number(r['boot_high'], '')}]",
            _format_number(r["p_t"], "", 3), _format_number(r["p_bca"], "", 3), _format_number(r["p_value"], "", 3),
            _format_number(r["p_holm"], "", 3), _format_number(r["margin"], ""), f"**{r['verdict']}**",
            _format_number(r["mdd"], ""), _format_number(r["seeds_needed"], "", 0),
        ])
    headers = ["arm", "baseline", "endpoint", "direction", "pairs", "diff [t CI]", "bootstrap CI", "p_t", "p_bca",
               "p_sign", "p_holm", "margin", "verdict", "mdd", "seeds"]
    return _markdown(headers, rows)


def _pairs_cell(row: pd.Series) -> str:
    """The number of analysis units, naming targets and their seeds where the target is the unit."""
    if row.get("unit") == "target":
        return f"{row['n_pairs']} targets ({row['n_seeds']} seeds)"
    return str(row["n_pairs"])


def markdown_tables(comparison: Comparison, columns: tuple[str, ...] = COMPARISON_COLUMNS) -> str:
    """comparison.md: per-arm mean +- std over seeds, paired differences vs the baseline, equal-compute budgets,
    one row per run, notes.

    Example:
        >>> print(markdown_tables(compare_records([])))
        No runs loaded.
    """
    if comparison.runs.empty:
        return "No runs loaded."
    parts = [*_per_setting_section(comparison, columns), *_paired_section(comparison),
             *_equal_compute_section(comparison), *_time_to_target_section(comparison),
             *_gradient_section(comparison), *_per_run_section(comparison, columns), *_notes_section(comparison)]
    return "\n".join(parts)


def _per_setting_section(comparison: Comparison, columns: tuple[str, ...]) -> list[str]:
    setting_columns = [c for c in comparison.swept if c != "sampler"]
    group_rows = []
    for arm, stats in comparison.groups.iterrows():
        partial = f" ({int(stats['n_partial'])} partial)" if stats["n_partial"] else ""
        cells = [str(arm), *[str(stats.get(c, "")) for c in setting_columns], f"{int(stats['n_runs'])}{partial}"]
        for column in columns:
            mean, std = stats[f"{column}_mean"], stats[f"{column}_std"]
            text = _format_number(mean, column)
            if np.isfinite(mean) and np.isfinite(std):
                text += f" ± {_format_number(std, column, digits=2)}"
            cells.append(text)
        group_rows.append(cells)
    return ["## Per setting (mean ± std over seeds)", "",
            _markdown(["arm", *setting_columns, "runs", *columns], group_rows), ""]


def _paired_section(comparison: Comparison) -> list[str]:
    protocol = comparison.protocol
    return [f"## Paired differences vs baseline `{protocol.baseline}` (same seed = same init and data)"
            if protocol.baseline else "## Paired differences: none (no baseline declared)", "",
            f"diff = arm − baseline, mean over seed pairs (over targets, each the mean of its seeds, where seeds "
            f"nest in several targets: rules version >= 5); {100 * (1 - protocol.alpha):.0f}% t and bootstrap "
            "intervals; p_t: paired t test, p_bca: BCa bootstrap test, p_sign: exact sign-flip test; p_holm: Holm "
            f"over the endpoints of an arm of the verdict's test ({protocol.test}); verdict: TOST against the "
            "declared margin, else the sign of a Holm-significant difference; mdd: the difference detectable with "
            "power 0.8 at these units; seeds: units (seeds, or targets) needed for the margin.", "",
            paired_markdown(comparison.paired), ""]


def _arm_means(comparison: Comparison, headers: list[str]) -> str:
    """A table of the arms' means (over seeds) of ``headers[1:]``."""
    return _markdown(headers, [[str(arm)] + [_format_number(stats[f"{c}_mean"], c) for c in headers[1:]]
                               for arm, stats in comparison.groups.iterrows()])


def _equal_compute_section(comparison: Comparison) -> list[str]:
    budget = comparison.budgets
    return ["## Equal compute", "",
            "Mean probe loss over bands, read at the budget every finished run reaches: "
            f"{_format_number(budget['steps'], 'steps')} optimizer steps, "
            f"{_format_number(budget['real_tokens'], 'real_tokens')} real tokens, "
            f"{_format_number(budget['modelled_time_s'], 'time')} s modelled time"
            + ("" if comparison.protocol.cost else " (no cost model: give --cost or analysis.cost)") + ".", "",
            _arm_means(comparison, ["arm", "probe_loss_final", "probe_loss_at_steps", "probe_loss_at_tokens",
                                    "probe_loss_at_time"]), ""]


def _time_to_target_section(comparison: Comparison) -> list[str]:
    if comparison.target is None:
        return []
    levels = ", ".join(f"{level:.4g}" + ("" if arm == "all" else f" ({arm})")
                       for arm, level in comparison.target["levels"].items()) or "n/a"
    return ["## Time to target", "",
            f"Probe loss {levels}, {comparison.target['fixed_by']}: where each run's probe curve first reaches "
            f"it (interpolated between evals), mean over the arm's runs that reached it (a run that never did is named in "
            f"the notes). probe_loss_early: mean probe loss over the "
            f"first {budgets.EARLY_SHARE:.0%} of the common step budget.", "",
            _arm_means(comparison, ["arm", "steps_to_target", "tokens_to_target", "time_to_target",
                                    "probe_loss_early"]), ""]


def _gradient_section(comparison: Comparison) -> list[str]:
    return ["## Gradient norm by bucket and phase (mean over seeds)", "",
            "Pre-clip global gradient norm per optimizer step, grouped by the step's bucket (policies without "
            "buckets: the probe band of its longest document) and phase (warmup: the LR schedule's linear rise; "
            "after: the rest); clip frac: share of steps with norm > trainer.grad_clip > 0 (gradients.csv).", "",
            gradients_markdown(comparison.gradients), ""]


def _per_run_section(comparison: Comparison, columns: tuple[str, ...]) -> list[str]:
    run_rows = []
    for _, run in comparison.runs.iterrows():
        seed = "n/a" if pd.isna(run["seed"]) else str(int(run["seed"]))
        status = str(run["status"]) + (" (partial)" if run["partial"] else "")
        topology = str(run.get("topology") or "") if not pd.isna(run.get("topology")) else ""
        run_rows.append([str(run["run_id"]), str(run["arm"]), seed, status, topology or "n/a"]
                        + [_format_number(run[c], c) for c in columns])
    return ["## Per run", "", "topology: nodes x ranks per node.", "",
            _markdown(["run", "arm", "seed", "status", "topology", *columns], run_rows)]


def _notes_section(comparison: Comparison) -> list[str]:
    runs = comparison.runs
    noted = runs[runs["notes"].astype(str).str.len() > 0]
    if not len(noted) and not comparison.notes:
        return []
    return ["", "## Notes", "", *[f"- {note}" for note in comparison.notes],
            *[f"- `{r['run_id']}`: {r['notes']}" for _, r in noted.iterrows()]]
