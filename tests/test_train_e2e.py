"""End-to-end training on CPU with a tiny target: learning, run-directory files, exact resume, preemption,
non-finite losses, W&B offline and broken W&B, re-runs of finished directories, and the Hydra command line.

All runs share one small configuration (a 2-layer target pretrained for a few steps, cached in the default cache,
300 synthetic samples, a 1024-token budget) so each training takes seconds.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

from dflash_lab.records import checkpoint as ckpt
from dflash_lab.records import record
from dflash_lab.records.record import PRESENTATION_COLUMNS, PROBE_FIELDS, STEP_FIELDS, SUMMARY_FIELDS
from dflash_lab.train import TrainHooks, train
from helpers import compose_small as compose_cfg  # tests/ is on sys.path (pytest rootdir-relative import)
from helpers import SMALL, stop_at

pytestmark = pytest.mark.integration   # trains, compiles or starts processes: scripts/test.sh

ROOT = Path(__file__).resolve().parents[1]



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
    assert all(list(r) == list(STEP_FIELDS) for r in rows)
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
    assert saved["full_run_eta_s"] > 0 and saved["eta_s"] == 0  # ETA to the end step; full run: every epoch
    assert saved["tau"] >= 1 and saved["tau_baseline"] >= 1
    assert saved["final_loss"] == pytest.approx(rows[-1]["loss"])

    probes = read_jsonl(run_dir / "probes.jsonl")
    assert all(list(p) == list(PROBE_FIELDS) for p in probes)
    assert sorted({p["step"] for p in probes}) == [0, 5, 10, 15, 20, 25, 30]   # every probes.every=5 steps
    assert {p["band"] for p in probes} <= set(range(6)) and len({p["band"] for p in probes}) >= 4

    table = pq.read_table(run_dir / "presentations.parquet").to_pandas()
    assert list(table.columns) == list(PRESENTATION_COLUMNS)
    assert table["step"].between(1, 30).all() and table["acc"].between(0, 1).all()  # the record's step rule
    assert table["step"].nunique() == 30
    assert saved["steps_per_epoch"] == [saved["total_steps"] // 2 + d for d in (0, saved["total_steps"] % 2)] or (
        sum(saved["steps_per_epoch"]) == saved["total_steps"])

    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["last.json", "step_20.pt", "step_30.pt"]
    state = ckpt.load_run_checkpoint(run_dir)
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


def test_a_run_without_tau_says_so_in_its_exit_line_and_keeps_tau_null_in_the_summary(tmp_path):
    run_dir = tmp_path / "run"
    train(compose_cfg(run_dir, "trainer.max_steps=3", "trainer.measure_tau=false", "probes.every=0"))
    exit_line = (run_dir / "train_rank0.log").read_text().splitlines()[-1]
    assert "finished: step 3/" in exit_line and "nan" not in exit_line.lower(), exit_line
    assert exit_line.endswith("tau not measured (trainer.measure_tau=false)"), exit_line
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["tau"] is None and saved["tau_baseline"] is None   # null, not a number: analysis notes why


def train_in_parts(run_dir: Path, stops: list[int], *overrides: str) -> dict:
    """Train `run_dir` to the end, preempted at each step in `stops` and continued each time."""
    for step in stops:
        with pytest.raises(ckpt.Preempted) as info:
            train(compose_cfg(run_dir, *overrides), stop_at(step))
        assert info.value.code == ckpt.PREEMPTED_EXIT_CODE and info.value.step == step
    return train(compose_cfg(run_dir, *overrides))


def assert_no_duplicate_rows(run_dir: Path) -> None:
    """Every file of the run directory holds each (step, key) once (the acceptance of exact side files)."""
    steps = [r["step"] for r in record.read_jsonl(run_dir / "metrics.jsonl")[0]]
    assert len(steps) == len(set(steps)) and steps == sorted(steps)
    probe_keys = [(r["step"], r["band"]) for r in record.read_jsonl(run_dir / "probes.jsonl")[0]]
    assert len(probe_keys) == len(set(probe_keys))
    if (run_dir / "presentations.parquet").is_file():
        table = pq.read_table(run_dir / "presentations.parquet").to_pandas()
        assert not table.duplicated(["step", "sample_index"]).any()


@pytest.mark.parametrize("sampler", ["bucketed", "packed"])
def test_resume_equals_uninterrupted_run(tmp_path, sampler):
    # 300 samples / 1024-token steps: ~60 steps per epoch, so the runs below cross no epoch; the epoch test
    # below shrinks the data to cross one.
    common = [f"sampler={sampler}", "trainer.max_steps=12", "trainer.measure_tau=false"]
    straight = tmp_path / "straight"
    train(compose_cfg(straight, *common))
    split = tmp_path / "split"
    resumed = train_in_parts(split, [5], *common)
    assert resumed["steps"] == 12 and resumed["segments"] == 2
    assert losses(split) == losses(straight)  # bitwise: same anchors, batches, weights and optimizer state
    rows = read_jsonl(split / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    if sampler == "packed":  # one row per step, no padding inside it, several documents
        assert all(r["pad_eff"] == 1.0 and r["real_tokens"] == r["padded_tokens"] for r in rows)
        assert max(r["batch_size"] for r in rows) > 1
    table = pq.read_table(split / "presentations.parquet").to_pandas()
    assert sorted(table["step"].unique()) == list(range(1, 13))
    assert_no_duplicate_rows(split)


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
    per_epoch = full["steps_per_epoch"][0]
    assert full["steps"] == full["total_steps"] >= 4

    split = tmp_path / "split"
    train_in_parts(split, [per_epoch + 1], *extra)
    assert losses(split) == losses(straight)
    epochs = [r["epoch"] for r in read_jsonl(split / "metrics.jsonl")]
    assert epochs[0] == 0 and epochs[-1] == 1


def test_signal_during_training_checkpoints_and_the_requeued_job_resumes_exactly(tmp_path):
    import signal

    straight = tmp_path / "straight"
    train(compose_cfg(straight, "trainer.max_steps=8", "trainer.measure_tau=false"))

    def signal_during_step_4(step, micro, out):
        if step == 4:   # SIGTERM: what a scheduler's preemption sends (SIGUSR2, Slurm's warning, takes the same path)
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    run_dir = tmp_path / "preempted"
    with pytest.raises(ckpt.Preempted) as info:
        train(compose_cfg(run_dir, "trainer.max_steps=8", "trainer.measure_tau=false"),
              TrainHooks(after_forward=signal_during_step_4))
    assert info.value.code == ckpt.PREEMPTED_EXIT_CODE and info.value.step == 4
    assert ckpt.load_run_checkpoint(run_dir)["step"] == 4
    saved = json.loads((run_dir / "summary.json").read_text())   # issue 31: not "running" (killed, or running)
    assert saved["status"] == "preempted" and saved["steps"] == 4 and saved["checkpoint_step"] == 4
    train(compose_cfg(run_dir, "trainer.max_steps=8", "trainer.measure_tau=false"))  # the requeued job
    assert losses(run_dir) == losses(straight)


def test_sigterm_during_tau_records_a_partial_tau_and_the_requeued_job_measures_again(tmp_path):
    import signal
    import threading

    run_dir = tmp_path / "tau"
    overrides = ["trainer.max_steps=3", "model.decode_num_prompts=6", "model.decode_max_new_tokens=64",
                 "probes.every=0"]
    real_measure = __import__("dflash_lab.training.evaluation", fromlist=["measure_acceptance"]).measure_acceptance
    started = threading.Event()

    def after_step(row):
        if row["step"] == 3:  # the loop is done: SIGTERM arrives while tau is being measured
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
            started.set()

    with pytest.raises(ckpt.Preempted):
        train(compose_cfg(run_dir, *overrides), TrainHooks(after_step=after_step))
    assert started.is_set() and callable(real_measure)
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["status"] == "preempted" and saved["steps"] == 3
    summary = train(compose_cfg(run_dir, *overrides))  # requeued: training is done, tau is measured again
    assert summary["status"] == "finished" and summary["tau"] >= 1 and summary["tau_baseline"] >= 1
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]


def poison_step(step: int) -> TrainHooks:
    def after_forward(at_step, micro, out):
        if at_step == step:
            out.weighted_ce_sum = out.weighted_ce_sum * float("nan")
            out.loss = out.loss * float("nan")
        return out
    return TrainHooks(after_forward=after_forward)


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "nan"
    summary = train(compose_cfg(run_dir, "trainer.max_steps=10", "trainer.ckpt_every=3"), poison_step(7))
    assert summary["status"] == "failed" and summary["steps"] == 6
    assert "non-finite loss at step 7" in summary["error"]
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["status"] == "failed" and saved["tau"] is None
    state = ckpt.load_run_checkpoint(run_dir)
    assert state["step"] == 6
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 7))


def test_nan_loss_is_skipped_when_configured(tmp_path):
    run_dir = tmp_path / "skip"
    summary = train(compose_cfg(run_dir, "trainer.max_steps=6", "trainer.skip_nonfinite=true",
                                "trainer.measure_tau=false"), poison_step(3))
    assert summary["status"] == "finished" and summary["skipped_steps"] == 1 and summary["steps"] == 6
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[2]["loss"] is None and all(r["loss"] is not None for i, r in enumerate(rows) if i != 2)
    state = ckpt.load_run_checkpoint(run_dir)
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_a_crash_marks_the_summary_failed_and_releases_the_signal_handler(tmp_path):
    import signal

    def crash(step, micro, out):
        raise RuntimeError("simulated crash")

    run_dir = tmp_path / "crash"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(compose_cfg(run_dir, "trainer.max_steps=3", "probes.every=0"), TrainHooks(after_forward=crash))
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["status"] == "failed" and "simulated crash" in saved["error"]
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_rerunning_a_finished_directory_changes_nothing_but_a_log_line(tmp_path):
    run_dir = tmp_path / "done"
    overrides = ["trainer.max_steps=6", "probes.every=3", "model.decode_num_prompts=1"]
    first = train(compose_cfg(run_dir, *overrides))

    def snapshot() -> dict[str, bytes]:
        return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
                if p.is_file() and p.name != "train_rank0.log"}

    before, log_before = snapshot(), (run_dir / "train_rank0.log").read_text()
    again = train(compose_cfg(run_dir, *overrides))
    assert snapshot() == before and again == json.loads(before["summary.json"]) and again["tau"] == first["tau"]
    added = (run_dir / "train_rank0.log").read_text()[len(log_before):]
    assert "already finished" in added


def test_max_steps_zero_and_a_kill_before_the_first_checkpoint_leave_no_duplicate_rows(tmp_path):
    run_dir = tmp_path / "zero"
    summary = train(compose_cfg(run_dir, "trainer.max_steps=0", "trainer.measure_tau=false"))
    assert {r["step"] for r in read_jsonl(run_dir / "probes.jsonl")} == {0}
    assert_no_duplicate_rows(run_dir)
    # issue 31: said as what it is (no step trained), never "overhead 100.0%"; a later launch there trains
    assert summary["status"] == "finished" and summary["steps"] == 0 and math.isnan(summary["overhead_frac"])
    text = (run_dir / "train_rank0.log").read_text()
    assert "trainer.max_steps=0: this launch trains no step" in text and "finished without training" in text
    assert "overhead 100.0%" not in text
    assert train(compose_cfg(run_dir, "trainer.max_steps=2", "trainer.measure_tau=false"))["steps"] == 2
    # an earlier attempt killed before its first checkpoint left rows behind: a fresh start drops them
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (fresh / "probes.jsonl").write_text('{"step": 0, "band": 0}\n')
    train(compose_cfg(fresh, "trainer.max_steps=3", "trainer.measure_tau=false", "probes.every=3"))
    assert [r["step"] for r in read_jsonl(fresh / "metrics.jsonl")] == [1, 2, 3]
    assert_no_duplicate_rows(fresh)


def test_changed_lr_on_resume_takes_effect_and_other_changes_are_refused(tmp_path):
    run_dir = tmp_path / "lr"
    common = ["trainer.max_steps=8", "trainer.measure_tau=false", "probes.every=0"]
    with pytest.raises(ckpt.Preempted):
        train(compose_cfg(run_dir, *common), stop_at(4))
    train(compose_cfg(run_dir, *common, "trainer.lr=3e-3"))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[4]["lr"] > rows[3]["lr"] * 3  # the new peak drives the rebuilt schedule from step 5 on
    with pytest.raises(ValueError, match=r"sampler\.max_tokens.*fresh run directory"):
        train(compose_cfg(run_dir, *common, "trainer.max_steps=10", "sampler.max_tokens=2048"))


def test_wandb_offline_run_and_resume_keeps_the_run_id(tmp_path):
    import warnings

    run_dir = tmp_path / "wb"
    common = ["logger=wandb", "trainer.max_steps=5", "trainer.measure_tau=false"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="W&B")  # W&B must work here, not fall back silently
        with pytest.raises(ckpt.Preempted):
            train(compose_cfg(run_dir, *common), stop_at(3))
        run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
        assert ckpt.load_run_checkpoint(run_dir)["wandb_run_id"] == run_id
        train(compose_cfg(run_dir, *common))
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert runs and all(list(r.glob(f"run-{run_id}.wandb")) for r in runs)
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 5


def test_broken_wandb_never_stops_training(tmp_path, monkeypatch):
    import wandb

    def broken_init(**kwargs):
        raise ConnectionError("wandb is down")

    monkeypatch.setattr(wandb, "init", broken_init)  # the third-party service, not our code
    run_dir = tmp_path / "broken"
    with pytest.warns(RuntimeWarning, match="W&B init failed"):
        summary = train(compose_cfg(run_dir, "logger=wandb", "trainer.max_steps=3", "trainer.measure_tau=false"))
    assert summary["status"] == "finished"
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 3


def _cli(run_dir: Path, *overrides: str, **popen) -> list[str]:
    return [sys.executable, "-m", "dflash_lab.train", f"hydra.run.dir={run_dir}", *SMALL, *overrides]


def test_command_line_run_and_rerun_in_the_same_directory(tmp_path):
    run_dir = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = _cli(run_dir, "trainer.measure_tau=false")
    first = subprocess.run([*args, "trainer.max_steps=3"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and not (run_dir / "train.log").exists()
    second = subprocess.run([*args, "trainer.max_steps=5"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    assert "step 5/5" in (run_dir / "train_rank0.log").read_text()  # no terminal: periodic log lines


def test_kill_minus_nine_campaign_ends_equal_to_an_uninterrupted_run(tmp_path):
    """Kill -9 at random points (mid-step, mid-checkpoint), damage the newest checkpoint, stale the pointer:
    the final weights equal an uninterrupted run's and no file holds a duplicate (step, key) row.

    The first kill lands one step past the step-6 checkpoint: metrics.jsonl is appended and flushed every step, so it then
    holds rows 1..N with N at least the last step the log reported, rows after the checkpoint included, and the
    next launch says how many rows it trimmed back to the checkpoint."""
    import random
    import signal
    import time

    common = ["trainer.max_steps=40", "trainer.ckpt_every=3", "trainer.measure_tau=false", "probes.every=4",
              "trainer.log_every=1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    straight = tmp_path / "straight"
    done = subprocess.run(_cli(straight, *common), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "killed"
    rng = random.Random(0)
    checkpoints = run_dir / "checkpoints"
    for attempt in range(5):
        rows_now = len(read_jsonl(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else 0
        target = 7 if attempt == 0 else rows_now + rng.randint(2, 7)   # 7: one step past the step-6 checkpoint
        proc = subprocess.Popen(_cli(run_dir, *common), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            lines = (run_dir / "metrics.jsonl").read_text().count("\n") if (run_dir / "metrics.jsonl").exists() else 0
            if lines >= target:
                if attempt:   # land anywhere inside the next step or checkpoint (the first kill: before step 9's)
                    time.sleep(rng.uniform(0.0, 0.15))
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        assert proc.wait(timeout=60) == -signal.SIGKILL, f"attempt {attempt}: the run ended before it was killed"
        if attempt == 0:   # every logged row reached the disk, the ones after the last checkpoint too
            steps = [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")]
            logged = [int(m) for m in re.findall(r"\] step (\d+)/40 ", (run_dir / "train_rank0.log").read_text())]
            first_checkpoint = json.loads((checkpoints / "last.json").read_text())["step"]
            assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= logged[-1] >= 7
            assert steps[-1] > first_checkpoint
            first_rows = steps[-1]
        if attempt == 1:   # the relaunch trimmed the rows logged after the checkpoint, and said so
            log = (run_dir / "train_rank0.log").read_text()
            assert (f"resume: removed {first_rows - first_checkpoint} metric and" in log
                    and f"logged after step {first_checkpoint}" in log), log[-3000:]
        if attempt == 2 and checkpoints.is_dir():  # the newest checkpoint is found truncated on disk
            newest = max(checkpoints.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
            newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])
        if attempt == 3 and (checkpoints / "last.json").is_file():  # killed between the save and the pointer
            steps = sorted(int(p.stem.split("_")[1]) for p in checkpoints.glob("step_*.pt"))
            (checkpoints / "last.json").write_text(json.dumps({"file": f"step_{steps[0]}.pt", "step": steps[0]}))
    final = subprocess.run(_cli(run_dir, *common), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]

    ours, theirs = ckpt.load_run_checkpoint(run_dir), ckpt.load_run_checkpoint(straight)
    assert ours["step"] == theirs["step"] == 40
    assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in theirs["model"])
    assert losses(run_dir) == losses(straight)
    assert_no_duplicate_rows(run_dir)
    assert not list(checkpoints.glob("*.tmp"))
    assert json.loads((run_dir / "summary.json").read_text())["segments"] >= 2


@pytest.mark.parametrize("sampler", ["bucketed", "packed"])
def test_a_block_budget_bounds_every_step_under_the_recipe_anchor_rule(tmp_path, sampler):
    """The recipe's rule (min(anchors_per_doc, valid positions) per document) with sampler.max_block_tokens: every
    logged step runs at most that many block slots, and the summary records the rule and the budget."""
    run_dir = tmp_path / sampler
    summary = train(compose_cfg(run_dir, f"sampler={sampler}", "model.anchor_density=null", "model.anchors_per_doc=32",
                                "sampler.max_block_tokens=512", "trainer.max_steps=12", "trainer.measure_tau=false",
                                "probes.every=0", "probes.presentations=false"))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert summary["status"] == "finished" and len(rows) == 12
    assert all(0 < r["block_tokens"] <= r["block_slots"] <= 512 for r in rows), [r["block_slots"] for r in rows]
    assert summary["anchor_rule"] == "recipe" and summary["max_block_tokens"] == 512
    assert summary["activation_checkpointing"] is False
    assert "memory plan: as configured (anchor rule recipe)" in (run_dir / "train_rank0.log").read_text()


def test_auto_block_budget_and_checkpointing_follow_the_gpu_memory_and_are_logged(tmp_path):
    """trainer.activation_checkpointing=auto and sampler.max_block_tokens=auto with a GPU's memory known (here a
    preset's memory_gb on the CPU run): the memory plan picks the largest block budget that fits, the steps keep to
    it, and the log says what was chosen and why."""
    run_dir = tmp_path / "auto"
    summary = train(compose_cfg(run_dir, "model.anchor_density=null", "model.anchors_per_doc=32",
                                "sampler.max_block_tokens=auto", "trainer.activation_checkpointing=auto",
                                "gpu.memory_gb=1", "trainer.max_steps=8", "trainer.measure_tau=false",
                                "probes.every=0", "probes.presentations=false"))
    budget = summary["max_block_tokens"]
    assert summary["status"] == "finished" and budget is not None and budget >= 4 * 32
    assert all(r["block_slots"] <= budget for r in read_jsonl(run_dir / "metrics.jsonl"))
    log = (run_dir / "train_rank0.log").read_text()
    assert f"memory plan: block budget {budget}" in log and "checkpointing" in log


def test_a_resume_whose_max_steps_is_below_the_checkpoint_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    train(compose_cfg(run_dir, "trainer.max_steps=12", "trainer.ckpt_every=6", "trainer.measure_tau=false"))
    with pytest.raises(ValueError, match=r"trainer.max_steps=8 ends this run at step 8, but its checkpoint is at "
                                         r"step 12: raise trainer.max_steps to at least 12"):
        train(compose_cfg(run_dir, "trainer.max_steps=8", "trainer.ckpt_every=6", "trainer.measure_tau=false"))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"   # the record is untouched


def test_a_diverged_run_fails_after_too_many_skipped_updates_in_a_row(tmp_path):
    """trainer.skip_nonfinite=true skips a non-finite update, but a run whose updates are skipped
    trainer.max_consecutive_skips times in a row has diverged: it fails, and the summary counts the skips."""
    def poison(step, micro, out):   # every step from the 2nd on is non-finite
        if step >= 2:
            out.weighted_ce_sum = out.weighted_ce_sum * float("nan")
        return out

    run_dir = tmp_path / "run"
    summary = train(compose_cfg(run_dir, "trainer.max_steps=30", "trainer.skip_nonfinite=true",
                                "trainer.max_consecutive_skips=5", "trainer.measure_tau=false"),
                    TrainHooks(after_forward=poison))
    assert summary["status"] == "failed" and summary["skipped_steps"] == 5
    assert "5 updates in a row skipped (steps 2..6" in summary["error"]


def test_the_wall_time_split_adds_up_over_segments_with_dense_probes(tmp_path):
    """summary.json splits the wall time into setup, compute, data wait, evaluation, checkpointing and other; the
    measured parts never exceed the wall time (other is what is left, so the parts sum to it), also for a short
    run with dense probes and over the two segments of a resumed run."""
    run_dir = tmp_path / "run"
    first = train(compose_cfg(run_dir, "trainer.max_steps=6", "trainer.ckpt_every=3", "probes.every=2"))
    second = train(compose_cfg(run_dir, "trainer.max_steps=12", "trainer.ckpt_every=3", "probes.every=2"))
    parts = ("setup", "compute", "data_wait", "eval", "checkpoint")
    for summary in (first, second):
        measured = sum(summary[f"{p}_time_s"] for p in parts)
        assert measured <= summary["wall_time_s"] * 1.01, summary
        assert summary["other_time_s"] == pytest.approx(summary["wall_time_s"] - measured, abs=1e-6)
        assert summary["eval_time_s"] >= summary["probe_time_s"] + summary["tau_time_s"] - 1e-6
        assert 0 <= summary["overhead_frac"] < 1 and 0 < summary["eval_frac"] < 1
    assert second["segments"] == 2 and second["wall_time_s"] > first["wall_time_s"]
    assert second["compute_time_s"] > first["compute_time_s"] and second["setup_time_s"] > first["setup_time_s"]


def test_a_fresh_start_over_an_earlier_runs_records_is_refused_unless_overwrite(tmp_path):
    """A finished run directory whose checkpoints/ is gone: a new launch there would replace its metrics, probes,
    presentations and summary. It is refused (the files stay as they were) unless overwrite=true."""
    import shutil

    run_dir = tmp_path / "run"
    train(compose_cfg(run_dir, "trainer.max_steps=6", "trainer.measure_tau=false"))
    shutil.rmtree(run_dir / "checkpoints")
    before = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "probes.jsonl", "summary.json")}
    with pytest.raises(ValueError, match=r"holds the records of a run that ended \(status finished\) but no "
                                         r"checkpoint.*overwrite=true"):
        train(compose_cfg(run_dir, "trainer.max_steps=6", "trainer.measure_tau=false"))
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    summary = train(compose_cfg(run_dir, "trainer.max_steps=4", "trainer.measure_tau=false", "overwrite=true"))
    assert summary["status"] == "finished" and summary["steps"] == 4 and len(losses(run_dir)) == 4


def test_summary_records_the_target_and_data_digests_the_run_trained_with(tmp_path):
    """What compare checks before it pairs runs: the digest of the very target weights the run loaded (the tiny
    target's weights_digest, as build_model computes it from the cache) and of its training data."""
    from dflash_lab.training.components import pretrain_corpus_follows_data
    from dflash_lab.model import build_model

    cfg = compose_cfg(tmp_path / "run", "trainer.max_steps=2", "trainer.measure_tau=false", "probes.every=0",
                      "probes.presentations=false")
    summary = train(cfg)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    plain = OmegaConf.to_container(cfg, resolve=True)
    model, _ = build_model(**pretrain_corpus_follows_data(plain["model"], plain["data"]),
                           activation_checkpointing=False)
    assert saved["target_digest"] == summary["target_digest"] == model.target_digest
    assert len(saved["target_digest"]) == 16 and len(saved["data_digest"]) == 32


def test_a_resume_on_changed_data_content_is_refused(tmp_path):
    """A chat JSONL edited in place with the same lengths: the cache is rebuilt (size and mtime are in its key), and
    the checkpoint's data digest no longer matches, so the run refuses to continue on other text."""
    data = tmp_path / "chat.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i:03d}"},
                                      {"role": "assistant", "content": f"answer {i:03d} " + "abc " * (i % 40)}]})
             for i in range(300)]
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    overrides = ("data=jsonl", f"data.path={data}", "trainer.measure_tau=false", "probes.every=0",
                 "probes.presentations=false", "trainer.ckpt_every=3")
    first = train(compose_cfg(run_dir, "trainer.max_steps=3", *overrides))
    assert len(first["data_digest"]) == 32
    data.write_text(data.read_text().replace("abc", "xyz"))   # same lengths, other text
    with pytest.raises(ValueError, match="the data changed since the checkpoint"):
        train(compose_cfg(run_dir, "trainer.max_steps=6", *overrides))


