"""Rules version 5 statistics (analysis.paired, analysis.verdict): the target as the unit where seeds nest in
targets, the negative control judged by equivalence, the question net of its matched control, tau instruments that
need the positive control, and the throughput claim by its source; version 4 answers unchanged."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from dflash_lab.analysis import compare_records, load_runs, paired, verdict
from dflash_lab.analysis.protocol import RULES, Protocol, check_verdict
from dflash_lab.analysis.schema import BETTER
from dflash_lab.analysis.summarize import analyse_run
from helpers import write_run  # tests/ is on sys.path (pytest rootdir-relative import)
from dflash_lab.analysis.schema import RunRecord

NATURAL = Path(__file__).resolve().parents[1] / "docs" / "ablation_natural"
NATURAL_MARGINS = {"tau_band_min": 0.05, "tau": 0.05, "residual_amplitude": 0.01, "band_forgetting": 0.02,
                   "probe_loss_at_steps": 0.05, "probe_loss_at_tokens": 0.05, "probe_loss_at_time": 0.05}
NATURAL_ENDPOINTS = ("ktok_s", "tau_band_min", "tau", "residual_amplitude", "band_forgetting", "probe_loss_at_steps",
                     "probe_loss_at_tokens", "probe_loss_at_time")
NATURAL_ROLES = {"endpoint": "residual_amplitude",
                 "positive_control": "sampler=bucket_sequential,sampler.bucket_by=length",
                 "negative_control": "sampler=bucket_sequential,sampler.bucket_by=random",
                 "question": "sampler=bucketed"}


def nested_runs(target_shift=(0.06, 0.01, 0.03), seeds=9, noise=0.002, seed=0):
    """Arm 'a' minus baseline 'b' = a per-target shift plus small per-seed noise; seed s trains target s mod 3."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(seeds):
        base = 1.0 + rng.normal(0, 0.05)
        rows.append({"arm": "b", "seed": s, "target_seed": s % 3, "status": "finished", "residual_amplitude": base})
        rows.append({"arm": "a", "seed": s, "target_seed": s % 3, "status": "finished",
                     "residual_amplitude": base + target_shift[s % 3] + rng.normal(0, noise)})
    return pd.DataFrame(rows)


ARMS = pd.DataFrame({"stratum": ["", ""], "baseline": ["b", "b"]}, index=["a", "b"])


def test_nested_analysis_has_one_unit_per_target_and_a_wider_interval():
    runs = nested_runs()
    seeds, _ = paired.paired_table(runs, ARMS, ("residual_amplitude",), {}, nested=False)
    targets, _ = paired.paired_table(runs, ARMS, ("residual_amplitude",), {}, nested=True)
    seed_row, target_row = seeds.iloc[0], targets.iloc[0]
    assert (seed_row["unit"], seed_row["n_pairs"], seed_row["n_targets"], seed_row["n_seeds"]) == ("seed", 9, 3, 9)
    assert (target_row["unit"], target_row["n_pairs"], target_row["n_targets"], target_row["n_seeds"]) == \
        ("target", 3, 3, 9)
    # seeds of one target repeat its shift: as independent seeds they look precise; as 3 targets they do not
    assert target_row["ci_high"] - target_row["ci_low"] > 2.5 * (seed_row["ci_high"] - seed_row["ci_low"])
    assert seed_row["verdict"] == "worse" and target_row["verdict"] == "inconclusive"
    # MDD and seeds_needed per unit: targets, with the sd of the target means
    means = (runs[runs.arm == "a"].set_index("seed")["residual_amplitude"]
             - runs[runs.arm == "b"].set_index("seed")["residual_amplitude"]).groupby(lambda s: s % 3).mean()
    assert target_row["mdd"] == pytest.approx(paired.minimum_detectable_difference(means.to_numpy()))
    assert target_row["p_min"] == pytest.approx(2 / 2**3)


