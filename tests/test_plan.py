"""Planner: cost model, predictions, and the Hydra app on a reference workload."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dflash_lab.metrics.throughput import format_eta
from dflash_lab.plan import CostModel, predict_throughput, recommendation, sampler_configs
from dflash_lab.sampling import POLICIES, build_policy


def test_cost_model_fit_recovers_coefficients():
    rng = np.random.default_rng(0)
    padded = rng.integers(1000, 4096, 200).astype(float)
    squared = padded * rng.integers(50, 1024, 200)
    truth = CostModel(0.03, 2e-5, 1e-9)
    fitted = CostModel.fit(padded, squared, truth.step_time(padded, squared) * (1 + rng.normal(0, 1e-3, 200)))
    assert fitted.c0 == pytest.approx(0.03, rel=0.05)
    assert fitted.c1 == pytest.approx(2e-5, rel=0.05)
    assert fitted.c2 == pytest.approx(1e-9, rel=0.1)


def test_cost_model_fit_never_goes_negative():
    padded = np.linspace(100, 1000, 50)
    fitted = CostModel.fit(padded, np.zeros(50), 0.5 - 1e-4 * padded)  # time falls with tokens: nonsense data
    assert min(fitted.c0, fitted.c1, fitted.c2) >= 0


def test_cost_model_from_run(tmp_path):
    rng = np.random.default_rng(1)
    padded = rng.integers(2000, 8192, 60) * 2  # two ranks' tokens
    sq = padded * rng.integers(64, 1024, 60)  # not collinear with padded
    rows = [{"step": i, "padded_tokens": int(p), "attn_tokens": int(s), "step_time_s": 0.01 + 1e-5 * p / 2}
            for i, (p, s) in enumerate(zip(padded, sq))]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 2}))
    fitted = CostModel.from_run(tmp_path)
    assert fitted.c1 == pytest.approx(1e-5, rel=0.02)
    with pytest.raises(ValueError, match="no usable metrics.jsonl rows"):
        CostModel.from_run(tmp_path / "nowhere")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "padded_tokens": 5, "sq_tokens": 5,
                                                        "step_time_s": 0.1}))
    with pytest.raises(ValueError, match="lacks.*attn_tokens"):
        CostModel.from_run(tmp_path)


def test_prediction_by_hand():
    lengths = np.array([10, 10, 20, 20, 40, 40, 80, 80])
    policy = build_policy("sorted_static", lengths, max_tokens=160, world_size=2)
    cost = CostModel(1.0, 0.01, 0.0)
    plan = policy.global_plan(0)
    step_times, step_real = [], []
    for s in range(plan.steps):
        pair = plan.batches[2 * s : 2 * s + 2]
        step_times.append(max(1.0 + 0.01 * b.size * lengths[b].max() for b in pair))
        step_real.append(sum(int(lengths[b].sum()) for b in pair))
    got = predict_throughput(policy, cost, epochs=3)
    assert sum(step_real) > lengths.sum()  # repeats of the remainder rule count too
    # Ktok/s over time: the epoch's real tokens over its summed step times (the rate the ETA implies)
    assert got["ktok_s"] == pytest.approx(sum(step_real) / sum(step_times) / 1000)
    # the trainer's summary definition: median over steps of real tokens / step time
    assert got["ktok_s_median"] == pytest.approx(float(np.median(np.array(step_real) / np.array(step_times))) / 1000)
    assert got["ktok_s_median"] != pytest.approx(got["ktok_s"])   # unequal steps: the two definitions part
    assert got["eta_s"] == pytest.approx(3 * sum(step_times))


def test_the_target_mode_takes_the_targets_forward_out_of_the_flop_priced_step():
    """cost.target=offline|disaggregated: a step runs no target forward (footprint.step_flops' executed_target);
    online: every step does. Each prediction also gives the other mode's Ktok/s, as the plan prints it."""
    from dataclasses import replace

    from dflash_lab.model.footprint import StepModel, batch_shapes, policy_anchors, step_flops
    from dflash_lab.sampling.anchors import block_tokens_per_sample, valid_positions_from_lengths

    from dflash_lab.presets import preset

    model = StepModel.from_model_config(preset("model", "tiny", block_size=8, anchor_density=None,
                                               anchors_per_doc=16))
    lengths = np.random.default_rng(3).integers(20, 400, 300)
    blocks = block_tokens_per_sample(valid_positions_from_lengths(lengths), block_size=8, anchors_per_doc=16,
                                     anchor_density=None)
    policy = build_policy("bucketed", lengths, max_tokens=1024, boundaries=[0, 100, 200, 400], block_tokens=blocks)
    online = CostModel(0.0, utilisation=0.5, peak_tflops=1e-3)
    got = {mode: predict_throughput(policy, replace(online, target=mode), epochs=1, step_model=model)
           for mode in ("online", "offline", "disaggregated")}
    plan = policy.global_plan(0)
    flops = step_flops(model, batch_shapes(plan.batches, policy.lengths, packed=False, model=model,
                                           anchors=policy_anchors(policy, model)))
    real = sum(int(policy.lengths[b].sum()) for b in plan.batches)
    off_seconds = (flops["executed"] - flops["executed_target"]).sum() / (0.5 * 1e9)
    assert got["offline"]["ktok_s"] == pytest.approx(real / off_seconds / 1000)
    assert got["offline"]["ktok_s"] == got["disaggregated"]["ktok_s"] == pytest.approx(
        got["online"]["ktok_s_target_off"])
    assert got["online"]["ktok_s"] == pytest.approx(got["offline"]["ktok_s_target_online"])
    share = flops["executed_target"].sum() / flops["executed"].sum()
    assert 0 < share < 1 and got["online"]["target_flop_share"] == pytest.approx(share)
    assert got["online"]["ktok_s"] == pytest.approx(got["offline"]["ktok_s"] * (1 - share))
    with pytest.raises(ValueError, match=r"cost\.target=offline: only the FLOPs form"):
        CostModel(0.01, 1e-5, target="offline")


def test_full_random_predicted_slower_than_bucketed_on_seed_shape():
    from dflash_lab.data.lengths import reference_lengths

    lengths = reference_lengths("seed", 50000)
    cost = CostModel(0.0, 2.5e-4, 0.0)
    ktok = {
        name: predict_throughput(build_policy(name, lengths, max_tokens=32768, world_size=8, **kw), cost, 6)["ktok_s"]
        for name, kw in [("full_random", {}), ("bucketed", {"boundaries": "seed"})]
    }
    assert ktok["full_random"] < 0.7 * ktok["bucketed"]


def test_sampler_configs_share_the_budget():
    chosen = {"name": "bucketed", "max_tokens": 999, "boundaries": [0, 5, 10], "drop_last": True}
    cfgs = sampler_configs(chosen, "all")
    assert {c["max_tokens"] for c in cfgs.values()} == {999}
    assert cfgs["bucketed_megabatch"]["boundaries"] == [0, 5, 10]
    assert "boundaries" not in cfgs["packed"]
    with pytest.raises(ValueError, match="unknown"):
        sampler_configs(chosen, ["nope"])


@pytest.mark.integration
def test_plan_cli_writes_table(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dflash_lab.plan", "data=lengths", "data.workload=cpu", "data.num_samples=20000",
         "sampler.max_tokens=4096", "sweep_k=[2,4]", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    table = pd.read_csv(tmp_path / "plan.csv", index_col=0)
    assert set(table.index) == set(POLICIES)
    assert (table["real_tokens_per_step"] > 0).all()
    assert table.loc["sorted_static", "pad_eff"] > 0.99
    assert table.loc["full_random", "pred_ktok_s"] < table.loc["bucketed", "pred_ktok_s"]
    assert json.loads((tmp_path / "plan.json").read_text())["meta"]["num_samples"] == 20000
    assert (tmp_path / "k_sweep.png").stat().st_size > 0
    # what a person reads: the narrow table with units, a legend, the ETA in days/hours/minutes, one recommendation
    printed = out.stdout.split("\nK sweep written")[0]
    step_part, diversity_part = printed.split("Supervision share")[0].split("Diversity and memory:")
    rows = [line for line in step_part.splitlines() if line.startswith("|")]
    assert rows[0].split("|")[1:4] == [" policy             ", " pad_eff % ", " steps/epoch "]
    assert [c.strip() for c in rows[0].split("|")[4:-1]] == ["docs", "real tok", "padded tok", "blk slots", "Ktok/s",
                                                             "med Ktok/s", "ETA"]
    diversity_rows = [line for line in diversity_part.splitlines() if line.startswith("|")]
    assert [c.strip() for c in diversity_rows[0].split("|")[2:-1]] == ["repeat", "spread CV", "order r", "peak GiB",
                                                                       "GPU %", "fits"]
    assert len(rows) == len(diversity_rows) == 2 + len(POLICIES) and max(map(len, rows + diversity_rows)) <= 128
    assert "budget_fill" not in printed and "- spread CV: within-batch length spread" in printed
    assert "Ktok/s relative to bucketed, over time (median step): sorted_static " in printed
    bucketed_row = next(line for line in rows if line.startswith("| bucketed "))
    assert f"| {format_eta(table.loc['bucketed', 'pred_eta_s'])} |" in bucketed_row
    assert f" {table.loc['bucketed', 'padded_tokens_per_step']:,.0f} |" in bucketed_row
    assert printed.count("recommended: ") == 1
    meta = json.loads((tmp_path / "plan.json").read_text())["meta"]
    assert meta["recommendation"]["line"] in printed and meta["recommendation"]["policy"] in POLICIES
    markdown = (tmp_path / "plan.md").read_text()
    assert markdown.startswith(printed.strip()) and "## Every column" in markdown and "budget_fill" in markdown


# ---- input validation: every bad planner input is refused before any work, naming the key -----------------------
@pytest.fixture(scope="module")
def plan_cfg(tmp_path_factory):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from dflash_lab.plan import CONF_DIR

    out = tmp_path_factory.mktemp("plan")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("plan", overrides=["data=lengths", "data.workload=cpu", "data.num_samples=3000",
                                         "sampler.max_tokens=4096", f"out_dir={out}"])
    return OmegaConf.to_container(cfg, resolve=True)


def with_override(cfg, dotted, value):
    import copy

    cfg = copy.deepcopy(cfg)
    *parents, leaf = dotted.split(".")
    node = cfg
    for key in parents:
        node = node[key]
    node[leaf] = value
    return cfg


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("sweep_k", [8, 2], r"sweep_k=\[8, 2\]: k_min 8 is above k_max 2; write sweep_k=\[2,8\]"),
        ("sweep_k", 5, r"sweep_k=5: must be two bucket counts \[k_min, k_max\], e\.g\. sweep_k=\[2,16\]"),
        ("sweep_k", [0, 4], r"sweep_k\[0\] \(k_min\)=0: must be >= 1"),
        ("sweep_k", [2, "x"], r"sweep_k\[1\] \(k_max\)='x': must be an integer"),
        ("sweep_method", "magic", r"sweep_method='magic': choose one of quantile, equal_tokens, optimal"),
        ("sampler.name", "bogus", r"sampler\.name='bogus': choose one of sorted_static"),
        ("sampler.max_tokens", "abc", r"sampler\.max_tokens='abc': must be an integer"),
        ("sampler.megabatch_batches", 4, r"unknown bucketed sampler key\(s\) \['megabatch_batches'\]; valid keys:"),
        ("data.path", "/x.jsonl", r"unknown data \(kind=lengths\) key\(s\) \['path'\]; valid keys: kind, "),
        ("data.kind", "parquet", r"data\.kind='parquet': choose one of"),
        ("data.workload", "bogus", r"data\.workload='bogus': choose one of seed, cpu, heavy_tailed, bimodal"),
        ("data.num_samples", 0, r"data\.num_samples=0: must be >= 1"),
        ("policies", ["bogus"], r"policies=\['bogus'\]: unknown \['bogus'\]; choose from .* or all"),
        ("policies", [], r"policies=\[\]: give all or a list of policies"),
        ("colour", "red", r"unknown plan key\(s\) \['colour'\]; valid keys: .*bands, cost, data, epochs"),
        ("cost.c5", 1.0, r"unknown cost key\(s\) \['c5'\]; valid keys: c0, c1, c2, c3, c4"),
        ("cost.c1", "fast", r"cost\.c1='fast': must be a number"),
        ("cost.c0", -1.0, r"cost\.c0=-1: must be >= 0"),
        ("cost.calibrate", "false", r"cost\.calibrate='false': must be true or false"),
        ("cost.target", "remote", r"cost\.target='remote': choose one of online, offline, disaggregated"),
        ("cost.target", "offline", r"cost\.target=offline: only the FLOPs form \(cost\.utilisation"),
        ("cost.from_run", 3, r"cost\.from_run=3: must be a run directory path"),
        ("epochs", 0, r"epochs=0: the configured run needs a positive number of epochs"),
        ("epochs", "six", r"epochs='six': must be a number"),
        ("world_size", 0, r"world_size=0: must be >= 1"),
        ("nodes", 3, r"nodes=3 does not divide world_size=8: world_size counts every rank"),
        ("nodes", 0, r"nodes=0: must be >= 1"),
        ("inter_node_busbw_gbs", 0, r"inter_node_busbw_gbs=0: give the all-reduce bus bandwidth across nodes"),
        ("seed", 1.5, r"seed=1\.5: must be a whole number"),
        ("bands", [0, 50, 20], r"bands=\[0, 50, 20\]: unsorted entries 50 and 20"),
        ("target_pad_eff", 2, r"target_pad_eff=2: must be <= 1"),
        ("recommend.min_within_batch_spread", "high", r"recommend\.min_within_batch_spread='high': must be a number"),
        ("recommend.max_composition_repeat", 2, r"recommend\.max_composition_repeat=2: must be <= 1"),
        ("recommend.min_spread", 0.1, r"unknown recommend key\(s\) \['min_spread'\]; valid keys: max_adjacent"),
    ],
)
def test_bad_plan_input_names_the_key(plan_cfg, key, value, match):
    from dflash_lab.plan import run_plan

    with pytest.raises(ValueError, match=match):
        run_plan(with_override(plan_cfg, key, value))


