"""trainer=smoke: the shortest run whose comparison fills every column a short run can (conf/trainer/smoke.yaml).

The unit tests check the composed config against the comparison's minima (and that one step less, or probes one
step sparser, would lose a column); the integration test trains it and reads it back with compare's analysis."""

from __future__ import annotations

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from dflash_lab.analysis import compare_records, load_runs
from dflash_lab.analysis.schema import COMPARISON_COLUMNS
from dflash_lab.analysis.sizing import verdict_probe_warning
from dflash_lab.metrics.jumpiness import SPIKE_MIN_HISTORY
from dflash_lab.training.probes import DEFAULT_BANDS
from dflash_lab.training.settings import RunSettings

PROBE_ENDPOINTS = {"endpoints": ["residual_amplitude", "own_share_slope", "cross_band_effect"]}
N_BANDS = len(DEFAULT_BANDS) - 1   # probes.bands=auto on the built-in corpus; fitted bands on other data: 6 too
# Columns that need whole passes over the data: every example presented 3 times (forgetting events), two periods
# of a periodic order inside the window (bucket_sequential's loop_score; NaN by definition for shuffled orders).
EPOCH_BOUND = {"forgetting_events_per_example", "loop_score"}


def _smoke(*overrides: str) -> dict:
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["trainer=smoke", "run_dir=/tmp/unused", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def _short_of(end_step: int, every: int) -> str | None:
    """What the comparison would lack at this length and probe cadence (None: nothing a short run can give)."""
    if end_step < SPIKE_MIN_HISTORY + 1:
        return f"spike_score: {end_step} logged losses"
    return verdict_probe_warning(PROBE_ENDPOINTS, end_step=end_step, probes_every=every, n_bands=N_BANDS)


def test_the_smoke_preset_is_the_cpu_trainer_with_a_short_schedule():
    config = _smoke()
    settings = RunSettings.from_config(config)   # every section checks
    assert settings.trainer.max_steps == 33 and settings.probes.every == 2
    cpu = _smoke("trainer=cpu")["trainer"]
    assert {k: v for k, v in config["trainer"].items() if cpu[k] != v} == {"max_steps": 33, "ckpt_every": 0}
    assert _smoke("probes.every=7", "trainer.max_steps=9")["probes"]["every"] == 7   # the command line still wins


def test_the_smoke_run_is_the_shortest_that_fills_every_short_run_column():
    config = _smoke()
    end, every = config["trainer"]["max_steps"], config["probes"]["every"]
    assert _short_of(end, every) is None
    assert end > config["trainer"]["steady_warmup_steps"]   # a steady-state Ktok/s
    assert _short_of(end - 1, every) is not None, "one step less still fills every column: shorten the preset"
    assert _short_of(end, every + 1) is not None, "sparser probes still fill every column: probe less often"


@pytest.mark.integration
def test_a_smoke_run_yields_every_comparison_column_a_short_run_can(tmp_path):
    from dflash_lab.train import train

    summary = train(_smoke("trainer.num_threads=1", "trainer.progress=false", f"run_dir={tmp_path}"))
    assert summary["status"] == "finished" and summary["steps"] == 33
    row = compare_records(load_runs([tmp_path]).runs).runs.iloc[0]   # as compare reads it (window: the rules')
    missing = [c for c in COMPARISON_COLUMNS if c not in EPOCH_BOUND and not np.isfinite(row[c])]
    assert not missing, f"{missing}: {row['notes']}"
    assert "forgetting_events_per_example" in row["notes"]   # n/a, and said why (3 epochs)
