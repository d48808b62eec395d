"""The one schema every run source (local run directory, W&B run, offline W&B run) is loaded into.

A loaded run is a `RunRecord`: identity and status, the resolved config, the final summary, and three long tables
whose columns are the run-directory contract (`dflash_lab.records.record`):

    steps          one row per logged training step   STEP_COLUMNS    (metrics.jsonl)
    probes         one row per (eval, band)           PROBE_COLUMNS   (probes.jsonl)
    presentations  one row per example presentation  PRESENTATION_COLUMNS (presentations.parquet)

Analysis turns records into the comparison table: one row per run with RUN_COLUMNS first (see `RUN_COLUMN_DOCS`
for the formula behind each column; the swept keys follow), per-arm aggregates (mean and std over seeds), and paired
differences against a baseline arm (`BETTER` says which way each endpoint improves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from dflash_lab.records.record import PRESENTATION_COLUMNS, PROBE_FIELDS, STEP_FIELDS, SUMMARY_FIELDS

STEP_COLUMNS: tuple[str, ...] = STEP_FIELDS
PROBE_COLUMNS: tuple[str, ...] = PROBE_FIELDS
SUMMARY_KEYS: tuple[str, ...] = SUMMARY_FIELDS

# Status of a run whose summary.json is missing: it crashed or is still running; figures come from metrics.jsonl.
STATUS_NO_SUMMARY = "no_summary"
# Status of a run whose summary.json exists but cannot be read (truncated, not JSON): never "no summary.json".
STATUS_SUMMARY_UNREADABLE = "summary_unreadable"

# Column -> where its value comes from. "summary:" columns fall back to the steps table for partial runs.
RUN_COLUMN_DOCS: dict[str, str] = {
    "run_id": "run directory name or W&B run id",
    "name": "display name (run directory name or W&B run name)",
    "source": "local | wandb | wandb_offline",
    "location": "run directory path or W&B path entity/project/id",
    "group": "experiment / W&B group",
    "sampler": "summary.sampler, else config sampler.name",
    "seed": "summary.seed, else config seed",
    "arm": "the run's setting: sampler plus every swept key (analysis.arms), seeds aggregated",
    "stratum": "the swept keys an arm is not compared on (e.g. data.band_skills=aligned); pairs stay inside one",
    "status": "summary.status (finished | failed | running | preempted), else no_summary or summary_unreadable",
    "partial": "True unless status == finished",
    "steps": "summary.steps, else last logged step",
    "topology": "summary.topology: nodes x ranks per node (2x8: 16 ranks on 2 nodes; 1+2 when nodes differ); "
                "empty for runs recorded before it was",
    "nodes": "summary.rank_nodes: the nodes the ranks ran on, in first-rank order",
    "ktok_s": "summary.ktok_s, else throughput.steady_state_ktok_s(steps.ktok_s)",
    "pad_eff": "summary.pad_eff, else throughput.padding_efficiency(steps.real_tokens, steps.padded_tokens)",
    "eta_s": "summary.eta_s, else the last logged eta_s",
    "full_run_eta_s": "summary.full_run_eta_s",
    "overhead_frac": "summary.overhead_frac",
    "steady_start_step": "jumpiness.steady_state_start: first step after 90% of the loss EMA's descent (>= 10%)",
    "jumpiness": "jumpiness.jumpiness: std(d_t), d_t = log L_t - log L_(t-1), steady state",
    "robust_jumpiness": "jumpiness.robust_jumpiness: 1.4826 median(|d - median d|), steady state",
    "resid_lag1_acf": "jumpiness.autocorrelation(L_t - EMA_t, lag 1), steady state",
    "spike_score": "jumpiness.spike_flags: share of steps with L_t > mean(W) + 6 std(W), W = previous 128",
    "length_r2": "jumpiness.length_confound: R^2 of r_t on [log mean_len, log max_len, one_hot(bucket)]",
    "residual_jumpiness": "jumpiness.length_confound: jumpiness of EMA_t + fit residual",
    "band_forgetting": "forgetting.band_forgetting: F_b averaged over probe bands",
    "final_drop": "forgetting.final_drop: drop_b averaged over probe bands",
    "max_final_drop": "forgetting.final_drop: the largest drop_b over probe bands",
    "forgetting_window_evals": "forgetting.probe_dynamics: probe evals at or after the steady-state start",
    "residual_amplitude": "forgetting.residual_amplitude: A, std of band-relative detrended log probe loss, "
                          "mean over bands",
    "own_share_slope": "forgetting.own_share_slope: beta, slope of a band's probe log-loss change on its own "
                       "token share (token-weighted over bands); < 0: the model follows what it saw recently",
    "own_share_slope_se": "forgetting.own_share_slope: standard error of beta",
    "cross_band_effect": "forgetting.cross_band_effects: mean over pairs of the slope of band b's change on s_a "
                         "against the reference band r(b), own share held; > 0: interference",
    "order_period_steps": "forgetting.order_period_steps: steps per epoch for a periodic order, else NaN",
    "loop_score": "forgetting.loop_score: autocorrelation of band residuals at the order's period (periodic "
                  "orders only, else NaN)",
    "loop_lag_evals": "forgetting.loop_score: lag L in evals",
    "forgetting_events_per_example": "forgetting.example_forgetting: mean learned->not-learned events per example "
                                     "(examples presented >= 3 times)",
    "frac_ever_forgotten": "forgetting.example_forgetting: share of examples with >= 1 event",
    "frac_never_learned": "forgetting.example_forgetting: share of examples never at acc >= 0.5",
    "real_tokens_total": "budgets.compute_axes: real training tokens over the run",
    "modelled_time_s": "budgets.compute_axes: modelled step time summed over the run (cost model c0 + c1 padded "
                       "+ c2 attention, per rank)",
    "probe_loss_final": "budgets.mean_probe_loss at the last eval (mean over bands)",
    "probe_loss_at_steps": "budgets: mean probe loss interpolated at the comparison's common optimizer-step budget",
    "probe_loss_at_tokens": "budgets: mean probe loss interpolated at the common real-token budget",
    "probe_loss_at_time": "budgets: mean probe loss interpolated at the common modelled-time budget",
    "probe_loss_early": "budgets.mean_probe_loss_until: mean probe loss over the first 25% of the common step "
                        "budget (trapezoid area under the probe curve / width)",
    "steps_to_target": "budgets.time_to_target: optimizer steps at which the probe curve first reaches the "
                       "declared target (analysis.target), interpolated between evals; NaN if never reached",
    "tokens_to_target": "budgets.time_to_target on the real-token axis",
    "time_to_target": "budgets.time_to_target on the modelled-time axis (seconds; NaN without a cost model)",
    "final_loss": "summary.final_loss, else the last logged loss",
    "final_acc": "summary.final_acc, else the last logged acc",
    "tau": "summary.tau: acceptance length of greedy speculative decoding",
    "tau_baseline": "summary.tau_baseline: tau of the untrained draft",
    "tau_band_min": "summary.tau_band_min: the worst probe band's tau (tau prompts spread over the bands)",
    "tau_band_mean": "summary.tau_band_mean: the mean over probe bands of tau per band",
    "target_seed": "summary.target_seed: the tiny target's pretraining seed (seed mod target_seeds: seeds nested "
                   "within targets, dflash_lab/replicates.py); NaN for a given target (model=hf)",
    "target_digest": "summary.target_digest: a digest of the target's weights (one per target)",
    "tau_se": "summary.tau_se: prompt-bootstrap standard error of tau (draft_quality.tau_bootstrap_se)",
    "tau_prompts": "summary.tau_prompts: held-out prompts tau was measured on",
    "notes": "what was missing or approximated for this run",
}
RUN_COLUMNS: tuple[str, ...] = tuple(RUN_COLUMN_DOCS)

# Columns of the comparison tables (comparison.md), in order: the figures the ablation is judged on.
COMPARISON_COLUMNS: tuple[str, ...] = (
    "ktok_s",
    "pad_eff",
    "jumpiness",
    "spike_score",
    "residual_amplitude",
    "own_share_slope",
    "cross_band_effect",
    "loop_score",
    "band_forgetting",
    "forgetting_events_per_example",
    "probe_loss_at_tokens",
    "final_loss",
    "tau",
)
TEXT_RUN_COLUMNS = frozenset(
    {"run_id", "name", "source", "location", "group", "sampler", "arm", "stratum", "status", "partial", "notes",
     "target_digest", "topology", "nodes"}
)
NUMERIC_RUN_COLUMNS: tuple[str, ...] = tuple(c for c in RUN_COLUMNS if c not in TEXT_RUN_COLUMNS)

# Which way is better for each column a paired comparison may use as an endpoint ("higher" or "lower").
BETTER: dict[str, str] = {
    "ktok_s": "higher", "pad_eff": "higher", "eta_s": "lower", "full_run_eta_s": "lower", "overhead_frac": "lower",
    "jumpiness": "lower", "robust_jumpiness": "lower", "resid_lag1_acf": "lower", "spike_score": "lower",
    "length_r2": "lower", "residual_jumpiness": "lower", "band_forgetting": "lower", "final_drop": "lower",
    "max_final_drop": "lower", "residual_amplitude": "lower", "own_share_slope": "higher",
    "cross_band_effect": "lower", "loop_score": "lower", "forgetting_events_per_example": "lower",
    "frac_ever_forgotten": "lower", "frac_never_learned": "lower", "modelled_time_s": "lower",
    "probe_loss_final": "lower", "probe_loss_at_steps": "lower", "probe_loss_at_tokens": "lower",
    "probe_loss_at_time": "lower", "probe_loss_early": "lower", "steps_to_target": "lower",
    "tokens_to_target": "lower", "time_to_target": "lower", "final_loss": "lower", "final_acc": "higher", "tau": "higher",
    "tau_band_min": "higher", "tau_band_mean": "higher",
}

# Endpoints of the paired comparison when the sweep declares none (analysis.endpoints). Holm's correction runs over
# these, so the list is short: one throughput, one jumpiness, the shuffled-order forgetting figures, one quality.
DEFAULT_ENDPOINTS: tuple[str, ...] = (
    "ktok_s", "jumpiness", "residual_amplitude", "own_share_slope", "band_forgetting", "probe_loss_at_tokens",
)


def conform(frame: pd.DataFrame | None, columns: tuple[str, ...]) -> tuple[pd.DataFrame, list[str]]:
    """Reorder `frame` to `columns`, adding missing ones as NaN; returns (frame, names of missing columns).

    Extra columns are kept after the contract ones (a newer trainer may log more).

    Example:
        >>> frame, missing = conform(pd.DataFrame({"b": [1]}), ("a", "b"))
        >>> list(frame.columns), missing
        (['a', 'b'], ['a'])
    """
    if frame is None:
        frame = pd.DataFrame()
    missing = [c for c in columns if c not in frame.columns]
    extra = [c for c in frame.columns if c not in columns]
    result = frame.copy()
    for name in missing:
        result[name] = np.nan
    return result[list(columns) + extra], missing


@dataclass
class RunRecord:
    """One training run in the common schema, whatever it was loaded from.

    Attributes:
        run_id: run directory name or W&B id (unique within one comparison).
        source: "local", "wandb" or "wandb_offline".
        location: where it was read from (directory path or W&B path).
        config: resolved training config (nested dict; empty if unknown).
        summary: summary.json contents (empty if the run has none).
        steps / probes / presentations: the contract tables (probes / presentations may be empty).
        overrides: the run's Hydra task overrides ("key=value" strings) when the source recorded them, else None
            (`analysis.arms.recorded_overrides` then reads .hydra/overrides.yaml of a local run).
        messages: human-readable notes on anything missing or repaired while loading.
    """

    run_id: str
    source: str
    location: str
    name: str = ""
    group: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    steps: pd.DataFrame = field(default_factory=lambda: conform(None, STEP_COLUMNS)[0])
    probes: pd.DataFrame = field(default_factory=lambda: conform(None, PROBE_COLUMNS)[0])
    presentations: pd.DataFrame = field(default_factory=lambda: conform(None, PRESENTATION_COLUMNS)[0])
    overrides: list[str] | None = None
    messages: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        """summary.status, or "no_summary" when the run never wrote its summary (crashed or still running)."""
        if not self.summary:
            return STATUS_NO_SUMMARY
        return str(self.summary.get("status") or "finished")

    @property
    def partial(self) -> bool:
        """True for any run that did not finish: its figures are computed from what it logged."""
        return self.status != "finished"

    @property
    def sampler(self) -> str | None:
        """Policy name: summary.sampler, else config sampler.name (or a flat "sampler.name"/"sampler" key)."""
        value = self.summary.get("sampler")
        if value:
            return str(value)
        sampler_cfg = self.config.get("sampler")
        if isinstance(sampler_cfg, dict) and sampler_cfg.get("name"):
            return str(sampler_cfg["name"])
        if isinstance(sampler_cfg, str):
            return sampler_cfg
        flat = self.config.get("sampler.name") or self.config.get("sampler/name")
        return str(flat) if flat else None

    @property
    def seed(self) -> int | None:
        """summary.seed, else config seed."""
        for value in (self.summary.get("seed"), self.config.get("seed")):
            if value is not None and not (isinstance(value, float) and np.isnan(value)):
                return int(value)
        return None
