"""dflash_lab.run_logger: metrics.jsonl fields, buffered writes, resume truncation, summary, W&B guard."""

from __future__ import annotations

import json
import math

import pytest

from dflash_lab import run_logger as rl


def _row(step: int, **over):
    row = {name: 1.0 for name in rl.METRIC_FIELDS}
    row.update(step=step, **over)
    return row


def test_metrics_rows_have_exactly_the_contract_fields(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True)
    logger.log_step({**_row(1), "extra_field": 3})
    assert not logger.metrics_path.exists()  # buffered: no per-step file I/O
    logger.flush()
    rows = [json.loads(line) for line in logger.metrics_path.read_text().splitlines()]
    assert list(rows[0]) == list(rl.METRIC_FIELDS)


def test_missing_field_is_an_error(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True)
    row = _row(1)
    del row["pad_eff"]
    with pytest.raises(KeyError, match="pad_eff"):
        logger.log_step(row)


def test_non_finite_values_become_null(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True)
    logger.log_step(_row(1, loss=math.nan, grad_norm=math.inf))
    logger.close()
    row = json.loads(logger.metrics_path.read_text())
    assert row["loss"] is None and row["grad_norm"] is None


def test_other_ranks_write_nothing(tmp_path):
    logger = rl.RunLogger(tmp_path / "r1", is_main=False)
    logger.log_step(_row(1))
    logger.write_summary({"status": "finished"})
    logger.close()
    assert not (tmp_path / "r1").exists()


def test_truncate_after_resume_point(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True)
    for step in range(1, 6):
        logger.log_step(_row(step))
    logger.log_probes([{"step": s, "band": 0, "band_lo": 0, "band_hi": 96, "loss": 1.0, "acc": 0.5, "tokens": 3}
                       for s in (0, 5)])
    logger.close()
    with open(logger.metrics_path, "a") as handle:
        handle.write('{"step": 6, "lo')  # a line torn by a kill
    logger.truncate_after(3)
    steps = [json.loads(line)["step"] for line in logger.metrics_path.read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert [json.loads(line)["step"] for line in logger.probes_path.read_text().splitlines()] == [0]


def test_summary_orders_contract_fields_and_checks_status(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True)
    logger.write_summary({"status": "finished", "tau": 1.5, "extra": 1, "final_loss": math.nan})
    data = json.loads(logger.summary_path.read_text())
    assert list(data)[: len(rl.SUMMARY_FIELDS)] == list(rl.SUMMARY_FIELDS)
    assert data["tau"] == 1.5 and data["final_loss"] is None and data["extra"] == 1
    with pytest.raises(ValueError, match="status"):
        logger.write_summary({"status": "done"})


def test_run_id_persists(tmp_path):
    first = rl.load_or_create_run_id(tmp_path)
    assert rl.load_or_create_run_id(tmp_path) == first
    assert rl.load_or_create_run_id(tmp_path, from_checkpoint="abc123") == "abc123"
    assert (tmp_path / "wandb_run_id.txt").read_text().strip() == "abc123"


WANDB_SETTINGS = {"kind": "wandb", "mode": "offline", "project": "dflash_lab_test", "entity": None,
                  "group": "tests", "job_type": "bucketed", "name": "unit", "tags": ["t"]}


def test_wandb_offline_writes_files_and_same_metric_names(tmp_path):
    logger = rl.RunLogger(tmp_path, is_main=True, wandb_settings=WANDB_SETTINGS, config={"seed": 0}, run_id="unit01")
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
        logger = rl.RunLogger(tmp_path, is_main=True, wandb_settings=WANDB_SETTINGS, config={}, run_id="x")
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

    logger = rl.RunLogger(tmp_path, is_main=True)
    sink = rl.WandbSink.__new__(rl.WandbSink)
    sink.log, sink.failed, sink.run_id, sink.run = logger.log, False, "x", FailingRun()
    failing = sink.run
    logger.wandb = sink
    with pytest.warns(RuntimeWarning, match="W&B log failed"):
        logger.log_step(_row(1))
    logger.log_step(_row(2))  # no second warning, no second call
    logger.close()
    assert failing.calls == 1 and not sink.active
    assert len(logger.metrics_path.read_text().splitlines()) == 2
