"""The verdict is judged by what was frozen at launch and by finished runs only (hand-made run directories):
protocol.json's analysis section applies (an override on the command line is flagged, with both answers), failed
or missing runs are left out and named, and a zero-variance endpoint never passes an equivalence test."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from dflash_lab import compare
from dflash_lab.analysis import protocol as protocol_module
from helpers import write_run

VERDICT = {"endpoint": "final_loss", "positive_control": "bucket_sequential", "negative_control": "packed",
           "question": "bucketed"}
ANALYSIS = {"baseline": "full_random", "endpoints": ["final_loss"], "margins": {"final_loss": 0.01},
            "verdict": VERDICT}
EFFECTS = {"full_random": 0.0, "bucket_sequential": 0.5, "packed": 0.0, "bucketed": 0.02}


def verdict_sweep(root: Path, seeds: int = 5, analysis: dict | None = None, recorded: bool = True,
                  skip: tuple[tuple[str, int], ...] = ()) -> Path:
    """A sweep of four arms x `seeds` (the positive control planted +0.5 final loss), its protocol.json recorded
    at launch with `analysis`; runs in `skip` were never written."""
    analysis = ANALYSIS if analysis is None else analysis
    for sampler, effect in EFFECTS.items():
        for seed in range(seeds):
            if (sampler, seed) not in skip:
                write_run(root / f"{sampler}_s{seed}", sampler, seed, analysis=analysis, run_record=True,
                          effects={"final_loss": effect}, probes=False, presentations=False, steps=30)
    if recorded:
        (root / "protocol.json").write_text(json.dumps(protocol_module.protocol_record(analysis)))
    return root


def run_compare(root: Path, out: Path, *options: str) -> dict:
    assert compare.main([str(root), "--out", str(out), "--no-plots", *options]) == 0
    return json.loads((out / "verdict.json").read_text())


def _edit_run_sections(root: Path, analysis: dict) -> None:
    """Someone edits the analysis section in every run's config files (its record and Hydra's) after the launch."""
    for path in root.glob("*/run_config.json"):
        data = json.loads(path.read_text())
        data["config"]["analysis"] = analysis
        path.write_text(json.dumps(data))
    for path in root.glob("*/.hydra/config.yaml"):
        config = yaml.safe_load(path.read_text())
        config["analysis"] = analysis
        path.write_text(yaml.safe_dump(config))


# --------------------------------------------------------------------------------------------- item 2: protocol
def test_the_protocol_frozen_at_launch_is_applied_not_the_runs_edited_sections(tmp_path):
    root = verdict_sweep(tmp_path / "sweep")
    launch = run_compare(root, tmp_path / "launch")
    assert launch["valid"] and not launch["answer"].startswith("equivalent")   # margin 0.01: too wide an interval
    _edit_run_sections(root, {**ANALYSIS, "margins": {"final_loss": 1.0}})
    edited = run_compare(root, tmp_path / "edited")
    assert edited["answer"] == launch["answer"]
    assert edited["launch_protocol"] == {"applied": True}
    notes = (tmp_path / "edited" / "comparison.md").read_text()
    assert "differs from the sweep's protocol.json" in notes and "protocol.json, frozen at launch, applies" in notes


def test_a_command_line_override_changes_the_answer_only_with_a_note_and_both_answers(tmp_path, capsys):
    root = verdict_sweep(tmp_path / "sweep")
    launch = run_compare(root, tmp_path / "launch")
    overridden = run_compare(root, tmp_path / "overridden", "--margins", "final_loss=1.0")
    assert overridden["answer"].startswith("equivalent") and overridden["answer"] != launch["answer"]
    entry = overridden["launch_protocol"]
    assert entry["applied"] is False and entry["answer"] == launch["answer"]
    assert entry["overridden_answer"] == overridden["answer"]
    assert entry["overridden"] == {"margins": {"launch": {"final_loss": 0.01}, "applied": {"final_loss": 1.0}}}
    notes = (tmp_path / "overridden" / "comparison.md").read_text().split("## Notes")[1].strip().splitlines()
    assert notes[0].startswith("- protocol overridden on the command line: --margins")
    assert "NOT the launch protocol's" in notes[0] and launch["answer"] in notes[0]
    assert "NOT the launch protocol's verdict" in capsys.readouterr().out
    # the same value as the launch protocol's is no override
    same = run_compare(root, tmp_path / "same", "--margins", "final_loss=0.01")
    assert same["launch_protocol"] == {"applied": True} and same["answer"] == launch["answer"]


@pytest.mark.parametrize("content, expected", [
    ('{"declared": {}}', "holds no rules_version"),
    ("{not json", "cannot be read as JSON"),
    ('{"rules_version": 99, "declared": {}}', "rules_version 99 is unknown"),
])
def test_a_damaged_protocol_record_is_a_one_line_refusal(tmp_path, capsys, content, expected):
    root = verdict_sweep(tmp_path / "sweep", seeds=2)
    (root / "protocol.json").write_text(content)
    assert compare.main([str(root), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0] and "Traceback" not in err[0]


# ------------------------------------------------------------------------------ item 4: failed / missing runs
def _fail(run_dir: Path, error: str = "step 17: non-finite loss (nan)") -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(status="failed", error=error)
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_a_failed_run_is_left_out_of_the_pairs_and_named(tmp_path):
    root = verdict_sweep(tmp_path / "sweep")
    _fail(root / "bucketed_s4")
    verdict = run_compare(root, tmp_path / "out")
    question = next(row for row in verdict["bucketed_vs_full_random"] if row["endpoint"] == "final_loss")
    assert question["n_pairs"] == 4 and verdict["seeds"] == 4
    assert verdict["positive_control"]["n_pairs"] == 5
    paired = pd.read_csv(tmp_path / "out" / "paired.csv").set_index("policy")
    assert paired.loc["bucketed", "n_pairs"] == 4 and paired.loc["bucketed", "seeds"] == "0 1 2 3"
    assert verdict["left_out"] == [{"run": "bucketed_s4", "arm": "bucketed", "seed": 4, "status": "failed",
                                    "reason": "failed: step 17: non-finite loss (nan)"}]
    assert verdict["missing"] == ["seed 4 of bucketed (question): failed: step 17: non-finite loss (nan)"]
    assert "missing from the pairs: seed 4 of bucketed" in verdict["answer"]
    notes = (tmp_path / "out" / "comparison.md").read_text()
    assert "use finished runs only; left out: bucketed_s4 (bucketed seed 4): failed: step 17" in notes


def test_a_control_with_one_seed_names_the_missing_seeds_instead_of_a_nan_interval(tmp_path):
    root = verdict_sweep(tmp_path / "sweep", skip=tuple(("bucket_sequential", seed) for seed in (1, 2, 3)))
    _fail(root / "bucket_sequential_s4")
    verdict = run_compare(root, tmp_path / "out")
    assert not verdict["valid"] and "[nan, nan]" not in verdict["answer"] and "did not show" not in verdict["answer"]
    assert verdict["answer"].startswith("inconclusive: too few finished seed pairs for an interval (at least 2): "
                                        "the positive control (bucket_sequential) has 1")
    assert verdict["missing"][:4] == [f"seed {seed} of bucket_sequential (positive control): no run"
                                      for seed in (1, 2, 3)] + [
        "seed 4 of bucket_sequential (positive control): failed: step 17: non-finite loss (nan)"]


@pytest.mark.parametrize("negative, expected", [
    ("packed", "the negative control arm (packed) is missing: no loaded run matches it"),
    ("sampler=packed,data.band_skills=independent", "the negative control arm (sampler=packed,"
     "data.band_skills=independent) is missing: no loaded run has data.band_skills=independent (they hold aligned)"),
])
def test_a_missing_arm_gives_an_inconclusive_verdict_that_names_it(tmp_path, negative, expected):
    analysis = {**ANALYSIS, "verdict": {**VERDICT, "negative_control": negative}}
    root = verdict_sweep(tmp_path / "sweep", analysis=analysis,
                         skip=tuple(("packed", seed) for seed in range(5)))
    for path in root.glob("*/run_config.json"):   # every run trained on aligned data (not a swept key)
        data = json.loads(path.read_text())
        data["config"]["data"]["band_skills"] = "aligned"
        path.write_text(json.dumps(data))
    verdict = run_compare(root, tmp_path / "out")
    assert not verdict["valid"] and verdict["answer"].startswith(f"inconclusive: {expected}")
    assert verdict["arms"]["negative_control"] is None and "selector" not in verdict["answer"]
    assert "verdict.json not written" not in (tmp_path / "out" / "comparison.md").read_text()


# ---------------------------------------------------------------------------------- item 11: decided rules
def test_runs_of_one_arm_from_two_launches_are_pooled_with_a_note(tmp_path):
    for folder, seeds in (("launch_a", (0, 1)), ("launch_b", (2, 3))):
        for sampler in ("bucketed", "full_random"):
            for seed in seeds:
                write_run(tmp_path / folder / f"{sampler}_s{seed}", sampler, seed, run_record=True, probes=False,
                          presentations=False, steps=30)
    out = tmp_path / "out"
    assert compare.main([str(tmp_path / "launch_a"), str(tmp_path / "launch_b"), "--out", str(out), "--no-plots",
                         "--baseline", "full_random"]) == 0
    notes = (out / "comparison.md").read_text()
    assert (f"arm 'bucketed' pools the runs of 2 launches ({tmp_path / 'launch_a'}: seeds 0 1; "
            f"{tmp_path / 'launch_b'}: seeds 2 3) as seeds of one arm") in notes
    assert pd.read_csv(out / "paired.csv")["n_pairs"].eq(4).all()


def test_identical_values_on_every_seed_never_pass_the_equivalence_test(tmp_path):
    """tau measured identically on every seed (a zero-width interval) is no evidence of equivalence."""
    root = tmp_path / "sweep"
    for sampler in ("bucketed", "full_random"):
        for seed in range(5):
            write_run(root / f"{sampler}_s{seed}", sampler, seed, run_record=True, probes=False,
                      presentations=False, steps=30)
    out = tmp_path / "out"
    assert compare.main([str(root), "--out", str(out), "--no-plots", "--baseline", "full_random", "--endpoints",
                         "tau", "--margins", "tau=0.5"]) == 0
    row = pd.read_csv(out / "paired.csv").iloc[0]
    assert row["endpoint"] == "tau" and row["diff"] == 0 and row["ci_low"] == row["ci_high"] == 0
    assert row["verdict"] == "inconclusive" and pd.isna(row["p_tost"])
    assert "bucketed, tau: every one of the 5 seed pairs differs by exactly +0 (zero variance)" in (
        out / "comparison.md").read_text()
