"""Time to target and the early-window gap (issue 25): the definition on the committed natural-data curves, on
small synthetic curves, the declared analysis.target, and the verdict's trade sentence under rules version 5 only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dflash_lab import compare
from dflash_lab.analysis import budgets
from dflash_lab.analysis import protocol as protocol_module
from dflash_lab.analysis import load_runs, markdown_tables
from dflash_lab.analysis.paired import paired_table
from dflash_lab.analysis.protocol import Protocol, check_target, protocol_from_section
from dflash_lab.analysis.summarize import compare_records
from helpers import write_run

CURVES = Path(__file__).resolve().parents[1] / "docs" / "ablation_natural" / "curves.csv"
BUCKETED, FULL_RANDOM = "bucketed bucket_by=length", "full_random"


# ------------------------------------------------------------------------------ (a) the committed natural curves
def test_bucketed_needs_35_more_steps_than_full_random_to_reach_probe_loss_2_316():
    """The review's figures from docs/ablation_natural/curves.csv: first crossing of 2.316, interpolated between
    the crossing eval and the one before, paired by seed over seeds 0-4 (95% t interval)."""
    curves = pd.read_csv(CURVES)
    rows = []
    for (arm, seed), curve in curves[curves["arm"].isin([BUCKETED, FULL_RANDOM])].groupby(["arm", "seed"]):
        rows.append({"arm": arm, "seed": seed, **{endpoint: budgets.time_to_target(curve, axis, 2.316)
                                                  for axis, endpoint in budgets.TARGET_ENDPOINT_OF_AXIS.items()}})
    runs = pd.DataFrame(rows)
    arms = pd.DataFrame({"stratum": "", "baseline": FULL_RANDOM}, index=[BUCKETED, FULL_RANDOM])
    table, _ = paired_table(runs, arms, tuple(budgets.TARGET_ENDPOINT_OF_AXIS.values()), {})
    steps = table.set_index("endpoint").loc["steps_to_target"]
    time = table.set_index("endpoint").loc["time_to_target"]
    assert steps["n_pairs"] == 5 and steps["seeds"] == "0 1 2 3 4"
    assert [round(steps[c]) for c in ("diff", "ci_low", "ci_high")] == [35, 21, 49]
    assert steps["diff"] == pytest.approx(35.368, abs=1e-3)
    assert round(steps["arm_mean"] / steps["baseline_mean"], 2) == 1.21
    assert round(time["arm_mean"] / time["baseline_mean"], 2) == 1.29


def test_the_early_window_gap_on_the_committed_curves():
    """probe_loss_early over the first 25% of the common 390 steps: bucketed is behind full_random early on."""
    curves = pd.read_csv(CURVES)
    common = budgets.common_budgets([curve for _, curve in curves.groupby("run_id")])
    assert common["steps"] == 390.0
    rows = [{"arm": arm, "seed": seed,
             "probe_loss_early": budgets.mean_probe_loss_until(curve, "steps", budgets.EARLY_SHARE * 390.0)}
            for (arm, seed), curve in curves[curves["arm"].isin([BUCKETED, FULL_RANDOM])].groupby(["arm", "seed"])]
    arms = pd.DataFrame({"stratum": "", "baseline": FULL_RANDOM}, index=[BUCKETED, FULL_RANDOM])
    table, _ = paired_table(pd.DataFrame(rows), arms, ("probe_loss_early",), {})
    assert [round(table.loc[0, c], 3) for c in ("diff", "ci_low", "ci_high")] == [0.100, 0.070, 0.130]


# ----------------------------------------------------------------------------------- (b) small synthetic curves
CURVE = pd.DataFrame({"steps": [0.0, 10.0, 20.0, 30.0, 40.0], "real_tokens": [0.0, 50.0, 150.0, 300.0, 500.0],
                      "modelled_time_s": [0.0, 1.0, 3.0, 6.0, 10.0], "probe_loss": [5.0, 4.0, 2.0, 2.6, 1.5]})


def test_time_to_target_interpolates_the_first_crossing_on_every_axis():
    # 4.0 -> 2.0 between steps 10 and 20: 3.5 is a quarter of the way on each axis
    assert [budgets.time_to_target(CURVE, axis, 3.5) for axis in budgets.AXES] == [12.5, 75.0, 1.5]
    assert budgets.time_to_target(CURVE, "steps", 2.0) == 20.0          # an eval exactly at the level
    assert budgets.time_to_target(CURVE, "steps", 2.5) == 17.5          # the first crossing, not the rebound at 30
    assert budgets.time_to_target(CURVE, "steps", 6.0) == 0.0           # the first eval is already there


def test_a_run_that_never_reaches_the_target_gives_nan_never_an_extrapolation():
    assert np.isnan(budgets.time_to_target(CURVE, "steps", 1.0))
    assert np.isnan(budgets.time_to_target(CURVE.assign(modelled_time_s=np.nan), "modelled_time_s", 3.5))


def test_the_early_window_is_the_trapezoid_area_over_the_width():
    # [0, 15]: (5 + 4) / 2 x 10 + (4 + 3) / 2 x 5 = 62.5 over 15 steps; a plain mean of the two evals inside: 4.5
    assert budgets.mean_probe_loss_until(CURVE, "steps", 15.0) == pytest.approx(62.5 / 15)
    assert np.isnan(budgets.mean_probe_loss_until(CURVE, "steps", 41.0))


def _sweep(root: Path, effects: dict[tuple[str, int], float], seeds: int = 3, steps: int = 60,
           analysis: dict | None = None) -> Path:
    """Runs of full_random and bucketed (probe loss 3.0 - 0.01 step + effect) x seeds."""
    for sampler in ("full_random", "bucketed"):
        for seed in range(seeds):
            write_run(root / f"{sampler}_s{seed}", sampler, seed, steps=steps, presentations=False,
                      analysis=analysis, effects={"probe_loss": effects.get((sampler, seed), 0.0)})
    return root


def test_a_rule_fixes_the_level_from_the_baseline_alone(tmp_path):
    """baseline_mean_at 0.5: the baseline's mean probe loss at half the common step budget; moving the compared
    arm's curves does not move the level."""
    protocol = Protocol(baseline="full_random", target={"rule": "baseline_mean_at", "at": 0.5})
    levels = []
    for effect in (0.05, 0.2):
        root = _sweep(tmp_path / f"e{effect}", {("bucketed", seed): effect for seed in range(3)})
        comparison = compare_records(load_runs([root]).runs, protocol=protocol)
        levels.append(comparison.target["levels"]["full_random"])
        baseline = comparison.curves[comparison.curves["arm"] == "full_random"]
        expected = np.mean([budgets.probe_loss_at(curve, "steps", 30.0) for _, curve in baseline.groupby("run_id")])
        assert levels[-1] == pytest.approx(expected)
        runs = comparison.runs.set_index("run_id")
        assert (runs["steps_to_target"] > 0).all()
    assert levels[0] == levels[1]


