"""`python -m dflash_lab.compare`: --out holds exactly one complete comparison (swapped in whole, never mixed with an
earlier one, foreign files refused), runs of one arm and one seed are refused as duplicates, and refusals are one
line. Hand-made run directories (tests/test_analysis_loading.write_run), no training."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from dflash_lab import compare
from dflash_lab.analysis import compare_records, load_runs
from dflash_lab.analysis import plots
from dflash_lab.refusal import Refused
from helpers import write_run  # tests/ is on sys.path (pytest rootdir-relative import)


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
    assert second <= {"comparison.csv", "comparison_groups.csv", "comparison.md", "bands.csv", "curves.csv",
                      "cross_effects.csv"} and second < first
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


# ------------------------------------------------------------------------------------------------------ duplicates
@pytest.fixture
def rerun(sweep, tmp_path):
    """The bucketed seed-0 run launched again in another folder: same config, same seed."""
    return write_run(tmp_path / "runs" / "rerun" / "0_bucketed_s0", "bucketed", 0, steps=60,
                     effects={"ktok_s": 3.0})


def test_two_runs_of_one_arm_and_seed_are_refused_naming_both(sweep, rerun, tmp_path, capsys):
    out = tmp_path / "out"
    code = compare.main([str(sweep), str(rerun.parent), "--out", str(out), "--no-plots", "--baseline", "full_random"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert str(sweep / "2_bucketed_s0") in err and str(rerun) in err
    assert "seed 0" in err and "not two seeds" in err and "--duplicates=latest" in err
    assert not out.exists()
    with pytest.raises(ValueError, match="not two seeds"):  # the library refuses too: arms never count them twice
        compare_records(load_runs([sweep, rerun]).runs)


def test_duplicates_first_or_latest_keeps_one_run_and_notes_it(sweep, rerun, tmp_path):
    out = tmp_path / "out"
    original = sweep / "2_bucketed_s0"
    old = original.stat().st_mtime - 1000
    for name in ("summary.json", "metrics.jsonl", "probes.jsonl", ".hydra/config.yaml"):
        os.utime(original / name, (old, old))  # the rerun wrote its files last
    for policy, kept, left_out in (("first", original, rerun), ("latest", rerun, original)):
        args = [str(sweep), str(rerun.parent), "--out", str(out), "--no-plots", "--baseline", "full_random"]
        assert compare.main([*args, f"--duplicates={policy}"]) == 0
        runs = pd.read_csv(out / "comparison.csv")
        assert len(runs) == 4 and str(kept) in set(runs["location"]) and str(left_out) not in set(runs["location"])
        groups = pd.read_csv(out / "comparison_groups.csv", index_col="arm")
        assert groups.loc["bucketed", "n_runs"] == 2 and groups.loc["bucketed", "seeds"] == "0 1"
        paired = pd.read_csv(out / "paired.csv")
        assert set(paired["n_pairs"]) == {2}
        markdown = (out / "comparison.md").read_text()
        assert f"kept {kept}, left out {left_out} (--duplicates={policy})" in markdown
        assert "2 runs with seed 0" not in markdown  # nothing is averaged into one seed any more


def test_runs_of_different_arms_or_seeds_are_not_duplicates(sweep, tmp_path):
    write_run(tmp_path / "runs" / "more" / "0_bucketed_s2", "bucketed", 2, steps=60)
    write_run(tmp_path / "runs" / "more" / "1_packed_s0", "packed", 0, steps=60)
    comparison = compare_records(load_runs([sweep, tmp_path / "runs" / "more"]).runs)
    # not duplicates; the one note says that bucketed pools the seeds of two launches (issue 23, item 11)
    assert len(comparison.runs) == 6 and len(comparison.notes) == 1
    assert comparison.notes[0].startswith("arm 'bucketed' pools the runs of 2 launches")


def _record_topology(run_dir, topology):
    """Where the run's ranks ran, as the trainer records it in summary.json (nodes x ranks per node)."""
    path = run_dir / "summary.json"
    nodes, per_node = map(int, topology.split("x"))
    path.write_text(json.dumps({**json.loads(path.read_text()), "topology": topology, "num_nodes": nodes,
                                "tasks_per_node": per_node, "world_size": nodes * per_node}))


