"""dflash_lab.records.run_logger + dflash_lab.records.record: row fields, immediate appends, the one resume rule, summary, W&B guard."""

from __future__ import annotations

import json
import math

import pytest

from dflash_lab.records import record
from dflash_lab.records import run_logger as rl
from dflash_lab.records.run_dir import RunRecordsAtRisk, check_records_cover


def _row(step: int, **over):
    row = {name: 1.0 for name in record.STEP_FIELDS}
    row.update(step=step, **over)
    return row


def test_metrics_rows_have_exactly_the_contract_fields_and_reach_disk_at_once(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None)
    logger.log_step({**_row(1), "extra_field": 3})
    rows = [json.loads(line) for line in logger.metrics_path.read_text().splitlines()]  # no close: already there
    assert list(rows[0]) == list(record.STEP_FIELDS)


def test_missing_field_is_an_error(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None)
    row = _row(1)
    del row["pad_eff"]
    with pytest.raises(KeyError, match="pad_eff"):
        logger.log_step(row)


def test_non_finite_values_become_null(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None)
    logger.log_step(_row(1, loss=math.nan, grad_norm=math.inf))
    logger.close()
    row = json.loads(logger.metrics_path.read_text())
    assert row["loss"] is None and row["grad_norm"] is None


def test_other_ranks_write_nothing(tmp_path):
    logger = rl.RunLogger(tmp_path / "r1", is_main=False, resume_step=None)
    logger.log_step(_row(1))
    logger.write_summary({"status": "finished"})
    logger.close()
    assert not (tmp_path / "r1").exists()


def test_resume_keeps_rows_through_the_checkpoint_step_and_skips_bad_lines(tmp_path, caplog):
    logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None)
    for step in range(1, 6):
        logger.log_step(_row(step))
    logger.log_probes([{"step": s, "band": 0, "band_lo": 0, "band_hi": 96, "loss": 1.0, "acc": 0.5, "tokens": 3}
                       for s in (0, 5)])
    logger.close()
    with open(logger.metrics_path, "a") as handle:
        handle.write('123\n{"step": "abc"}\n{"step": 1e308}\n{"step": 6, "lo')  # junk and a line torn by a kill
    with caplog.at_level("INFO", logger="dflash_lab"):
        resumed = rl.RunLogger(tmp_path, is_main=True, resume_step=3)
    assert [json.loads(line)["step"] for line in resumed.metrics_path.read_text().splitlines()] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in resumed.probes_path.read_text().splitlines()] == [0]
    assert [r["step"] for r in resumed.history] == [1, 2, 3] and resumed.probed_steps == {0}
    assert "skipped 4 unusable line(s)" in caplog.text


def test_fresh_start_keeps_no_rows_of_an_earlier_attempt(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None)
    logger.log_step(_row(1))
    again = rl.RunLogger(tmp_path, is_main=True, resume_step=None)  # e.g. killed before its first checkpoint
    assert again.metrics_path.read_text() == "" and again.history == []


def test_a_read_only_resume_changes_no_file_until_it_starts(tmp_path):
    """The trainer checks the records before it writes any: read_only reads the rows the resume keeps and leaves the
    files as they are (a refused resume changes nothing); start() then trims them."""
    logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None)
    for step in range(1, 6):
        logger.log_step(_row(step))
    with open(logger.metrics_path, "a") as handle:
        handle.write('{"step": 6, "lo')   # torn by a kill
    before = logger.metrics_path.read_bytes()
    resumed = rl.RunLogger(tmp_path, is_main=True, resume_step=3, read_only=True)
    assert [r["step"] for r in resumed.history] == [1, 2, 3]
    assert resumed.unusable_lines == {record.METRICS_FILE: [(6, "not JSON (e.g. a line torn by a kill)")]}
    assert logger.metrics_path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        record.METRICS_FILE]
    resumed.start()
    assert [json.loads(line)["step"] for line in resumed.metrics_path.read_text().splitlines()] == [1, 2, 3]