def test_one_target_keeps_the_seed_analysis():
    runs = nested_runs().assign(target_seed=np.nan, target_digest="hf-weights")   # model=hf: one given target
    nested, _ = paired.paired_table(runs, ARMS, ("residual_amplitude",), {}, nested=True)
    by_seed, _ = paired.paired_table(runs, ARMS, ("residual_amplitude",), {}, nested=False)
    assert nested.iloc[0]["unit"] == "seed" and nested.iloc[0]["n_targets"] == 1 and nested.iloc[0]["n_pairs"] == 9
    assert nested.iloc[0]["ci_low"] == by_seed.iloc[0]["ci_low"]


def natural_runs() -> pd.DataFrame:
    runs = pd.read_csv(NATURAL / "comparison.csv")
    runs["target_seed"] = runs["seed"] % 3   # the sweep's target_seeds: 3 (its README)
    return runs


def natural_arms(runs: pd.DataFrame) -> pd.DataFrame:
    labels = sorted(runs["arm"].unique())
    return pd.DataFrame({"stratum": [""] * len(labels), "baseline": ["full_random"] * len(labels)}, index=labels)


def test_question_row_recomputed_by_hand_from_per_run_rows_grouped_by_target():
    runs = natural_runs()
    table, _ = paired.paired_table(runs[runs.status == "finished"], natural_arms(runs), NATURAL_ENDPOINTS,
                                   NATURAL_MARGINS, nested=True)
    row = table[(table.policy == "bucketed bucket_by=length") & (table.endpoint == "residual_amplitude")].iloc[0]
    wide = runs.pivot(index="seed", columns="arm", values="residual_amplitude")
    per_target = (wide["bucketed bucket_by=length"] - wide["full_random"]).groupby(wide.index % 3).mean()
    n = len(per_target)
    low, high = stats.t.interval(0.95, n - 1, loc=per_target.mean(), scale=stats.sem(per_target))
    assert (row["unit"], row["n_pairs"], row["n_targets"], row["n_seeds"]) == ("target", 3, 3, 5)
    assert (row["diff"], row["ci_low"], row["ci_high"]) == pytest.approx((per_target.mean(), low, high))
    assert row["p_t"] == pytest.approx(stats.ttest_1samp(per_target, 0.0).pvalue)
    assert (round(row["diff"], 4), round(row["ci_low"], 4), round(row["ci_high"], 4)) == (0.0098, -0.0142, 0.0338)


def test_natural_sweep_v4_answer_unchanged_and_v5_answer_states_targets_controls_and_throughput_source():
    runs = natural_runs()
    finished = runs[runs.status == "finished"]
    arms = natural_arms(runs)
    answers = {}
    for rules in (4, 5):
        flags = RULES[rules]
        table, _ = paired.paired_table(finished, arms, NATURAL_ENDPOINTS, NATURAL_MARGINS, nested=flags["nested"])
        answers[rules] = verdict.build_verdict(runs, table, NATURAL_ROLES, baselines=arms["baseline"].to_dict(),
                                               nested=flags["nested"],
                                               controls_by_equivalence=flags["controls_by_equivalence"])
    committed = json.loads((NATURAL / "verdict.json").read_text())
    assert answers[4]["answer"] == committed["answer"]
    assert "throughput_from" not in answers[4] and "units" not in answers[4]
    v5 = answers[5]
    assert v5["units"] == {"unit": "target", "units": 3, "targets": 3, "seeds": 5}
    assert "it rests on 3 targets and 5 seeds" in v5["answer"]
    source = v5["throughput_from"]
    assert source["claim"] == "modelled_cost" and source["modelled_cost"] == pytest.approx(1.6457, abs=1e-3)
    assert source["measured_ktok_s"] == pytest.approx(2.2366, abs=1e-3)
    assert ("at 1.65x the throughput by padding and the modelled cost" in v5["answer"]
            and "measured Ktok/s 2.24x, time-confounded unless arms interleave" in v5["answer"])
    assert v5["failed_positive_control"] == ["tau_band_min", "tau"]   # the curriculum does not lower tau
    assert "(tau did not detect the positive control, 1.38 -> 1.41)" in v5["answer"]
    assert v5["negative_control"]["equivalent"] and not v5["negative_control"]["reacted"] and v5["valid"]


