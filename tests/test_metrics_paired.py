"""Paired statistics of the policy comparison (analysis.paired): known answers, calibration under a
planted null, power under a planted effect, pairing by seed, Holm, TOST verdicts, and the equal-compute axes."""

import doctest

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from dflash_lab.analysis import budgets, paired


def test_docstring_examples():
    assert doctest.testmod(paired).failed == 0
    assert doctest.testmod(budgets).failed == 0


def test_t_interval_matches_scipy():
    diffs = np.array([0.3, -0.1, 0.5, 0.2, 0.4])
    low, high = paired.t_interval(diffs, alpha=0.05)
    expected = stats.t.interval(0.95, 4, loc=diffs.mean(), scale=stats.sem(diffs))
    assert (low, high) == pytest.approx(expected)
    assert np.isnan(paired.t_interval([1.0])[0])


def test_sign_flip_p_value_is_exact_on_small_samples():
    # n = 3, all positive: only +++ and --- reach |mean| = 2 -> 2 / 8
    assert paired.sign_flip_p_value([1.0, 2.0, 3.0]) == pytest.approx(0.25)
    # 1, 2, -3: |mean| = 0; every pattern is at least as extreme
    assert paired.sign_flip_p_value([1.0, 2.0, -3.0]) == 1.0
    # the smallest attainable p-value is 2 / 2^n: 5 seeds can never reach 0.05
    assert paired.sign_flip_p_value(np.arange(1.0, 6.0)) == pytest.approx(2 / 32)
    assert paired.sign_flip_p_value(np.arange(1.0, 7.0)) == pytest.approx(2 / 64)
    big = paired.sign_flip_p_value(np.arange(1.0, 21.0))  # beyond 16 seeds: random sign patterns
    assert 0 < big < 1e-4


def test_holm_by_hand():
    # sorted 0.01, 0.02, 0.04 -> 3 x 0.01, max(0.03, 2 x 0.02), max(0.04, 1 x 0.04)
    assert paired.holm([0.04, 0.01, 0.02]).tolist() == pytest.approx([0.04, 0.03, 0.04])
    assert paired.holm([0.5, 0.9]).tolist() == pytest.approx([1.0, 1.0])


def test_under_a_planted_null_intervals_cover_and_tests_hold_their_level():
    rng = np.random.default_rng(0)
    n_sims, n_seeds = 400, 8
    covered_t = covered_boot = rejected = 0
    for _ in range(n_sims):
        diffs = rng.normal(0.0, 1.0, n_seeds)
        low, high = paired.t_interval(diffs)
        covered_t += low <= 0 <= high
        low, high = paired.bootstrap_interval(diffs, resamples=2000)
        covered_boot += low <= 0 <= high
        rejected += paired.sign_flip_p_value(diffs) < 0.05
    assert covered_t / n_sims == pytest.approx(0.95, abs=0.03)
    assert covered_boot / n_sims > 0.85  # the percentile bootstrap runs a little narrow with 8 seeds
    assert rejected / n_sims <= 0.05 + 0.025


def test_a_planted_paired_effect_is_found_although_seeds_differ_more_than_arms():
    """The seed moves both arms by +-1 (same init and data); the arm adds 0.2 with noise 0.05. Unpaired, the
    seed spread hides the effect; paired by seed it is clear."""
    rng = np.random.default_rng(1)
    seeds = np.arange(8)
    seed_effect = rng.normal(0, 1.0, seeds.size)
    runs = pd.DataFrame({
        "arm": ["bucketed"] * 8 + ["full_random"] * 8,
        "seed": np.r_[seeds, seeds],
        "jumpiness": np.r_[1 + seed_effect + 0.2 + 0.05 * rng.standard_normal(8),
                           1 + seed_effect + 0.05 * rng.standard_normal(8)],
    }).sample(frac=1.0, random_state=0)  # row order must not matter
    arms = pd.DataFrame({"stratum": "", "baseline": "full_random"}, index=["bucketed", "full_random"])
    table, _ = paired.paired_table(runs, arms, ("jumpiness",), {})
    row = table.iloc[0]
    assert row["diff"] == pytest.approx(0.2, abs=0.06)
    assert row["ci_low"] > 0.1 and row["boot_low"] > 0.1
    assert row["p_value"] == pytest.approx(2 / 256) and row["verdict"] == "worse"  # lower jumpiness is better
    unpaired = stats.ttest_ind(runs.loc[runs.arm == "bucketed", "jumpiness"],
                               runs.loc[runs.arm == "full_random", "jumpiness"])
    assert unpaired.pvalue > 0.3


