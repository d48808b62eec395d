"""benchmarks/bench_data_scale.py in its reduced configuration: every column is measured, the tables print."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_the_data_scale_benchmark_runs_small_and_prints_its_tables(tmp_path):
    pytest.importorskip("datasets")
    out = subprocess.run([sys.executable, "benchmarks/bench_data_scale.py", "--sizes", "2000", "--num-proc", "1", "2",
                          "--work", str(tmp_path), "--out", str(tmp_path / "report.md")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    report = (tmp_path / "report.md").read_text()
    assert report in out.stdout
    prep = [line for line in report.splitlines() if line.startswith("| 2,000 |")]
    assert len(prep) == 3   # num_proc 1 and 2, then the start table's row
    for row in prep[:2]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 15 and "-" not in cells   # ours and datasets.map both measured
    start = [cell.strip() for cell in prep[2].strip("|").split("|")]
    assert len(start) == 9 and "-" not in start and float(start[1]) <= float(start[2])   # first plan line first
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".jsonl") == ["chats_2000.jsonl"]
    assert not list(tmp_path.glob("ours_*")) and not list(tmp_path.glob("hf_*"))   # the caches are removed
