"""Your data, your target: model=hf on a CPU says up front when its steps will be slow (with the CPU-sized preset)
and tau reports its progress; mostly-cut data is refused; probe bands and bucket boundaries follow the data's own
lengths. The target is a real ``transformers`` Qwen3 with random weights saved locally; the chat data and template
come from the chat-template tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import (  # tests/ is on sys.path (pytest rootdir-relative import)
    CONVERSATIONS, QWEN3, QWEN3_TOOLS, TOOL_RECORDS, local_qwen3, tiny_tool_tokenizer,
)


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_module

    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.integration
def test_hf_target_on_cpu_announces_slow_steps_and_reports_tau_progress(tmp_path):
    from dflash_lab.train import train

    target = local_qwen3(tmp_path / "target")
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 10))
    run_dir = tmp_path / "run"
    summary = train(_compose([
        "model=hf_cpu", f"model.target_path={target}", "model.device=cpu", "model.decode_num_prompts=3",
        "model.decode_max_new_tokens=4", f"model.cache_dir={tmp_path / 'cache'}", "data=jsonl", f"data.path={chats}",
        f"data.chat_template={QWEN3}", f"data.cache_dir={tmp_path / 'cache'}", "data.probe_fraction=0.1",
        "sampler.max_tokens=512",
        "sampler.boundaries=[0,64,512]", "probes.every=0", "trainer.max_steps=2", "trainer.num_threads=1",
        "trainer.progress=false", "trainer.cpu_step_warn_s=0", f"run_dir={run_dir}",
    ]))
    assert summary["status"] == "finished" and summary["steps"] == 2
    log = (run_dir / "train_rank0.log").read_text()
    # the warning: a predicted step time, the hours for the run, the measured rate and the preset to use
    assert "CPU run of a large target: predicted >=" in log and "GFLOP/s" in log and "model=hf_cpu" in log
    for name in ("trained draft", "untrained draft"):
        assert f"tau ({name}): 3 held-out prompts x up to 4 new tokens" in log
        assert f"tau ({name}): 1/3 prompts, tau so far" in log and f"tau ({name}): 2/3 prompts" in log
        assert "over 3/3 prompts in" in log


@pytest.mark.integration
def test_cpu_step_prediction_grows_with_the_draft_objective():
    """The floor on the CPU step time scales with the step's FLOPs: the GPU recipe's objective (block 16, up to 512
    anchors, 5 layers) predicts a slower step than the CPU preset's, for the same target and data."""
    import numpy as np

    from dflash_lab.training.components import predicted_cpu_step_s
    from dflash_lab.model import build_model
    from dflash_lab.presets import preset
    from dflash_lab.model.footprint import StepModel
    from dflash_lab.sampling import policy_from_config

    lengths = np.random.default_rng(0).integers(64, 1024, size=400)
    times = {}
    for name, objective in {"recipe": dict(block_size=16, anchors_per_doc=512, anchor_density=None,
                                           draft_layers=1),
                            "cpu": dict(block_size=8, anchors_per_doc=64, anchor_density=0.0625,
                                        draft_layers=1)}.items():
        model, _ = build_model(**preset("model", "tiny", **objective), activation_checkpointing=False)
        policy = policy_from_config({"name": "bucketed", "max_tokens": 4096, "boundaries": [0, 256, 1024]},
                                    lengths, seed=0)
        times[name] = predicted_cpu_step_s(StepModel.from_model(model), policy, grad_accum=1, flops_per_s=1e10)
    assert times["recipe"] > 3 * times["cpu"] > 0


@pytest.mark.integration
def test_a_run_whose_data_is_mostly_cut_is_refused_naming_the_keys(tmp_path):
    """More than data.max_truncated_fraction of the samples cut to data.max_length: refused before training, with
    the keys and the fix; accepted with the threshold raised, and the count is in summary.json."""
    from dflash_lab.train import train

    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    long = [{"role": "user", "content": "tell me more"}, {"role": "assistant", "content": "sure, " * 40}]
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": long if i % 4 == 0 else short}) + "\n" for i in range(80)))
    overrides = ["data=jsonl", f"data.path={chats}", "data.max_length=128", f"data.cache_dir={tmp_path / 'cache'}",
                 "probes.every=0", "probes.presentations=false", "trainer.max_steps=1", "trainer.measure_tau=false",
                 "trainer.progress=false", "sampler.boundaries=[0,64,128]"]
    with pytest.raises(ValueError, match=r"20 of 80 samples \(25%\) are longer than data.max_length=128 tokens.*"
                                         r"data.max_truncated_fraction=0.05"):
        train(_compose([*overrides, f"run_dir={tmp_path / 'refused'}"]))
    summary = train(_compose([*overrides, "data.max_truncated_fraction=0.3", f"run_dir={tmp_path / 'run'}"]))
    assert summary["status"] == "finished" and summary["data_truncated"] == 20