def control_rows(negative_low, negative_high, negative_p_tost, margin=0.01, tau_positive=(-0.2, 0.18)):
    def row(arm, endpoint, low, high, p_tost=float("nan"), row_margin=float("nan")):
        return {"policy": arm, "endpoint": endpoint, "diff": (low + high) / 2, "ci_low": low, "ci_high": high,
                "p_value": 0.06, "p_holm": 0.2, "verdict": "inconclusive", "better": BETTER[endpoint],
                "baseline": "fr", "n_pairs": 20, "arm_mean": 2.0, "baseline_mean": 1.0, "margin": row_margin,
                "p_tost": p_tost}
    return pd.DataFrame([row("seq", "residual_amplitude", 0.03, 0.07),
                         row("seqi", "residual_amplitude", negative_low, negative_high, negative_p_tost, margin),
                         row("bkt", "residual_amplitude", -0.003, 0.007),
                         row("seq", "tau", *tau_positive), row("bkt", "tau", -0.1, 0.1)])


ROLE_RUNS = pd.DataFrame({"arm": ["seq", "bkt", "seqi", "fr"], "sampler": ["s", "b", "s", "f"],
                          "data.band_skills": ["aligned", "aligned", "independent", "aligned"]})
ROLES = {"endpoint": "residual_amplitude", "positive_control": "sampler=s,data.band_skills=aligned",
         "negative_control": "sampler=s,data.band_skills=independent", "question": "sampler=b"}


def test_negative_control_detected_inside_its_margin_voids_under_v4_only():
    table = control_rows(0.001, 0.003, negative_p_tost=1e-6)   # real but tiny: excludes 0, inside 0.01
    v4 = verdict.build_verdict(ROLE_RUNS, table, ROLES, controls_by_equivalence=False)
    v5 = verdict.build_verdict(ROLE_RUNS, table, ROLES, controls_by_equivalence=True)
    assert not v4["valid"] and v4["answer"].startswith("inconclusive")
    assert v5["valid"] and v5["negative_control"]["detected"] and not v5["negative_control"]["reacted"]
    assert "is equivalent within its margin 0.01" in v5["answer"]
    outside = control_rows(0.008, 0.02, negative_p_tost=0.6)   # detected and not shown inside the margin
    assert not verdict.build_verdict(ROLE_RUNS, outside, ROLES, controls_by_equivalence=True)["valid"]


def test_negative_control_without_a_margin_falls_back_to_detection_and_says_so():
    table = control_rows(0.001, 0.003, negative_p_tost=float("nan"), margin=float("nan"))
    v5 = verdict.build_verdict(ROLE_RUNS, table, ROLES, controls_by_equivalence=True)
    assert not v5["valid"] and v5["negative_control"]["reacted"]
    assert "judged by detection: detection: no margin declared for residual_amplitude" not in v5["answer"]
    assert "the negative control is judged by detection (no margin declared for residual_amplitude)" in v5["answer"]


def test_tau_that_misses_the_positive_control_is_a_failed_instrument_under_v5_only():
    table = control_rows(-0.002, 0.002, negative_p_tost=1e-4)   # positive control's tau interval straddles 0
    v4 = verdict.build_verdict(ROLE_RUNS, table, ROLES)
    v5 = verdict.build_verdict(ROLE_RUNS, table, ROLES, controls_by_equivalence=True)
    assert "tau" not in v4["failed_positive_control"] and "did not detect" not in v4["answer"]
    assert v5["failed_positive_control"] == ["tau"]
    assert "mean tau +0 [-0.1, +0.1] (tau did not detect the positive control" in v5["answer"]
    seen = verdict.build_verdict(ROLE_RUNS, control_rows(-0.002, 0.002, 1e-4, tau_positive=(-0.3, -0.1)), ROLES,
                                 controls_by_equivalence=True)
    assert "tau" not in seen["failed_positive_control"] and "(inconclusive, 1 -> 2)" in seen["answer"]