def test_pairs_only_common_seeds_and_averages_repeated_runs():
    runs = pd.DataFrame({"arm": ["a", "a", "a", "a", "b", "b", "b"], "seed": [0, 1, 2, 2, 1, 2, 3],
                         "ktok_s": [9.0, 10.0, 11.0, 13.0, 5.0, 6.0, 7.0]})
    arms = pd.DataFrame({"stratum": "", "baseline": "b"}, index=["a", "b"])
    table, notes = paired.paired_table(runs, arms, ("ktok_s",), {}, test="sign_flip")
    row = table.iloc[0]
    assert row["n_pairs"] == 2 and row["seeds"] == "1 2"
    assert row["diff"] == pytest.approx(((10 - 5) + (12 - 6)) / 2)  # seed 2 of arm a: mean of 11 and 13
    assert any("2 runs with seed 2" in note for note in notes)
    assert any("cannot reach" in note for note in notes)  # 2 pairs: smallest p = 0.5


def test_holm_runs_over_the_endpoints_of_an_arm_and_nan_endpoints_are_left_out():
    seeds = np.arange(7)
    runs = pd.DataFrame({"arm": ["a"] * 7 + ["b"] * 7, "seed": np.r_[seeds, seeds],
                         "ktok_s": np.r_[seeds + 10.0, seeds + 0.0],  # +10 on every seed: p = 2/128
                         "jumpiness": np.r_[seeds * 0.1 + 0.01, seeds * 0.1],
                         "loop_score": np.nan})  # a shuffled order: no loop score on either side
    arms = pd.DataFrame({"stratum": "", "baseline": "b"}, index=["a", "b"])
    table, _ = paired.paired_table(runs, arms, ("ktok_s", "jumpiness", "loop_score"), {}, test="sign_flip")
    assert table["endpoint"].tolist() == ["ktok_s", "jumpiness"]
    assert table["p_value"].tolist() == pytest.approx([2 / 128, 2 / 128])
    assert table["p_holm"].tolist() == pytest.approx([4 / 128, 4 / 128])
    assert table["verdict"].tolist() == ["better", "worse"]


def test_the_t_test_can_conclude_at_five_seeds_where_the_exact_sign_flip_test_cannot():
    """Five seeds, every difference positive: the sign-flip test's smallest p is 2/32 = 0.0625, so it can never
    say 'better'; the paired t test (the default) and the BCa bootstrap can. The minimum detectable difference and
    the seeds a margin needs are reported."""
    seeds = np.arange(5)
    runs = pd.DataFrame({"arm": ["a"] * 5 + ["b"] * 5, "seed": np.r_[seeds, seeds],
                         "ktok_s": np.r_[[18.1, 17.6, 18.4, 17.9, 18.2], [10.0, 10.2, 9.9, 10.1, 10.0]]})
    arms = pd.DataFrame({"stratum": "", "baseline": "b"}, index=["a", "b"])
    exact, notes = paired.paired_table(runs, arms, ("ktok_s",), {"ktok_s": 1.0}, test="sign_flip")
    assert exact.iloc[0]["p_value"] == pytest.approx(2 / 32) and exact.iloc[0]["verdict"] == "inconclusive"
    assert any("cannot reach" in note for note in notes)
    table, notes = paired.paired_table(runs, arms, ("ktok_s",), {"ktok_s": 1.0})
    row = table.iloc[0]
    d = runs["ktok_s"].to_numpy()[:5] - runs["ktok_s"].to_numpy()[5:]
    assert row["test"] == "t" and row["p_t"] == pytest.approx(stats.ttest_rel(d, np.zeros(5)).pvalue)
    assert row["p_holm"] == row["p_t"] < 0.001 and row["verdict"] == "better" and not notes
    assert row["p_bca"] < 0.01 and row["p_value"] == pytest.approx(2 / 32)
    sd = d.std(ddof=1)
    assert row["mdd"] == pytest.approx((stats.t.ppf(0.975, 4) + stats.t.ppf(0.8, 4)) * sd / np.sqrt(5))
    def mdd(n: int) -> float:
        return (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.8, n - 1)) * sd / np.sqrt(n)

    needed = int(row["seeds_needed"])   # the fewest pairs whose mdd is within the margin 1.0
    assert mdd(needed) <= 1.0 and (needed == 2 or mdd(needed - 1) > 1.0)
    with pytest.raises(ValueError, match="analysis.test='z'"):
        paired.paired_table(runs, arms, ("ktok_s",), {}, test="z")


