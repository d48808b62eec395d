"""`python -m dflash_lab.compare`: files written, markdown printed, bad input handled (hand-made run directories)."""

import subprocess
import sys

import pandas as pd
import pytest

from dflash_lab import compare
from dflash_lab.analysis.schema import COMPARISON_COLUMNS, RUN_COLUMNS
from test_analysis_loading import write_run  # tests/ is on sys.path (pytest rootdir-relative import)


@pytest.fixture
def multirun(tmp_path):
    root = tmp_path / "multirun" / "exp"
    for job, (sampler, seed) in enumerate([("bucketed", 0), ("bucketed", 1), ("full_random", 0), ("packed", 0)]):
        write_run(root / f"{job}_{sampler}_s{seed}", sampler, seed)
    write_run(root / "4_packed_s1", "packed", 1, summary=False, torn_tail=True)
    return root


def test_cli_writes_tables_and_plots_and_prints_markdown(multirun, tmp_path, capsys):
    out = tmp_path / "out"
    assert compare.main([str(multirun), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    for name in ("comparison.csv", "comparison_policies.csv", "comparison.md", "bands.csv", "interference.csv",
                 "loss_curves.png", "band_accuracy.png", "metric_bars.png", "throughput_vs_forgetting.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    runs = pd.read_csv(out / "comparison.csv")
    assert list(runs.columns) == list(RUN_COLUMNS) and len(runs) == 5
    assert runs["partial"].sum() == 1
    markdown = (out / "comparison.md").read_text()
    assert markdown.strip() == printed.out.strip()
    header = next(line for line in markdown.splitlines() if line.startswith("| sampler"))
    assert all(column in header for column in COMPARISON_COLUMNS)
    assert "| bucketed | 2 |" in markdown and "(1 partial)" in markdown and "±" in markdown
    assert "5 run(s) (1 partial)" in printed.err
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_reports_bad_paths_and_still_compares_the_good_ones(multirun, tmp_path, capsys):
    junk = tmp_path / "junk"
    junk.mkdir()
    code = compare.main([str(tmp_path / "nope"), str(junk), str(multirun), "--out", str(tmp_path / "o"), "--no-plots"])
    err = capsys.readouterr().err
    assert code == 0
    assert "skipped: " in err and "does not exist" in err and "not a run directory" in err
    assert not (tmp_path / "o" / "loss_curves.png").exists()


def test_cli_exits_1_with_a_message_when_nothing_loads(tmp_path, capsys):
    assert compare.main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 1
    assert "no runs loaded" in capsys.readouterr().err


def test_cli_requires_a_source():
    with pytest.raises(SystemExit):
        compare.parse_args([])


def test_plots_survive_runs_without_probes_or_steps(tmp_path):
    run = write_run(tmp_path / "m" / "r", "sorted_static", 0, probes=False, presentations=False)
    (run / "metrics.jsonl").write_text("")
    assert compare.main([str(tmp_path / "m"), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "band_accuracy.png").is_file()


def test_module_entry_point_runs(multirun, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dflash_lab.compare", str(multirun), "--out", str(tmp_path / "o"), "--no-plots"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "## Per policy" in result.stdout
