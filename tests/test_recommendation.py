"""Rules version 6: verdict.json's recommendation (what to do, the break-even throughput ratio, the throughput the
answer assumes and its source, the GPU-time conclusion) and composition (update count separated from batch
composition), and compare's way to take the user's throughput. Nothing here trains: small run folders with planted
probe-loss curves (tests/helpers.write_run)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from dflash_lab import compare
from dflash_lab.analysis import protocol as protocol_module
from dflash_lab.analysis import verdict as verdict_module
from dflash_lab.analysis.recommendation import decide, ratio_interval
from dflash_lab.refusal import Refused
from helpers import write_run  # tests/ is on sys.path (pytest rootdir-relative import)

PLAIN = {"sampler.real_tokens_per_step": None, "trainer.lr_scaling": None}
VERDICT = {"endpoint": "final_loss", "positive_control": "bucket_sequential", "negative_control": "packed",
           "question": "sampler=bucketed,sampler.real_tokens_per_step=null,trainer.lr_scaling=null",
           "equal_updates": "sampler=bucketed,sampler.real_tokens_per_step=full_random",
           "equal_tokens": "sampler=full_random,sampler.real_tokens_per_step=bucketed",
           "lr_scaled": "sampler=bucketed,trainer.lr_scaling=sqrt"}
ANALYSIS = {"baseline": "sampler=full_random,sampler.real_tokens_per_step=null,trainer.lr_scaling=null",
            "endpoints": ["final_loss", "ktok_s"], "verdict": VERDICT, "cost": {"c0": 0.01, "c1": 1.0e-5},
            "target": {"probe_loss": 2.7, "margin": 0.1}}
# folder -> (sampler, settings, planted effects): probe loss falls 0.01 per step, so +0.1 probe loss reaches the
# target ~10 steps later (steps and real tokens to target: ~40 / ~30 = 1.33x the baseline's)
ARMS = {"full_random": ("full_random", PLAIN, {}),
        "full_random_eq_tokens": ("full_random", {**PLAIN, "sampler.real_tokens_per_step": "bucketed"},
                                  {"probe_loss": 0.02}),
        "bucketed": ("bucketed", PLAIN, {"probe_loss": 0.1, "ktok_s": 30.0}),
        "bucketed_eq_updates": ("bucketed", {**PLAIN, "sampler.real_tokens_per_step": "full_random"},
                                {"probe_loss": 0.05}),
        "bucketed_lr": ("bucketed", {**PLAIN, "trainer.lr_scaling": "sqrt"}, {"probe_loss": 0.08}),
        "bucket_sequential": ("bucket_sequential", {}, {"final_loss": 0.5}),
        "packed": ("packed", {}, {})}
QUESTION = "bucketed real_tokens_per_step=null lr_scaling=null"


def sweep(root: Path, rules: int = 6, seeds: int = 4, analysis: dict | None = None, arms: dict = ARMS) -> Path:
    analysis = analysis or ANALYSIS
    for name, (sampler, settings, effects) in arms.items():
        for seed in range(seeds):
            write_run(root / f"{name}_s{seed}", sampler, seed, steps=60, analysis=analysis, run_record=True,
                      presentations=False, effects=effects, settings=settings)
    record = protocol_module.protocol_record(analysis)
    (root / "protocol.json").write_text(json.dumps({**record, "rules_version": rules,
                                                    "rules": protocol_module.RULES[rules]}))
    return root


def run_compare(root: Path, out: Path, *extra: str, capsys=None) -> tuple[dict, str]:
    assert compare.main([str(root), "--out", str(out), "--no-plots", *extra]) == 0
    printed = capsys.readouterr().out if capsys is not None else ""
    return json.loads((out / "verdict.json").read_text()), printed


@pytest.fixture(scope="module")
def v6(tmp_path_factory):
    """The sweep, its folder, and its comparison by the launch protocol (verdict.json, stdout)."""
    root = tmp_path_factory.mktemp("v6")
    folder = sweep(root / "sweep", seeds=3)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        verdict, _ = run_compare(folder, root / "out")
    return folder, root, verdict, printed.getvalue()


def test_rules_6_is_declared_and_the_older_versions_keep_their_rules():
    assert protocol_module.RULES_VERSION == 6 and 6 in protocol_module.RULE_CHANGES
    assert protocol_module.RULES[6]["recommendation"] and not any(
        protocol_module.RULES[version]["recommendation"] for version in range(1, 6))
    assert {key: value for key, value in protocol_module.RULES[6].items() if key != "recommendation"} == {
        key: value for key, value in protocol_module.RULES[5].items() if key != "recommendation"}


def test_the_recommendation_holds_the_keys_and_break_even_is_the_tokens_ratio_it_comes_from(v6):
    root, out, verdict, printed = v6
    advice = verdict["recommendation"]
    assert {"text", "break_even_throughput", "throughput_ratio", "time_ratio", "policy", "settings",
            "conclusion", "forgetting", "tokens_to_target_ratio"} <= set(advice)
    tokens, even = advice["tokens_to_target_ratio"], advice["break_even_throughput"]
    assert (even["value"], even["ci_low"], even["ci_high"]) == (tokens["value"], tokens["ci_low"], tokens["ci_high"])
    # by hand: per seed log(question / baseline) of tokens to target, t interval, exponentiated
    runs = pd.read_csv(out / "out" / "comparison.csv").set_index(["arm", "seed"])["tokens_to_target"]
    logs = np.log(runs[QUESTION] / runs["full_random real_tokens_per_step=null lr_scaling=null"]).to_numpy()
    half = stats.t.ppf(0.975, logs.size - 1) * logs.std(ddof=1) / np.sqrt(logs.size)
    assert even["value"] == pytest.approx(np.exp(logs.mean()))
    assert (even["ci_low"], even["ci_high"]) == pytest.approx((np.exp(logs.mean() - half), np.exp(logs.mean() + half)))
    assert 1.2 < even["value"] < 1.5   # planted: ~40 / ~30 steps at equal tokens per step
    rate = advice["throughput_ratio"]
    assert rate["source"] == "modelled_cost" and rate["value"] == pytest.approx(1.0)   # equal padding planted
    assert advice["time_ratio"]["value"] == pytest.approx(even["value"] / rate["value"])
    assert advice["conclusion"] == "baseline" and advice["policy"] == "full_random"
    assert advice["text"].startswith("Use full_random (sampler=full_random ") and "sampler.max_tokens=4096" in \
        advice["text"]
    assert f"{even['value']:.2f}x [{even['ci_low']:.2f}, {even['ci_high']:.2f}] the real tokens" in advice["text"]
    assert printed.startswith(f"recommendation: {advice['text']}")   # compare prints it first


def test_composition_separates_update_count_from_composition(v6):
    verdict = v6[2]
    parts = verdict["composition"]
    assert parts["arms"] == {"equal_updates": "bucketed real_tokens_per_step=full_random lr_scaling=null",
                             "equal_tokens": "full_random real_tokens_per_step=bucketed lr_scaling=null",
                             "lr_scaled": "bucketed real_tokens_per_step=null lr_scaling=sqrt"}
    assert 1.05 < parts["equal_updates"]["value"] < 1.35   # +0.05 probe loss: ~5 steps later than ~30
    assert 1.0 < parts["equal_tokens"]["value"] < 1.45     # bucketed (+0.1) over full_random at its tokens (+0.02)
    assert parts["lr_scaled"]["value"] < verdict["recommendation"]["break_even_throughput"]["value"]
    assert "batch composition: " in verdict["answer"] and "at equal updates per epoch" in verdict["answer"]
    # each claim carries its test's outcome: the time to target with its own interval and verdict
    assert "the modelled GPU time (+" in verdict["answer"] and "Holm p" in verdict["answer"]


def test_a_throughput_given_on_the_command_line_decides_against_the_break_even_interval(v6):
    root, out, launch, _ = v6
    even = launch["recommendation"]["break_even_throughput"]
    inside = round((even["ci_low"] + even["ci_high"]) / 2, 3)
    verdict, _ = run_compare(root, out / "given", "--throughput-ratio", str(inside), "--throughput-source",
                             "measured: one H200")
    advice = verdict["recommendation"]
    assert advice["throughput_ratio"] == {"value": inside, "source": "command_line", "detail": "measured: one H200"}
    assert advice["conclusion"] == "inconclusive" and advice["time_ratio"]["value"] == pytest.approx(
        even["value"] / inside)
    assert "Inconclusive on GPU time; keep full_random (sampler=full_random" in advice["text"]
    assert "the interval straddles break-even" in advice["text"]
    faster = decide(advice, {"value": even["ci_high"] * 1.5, "source": "command_line", "detail": ""})
    slower = decide(advice, {"value": even["ci_low"] / 1.5, "source": "command_line", "detail": ""})
    assert (faster["conclusion"], slower["conclusion"]) == ("question", "baseline")
    assert faster["text"].startswith("Use bucketed (sampler=bucketed ") and faster["policy"] == "bucketed"


def test_a_plan_gives_the_throughput_ratio_and_a_plan_without_the_policies_is_refused(v6):
    root, out = v6[:2]
    plan = out / "plan.json"
    plan.write_text(json.dumps({"meta": {"cost_model": {"c0": 0.0, "utilisation": 0.4}},
                                "policies": {"bucketed": {"pred_ktok_s": 9.84}, "full_random": {"pred_ktok_s": 8.0}}}))
    verdict, _ = run_compare(root, out / "planned", "--throughput-from", str(plan))
    rate = verdict["recommendation"]["throughput_ratio"]
    assert rate["source"] == "plan" and rate["value"] == pytest.approx(1.23) and "FLOPs form" in rate["detail"]
    plan.write_text(json.dumps({"policies": {"packed": {"pred_ktok_s": 9.0}}}))
    args = compare.parse_args([str(root), "--throughput-from", str(plan)])
    with pytest.raises(Refused) as refused:
        compare.given_throughput(args, verdict["recommendation"])
    message = str(refused.value)
    assert "--throughput-from" in message and "bucketed, full_random" in message and "\n" not in message
    assert "python -m dflash_lab.plan policies=[bucketed,full_random]" in message


def test_a_sweep_recorded_under_rules_5_keeps_its_verdict_and_prints_todays_recommendation(tmp_path, capsys):
    root = sweep(tmp_path / "v5", rules=5, seeds=2)
    verdict, printed = run_compare(root, tmp_path / "out", capsys=capsys)
    assert "recommendation" not in verdict and "composition" not in verdict
    assert "the modelled GPU time to reach probe loss 2.7 (" in verdict["answer"]   # rules 5's trade sentence
    assert printed.startswith("recommendation (today's rules, version 6; the sweep's rules have none): Use ")


def test_verdict_seeds_are_the_seeds_its_answer_rests_on_when_a_control_arm_is_missing(tmp_path):
    arms = {name: (sampler, {}, effects) for name, (sampler, _, effects) in ARMS.items()
            if name in ("full_random", "bucketed", "packed")}   # no positive control run
    analysis = {**ANALYSIS, "baseline": "full_random",
                "verdict": {**{key: VERDICT[key] for key in ("endpoint", "positive_control", "negative_control")},
                            "question": "bucketed"}}
    root = sweep(tmp_path / "sweep", arms=arms, seeds=3, analysis=analysis)
    verdict, _ = run_compare(root, tmp_path / "out")
    assert verdict["answer"].startswith("inconclusive: the positive control arm (bucket_sequential) is missing")
    assert verdict["seeds"] == 3   # before: 0, the pairs of the missing control


def test_the_decision_rule_and_its_text_without_runs():
    base = {"question": "b", "baseline": "f", "probe_loss": 2.2, "valid": True, "composition": {},
            "policies": {"question": {"sampler": "bucketed", "sampler.boundaries": "auto"},
                         "baseline": {"sampler": "full_random"}},
            "forgetting": {"endpoint": "residual_amplitude", "at_most": 0.0148, "margin": 0.01,
                           "share_at_most": 0.11, "answer": "no detectable effect"},
            "break_even_throughput": {"value": 1.99, "ci_low": 1.67, "ci_high": 2.37, "n_pairs": 5,
                                      "unit": "target"}}
    seen = {rate: decide(base, {"value": rate, "source": "plan", "detail": "d"}) for rate in (1.23, 1.99, 2.5)}
    assert [seen[rate]["conclusion"] for rate in (1.23, 1.99, 2.5)] == ["baseline", "inconclusive", "question"]
    assert [seen[rate]["policy"] for rate in (1.23, 1.99, 2.5)] == ["full_random", "full_random", "bucketed"]
    assert seen[2.5]["overrides"] == "sampler=bucketed sampler.boundaries=auto"
    assert "beyond the margin 0.01 declared irrelevant" in seen[1.23]["text"]
    assert decide({**base, "forgetting": {**base["forgetting"], "answer": "yes"}},
                  {"value": 9.0, "source": "plan", "detail": "d"})["conclusion"] == "forgetting"
    assert decide({**base, "break_even_throughput": None}, None)["text"].startswith("no recommendation")


def test_ratio_interval_has_the_target_as_unit_where_seeds_nest():
    runs = pd.DataFrame({"arm": ["q"] * 6 + ["b"] * 6, "seed": list(range(6)) * 2,
                         "target_seed": [s % 3 for s in range(6)] * 2,
                         "x": [2.0, 1.5, 1.8, 2.2, 1.5, 1.6] + [1.0] * 6})
    nested = ratio_interval(runs, "q", "b", "x", nested=True)
    assert (nested["unit"], nested["n_pairs"], nested["n_seeds"]) == ("target", 3, 6)
    per_target = np.log(np.array([2.0 * 2.2, 1.5 * 1.5, 1.8 * 1.6])) / 2
    assert nested["value"] == pytest.approx(np.exp(per_target.mean()))
    assert ratio_interval(runs, "q", None, "x", nested=True) is None


def test_build_verdict_and_add_time_to_target_are_split_below_radon_d():
    radon = pytest.importorskip("radon.complexity")
    source = Path(verdict_module.__file__).read_text()
    ranks = {block.name: radon.cc_rank(block.complexity) for block in radon.cc_visit(source)}
    assert ranks["build_verdict"] in "ABC" and ranks["add_time_to_target"] in "ABC"