def test_bca_p_value_agrees_with_the_t_test_on_clear_and_null_effects():
    rng = np.random.default_rng(1)
    clear, null = rng.normal(1.0, 0.5, size=8), rng.normal(0.0, 0.5, size=8)
    assert paired.bca_p_value(clear) < 0.01 and paired.paired_t_p_value(clear) < 0.01
    assert paired.bca_p_value(null) > 0.1 and paired.paired_t_p_value(null) > 0.1
    assert np.isnan(paired.bca_p_value([1.0, 2.0, 3.0]))   # below 5 pairs: no bootstrap


def test_tost_verdicts_against_declared_margins():
    rng = np.random.default_rng(2)
    seeds = np.arange(8)
    base = rng.normal(2.0, 0.3, 8)
    runs = pd.DataFrame({"arm": ["a"] * 8 + ["b"] * 8, "seed": np.r_[seeds, seeds],
                         "probe_loss_at_tokens": np.r_[base + 0.001 * rng.standard_normal(8), base],
                         "residual_amplitude": np.r_[base * 0.01 + 0.02, base * 0.01]})
    arms = pd.DataFrame({"stratum": "", "baseline": "b"}, index=["a", "b"])
    table, _ = paired.paired_table(runs, arms, ("probe_loss_at_tokens", "residual_amplitude"),
                                   {"probe_loss_at_tokens": 0.01, "residual_amplitude": 0.005})
    verdicts = dict(zip(table["endpoint"], table["verdict"]))
    assert verdicts == {"probe_loss_at_tokens": "equivalent", "residual_amplitude": "worse"}
    # no margin declared: a tiny difference is never called equivalent
    table, _ = paired.paired_table(runs, arms, ("probe_loss_at_tokens",), {})
    assert table["verdict"].iloc[0] == "inconclusive"


def test_the_required_paired_columns_come_first():
    assert paired.PAIRED_COLUMNS[:8] == ("policy", "endpoint", "diff", "ci_low", "ci_high", "p_value", "p_holm",
                                         "verdict")


# ------------------------------------------------------------------------------------------------ equal compute
def test_equal_compute_axes_place_a_faster_run_correctly():
    """Run A consumes 2000 real tokens per step, run B 1000; both reach probe loss 2.0 after 100k tokens. At equal
    steps A looks better; at equal real tokens they are the same."""
    def run(tokens_per_step, steps=100):
        metrics = pd.DataFrame({"step": np.arange(1, steps + 1), "real_tokens": tokens_per_step,
                                "padded_tokens": 2 * tokens_per_step, "attn_tokens": 0})
        axes = budgets.compute_axes(metrics, cost=(0.01, 1e-5, 0.0))
        eval_steps = np.arange(0, steps + 1, 10)
        probes = pd.DataFrame({"step": eval_steps, "band": 0,
                               "loss": 3.0 - eval_steps * tokens_per_step / 100_000})  # loss falls with tokens
        return budgets.probe_curve(probes, axes)

    fast, slow = run(2000, steps=60), run(1000)
    common = budgets.common_budgets([fast, slow])
    assert common["steps"] == 60 and common["real_tokens"] == 100_000
    assert common["modelled_time_s"] == pytest.approx(min(60 * (0.01 + 0.04), 100 * (0.01 + 0.02)))
    at_steps = [budgets.probe_loss_at(c, "steps", common["steps"]) for c in (fast, slow)]
    assert at_steps == pytest.approx([3.0 - 1.2, 3.0 - 0.6])
    at_tokens = [budgets.probe_loss_at(c, "real_tokens", common["real_tokens"]) for c in (fast, slow)]
    assert at_tokens == pytest.approx([2.0, 2.0])
    assert np.isnan(budgets.probe_loss_at(fast, "real_tokens", 150_000))  # never extrapolated


def test_compute_axes_use_the_attention_column_and_the_world_size():
    metrics = pd.DataFrame({"step": [1, 2], "real_tokens": [100, 100], "padded_tokens": [400, 400],
                            "attn_tokens": [1000, 3000]})
    axes = budgets.compute_axes(metrics, cost=(0.0, 0.0, 1e-3), world_size=2)
    assert axes["modelled_time_s"].tolist() == pytest.approx([0.0, 0.5, 2.0])  # per rank: 500 then 1500 x 1e-3
    assert budgets.compute_axes(metrics)["modelled_time_s"].isna().all()  # no cost model, no time axis


