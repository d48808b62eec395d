#!/usr/bin/env bash
# bash scripts/test.sh     -- set up, start a local single-node Slurm cluster, run every test (slow + slurm
# included), stop Slurm. Extra arguments go to pytest (e.g. bash scripts/test.sh -x -k sampling).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1
export DFLASH_LAB_REQUIRE_SLURM=1              # Slurm tests fail (instead of skipping) when Slurm is down
trap 'bash scripts/slurm_down.sh || true' EXIT  # set before starting, so a half-started cluster is stopped too
bash scripts/slurm_up.sh
python3 -m pytest -q -m "" --durations=20 "$@"
