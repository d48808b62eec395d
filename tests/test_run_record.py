"""A run's record is the truth: the run owns its config record (run_config.json), written only by a launch that
trains it; launches that train nothing (refused by the lock, refused before the loop, nothing to do) leave it
byte-identical, and compare labels arms from it, not from Hydra's per-launch .hydra files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from dflash_lab import compare
from dflash_lab.records import record
from dflash_lab.analysis.local import load_local_run
from dflash_lab.records.run_dir import RunDirectory
from dflash_lab.records.run_lock import RunDirBusy
from helpers import SMALL, run_cli, write_run


def _launch_files(run_dir: Path, sampler: str, seed: int = 0) -> None:
    """What Hydra writes into .hydra/ before a launch reaches the trainer."""
    hydra = run_dir / ".hydra"
    hydra.mkdir(parents=True, exist_ok=True)
    (hydra / "config.yaml").write_text(yaml.safe_dump({"sampler": {"name": sampler}, "seed": seed}))
    (hydra / "overrides.yaml").write_text(yaml.safe_dump([f"sampler={sampler}", f"seed={seed}"]))
    (hydra / "hydra.yaml").write_text(f"launch: {sampler}\n")


def _files(run_dir: Path) -> dict[str, bytes]:
    names = [record.RUN_CONFIG_FILE, *(f".hydra/{n}" for n in ("config.yaml", "overrides.yaml", "hydra.yaml"))]
    return {name: (run_dir / name).read_bytes() for name in names if (run_dir / name).is_file()}


def test_only_a_launch_that_trains_writes_the_run_record_and_one_that_trains_nothing_puts_hydra_back(tmp_path):
    run_dir = tmp_path / "run"
    _launch_files(run_dir, "bucketed")
    trained = RunDirectory(run_dir, is_main=True)
    trained.claim()
    trained.running({"sampler": {"name": "bucketed"}, "seed": 0})
    saved = json.loads((run_dir / record.RUN_CONFIG_FILE).read_text())
    assert saved["config"]["sampler"]["name"] == "bucketed" and saved["overrides"] == ["sampler=bucketed", "seed=0"]
    before = _files(run_dir)

    # a second launch while the run lives: Hydra has rewritten .hydra, the lock refuses it, the record is untouched
    _launch_files(run_dir, "full_random")
    with pytest.raises(RunDirBusy):
        RunDirectory(run_dir, is_main=True).claim()
    assert (run_dir / record.RUN_CONFIG_FILE).read_bytes() == before[record.RUN_CONFIG_FILE]
    assert load_local_run(run_dir).sampler == "bucketed"
    trained.release()

    # a launch refused before its loop (no checkpoint to take the files from): .hydra goes back to the run's
    refused = RunDirectory(run_dir, is_main=True)
    refused.claim()
    refused.restore_if_refused()
    refused.release()
    assert _files(run_dir) == before


def test_compare_labels_arms_from_the_run_record_not_from_the_latest_launch(tmp_path):
    """A launch refused in a run's directory (or one with nothing to do) left Hydra's files of another sampler: the
    run is still compared as what it trained."""
    root = tmp_path / "sweep"
    write_run(root / "0_bucketed_s0", "bucketed", 0, run_record=True)
    write_run(root / "1_full_random_s0", "full_random", 0, run_record=True)
    _launch_files(root / "0_bucketed_s0", "full_random")
    (root / "0_bucketed_s0" / ".hydra" / "overrides.yaml").write_text(
        yaml.safe_dump(["sampler=full_random", "seed=0", "trainer.log_every=5"]))
    out = tmp_path / "out"
    assert compare.main([str(root), "--out", str(out), "--no-plots", "--baseline", "full_random"]) == 0
    runs = pd.read_csv(out / "comparison.csv").set_index("run_id")
    assert runs.loc["0_bucketed_s0", "arm"] == "bucketed" and runs.loc["1_full_random_s0", "arm"] == "full_random"
    assert set(pd.read_csv(out / "paired.csv")["policy"]) == {"bucketed"}


@pytest.mark.integration
def test_a_refused_fresh_start_and_a_nothing_to_do_relaunch_leave_the_record_byte_identical(tmp_path):
    """The reproductions of issue 23 on the command line: a fresh start refused over an ended run's records, and a
    re-launched sweep whose run has nothing to do, change no file of the run's record; compare labels the arms."""
    common = [*SMALL, "logger=none", "trainer.measure_tau=false", "trainer.max_steps=4", "probes.every=2",
              "trainer.ckpt_every=2"]
    run_dir = tmp_path / "d1"
    first = run_cli(f"hydra.run.dir={run_dir}", *common, "sampler=bucketed", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _files(run_dir)
    assert record.RUN_CONFIG_FILE in before
    shutil.rmtree(run_dir / "checkpoints")
    refused = run_cli(f"hydra.run.dir={run_dir}", *common, "sampler=full_random", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert _files(run_dir) == before
    assert compare.main([str(run_dir), "--out", str(tmp_path / "r1"), "--no-plots"]) == 0
    assert pd.read_csv(tmp_path / "r1" / "comparison.csv")["arm"].tolist() == ["bucketed"]

    sweep = tmp_path / "s1"
    launched = run_cli("-m", f"hydra.sweep.dir={sweep}", *common, "sampler=bucketed,full_random", "seed=0",
                       cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    job = sweep / "0_bucketed_s0"
    before = _files(job)
    again = run_cli("-m", f"hydra.sweep.dir={sweep}", *common, "sampler=bucketed", "seed=0", "trainer.log_every=5",
                    cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do" in (job / record.rank_log_name(0)).read_text()
    assert _files(job) == before
    out = tmp_path / "r2"
    assert compare.main([str(sweep), "--out", str(out), "--no-plots", "--baseline", "full_random"]) == 0
    assert sorted(pd.read_csv(out / "comparison.csv")["arm"]) == ["bucketed", "full_random"]
    paired = pd.read_csv(out / "paired.csv")
    assert len(paired) and paired["policy"].eq("bucketed").all()


def test_keys_that_follow_the_seed_in_the_resolved_record_are_not_arms(tmp_path):
    """run_config.json records the resolved config, where ``model.draft_init_seed: ${seed}`` is the seed itself and
    ``model.pretrain_seed`` the seed mod target_seeds: one value per seed, not a setting. Two policies x two seeds
    are two arms, not four."""
    from dflash_lab.analysis import compare_records, load_runs

    for sampler in ("bucketed", "full_random"):
        for seed in (0, 1):
            run = write_run(tmp_path / "sweep" / f"{sampler}_s{seed}", sampler, seed, run_record=True)
            record = json.loads((run / "run_config.json").read_text())
            record["config"]["model"] = {"draft_init_seed": seed, "pretrain_seed": seed % 1, "hidden_size": 64}
            record["overrides"].append(f"+arm={sampler}")   # a sweep's arm file: its keys come from the config
            (run / "run_config.json").write_text(json.dumps(record))
    comparison = compare_records(load_runs([tmp_path / "sweep"]).runs)
    assert sorted(comparison.groups.index) == ["bucketed", "full_random"]