# ------------------------------------------------------------------------------------------------ verdict
def _verdict_inputs(question_diff, question_ci, question_verdict="inconclusive", positive_ci=(0.03, 0.07),
                    negative_ci=(-0.004, 0.006)):
    import pandas as pd

    from dflash_lab.analysis.schema import BETTER

    runs = pd.DataFrame({"arm": ["seq", "bkt", "seqi", "fr", "fri"], "sampler": ["s", "b", "s", "f", "f"],
                         "data.band_skills": ["aligned", "aligned", "independent", "aligned", "independent"]})

    def row(arm, endpoint, diff, ci, verdict="inconclusive"):
        return {"policy": arm, "endpoint": endpoint, "diff": diff, "ci_low": ci[0], "ci_high": ci[1],
                "p_value": 0.0625, "p_holm": 0.25, "verdict": verdict, "better": BETTER[endpoint],
                "baseline": "fr", "n_pairs": 5, "margin": 0.01, "arm_mean": 18.0, "baseline_mean": 10.0}

    paired = pd.DataFrame([row("seq", "residual_amplitude", 0.05, positive_ci),
                           row("seqi", "residual_amplitude", 0.001, negative_ci),
                           row("bkt", "residual_amplitude", question_diff, question_ci, question_verdict),
                           row("bkt", "ktok_s", 8.0, (7.0, 9.0))])
    roles = {"endpoint": "residual_amplitude", "positive_control": "sampler=s,data.band_skills=aligned",
             "negative_control": "sampler=s,data.band_skills=independent",
             "question": "sampler=b,data.band_skills=aligned"}
    return runs, paired, roles


@pytest.mark.parametrize("diff,ci,tost,answer", [
    (0.005, (0.002, 0.008), "equivalent", "small"),         # detectable and inside the margin
    (0.03, (0.02, 0.04), "inconclusive", "yes"),             # detectable, beyond any declared margin
    (0.001, (-0.002, 0.004), "equivalent", "equivalent"),    # only the equivalence test speaks
    (0.001, (-0.01, 0.012), "inconclusive", "no detectable effect"),
])
def test_verdict_answers(diff, ci, tost, answer):
    from dflash_lab.analysis.verdict import build_verdict

    verdict = build_verdict(*_verdict_inputs(diff, ci, tost))
    assert verdict["valid"] and verdict["seeds"] == 5 and verdict["throughput_ratio"] == pytest.approx(1.8)
    assert verdict["answer"].split(":")[0] == answer


def test_rules_before_version_2_have_no_small_answer():
    """A sweep recorded under protocol rules version 1 is judged as it was launched: detected and inside the
    margin answers "yes" there (the "small" answer came with version 2)."""
    from dflash_lab.analysis.protocol import RULES
    from dflash_lab.analysis.verdict import build_verdict

    inputs = _verdict_inputs(0.005, (0.002, 0.008), "equivalent")
    assert build_verdict(*inputs, small_answer=RULES[2]["small"])["answer"].startswith("small:")
    assert build_verdict(*inputs, small_answer=RULES[1]["small"])["answer"].startswith("yes:")


def test_verdict_is_inconclusive_when_a_control_fails():
    from dflash_lab.analysis.verdict import build_verdict

    blind = build_verdict(*_verdict_inputs(0.03, (0.02, 0.04), positive_ci=(-0.01, 0.11)))
    assert not blind["valid"] and blind["answer"].startswith("inconclusive: the positive control (seq)")
    # a positive control that moves the "better" way is no signature either
    wrong_way = build_verdict(*_verdict_inputs(0.03, (0.02, 0.04), positive_ci=(-0.07, -0.03)))
    assert not wrong_way["positive_control"]["detected"]
    confounded = build_verdict(*_verdict_inputs(0.03, (0.02, 0.04), negative_ci=(-0.009, -0.002)))
    assert not confounded["valid"] and "negative control (seqi) reacted" in confounded["answer"]


def test_verdict_roles_must_select_one_arm():
    from dflash_lab.analysis.protocol import protocol_from_section
    from dflash_lab.analysis.verdict import build_verdict

    runs, paired, roles = _verdict_inputs(0.03, (0.02, 0.04))
    with pytest.raises(ValueError, match=r"analysis.verdict.question='sampler=s' matches 2 arms"):
        build_verdict(runs, paired, {**roles, "question": "sampler=s"})
    with pytest.raises(ValueError, match=r"analysis.verdict.question=.*\['data.seed'\] is not a swept key"):
        build_verdict(runs, paired, {**roles, "question": "sampler=b,data.seed=1"})
    with pytest.raises(ValueError, match=r"analysis.verdict: missing \['question'\]"):
        protocol_from_section({"verdict": {k: v for k, v in roles.items() if k != "question"}})
    with pytest.raises(ValueError, match="analysis.verdict.endpoint: unknown endpoint 'loss'"):
        protocol_from_section({"verdict": {**roles, "endpoint": "loss"}})
