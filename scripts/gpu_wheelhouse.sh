#!/usr/bin/env bash
# bash scripts/gpu_wheelhouse.sh [--python-version 3.12] [--out wheelhouse]
#
# Builds wheelhouse/ (git-ignored): wheels of what scripts/gpu_check.sh needs and the lent GPU image lacks
# (scripts/gpu_requirements.txt: hydra-core, omegaconf, the antlr4 runtime, pytest, hypothesis, and their
# dependencies), for CPython <python-version> on x86_64 Linux. Run it here, where the registry can be reached;
# the wheelhouse then travels with the working tree (the device run's carry: ["wheelhouse"]) and gpu_check.sh
# installs from it with no index (scripts/gpu_deps.py). --python-version: 3.12 for the GPU image; the local
# Python's version (e.g. 3.11) for the CPU proof in docs/gpu.md. Fails when the wheelhouse reaches 60 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=3.12
OUT=wheelhouse
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) PYTHON_VERSION="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "gpu_wheelhouse.sh: unknown argument $1 (use --python-version X.Y, --out DIR)" >&2; exit 2 ;;
    esac
done
case "$PYTHON_VERSION" in
    3.[0-9]|3.[0-9][0-9]) ;;
    *) echo "gpu_wheelhouse.sh: --python-version $PYTHON_VERSION: give major.minor, e.g. 3.12" >&2; exit 2 ;;
esac
PY=$(command -v python3 || command -v python)
rm -rf "$OUT"
mkdir -p "$OUT"
# antlr4-python3-runtime 4.9.3 (omegaconf 2.3 pins 4.9.*) ships only an sdist: build it into a (pure Python) wheel
ANTLR=$(grep -E '^antlr4-python3-runtime==' scripts/gpu_requirements.txt | cut -d' ' -f1)
"$PY" -m pip wheel --quiet --no-deps --wheel-dir "$OUT" "$ANTLR"
# everything else as binary wheels for the target interpreter; the antlr4 wheel just built satisfies its pin
"$PY" -m pip download --quiet --dest "$OUT" --find-links "$OUT" --only-binary=:all: \
    --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -r scripts/gpu_requirements.txt
grep -vE '^\s*(#|$)' scripts/gpu_requirements.txt | sed 's/\s*#.*//' > "$OUT/requirements.txt"
echo "$PYTHON_VERSION" > "$OUT/python_version"
SIZE_KIB=$(du -sk "$OUT" | cut -f1)
ls -1 "$OUT"
echo "gpu_wheelhouse.sh: $OUT/ for Python $PYTHON_VERSION: $(ls "$OUT"/*.whl | wc -l) wheels, $((SIZE_KIB / 1024)) MiB"
if [ "$SIZE_KIB" -ge $((60 * 1024)) ]; then
    echo "gpu_wheelhouse.sh: $OUT/ is ${SIZE_KIB} KiB, over the 60 MiB a device run carries" >&2
    exit 1
fi
