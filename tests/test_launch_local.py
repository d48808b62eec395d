"""`hydra/launcher=local` end to end: a multirun goes through submitit's local executor as 2 CPU ranks (no Slurm).

This is the same path a Slurm job takes (the Hydra job is pickled by submitit, every task unpickles and runs the
whole app, dflash_lab.training.dist reads rank/world from submitit's environment), so it runs on any CI machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration   # trains, compiles or starts processes: scripts/test.sh

ROOT = Path(__file__).resolve().parents[1]


def test_local_launcher_runs_a_two_rank_job(tmp_path):
    sweep_dir = tmp_path / "multirun"
    steps = 3
    out = subprocess.run(
        [sys.executable, "-m", "dflash_lab.train", "-m", "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}",
         f"trainer.max_steps={steps}", "trainer.progress=false", "trainer.measure_tau=false", "trainer.num_threads=1",
         "probes.every=0", "probes.presentations=false", "sampler.max_tokens=1024"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(sweep_dir.rglob("*_log.*")))
    assert out.returncode == 0, out.stderr[-3000:] + logs
    assert "launch checks passed: submitit local, 1 node(s) x 2 task(s)" in out.stdout + out.stderr
    (run_dir,) = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    protocol = json.loads((sweep_dir / "protocol.json").read_text())   # frozen before the runs started
    assert protocol["rules_version"] >= 3 and protocol["resolved"]["test"] == "t" and protocol["analysis_code"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["world_size"], summary["steps"]) == ("finished", 2, steps)
    steps_logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps_logged == list(range(1, steps + 1))
    for rank in (0, 1):
        assert f"rank {rank}/2 (submitit)" in (run_dir / f"train_rank{rank}.log").read_text()
