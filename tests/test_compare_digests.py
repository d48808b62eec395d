"""compare and the digests each run records (summary.json target_digest / data_digest): runs of one setting trained
against different targets or data are refused, listing which run holds which digest, unless --mixed-digests=allow,
which compares them and says so in their notes; runs without digests are compared with a note; a swept data key
changes the data legitimately. Hand-made run directories (tests/test_analysis_loading.write_run), no training."""

import json

import pandas as pd
import pytest

from dflash_lab import compare
from dflash_lab.analysis import compare_records, load_runs
from helpers import write_run  # tests/ is on sys.path (pytest rootdir-relative import)

TARGET, OTHER_TARGET, DATA = "1111aaaa2222bbbb", "9999ffff8888eeee", "d" * 32


def set_digests(run_dir, **digests):
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text())
    summary.update(digests)
    path.write_text(json.dumps(summary))
    return run_dir


@pytest.fixture
def sweep(tmp_path):
    """full_random and bucketed, seeds 0 and 1, all trained against one target and one data set."""
    root = tmp_path / "runs" / "sweep"
    for job, (sampler, seed) in enumerate([("full_random", 0), ("full_random", 1), ("bucketed", 0), ("bucketed", 1)]):
        set_digests(write_run(root / f"{job}_{sampler}_s{seed}", sampler, seed, steps=60),
                    target_digest=TARGET, data_digest=DATA)
    return root


def test_runs_with_one_target_and_data_compare_without_digest_notes(sweep, tmp_path):
    assert compare.main([str(sweep), "--out", str(tmp_path / "out"), "--no-plots", "--baseline", "full_random"]) == 0
    runs = pd.read_csv(tmp_path / "out" / "comparison.csv")
    assert not runs["notes"].astype("string").fillna("").str.contains("digest").any()


def test_a_run_trained_against_another_target_is_refused_then_allowed_with_a_note(sweep, tmp_path, capsys):
    """The reviewer's case: bucketed seed 0 was run on a machine whose tiny target was pretrained differently."""
    odd = set_digests(sweep / "2_bucketed_s0", target_digest=OTHER_TARGET)
    out = tmp_path / "out"
    args = [str(sweep), "--out", str(out), "--no-plots", "--baseline", "full_random"]
    assert compare.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "different target weights" in err and f"{OTHER_TARGET} in {odd}" in err
    assert f"{TARGET} in {sweep / '0_full_random_s0'}" in err and "--mixed-digests=allow" in err
    assert not out.exists()
    with pytest.raises(ValueError, match="compare_records\\(mixed_digests='allow'\\)"):  # the library refuses too
        compare_records(load_runs([sweep]).runs)

    assert compare.main([*args, "--mixed-digests=allow"]) == 0
    runs = pd.read_csv(out / "comparison.csv").set_index("location")
    assert f"target_digest {OTHER_TARGET} differs from other runs of its setting" in runs.loc[str(odd), "notes"]
    assert "compared anyway (--mixed-digests=allow)" in runs.loc[str(sweep / "1_full_random_s1"), "notes"]
    assert set(pd.read_csv(out / "paired.csv")["n_pairs"]) == {2}   # the pairing went ahead
    assert "trained against other target weights or data (--mixed-digests=allow)" in (out / "comparison.md").read_text()