def test_a_never_reaching_run_is_nan_with_a_note_and_the_pairs_say_so(tmp_path):
    root = _sweep(tmp_path / "m", {("bucketed", 2): 1.0})   # seed 2 of bucketed stays above 2.9
    comparison = compare_records(load_runs([root]).runs, protocol=Protocol(
        baseline="full_random", target={"probe_loss": 2.7}, endpoints=("ktok_s",)))
    runs = comparison.runs.set_index("run_id")
    assert np.isnan(runs.loc["bucketed_s2", "steps_to_target"])
    assert "never reached the target probe loss 2.7" in runs.loc["bucketed_s2", "notes"]
    row = comparison.paired.set_index("endpoint").loc["steps_to_target"]
    assert row["n_pairs"] == 2 and row["seeds"] == "0 1"
    assert any("bucketed_s2 (bucketed seed 2) never reached probe loss 2.7" in note and "fewer pairs" in note
               for note in comparison.notes)
    table = markdown_tables(comparison).split("## Time to target")[1]
    assert "Probe loss 2.7, declared before the runs" in table and "| bucketed |" in table
    assert comparison.paired.set_index("endpoint").loc["ktok_s", "p_holm"] == pytest.approx(
        comparison.paired.set_index("endpoint").loc["ktok_s", "p_t"])   # its own family: Holm over 1 endpoint