def test_probe_bands_auto_follow_the_data_and_keep_the_builtin_corpus_bands():
    """probes.bands=auto: the built-in corpus keeps the ablation's bands; other data gets bands at its length
    quantiles, ending at its longest sample, so a long-tailed file is never refused for its lengths."""
    import numpy as np

    from dflash_lab.training.probes import DEFAULT_BANDS, ProbeSets, fitted_bands, resolve_bands

    lengths = np.random.default_rng(0).lognormal(6.5, 0.9, size=3000).astype(int) + 16
    assert resolve_bands("auto", lengths, builtin_corpus=True) == list(DEFAULT_BANDS)
    assert resolve_bands([0, 50, 5000], lengths, builtin_corpus=False) == [0, 50, 5000]
    bands = resolve_bands("auto", lengths, builtin_corpus=False)
    assert bands == fitted_bands(lengths) and bands[0] == 0 and bands[-1] == lengths.max()
    assert len(bands) == 7 and all(b % 16 == 0 for b in bands[1:-1])
    counts = np.histogram(lengths, bins=np.asarray(bands) + 0.5)[0]
    assert counts.min() > 0.7 * len(lengths) / 6   # about equal counts per band
    probes = ProbeSets(lengths, bands, per_band=6, seed=0, max_tokens=1 << 16)
    assert not probes.empty_bands


@pytest.mark.integration
def test_bucket_boundaries_auto_fit_your_lengths_and_keep_the_builtin_corpus_preset(tmp_path):
    """sampler.boundaries=auto (the default): a chat file's buckets are fitted to its own lengths (6 buckets,
    optimal), not the built-in corpus's preset, and the run records them; the built-in corpus keeps its preset."""
    from dflash_lab.sampling import CPU_BOUNDARIES, resolve_auto_boundaries
    from dflash_lab.train import train

    turns = [[{"role": "user", "content": "q" * (5 + i % 37)}, {"role": "assistant", "content": "a " * (3 + i % 200)}]
             for i in range(300)]
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in turns))
    summary = train(_compose(["data=jsonl", f"data.path={chats}", f"data.cache_dir={tmp_path / 'cache'}",
                              "probes.every=0", "probes.presentations=false", "trainer.max_steps=2",
                              "trainer.measure_tau=false", "trainer.progress=false", f"run_dir={tmp_path / 'run'}"]))
    boundaries = summary["boundaries"]
    assert boundaries != CPU_BOUNDARIES and boundaries[0] == 0 and 3 <= len(boundaries) - 1 <= 6
    assert boundaries[-1] > 300   # the chats' own lengths (up to ~430 byte tokens), not the preset's 1024
    builtin = resolve_auto_boundaries({"boundaries": "auto", "num_buckets": None}, builtin_corpus=True)
    assert builtin["boundaries"] == "cpu"


@pytest.mark.integration
def test_a_tool_calling_chat_file_trains_on_a_qwen3_template_with_tools_and_nothing_skipped(tmp_path):
    """OpenAI-schema tool calls (a tools list, null content beside calls, tool turns) on a local Qwen3 whose
    template renders tools: the run trains with no line skipped and no sample cut."""
    from dflash_lab.data.jsonl import SKIP_REASONS
    from dflash_lab.train import train

    target = local_qwen3(tmp_path / "target", tiny_tool_tokenizer())
    chats = tmp_path / "tools.jsonl"
    records = [record for record, _, _ in TOOL_RECORDS] * 12 + [{"messages": m} for m in CONVERSATIONS]
    chats.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = train(_compose([
        "model=hf_cpu", f"model.target_path={target}", "model.device=cpu", "model.decode_num_prompts=2",
        "model.decode_max_new_tokens=4", f"model.cache_dir={tmp_path / 'cache'}", "data=jsonl", f"data.path={chats}",
        f"data.chat_template={QWEN3_TOOLS}", "data.max_bad_fraction=0.0", f"data.cache_dir={tmp_path / 'cache'}",
        "probes.every=0", "trainer.max_steps=3", "trainer.num_threads=1", "trainer.progress=false",
        f"run_dir={tmp_path / 'run'}",
    ]))
    assert summary["status"] == "finished" and summary["steps"] == 3
    assert summary["data_skipped"] == dict.fromkeys(SKIP_REASONS, 0) and summary["data_truncated"] == 0