@pytest.mark.integration
def test_plan_refuses_bad_input_from_the_command_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dflash_lab.plan", "data=lengths", "+data.path=/data/chat.jsonl",
         f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode != 0 and "unknown data (kind=lengths) key(s) ['path']" in out.stderr
    assert not (tmp_path / "plan.csv").exists()


def test_a_plan_across_nodes_adds_the_gradient_all_reduce_to_every_step(plan_cfg, tmp_path):
    from dflash_lab.model.footprint import StepModel
    from dflash_lab.plan import run_plan
    from dflash_lab.planning.cost import gradient_allreduce_seconds

    one = run_plan({**with_override(plan_cfg, "world_size", 16), "policies": ["bucketed"],
                    "out_dir": str(tmp_path / "one")})
    two = run_plan({**with_override(with_override(plan_cfg, "world_size", 16), "nodes", 2), "policies": ["bucketed"],
                    "inter_node_busbw_gbs": 0.001, "out_dir": str(tmp_path / "two")})   # a slow link: a visible cost
    params = StepModel.from_model_config(plan_cfg["model"]).draft.params
    comm = gradient_allreduce_seconds(params, world_size=16, nodes=2, busbw_gbs=0.001)
    assert comm == pytest.approx(2 * 15 / 16 * 4 * params / 1e6)
    assert one.loc["bucketed", "pred_comm_s"] == 0 and two.loc["bucketed", "pred_comm_s"] == pytest.approx(comm)
    steps = one.loc["bucketed", "steps_per_epoch"] * plan_cfg["epochs"]
    assert two.loc["bucketed", "pred_eta_s"] - one.loc["bucketed", "pred_eta_s"] == pytest.approx(steps * comm)
    assert two.loc["bucketed", "pred_ktok_s"] < one.loc["bucketed", "pred_ktok_s"]
    text = (tmp_path / "two" / "plan.md").read_text()
    assert f"layout: 2 nodes x 8 ranks; every step adds {comm * 1e3:.3g} ms of gradient all-reduce" in text
    assert json.loads((tmp_path / "two" / "plan.json").read_text())["meta"]["nodes"] == 2


