"""End to end through a real Slurm: `hydra/launcher=slurm` submits, ranks train, preemption requeues and resumes.

Needs the cluster started by ``scripts/slurm_up.sh`` (CI: `.ci/run` starts it); every test here is marked
``slurm`` and skipped, with the reason, when ``sinfo`` cannot reach a controller (failed instead when
``DFLASH_LAB_REQUIRE_SLURM=1``, so CI cannot pass without having run them). Jobs are tiny (a few optimizer
steps of the tiny CPU model, 1 CPU per rank) because the test machine may have only 2 cores.

What is checked:
    * a named partition is validated against the live ``sinfo`` before submission (nothing is queued);
    * a CPU request larger than the nodes hold is refused before submission, with the numbers and the fix;
    * a submitted job cancelled while pending ends the launcher's wait with an error within a minute;
    * a 2-task CPU DDP training job runs to the end: both ranks took part, metrics cover every step once;
    * a 2-point boundary sweep (the sweep file, its grid replaced on the command line) gives two finished runs,
      each in its own directory with its own boundaries;
    * preemption: ``scancel --signal=USR2`` (submitit's checkpoint-and-requeue path) and ``scontrol requeue``
      (SIGTERM, Slurm requeues) both end in a run that resumed in the same directory from its own checkpoint,
      with the steps in metrics.jsonl contiguous and without duplicates, and the same W&B run id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dflash_lab.cluster.launch import slurm_nodes, slurm_partitions
from helpers import ROOT, SLURM_CPU, TINY, need_slurm, submitit_logs, wait_for
from helpers import cancel_jobs as _cancel
from helpers import metric_steps as _metric_steps
from helpers import new_job_name as _experiment
from helpers import slurm_cli as _run_cli
from helpers import slurm_jobs as _jobs

pytestmark = pytest.mark.slurm


@pytest.fixture(autouse=True)
def _need_slurm():
    need_slurm()


def _finished(run_dir: Path, steps: int, world_size: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished", summary
    assert summary["steps"] == steps and summary["world_size"] == world_size
    assert _metric_steps(run_dir) == list(range(1, steps + 1))
    return summary


def test_slurm_up_is_idempotent_on_a_running_cluster():
    # Running it again with the running cluster's node count must not restart anything (CI may call it twice; jobs
    # would be lost).
    if os.geteuid() != 0:
        pytest.skip("scripts/slurm_up.sh needs root")
    nodes = len({node.name for node in slurm_nodes()})
    pid_files = [Path("/run/slurmctld.pid"), *sorted(Path("/run").glob("slurmd*.pid"))]
    pids = {p: p.read_text().strip() for p in pid_files if p.is_file()}
    assert len(pids) == 1 + nodes, pids   # slurmctld and one slurmd per node
    out = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_up.sh"), "--nodes", str(nodes)], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "slurmctld already running" in out.stdout and "srun works" in out.stdout
    assert f"cluster is up with {nodes} node(s)" in out.stdout
    assert {p: p.read_text().strip() for p in pids} == pids


def test_partition_is_checked_against_the_live_cluster(tmp_path):
    partitions = slurm_partitions()
    assert partitions and all("*" not in p for p in partitions)
    name = _experiment()
    sweep_dir = tmp_path / "multirun"
    out = _run_cli(
        ["-m", *SLURM_CPU, f"hydra.launcher.name=dflash_{name}", f"hydra.sweep.dir={sweep_dir}",
         "hydra.launcher.partition=no_such_part", "trainer.max_steps=1", *TINY],
        timeout=120, name=name,
    )
    assert out.returncode != 0
    assert "hydra.launcher.partition='no_such_part'" in out.stderr
    assert ", ".join(partitions) in out.stderr
    assert not sweep_dir.exists() and _jobs(name) == []  # nothing was submitted


def test_cpu_request_larger_than_the_node_is_refused_before_submission(tmp_path):
    # tasks_per_node=2 with the GPU default of 8 CPUs per task asks 16 CPUs of a 2-CPU node: Slurm would keep the
    # job PENDING forever while the launcher waits. The check refuses it with the numbers and the fix.
    cpus = max(n.cpus for n in slurm_nodes() if n.default)
    name = _experiment()
    sweep_dir = tmp_path / "multirun"
    oversized = [a for a in SLURM_CPU if not a.startswith("hydra.launcher.cpus_per_task")]
    per_task = cpus + 1  # more than the node holds, whatever its size
    out = _run_cli(
        ["-m", *oversized, f"hydra.launcher.cpus_per_task={per_task}", f"hydra.launcher.name=dflash_{name}",
         f"hydra.sweep.dir={sweep_dir}", "trainer.max_steps=1", *TINY],
        timeout=120, name=name,
    )
    assert out.returncode != 0
    fix = f"set hydra.launcher.cpus_per_task={cpus // 2}" if cpus >= 2 else "set hydra.launcher.tasks_per_node=1"
    assert f"asks {2 * per_task} CPUs per node; nodes in partition debug have {cpus}: {fix}" in out.stderr, out.stderr
    assert not sweep_dir.exists() and _jobs(name) == []  # nothing was submitted


def test_cancelled_pending_job_ends_the_launcher_wait_with_an_error(tmp_path):
    # A 2-job sweep held PENDING (begin time in an hour); cancelling one job means it never writes a result.
    # Without accounting storage submitit cannot see that (sacct fails), so the launcher would wait forever.
    name = _experiment()
    sweep_dir = tmp_path / "multirun"
    args = ["-m", *SLURM_CPU, f"hydra.launcher.name=dflash_{name}", f"hydra.sweep.dir={sweep_dir}", "seed=0,1",
            "++hydra.launcher.additional_parameters.begin=now+3600", "trainer.max_steps=1", *TINY]
    proc = subprocess.Popen([sys.executable, "-m", "dflash_lab.train", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def elements() -> list[str]:
        out = subprocess.run(["squeue", "-h", "-r", "-n", f"dflash_{name}", "-o", "%i"], capture_output=True,
                             text=True)
        return sorted(out.stdout.split())

    try:
        wait_for(lambda: len(elements()) == 2, 120, "the two jobs to be queued", proc)
        first, second = elements()
        subprocess.run(["scancel", first], check=True)
        cancelled_at = time.time()
        output, _ = proc.communicate(timeout=120)
        waited = time.time() - cancelled_at
        assert elements() == [second]  # the other job is left alone
    finally:
        _cancel(name)
        proc.kill()
    assert proc.returncode != 0, output[-3000:]
    assert waited < 60, waited
    # A cancelled pending array element vanishes from Slurm at once (the message adds its last state when the
    # watch saw it pending before).
    assert f"Slurm job {first} left the queue without a result (" in output, output[-3000:]
    assert "Slurm no longer knows it: cancelled, or ended and purged); the launcher stops waiting" in output
    assert f"Other jobs of this sweep may still be queued or running ({second})" in output


def test_two_rank_cpu_ddp_training_job(tmp_path):
    name = _experiment()
    sweep_dir = tmp_path / "multirun"
    steps = 4
    out = _run_cli(
        ["-m", *SLURM_CPU, f"hydra.launcher.name=dflash_{name}", f"hydra.sweep.dir={sweep_dir}",
         f"trainer.max_steps={steps}", *TINY],
        timeout=600, name=name,
    )
    assert out.returncode == 0, out.stderr[-3000:] + submitit_logs(sweep_dir)
    (run_dir,) = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    _finished(run_dir, steps, world_size=2)
    # both ranks ran inside the Slurm job, as the job's two tasks
    for rank in (0, 1):
        text = (run_dir / f"train_rank{rank}.log").read_text()
        assert f"rank {rank}/2 (submitit)" in text
    task_logs = sorted(p.name for p in (sweep_dir / ".submitit").rglob("*_log.out"))
    assert len(task_logs) == 2, task_logs


def test_two_point_boundary_sweep(tmp_path):
    name = _experiment()
    sweep_dir = tmp_path / "multirun"
    grid = {"[0,96,152,216,304,412,1024]": [0, 96, 152, 216, 304, 412, 1024], "[0,216,1024]": [0, 216, 1024]}
    steps = 3
    out = _run_cli(
        ["-m", "--config-dir", "sweeps", "--config-name", "boundaries_grid", *SLURM_CPU,
         # one rank per job, so the two jobs run side by side on a 2-core node
         "hydra.launcher.tasks_per_node=1", f"hydra.launcher.name=dflash_{name}", f"hydra.sweep.dir={sweep_dir}",
         "sampler.boundaries=" + ",".join(grid), f"trainer.max_steps={steps}", *TINY],
        timeout=600, name=name,
    )
    assert out.returncode == 0, out.stderr[-3000:] + submitit_logs(sweep_dir)
    run_dirs = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name.split("_")[0] for p in run_dirs] == ["0", "1"]
    seen = []
    for run_dir in run_dirs:
        _finished(run_dir, steps, world_size=1)
        seen.append(list(OmegaConf.load(run_dir / ".hydra" / "config.yaml").sampler.boundaries))
    assert seen == list(grid.values())


# about 2-3 minutes each: two starts of the job and Slurm's requeue delay in between
# One preemption path: USR2 (what Slurm sends before the time limit, and scancel --signal=USR2); an admin's
# `scontrol requeue` ends the job with SIGTERM, whose checkpoint-and-exit path test_train_e2e checks in-process.
def test_preempted_job_requeues_and_resumes_without_lost_steps(tmp_path):
    name = _experiment()
    sweep_dir = tmp_path / "multirun"
    steps = 100  # long enough that the signal lands mid-run even on a fast machine
    args = ["-m", *SLURM_CPU, f"hydra.launcher.name=dflash_{name}", f"hydra.sweep.dir={sweep_dir}",
            f"trainer.max_steps={steps}", "trainer.ckpt_every=2", "logger=wandb", "logger.mode=offline", *TINY]
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.Popen([sys.executable, "-m", "dflash_lab.train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: _jobs(name), 60, "the job to be queued", proc)
        (job,) = _jobs(name)

        def run_dirs() -> list[Path]:
            if not sweep_dir.is_dir():
                return []
            return [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]

        # a periodic checkpoint proves training is under way (and flushed metrics.jsonl)
        wait_for(lambda: run_dirs() and list((run_dirs()[0] / "checkpoints").glob("step_*.pt")), 300,
                  "the first checkpoint", proc, poll_s=0.2)
        (run_dir,) = run_dirs()
        run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
        # what Slurm sends before the time limit; submitit checkpoints and requeues
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        output, _ = proc.communicate(timeout=600)
    except BaseException:
        _cancel(name)
        proc.kill()
        raise
    assert proc.returncode == 0, output[-3000:] + submitit_logs(sweep_dir)
    info = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert "Restarts=1" in info, info

    # the same run directory, resumed from its own checkpoint, every step exactly once
    assert run_dirs() == [run_dir]
    _finished(run_dir, steps, world_size=2)
    log = (run_dir / "train_rank0.log").read_text()
    resumed = [line for line in log.splitlines() if "resuming from" in line]
    assert len(resumed) == 1, log[-3000:]
    resumed_at = int(resumed[0].split(" at step ")[1].split(":")[0])
    assert 0 < resumed_at < steps
    assert "checkpoint requested" in log
    # W&B continues the same run
    assert (run_dir / "wandb_run_id.txt").read_text().strip() == run_id
    offline_runs = list((run_dir / "wandb").rglob("offline-run-*"))
    assert offline_runs and all(p.name.endswith(run_id) for p in offline_runs), offline_runs
