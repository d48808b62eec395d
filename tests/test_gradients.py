"""The warmup and the gradient scale: the gradient norm and clip fraction per bucket and phase (one definition,
dflash_lab/metrics/gradients.py, read by the trainer's summary.json and by compare), and the probe evaluations
inside the LR warmup (probes.warmup_evals)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from helpers import SHORT_CLI, train_cli

from dflash_lab import compare
from dflash_lab.analysis.schema import RunRecord
from dflash_lab.analysis.summarize import GRADIENT_TABLE_COLUMNS, regular_probes, run_gradients
from dflash_lab.metrics import forgetting
from dflash_lab.metrics.gradients import gradient_stats, warmup_probe_steps
from dflash_lab.records import record
from dflash_lab.training.evaluation import Evaluation
from dflash_lab.training.step import LRSchedule


def _rows(norms_by_bucket: dict[int, list[float]], max_len: int = 50) -> list[dict]:
    """Metrics rows whose steps take the buckets in turn (bucket b's i-th norm at the i-th visit)."""
    rows, step = [], 0
    for i in range(max(len(v) for v in norms_by_bucket.values())):
        for bucket, norms in norms_by_bucket.items():
            if i < len(norms):
                step += 1
                rows.append({"step": step, "grad_norm": norms[i], "bucket": bucket, "max_len": max_len})
    return rows


def test_gradient_norm_and_clip_fraction_per_bucket_and_phase():
    # steps 1..4 are the warmup (W = 4): bucket 0 takes steps 1, 3, 5, 7; bucket 1 takes 2, 4, 6, 8
    rows = _rows({0: [0.5, 0.7, 0.9, 0.3], 1: [1.5, 0.8, 2.0, 1.2]})
    rows.append({"step": 9, "grad_norm": None, "bucket": 1, "max_len": 50})   # a skipped update: left out
    table = {(r["bucket"], r["phase"]): r for r in gradient_stats(rows, warmup=4, grad_clip=1.0, bands=None)}
    assert list(table) == [(0, "warmup"), (0, "after"), (1, "warmup"), (1, "after")]
    assert table[(0, "warmup")] == {"bucket": 0, "phase": "warmup", "steps": 2, "grad_norm_mean": pytest.approx(0.6),
                                    "grad_norm_median": pytest.approx(0.6), "clip_frac": 0.0}
    assert table[(1, "warmup")]["clip_frac"] == 0.5 and table[(1, "after")]["clip_frac"] == 1.0
    assert table[(1, "after")]["steps"] == 2 and table[(1, "after")]["grad_norm_median"] == pytest.approx(1.6)
    # grad_clip 0: no clipping, the norms are still summarised
    assert {r["clip_frac"] for r in gradient_stats(rows, warmup=4, grad_clip=0.0, bands=None)} == {0.0}


def test_a_policy_without_buckets_is_grouped_by_the_probe_band_of_its_longest_document():
    rows = [{"step": 1, "grad_norm": 2.0, "bucket": -1, "max_len": 50},
            {"step": 2, "grad_norm": 1.0, "bucket": -1, "max_len": 500},
            {"step": 3, "grad_norm": 3.0, "bucket": -1, "max_len": 600}]
    table = gradient_stats(rows, warmup=1, grad_clip=1.5, bands=[0, 96, 1024])
    assert [(r["bucket"], r["phase"], r["steps"], r["clip_frac"]) for r in table] == [
        (0, "warmup", 1, 1.0), (1, "after", 2, 0.5)]


def test_a_row_that_recorded_its_clipping_is_read_as_recorded():
    """A resumed run may change trainer.grad_clip: each row's own ``clipped`` is what happened to it."""
    rows = [{"step": 1, "grad_norm": 2.0, "bucket": 0, "max_len": 9, "clipped": False},
            {"step": 2, "grad_norm": 2.0, "bucket": 0, "max_len": 9}]
    assert gradient_stats(rows, warmup=0, grad_clip=1.0, bands=None)[0]["clip_frac"] == 0.5


def test_the_warmup_is_the_lr_schedules_own():
    schedule = LRSchedule(peak_lr=1.0, total_steps=390, warmup_frac=0.04, min_lr_ratio=0.1)
    rising = [s for s in range(390) if schedule.lr(s) < 1.0 and schedule.lr(s) < schedule.lr(s + 1)]
    assert schedule.warmup_steps == 16 and rising == list(range(15))   # update 16 (after 15 steps) reaches the peak
    assert schedule.lr(schedule.warmup_steps - 1) == 1.0


def test_older_runs_get_the_same_table_from_their_metrics_rows():
    """A run whose summary.json predates ``gradients``: computed from metrics.jsonl with the run's W (the LR
    schedule's rule on trainer.warmup_frac and end_step) and trainer.grad_clip."""
    rows = _rows({0: [0.5, 0.7, 0.9, 0.3, 1.4], 2: [1.5, 0.8, 2.0, 1.2, 1.1]})
    steps = pd.DataFrame(rows)
    old = RunRecord("r", "local", "/r", config={"trainer": {"warmup_frac": 0.4, "grad_clip": 1.0}},
                    summary={"status": "finished", "end_step": 10, "boundaries": [0, 96, 152, 1024]}, steps=steps)
    table, grouped = run_gradients(old)
    assert grouped == "bucket" and table == gradient_stats(rows, warmup=4, grad_clip=1.0, bands=None)


def _evaluation(every: int, warmup: int, evals: int, last_probe_step: int | None, probed: list[int]) -> Evaluation:
    """An Evaluation whose probe sets only record the steps they were evaluated at (no model, no data)."""
    evaluation = Evaluation.__new__(Evaluation)

    class ProbeSets:
        def evaluate(self, evaluate_batch, step, seed):
            probed.append(step)
            return []

    evaluation.settings = type("Probes", (), {"every": every, "seed": 0})()
    evaluation.warmup_probe_steps = frozenset(warmup_probe_steps(warmup, evals))
    evaluation.probe_sets, evaluation.evaluate_batch, evaluation.tau_every = ProbeSets(), None, 0
    evaluation.last_probe_step, evaluation.is_main, evaluation.model = last_probe_step, True, torch.nn.Linear(1, 1)
    evaluation.ledger, evaluation.log_probes = record.TimeLedger(record.RunTotals(), start=0.0), lambda rows: None
    return evaluation


def _probe_run(evaluation: Evaluation, start: int, stop: int, end_step: int) -> None:
    """The trainer's calls: after each step, and the final probe when the run ends."""
    for step in range(start + 1, stop + 1):
        evaluation.after_step(step, end_step)
    if stop == end_step:
        evaluation.probe(end_step)


def test_the_warmup_gets_its_evaluations_once_each_across_a_resume():
    """The protocol's schedule (W = 16 of 390 steps, probes.every=15): 4 evaluations inside the warmup besides the
    regular ones, none repeated, and a run resumed from a checkpoint inside the warmup probes the same steps."""
    probed: list[int] = []
    evaluation = _evaluation(15, 16, 4, None, probed)
    evaluation.probe(0)
    _probe_run(evaluation, 0, 390, 390)
    inside = [step for step in probed if 0 < step <= 16]
    assert inside == [4, 8, 12, 15, 16] and len(probed) == len(set(probed))
    assert [step for step in probed if step not in (4, 8, 12, 16)] == list(range(0, 391, 15))
    resumed: list[int] = []
    before = _evaluation(15, 16, 4, None, resumed)
    before.probe(0)
    _probe_run(before, 0, 8, 390)   # checkpoint at step 8, just probed; the resumed run knows it
    _probe_run(_evaluation(15, 16, 4, before.last_probe_step, resumed), 8, 390, 390)
    assert resumed == probed
    off: list[int] = []
    _probe_run(_evaluation(0, 16, 4, None, off), 0, 40, 41)   # probes.every=0: probes are off, warmup ones too
    assert off == []


def test_the_warmup_evaluations_stay_out_of_the_forgetting_figures():
    """band_forgetting averages over every eval it is given: the warmup's extra evals would change it."""
    grid = pd.DataFrame({"step": [0, 15, 30, 45], "band": 0, "acc": [0.1, 0.5, 0.4, 0.6]})
    extra = pd.DataFrame({"step": [4, 8, 12, 16], "band": 0, "acc": [0.2, 0.3, 0.4, 0.5]})
    probes = pd.concat([grid, extra]).sort_values("step")
    run = RunRecord("r", "local", "/r", config={"probes": {"every": 15, "warmup_evals": 4}},
                    summary={"warmup_steps": 16})
    kept = regular_probes(probes, run)
    assert sorted(kept["step"]) == [0, 15, 30, 45]
    assert (forgetting.band_forgetting_table(kept)["forgetting"].tolist()
            == forgetting.band_forgetting_table(grid)["forgetting"].tolist()
            != forgetting.band_forgetting_table(probes)["forgetting"].tolist())


@pytest.mark.integration
def test_a_run_reports_its_gradients_by_bucket_and_phase_and_compare_tables_them(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = train_cli(f"hydra.run.dir={run_dir}", *SHORT_CLI, "sampler=bucketed", "trainer.warmup_frac=0.4",
                       "probes.warmup_evals=4")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["warmup_steps"] == 12   # round(0.4 x 30)
    gradients = summary["gradients"]
    assert gradients["grouped_by"] == "bucket" and gradients["grad_clip"] == 1.0
    assert {row["phase"] for row in gradients["rows"]} == {"warmup", "after"}
    assert sum(row["steps"] for row in gradients["rows"] if row["phase"] == "warmup") == 12
    assert sum(row["steps"] for row in gradients["rows"]) == 30
    steps, _ = record.read_jsonl(run_dir / record.METRICS_FILE)
    assert all(row["clipped"] == (row["grad_norm"] > 1.0) for row in steps)
    clipped = sum(row["clipped"] for row in steps)
    assert sum(row["clip_frac"] * row["steps"] for row in gradients["rows"]) == pytest.approx(clipped)
    probes, _ = record.read_jsonl(run_dir / record.PROBES_FILE)
    keys = [(row["step"], row["band"]) for row in probes]
    assert len(keys) == len(set(keys))
    assert sorted({step for step, _ in keys}) == [0, 3, 6, 9, 10, 12, 20, 30]   # 4 inside the warmup of 12
    assert compare.main([str(run_dir), "--out", str(out), "--no-plots"]) == 0
    table = pd.read_csv(out / "gradients.csv")
    assert table.columns.tolist() == list(GRADIENT_TABLE_COLUMNS)
    assert set(table["phase"]) == {"warmup", "after"} and table["steps"].sum() == 30
    markdown = (out / "comparison.md").read_text()
    assert "## Gradient norm by bucket and phase" in markdown and "| bucketed | bucket " in markdown
