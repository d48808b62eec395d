"""Jumpiness metrics on synthetic series with known answers (metrics.jumpiness)."""

import doctest

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_lab.metrics import jumpiness as jm
from dflash_lab.metrics.throughput import ema_update


def test_docstring_examples():
    assert doctest.testmod(jm).failed == 0


def test_log_loss_diffs_and_jumpiness_of_alternating_series():
    loss = np.tile([1.0, 2.0], 50)
    diffs = jm.log_loss_diffs(loss)
    assert np.allclose(np.abs(diffs), np.log(2))
    # d alternates +-log 2 around mean ~0: std = log 2 (exactly for an even number of diffs)
    assert jm.jumpiness(loss[:-1]) == pytest.approx(np.log(2))
    assert jm.robust_jumpiness(loss[:-1]) == pytest.approx(1.4826 * np.log(2))


def test_jumpiness_of_lognormal_noise_matches_generating_sigma():
    rng = np.random.default_rng(0)
    sigma = 0.05
    # log L_t i.i.d. normal(sigma): d_t = e_t - e_(t-1) has std sigma * sqrt(2)
    loss = np.exp(0.7 + sigma * rng.standard_normal(20000))
    assert jm.jumpiness(loss) == pytest.approx(sigma * np.sqrt(2), rel=0.03)
    assert jm.robust_jumpiness(loss) == pytest.approx(sigma * np.sqrt(2), rel=0.05)


def test_robust_jumpiness_ignores_rare_spikes_but_std_does_not():
    rng = np.random.default_rng(1)
    loss = np.exp(0.5 + 0.02 * rng.standard_normal(5000))
    spiky = loss.copy()
    spiky[::500] *= 20
    assert jm.jumpiness(spiky) > 3 * jm.jumpiness(loss)
    assert jm.robust_jumpiness(spiky) == pytest.approx(jm.robust_jumpiness(loss), rel=0.1)


def test_non_positive_losses_are_dropped_and_short_series_give_nan():
    assert jm.log_loss_diffs([1.0, 0.0, -1.0, np.nan, np.e]).tolist() == pytest.approx([1.0])
    assert np.isnan(jm.jumpiness([1.0, 2.0]))
    assert np.isnan(jm.robust_jumpiness([1.0]))


def test_ema_matches_the_throughput_module_recurrence():
    rng = np.random.default_rng(2)
    values = rng.uniform(1, 3, 300)
    expected, running = [], None
    for value in values:
        running = ema_update(running, value, alpha=0.1)
        expected.append(running)
    assert np.allclose(jm.ema(values, 0.1), expected)


@pytest.mark.parametrize("period", [8, 20, 50])
def test_pure_sine_has_lag1_autocorrelation_cos_2pi_over_period(period):
    t = np.arange(period * 40)
    assert jm.autocorrelation(np.sin(2 * np.pi * t / period), 1) == pytest.approx(np.cos(2 * np.pi / period), abs=0.01)
    # the EMA residual of a sine is a sine of the same period: same lag-1 autocorrelation after the transient
    loss = 2.0 + 0.3 * np.sin(2 * np.pi * t / period)
    residual = jm.ema_residuals(loss)[100:]
    assert jm.autocorrelation(residual, 1) == pytest.approx(np.cos(2 * np.pi / period), abs=0.02)


def test_white_noise_residuals_are_negatively_autocorrelated_and_slow_wave_positive():
    rng = np.random.default_rng(4)
    noise = 2.0 + 0.05 * rng.standard_normal(4000)
    assert jm.residual_autocorrelation(noise) < -0.02
    slow = 2.0 + 0.2 * np.sin(2 * np.pi * np.arange(4000) / 200) + 0.01 * rng.standard_normal(4000)
    assert jm.residual_autocorrelation(slow) > 0.5


def test_planted_spike_is_found_at_its_step_and_nowhere_else():
    rng = np.random.default_rng(5)
    loss = 2.0 + 0.02 * rng.standard_normal(600)
    loss[400] = 3.0  # 50 sigma above the window mean
    flags = jm.spike_flags(loss)
    assert np.nansum(flags) == 1
    assert flags[400] == 1.0
    assert np.all(np.isnan(flags[:32]))  # too little history to score
    assert jm.spike_score(loss) == pytest.approx(1 / (600 - 32))


def test_spike_window_excludes_the_current_step_and_is_128_long():
    loss = np.r_[np.full(200, 1.0) + 0.01 * np.sin(np.arange(200)), 100.0]
    assert jm.spike_flags(loss)[-1] == 1.0
    # a level shift 150 steps ago is outside the 128-step window: no spike now
    shifted = np.r_[np.full(50, 5.0), np.full(150, 1.0)] + 0.01 * np.sin(np.arange(200))
    assert np.nansum(jm.spike_flags(shifted)[190:]) == 0


