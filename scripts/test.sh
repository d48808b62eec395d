#!/usr/bin/env bash
# bash scripts/test.sh     -- set up, start a local single-node Slurm cluster, run every test (slow + slurm
# included), stop Slurm. Extra arguments go to pytest (e.g. bash scripts/test.sh -x -k sampling).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1
if bash scripts/slurm_up.sh; then
  trap 'bash scripts/slurm_down.sh || true' EXIT
else
  echo "scripts/test.sh: Slurm did not start; the slurm-marked tests will fail" >&2
fi
python3 -m pytest -q -m "" --durations=15 "$@"