def test_policies_accepts_one_name_and_equal_real_tokens_flow(plan_cfg):
    from dflash_lab.plan import plan_table, policy_names

    assert policy_names("bucketed") == ["bucketed"]
    assert policy_names(["packed", "packed"]) == ["packed"]
    chosen = {"name": "full_random", "max_tokens": 4096, "real_tokens_per_step": 3000}
    cfgs = sampler_configs(chosen, ["bucketed", "full_random"])
    # full_random's T does not leak into bucketed, whose own key (its preset's null) stays the padded budget
    assert cfgs["bucketed"]["max_tokens"] == 4096 and cfgs["bucketed"].get("real_tokens_per_step") is None
    from dflash_lab.data.lengths import reference_lengths

    table = plan_table(reference_lengths("cpu", 5000), cfgs, seed=0, world_size=1, epochs=1, cost=CostModel(0, 1e-5))
    assert table.loc["full_random", "real_tokens_per_step"] == pytest.approx(3000, rel=0.03)
    assert table.loc["bucketed", "real_tokens_per_step"] > 2000


# ---- the recommendation: fastest policy above the diversity floors that fits ------------------------------------
def _plan_rows(**columns):
    names = ["sorted_static", "bucketed", "packed", "full_random"]
    base = {"pred_ktok_s": [150.0, 117.0, 140.0, 68.0], "pred_eta_s": [3600.0, 4600.0, 3900.0, 8000.0],
            "within_batch_spread": [0.0, 0.17, 0.16, 0.62], "composition_repeat": [1.0, 0.0, 0.0, 0.0],
            "adjacent_length_corr": [0.0, 0.0, 0.0, 0.0]}
    return pd.DataFrame({**base, **columns}, index=names)