# ------------------------------------------------------------------------------------------ (c) the protocol key
@pytest.mark.parametrize("value, message", [
    (2.3, "analysis.target=2.3: give a mapping"),
    ({}, "analysis.target: give one of probe_loss"),
    ({"probe_loss": 2.3, "rule": "baseline_mean_at"}, "not both"),
    ({"probe_loss": -1.0}, "analysis.target.probe_loss=-1: a probe loss is > 0"),
    ({"probe_loss": "low"}, "analysis.target.probe_loss='low': must be a number"),
    ({"probe_loss": 2.3, "at": 0.5}, "at belongs to rule baseline_mean_at"),
    ({"rule": "median"}, "analysis.target.rule='median': choose baseline_mean_at"),
    ({"rule": "baseline_mean_at"}, "needs at, the share of the common step budget"),
    ({"rule": "baseline_mean_at", "at": 1.5}, "analysis.target.at=1.5: must be <= 1"),
    ({"rule": "baseline_mean_at", "at": 0}, "analysis.target.at=0: give a share of the common step budget in (0, 1]"),
    ({"probe_loss": 2.3, "margin": 0.0}, "analysis.target.margin=0: a ratio margin must be > 0"),
    ({"level": 2.3}, "unknown analysis.target key(s) ['level']"),
])
def test_bad_targets_are_refused_in_one_line_naming_the_field(value, message):
    with pytest.raises(ValueError) as error:
        protocol_from_section({"target": value})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_declared_target_resolves_and_defaults_to_none():
    assert protocol_from_section({}).target is None
    assert check_target({"probe_loss": 2, "margin": 0.1}) == {"probe_loss": 2.0, "margin": 0.1}
    assert compare.parse_args(["x", "--target", "baseline_mean_at=0.5,margin=0.1"]).target == {
        "rule": "baseline_mean_at", "at": 0.5, "margin": 0.1}
    assert compare.parse_args(["x", "--target", "2.316"]).target == {"probe_loss": 2.316}


# ------------------------------------------------------------------------ (d) verdict.json under rules 5, not 4
VERDICT = {"endpoint": "final_loss", "positive_control": "bucket_sequential", "negative_control": "packed",
           "question": "bucketed"}
ANALYSIS = {"baseline": "full_random", "endpoints": ["final_loss", "ktok_s"], "verdict": VERDICT,
            "cost": {"c0": 0.01, "c1": 1.0e-5}, "target": {"probe_loss": 2.7, "margin": 0.1}}
EFFECTS = {"full_random": {}, "bucket_sequential": {"final_loss": 0.5}, "packed": {},
           "bucketed": {"probe_loss": 0.1, "ktok_s": 30.0}}


def _verdict_sweep(root: Path, rules: int) -> Path:
    for sampler, effects in EFFECTS.items():
        for seed in range(3):
            write_run(root / f"{sampler}_s{seed}", sampler, seed, steps=60, analysis=ANALYSIS, run_record=True,
                      presentations=False, effects=effects)
    record = protocol_module.protocol_record(ANALYSIS)
    (root / "protocol.json").write_text(json.dumps({**record, "rules_version": rules,
                                                    "rules": protocol_module.RULES[rules]}))
    return root


def _compare(root: Path, out: Path) -> tuple[dict, pd.DataFrame]:
    assert compare.main([str(root), "--out", str(out), "--no-plots"]) == 0
    return json.loads((out / "verdict.json").read_text()), pd.read_csv(out / "paired.csv")


def test_the_verdict_states_time_to_target_next_to_throughput_under_rules_5_only(tmp_path):
    verdict, paired = _compare(_verdict_sweep(tmp_path / "v5", rules=5), tmp_path / "out5")
    entry = verdict["time_to_target"]
    assert entry["probe_loss"] == 2.7 and entry["baseline"] == "full_random" and entry["question"] == "bucketed"
    steps = entry["steps_to_target"]
    assert steps["n_pairs"] == 3 and steps["diff"] > 0 and steps["ratio"] > 1   # +0.1 probe loss: ~10 steps later
    assert steps["margin"] == pytest.approx(0.1 * steps["baseline_mean"])
    assert entry["time_ratio"] == pytest.approx(entry["time_to_target"]["question_mean"]
                                                / entry["time_to_target"]["baseline_mean"])
    assert verdict["early_window"]["until_step"] == 15.0 and verdict["early_window"]["diff"] > 0
    claimed = verdict["throughput_from"]   # the throughput the answer claims: the modelled cost, not Ktok/s
    assert claimed["claim"] == "modelled_cost"
    assert (f"trade: {claimed['modelled_cost']:.2f}x the throughput (modelled cost), {entry['time_ratio']:.2f}x the "
            f"modelled GPU time to reach probe loss 2.7 ({steps['ratio']:.2f}x the steps: ") in verdict["answer"]
    assert "paired probe-loss gap over the first 25% of steps (to step 15)" in verdict["answer"]
    assert {"steps_to_target", "tokens_to_target", "time_to_target", "probe_loss_early"} <= set(paired["endpoint"])

    verdict, paired = _compare(_verdict_sweep(tmp_path / "v4", rules=4), tmp_path / "out4")
    assert "time_to_target" not in verdict and "early_window" not in verdict
    assert "trade:" not in verdict["answer"] and "first 25% of steps" not in verdict["answer"]
    assert set(paired["endpoint"]) == {"final_loss", "ktok_s"}
