#!/usr/bin/env bash
# bash scripts/gpu_check.sh [--quick] OUT.jsonl   -- the GPU check (scripts/gpu_check_stages.py): the CUDA tests
#                                                    (flex attention, the one-pass LM head); the seed regime's
#                                                    full_random / bucketed / packed steps and then the memory plan's
#                                                    bucketed / packed steps at the Qwen3-8B shape in one process, one
#                                                    step per cost stratum, each regime's epoch line (step-time fit,
#                                                    the planner's ratio beside), memory lines, MFU and profile; python
#                                                    -m dflash_lab.train trainer=gpu at the Qwen3-8B shape on random
#                                                    weights, to tau. Full <= 7 min 15 s (inside 8 min of machine
#                                                    time), --quick <= 4 min on an H200 by the stages' limits
# bash scripts/gpu_check.sh --cpu OUT.jsonl        -- the same path on a CPU at the tiny shape (minutes)
# One JSON object per line in OUT.jsonl, each with a "check" key; a failing stage records its error and the
# others still run; the exit code is non-zero when any stage failed.
#
# First, before anything imports the project, scripts/gpu_deps.py installs what this Python lacks (hydra-core,
# omegaconf, antlr4, pytest, hypothesis) from wheelhouse/ with no index into $GPU_CHECK_DEPS (default .gpu_deps/,
# put on PYTHONPATH); it stops in seconds, exit code 2, naming what is missing if it cannot. Build the wheelhouse
# with scripts/gpu_wheelhouse.sh where the registry can be reached (docs/gpu.md, "Running the GPU check on a lent
# machine"). Nothing here needs W&B or submitit.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v python3 || command -v python)
DEPS="${GPU_CHECK_DEPS:-$PWD/.gpu_deps}"
export PYTHONPATH="$PWD:$DEPS${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1
"$PY" scripts/gpu_deps.py --wheelhouse "${GPU_CHECK_WHEELHOUSE:-$PWD/wheelhouse}" --target "$DEPS" || exit 2
exec "$PY" scripts/gpu_check_stages.py "$@"