FLOORS = {"min_within_batch_spread": 0.1, "max_composition_repeat": 0.1, "max_adjacent_length_corr": 0.5}


def test_recommendation_is_the_fastest_policy_above_every_floor_and_says_why():
    advice = recommendation(_plan_rows(), FLOORS)
    assert advice["policy"] == "packed"
    assert advice["line"] == (
        "recommended: packed, the fastest policy (140.0 Ktok/s, ETA 1h 05m) with spread >= 0.1, repeat <= 0.1 and "
        "order r <= 0.5; faster but excluded: sorted_static (spread 0.00, repeat 1.00)")
    # a floor switched off (null) no longer excludes; a missing figure never clears a floor
    assert recommendation(_plan_rows(), {**FLOORS, "min_within_batch_spread": None,
                                         "max_composition_repeat": None})["policy"] == "sorted_static"
    nan_spread = _plan_rows(within_batch_spread=[0.0, 0.17, float("nan"), 0.62])
    assert recommendation(nan_spread, FLOORS)["policy"] == "bucketed"
    assert recommendation(nan_spread, FLOORS)["excluded"]["packed"] == ["spread nan"]


def test_recommendation_respects_memory_and_names_checkpointing():
    rows = _plan_rows(fits=["yes", "ckpt", "no", "yes"], pred_peak_mem_gb=[40.0, 75.0, 95.0, 30.0])
    advice = recommendation(rows, FLOORS)
    assert advice["policy"] == "bucketed" and "fitting in memory" in advice["line"]
    assert "(with activation checkpointing: activation_checkpointing=true)" in advice["line"]
    assert "packed (needs 95 GiB)" in advice["line"]
    assert "activation checkpointing" not in recommendation(rows, FLOORS, activation_checkpointing=True)["line"]


