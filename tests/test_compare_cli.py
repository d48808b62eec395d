"""`python -m dflash_lab.compare`: files written, markdown printed, bad input handled (hand-made run directories)."""

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from dflash_lab import compare
from dflash_lab.analysis.schema import COMPARISON_COLUMNS, RUN_COLUMNS
from helpers import write_run  # tests/ is on sys.path (pytest rootdir-relative import)


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
    for name in ("comparison.csv", "comparison_groups.csv", "comparison.md", "bands.csv", "cross_effects.csv",
                 "curves.csv", "loss_curves.png", "band_accuracy.png", "metric_bars.png", "tradeoff.png",
                 "equal_compute.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert not (out / "paired.csv").exists()  # no baseline given or declared
    runs = pd.read_csv(out / "comparison.csv")
    assert list(runs.columns) == list(RUN_COLUMNS) and len(runs) == 5
    assert runs["partial"].sum() == 1
    markdown = (out / "comparison.md").read_text()
    assert markdown.strip() == printed.out.strip()
    header = next(line for line in markdown.splitlines() if line.startswith("| arm"))
    assert all(column in header for column in COMPARISON_COLUMNS)
    assert "| bucketed | 2 |" in markdown and "(1 partial)" in markdown and "±" in markdown
    assert "5 run(s) (1 partial) in 3 setting(s)" in printed.err
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


@pytest.mark.integration
def test_module_entry_point_runs(multirun, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dflash_lab.compare", str(multirun), "--out", str(tmp_path / "o"), "--no-plots"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "## Per setting" in result.stdout


# ------------------------------------------------------------------------------------------ arms, baseline, strata
@pytest.fixture
def ablation(tmp_path):
    """Arms of the forgetting ablation, 3 seeds each: full_random, bucketed, bucketed run_length=8 and
    bucket_sequential on aligned data, full_random and bucket_sequential on independent data. Planted: every
    bucketed arm is 5 Ktok/s faster than full_random, bucket_sequential 8; the seed adds 0.1 x seed to every arm."""
    root = tmp_path / "multirun" / "ablation"
    arms = [("full_random", {}, 0.0), ("bucketed", {}, 5.0), ("bucketed", {"sampler.run_length": 8}, 5.0),
            ("bucket_sequential", {}, 8.0)]
    job = 0
    for skills in ("aligned", "independent"):
        for sampler, settings, faster in arms:
            if skills == "independent" and sampler == "bucketed":
                continue
            for seed in range(3):
                write_run(root / f"{job}_{sampler}_s{seed}", sampler, seed, effects={"ktok_s": faster},
                          settings={"data.band_skills": skills, **settings})
                job += 1
    return root


def test_arms_are_settings_and_pairs_stay_inside_their_stratum(ablation, tmp_path):
    out = tmp_path / "out"
    assert compare.main([str(ablation), "--out", str(out), "--no-plots", "--baseline", "full_random"]) == 0
    groups = pd.read_csv(out / "comparison_groups.csv", index_col="arm")
    assert sorted(groups.index) == [
        "bucket_sequential band_skills=aligned", "bucket_sequential band_skills=independent",
        "bucketed band_skills=aligned", "bucketed run_length=8 band_skills=aligned",
        "full_random band_skills=aligned", "full_random band_skills=independent"]
    assert set(groups["data.band_skills"]) == {"aligned", "independent"}
    assert (groups["n_runs"] == 3).all() and (groups["seeds"] == "0 1 2").all()
    paired = pd.read_csv(out / "paired.csv")
    assert list(paired.columns[:8]) == ["policy", "endpoint", "diff", "ci_low", "ci_high", "p_value", "p_holm",
                                        "verdict"]
    ktok = paired[paired["endpoint"] == "ktok_s"].set_index("policy")
    assert ktok.loc["bucket_sequential band_skills=independent", "baseline"] == "full_random band_skills=independent"
    assert ktok.loc["bucketed run_length=8 band_skills=aligned", "baseline"] == "full_random band_skills=aligned"
    assert ktok.loc["bucketed band_skills=aligned", "diff"] == pytest.approx(5.0)  # the seed effect cancels
    assert ktok.loc["bucket_sequential band_skills=aligned", "diff"] == pytest.approx(8.0)
    assert (ktok["n_pairs"] == 3).all() and np.allclose(ktok["p_value"], 0.25)  # 2 / 2^3
    assert set(paired["policy"]) == set(groups.index) - {"full_random band_skills=aligned",
                                                         "full_random band_skills=independent"}
    markdown = (out / "comparison.md").read_text()
    assert "## Paired differences vs baseline `full_random`" in markdown
    assert "p_t" in markdown and "mdd" in markdown and "seeds" in markdown
    exact = tmp_path / "exact"
    assert compare.main([str(ablation), "--out", str(exact), "--no-plots", "--baseline", "full_random",
                         "--test", "sign_flip"]) == 0
    # the exact test: 3 seeds and 6 endpoints cannot reach p_holm < 0.05, and the note says how many seeds would
    assert "'better'/'worse' need >= 8 seeds" in (exact / "comparison.md").read_text()


def test_a_baseline_selector_can_compare_data_settings_within_each_sampler(ablation, tmp_path):
    out = tmp_path / "out"
    code = compare.main([str(ablation), "--out", str(out), "--no-plots", "--baseline", "data.band_skills=aligned",
                         "--endpoints", "ktok_s"])
    assert code == 0
    paired = pd.read_csv(out / "paired.csv").set_index("policy")
    # strata are now the sampler settings: independent data compared with aligned data of the same arm
    assert paired.loc["full_random band_skills=independent", "baseline"] == "full_random band_skills=aligned"
    assert paired.loc["bucket_sequential band_skills=independent", "diff"] == pytest.approx(0.0, abs=1e-9)
    assert "bucketed run_length=8" not in paired.index.str.cat()  # an arm without an independent twin has no pair


def test_ambiguous_or_unknown_baselines_are_refused_with_the_fix(ablation, tmp_path, capsys):
    assert compare.main([str(ablation), "--out", str(tmp_path / "o"), "--no-plots", "--baseline", "bucketed"]) == 0
    paired = pd.read_csv(tmp_path / "o" / "paired.csv")
    # plain bucketed (fewest overridden compared keys) is the baseline, not bucketed run_length=8
    assert set(paired["baseline"]) == {"bucketed band_skills=aligned"}
    code = compare.main([str(ablation), "--out", str(tmp_path / "o"), "--no-plots", "--baseline",
                         "trainer.lr=0.1"])
    assert code == 2 and "not a swept key" in capsys.readouterr().err
    code = compare.main([str(ablation), "--out", str(tmp_path / "o"), "--no-plots", "--margins", "jumpines=0.1"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown endpoint 'jumpines'" in err


def test_the_sweep_declares_the_protocol_before_the_runs(tmp_path):
    root = tmp_path / "m"
    analysis = {"baseline": "full_random", "endpoints": ["ktok_s", "probe_loss_at_tokens"],
                "margins": {"probe_loss_at_tokens": 0.5}, "cost": {"c0": 0.01, "c1": 1e-5}, "test": "sign_flip"}
    for sampler in ("full_random", "bucketed"):
        for seed in range(7):
            write_run(root / f"{sampler}_{seed}", sampler, seed, analysis=analysis,
                      effects={"ktok_s": 5.0 if sampler == "bucketed" else 0.0})
    out = tmp_path / "out"
    assert compare.main([str(root), "--out", str(out), "--no-plots"]) == 0
    paired = pd.read_csv(out / "paired.csv").set_index("endpoint")
    assert list(paired.index) == ["ktok_s", "probe_loss_at_tokens"]
    # the declared exact test: 7 seeds, 2 endpoints
    assert paired.loc["ktok_s", "p_holm"] == pytest.approx(2 * 2 / 2**7)
    assert (paired["test"] == "sign_flip").all()
    assert paired.loc["ktok_s", "verdict"] == "better"
    assert paired.loc["probe_loss_at_tokens", "verdict"] == "equivalent"  # same curves up to noise, margin 0.5
    runs = pd.read_csv(out / "comparison.csv")
    assert runs["probe_loss_at_time"].notna().all() and runs["modelled_time_s"].gt(0).all()
    # a run of another sweep with another declaration cannot be mixed in silently
    write_run(root / "other", "bucketed", 9, analysis={**analysis, "baseline": "bucketed"})
    assert compare.main([str(root), "--out", str(out), "--no-plots"]) == 2
    assert compare.main([str(root), "--out", str(out), "--no-plots", "--baseline", "full_random"]) == 0


def test_a_boundaries_sweep_gives_one_row_per_boundary_list(tmp_path):
    root = tmp_path / "boundaries_grid"
    for job, boundaries in enumerate([[0, 96, 1024], [0, 216, 1024], [0, 96, 216, 1024]]):
        write_run(root / f"{job}_bucketed_s0", "bucketed", 0, settings={"sampler.boundaries": boundaries})
    out = tmp_path / "out"
    assert compare.main([str(root), "--out", str(out)]) == 0
    groups = pd.read_csv(out / "comparison_groups.csv")
    assert groups["boundaries"].tolist() == ["[0, 96, 1024]", "[0, 216, 1024]", "[0, 96, 216, 1024]"]
    assert groups["K"].tolist() == [2, 2, 3]
    assert (out / "tradeoff.png").read_bytes()[:4] == b"\x89PNG"


def test_a_grid_sweep_pairs_its_arms_with_its_first_point(tmp_path):
    """Issue 31: a grid sweep declares analysis.baseline=first (sweeps/boundaries_grid.yaml): every other grid
    point is paired with job 0's, whatever lists the command line gave; paired.csv is written."""
    root = tmp_path / "boundaries_grid"
    lists = [[0, 216, 1024], [0, 96, 1024], [0, 96, 216, 1024]]
    for job, (seed, boundaries) in enumerate((s, b) for s in (0, 1, 2) for b in lists):
        write_run(root / f"{job}_bucketed_b{'-'.join(map(str, boundaries))}_s{seed}", "bucketed", seed,
                  settings={"sampler.boundaries": boundaries}, analysis={"baseline": "first"})
    out = tmp_path / "out"
    assert compare.main([str(root), "--out", str(out), "--no-plots"]) == 0
    paired = pd.read_csv(out / "paired.csv")
    assert set(paired["baseline"]) == {"bucketed boundaries=[0, 216, 1024]"}
    assert set(paired["policy"]) == {"bucketed boundaries=[0, 96, 1024]", "bucketed boundaries=[0, 96, 216, 1024]"}
    assert "baseline: the sweep's first point (sampler=bucketed,sampler.boundaries=[0, 216, 1024])" in (
        out / "comparison.md").read_text()


def test_compare_names_the_jobs_of_a_killed_sweep_that_never_started(tmp_path):
    """Issue 31: a sweep killed mid-way; Hydra's multirun.yaml says what it planned, the job folders what ran."""
    import yaml

    root = tmp_path / "sweep"
    for job, (sampler, seed) in enumerate([("bucketed", 0), ("bucketed", 1), ("full_random", 0)]):
        write_run(root / f"{job}_{sampler}_s{seed}", sampler, seed)
    (root / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"params": None}, "overrides": {"task": ["sampler=bucketed,full_random", "seed=0,1",
                                                             "trainer.max_steps=40"]}}}))
    out = tmp_path / "out"
    assert compare.main([str(root), "--out", str(out), "--no-plots"]) == 0
    note = (f"sweep {root}: 1 of 4 jobs never started: job 3 (sampler=full_random seed=1); relaunch the same "
            f"command with hydra.sweep.dir={root} to run them (finished jobs say nothing to do)")
    assert note in (out / "comparison.md").read_text()