def _check_resume(run_dir, step: int) -> None:
    """The resume check of ``run_dir``'s records at the checkpoint of ``step``, as the trainer runs it."""
    logger = rl.RunLogger(run_dir, is_main=True, resume_step=step, read_only=True)
    check_records_cover(step, logger.history, logger.probed_steps, None, None, tau_steps=logger.tau_steps,
                        probe_bands=logger.probe_bands, incomplete_rows=logger.incomplete_rows,
                        mistyped_rows=logger.mistyped_rows, unusable_lines=logger.unusable_lines)


@pytest.mark.parametrize("file, change, refusal", [
    (record.METRICS_FILE, {"loss": [1.5, 2.0]},
     "metrics.jsonl's row of step 2 holds loss [1.5, 2.0] where the trainer writes a number or null"),
    (record.METRICS_FILE, {"epoch": "0", "clipped": 1},
     'metrics.jsonl holds values of another type than the trainer writes: step 2 holds epoch "0" (a number or null), '
     "clipped 1 (true, false or null)"),
    (record.METRICS_FILE, {"step": "2"},
     'metrics.jsonl holds 2 of the 3 steps up to it (missing [2]); metrics.jsonl line 2 is read as no row: its step '
     '"2" is not a step number (an integer >= 0)'),
    (record.PROBES_FILE, {"band": [0]}, "probes.jsonl's row of step 2 holds band [0] where the trainer writes a "
                                        "number or null"),
    (record.TAU_FILE, {"tau_by_band": "1.5"}, 'tau.jsonl\'s row of step 2 holds tau_by_band "1.5" where the trainer '
                                              "writes a list of numbers and nulls"),
])
def test_resume_refuses_a_value_of_another_type_naming_the_file_row_and_column(tmp_path, file, change, refusal):
    """The check read the columns of each row but not their values: a loss that is a list passed (and the summary or
    the analysis computed with it); a step that is a string was read as no row without a word on which line."""
    logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None)
    for step in (1, 2, 3):
        logger.log_step(_row(step, clipped=False))
        logger.log_probes([{"step": step, "band": 0, "band_lo": 0, "band_hi": 96, "loss": 1.0, "acc": 0.5,
                            "tokens": 3}])
        logger.log_tau({"step": step, "tau": 1.5, "tau_se": 0.1, "tau_prompts": 2, "tau_band_min": 1.5,
                        "tau_band_mean": 1.5, "tau_by_band": [1.5, None]})
    _check_resume(tmp_path, 3)   # the records as written pass
    path = tmp_path / file
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), **change})
    path.write_text("\n".join(lines) + "\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(RunRecordsAtRisk) as refused:
        _check_resume(tmp_path, 3)
    message = str(refused.value)
    assert message.startswith(f"resume from the checkpoint of step 3: {refusal}") and message.endswith(
        "restore them (e.g. from a backup of the run directory), or start a fresh run directory "
        "(hydra.run.dir=<new dir>)"), message
    assert "\n" not in message and {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def _stats(**over):
    values = {name: 1.0 for name in record.STEP_STAT_RULES}
    values.update(over)
    return record.StepStats(**values)


def _six_steps(wall_time_s: float, world_size: int = 1, segments: int = 1):
    """Plan facts, step rows, totals and identity of a run of 6 steps over 2 epochs of 3."""
    plan = record.PlanFacts(steps_per_epoch=(3, 3), batches_per_epoch=(3, 3), end_step=6)
    rows = [record.step_row(step=s, epoch=0, stats=_stats(), lr=1e-3, grad_clip=1.0, bucket=0, step_time_s=0.1,
                            compute_time_s=0.05, eta_s=0.0) for s in range(1, 7)]
    totals = record.RunTotals(wall_time_s=wall_time_s, setup_time_s=0.1, compute_time_s=0.3, data_wait_time_s=0.1,
                              eval_time_s=0.25, checkpoint_time_s=0.05, segments=segments)
    identity = {"sampler": "bucketed", "seed": 0, "epochs": 2, "world_size": world_size}
    return plan, rows, totals, identity


def test_summary_orders_contract_fields_and_keeps_totals_of_all_segments():
    plan, rows, totals, identity = _six_steps(1.0, segments=2)
    summary = record.build_summary(rows, plan, totals, identity=identity, status="finished")
    assert list(summary)[: len(record.SUMMARY_FIELDS)] == list(record.SUMMARY_FIELDS)
    assert summary["steps"] == 6 and summary["steps_per_epoch"] == [3, 3] and summary["segments"] == 2
    parts = ("setup", "compute", "data_wait", "eval", "checkpoint", "other")
    assert sum(summary[f"{p}_time_s"] for p in parts) == pytest.approx(summary["wall_time_s"])   # they add up
    assert summary["other_time_s"] == pytest.approx(0.2)
    assert summary["overhead_frac"] == pytest.approx(0.5) and summary["eval_frac"] == pytest.approx(0.25)
    assert summary["full_run_eta_s"] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="status"):
        record.build_summary(rows, plan, totals, identity=identity, status="done")


def test_the_exit_line_of_a_rank_without_the_metric_history_names_rank_0_instead_of_a_nan_loss():
    """Only rank 0 keeps the metric history: rank 1's summary (built from none, as a DDP run's rank 1 builds it)
    holds NaN loss and throughput, so its exit line says where they are instead of printing them."""
    from dflash_lab.train import exit_line
    from dflash_lab.training.dist import DistEnv

    plan, rows, totals, identity = _six_steps(7.0, world_size=2)
    rank_1 = record.build_summary([], plan, totals, identity=identity, status="finished", steps=6)
    assert math.isnan(rank_1["final_loss"])   # why its line cannot state the loss
    line = exit_line("finished", 6, 6, rank_1, DistEnv(rank=1, world_size=2))
    assert "nan" not in line.lower() and "loss" in line
    assert line.startswith("finished: step 6/6 on rank 1 of 2, 7 s;") and "rank 0's log line and summary.json" in line
    rank_0 = record.build_summary(rows, plan, totals, identity=identity, status="finished",
                                   extra={"tau": 2.5, "tau_baseline": 1.1})
    line = exit_line("finished", 6, 6, rank_0, DistEnv(rank=0, world_size=2))
    assert line.startswith(f"finished: step 6/6, loss {rank_0['final_loss']:.4f}, acc ") and "rank" not in line
    assert line.endswith("tau 2.500 (untrained 1.100)")


def test_the_exit_line_of_a_run_that_measured_no_tau_says_why_instead_of_a_nan_tau():
    """trainer.measure_tau=false (or a failed run) leaves tau NaN in the summary: the exit line says tau was not
    measured and why, not 'tau nan (untrained nan)' that reads like a broken measurement."""
    from dflash_lab.train import exit_line
    from dflash_lab.training.dist import DistEnv

    plan, rows, totals, identity = _six_steps(7.0)
    summary = record.build_summary(rows, plan, totals, identity=identity, status="finished")
    assert math.isnan(summary["tau"])   # what the line would print
    line = exit_line("finished", 6, 6, summary, DistEnv(), tau_not_measured="trainer.measure_tau=false")
    assert line.endswith(", tau not measured (trainer.measure_tau=false)") and "nan" not in line.lower()


def test_step_stats_reduce_by_their_rules():
    import numpy as np

    names = list(record.STEP_STAT_RULES)
    per_rank = np.array([[float(i + 1)] * len(names) for i in range(3)])
    stats = record.reduce_step_stats(per_rank)
    assert stats.real_tokens == 6.0 and stats.max_len == 3.0 and stats.grad_norm == 1.0
    assert stats.stop_requested == 3.0 and stats.loss == pytest.approx(1.0)


def test_write_summary_is_atomic_json_with_nulls(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None)
    logger.write_summary({"status": "finished", "tau": 1.5, "final_loss": math.nan})
    data = json.loads(logger.summary_path.read_text())
    assert data["tau"] == 1.5 and data["final_loss"] is None and not list(tmp_path.glob("*.tmp"))


def test_run_id_persists(tmp_path):
    first = rl.load_or_create_run_id(tmp_path)
    assert rl.load_or_create_run_id(tmp_path) == first
    assert rl.load_or_create_run_id(tmp_path, from_checkpoint="abc123") == "abc123"
    assert (tmp_path / "wandb_run_id.txt").read_text().strip() == "abc123"


WANDB_SETTINGS = {"kind": "wandb", "mode": "offline", "project": "dflash_lab_test", "entity": None,
                  "group": "tests", "job_type": "bucketed", "name": "unit", "tags": ["t"]}


@pytest.mark.integration
def test_wandb_offline_writes_files_and_same_metric_names(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None, wandb_settings=WANDB_SETTINGS, config={"seed": 0},
                          run_id="unit01")
    assert logger.wandb is not None and logger.wandb.active, "W&B offline init failed"
    logger.log_step(_row(1))
    logger.write_summary({"status": "finished"})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*-unit01"))
    assert runs and list(runs[0].glob("run-unit01.wandb"))
    attached = {p.name for p in (runs[0] / "files").iterdir()}
    assert {"metrics.jsonl", "summary.json"} <= attached
    assert (tmp_path / "metrics.jsonl").is_file()


def test_broken_wandb_init_warns_once_and_keeps_local_files(tmp_path, monkeypatch):
    import wandb

    def boom(**kwargs):
        raise RuntimeError("no network")

    monkeypatch.setattr(wandb, "init", boom)
    with pytest.warns(RuntimeWarning, match="W&B init failed"):
        logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None, wandb_settings=WANDB_SETTINGS, config={},
                              run_id="x")
    logger.log_step(_row(1))
    logger.close()
    assert len(logger.metrics_path.read_text().splitlines()) == 1