def test_no_qualifying_policy_is_said_with_each_reason_and_the_fix():
    advice = recommendation(_plan_rows(), {**FLOORS, "min_within_batch_spread": 0.9})
    assert advice["policy"] is None
    assert advice["line"].startswith("recommended: none; no policy qualifies (spread >= 0.9, repeat <= 0.1 and "
                                     "order r <= 0.5): sorted_static (spread 0.00, repeat 1.00); bucketed (spread")
    assert "Relax the recommend.* floors" in advice["line"]


SEED_REGIME = ["model=qwen3_8b", "data=lengths", "data.workload=seed", "cost=seed", "sampler.boundaries=seed",
               "policies=[full_random,bucketed]", "sampler.max_tokens=32768", "sampler.max_block_tokens=null",
               "gpu=rtx_pro_6000"]


@pytest.mark.integration
def test_the_seed_regime_plan_says_what_it_predicts(tmp_path):
    """Issue 22's acceptance command: the seed's stated regime (32K-token steps, no block budget, the recipe's
    anchors, 800K documents) prints the per-rank-step columns, Ktok/s over time and on the median step, the
    full_random/bucketed ratio of each, what a target off the trainer GPUs changes, and no calibration warning.
    cost=seed is calibrated here: bucketed's Ktok/s over time is the seed's 25.1 (its tokens over its wall time).
    The ratios are the FLOP model's (docs/gpu.md, "The seed calibration"): 0.636 on the median step, 0.754 over
    time; the seed measured 0.478, below what any FLOP mix of these steps gives."""
    out = subprocess.run([sys.executable, "-m", "dflash_lab.plan", *SEED_REGIME, f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = out.stdout
    assert "warning" not in printed.lower() and "not calibrated" not in out.stderr
    header = next(line for line in printed.splitlines() if line.startswith("| policy ") and "docs" in line)
    assert [cell.strip() for cell in header.split("|")[1:-1]] == [
        "policy", "pad_eff %", "steps/epoch", "docs", "real tok", "padded tok", "blk slots", "Ktok/s", "med Ktok/s",
        "ETA"]
    table = pd.read_csv(tmp_path / "plan.csv", index_col=0)
    fr, bk = table.loc["full_random"], table.loc["bucketed"]
    assert bk["pred_ktok_s"] == pytest.approx(25.1, rel=0.01)          # the calibration, like with like
    assert bk["pred_ktok_s_median"] == pytest.approx(1.245 * bk["pred_ktok_s"], rel=0.02)
    median_ratio = fr["pred_ktok_s_median"] / bk["pred_ktok_s_median"]
    over_time_ratio = fr["pred_ktok_s"] / bk["pred_ktok_s"]
    assert 0.55 <= median_ratio <= 0.70 and median_ratio == pytest.approx(0.636, abs=0.01)
    assert over_time_ratio == pytest.approx(0.754, abs=0.01)
    assert (f"Ktok/s relative to bucketed, over time (median step): full_random {over_time_ratio:.3f} "
            f"({median_ratio:.3f})") in printed
    # the regime: 6.6 vs 11.6 documents and 14.2K vs 24.8K real tokens per rank-step, 7% fewer padded tokens,
    # 43% fewer block slots (the draft's work)
    assert fr["mean_samples_per_batch"] == pytest.approx(6.64, abs=0.05)
    assert bk["mean_samples_per_batch"] == pytest.approx(11.59, abs=0.05)
    assert fr["real_tokens_per_step"] / bk["real_tokens_per_step"] == pytest.approx(0.573, abs=0.005)
    assert fr["padded_tokens_per_step"] / bk["padded_tokens_per_step"] == pytest.approx(0.928, abs=0.005)
    assert fr["block_tokens"] / bk["block_tokens"] == pytest.approx(0.573, abs=0.005)
    # the target off the trainer GPUs (offline or disaggregated): what the plan says it changes
    assert "target online (cost.target)" in printed and "Off them (cost.target=offline or disaggregated" in printed
    assert fr["pred_ktok_s_target_off"] / bk["pred_ktok_s_target_off"] == pytest.approx(0.899, abs=0.01)
    assert "anchor rule: recipe (min(512, valid positions) anchors per document, block size 16)" in printed
    assert "executed FLOPs (target online) / (0.323 x 500 TFLOP/s)" in printed


# ---- the cost model's calibration: a warning when it was fitted on another model ------------------------------------
def _model(name, **changes):
    """The ``model`` section of ``python -m dflash_lab.plan model=<name>``, composed by Hydra as the CLI composes it
    (its defaults list included: qwen3_8b is model=hf's keys plus the target's shape)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose("plan", overrides=[f"model={name}"])
    return {**OmegaConf.to_container(cfg.model, resolve=True), **changes}


def _hf_target(path: Path, hidden: int) -> Path:
    """A local HF target with a config.json only (the planner reads the shape, never the weights)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 4 * hidden, "vocab_size": 1000, "head_dim": hidden // 4}))
    return path


def test_the_planner_warns_when_the_cost_model_was_calibrated_on_another_model(tmp_path):
    from dflash_lab.plan import cost_calibration_warning

    tiny_cost = {"calibrated_for": "tiny", "from_run": None, "calibrate": False}
    seed_cost = {"calibrated_for": "qwen3_8b", "from_run": None, "calibrate": False}
    assert cost_calibration_warning(tiny_cost, _model("tiny")) is None
    assert cost_calibration_warning(seed_cost, _model("qwen3_8b")) is None
    hf = _model("hf", target_path=str(_hf_target(tmp_path / "target", 64)), draft_layers=1)
    for cost, model in ((tiny_cost, hf), (tiny_cost, _model("tiny", hidden_size=128)), (seed_cost, hf)):
        warning = cost_calibration_warning(cost, model)
        assert warning and "not calibrated for this model" in warning and "cost.from_run=<a run dir" in warning
        assert f"model={cost['calibrated_for']}" in warning and f"model={model['kind']}" in warning
    assert cost_calibration_warning({**tiny_cost, "calibrate": True}, hf) is None   # timed on this model
    assert cost_calibration_warning({**tiny_cost, "calibrated_for": None}, hf) is None   # the user's coefficients
    with pytest.raises(ValueError, match=r"cost\.calibrated_for='nope': not a model preset \(conf/model/\)"):
        cost_calibration_warning({**tiny_cost, "calibrated_for": "nope"}, hf)
    # cost.from_run: the runs' own .hydra/config.yaml says what they trained
    for name, model in (("run_hf", hf), ("run_tiny", _model("tiny"))):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "config.yaml").write_text(json.dumps({"model": model}))
    assert cost_calibration_warning({**tiny_cost, "from_run": str(tmp_path / "run_hf")}, hf) is None
    warning = cost_calibration_warning({**tiny_cost, "from_run": [str(tmp_path / "run_hf"),
                                                                  str(tmp_path / "run_tiny")]}, hf)
    assert warning and f"cost.from_run={tmp_path / 'run_tiny'} was fitted on hidden 64, layers 4" in warning


def test_the_plan_prints_and_records_the_calibration_warning(plan_cfg, tmp_path, capsys):
    from dflash_lab.plan import run_plan

    cfg = with_override(with_override(plan_cfg, "model.hidden_size", 128), "out_dir", str(tmp_path))
    run_plan(cfg)
    printed = capsys.readouterr().out
    assert printed.count("warning: the cost model is not calibrated for this model") == 1
    assert "hidden 128" in printed and "cost.from_run=<a run dir of this model>" in printed
    assert "not calibrated" in json.loads((tmp_path / "plan.json").read_text())["meta"]["cost_warning"]
    run_plan(with_override(plan_cfg, "out_dir", str(tmp_path)))   # the tiny model the default cost was fitted on
    assert "not calibrated" not in capsys.readouterr().out


# ---- issue 31: the parts of a plan belong to one model, and the README's plan commands plan the model they claim --
def test_a_plan_whose_workload_cost_and_model_describe_different_models_is_refused(tmp_path):
    from dflash_lab.plan import check_plan_belongs

    lengths = {"kind": "lengths", "workload": "seed", "num_samples": 800000, "seed": 0}
    seed_cost = {"calibrated_for": "qwen3_8b", "from_run": None, "calibrate": False}
    tiny_cost = {"calibrated_for": "tiny", "from_run": None, "calibrate": False}
    with pytest.raises(ValueError, match=r"^data\.workload=seed is the seed run's Qwen3-8B token lengths .* plan is "
                                         r"for model=tiny \(the default\): add model=qwen3_8b"):
        check_plan_belongs(seed_cost, _model("tiny"), lengths)
    with pytest.raises(ValueError, match=r"calibrated for model=qwen3_8b .* the plan is for model=tiny \(the "
                                         r"default\).* Add model=qwen3_8b to plan that model, or cost=cpu_tiny"):
        check_plan_belongs(seed_cost, _model("tiny"), {**lengths, "workload": "cpu"})
    with pytest.raises(ValueError, match=r"calibrated for model=tiny .* plan is for model=qwen3_8b.*cost=seed for "
                                         r"model=qwen3_8b"):
        check_plan_belongs(tiny_cost, _model("qwen3_8b"), lengths)
    check_plan_belongs(seed_cost, _model("qwen3_8b"), lengths)                           # the seed's run
    check_plan_belongs(tiny_cost, _model("tiny"), {**lengths, "workload": "cpu"})         # the tiny CPU model
    hf = _model("hf", target_path=str(_hf_target(tmp_path / "target", 64)), draft_layers=1)
    check_plan_belongs(tiny_cost, hf, {"kind": "jsonl"})        # your own target: the calibration warning only
    check_plan_belongs({**seed_cost, "calibrated_for": None}, _model("tiny"), {**lengths, "workload": "cpu"})


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_plan_commands() -> list[list[str]]:
    """The ``python -m dflash_lab.plan`` commands of the README's bash blocks, as argument lists (continuation
    lines joined, comments dropped)."""
    import re
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:3] == ["python", "-m", "dflash_lab.plan"]:
                commands.append(words[3:])
    return commands


