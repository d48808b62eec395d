"""Loading runs into the common schema: hand-made run directories (CONTRACTS.md format), bad input, W&B mapping."""

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dflash_lab.analysis import compare_records, load_runs, markdown_tables
from dflash_lab.analysis.local import find_run_dirs, load_local_run
from dflash_lab.analysis.summarize import analyse_run
from dflash_lab.analysis.schema import (
    NUMERIC_RUN_COLUMNS,
    PROBE_COLUMNS,
    RUN_COLUMNS,
    STEP_COLUMNS,
    RunRecord,
)
from dflash_lab.analysis.wandb_runs import OfflineRun, load_wandb_runs, wandb_run_to_record

from helpers import BANDS, write_run  # noqa: F401  (other test modules import write_run from here)


@pytest.fixture
def multirun(tmp_path):
    root = tmp_path / "multirun" / "2026-12-02_10-00-00"
    write_run(root / "0_bucketed_s0", "bucketed", 0)
    write_run(root / "1_bucketed_s1", "bucketed", 1)
    write_run(root / "2_full_random_s0", "full_random", 0)
    write_run(root / "3_full_random_s1", "full_random", 1, summary=False, torn_tail=True)  # crashed
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return tmp_path / "multirun"


def test_multirun_expands_to_its_runs_and_does_not_descend_into_runs(multirun):
    (multirun / "2026-12-02_10-00-00" / "0_bucketed_s0" / "checkpoints" / "inner" / ".hydra").mkdir(parents=True)
    runs = find_run_dirs(multirun)
    assert [r.name for r in runs] == ["0_bucketed_s0", "1_bucketed_s1", "2_full_random_s0", "3_full_random_s1"]
    assert find_run_dirs(runs[0]) == [runs[0]]


def test_local_run_matches_the_contract_schema(multirun):
    record = load_local_run(find_run_dirs(multirun)[0])
    assert tuple(record.steps.columns[: len(STEP_COLUMNS)]) == STEP_COLUMNS
    assert tuple(record.probes.columns[: len(PROBE_COLUMNS)]) == PROBE_COLUMNS
    assert len(record.steps) == 120 and len(record.presentations) == 120
    assert (record.sampler, record.seed, record.status, record.partial) == ("bucketed", 0, "finished", False)
    assert record.group == "test_ablation"


def test_crashed_run_is_included_marked_partial_with_figures_from_metrics(multirun):
    record = load_local_run(find_run_dirs(multirun)[3])
    assert record.status == "no_summary" and record.partial
    assert any("no summary.json" in m for m in record.messages)
    assert any("skipped 1 unusable line" in m for m in record.messages)
    assert record.sampler == "full_random" and record.seed == 1  # from .hydra/config.yaml
    row = compare_records([record]).runs.iloc[0]
    assert bool(row["partial"])
    assert row["ktok_s"] == pytest.approx(np.median(record.steps["ktok_s"].to_numpy()[10:]))
    assert row["pad_eff"] == pytest.approx(0.75)
    assert row["final_loss"] == pytest.approx(record.steps["loss"].iloc[-1])
    assert np.isnan(row["tau"])


def test_running_summary_is_partial_and_falls_back_to_metrics(tmp_path):
    run = write_run(tmp_path / "run", "packed", 0, summary=False)
    (run / "summary.json").write_text(json.dumps({"sampler": "packed", "seed": 0, "steps": 40, "status": "running"}))
    row = compare_records(load_runs([run]).runs).runs.iloc[0]
    assert row["status"] == "running" and bool(row["partial"])
    assert np.isfinite(row["ktok_s"]) and np.isfinite(row["final_loss"])