def test_broken_wandb_log_disables_wandb(tmp_path):
    class FailingRun:
        def __init__(self):
            self.calls = 0

        def log(self, row):
            self.calls += 1
            raise OSError("disk full")

    logger = rl.RunLogger(tmp_path, is_main=True, resume_step=None)
    sink = rl.WandbSink.__new__(rl.WandbSink)
    sink.log, sink.failed, sink.run = logger.log, False, FailingRun()
    failing = sink.run
    logger.wandb = sink
    with pytest.warns(RuntimeWarning, match="W&B log failed"):
        logger.log_step(_row(1))
    logger.log_step(_row(2))  # no second warning, no second call
    logger.close()
    assert failing.calls == 1 and not sink.active
    assert len(logger.metrics_path.read_text().splitlines()) == 2


def test_without_a_terminal_a_progress_line_comes_every_n_steps_and_every_n_seconds():
    """Issue 31: a slow run in a Slurm log shows life within trainer.log_every_s (30 s in the preset), not only
    every trainer.log_every steps (the first line came ~4 minutes in on a busy machine)."""
    import logging
    from types import SimpleNamespace

    from dflash_lab.training.run_records import StepClock

    now = [0.0]
    lines = []
    log = logging.getLogger("test-step-clock")
    log.addHandler(type("Keep", (logging.Handler,), {"emit": lambda self, r: lines.append(r.getMessage())})())
    log.setLevel(logging.INFO)
    clock = StepClock(200, 0, show_bar=False, log_every=50, name="bucketed", log=log, log_every_s=30.0,
                      clock=lambda: now[0])
    stats = SimpleNamespace(loss=2.5, acc=0.1)
    logged = []
    for step in range(1, 201):
        now[0] += 7.0   # one step every 7 s: 50 steps take 350 s
        lines.clear()
        clock.show({"step": step, "epoch": 0, "ktok_s": 1.0, "eta_s": 60.0, "pad_eff": 0.8}, stats)
        logged += [step] * len(lines)
    assert logged[:3] == [5, 10, 15]          # 35 s, then every 35 s: never more than 30 s without a line
    assert 50 in logged and 200 in logged
    assert all(b - a <= 5 for a, b in zip(logged, logged[1:]))
    quiet = StepClock(200, 0, show_bar=False, log_every=50, name="bucketed", log=log, log_every_s=0.0,
                      clock=lambda: now[0])
    assert [s for s in range(1, 201) if quiet.line_due(s)] == [50, 100, 150, 200]   # 0: steps only
