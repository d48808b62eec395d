#!/usr/bin/env bash
# bash scripts/gpu_check.sh OUT.jsonl         -- the GPU check: CUDA attention tests, gpu_check (Qwen3-8B shape,
#                                                bucketed + packed, 32K tokens, memory-plan block budget and
#                                                checkpointing), a 100-step model=hf training; <= 8 min on one H200
# bash scripts/gpu_check.sh --cpu OUT.jsonl   -- the same path on a CPU at the tiny shape (a few minutes)
# One JSON object per line in OUT.jsonl, each with a "check" key; a failing stage records its error and the
# others still run; the exit code is non-zero when any stage failed. Stages: scripts/gpu_check_stages.py.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1
exec python scripts/gpu_check_stages.py "$@"