def test_a_truncated_summary_is_reported_as_such_not_as_missing(tmp_path):
    """Issue 31: a summary.json cut short (a kill while it was copied, a full disk) is named as unreadable, never
    as "no summary.json"; the run is partial and left out of pairs with that reason."""
    from dflash_lab.analysis.summarize import left_out_reason

    run = write_run(tmp_path / "run", "packed", 0)
    text = (run / "summary.json").read_text()
    (run / "summary.json").write_text(text[: len(text) // 2])
    record = load_runs([run]).runs[0]
    assert record.status == "summary_unreadable" and record.partial and record.sampler == "packed"
    assert not any(m.startswith("no summary.json") for m in record.messages)
    assert any(m.startswith("summary.json is not valid JSON") and "truncated or damaged" in m
               for m in record.messages)
    assert left_out_reason(record).startswith("summary.json unreadable (truncated or not JSON)")
    row = compare_records([record]).runs.iloc[0]
    assert row["status"] == "summary_unreadable" and bool(row["partial"]) and np.isfinite(row["final_loss"])


def test_a_folder_of_symbolic_links_to_runs_is_read_and_a_broken_link_is_named(tmp_path):
    """Issue 31: a folder of links to runs kept elsewhere finds them; a link whose target is gone is named."""
    kept = tmp_path / "kept"
    runs = [write_run(kept / f"{job}_bucketed_s{job}", "bucketed", job) for job in range(2)]
    links = tmp_path / "links"
    links.mkdir()
    for run in runs:
        (links / run.name).symlink_to(run)
    (links / "loop").symlink_to(links)          # a link back up the tree is visited once
    report = load_runs([links])
    assert sorted(r.run_id for r in report.runs) == [run.name for run in runs] and not report.problems
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "2_bucketed_s2").symlink_to(tmp_path / "moved_away")
    (problem,) = load_runs([broken]).problems
    assert "1 symbolic link(s) to a missing target (2_bucketed_s2 -> " in problem and "moved_away" in problem


def test_bad_paths_are_reported_not_raised(tmp_path, multirun):
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("hello")
    report = load_runs([tmp_path / "missing", not_a_run, multirun])
    assert len(report.runs) == 4
    assert any("does not exist" in p for p in report.problems)
    assert any("not a run directory" in p for p in report.problems)


def test_runs_with_different_metric_sets_compare_without_crash(tmp_path):
    full = write_run(tmp_path / "a" / "full", "bucketed", 0)
    bare = write_run(
        tmp_path / "a" / "bare", "sorted_static", 0, probes=False, presentations=False,
        drop_fields=("mean_len", "max_len", "bucket", "ktok_s"),
    )
    comparison = compare_records(load_runs([full.parent]).runs)
    runs = comparison.runs.set_index("sampler")
    assert list(comparison.runs.columns) == list(RUN_COLUMNS)
    assert np.isfinite(runs.loc["bucketed", "length_r2"])
    assert np.isnan(runs.loc["sorted_static", "length_r2"])
    assert np.isnan(runs.loc["sorted_static", "band_forgetting"])
    assert np.isfinite(runs.loc["sorted_static", "jumpiness"])
    assert "metrics.jsonl lacks max_len, mean_len, bucket, ktok_s" in runs.loc["sorted_static", "notes"]
    assert bare.name in markdown_tables(comparison)


def test_every_comparison_column_is_filled_for_complete_runs(multirun):
    comparison = compare_records(load_runs([multirun]).runs)
    finished = comparison.runs[~comparison.runs["partial"]]
    shuffled_only = {"loop_score", "loop_lag_evals", "order_period_steps"}  # periodic orders only
    no_cost_model = {"modelled_time_s", "probe_loss_at_time"}
    no_target = {"steps_to_target", "tokens_to_target", "time_to_target"}   # analysis.target: none declared
    given_target = {"target_seed"}   # these runs record no tiny-target pretraining seed (as model=hf runs)
    for column in NUMERIC_RUN_COLUMNS:
        if column not in shuffled_only | no_cost_model | no_target | given_target:
            assert finished[column].notna().all(), (column, finished["notes"].tolist())
    for column in shuffled_only | no_cost_model | no_target | given_target:
        assert finished[column].isna().all(), column
    groups = comparison.groups
    assert groups.loc["bucketed", "n_runs"] == 2 and groups.loc["bucketed", "seeds"] == "0 1"
    assert groups.loc["full_random", "n_partial"] == 1
    assert groups.loc["bucketed", "pad_eff_std"] == pytest.approx(0.0)
    assert not comparison.bands.empty and set(comparison.bands["band"]) == {0, 1, 2}
    assert {"residual_amplitude", "loop", "own_share_slope", "forgetting"} <= set(comparison.bands.columns)
    assert set(comparison.cross.columns) >= {"train_band", "probe_band", "cross_effect", "run_id", "arm"}
    assert comparison.paired.empty  # no baseline declared or given


def test_steady_state_start_and_forgetting_window_follow_the_loss_descent(multirun):
    from dflash_lab.analysis.protocol import default_protocol

    records = load_runs([multirun]).runs
    row = compare_records(records, protocol=replace(default_protocol(), window="steady")).runs.iloc[0]
    # loss 3 exp(-step / 20) + 1: 90% of the EMA's descent is covered near step 20 ln 10 = 46, plus the EMA's lag
    assert 40 <= row["steady_start_step"] <= 65
    evals_after = len(range(0, 121, 5)) - int(np.ceil(row["steady_start_step"] / 5))
    assert row["forgetting_window_evals"] == evals_after
    assert row["real_tokens_total"] == 120 * 3000


def test_the_protocol_window_starts_every_run_at_the_same_share_of_its_end_step(multirun):
    """analysis.window (default 0.25): the window starts after 25% of the run's end step, whatever its loss does,
    so arms are measured over the same steps."""
    from dflash_lab.analysis.protocol import default_protocol

    records = load_runs([multirun]).runs
    row = compare_records(records).runs.iloc[0]          # today's default: 0.25 of 120 steps
    assert row["steady_start_step"] == 31                # the first logged step after step 30
    assert row["forgetting_window_evals"] == len(range(35, 121, 5))
    later = compare_records(records, protocol=replace(default_protocol(), window=0.5)).runs.iloc[0]
    assert later["steady_start_step"] == 61 and later["forgetting_window_evals"] == len(range(65, 121, 5))


def test_a_periodic_order_gets_a_loop_score_and_a_shuffled_one_does_not(tmp_path):
    write_run(tmp_path / "m" / "0", "bucket_sequential", 0, steps=240)
    write_run(tmp_path / "m" / "1", "bucketed", 0, steps=240)
    runs = compare_records(load_runs([tmp_path / "m"]).runs).runs.set_index("sampler")
    assert runs.loc["bucket_sequential", "order_period_steps"] == 80  # 240 steps in 3 logged epochs
    assert runs.loc["bucket_sequential", "loop_lag_evals"] == 16  # 80 steps / an eval every 5
    assert np.isfinite(runs.loc["bucket_sequential", "loop_score"])
    assert np.isnan(runs.loc["bucketed", "loop_score"]) and np.isnan(runs.loc["bucketed", "order_period_steps"])


def test_duplicate_run_names_from_two_multiruns_stay_distinct(tmp_path):
    write_run(tmp_path / "m1" / "0_bucketed_s0", "bucketed", 0)
    write_run(tmp_path / "m2" / "0_bucketed_s0", "bucketed", 1)  # one name, another seed (one seed: duplicates)
    runs = compare_records(load_runs([tmp_path / "m1", tmp_path / "m2"]).runs).runs
    assert runs["run_id"].is_unique


# ------------------------------------------------------------------------------------------------------------ W&B
class FakeSummary(dict):
    """wandb's HTTPSummary exposes the raw values as _json_dict."""

    @property
    def _json_dict(self):
        return dict(self)


class FakePublicRun:
    """Shaped like wandb.apis.public.Run: id, name, group, path, config, summary, history()."""

    def __init__(self, history: pd.DataFrame, summary: dict, config: dict):
        self.id, self.name, self.group = "x1y2z3", "bucketed_s3", "ablation_policies"
        self.path = ["me", "dflash_lab", "x1y2z3"]
        self.config = config
        self.summary = FakeSummary(summary)
        self._history = history

    def history(self, samples=500, pandas=True):
        return self._history.head(samples)


def _history_like_run_logger(steps: int = 60) -> pd.DataFrame:
    """W&B history as RunLogger writes it: step rows with the metric names, probe rows probe/<band>/<loss|acc>."""
    rows = []
    for step in range(1, steps + 1):
        rows.append({"step": step, "loss": 2.0 + 1.0 / step, "acc": 0.01 * step, "ktok_s": 20.0, "mean_len": 100.0,
                     "max_len": 140, "bucket": step % 3, "real_tokens": 900, "padded_tokens": 1000})
        if step % 10 == 0:
            rows.append({"step": step, **{f"probe/{b}/loss": 3.0 - 0.01 * step - b for b in range(2)},
                         **{f"probe/{b}/acc": 0.005 * step + 0.1 * b for b in range(2)}})
    history = pd.DataFrame(rows)
    history["_step"] = np.arange(len(history))
    history["_runtime"] = 1.0
    return history


def test_fake_public_run_maps_to_the_schema():
    config = {"sampler": {"value": {"name": "bucketed", "max_tokens": 4096}}, "seed": {"value": 3}, "_wandb": {}}
    summary = {"sampler": "bucketed", "seed": 3, "ktok_s": 21.5, "final_loss": 2.1, "tau": 2.2, "status": "finished",
               "_runtime": 12.0, "loss": 2.0}
    record = wandb_run_to_record(FakePublicRun(_history_like_run_logger(), summary, config))
    assert record.source == "wandb" and record.location == "me/dflash_lab/x1y2z3"
    assert record.group == "ablation_policies" and record.run_id == "x1y2z3"
    assert record.config == {"sampler": {"name": "bucketed", "max_tokens": 4096}, "seed": 3}
    assert (record.sampler, record.seed, record.status) == ("bucketed", 3, "finished")
    assert "_runtime" not in record.summary
    # all 60 step rows (the adapter asks for every row, not wandb's default 500-row sample) and only those
    assert record.steps["step"].tolist() == list(range(1, 61))
    assert tuple(record.steps.columns[: len(STEP_COLUMNS)]) == STEP_COLUMNS
    assert record.probes[["step", "band"]].to_numpy().tolist()[:2] == [[10, 0], [10, 1]]
    at_step_30 = record.probes[(record.probes.step == 30) & (record.probes.band == 1)]
    assert at_step_30["loss"].item() == pytest.approx(1.7)
    row = compare_records([record]).runs.iloc[0]
    assert row["ktok_s"] == 21.5 and np.isfinite(row["jumpiness"]) and np.isfinite(row["band_forgetting"])
    assert "no presentations.parquet" in row["notes"]


def test_wandb_run_without_final_figures_is_partial():
    record = wandb_run_to_record(FakePublicRun(_history_like_run_logger(), {"loss": 2.0, "_step": 5}, {}))
    assert record.partial and record.status == "no_summary"
    assert any("partial run" in m for m in record.messages)


def test_wandb_api_errors_become_problems():
    class BrokenApi:
        def runs(self, path, filters=None):
            raise ConnectionError("no network")

    report = load_wandb_runs("me/dflash_lab", "g", api=BrokenApi())
    assert report.runs == [] and "cannot list runs" in report.problems[0]

    class Api:
        def __init__(self):
            self.filters = None

        def runs(self, path, filters=None):
            self.filters = filters
            return [FakePublicRun(_history_like_run_logger(), {"final_loss": 1.0}, {"seed": 0})]

    api = Api()
    report = load_runs(wandb="me/dflash_lab", group="ablation_policies", api=api)
    assert api.filters == {"group": "ablation_policies"} and len(report.runs) == 1


def _real_run_with_offline_wandb(run_dir: Path, steps: int = 40) -> Path:
    """Write a run with the trainer's own RunLogger and W&B in offline mode (local files and W&B side by side)."""
    from dflash_lab.records.record import STEP_FIELDS as METRIC_FIELDS
    from dflash_lab.records.run_logger import RunLogger

    config = {"sampler": {"name": "bucketed"}, "seed": 5, "experiment": "offline_test"}
    logger = RunLogger(
        run_dir, is_main=True, resume_step=None, config=config, run_id="offl1234",
        wandb_settings={"mode": "offline", "project": "dflash_lab_test", "group": "offline_test",
                        "job_type": "bucketed", "name": "bucketed_s5"},
    )
    assert logger.wandb is not None and logger.wandb.active
    rng = np.random.default_rng(0)
    for step in range(1, steps + 1):
        row = {name: 1 for name in METRIC_FIELDS}
        row.update(step=step, loss=2.0 + 1.0 / step + 0.01 * rng.standard_normal(), ktok_s=10.0 + step % 3,
                   mean_len=float(rng.uniform(20, 400)), bucket=step % 2)
        logger.log_step(row)
        if step % 5 == 0:
            logger.log_probes([{"step": step, "band": b, "band_lo": BANDS[b], "band_hi": BANDS[b + 1],
                                "loss": 3.0 - 0.02 * step, "acc": 0.01 * step, "tokens": 8} for b in range(2)])
    logger.write_summary({"sampler": "bucketed", "seed": 5, "steps": steps, "ktok_s": 11.0, "pad_eff": 0.8,
                          "final_loss": 2.05, "final_acc": 0.4, "tau": 1.9, "status": "finished",
                          "target_digest": "0123456789abcdef", "data_digest": "f" * 32})
    logger.close()
    return run_dir


@pytest.mark.integration
def test_offline_wandb_run_reads_back_to_the_same_schema_as_the_local_files(tmp_path):
    run_dir = _real_run_with_offline_wandb(tmp_path / "run")
    offline_dirs = OfflineRun.find(run_dir / "wandb")
    assert len(offline_dirs) == 1
    # wandb.finish() may return before wandb-core has flushed the last block of the offline log: wait for it
    deadline = time.monotonic() + 30
    offline = OfflineRun(offline_dirs[0])
    while not offline.complete and time.monotonic() < deadline:
        time.sleep(0.2)
        offline = OfflineRun(offline_dirs[0])
    assert offline.complete, "the offline W&B log never received its exit record"
    assert (offline.id, offline.group, offline.name) == ("offl1234", "offline_test", "bucketed_s5")
    from_wandb = wandb_run_to_record(offline, "wandb_offline")
    local = load_local_run(run_dir)
    assert from_wandb.sampler == local.sampler == "bucketed" and from_wandb.seed == local.seed == 5
    assert from_wandb.status == "finished", (from_wandb.messages, offline.summary)
    assert from_wandb.summary["tau"] == local.summary["tau"]
    for digest in ("target_digest", "data_digest"):   # compare checks W&B runs' digests as it does local ones'
        assert from_wandb.summary[digest] == local.summary[digest]
    pd.testing.assert_series_equal(from_wandb.steps["loss"], local.steps["loss"], check_names=False)
    assert from_wandb.steps["step"].tolist() == local.steps["step"].tolist()
    merged = local.probes.merge(from_wandb.probes, on=["step", "band"], suffixes=("_local", "_wandb"))
    assert len(merged) == len(local.probes) == 16
    assert np.allclose(merged["loss_local"], merged["loss_wandb"])
    assert np.allclose(merged["acc_local"], merged["acc_wandb"])
    # the offline folder is also accepted directly as a compare PATH
    report = load_runs([run_dir / "wandb"], offline_wandb=True)
    assert [r.source for r in report.runs] == ["wandb_offline"]
    # a log cut short (crash, or read while still being written) is read up to the cut and flagged
    torn = tmp_path / "torn" / offline_dirs[0].name
    torn.mkdir(parents=True)
    log = next(offline_dirs[0].glob("*.wandb"))
    (torn / log.name).write_bytes(log.read_bytes()[: len(log.read_bytes()) * 2 // 3])
    torn_record = wandb_run_to_record(OfflineRun(torn), "wandb_offline")
    assert not OfflineRun(torn).complete and any("no exit record" in m for m in torn_record.messages)
    assert 0 < len(torn_record.steps) < len(local.steps)
    # the run directory itself is one local run: the copies in wandb/offline-run-*/files/ are not a second one
    assert [(r.source, r.run_id) for r in load_runs([run_dir.parent]).runs] == [("local", "run")]
    # the same run read twice is one run, not two seeds: compared side by side run by run, not as one arm
    with pytest.raises(ValueError, match="not two seeds"):
        compare_records([local, from_wandb])
    rows = pd.DataFrame([analyse_run(r).row for r in (local, from_wandb)]).set_index("source")
    for column in ("jumpiness", "band_forgetting", "loop_score", "ktok_s"):
        assert rows.loc["local", column] == pytest.approx(rows.loc["wandb_offline", column], nan_ok=True)


def test_record_defaults_are_schema_shaped():
    record = RunRecord(run_id="r", source="local", location="r")
    assert tuple(record.steps.columns) == STEP_COLUMNS and record.steps.empty
    assert record.partial and record.sampler is None and record.seed is None


# ------------------------------------------------------------------------------------------------- W&B sweeps
def _wandb_sweep_run(run_id: str, sampler: str, seed: int, config_extra: dict, with_overrides: bool):
    config = {"sampler": {"value": {"name": sampler, "max_tokens": 4096, **config_extra.get("sampler", {})}},
              "seed": {"value": seed}, "run_dir": {"value": f"/runs/{run_id}"}, "experiment": {"value": "sweep"},
              "data": {"value": {"name": "synthetic", **config_extra.get("data", {})}}}
    if sampler == "bucketed":
        config["sampler"]["value"]["boundaries"] = [0, 96, 1024]  # a key full_random has no use for
    if with_overrides:
        config["overrides"] = {"value": [f"sampler={sampler}", f"seed={seed}"]
                               + [f"{group}.{k}={v}" for group, keys in config_extra.items() for k, v in keys.items()]}
    run = FakePublicRun(_history_like_run_logger(), {"final_loss": 2.0, "status": "finished"}, config)
    run.id = run.name = run_id
    return wandb_run_to_record(run)


@pytest.mark.parametrize("with_overrides", [True, False])
def test_wandb_sweep_runs_group_into_arms_from_their_configs(with_overrides):
    """A W&B sweep: bucketed / full_random x data.band_skills, two seeds each. With the overrides the trainer logs,
    or, without them, from the differences between the run configs, the arms are the same four settings."""
    records = [
        _wandb_sweep_run(f"{sampler[0]}{skills[0]}{seed}", sampler, seed, {"data": {"band_skills": skills}},
                         with_overrides)
        for sampler in ("bucketed", "full_random") for skills in ("aligned", "independent") for seed in (0, 1)
    ]
    comparison = compare_records(records)
    assert comparison.swept == ["sampler", "data.band_skills"]
    assert sorted(comparison.groups.index) == [
        "bucketed band_skills=aligned", "bucketed band_skills=independent",
        "full_random band_skills=aligned", "full_random band_skills=independent"]
    assert (comparison.groups["n_runs"] == 2).all()
    assert "boundaries" not in comparison.runs.columns  # bucketed's preset list is part of choosing bucketed


def test_wandb_metric_names_of_the_new_logger_are_read():
    history = pd.DataFrame([
        {"step": 1, "train/loss": 2.5, "train/ktok_s": 10.0},
        {"step": 2, "train/loss": 2.4, "train/ktok_s": 11.0},
        {"step": 2, "probe/0-96/loss": 3.0, "probe/0-96/acc": 0.2, "probe/96-216/loss": 3.5, "probe/96-216/acc": 0.1},
    ])
    summary = {"final/ktok_s": 10.5, "ktok_s": 11.0, "final/status": "finished", "final/final_loss": 2.4}
    record = wandb_run_to_record(FakePublicRun(history, summary, {"seed": 1}))
    assert record.steps["loss"].tolist() == [2.5, 2.4]
    assert record.summary["ktok_s"] == 10.5 and record.status == "finished"
    assert record.probes[["band", "band_lo", "band_hi"]].values.tolist() == [[0, 0, 96], [1, 96, 216]]


def test_offline_wandb_runs_are_read_only_when_asked(tmp_path):
    """A folder of offline W&B runs and no run directory: a problem naming the option, not a silent parse of W&B's
    undocumented binary log."""
    from dflash_lab.analysis import OFFLINE_WANDB_HINT

    run = tmp_path / "wandb" / "offline-run-20261203_000000-abc123"
    run.mkdir(parents=True)
    (run / "run-abc123.wandb").write_bytes(b":W&B\x00\x00\x00")   # the header alone: no record
    report = load_runs([tmp_path / "wandb"])
    assert not report.runs and report.problems == [f"{tmp_path / 'wandb'}: holds offline W&B runs and no run "
                                                   f"directory; {OFFLINE_WANDB_HINT}"]
    assert "--offline-wandb" in OFFLINE_WANDB_HINT
    assert load_runs([tmp_path / "wandb"], offline_wandb=True).problems != report.problems


def test_a_run_that_switched_tau_off_says_so_instead_of_a_missing_measurement(tmp_path):
    """trainer.measure_tau=false: tau is NaN, and the note says it was not measured (not that it is missing)."""
    run_dir = write_run(tmp_path / "r", "bucketed", 0)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["tau"] = None
    (run_dir / "summary.json").write_text(json.dumps(summary))
    record = load_local_run(run_dir)
    measured = analyse_run(record).row
    assert "tau: not in summary.json" in measured["notes"]
    off = analyse_run(replace(record, config={**record.config, "trainer": {"measure_tau": False}})).row
    assert np.isnan(off["tau"]) and "not measured (trainer.measure_tau=false)" in off["notes"]
    assert "tau: not in summary.json" not in off["notes"]