def _readme_overrides(arguments: list[str], tmp_path: Path) -> list[str]:
    """A README command's overrides with its placeholders made real: a local Qwen3 target as the planner needs it
    (config.json and the tokenizer with its chat template; no weights) and a chat JSONL (tests/helpers.py)."""
    from helpers import CONVERSATIONS, QWEN3, tiny_chat_tokenizer, write_jsonl
    from transformers import Qwen3Config

    target = tmp_path / "target"
    if not target.exists():
        tokenizer = tiny_chat_tokenizer()
        tokenizer.chat_template = QWEN3.read_text()   # the target's own template, as a real one ships it
        tokenizer.save_pretrained(target)
        Qwen3Config(vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                    eos_token_id=tokenizer.eos_token_id).save_pretrained(target)   # room for the recipe's 5 layers
        write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS * 60])
    return [a.replace("/path/to/local/model", str(target)).replace("/path/to/chats.jsonl", str(tmp_path / "chats.jsonl"))
            for a in arguments]


def _claimed_shape(arguments: list[str], tmp_path: Path) -> str:
    """The shape a README plan command claims: the seed's (Qwen3-8B) for the seed's workload or cost, else the
    target its model.target_path names."""
    from dflash_lab.plan import model_fingerprint, model_preset_config

    if "data.workload=seed" in arguments or "cost=seed" in arguments:
        return model_fingerprint(model_preset_config("qwen3_8b"))
    assert "model=hf" in arguments, arguments
    return model_fingerprint({**_model("hf"), "target_path": str(tmp_path / "target")})