def test_samples_cut_to_max_length_are_counted_in_the_log_and_summary(tmp_path):
    """A JSONL conversation longer than data.max_length is cut, never in silence: the log and summary.json count it."""
    data = tmp_path / "chat.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                      {"role": "assistant", "content": f"answer {i} " * 5}]}) for i in range(200)]
    lines[7] = json.dumps({"messages": [{"role": "user", "content": "long"},
                                        {"role": "assistant", "content": "word " * 3000}]})
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    summary = train(compose_cfg(run_dir, "data=jsonl", f"data.path={data}", "data.max_length=512",
                                "trainer.max_steps=2", "trainer.measure_tau=false", "probes.every=0",
                                "probes.presentations=false"))
    assert summary["data_truncated"] == 1
    assert "data: 1 of 200 samples were cut to data.max_length=512" in (run_dir / "train_rank0.log").read_text()


@pytest.mark.parametrize("damage", ["truncate_presentations", "delete_metrics", "delete_probes"])
def test_a_resume_over_missing_or_damaged_side_files_is_refused(tmp_path, damage):
    """The side files must cover the run up to its checkpoint; a truncated presentations.parquet or a deleted
    metrics.jsonl / probes.jsonl would end a "finished" run with holes in its records: refused, naming the file."""
    run_dir = tmp_path / "run"
    overrides = ("trainer.ckpt_every=4", "trainer.measure_tau=false", "probes.every=4")
    train(compose_cfg(run_dir, "trainer.max_steps=8", *overrides))
    if damage == "truncate_presentations":
        path = run_dir / "presentations.parquet"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        expected = "presentations.parquet is unreadable"
    elif damage == "delete_metrics":
        (run_dir / "metrics.jsonl").unlink()
        expected = "metrics.jsonl holds 0 of the 8 steps up to it"
    else:
        (run_dir / "probes.jsonl").unlink()
        expected = r"probes.jsonl lacks the probe evaluations of steps \[0, 4, 8\]"
    with pytest.raises(ValueError, match=f"resume from the checkpoint of step 8: {expected}"):
        train(compose_cfg(run_dir, "trainer.max_steps=12", *overrides))