def test_steady_state_starts_after_90_percent_of_the_descent():
    steps = np.arange(3000)
    loss = 2.0 + 3.0 * np.exp(-steps / 300)  # the EMA covers 90% of its 3.0 descent near step 300 ln 10 = 691
    start = jm.steady_state_start(loss)
    assert 691 <= start <= 691 + 12  # + the EMA's lag of about 9 steps
    assert jm.steady_state(loss)[0] == loss[start]


def test_steady_state_never_starts_before_10_percent_and_keeps_a_few_steps():
    assert jm.steady_state_start(np.full(1000, 2.0)) == 100  # no descent at all
    assert jm.steady_state_start(np.r_[5.0, np.full(999, 2.0)]) == 100  # descent done at once
    rising = np.linspace(2.0, 3.0, 500)  # a diverging run has no descent either
    assert jm.steady_state_start(rising) == 50
    assert jm.steady_state_start(np.linspace(5.0, 2.0, 20)) == 12  # at least min_keep = 8 steps stay
    assert jm.steady_state_start(np.linspace(5.0, 2.0, 5)) == 0


def test_lag1_autocorrelation_no_longer_tracks_run_length():
    """The same learning curve and noise, run 4x longer: with a 10%-of-steps warm-up the short run's steady state
    still holds the descent (the EMA lags it: positive residual autocorrelation); from the 90% point it does not."""
    rng = np.random.default_rng(9)

    def run(n_steps):
        steps = np.arange(n_steps)
        return 2.0 + 3.0 * np.exp(-steps / 150) + 0.03 * rng.standard_normal(n_steps)

    short, long_ = run(600), run(2400)
    old = [jm.autocorrelation(jm.ema_residuals(loss)[int(0.1 * loss.size):], 1) for loss in (short, long_)]
    assert old[0] - old[1] > 0.1  # the old rule: the figure moves with run length
    new = [jm.jumpiness_report(loss).resid_lag1_acf for loss in (short, long_)]
    assert abs(new[0] - new[1]) < 0.06
    assert max(new) < 0  # only step-to-step noise is left


def test_report_uses_steady_state_only():
    rng = np.random.default_rng(8)
    warm = np.linspace(10.0, 2.0, 100)  # fast early learning: huge log-differences
    steady = 2.0 + 0.01 * rng.standard_normal(900)
    report = jm.jumpiness_report(np.r_[warm, steady])
    assert 95 <= report.steady_start <= 110
    assert report.steady_steps == 1000 - report.steady_start
    assert report.jumpiness == pytest.approx(jm.jumpiness(np.r_[warm, steady][report.steady_start:]), rel=1e-9)
    assert report.jumpiness < 0.02
    assert np.isnan(report.length_r2)
    assert jm.jumpiness_report(np.r_[warm, steady], steady_start=500).steady_steps == 500


def test_length_confound_recovers_a_planted_length_effect():
    rng = np.random.default_rng(6)
    n = 3000
    mean_len = rng.lognormal(5, 0.7, n)
    max_len = mean_len * rng.uniform(1.0, 1.5, n)
    bucket = np.digitize(max_len, [100, 200, 400])
    noise = 0.01 * rng.standard_normal(n)
    loss = 3.0 * np.exp(-np.arange(n) / 2000) + 0.05 * np.log(mean_len) + noise
    confound = jm.length_confound(loss, mean_len, max_len, bucket, steady=slice(300, None))
    assert confound.r2 > 0.85
    assert confound.n_features == 2 + 3  # two log lengths + 4 buckets minus the reference level
    # removing the length-explained part leaves much less jumpiness
    assert confound.residual_jumpiness < 0.5 * jm.jumpiness(loss[300:])


def test_length_confound_is_near_zero_without_a_length_effect_and_nan_without_features():
    rng = np.random.default_rng(7)
    n = 3000
    mean_len = rng.lognormal(5, 0.7, n)
    loss = 2.0 + 0.02 * rng.standard_normal(n)
    assert jm.length_confound(loss, mean_len, bucket=np.full(n, -1)).r2 < 0.01
    assert np.isnan(jm.length_confound(loss).r2)
    assert np.isnan(jm.length_confound(loss, bucket=np.full(n, -1)).r2)  # one level: no feature at all


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.05, 50.0, allow_nan=False), min_size=3, max_size=200),
    st.floats(0.01, 100.0),
)
def test_jumpiness_is_scale_invariant_and_non_negative(values, scale):
    loss = np.asarray(values)
    base = jm.jumpiness(loss)
    assert base >= 0
    assert jm.jumpiness(scale * loss) == pytest.approx(base, rel=1e-6, abs=1e-9)
    assert jm.robust_jumpiness(scale * loss) == pytest.approx(jm.robust_jumpiness(loss), rel=1e-6, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=3, max_size=200), st.integers(1, 5))
def test_autocorrelation_is_bounded(values, lag):
    value = jm.autocorrelation(values, lag)
    assert np.isnan(value) or -1.0 - 1e-9 <= value <= 1.0 + 1e-9


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.1, 10.0, allow_nan=False), min_size=40, max_size=300))
def test_spike_score_is_a_fraction(values):
    score = jm.spike_score(values)
    assert np.isnan(score) or 0.0 <= score <= 1.0
