"""Beyond one node, through a real Slurm: the local cluster's two nodes (``scripts/slurm_up.sh --nodes 2``: two
slurmd daemons on this host, whose node names do not resolve, as on clusters where a node's name is not its reachable
address).

What is checked:
    * a 2-node x 1-task run finishes (the rendezvous uses the first node's NodeAddr, not its name), its records name
      both nodes, and its losses equal a 1-node x 2-task run's step for step; compare shows each run's topology;
    * a 2-node run requeued mid-way (``scontrol requeue``: SIGTERM, checkpoint, Slurm restarts it) resumes in its
      directory and ends with the uninterrupted run's losses;
    * a rank killed mid-run (SIGKILL) ends the job within the peer timeout, the waiting command says which rank on
      which node was lost, and the same command relaunched into the same sweep directory resumes from the newest
      checkpoint and ends with the uninterrupted run's losses;
    * a rank that cannot reach the master (a master address that does not resolve) and a rank that never starts
      each end the job within the rendezvous bound, with one line naming the rank.

Skipped (failed under ``DFLASH_LAB_REQUIRE_SLURM=1``) without a cluster of at least two nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from helpers import (ROOT, TINY, cancel_jobs, metric_losses, metric_steps, need_slurm, new_job_name, slurm_cli,
                     slurm_jobs, submitit_logs, wait_for)

pytestmark = pytest.mark.slurm

STEPS = 40
# one rank per node on two nodes, or two ranks on one node: the same 2-rank run
TWO_NODES = ["hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1"]
ONE_NODE = ["hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=2"]
LAUNCH = ["-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
          "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=20", "sampler=bucketed", "logger=none", *TINY,
          f"trainer.max_steps={STEPS}", "trainer.ckpt_every=5"]


@pytest.fixture(autouse=True)
def _need_two_nodes():
    need_slurm(nodes=2)


def _launch(sweep_dir: Path, layout: list[str], *extra: str, name: str | None = None) -> subprocess.Popen:
    name = name or new_job_name()
    return subprocess.Popen([sys.executable, "-m", "dflash_lab.train", *LAUNCH, *layout, f"hydra.sweep.dir={sweep_dir}",
                             f"hydra.launcher.name=dflash_{name}", *extra], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, sweep_dir: Path, timeout: float = 400) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, output[-3000:] + submitit_logs(sweep_dir)
    return output


def _run_dir(sweep_dir: Path) -> Path:
    (run_dir,) = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return run_dir


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """The same run on 2 nodes x 1 task and on 1 node x 2 tasks, side by side."""
    base = tmp_path_factory.mktemp("multinode")
    runs = {"2x1": (base / "two_nodes", TWO_NODES), "1x2": (base / "one_node", ONE_NODE)}
    procs = {key: _launch(sweep, layout) for key, (sweep, layout) in runs.items()}
    for key, proc in procs.items():
        _finish(proc, runs[key][0])
    return {key: _run_dir(sweep) for key, (sweep, _) in runs.items()}


def test_two_nodes_and_one_node_give_the_same_run_and_records_name_the_nodes(reference_runs, tmp_path):
    nodes = sorted(set(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split()))
    two, one = reference_runs["2x1"], reference_runs["1x2"]
    for run_dir in (two, one):
        summary = _summary(run_dir)
        assert summary["status"] == "finished" and summary["steps"] == STEPS and summary["world_size"] == 2
        assert metric_steps(run_dir) == list(range(1, STEPS + 1))
    assert metric_losses(two) == metric_losses(one)   # the topology does not change the run, bit for bit

    summary, record = _summary(two), json.loads((two / "run_config.json").read_text())["topology"]
    assert (summary["topology"], summary["num_nodes"], summary["tasks_per_node"]) == ("2x1", 2, 1)
    assert len(set(summary["rank_nodes"])) == 2 and set(summary["rank_nodes"]) <= set(nodes)
    assert record["rank_nodes"] == summary["rank_nodes"]
    assert "NodeAddr of the first node" in record["rendezvous"]   # not the first node's (unresolvable) name
    one_summary = _summary(one)
    assert (one_summary["topology"], one_summary["num_nodes"], one_summary["tasks_per_node"]) == ("1x2", 1, 2)
    log = (two / "train_rank0.log").read_text()
    assert f"topology 2x1 (nodes x ranks per node): {', '.join(summary['rank_nodes'])}" in log

    # compare shows where the run ran
    out = subprocess.run([sys.executable, "-m", "dflash_lab.compare", str(two), "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    table = pd.read_csv(tmp_path / "comparison.csv")
    assert list(table["topology"]) == ["2x1"] and list(table["nodes"]) == [",".join(summary["rank_nodes"])]
    assert "| run | arm | seed | status | topology |" in out.stdout


def _task_pid(job: str, task: int) -> int | None:
    """The pid of task ``task`` (its rank) of Slurm job ``job`` on this host: the Python process submitit runs."""
    out = subprocess.run(["pgrep", "-f", r"^\S*python\S* -u -m submitit\.core\._submit"], capture_output=True,
                         text=True)
    for pid in map(int, out.stdout.split()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in environ and f"SLURM_PROCID={task}".encode() in environ:
            return pid
    return None


def _wait_for_checkpoint(sweep_dir: Path, proc: subprocess.Popen) -> Path:
    def checkpointed() -> bool:
        runs = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")] \
            if sweep_dir.is_dir() else []
        return bool(runs) and any((runs[0] / "checkpoints").glob("step_*.pt"))
    wait_for(checkpointed, 300, "the first checkpoint", proc, poll_s=0.2)
    return _run_dir(sweep_dir)


def test_a_two_node_run_requeued_midway_resumes_exactly(reference_runs, tmp_path):
    name = new_job_name()
    proc = _launch(tmp_path / "sweep", TWO_NODES, name=name)
    try:
        wait_for(lambda: slurm_jobs(name), 60, "the job to be queued", proc)
        (job,) = slurm_jobs(name)
        run_dir = _wait_for_checkpoint(tmp_path / "sweep", proc)
        subprocess.run(["scontrol", "requeue", job], check=True)   # SIGTERM to every rank, then Slurm restarts it
        _finish(proc, tmp_path / "sweep", timeout=500)
    finally:
        cancel_jobs(name)
        proc.kill()
    info = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert "Restarts=1" in info, info
    log = (run_dir / "train_rank0.log").read_text()
    assert len([line for line in log.splitlines() if "resuming from" in line]) == 1, log[-3000:]
    assert _summary(run_dir)["status"] == "finished"
    assert metric_steps(run_dir) == list(range(1, STEPS + 1))
    assert metric_losses(run_dir) == metric_losses(reference_runs["2x1"])


def test_a_rank_killed_mid_run_ends_the_job_naming_it_and_a_relaunch_resumes(reference_runs, tmp_path):
    sweep_dir, name = tmp_path / "sweep", new_job_name()
    proc = _launch(sweep_dir, TWO_NODES, name=name)
    try:
        wait_for(lambda: slurm_jobs(name), 60, "the job to be queued", proc)
        (job,) = slurm_jobs(name)
        run_dir = _wait_for_checkpoint(sweep_dir, proc)
        pid = _task_pid(job, 1)
        assert pid is not None, "rank 1's process was not found"
        killed = time.monotonic()
        subprocess.run(["kill", "-9", str(pid)], check=True)
        output, _ = proc.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        cancel_jobs(name)
        proc.kill()
    node = _summary(run_dir)["rank_nodes"][1]
    assert proc.returncode == 1, output[-3000:]
    assert f"Slurm job {job} failed (FAILED): rank 1 (node {node}) was lost: its heartbeat stopped" in output, \
        output[-3000:]
    assert f"hydra.sweep.dir={sweep_dir}" in output
    assert took < 60, took   # the peer timeout (20 s) bounds it; gloo reports the loss at once
    summary = _summary(run_dir)
    assert summary["status"] == "failed" and f"rank 1 (node {node}) was lost" in summary["error"]
    newest = json.loads((run_dir / "checkpoints" / "last.json").read_text())["step"]

    # the same command, into the same sweep directory: the run resumes from its newest checkpoint
    proc = _launch(sweep_dir, TWO_NODES)
    _finish(proc, sweep_dir)
    log = (run_dir / "train_rank0.log").read_text()
    assert f"at step {newest}: the newest intact checkpoint" in log, log[-3000:]
    assert _summary(run_dir)["status"] == "finished"
    assert metric_steps(run_dir) == list(range(1, STEPS + 1))
    assert metric_losses(run_dir) == metric_losses(reference_runs["2x1"])


def test_a_rank_that_cannot_reach_the_master_ends_the_job_at_once(tmp_path):
    sweep_dir, name = tmp_path / "sweep", new_job_name()
    started = time.monotonic()
    out = slurm_cli([*LAUNCH, *TWO_NODES, f"hydra.sweep.dir={sweep_dir}", f"hydra.launcher.name=dflash_{name}",
                     "trainer.master_addr=no-such-node.invalid"], timeout=300, name=name)
    took = time.monotonic() - started
    assert out.returncode == 1, out.stderr[-3000:]
    for rank in (0, 1):
        assert (f"rank {rank} (node " in out.stderr
                and "cannot reach the rendezvous master no-such-node.invalid:" in out.stderr), out.stderr[-3000:]
    assert "set trainer.master_addr=" in out.stderr
    summary = _summary(_run_dir(sweep_dir))
    assert summary["status"] == "failed" and "cannot reach the rendezvous master" in summary["error"]
    assert took < 120, took


def test_a_rank_that_never_starts_ends_the_job_within_the_rendezvous_bound(tmp_path):
    # a plain srun of the trainer (no launcher), whose second task exits before it starts the trainer
    run_dir = tmp_path / "run"
    command = (f"if [ \"$SLURM_PROCID\" = 1 ]; then exit 0; fi; exec {sys.executable} -m dflash_lab.train "
               f"{' '.join(TINY)} trainer.max_steps=3 trainer.rendezvous_timeout_s=10 hydra.run.dir={run_dir}")
    started = time.monotonic()
    out = subprocess.run(["srun", "-N2", "-n2", "-c1", "--mem=2G", "-t", "10", "-J", f"dflash_{new_job_name()}",
                          "bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    assert out.returncode != 0
    line = [text for text in out.stderr.splitlines() if text.startswith("dflash_lab.train: error:")]
    assert len(line) == 1 and "rank 1 never joined within 10 s (trainer.rendezvous_timeout_s)" in line[0], \
        out.stderr[-3000:]
    assert line[0].startswith("dflash_lab.train: error: rank 0 (node ")
    assert "rank 1 never joined" in _summary(run_dir)["error"]
    assert took < 10 + 60, took   # the bound, plus starting Python and the job
