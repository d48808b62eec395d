#!/usr/bin/env bash
# bash scripts/test.sh     -- set up, start a local 2-node Slurm cluster (two slurmd on this host), run every test tier
# (unit, integration, slurm: single-node and multi-node jobs), stop Slurm. Extra arguments go to pytest (e.g. bash scripts/test.sh -x -k sampling). The unit tier alone:
# plain `pytest` (their times: README.md, "Two commands on a fresh machine").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1
export DFLASH_LAB_REQUIRE_SLURM=1              # Slurm tests fail (instead of skipping) when Slurm is down
trap 'bash scripts/slurm_down.sh || true' EXIT  # set before starting, so a half-started cluster is stopped too
bash scripts/slurm_up.sh --nodes 2
# every tier (-m "" lifts the unit-tier default of pyproject.toml), on both cores: a test module runs on one worker
# (--dist loadfile), so its module fixtures (a trained multirun, a DDP pair) are made once
python3 -m pytest -q -m "" -n 2 --dist loadfile --durations=20 "$@"
