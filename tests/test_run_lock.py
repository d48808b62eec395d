"""One writer per run directory (dflash_lab/records/run_lock.py): a second process on a live run's directory is refused
within seconds and writes nothing, in either order of arrival; a lock left by a killed run is taken over with a log
line; finished, resumed and 2-rank runs keep working (the 2-rank case: tests/test_dist_train.py leaves the lock
released)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_lab.records.run_lock import LOCK_FILE, RunDirBusy, RunDirLock

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "++model.hidden_size=64", "++model.num_layers=2", "++model.num_heads=4", "++model.num_kv_heads=2",
    "++model.intermediate_size=128", "++model.pretrain_steps=20", "++model.pretrain_tokens_per_step=2048",
    "++model.block_size=4", "++data.num_samples=300", "sampler.max_tokens=1024", "trainer.num_threads=1",
    "trainer.progress=false", "trainer.measure_tau=false", "trainer.epochs=2", "probes.every=5", "probes.per_band=2",
    "trainer.log_every=1",
]


def test_a_second_lock_on_a_held_directory_is_refused_naming_the_holder(tmp_path):
    with RunDirLock(tmp_path):
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(RunDirBusy, match=rf"in use by host \S+ pid {os.getpid()} since .*hydra.run.dir"):
            RunDirLock(tmp_path).acquire()
    assert (tmp_path / LOCK_FILE).read_text() == ""          # a clean end clears the holder
    with RunDirLock(tmp_path) as again:
        assert again.replaced is None                        # nothing stale after a clean end


def _launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "dflash_lab.train", *SMALL, f"hydra.run.dir={run_dir}", *extra]
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.2)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def _holder_pid(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.integration
def test_a_double_start_is_refused_in_either_order_and_the_first_run_is_unharmed(tmp_path):
    long_run = ("trainer.epochs=40", "trainer.max_steps=600", "probes.every=50")   # outlasts a second launch
    reference = tmp_path / "reference"
    done = _launch(reference, *long_run)
    assert done.wait(timeout=600) == 0, done.stderr.read()[-3000:]

    shared = tmp_path / "shared"
    first = _launch(shared, *long_run)
    _wait_for(lambda: _holder_pid(shared) == first.pid)
    arrivals = []
    for moment in ("during setup", "during the loop"):
        if moment == "during the loop":
            _wait_for(lambda: len(_steps(shared)) >= 3)
        started = time.monotonic()
        second = _launch(shared, *long_run)
        out, err = second.communicate(timeout=120)
        arrivals.append((moment, second.returncode, time.monotonic() - started, err))
    first_finished_early = first.poll() is not None
    assert first.wait(timeout=600) == 0, first.stderr.read()[-3000:]
    for moment, code, seconds, err in arrivals:
        assert code == 3, (moment, err[-2000:])
        assert "is in use by host" in err and f"pid {first.pid}" in err and "Traceback" not in err, err[-2000:]
        assert seconds < 60, (moment, seconds)   # the interpreter, Hydra and torch imports; no model, no data
    steps = _steps(shared)
    assert not first_finished_early, "the first run ended before the second arrived: lengthen long_run"
    assert steps == list(range(1, 601))
    probe_keys = [(r["step"], r["band"]) for r in map(json.loads, (shared / "probes.jsonl").read_text().splitlines())]
    assert len(probe_keys) == len(set(probe_keys))
    losses = lambda d: [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]  # noqa
    assert losses(shared) == losses(reference)
    assert json.loads((shared / "summary.json").read_text())["status"] == "finished"


@pytest.mark.integration
def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_log_line(tmp_path):
    run_dir = tmp_path / "run"
    victim = _launch(run_dir, "trainer.max_steps=400", "trainer.ckpt_every=5")
    _wait_for(lambda: len(_steps(run_dir)) >= 6)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=60)
    assert _holder_pid(run_dir) == victim.pid            # the dead process's holder line is still there
    survivor = _launch(run_dir, "trainer.max_steps=12")
    assert survivor.wait(timeout=600) == 0, survivor.stderr.read()[-3000:]
    log = (run_dir / "train_rank0.log").read_text()
    assert "run lock: took over a stale lock of host" in log and f"pid {victim.pid}" in log
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    assert (run_dir / LOCK_FILE).read_text() == ""
    # the finished directory re-run: the lock is free, nothing to do
    again = _launch(run_dir, "trainer.max_steps=12")
    assert again.wait(timeout=600) == 0, again.stderr.read()[-3000:]


@pytest.mark.integration
def test_a_refused_launch_prints_the_message_alone_unless_hydra_full_error(tmp_path):
    """A refusal (here: resume=true in a directory without a checkpoint) prints one message naming the fix and
    exits 2; HYDRA_FULL_ERROR=1 shows the traceback instead."""
    command = [sys.executable, "-m", "dflash_lab.train", *SMALL, f"hydra.run.dir={tmp_path / 'run'}", "resume=true"]
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("HYDRA_FULL_ERROR", None)
    quiet = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr, quiet.stderr[-2000:]
    assert "dflash_lab.train: error: resume=true but" in quiet.stderr and "drop resume=true" in quiet.stderr
    full = subprocess.run(command, cwd=ROOT, env={**env, "HYDRA_FULL_ERROR": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert full.returncode != 0 and "Traceback" in full.stderr


def test_a_pickled_lock_holds_nothing(tmp_path):
    """submitit pickles the task function and its globals for a requeue: a copy of a held lock must not carry the
    file (cloudpickle would turn it into a StringIO) and releases as a no-op."""
    import pickle

    with RunDirLock(tmp_path) as lock:
        copy = pickle.loads(pickle.dumps(lock))
        assert not copy.held
        copy.release()
        assert lock.held
