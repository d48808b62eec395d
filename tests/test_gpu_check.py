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
    assert "--quick" in text and "--regime {plan,seed}" in text and "seed run's regime" in text


def test_seed_regime_defaults_and_contradictions(gpu_check):
    args = gpu_check.parse_args(["--device", "cpu", "--shape", "tiny", "--regime", "seed", "--quick"])
    assert args.policies == "full_random,bucketed,packed" and args.ckpt_step is True
    assert (args.warmup, args.steps, args.num_samples) == (1, 1, 8000)
    assert "sampler.max_block_tokens=null" in gpu_check.all_overrides(args)
    assert gpu_check.checkpointing_choice(args, {"activation_checkpointing": True}) == (False, "--regime seed")
    full = gpu_check.parse_args(["--device", "cuda", "--regime", "seed"])
    assert (full.warmup, full.steps, full.num_samples) == (2, 6, 20000)
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


def _tiny_plan(gpu_check, name="bucketed"):
    from dflash_lab.model import footprint
    from dflash_lab.sampling import build_policy

    from dflash_lab.presets import preset

    step_model = footprint.StepModel.from_model_config(preset("model", "tiny", draft_layers=1, block_size=8))
    lengths = np.random.default_rng(0).integers(20, 400, 300)
    policy = build_policy(name, lengths, max_tokens=1024, seed=0, boundaries=[0, 100, 200, 400])
    batches = policy.global_plan(0).batches
    shapes = footprint.batch_shapes(batches, policy.lengths, packed=policy.packed, model=step_model)
    peak = footprint.step_memory(step_model, shapes, footprint.Settings())["peak"]
    return gpu_check.PolicyPlan(name, policy, batches, shapes, footprint.step_flops(step_model, shapes), peak, peak,
                                peak, np.ones(len(lengths), dtype=int), False)


def test_warmup_runs_the_cheapest_steps_of_two_shapes_and_timing_the_plan_in_order(gpu_check):
    plan = _tiny_plan(gpu_check)
    warm, timed = gpu_check.choose_steps(plan, 1, 2, 4)
    cost = plan.executed()
    assert warm[0] == int(np.argmin(cost)) and len(warm) == 2
    shape = lambda i: (int(plan.shapes["rows"][i]), int(plan.shapes["row_len"][i]))   # noqa: E731
    assert shape(warm[0]) != shape(warm[1])
    assert timed == [i for i in range(len(plan.batches)) if i not in warm][:4]
    with pytest.raises(ValueError, match="raise --num-samples"):
        gpu_check.choose_steps(plan, 1, 2, len(plan.batches))


def test_checkpointing_adds_the_recomputed_draft_forward_to_executed_flops(gpu_check):
    plan = _tiny_plan(gpu_check)
    extra = plan.executed(True) - plan.executed(False)
    assert np.allclose(extra, plan.flops["executed_draft"] / 3) and (extra > 0).all()


def test_comparison_divides_each_figure_by_bucketed(gpu_check):
    rows = {"full_random": {"ktok_s": 6.0, "ktok_s_median_step": 8.0, "planner_ktok_s_wall": 3.0,
                            "planner_ktok_s": 4.0, "planner_ktok_s_median_step": 3.5},
            "bucketed": {"ktok_s": 10.0, "ktok_s_median_step": 10.0, "planner_ktok_s_wall": 5.0,
                         "planner_ktok_s": 5.0, "planner_ktok_s_median_step": 5.0}}
    out = gpu_check.comparison(rows)["comparison"]
    assert out["full_random_over_bucketed"] == {"measured": 0.6, "measured_median_step": 0.8,
                                                "epoch_at_measured_tflops": None, "planner": 0.6,
                                                "planner_reported": 0.8, "planner_median_step": 0.7}
    assert all(v is None for v in out["packed_over_bucketed"].values())


@pytest.mark.integration
def test_gpu_check_cpu_tiny():
    """Checkpointing off (--activation-checkpointing false): with it on, the tiny shape over-predicts by ~25%
    (docs/gpu.md, "One GPU script"); the checkpointed path runs in the two-rank test."""
    setup, rows = _run(["--shape", "tiny", "--policies", "packed,bucketed", "--warmup", "1", "--steps", "1",
                        "--activation-checkpointing", "false"], 900)
    assert setup["device"] == "cpu" and setup["peak_source"] == "matmul" and setup["budget"] == 4096
    assert setup["activation_checkpointing"] is False and set(setup["memory_plan"]) == {"packed", "bucketed"}
    assert all("reason" in plan for plan in setup["memory_plan"].values())
    assert [row["policy"] for row in rows] == ["packed", "bucketed"]
    for row in rows:
        assert FIELDS <= set(row) and row["finite"] and row["truncated"] == 0
        assert row["ktok_s"] > 0 and 0 < row["mfu"] < 1 and 0 < row["pad_eff"] <= 1
        assert row["peak_reserved_gb"] >= row["peak_mem_gb"] * 0.5
        assert row["activation_checkpointing"] is False
        assert 0.8 <= row["pred_peak_mem_gb"] / row["peak_mem_gb"] <= 1.2, row


@pytest.mark.integration
def test_gpu_check_cpu_two_ranks_and_checkpointing_override():
    """--nproc 2 on CPU: two gloo ranks under DDP; trainer.activation_checkpointing=true is honoured."""
    setup, rows = _run(["--shape", "tiny", "--policies", "packed", "--warmup", "0", "--steps", "1", "--nproc", "2",
                        "trainer.activation_checkpointing=true"], 900)
    assert setup["world_size"] == 2 and setup["activation_checkpointing"] is True
    assert "override" in setup["activation_checkpointing_source"]
    (row,) = rows
    assert row["activation_checkpointing"] is True and row["finite"] and FIELDS <= set(row)


@pytest.mark.integration
def test_gpu_check_sh_cpu(tmp_path):
    """bash scripts/gpu_check.sh --cpu --quick: every stage passes and every JSON line has its "check"."""
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--quick", str(out), "--work-dir",
                           str(tmp_path / "work")], cwd=ROOT, env={**ENV, "GPU_CHECK_DEPS": str(tmp_path / "deps")},
                          capture_output=True, text=True, timeout=900)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert proc.returncode == 0, (proc.stderr[-2000:], lines)
    assert all("check" in line and line["ok"] for line in lines), lines
    checks = [line["check"] for line in lines]
    assert checks[0] == "start" and checks[-1] == "done" and lines[0]["run_mode"] == "quick"
    tests = next(line for line in lines if line["check"] == "attention_tests")
    assert tests["failed"] == 0 and tests["passed"] > 0 and tests["skipped"] >= 1   # the CUDA-only tests
    assert any("CUDA" in name or "cuda" in name for name in tests["skipped_tests"])
    assert any("flex_operator" in name for name in tests["skipped_tests"]) is False
    rows = [line for line in lines if line["check"] == "gpu_check"]
    assert [line["policy"] for line in rows] == ["full_random", "bucketed", "packed"]
    for row in rows:   # the seed regime, quick: tokens over wall, executed TFLOP, utilisation, memory, planner
        assert row["finite"] and row["steps"] >= 1 and row["oom_steps"] == 0
        assert row["executed_tflop_per_step"] >= row["tflop_per_step"] > 0 and 0 < row["hfu"] < 1
        assert row["ktok_s"] > 0 and 0 <= row["pred_fit_frac"] <= 1 and row["planner_ktok_s_wall"] > 0
    assert "gpu_check_comparison" in checks and "gpu_check_ckpt" in checks and "train" not in checks