def test_replicates_on_different_data_are_refused(sweep, tmp_path, capsys):
    set_digests(sweep / "3_bucketed_s1", data_digest="e" * 32)
    assert compare.main([str(sweep), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "trained on different data" in err and f"{'e' * 32} in {sweep / '3_bucketed_s1'}" in err
    assert "different target weights" not in err


def test_runs_without_digests_are_compared_with_a_note(sweep, tmp_path):
    old = write_run(tmp_path / "runs" / "old" / "0_packed_s0", "packed", 0, steps=60)   # an older trainer's run
    comparison = compare_records(load_runs([sweep, old.parent]).runs)
    notes = comparison.runs.set_index("run_id")["notes"]
    assert "target_digest unknown" in notes["0_packed_s0"] and "data_digest unknown" in notes["0_packed_s0"]
    assert "digest" not in notes["0_full_random_s0"]


def test_a_swept_data_setting_may_change_the_data_and_the_target(tmp_path):
    """band_skills changes the corpus and the tiny target pretrained on it: runs differing in it are other settings,
    never checked against each other; replicates inside one setting still are."""
    root = tmp_path / "ablation"
    for job, (sampler, skills, seed) in enumerate([(s, k, seed) for s in ("full_random", "bucketed")
                                                   for k in ("aligned", "independent") for seed in (0, 1)]):
        set_digests(write_run(root / f"{job}_{sampler}_{skills}_s{seed}", sampler, seed, steps=60,
                              settings={"data.band_skills": skills}),
                    target_digest=TARGET if skills == "aligned" else OTHER_TARGET,
                    data_digest=("a" if skills == "aligned" else "b") * 32)
    comparison = compare_records(load_runs([root]).runs)
    assert len(comparison.runs) == 8 and not comparison.runs["notes"].str.contains("digest").any()
    set_digests(root / "5_bucketed_aligned_s1", target_digest=OTHER_TARGET)
    with pytest.raises(ValueError, match=f"band_skills=aligned: target_digest {TARGET} in .*; {OTHER_TARGET} in "
                                         ".*5_bucketed_aligned_s1"):
        compare_records(load_runs([root]).runs)


def test_seeds_nested_within_target_seeds_compare_and_a_pair_across_targets_is_refused(sweep, tmp_path):
    """target_seeds=2 (dflash_lab/replicates.py): seed 1 trained against target seed 1, a target of its own. Runs of
    one target seed must share its digest; runs of different target seeds may differ, and still pair by seed."""
    for run in ("0_full_random_s0", "2_bucketed_s0"):
        set_digests(sweep / run, target_seed=0)
    for run in ("1_full_random_s1", "3_bucketed_s1"):
        set_digests(sweep / run, target_seed=1, target_digest=OTHER_TARGET)
    from dflash_lab.analysis.protocol import protocol_from_section

    comparison = compare_records(load_runs([sweep]).runs, protocol=protocol_from_section({"baseline": "full_random"}))
    assert not comparison.runs["notes"].fillna("").str.contains("digest").any()
    assert set(comparison.paired["n_pairs"]) == {2}
    set_digests(sweep / "3_bucketed_s1", target_digest=TARGET)   # one target seed, two different targets
    with pytest.raises(ValueError, match=f"target_seed=1: target_digest {OTHER_TARGET} in .*1_full_random_s1; "
                                         f"{TARGET} in .*3_bucketed_s1"):
        compare_records(load_runs([sweep]).runs)


def test_the_tiny_targets_pretraining_seed_nests_in_the_run_seed():
    """conf/model/tiny.yaml: pretrain_seed = seed mod target_seeds; target_seeds=1 keeps the one target of seed 0."""
    from hydra import compose, initialize_config_dir
    from pathlib import Path

    from dflash_lab.training.settings import plain_config

    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        seeds = {(seed, k): plain_config(compose("train", [f"seed={seed}", f"target_seeds={k}", "run_dir=x"]))
                 ["model"]["pretrain_seed"] for seed in (0, 4, 5) for k in (1, 3)}
        assert seeds == {(0, 1): 0, (4, 1): 0, (5, 1): 0, (0, 3): 0, (4, 3): 1, (5, 3): 2}
        with pytest.raises(Exception, match="target_seeds=0: give a whole number >= 1"):
            plain_config(compose("train", ["target_seeds=0", "run_dir=x"]))


def test_help_documents_mixed_digests(capsys):
    with pytest.raises(SystemExit):
        compare.parse_args(["--help"])
    assert "--mixed-digests" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compare.parse_args(["x", "--mixed-digests", "sometimes"])

def test_an_unknown_policy_is_refused_by_the_library_naming_the_choices(sweep):
    with pytest.raises(ValueError, match="--mixed-digests='sometimes': choose one of error, allow"):
        compare_records(load_runs([sweep]).runs, mixed_digests="sometimes")