@pytest.mark.integration
def test_the_gpu_recipe_on_a_cpu_is_announced_even_when_the_prediction_is_small():
    """The recipe's anchors (anchor_density null: up to 512 per document) on a CPU warn with the prediction and the
    preset whatever the threshold; a CPU-sized objective below the threshold gets one info line."""
    import logging

    import numpy as np

    from dflash_lab.training.components import plan_facts, warn_if_slow_on_cpu
    from dflash_lab.model import build_model
    from dflash_lab.presets import preset
    from dflash_lab.model.footprint import StepModel
    from dflash_lab.sampling import policy_from_config

    lengths = np.random.default_rng(0).integers(64, 1024, size=200)
    policy = policy_from_config({"name": "bucketed", "max_tokens": 4096, "boundaries": [0, 256, 1024]}, lengths, seed=0)
    plan = plan_facts(policy, epochs=1, grad_accum=1, max_steps=None)
    log = logging.getLogger("test_own_data.cpu_warning")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = records.append   # the logger's own handler: whatever other tests did to the logging tree
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    recipe, _ = build_model(**preset("model", "tiny", block_size=16, anchors_per_doc=512, anchor_density=None),
                            activation_checkpointing=False)
    cpu_sized, _ = build_model(**preset("model", "tiny"), activation_checkpointing=False)   # 8, 64, 0.0625
    try:
        for model in (recipe, cpu_sized):
            warn_if_slow_on_cpu(model, StepModel.from_model(model), policy, plan, 1, threshold_s=1e9, log=log)
    finally:
        log.removeHandler(handler)
    mine = records
    (warning,) = [r for r in mine if r.levelno == logging.WARNING]
    assert "predicted >=" in warning.getMessage() and "model=hf_cpu" in warning.getMessage()
    (info,) = [r for r in mine if r.levelno == logging.INFO]
    assert "predicted >=" in info.getMessage() and "hf_cpu" not in info.getMessage()


@pytest.mark.integration
def test_the_forgetting_protocol_runs_on_your_chat_file_and_target_in_one_command(tmp_path):
    """sweeps/forgetting_protocol.yaml on a chat JSONL and a local Qwen3 (tiny: 2 seeds, a few steps): one multirun
    command trains the eight arms (the random-key controls, full_random at bucketed's real tokens, bucketed at
    full_random's and bucketed with its LR scaled among them), records the protocol at launch, and compare writes
    the paired table with the tau endpoints and verdict.json with its recommendation."""
    import subprocess
    import sys

    import pandas as pd

    from dflash_lab.analysis.protocol import RULES_VERSION

    root = Path(__file__).resolve().parents[1]
    target = local_qwen3(tmp_path / "target")
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 20))
    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "dflash_lab.train", "-m", "--config-name", "forgetting_protocol",
               "model=hf_cpu", f"model.target_path={target}", "model.device=cpu", "model.decode_num_prompts=2",
               "model.decode_max_new_tokens=4", f"model.cache_dir={tmp_path / 'cache'}", "data=jsonl",
               f"data.path={chats}", f"data.chat_template={QWEN3}", f"data.cache_dir={tmp_path / 'cache'}",
               "data.probe_fraction=0.1", "trainer.max_steps=4", "trainer.progress=false", "probes.every=2",
               "probes.per_band=2", "seed=0,1", f"hydra.sweep.dir={sweep}"]
    out = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    protocol = json.loads((sweep / "protocol.json").read_text())
    assert protocol["resolved"]["verdict"]["negative_control"] == "sampler=bucket_sequential,sampler.bucket_by=random"
    runs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(runs) == 16
    summaries = [json.loads((run / "summary.json").read_text()) for run in runs]
    assert all(s["status"] == "finished" and s["steps"] == 4 for s in summaries)
    assert {s["sampler"] for s in summaries} == {"full_random", "bucketed", "bucket_sequential"}
    assert all(s["boundaries"] != [0, 96, 152, 216, 304, 412, 1024] for s in summaries if s["boundaries"])
    for run in runs:   # 4 steps: too few probes for the verdict's endpoint, said before the first step
        log = (run / "train_rank0.log").read_text()
        assert log.index("residual_amplitude needs 8") < log.index("running steps 0..4")
    report = tmp_path / "report"
    out = subprocess.run([sys.executable, "-m", "dflash_lab.compare", str(sweep), "--out", str(report),
                          "--no-plots"], cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    paired = pd.read_csv(report / "paired.csv")
    assert {"tau_band_min", "tau", "ktok_s"} <= set(paired["endpoint"])   # 4 steps: too few probes for A
    verdict = json.loads((report / "verdict.json").read_text())
    assert verdict["arms"]["negative_control"].startswith("bucket_sequential") and verdict["answer"]
    assert verdict["protocol"]["recorded_at_launch"] and verdict["protocol"]["rules_version"] == RULES_VERSION
    assert {"tau_band_min", "tau"} <= set(verdict["co_primary"]) and "mean tau" in verdict["answer"]
    assert all(s["target_seed"] is None for s in summaries)   # model=hf: the one given target
    scaled = [s for s in summaries if s["sampler"] == "bucketed" and s["peak_lr"] != 3.0e-3]
    assert len(scaled) == 2 and all(s["peak_lr"] > 3.0e-3 for s in scaled)   # trainer.lr_scaling=sqrt
    advice = verdict["recommendation"]
    assert {"text", "break_even_throughput", "throughput_ratio", "time_ratio"} <= set(advice)
    assert set(verdict["composition"]["arms"]) == {"equal_updates", "equal_tokens", "lr_scaled"}