def test_a_refused_resume_leaves_the_recorded_config_and_export_reads_the_checkpoints(tmp_path):
    """Hydra writes .hydra/config.yaml before the trainer sees the launch; a resume refused for a changed model
    (block size, target layers) puts the run's own files back, and export reads the checkpoint's config."""
    run_dir = tmp_path / "run"
    hydra_dir = run_dir / ".hydra"
    train(compose_cfg(run_dir, "trainer.max_steps=4", "trainer.measure_tau=false"))
    hydra_dir.mkdir(parents=True, exist_ok=True)
    (hydra_dir / "config.yaml").write_text("model:\n  block_size: 4\n")      # what the first launch recorded
    train(compose_cfg(run_dir, "trainer.max_steps=6", "trainer.measure_tau=false"))   # checkpoint holds it now
    recorded = (hydra_dir / "config.yaml").read_text()
    (hydra_dir / "config.yaml").write_text("model:\n  block_size: 16\n")     # a refused launch's, by Hydra
    with pytest.raises(ValueError):
        train(compose_cfg(run_dir, "trainer.max_steps=8", "trainer.measure_tau=false", "++model.block_size=16"))
    assert (hydra_dir / "config.yaml").read_text() == recorded

    from dflash_lab.export import run_model_config

    (hydra_dir / "config.yaml").write_text("model:\n  block_size: 16\n")
    assert run_model_config(run_dir, ckpt.load_run_checkpoint(run_dir))["block_size"] == 4