def test_runs_that_differ_only_by_topology_are_separate_arms_and_true_duplicates_are_still_refused(sweep, rerun,
                                                                                                   tmp_path):
    """The sweep ran on 1 node x 2 ranks; the bucketed seed-0 run again on 2 nodes x 1 rank is another run, not a
    duplicate: its own arm and row. A second 2x1 run of it is a duplicate, refused as before."""
    for run_dir in sweep.iterdir():
        _record_topology(run_dir, "1x2")
    _record_topology(rerun, "2x1")
    out = tmp_path / "out"
    assert compare.main([str(sweep), str(rerun.parent), "--out", str(out), "--no-plots", "--baseline",
                         "full_random"]) == 0
    runs = pd.read_csv(out / "comparison.csv").set_index("location")
    assert len(runs) == 5 and list(runs.columns).count("topology") == 1
    assert runs.loc[str(rerun), "arm"] == "bucketed topology=2x1" and runs.loc[str(rerun), "topology"] == "2x1"
    assert runs.loc[str(sweep / "2_bucketed_s0"), "arm"] == "bucketed topology=1x2"
    groups = pd.read_csv(out / "comparison_groups.csv", index_col="arm")
    assert groups.loc["bucketed topology=1x2", "seeds"] == "0 1" and groups.loc["bucketed topology=2x1", "seeds"] == "0"
    assert set(pd.read_csv(out / "paired.csv")["n_pairs"]) == {2}   # 1x2 pairs with 1x2 only
    markdown = (out / "comparison.md").read_text()
    assert "stratum 'topology=2x1': no arm matches baseline 'full_random'" in markdown   # said, not dropped
    again = write_run(tmp_path / "runs" / "again" / "0_bucketed_s0", "bucketed", 0, steps=60)
    _record_topology(again, "2x1")
    with pytest.raises(ValueError, match="not two seeds"):
        compare_records(load_runs([sweep, rerun, again]).runs)


def test_one_topology_beside_runs_recorded_before_topologies_splits_no_arm(sweep):
    for run_dir in sorted(sweep.iterdir())[:2]:   # the full_random runs; the bucketed ones recorded none
        _record_topology(run_dir, "1x1")
    comparison = compare_records(load_runs([sweep]).runs)
    assert sorted(set(comparison.runs["arm"])) == ["bucketed", "full_random"] and "topology" not in comparison.swept


# -------------------------------------------------------------------------------------------- one-line refusals
def test_compare_refuses_with_the_one_refused_class_the_other_commands_raise(tmp_path):
    """compare had a Refused of its own beside dflash_lab.refusal.Refused (the same concept: a one-line refusal
    naming the fix, exit 2): a caller catching the package's Refused missed compare's refusals."""
    file = tmp_path / "out"
    file.write_text("")
    with pytest.raises(Refused, match=r"--out .* is a file, not a folder"):
        compare.check_out(file)
    assert compare.Refused is Refused


def test_refusals_show_the_traceback_with_debug_or_hydra_full_error(sweep, rerun, tmp_path, monkeypatch):
    args = [str(sweep), str(rerun.parent), "--out", str(tmp_path / "o"), "--no-plots"]
    with pytest.raises(Refused, match="not two seeds"):
        compare.main([*args, "--debug"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(Refused, match="not two seeds"):
        compare.main(args)


@pytest.mark.integration
def test_the_module_prints_a_refusal_as_one_line(sweep, rerun, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    result = subprocess.run(
        [sys.executable, "-m", "dflash_lab.compare", str(sweep), str(rerun.parent), "--out", str(tmp_path / "o"),
         "--no-plots"], capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: ") and "not two seeds" in result.stderr


def test_help_documents_duplicates_force_and_the_swap(capsys):
    with pytest.raises(SystemExit):
        compare.parse_args(["--help"])
    help_text = capsys.readouterr().out
    for phrase in ("--duplicates", "--duplicates=latest", "--force", "--debug", "temporary folder",
                   "HYDRA_FULL_ERROR"):
        assert phrase in help_text, phrase
    with pytest.raises(SystemExit):
        compare.parse_args(["x", "--duplicates", "all"])
