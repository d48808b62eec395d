"""Said before a run trains: a declared verdict whose probe endpoint the run's probes cannot compute, and fewer tau
prompts than configured (dflash_lab/analysis/sizing.py, asked by dflash_lab/train.py; the tau prompts:
dflash_lab/training/evaluation.py; the training run's log: tests/test_own_data_records.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dflash_lab.analysis.sizing import verdict_probe_warning, window_probe_evals, window_start_step
from dflash_lab.analysis.summarize import _window_start_index
from dflash_lab.metrics import forgetting
from dflash_lab.training.evaluation import tau_prompt_warning

VERDICT = {"verdict": {"endpoint": "residual_amplitude", "positive_control": "sampler=bucket_sequential",
                       "negative_control": "sampler=bucketed", "question": "sampler=full_random"}}


def _probe_steps(end_step: int, every: int) -> np.ndarray:
    return np.unique(np.r_[np.arange(0, end_step + 1, every), end_step])


@pytest.mark.parametrize("end_step, every, window", [(40, 15, 0.25), (390, 15, 0.25), (57, 4, 0.0), (100, 7, 0.5)])
def test_the_window_count_is_the_one_compare_uses(end_step, every, window):
    """The count agrees with analysis.summarize (the window's first logged step) and metrics.forgetting (the
    evals probe_dynamics keeps), so the warning fires exactly when compare would report NaN."""
    steps = np.arange(1, end_step + 1)
    start = float(steps[_window_start_index(window, steps, {"end_step": end_step})])
    assert window_start_step(end_step, window) == start
    probes = _probe_steps(end_step, every)
    frame = pd.DataFrame({0: 2.0 + 0.01 * np.sin(probes), 1: 2.5 + 0.01 * np.cos(probes)}, index=probes)
    dynamics = forgetting.probe_dynamics(frame, None, start_step=start)
    assert window_probe_evals(end_step, every, int(start)) == dynamics.window_evals
    warned = verdict_probe_warning({**VERDICT, "window": window}, end_step=end_step, probes_every=every, n_bands=2)
    assert (warned is not None) == (not np.isfinite(dynamics.residual_amplitude))


def test_a_tiny_run_is_warned_with_the_probes_every_that_works():
    """60 conversations under the protocol's probes.every=15: 40 steps, 3 probes in the window, NaN verdict."""
    warned = verdict_probe_warning(VERDICT, end_step=40, probes_every=15, n_bands=6)
    assert "this run probes 3 time(s) in the analysis window (steps 11..40 of 40, probes.every=15)" in warned
    assert "residual_amplitude needs 8" in warned and "the verdict with it" in warned
    every = int(warned.split("set probes.every=")[1].split()[0])
    assert window_probe_evals(40, every, 11) >= forgetting.MIN_EVALS > window_probe_evals(40, every + 1, 11)
    too_short = verdict_probe_warning(VERDICT, end_step=6, probes_every=15, n_bands=6)
    assert "the run is too short for 8 probes" in too_short and "trainer.max_steps" in too_short
    cross = verdict_probe_warning({"endpoints": ["ktok_s", "cross_band_effect"]}, end_step=400, probes_every=40,
                                  n_bands=6)
    assert "cross_band_effect needs 11" in cross and "verdict" not in cross


def test_no_warning_when_the_probes_suffice_or_nothing_is_declared():
    assert verdict_probe_warning(VERDICT, end_step=390, probes_every=15, n_bands=6) is None
    assert verdict_probe_warning({"verdict": None, "endpoints": None}, end_step=40, probes_every=15, n_bands=6) is None
    assert verdict_probe_warning({"verdict": {"endpoint": "tau"}}, end_step=40, probes_every=15, n_bands=6) is None
    assert verdict_probe_warning(None, end_step=40, probes_every=0, n_bands=6) is None


def test_fewer_tau_prompts_than_configured_are_named():
    warned = tau_prompt_warning(6, 12, 9)
    assert "only 6 of the 12 prompts of model.decode_num_prompts exist" in warned
    assert "data.probe_fraction" in warned and "model.decode_num_prompts=6" in warned
    assert tau_prompt_warning(12, 12, 40) is None
