#!/usr/bin/env bash
# bash scripts/setup.sh    -- install dflash_lab and its dependencies into the current Python (fresh machine OK).
# torch first: torch==2.13.0 is the CPU build (a newer spec would pull a multi-GB CUDA build); the project's range
# is then already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e '.[dev]'
