"""The verdict is judged by what was frozen at launch and by finished runs only (hand-made run directories):
protocol.json's analysis section applies (an override on the command line is flagged, with both answers), failed
or missing runs are left out and named, and a zero-variance endpoint never passes an equivalence test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

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
    """Someone edits the analysis section every run's config records (after the launch)."""
    for path in root.glob("*/run_config.json"):
        data = json.loads(path.read_text())
        data["config"]["analysis"] = analysis
        path.write_text(json.dumps(data))


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
