"""End-to-end training on CPU with a tiny target: learning, run-directory files, exact resume, preemption,
non-finite losses, W&B offline and broken W&B, and the Hydra command line.

All runs share one small configuration (a 2-layer target pretrained for a few steps, cached in the default cache,
300 synthetic samples, a 1024-token budget) so each training takes seconds.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_module

from dflash_lab import checkpoint as ckpt
from dflash_lab.run_logger import METRIC_FIELDS, PROBE_FIELDS, SUMMARY_FIELDS
from dflash_lab.train import train

ROOT = Path(__file__).resolve().parents[1]

SMALL = [
    "++model.hidden_size=64", "++model.num_layers=2", "++model.num_heads=4", "++model.num_kv_heads=2",
    "++model.intermediate_size=128", "++model.pretrain_steps=20", "++model.pretrain_tokens_per_step=2048",
    "++model.block_size=4", "++data.num_samples=300", "sampler.max_tokens=1024",
    "trainer.num_threads=1", "trainer.progress=false", "model.decode_num_prompts=2", "model.decode_max_new_tokens=8",
    "trainer.epochs=2", "probes.every=5", "probes.per_band=2",
]


def compose_cfg(run_dir: Path, *overrides: str):
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        return compose(config_name="train", overrides=[f"run_dir={run_dir}", *SMALL, *overrides])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in read_jsonl(run_dir / "metrics.jsonl")]


def test_tiny_run_learns_and_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    summary = train(compose_cfg(run_dir, "trainer.max_steps=30", "trainer.lr=3e-3", "trainer.ckpt_every=10"))

    assert summary["status"] == "finished" and summary["steps"] == 30
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(list(r) == list(METRIC_FIELDS) for r in rows)
    # learning: the last steps' loss is clearly below the first steps'
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    for r in rows:
        assert 0 < r["pad_eff"] <= 1 and r["real_tokens"] <= r["padded_tokens"] <= 1024
        assert r["max_len"] >= r["mean_len"] > 0 and r["batch_size"] >= 1 and r["bucket"] >= 0
        assert r["compute_time_s"] <= r["step_time_s"] and r["ktok_s"] > 0 and r["eta_s"] >= 0

    saved = json.loads((run_dir / "summary.json").read_text())
    assert list(saved)[: len(SUMMARY_FIELDS)] == list(SUMMARY_FIELDS)
    assert saved["sampler"] == "bucketed" and saved["world_size"] == 1 and saved["epochs"] == 2
    assert 0 <= saved["overhead_frac"] < 1 and saved["ktok_s"] > 0 and 0 < saved["pad_eff"] <= 1
    assert saved["full_run_eta_s"] > saved["eta_s"] > 0  # a capped run: the configured run is longer
    assert saved["tau"] >= 1 and saved["tau_baseline"] >= 1
    assert saved["final_loss"] == pytest.approx(rows[-1]["loss"])

    probes = read_jsonl(run_dir / "probes.jsonl")
    assert all(list(p) == list(PROBE_FIELDS) for p in probes)
    assert sorted({p["step"] for p in probes}) == [0, 5, 10, 15, 20, 25, 30]
    assert {p["band"] for p in probes} <= set(range(6)) and len({p["band"] for p in probes}) >= 4

    table = pq.read_table(run_dir / "presentations.parquet").to_pandas()
    assert list(table.columns) == ["sample_index", "epoch", "step", "length", "band", "acc"]
    assert table["step"].between(0, 29).all() and table["acc"].between(0, 1).all()
    assert table["step"].nunique() == 30

    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["last.pt", "step_20.pt", "step_30.pt"]
    state = ckpt.load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert state["step"] == 30 and state["config"]["sampler"]["name"] == "bucketed"
    assert {"python", "numpy", "torch", "anchor"} <= set(state["rng"])
    assert (run_dir / "train_rank0.log").is_file()


@pytest.mark.parametrize("sampler", ["sorted_static", "full_random", "bucketed_megabatch"])
def test_every_sampler_trains(tmp_path, sampler):
    summary = train(compose_cfg(tmp_path / sampler, f"sampler={sampler}", "trainer.max_steps=3",
                                "trainer.measure_tau=false", "probes.every=0"))
    assert summary["status"] == "finished" and summary["sampler"] == sampler and summary["steps"] == 3
    rows = read_jsonl(tmp_path / sampler / "metrics.jsonl")
    unbucketed = sampler in ("sorted_static", "full_random")
    assert all((r["bucket"] == -1) if unbucketed else (r["bucket"] >= 0) for r in rows)


@pytest.mark.parametrize("sampler", ["bucketed", "packed"])
def test_resume_equals_uninterrupted_run(tmp_path, sampler):
    # 300 samples / 1024-token steps: ~60 steps per epoch, so the runs below cross no epoch; the epoch test
    # below shrinks the data to cross one.
    straight = tmp_path / "straight"
    train(compose_cfg(straight, f"sampler={sampler}", "trainer.max_steps=12", "trainer.measure_tau=false"))

    split = tmp_path / "split"
    train(compose_cfg(split, f"sampler={sampler}", "trainer.max_steps=5", "trainer.measure_tau=false"))
    resumed = train(compose_cfg(split, f"sampler={sampler}", "trainer.max_steps=12", "trainer.measure_tau=false",
                                "resume=true"))
    assert resumed["steps"] == 12
    assert losses(split) == losses(straight)  # bitwise: same anchors, batches, weights and optimizer state
    rows = read_jsonl(split / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    if sampler == "packed":  # one row per step, no padding inside it, several documents
        assert all(r["pad_eff"] == 1.0 and r["real_tokens"] == r["padded_tokens"] for r in rows)
        assert max(r["batch_size"] for r in rows) > 1
    table = pq.read_table(split / "presentations.parquet").to_pandas()
    assert sorted(table["step"].unique()) == list(range(12))


def test_loader_workers_do_not_change_the_batches(tmp_path):
    common = ["trainer.max_steps=4", "trainer.measure_tau=false", "probes.every=0"]
    train(compose_cfg(tmp_path / "w0", *common))
    train(compose_cfg(tmp_path / "w1", *common, "trainer.num_workers=1"))
    assert losses(tmp_path / "w1") == losses(tmp_path / "w0")


def test_resume_across_an_epoch_boundary_with_grad_accum(tmp_path):
    extra = ["++data.num_samples=60", "trainer.grad_accum=2", "trainer.measure_tau=false", "probes.every=0",
             "sampler=full_random"]
    straight = tmp_path / "straight"
    full = train(compose_cfg(straight, *extra))
    per_epoch = full["total_steps"] // 2
    assert full["steps"] == full["total_steps"] >= 4

    split = tmp_path / "split"
    train(compose_cfg(split, *extra, f"trainer.max_steps={per_epoch + 1}"))
    train(compose_cfg(split, *extra))
    assert losses(split) == losses(straight)
    epochs = [r["epoch"] for r in read_jsonl(split / "metrics.jsonl")]
    assert epochs[0] == 0 and epochs[-1] == 1


def test_preemption_request_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    from dflash_lab.model import DFlashModel

    straight = tmp_path / "straight"
    train(compose_cfg(straight, "trainer.max_steps=8", "trainer.measure_tau=false"))

    original = DFlashModel.forward
    calls = {"n": 0}

    def forward_then_signal(self, batch, generator=None):
        calls["n"] += torch.is_grad_enabled()  # count training forwards, not probe evaluations
        if calls["n"] == 4 and torch.is_grad_enabled():  # during step 4 a SIGUSR2 arrives
            os.kill(os.getpid(), __import__("signal").SIGUSR2)
        return original(self, batch, generator)

    monkeypatch.setattr(DFlashModel, "forward", forward_then_signal)
    run_dir = tmp_path / "preempted"
    with pytest.raises(ckpt.Preempted) as info:
        train(compose_cfg(run_dir, "trainer.max_steps=8", "trainer.measure_tau=false"))
    assert info.value.code == ckpt.PREEMPTED_EXIT_CODE and info.value.step == 4
    assert ckpt.load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 4
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"

    monkeypatch.setattr(DFlashModel, "forward", original)
    train(compose_cfg(run_dir, "trainer.max_steps=8", "trainer.measure_tau=false"))  # the requeued job
    assert losses(run_dir) == losses(straight)


def _poison_forward(monkeypatch, at_call: int):
    from dflash_lab.model import DFlashModel

    original = DFlashModel.forward
    calls = {"n": 0}

    def forward(self, batch, generator=None):
        out = original(self, batch, generator)
        calls["n"] += torch.is_grad_enabled()  # count training forwards, not probe evaluations
        if calls["n"] == at_call and torch.is_grad_enabled():
            out.weighted_ce_sum = out.weighted_ce_sum * float("nan")
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(DFlashModel, "forward", forward)


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    _poison_forward(monkeypatch, at_call=7)
    run_dir = tmp_path / "nan"
    summary = train(compose_cfg(run_dir, "trainer.max_steps=10", "trainer.ckpt_every=3"))
    assert summary["status"] == "failed" and summary["steps"] == 6
    assert "non-finite loss at step 6" in summary["error"]
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["status"] == "failed" and saved["tau"] is None
    state = ckpt.load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert state["step"] == 6
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 7))


def test_nan_loss_is_skipped_when_configured(tmp_path, monkeypatch):
    _poison_forward(monkeypatch, at_call=3)
    run_dir = tmp_path / "skip"
    summary = train(compose_cfg(run_dir, "trainer.max_steps=6", "trainer.skip_nonfinite=true",
                                "trainer.measure_tau=false"))
    assert summary["status"] == "finished" and summary["skipped_steps"] == 1 and summary["steps"] == 6
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[2]["loss"] is None and all(r["loss"] is not None for i, r in enumerate(rows) if i != 2)
    state = ckpt.load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_a_crash_marks_the_summary_failed_and_releases_the_signal_handler(tmp_path, monkeypatch):
    import signal

    from dflash_lab.model import DFlashModel

    def crash(self, batch, generator=None):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(DFlashModel, "forward", crash)
    run_dir = tmp_path / "crash"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(compose_cfg(run_dir, "trainer.max_steps=3", "probes.every=0"))
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["status"] == "failed" and "simulated crash" in saved["error"]
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_wandb_offline_run_and_resume_keeps_the_run_id(tmp_path):
    import warnings

    run_dir = tmp_path / "wb"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="W&B")  # W&B must work here, not fall back silently
        train(compose_cfg(run_dir, "logger=wandb", "trainer.max_steps=3", "trainer.measure_tau=false"))
        run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
        assert ckpt.load_checkpoint(run_dir / "checkpoints" / "last.pt")["wandb_run_id"] == run_id
        train(compose_cfg(run_dir, "logger=wandb", "trainer.max_steps=5", "trainer.measure_tau=false"))
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert runs and all(list(r.glob(f"run-{run_id}.wandb")) for r in runs)
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 5


def test_broken_wandb_never_stops_training(tmp_path, monkeypatch):
    import wandb

    def broken_init(**kwargs):
        raise ConnectionError("wandb is down")

    monkeypatch.setattr(wandb, "init", broken_init)
    run_dir = tmp_path / "broken"
    with pytest.warns(RuntimeWarning, match="W&B init failed"):
        summary = train(compose_cfg(run_dir, "logger=wandb", "trainer.max_steps=3", "trainer.measure_tau=false"))
    assert summary["status"] == "finished"
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 3


@pytest.mark.slow
def test_command_line_run_and_rerun_in_the_same_directory(tmp_path):
    run_dir = tmp_path / "cli"
    args = [sys.executable, "-m", "dflash_lab.train", f"hydra.run.dir={run_dir}", *SMALL, "trainer.measure_tau=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run([*args, "trainer.max_steps=3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    second = subprocess.run([*args, "trainer.max_steps=5"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