def test_question_net_of_its_declared_matched_control_per_target():
    rng = np.random.default_rng(1)
    rows = []
    for s in range(6):
        base = 1.0 + rng.normal(0, 0.05)
        for arm, band_skills, sampler, effect in (("fr", "aligned", "f", 0.0), ("bkt", "aligned", "b", 0.05),
                                                  ("bkti", "independent", "b", 0.03), ("seq", "aligned", "s", 0.5),
                                                  ("seqi", "independent", "s", 0.0)):
            rows.append({"arm": arm, "sampler": sampler, "data.band_skills": band_skills, "seed": s,
                         "target_seed": s % 3, "status": "finished",
                         "residual_amplitude": base + effect + rng.normal(0, 0.002)})
    runs = pd.DataFrame(rows)
    arms = pd.DataFrame({"stratum": [""] * 5, "baseline": ["fr"] * 5}, index=["bkt", "bkti", "fr", "seq", "seqi"])
    table, _ = paired.paired_table(runs, arms, ("residual_amplitude",), {"residual_amplitude": 0.01}, nested=True)
    question = {**ROLES, "question": "sampler=b,data.band_skills=aligned"}
    roles = {**question, "matched_control": "sampler=b,data.band_skills=independent"}
    v5 = verdict.build_verdict(runs, table, roles, nested=True, controls_by_equivalence=True)
    net = v5["question_net_of_matched_control"]
    assert (net["matched_control"], net["unit"], net["n_pairs"], net["n_seeds"]) == ("bkti", "target", 3, 6)
    assert net["diff"] == pytest.approx(0.02, abs=0.003) and net["ci_low"] < net["diff"] < net["ci_high"]
    assert "net of its matched control (bkti" in v5["answer"]
    assert verdict.build_verdict(runs, table, question, controls_by_equivalence=True)[
        "question_net_of_matched_control"]["matched_control"] == "seqi"   # none declared: the negative control


def test_protocol_accepts_an_optional_matched_control():
    roles = check_verdict({**ROLES, "matched_control": "sampler=b,data.band_skills=independent"})
    assert roles["matched_control"] == "sampler=b,data.band_skills=independent"
    assert "matched_control" not in check_verdict(ROLES)
    with pytest.raises(ValueError, match="matched_controls"):
        check_verdict({**ROLES, "matched_controls": "x"})


def test_runs_record_their_target():
    record = RunRecord("r", "local", "/r", summary={"status": "finished", "target_seed": 2, "target_digest": "ab12"})
    row = analyse_run(record).row
    assert row["target_seed"] == 2 and row["target_digest"] == "ab12"


def test_compare_records_applies_the_nested_unit_of_the_protocols_rules_version(tmp_path):
    for seed in range(4):
        for sampler in ("full_random", "bucketed"):
            run_dir = write_run(tmp_path / "sweep" / f"{sampler}_s{seed}", sampler, seed, steps=30, presentations=False)
            summary = json.loads((run_dir / "summary.json").read_text())
            (run_dir / "summary.json").write_text(json.dumps({**summary, "target_seed": seed % 2}))
    records = load_runs([tmp_path / "sweep"]).runs
    units = {}
    for rules in (4, 5):
        comparison = compare_records(records, protocol=Protocol(baseline="full_random", endpoints=("ktok_s",),
                                                                rules=rules), mixed_digests="allow")
        row = comparison.paired.iloc[0]
        units[rules] = (row["unit"], row["n_pairs"], row["n_targets"], row["n_seeds"])
    assert units == {4: ("seed", 4, 2, 4), 5: ("target", 2, 2, 4)}