def _compose_plan(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        return OmegaConf.to_container(compose("plan", overrides=overrides), resolve=True)


def test_every_readme_plan_command_composes_to_the_model_it_claims(tmp_path):
    from dflash_lab.plan import check_plan_belongs, model_fingerprint

    commands = readme_plan_commands()
    assert len(commands) >= 4, commands
    for arguments in commands:
        cfg = _compose_plan(_readme_overrides(arguments, tmp_path) + [f"out_dir={tmp_path / 'out'}"])
        check_plan_belongs(dict(cfg["cost"]), cfg["model"], dict(cfg["data"]))
        assert model_fingerprint(cfg["model"]) == _claimed_shape(arguments, tmp_path), arguments


@pytest.mark.integration
def test_every_readme_plan_command_plans_the_model_it_claims(tmp_path, capsys):
    """Each README plan command through the planner (in-process, as the CLI runs it), on 20,000 samples of its
    workload instead of 800,000 (the same plan, smaller: the sweep_k command takes ~14 minutes at full size on a busy
    2-core machine): its plan.json names the claimed model's shape, the printed plan says it, no cost warning."""
    from dflash_lab.plan import run_plan

    for number, arguments in enumerate(readme_plan_commands()):
        out = tmp_path / f"plan{number}"
        smaller = ["data.num_samples=20000"] if "data=lengths" in arguments else []
        run_plan(_compose_plan(_readme_overrides(arguments, tmp_path) + smaller + [f"out_dir={out}"]))
        printed = capsys.readouterr().out
        meta = json.loads((out / "plan.json").read_text())["meta"]
        assert meta["model"]["shape"] == _claimed_shape(arguments, tmp_path), arguments
        assert f"({meta['model']['shape']})" in printed.splitlines()[1]
        if "cost=seed" in arguments:
            assert meta["cost_warning"] is None and "warning" not in printed.lower(), arguments


# ---- issue 43 ----------------------------------------------------------------------------------------------------
def test_an_out_dir_that_is_a_file_is_refused_before_any_work_naming_it(plan_cfg, tmp_path):
    """Defect 3: the plan ran, then ``mkdir`` ended it in a FileExistsError traceback."""
    from dflash_lab.plan import run_plan

    taken = tmp_path / "plan.txt"
    taken.write_text("keep me\n")
    with pytest.raises(ValueError, match=rf"^out_dir: {taken} is an existing file, not a directory: the plan's files "
                                         rf"\(plan\.csv, plan\.json, plan\.md\) go into a directory; choose a new or "
                                         rf"existing directory \(out_dir=<dir>\)$"):
        run_plan(with_override(plan_cfg, "out_dir", str(taken)))
    with pytest.raises(ValueError, match=rf"^out_dir: {taken / 'plan'}: its parent {taken} is an existing file"):
        run_plan(with_override(plan_cfg, "out_dir", str(taken / "plan")))
    assert [p.name for p in tmp_path.iterdir()] == ["plan.txt"] and taken.read_text() == "keep me\n"


@pytest.mark.integration
def test_an_out_dir_that_is_a_file_is_one_line_from_the_command_line(tmp_path):
    taken = tmp_path / "plan.txt"
    taken.write_text("keep me\n")
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    out = subprocess.run([sys.executable, "-m", "dflash_lab.plan", "data=lengths", "data.workload=cpu",
                          "data.num_samples=3000", f"out_dir={taken}", f"hydra.run.dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.splitlines() == [f"dflash_lab.plan: error: out_dir: {taken} is an existing file, not a "
                                       f"directory: the plan's files (plan.csv, plan.json, plan.md) go into a "
                                       f"directory; choose a new or existing directory (out_dir=<dir>)",
                                       "(HYDRA_FULL_ERROR=1 shows the traceback)"]
    assert taken.read_text() == "keep me\n"


def test_a_plan_says_what_it_does_on_stderr_when_it_runs_long_and_its_output_stays_the_same(plan_cfg, tmp_path,
                                                                                           capsys):
    """Issue 43: a plan over 10 million samples ran 160 s with no output. Progress lines come every
    progress_every_s seconds whatever the plan's size (here 0.01 s, so this small plan prints some); the printed plan
    and its files are the same as without them."""
    from dflash_lab.plan import run_plan

    cfg = with_override(plan_cfg, "out_dir", str(tmp_path / "plan"))
    run_plan({**cfg, "progress_every_s": 0})
    quiet = capsys.readouterr()
    files = {path.name: path.read_bytes() for path in (tmp_path / "plan").iterdir()}
    assert quiet.err == "" and set(files) == {"plan.csv", "plan.json", "plan.md"}
    run_plan({**cfg, "progress_every_s": 0.01})
    told = capsys.readouterr()
    assert told.out == quiet.out and {path.name: path.read_bytes() for path in (tmp_path / "plan").iterdir()} == files
    lines = told.err.splitlines()
    assert lines and all(re.fullmatch(r"plan: \d+ s, .+", line) for line in lines[:-1]), lines
    assert re.fullmatch(r"plan: done in \d+ s", lines[-1]), lines
    assert any(re.fullmatch(r"plan: \d+ s, policy (\w+) \([1-6] of 6\): its epoch plans, diversity and predicted "
                            r"speed, memory", line) for line in lines), lines
    with pytest.raises(ValueError, match=r"progress_every_s=-1: must be >= 0"):
        run_plan(with_override(plan_cfg, "progress_every_s", -1))


def test_progress_lines_name_the_stage_at_their_time():
    import io
    import time

    from dflash_lab.planning.progress import StageTimer

    out = io.StringIO()
    with StageTimer("plan", every_s=0.05, stream=out) as progress:
        progress.stage("reading the data")
        time.sleep(0.3)
        progress.stage("policy bucketed (1 of 1)")
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    stages = [line.split(" s, ", 1)[1] for line in lines[:-1]]
    assert "reading the data" in stages and stages[-1] == "policy bucketed (1 of 1)"
    assert stages == sorted(stages, key=["reading the data", "policy bucketed (1 of 1)"].index)   # in order
    assert re.fullmatch(r"plan: done in [01] s", lines[-1]), lines


def test_the_planners_stage_timer_and_the_data_passs_item_counter_are_named_apart():
    """Both were ``Progress``: an import or a type hint did not say which one it meant."""
    from dflash_lab.data import progress as data_progress
    from dflash_lab.planning import progress as planning_progress

    assert not hasattr(data_progress, "Progress") and not hasattr(planning_progress, "Progress")
    assert (data_progress.ItemProgress.__name__, planning_progress.StageTimer.__name__) == ("ItemProgress",
                                                                                             "StageTimer")
