"""benchmarks/gpu_check.py on CPU (tiny shape): the JSON lines, and predicted vs measured peak memory within 25%."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"policy", "ktok_s", "mfu", "peak_mem_gb", "pred_peak_mem_gb", "step_time_s", "pad_eff"}


@pytest.mark.slow
def test_gpu_check_cpu_tiny():
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--shape", "tiny",
           "--policies", "packed,bucketed", "--warmup", "1", "--steps", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    setup, rows = lines[0]["setup"], lines[1:]
    assert setup["device"] == "cpu" and setup["peak_source"] == "matmul" and setup["budget"] >= 64
    assert [row["policy"] for row in rows] == ["packed", "bucketed"]
    for row in rows:
        assert FIELDS <= set(row) and row["finite"]
        assert row["ktok_s"] > 0 and 0 < row["mfu"] < 1 and 0 < row["pad_eff"] <= 1
        assert 0.75 <= row["pred_peak_mem_gb"] / row["peak_mem_gb"] <= 1.25, row