def test_a_fresh_start_refused_after_the_model_loads_leaves_a_summary_and_a_fixed_relaunch_starts_over(tmp_path):
    """A config the data refuses (probe bands that end below the longest sample) stops the run after the model and
    data loaded: the folder's summary.json says failed, steps 0, and why. The relaunch with the fix starts over
    (no overwrite=true needed: nothing was trained)."""
    run_dir = tmp_path / "refused"
    with pytest.raises(ValueError, match="extend probes.bands"):
        train(compose_cfg(run_dir, "probes.bands=[0,96,200]", "trainer.max_steps=2"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 0 and "extend probes.bands" in summary["error"]
    fixed = train(compose_cfg(run_dir, "trainer.max_steps=2", "trainer.measure_tau=false"))
    assert fixed["status"] == "finished" and fixed["steps"] == 2
    assert "failed before its first step" in (run_dir / "train_rank0.log").read_text()


def test_tau_is_measured_per_length_band_from_the_same_prompts(tmp_path):
    """The tau prompts are spread over the probe bands, one band after another, so one measurement gives tau per
    band: every band with a prompt has a tau >= 1, the overall tau lies between the bands' (it pools their verify
    steps), and tau_band_min / tau_band_mean summarise the measured bands, for the untrained draft too. Each
    measurement of the trained draft (trainer.tau_every steps, and the end) is a tau.jsonl row; the last is the
    summary's."""
    summary = train(compose_cfg(tmp_path / "tau", "trainer.max_steps=3", "probes.every=0", "trainer.tau_every=2",
                                "model.decode_num_prompts=6", "model.decode_max_new_tokens=16"))
    rows = [json.loads(line) for line in (tmp_path / "tau" / record.TAU_FILE).read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 3] and all(set(row) == set(record.TAU_FIELDS) for row in rows)
    assert summary["tau_prompts"] == rows[-1]["tau_prompts"] == 6 and summary["tau_se"] == rows[-1]["tau_se"] >= 0
    assert {key: rows[-1][key] for key in ("tau", "tau_band_min", "tau_by_band")} == {
        key: summary[key] for key in ("tau", "tau_band_min", "tau_by_band")}
    by_band, baseline = summary["tau_by_band"], summary["tau_baseline_by_band"]
    assert len(by_band) == len(summary["probe_bands"]) - 1 == len(baseline)
    measured = [t for t in by_band if t is not None]
    assert len(measured) >= 4 and all(t >= 1.0 for t in measured)   # 6 prompts over 6 bands, where samples exist
    assert min(measured) - 1e-9 <= summary["tau"] <= max(measured) + 1e-9
    assert summary["tau_band_min"] == min(measured)
    assert summary["tau_band_mean"] == pytest.approx(sum(measured) / len(measured))
    assert all(t is None or t >= 1.0 for t in baseline)


def test_a_checkpoint_from_before_bucket_by_and_auto_bands_resumes(tmp_path):
    """Keys added since a checkpoint was written, at the value that computes the same run, are no change: a
    checkpoint whose config lacks sampler.bucket_by and lists its probe bands resumes under today's defaults
    (bucket_by=length, probes.bands=auto resolving to the same bands); bands that resolve otherwise are refused."""
    run_dir = tmp_path / "old"
    train(compose_cfg(run_dir, "trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.measure_tau=false"))
    manager = ckpt.CheckpointManager(run_dir / record.CHECKPOINT_DIR)
    path = manager.latest_path()
    state = torch.load(path, weights_only=False)
    del state["config"]["sampler"]["bucket_by"]
    state["config"]["probes"]["bands"] = [0, 96, 152, 216, 304, 412, 1024]   # as written before bands=auto
    torch.save(state, path)
    summary = train(compose_cfg(run_dir, "trainer.max_steps=6", "trainer.measure_tau=false"))
    assert summary["status"] == "finished" and summary["steps"] == 6
    state["config"]["probes"]["bands"] = [0, 200, 1024]
    state["step"] = 6
    torch.save(state, manager.latest_path())
    refused = r"probes.bands resolves to \[0, 96, .*checkpoint's run probed \[0, 200, 1024\]"
    with pytest.raises(ValueError, match=refused):
        train(compose_cfg(run_dir, "trainer.max_steps=8", "trainer.measure_tau=false"))


# ---- issue 43: what a launch caps or leaves empty is said before step 1 ------------------------------------------
def test_a_bucket_past_the_longest_document_and_a_capped_max_steps_are_said_at_launch(tmp_path):
    run_dir = tmp_path / "said"
    summary = train(compose_cfg(run_dir, "trainer.epochs=1", "sampler.max_tokens=16384", "trainer.max_steps=1000000000",
                                "trainer.measure_tau=false", "probes.every=0",
                                "sampler.boundaries=[0,96,152,216,304,412,1024,2048]"))
    log = (run_dir / "train_rank0.log").read_text()
    before_step_one = log[:log.index("running steps 0..")]
    steps = summary["steps"]
    assert summary["status"] == "finished" and steps == summary["total_steps"] == summary["end_step"] < 100
    assert ("sampler.boundaries=[0, 96, 152, 216, 304, 412, 1024, 2048]: bucket 6 (1024, 2048] holds no sample (the "
            "longest is 1024 tokens), so it makes no batch: this run has 6 buckets, not 7. Drop the empty buckets' "
            "upper boundaries to say so: sampler.boundaries=[0,96,152,216,304,412,1024]") in before_step_one
    assert (f"trainer.max_steps=1000000000 is more than the {steps} steps of trainer.epochs=1 ([{steps}] per epoch): "
            f"the run ends at step {steps}, the end of its last epoch (a run never trains past its epochs); raise "
            f"trainer.epochs for more steps, or set trainer.max_steps=null") in before_step_one
