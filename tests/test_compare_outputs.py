"""`python -m dflash_lab.compare`: --out holds exactly one complete comparison (swapped in whole, never mixed with an
earlier one, foreign files refused) and refusals are one line. Hand-made run directories
(tests/test_analysis_loading.write_run), no training."""

import os

import pandas as pd
import pytest

from dflash_lab import compare
from dflash_lab.analysis import plots
from test_analysis_loading import write_run  # tests/ is on sys.path (pytest rootdir-relative import)


@pytest.fixture
def sweep(tmp_path):
    """full_random and bucketed, seeds 0 and 1."""
    root = tmp_path / "runs" / "sweep"
    for job, (sampler, seed) in enumerate([("full_random", 0), ("full_random", 1), ("bucketed", 0), ("bucketed", 1)]):
        write_run(root / f"{job}_{sampler}_s{seed}", sampler, seed, steps=60)
    return root


def _snapshot(folder):
    return {path.name: path.read_bytes() if path.is_file() else "folder" for path in sorted(folder.iterdir())}


def _siblings(out):
    return sorted(path.name for path in out.parent.iterdir())


# ------------------------------------------------------------------------------------------------ --out swapped in
def test_a_second_comparison_with_fewer_outputs_leaves_none_of_the_firsts(sweep, tmp_path, capsys):
    out = tmp_path / "out"
    assert compare.main([str(sweep), "--out", str(out), "--baseline", "full_random"]) == 0
    first = set(os.listdir(out))
    assert {"paired.csv", "equal_compute.png", "loss_curves.png"} <= first
    assert compare.main([str(sweep), "--out", str(out), "--no-plots"]) == 0  # no baseline, no plots
    second = set(os.listdir(out))
    assert "paired.csv" not in second and not any(name.endswith(".png") for name in second)
    assert second == {"comparison.csv", "comparison_groups.csv", "comparison.md", "bands.csv", "curves.csv"}
    assert "No paired comparison" in (out / "comparison.md").read_text()
    assert _siblings(out) == ["out", "runs"]  # no temporary or old folder left beside it


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_a_failure_midway_leaves_the_previous_comparison_untouched(sweep, tmp_path, monkeypatch, failure):
    out = tmp_path / "out"
    assert compare.main([str(sweep), "--out", str(out), "--baseline", "full_random", "--no-plots"]) == 0
    before = _snapshot(out)

    def broken(*args, **kwargs):
        raise failure("midway")

    # the tables and the first plots are written by then; the tradeoff plot fails (or the user presses Ctrl-C)
    monkeypatch.setattr(plots, "plot_tradeoff", broken)
    with pytest.raises(failure):
        compare.main([str(sweep), "--out", str(out)])
    assert _snapshot(out) == before
    assert _siblings(out) == ["out", "runs"]
    # a first comparison that fails leaves no --out and no temporary folder at all
    with pytest.raises(failure):
        compare.main([str(sweep), "--out", str(tmp_path / "fresh")])
    assert _siblings(out) == ["out", "runs"]


def test_a_table_writer_failing_leaves_the_previous_comparison_untouched(sweep, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert compare.main([str(sweep), "--out", str(out), "--no-plots"]) == 0
    before = _snapshot(out)

    def broken(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_csv", broken)
    assert compare.main([str(sweep), "--out", str(out), "--no-plots", "--baseline", "full_random"]) == 1
    assert _snapshot(out) == before and _siblings(out) == ["out", "runs"]


def test_a_foreign_file_in_out_is_refused_by_name_and_force_replaces_it(sweep, tmp_path, capsys):
    out = tmp_path / "out"
    assert compare.main([str(sweep), "--out", str(out), "--no-plots", "--baseline", "full_random"]) == 0
    (out / "my_notes.txt").write_text("keep me")
    (out / "figures").mkdir()
    before = _snapshot(out)
    capsys.readouterr()
    assert compare.main([str(sweep), "--out", str(out), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "my_notes.txt" in err and "figures/" in err and "--force" in err
    assert _snapshot(out) == before  # nothing touched
    assert compare.main([str(sweep), "--out", str(out), "--no-plots", "--force"]) == 0
    assert not (out / "my_notes.txt").exists() and not (out / "figures").exists()
    assert not (out / "paired.csv").exists() and (out / "comparison.csv").is_file()
    assert _siblings(out) == ["out", "runs"]


def test_out_is_never_a_folder_holding_the_runs_or_the_current_directory(sweep, tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    for out in (runs, sweep):
        assert compare.main([str(sweep), "--out", str(out), "--no-plots", "--force"]) == 2
        assert "holds the input" in capsys.readouterr().err
    monkeypatch.chdir(sweep)
    assert compare.main([str(sweep), "--out", ".", "--no-plots", "--force"]) == 2
    assert "current directory" in capsys.readouterr().err
    assert sorted(p.name for p in sweep.iterdir()) == ["0_full_random_s0", "1_full_random_s1", "2_bucketed_s0",
                                                       "3_bucketed_s1"]


def test_help_documents_force_and_the_swap(capsys):
    with pytest.raises(SystemExit):
        compare.parse_args(["--help"])
    help_text = capsys.readouterr().out
    for phrase in ("--force", "--debug", "temporary folder", "HYDRA_FULL_ERROR"):
        assert phrase in help_text, phrase