def test_the_shipped_grid_sweeps_declare_their_first_point_as_baseline():
    from hydra import compose, initialize_config_module

    for name in ("boundaries_grid", "bucket_count_grid"):
        with initialize_config_module("dflash_lab.conf", version_base="1.3"):   # sweeps: the search-path plugin
            assert compose(name).analysis.baseline == "first", name


@pytest.mark.integration
def test_help_documents_the_baseline_selector_and_strata():
    result = subprocess.run([sys.executable, "-m", "dflash_lab.compare", "--help"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0
    for phrase in ("--baseline", "strata", "sign-flip", "--margins", "--cost", "comparison_groups.csv",
                   "paired.csv"):
        assert phrase in result.stdout, phrase


def test_two_options_of_a_config_group_with_one_name_are_two_arms():
    """A variant defined as its own sampler file (conf/sampler/full_random_equal.yaml, name: full_random) is a
    different setting from plain full_random, although both report the sampler name full_random."""
    from dflash_lab.analysis.arms import arm_label, pair_arms, sweep_of
    from dflash_lab.analysis.schema import RunRecord

    records = [RunRecord(f"{option}{seed}", "local", "/nonexistent", config={"sampler": {"name": "full_random"}},
                         overrides=[f"sampler={option}", f"seed={seed}"])
               for option in ("full_random", "full_random_equal") for seed in (0, 1)]
    sweep = sweep_of(records)
    labels = sweep.values.apply(arm_label, axis=1)
    assert sorted(set(labels)) == ["full_random", "full_random_equal"]
    assert set(pair_arms(sweep, labels, "full_random").arms["baseline"]) == {"full_random"}


def test_arm_files_of_a_sweep_expand_into_the_keys_they_set():
    """`+arm=<file>` names no config key: the arms are the config differences (sampler options, data skills),
    a key that restates another (the target's pretraining skills) is dropped, and strata follow the data."""
    from dflash_lab.analysis.arms import sweep_of
    from dflash_lab.analysis.schema import RunRecord

    def run(i, arm, sampler, skills, **options):
        config = {"sampler": {"name": sampler, **options}, "data": {"band_skills": skills},
                  "model": {"pretrain_data": {"band_skills": skills}}, "seed": i % 2}
        return RunRecord(f"{arm}{i}", "wandb", "x", config=config, overrides=[f"+arm={arm}", f"seed={i % 2}"])

    records = [run(i, arm, s, d, **o) for i in range(2) for arm, s, d, o in [
        ("a_fr", "full_random", "aligned", {"real_tokens_per_step": None}),
        ("a_fr_eq", "full_random", "aligned", {"real_tokens_per_step": 3098}),
        ("a_bk8", "bucketed", "aligned", {"run_length": 8}),
        ("a_bk", "bucketed", "aligned", {"run_length": 1}),
        ("i_fr", "full_random", "independent", {"real_tokens_per_step": None})]]
    sweep = sweep_of(records)
    assert sweep.keys == ["sampler", "sampler.real_tokens_per_step", "sampler.run_length", "data.band_skills"]
    assert sweep.source == "overrides+config"
    assert sweep.values.loc["a_bk80", "sampler.run_length"] == "8"


def test_a_sweep_is_judged_by_the_protocol_it_recorded_at_launch(tmp_path, capsys):
    """protocol.json in the sweep folder fixes the rules: a sweep recorded under rules version 2 is judged by the
    exact sign-flip test and each run's own steady state, whatever today's defaults, and compare says so; a sweep
    recorded today is judged by today's rules; runs without a record are judged by today's rules, with a note."""
    import json

    from dflash_lab.analysis import protocol as protocol_module

    root = tmp_path / "m"
    analysis = {"baseline": "full_random", "endpoints": ["ktok_s"]}
    for sampler in ("full_random", "bucketed"):
        for seed in range(5):
            write_run(root / f"{sampler}_{seed}", sampler, seed, analysis=analysis,
                      effects={"ktok_s": 5.0 if sampler == "bucketed" else 0.0})
    recorded = protocol_module.protocol_record(analysis)
    old = {**recorded, "rules_version": 2, "rules": protocol_module.RULES[2]}
    (root / "protocol.json").write_text(json.dumps(old))
    out = tmp_path / "old"
    assert compare.main([str(root), "--out", str(out), "--no-plots"]) == 0
    paired = pd.read_csv(out / "paired.csv")
    assert (paired["test"] == "sign_flip").all()   # version 2: the exact test, 2/32 at 5 seeds: inconclusive
    assert paired.loc[0, "verdict"] == "inconclusive"
    notes = (out / "comparison.md").read_text()
    assert "protocol: as recorded at launch" in notes and "rules version 2" in notes
    assert f"today's rules (version {protocol_module.RULES_VERSION})" in notes

    (root / "protocol.json").write_text(json.dumps(recorded))   # recorded under today's rules
    out = tmp_path / "today"
    assert compare.main([str(root), "--out", str(out), "--no-plots"]) == 0
    paired = pd.read_csv(out / "paired.csv")
    assert (paired["test"] == "t").all() and paired.loc[0, "verdict"] == "better"
    notes = (out / "comparison.md").read_text()
    assert f"rules version {protocol_module.RULES_VERSION}" in notes and "answer differently" not in notes

    (root / "protocol.json").unlink()
    out = tmp_path / "none"
    assert compare.main([str(root), "--out", str(out), "--no-plots"]) == 0
    assert "protocol: none recorded at launch" in (out / "comparison.md").read_text()
