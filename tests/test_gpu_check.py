"""benchmarks/gpu_check.py and scripts/gpu_check.sh on CPU: the memory plan it resolves, the seed regime and the
quick mode, its JSON lines, and predicted vs measured peak memory (tiny shape within 25%, medium shape within 15%)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"policy", "ktok_s", "mfu", "peak_mem_gb", "peak_reserved_gb", "pred_peak_mem_gb", "step_time_s", "pad_eff",
          "max_tokens", "max_block_tokens", "activation_checkpointing", "truncated", "mem_ratio"}
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def gpu_check():
    """benchmarks/gpu_check.py as a module (loaded from its path: it is a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def _run_lines(args: list[str], timeout: float) -> tuple[dict, list[dict]]:
    """The setup line and every later line (steps, policies, comparison, checkpointing step)."""
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return lines[0]["setup"], lines[1:]


def _run(args: list[str], timeout: float) -> tuple[dict, list[dict]]:
    """The setup line and the policy rows."""
    setup, lines = _run_lines(args, timeout)
    return setup, [line for line in lines if "policy" in line]


def test_h200_keeps_the_32k_token_budget_under_recipe_anchors(gpu_check):
    """The Qwen3-8B shape on an H200 (141 GB): the token budget stays 32,768 and the block budget comes from the
    memory plan (recipe anchors: min(512, valid positions) per document); no document is truncated."""
    from dflash_lab.model import footprint
    from dflash_lab.data.lengths import reference_lengths

    cfg = gpu_check.compose_config("qwen3_8b", ["gpu=h200"])
    from omegaconf import OmegaConf

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    assert model_cfg["anchor_density"] is None and model_cfg["anchors_per_doc"] == 512
    step_model = footprint.StepModel.from_model_config(model_cfg)
    args = argparse.Namespace(shape="qwen3-8b", model="qwen3_8b", budget="auto", policies="bucketed,packed",
                              gpu=None, overrides=[])
    lengths = reference_lengths("seed", 3000, seed=0, scale=1)
    budget, source, plans = gpu_check.resolve_plans(args, lengths, step_model, footprint.Settings(), "auto",
                                                    float(cfg.gpu.memory_gb), 1)
    assert budget == 32768 and "shape" in source
    for name, plan in plans.items():
        assert isinstance(plan, footprint.MemoryPlan), (name, plan)
        assert plan.max_block_tokens >= 8192   # at least the recipe's 512 anchors x 16 of one long document
    cfg_bucketed = gpu_check.sampler_config("bucketed", "qwen3_8b", [], budget, 1, int(lengths.max()))
    assert cfg_bucketed["overlong"] == "error"   # nothing is truncated at the configured budget


def test_checkpointing_choice_reads_the_flag_or_the_override(gpu_check):
    ns = argparse.Namespace
    assert gpu_check.checkpointing_choice(ns(activation_checkpointing=None, overrides=[]), {}) == ("auto", "default")
    value, source = gpu_check.checkpointing_choice(
        ns(activation_checkpointing=None, overrides=["trainer.activation_checkpointing=true"]),
        {"activation_checkpointing": True})
    assert value is True and "override" in source
    assert gpu_check.checkpointing_choice(ns(activation_checkpointing="false", overrides=[]), {})[0] is False
    with pytest.raises(SystemExit):
        gpu_check.checkpointing_choice(
            ns(activation_checkpointing="false", overrides=["trainer.activation_checkpointing=true"]),
            {"activation_checkpointing": True})


def test_gpu_preset_gives_memory_and_peak(gpu_check):
    args = argparse.Namespace(shape="tiny", gpu="h100", overrides=[])
    preset = gpu_check.gpu_preset(gpu_check.compose_config("qwen3_8b", gpu_check.all_overrides(args)))
    assert preset["memory_gb"] == 80 and preset["bf16_dense_tflops"] == 989


def test_help_lists_the_quick_mode_and_the_seed_regime(gpu_check, capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--quick" in text and "--regime REGIME" in text and "seed run's regime" in text and "seed,plan" in text


def test_seed_regime_defaults_and_contradictions(gpu_check):
    args = gpu_check.parse_args(["--device", "cpu", "--shape", "tiny", "--regime", "seed", "--quick"])
    assert args.policies == "full_random,bucketed,packed" and args.ckpt_step is True
    assert (args.warmup, args.steps, args.num_samples, args.sample) == (1, 2, 8000, "stratified")
    assert "sampler.max_block_tokens=null" in gpu_check.all_overrides(args)
    assert gpu_check.checkpointing_choice(args, {"activation_checkpointing": True}) == (False, "--regime seed")
    full = gpu_check.parse_args(["--device", "cuda", "--regime", "seed"])
    assert (full.warmup, full.steps, full.num_samples) == (2, 8, 20000)
    assert gpu_check.parse_args(["--device", "cuda", "--regime", "seed", "--quick"]).steps == 5
    plan = gpu_check.parse_args(["--device", "cpu"])
    assert plan.regime == "plan" and plan.ckpt_step is False and plan.policies.split(",") == list(gpu_check.POLICIES)
    for bad in (["--regime", "seed", "--activation-checkpointing", "true"], ["--regime", "seed", "--nproc", "2"],
                ["--mem-cap-gb", "80"], ["--policies", "bucketed,nope"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--device", "cpu", *bad])


def test_seed_regime_plans_no_block_budget_and_no_checkpointing_at_32k(gpu_check):
    from dflash_lab.data.lengths import reference_lengths
    from dflash_lab.model import footprint

    args = gpu_check.parse_args(["--device", "cuda", "--regime", "seed"])
    lengths = reference_lengths("seed", 500, seed=0, scale=1)
    budget, source, plans = gpu_check.resolve_plans(args, lengths, None, footprint.Settings(), False, 96.0, 1)
    assert budget == 32768 and "shape" in source and list(plans) == ["full_random", "bucketed", "packed"]
    assert all(p.max_block_tokens is None and p.activation_checkpointing is False for p in plans.values())


def _tiny_plan(gpu_check, name="bucketed", step_ckpt=None):
    from dflash_lab.model import footprint
    from dflash_lab.sampling import build_policy

    from dflash_lab.presets import preset

    step_model = footprint.StepModel.from_model_config(preset("model", "tiny", draft_layers=1, block_size=8))
    lengths = np.random.default_rng(0).integers(20, 400, 300)
    extra = {"boundaries": [0, 100, 200, 400]} if name == "bucketed" else {}
    policy = build_policy(name, lengths, max_tokens=1024, seed=0, **extra)
    batches = policy.global_plan(0).batches
    shapes = footprint.batch_shapes(batches, policy.lengths, packed=policy.packed, model=step_model)
    peak = footprint.step_memory(step_model, shapes, footprint.Settings())["peak"]
    step_ckpt = np.zeros(len(batches), dtype=bool) if step_ckpt is None else step_ckpt
    return gpu_check.PolicyPlan(name, policy, batches, shapes, footprint.step_flops(step_model, shapes), peak, peak,
                                peak, np.ones(len(lengths), dtype=int), False, step_ckpt, peak)


def test_warmup_runs_the_cheapest_steps_of_two_shapes_and_timing_one_step_per_cost_stratum(gpu_check):
    plan = _tiny_plan(gpu_check)
    warm, timed = gpu_check.choose_steps(plan, 1, 2, 4)
    cost = plan.executed()
    assert warm[0] == int(np.argmin(cost)) and len(warm) == 2
    shape = lambda i: (int(plan.shapes["rows"][i]), int(plan.shapes["row_len"][i]))   # noqa: E731
    assert shape(warm[0]) != shape(warm[1])
    assert timed == gpu_check.gpu_epoch.stratified_steps(cost, 4, exclude=warm) and not set(warm) & set(timed)
    quartiles = np.quantile(cost, [0.25, 0.5, 0.75])
    assert [int(np.searchsorted(quartiles, cost[i])) for i in timed] == [0, 1, 2, 3]
    _, first = gpu_check.choose_steps(plan, 1, 2, 4, sample="first")
    assert first == [i for i in range(len(plan.batches)) if i not in warm][:4]
    with pytest.raises(ValueError, match="raise --num-samples"):
        gpu_check.choose_steps(plan, 1, 2, len(plan.batches))


def test_checkpointing_adds_the_recomputed_draft_forward_to_executed_flops(gpu_check):
    every_other = np.arange(len(_tiny_plan(gpu_check).batches)) % 2 == 0
    plan = _tiny_plan(gpu_check, step_ckpt=every_other)
    extra = plan.executed(True) - plan.executed(False)
    assert np.allclose(extra, plan.flops["executed_draft"] / 3) and (extra > 0).all()
    assert np.array_equal(plan.executed(), np.where(every_other, plan.executed(True), plan.executed(False)))


def test_the_seed_regime_checkpoints_only_the_steps_that_do_not_fit(gpu_check):
    from dflash_lab.model import footprint

    peaks = np.array([50.0, 86.0, 87.0, 150.0]) * footprint.GIB
    seed = argparse.Namespace(args=argparse.Namespace(regime="seed"), memory_cap_gb=96.0, gpu_mem_gb=139.8)
    assert gpu_check.step_checkpointing(False, peaks, seed).tolist() == [False, False, True, True]   # > 86.4 GiB
    plan = argparse.Namespace(args=argparse.Namespace(regime="plan"), memory_cap_gb=None, gpu_mem_gb=139.8)
    assert gpu_check.step_checkpointing(True, peaks, plan).all()
    assert not gpu_check.step_checkpointing(False, peaks, plan).any()


def test_optimizer_state_exists_before_the_first_step_and_the_weights_do_not_move(gpu_check):
    import torch

    model = torch.nn.Linear(8, 4)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    gpu_check.create_optimizer_state(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(set(optimizer.state[p]) >= {"exp_avg", "exp_avg_sq"} for p in model.parameters())
    assert optimizer.param_groups[0]["lr"] == 6e-4 and all(p.grad is None for p in model.parameters())


def test_epoch_line_fits_each_policy_and_divides_by_bucketed(gpu_check):
    """Synthetic timed steps at a known 0.2 s + FLOPs / 0.5 TFLOP/s: the fit returns them, the epoch's Ktok/s is
    the planner's definition on that line, and the planner's ratio stands beside the measured one."""
    from dflash_lab.model import footprint
    from dflash_lab.plan import predict_throughput
    from dflash_lab.presets import preset

    step_model = footprint.StepModel.from_model_config(preset("model", "tiny", draft_layers=1, block_size=8))
    plans = {name: _tiny_plan(gpu_check, name) for name in ("full_random", "bucketed")}
    records = {name: [{"step": i, "index": i, "phase": "timed", "compiled": False, "oom": None,
                       "executed_tflop": float(plan.executed()[i]) / 1e12,
                       "seconds": 0.2 + float(plan.executed()[i]) / 0.5e12}
                      for i in gpu_check.gpu_epoch.stratified_steps(plan.executed(), 5)]
               for name, plan in plans.items()}
    rows = {name: {"ktok_s": 1.0 + i} for i, name in enumerate(plans)}
    bench = argparse.Namespace(step_model=step_model, budget=1024, args=argparse.Namespace(regime="seed",
                                                                                           sample="stratified"))
    line = gpu_check.epoch_line(plans, records, rows, bench)["epoch"]
    for name, plan in plans.items():
        entry = line["policies"][name]
        assert entry["fit"]["intercept_s"] == pytest.approx(0.2) and entry["fit"]["marginal_tflops"] == \
            pytest.approx(0.5)
        cost = gpu_check.gpu_epoch.fitted_cost(gpu_check.gpu_epoch.StepTimeFit(0.2, 1 / 0.5e12, 5, 0.0))
        assert entry["ktok_s"] == pytest.approx(predict_throughput(plan.policy, cost, 1.0, step_model=step_model)
                                                ["ktok_s"])
    ratios = line["ratios"]["full_random_over_bucketed"]
    assert line["ratio"] == ratios["epoch"] == pytest.approx(line["policies"]["full_random"]["ktok_s"]
                                                             / line["policies"]["bucketed"]["ktok_s"])
    assert line["planner_ratio"] == pytest.approx(line["policies"]["full_random"]["planner_ktok_s"]
                                                  / line["policies"]["bucketed"]["planner_ktok_s"])
    assert ratios["sample"] == 0.5 and "packed_over_bucketed" not in line["ratios"]


@pytest.mark.integration
def test_gpu_check_cpu_two_ranks_and_checkpointing_override():
    """--nproc 2 on CPU: two gloo ranks under DDP; trainer.activation_checkpointing=true is honoured."""
    setup, rows = _run(["--shape", "tiny", "--policies", "packed", "--warmup", "0", "--steps", "1", "--nproc", "2",
                        "trainer.activation_checkpointing=true"], 900)
    assert setup["world_size"] == 2 and setup["activation_checkpointing"] is True
    assert "override" in setup["activation_checkpointing_source"]
    (row,) = rows
    assert row["activation_checkpointing"] is True and row["finite"] and FIELDS <= set(row)


def _run_sh(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", *args, str(out), "--work-dir",
                           str(tmp_path / "work")], cwd=ROOT, env={**ENV, "GPU_CHECK_DEPS": str(tmp_path / "deps")},
                          capture_output=True, text=True, timeout=1500)
    return proc, [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.integration
def test_gpu_check_sh_cpu(tmp_path):
    """bash scripts/gpu_check.sh --cpu --quick --only attention_tests,gpu_check: the CUDA tests recorded as skipped,
    then both regimes in one gpu_check process; every stage passes, every JSON line has its "check" (and the
    gpu_check lines their regime), each regime's epoch line carries the measured and the planner's ratio, its
    profile line the kernel classes, and the profile traces are written per regime."""
    proc, lines = _run_sh(tmp_path, "--quick", "--only", "attention_tests,gpu_check")
    assert proc.returncode == 0, (proc.stderr[-2000:], lines)
    assert all("check" in line and line["ok"] for line in lines), lines
    checks = [line["check"] for line in lines]
    assert checks[0] == "start" and checks[-1] == "done" and lines[0]["run_mode"] == "quick"
    tests = next(line for line in lines if line["check"] == "attention_tests")
    assert tests["failed"] == tests["passed"] == 0 and tests["skipped"] >= 2   # only the CUDA tests: skipped here
    assert all("cuda" in name.split("::", 1)[1].split(":")[0] for name in tests["skipped_tests"])   # (the test's name)
    assert {"tests/test_model_attention.py", "tests/test_model_head.py"} <= set(tests["files"])
    gpu_lines = [line for line in lines if line["check"] in ("gpu_check", *(f"gpu_check_{name}" for name in (
        "setup", "step", "epoch", "ckpt", "profile")))]
    assert all(line["regime"] in ("seed", "plan") for line in gpu_lines)
    rows = [line for line in lines if line["check"] == "gpu_check"]
    assert [(line["regime"], line["policy"]) for line in rows] == [
        ("seed", "full_random"), ("seed", "bucketed"), ("seed", "packed"), ("plan", "bucketed"), ("plan", "packed")]
    for row in rows:   # quick: tokens over wall, executed TFLOP, utilisation, memory (the model within 20%)
        assert FIELDS <= set(row) and row["finite"] and row["truncated"] == 0 and row["oom_steps"] == 0
        assert row["steps"] >= 1 and row["sample"] == "stratified" and 0 < row["pad_eff"] <= 1
        assert row["executed_tflop_per_step"] >= row["tflop_per_step"] > 0 and 0 < row["hfu"] < 1
        assert row["ktok_s"] > 0 and 0 < row["mfu"] < 1 and row["peak_reserved_gb"] >= row["peak_mem_gb"] * 0.5
        assert 0.8 <= row["pred_peak_mem_gb"] / row["peak_mem_gb"] <= 1.2, row
        assert 0 <= row["pred_fit_frac"] <= 1 if row["regime"] == "seed" else row["max_block_tokens"] > 0
    setups = [line for line in lines if line["check"] == "gpu_check_setup"]
    assert [line["regime"] for line in setups] == ["seed", "plan"] and setups[1]["regimes"] == ["seed", "plan"]
    for setup in setups:
        assert setup["device"] == "cpu" and setup["peak_source"] == "matmul" and setup["budget"] == 4096
    assert set(setups[1]["memory_plan"]) == {"bucketed", "packed"}   # the plan regime's, each with its reason
    assert all("reason" in plan for plan in setups[1]["memory_plan"].values())
    for regime in ("seed", "plan"):
        epoch = next(line for line in lines if line["check"] == "gpu_check_epoch" and line["regime"] == regime)
        assert epoch["policies"]["bucketed"]["planner_ktok_s"] > 0
        profile = next(line for line in lines if line["check"] == "gpu_check_profile" and line["regime"] == regime)
        assert profile["policy"] == "bucketed" and len(profile["classes"]) >= 3 and profile["top"]
        assert {"target", "draft_forward", "head", "backward", "optimizer"} <= set(profile["ranges"])
        assert Path(profile["trace"]).is_file() and profile["trace"].endswith(f"profile_trace_{regime}.json")
    seed_epoch = next(line for line in lines if line["check"] == "gpu_check_epoch")
    assert seed_epoch["ratio"] > 0 and seed_epoch["planner_ratio"] > 0
    for name in ("full_random", "bucketed"):   # (packed's fit may lack a point: a timed step that compiled)
        assert seed_epoch["policies"][name]["fit"]["points"] == 2
    assert [line["regime"] for line in lines if line["check"] == "gpu_check_ckpt"] == ["seed"]
    (status,) = [line for line in lines if line["check"] == "gpu_check_status"]
    assert status["regimes"] == ["seed", "plan"] and "train" not in checks


@pytest.mark.integration
def test_gpu_check_sh_cpu_train_stage(tmp_path):
    """--only train on CPU: the training entry point on a random-weight target written without weights, to the
    end (tau included), with the memory plan, the compiled-graph count and the peak from inside the run."""
    proc, lines = _run_sh(tmp_path, "--only", "train")
    assert proc.returncode == 0, (proc.stderr[-2000:], lines)
    (train,) = [line for line in lines if line["check"] == "train"]
    assert train["status"] == "finished" and train["steps"] > 0 and train["ktok_s"] > 0 and train["tau"] >= 1
    assert train["target_digest"].startswith("random-") and train["compiled_graphs"] >= 0
    assert train["memory_log"][0].startswith("memory plan: block budget") and train["peak_rss_gb"] > 0
    assert train["recompiles"] == 0 and not list((tmp_path / "work" / "qwen3_random").glob("*.safetensors"))


@pytest.fixture(scope="module")
def stage_budget():
    """benchmarks/gpu_stage_budget.py (it imports gpu_check from its folder)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_stage_budget

    return gpu_stage_budget


@pytest.fixture(scope="module")
def stages():
    """scripts/gpu_check_stages.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_stages", ROOT / "scripts" / "gpu_check_stages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stage_limits_keep_the_modes_within_4_and_7_minutes_and_say_where_they_come_from(stages):
    for run_mode, seconds in (("quick", 240), ("full", 435)):   # full: 45 s inside its 8 minutes of machine time
        limits = stages.TIMEOUTS[("gpu", run_mode)]
        assert sum(limits[name] for name in stages.STAGES[run_mode]) <= seconds
    assert stages.STAGES["full"] == ("attention_tests", "gpu_check", "train")   # both regimes in the one command
    # the CUDA tests: the first H200 run's CUDA flex test took 12.7 s cold, + ~16 s of pytest start
    assert stages.TIMEOUTS[("gpu", "full")]["attention_tests"] >= 1.15 * (12.7 + 16)
    assert set(stages.LIMIT_SOURCES) == set(stages.TIMEOUTS[("gpu", "full")])


def test_train_line_reads_the_preflight_the_probe_and_dynamos_recompiles(stages):
    from dflash_lab.model.footprint import gpu_use

    # the preflight line as the trainer writes it (dflash_lab/training/components.py)
    log = (f"memory plan: block budget 53344; checkpointing off\npreflight: {gpu_use(16.7, 139.8)}\n"
           "V1204 torch/_dynamo/guards.py] Recompiling function rms_norm in /repo/dflash_lab/model/draft.py:40\n"
           "    triggered by the following guard failure(s):\n"
           "V1204 torch/_dynamo/guards.py] Recompiling function rms_norm in /repo/dflash_lab/model/draft.py:40\n")
    row = stages.train_figures(log, {"status": "finished", "ktok_s": 8.5, "other": 1},
                               {"peak_mem_gb": 12.5, "peak_rss_gb": 3.0, "compiled_graphs": 7, "flex_graphs": 2})
    assert row["status"] == "finished" and "other" not in row and row["compiled_graphs"] == 7
    assert row["pred_peak_mem_gb"] == 16.7 and row["mem_ratio"] == pytest.approx(16.7 / 12.5)
    assert row["recompiles"] == 2 and row["recompiled_functions"] == ["rms_norm (draft.py:40)"]
    cpu = stages.train_figures("memory plan: block budget 13442\n", {}, {"peak_mem_gb": None, "compiled_graphs": 0})
    assert cpu["pred_peak_mem_gb"] is None and "mem_ratio" not in cpu and "CUDA" in cpu["pred_peak_scope"]


def test_a_gpu_check_stage_needs_every_regimes_policies_epoch_and_profile_lines(stages):
    seed = [{"check": "gpu_check", "regime": "seed", "policy": p, "finite": True, "steps": 2}
            for p in ("full_random", "bucketed", "packed")]
    assert stages.gpu_check_problems(("seed",), seed) == ["seed gpu_check_epoch: no line",
                                                          "seed gpu_check_profile: no line"]
    seed += [{"check": "gpu_check_epoch", "regime": "seed", "ratio": 0.8},
             {"check": "gpu_check_profile", "regime": "seed", "error": "deadline passed"}]
    assert stages.gpu_check_problems(("seed",), seed) == ["seed gpu_check_profile: deadline passed"]
    seed[-1].pop("error")
    plan = [{**row, "regime": "plan"} for row in seed[1:]]   # bucketed, packed, epoch, profile
    assert stages.gpu_check_problems(("seed", "plan"), seed + plan) == []
    # the seed regime's lines do not stand in for the plan's: a deadline that cut the plan regime short shows
    assert stages.gpu_check_problems(("seed", "plan"), seed + plan[:1]) == [
        "plan: no row for packed", "plan gpu_check_epoch: no line", "plan gpu_check_profile: no line"]


def test_the_train_probe_names_its_file_per_rank(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_train_probe", ROOT / "scripts" / "gpu_train_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    monkeypatch.delenv("RANK", raising=False)
    assert probe.probe_path("/w/probe.json") == Path("/w/probe.json")
    monkeypatch.setenv("RANK", "1")
    assert probe.probe_path("/w/probe.json") == Path("/w/probe.rank1.json")
    assert probe.main(["trainer=gpu"]) == 2   # the probe file first: a forgotten one is not taken for an override
    figures = probe.measurements(3)
    assert figures["exit_code"] == 3 and figures["compiled_graphs"] >= 0 and figures["peak_rss_gb"] > 0


def test_seed_stage_runs_five_strata_on_a_gpu_and_its_limit_holds_its_priced_steps(stages, stage_budget, tmp_path):
    """The seed stage's command asks gpu_check for the strata its limit was priced for, and the limit is at least
    1.15x the stage priced by benchmarks/gpu_stage_budget.py (its own plans; the first H200 run's step rate,
    time outside the steps and warm-up); the plan stage's likewise."""
    cmd = stages.gpu_check_command("gpu_check_seed", "gpu", "full", 190, tmp_path)
    assert cmd[cmd.index("--steps") + 1] == str(stages.SEED_STRATA["gpu"])
    assert "--steps" not in stages.gpu_check_command("gpu_check_seed", "cpu", "full", 190, tmp_path)
    for run_mode in ("quick", "full"):
        priced = stage_budget.price_stage(["seed"], run_mode == "quick", stages.SEED_STRATA["gpu"],
                                              [None])["stage_s"]
        assert stages.TIMEOUTS[("gpu", run_mode)]["gpu_check_seed"] >= 1.15 * priced, (run_mode, priced)
    priced = stage_budget.price_stage(["plan"], False, 3, ["bucketed,packed"])["stage_s"]
    assert stages.TIMEOUTS[("gpu", "full")]["gpu_check_plan"] >= 1.15 * priced


def test_the_full_check_runs_both_regimes_in_one_process_within_its_priced_limit(stages, stage_budget, tmp_path):
    """gpu_check: one gpu_check.py process, the seed regime (its three policies) then the plan regime (bucketed and
    packed), 5 strata each; the seed regime's deadline leaves the plan regime its reserve, the plan's is the
    stage's; the limit is at least 1.15x both regimes priced in one process, and the reserve at least 1.15x the
    plan regime's part of that price."""
    limit = stages.TIMEOUTS[("gpu", "full")]["gpu_check"]
    cmd = stages.gpu_check_command("gpu_check", "gpu", "full", limit, tmp_path)
    options = lambda flag: [cmd[i + 1] for i, arg in enumerate(cmd) if arg == flag]   # noqa: E731
    assert options("--regime") == ["seed,plan"] and options("--steps") == ["5"]
    assert options("--policies") == ["full_random,bucketed,packed", "bucketed,packed"]
    final = limit - stages.DEADLINE_MARGIN_S
    assert [float(d) for d in options("--deadline-s")] == [final - stages.PLAN_RESERVE_S["gpu"], final]
    priced = stage_budget.price_stage(["seed", "plan"], False, stages.SEED_STRATA["gpu"],
                                          [",".join(stages.SEED_POLICIES), ",".join(stages.PLAN_POLICIES)])
    seed_part, plan_part = priced["regimes"]
    assert plan_part["outside_s"] < 10 and plan_part["warmup_s"] < seed_part["warmup_s"] / 2   # no start, no compile
    assert limit >= 1.15 * priced["stage_s"] and stages.PLAN_RESERVE_S["gpu"] >= 1.15 * plan_part["stage_s"]
    assert float(options("--deadline-s")[0]) >= 1.1 * seed_part["stage_s"]   # neither regime is squeezed


def test_several_regimes_take_their_own_policies_deadlines_and_traces(gpu_check, capsys):
    args = gpu_check.parse_args(["--device", "cpu", "--regime", "seed,plan", "--policies", "full_random,packed",
                                 "--policies", "bucketed", "--deadline-s", "100", "--deadline-s", "200",
                                 "--profile-trace", "/w/trace.json"])
    seed, plan = (gpu_check.regime_view(args, i) for i in range(2))
    assert (seed.regime, seed.policies, seed.deadline_s, seed.ckpt_step) == ("seed", "full_random,packed", 100, True)
    assert (plan.regime, plan.policies, plan.deadline_s, plan.ckpt_step) == ("plan", "bucketed", 200, False)
    assert (seed.profile_trace, plan.profile_trace) == ("/w/trace_seed.json", "/w/trace_plan.json")
    once = gpu_check.parse_args(["--device", "cpu", "--regime", "seed,plan", "--deadline-s", "90"])
    assert [gpu_check.regime_view(once, i).policies for i in range(2)] == [
        ",".join(gpu_check.SEED_POLICIES), ",".join(gpu_check.POLICIES)]
    assert [gpu_check.regime_view(once, i).deadline_s for i in range(2)] == [90, 90]
    for bad, message in ((["--regime", "seed,seed"], "each once"), (["--regime", "seed,gpu"], "each once"),
                         (["--regime", "seed,plan", "--policies", "a", "--policies", "b", "--policies", "c"],
                          "once per regime"),
                         (["--regime", "seed,plan", "--policies", "bucketed", "--policies", "nope"], "unknown"),
                         (["--regime", "plan,seed", "--nproc", "2"], "one rank")):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--device", "cpu", *bad])
        assert message in capsys.readouterr().err, bad
