"""Forgetting metrics on hand-made tables and synthetic series with known answers (metrics.forgetting)."""

import doctest

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_lab.metrics import forgetting as fg


def test_docstring_examples():
    assert doctest.testmod(fg).failed == 0


def test_band_forgetting_and_final_drop_by_hand():
    acc = [0.1, 0.5, 0.3, 0.6, 0.2]
    # running max 0.1 0.5 0.5 0.6 0.6 -> gaps 0 0 0.2 0 0.4 -> mean 0.12
    assert fg.band_forgetting(acc) == pytest.approx(0.12)
    assert fg.final_drop(acc) == pytest.approx(0.4)
    assert fg.band_forgetting([0.1, 0.2, 0.3]) == 0.0
    assert np.isnan(fg.band_forgetting([]))


def test_band_forgetting_table_orders_by_step_within_band():
    probes = pd.DataFrame(
        {
            "step": [20, 0, 10, 0, 10, 20],
            "band": [0, 0, 0, 1, 1, 1],
            "band_lo": [0, 0, 0, 96, 96, 96],
            "band_hi": [96, 96, 96, 152, 152, 152],
            "acc": [0.2, 0.1, 0.6, 0.3, 0.3, 0.4],
        }
    )
    table = fg.band_forgetting_table(probes)
    assert table.loc[0, "forgetting"] == pytest.approx(0.4 / 3)  # 0.1, 0.6, 0.2 in step order
    assert table.loc[0, "final_drop"] == pytest.approx(0.4)
    assert table.loc[1, "final_drop"] == 0.0
    assert table.loc[1, "band_lo"] == 96 and table.loc[1, "band_hi"] == 152
    assert table["n_evals"].tolist() == [3, 3]


@pytest.fixture
def presentations():
    """Hand-made presentation records; expected counts written next to each example."""
    rows = [
        # example 1 (band 0): learned, forgotten, learned, forgotten -> 2 events
        (1, 0, 0.8), (1, 10, 0.2), (1, 20, 0.9), (1, 30, 0.4),
        # example 2 (band 0): never learned -> 0 events, never learned
        (2, 1, 0.1), (2, 11, 0.3), (2, 21, 0.2),
        # example 3 (band 1): not learned -> learned -> stays learned (0.5 counts as learned) -> 0 events
        (3, 2, 0.2), (3, 12, 0.5), (3, 22, 0.7),
        # example 4 (band 1): presented twice -> excluded (one event needs a learn and a loss after it)
        (4, 3, 0.9), (4, 13, 0.1),
        # example 5 (band 1): learned -> forgotten -> forgotten -> 1 event
        (5, 4, 0.6), (5, 14, 0.49), (5, 24, 0.3),
    ]
    frame = pd.DataFrame(rows, columns=["sample_index", "step", "acc"])
    frame["band"] = frame["sample_index"].map({1: 0, 2: 0, 3: 1, 4: 1, 5: 1})
    frame["epoch"] = frame["step"] // 10
    frame["length"] = 50
    return frame.sample(frac=1.0, random_state=0)  # shuffled: the functions must sort by step themselves


def test_example_forgetting_events_counted_by_hand(presentations):
    per_example = fg.example_forgetting_events(presentations)
    assert per_example["events"].to_dict() == {1: 2, 2: 0, 3: 0, 4: 1, 5: 1}
    assert per_example["ever_learned"].to_dict() == {1: True, 2: False, 3: True, 4: True, 5: True}
    summary = fg.example_forgetting(presentations)  # example 4 (2 presentations) is left out
    assert summary.n_examples == 4
    assert summary.events_per_example == pytest.approx(3 / 4)
    assert summary.frac_ever_forgotten == pytest.approx(2 / 4)
    assert summary.frac_never_learned == pytest.approx(1 / 4)


def test_example_forgetting_by_band(presentations):
    by_band = fg.example_forgetting_by_band(presentations)
    assert by_band.loc[0, "events_per_example"] == pytest.approx(1.0)  # examples 1 and 2
    assert by_band.loc[0, "frac_never_learned"] == pytest.approx(0.5)
    assert by_band.loc[1, "events_per_example"] == pytest.approx(0.5)  # examples 3 and 5
    assert by_band.loc[1, "n_examples"] == 2


def test_threshold_is_configurable(presentations):
    # theta 0.95: nothing is ever learned -> no events, all never learned
    summary = fg.example_forgetting(presentations, theta=0.95)
    assert summary.events_per_example == 0.0 and summary.frac_never_learned == 1.0


def test_fewer_than_three_presentations_give_nan_not_zero():
    rows = pd.DataFrame({"sample_index": [1, 1, 2, 2], "step": [0, 5, 1, 6], "acc": [0.9, 0.1, 0.1, 0.9],
                         "band": [0, 0, 1, 1]})
    summary = fg.example_forgetting(rows)  # example 1 has an event, but two epochs cannot tell noise from forgetting
    assert np.isnan(summary.events_per_example) and summary.n_examples == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0.0, 1.0)), min_size=1, max_size=80))
def test_events_match_a_plain_loop(records):
    frame = pd.DataFrame(records, columns=["sample_index", "acc"])
    frame["step"] = np.arange(len(frame))
    frame["band"] = 0
    expected: dict[int, int] = {}
    previous: dict[int, bool] = {}
    for sample, acc in records:
        learned = acc >= 0.5
        expected[sample] = expected.get(sample, 0) + int(previous.get(sample, False) and not learned)
        previous[sample] = learned
    assert fg.example_forgetting_events(frame)["events"].to_dict() == expected


def test_interval_band_tokens_assign_steps_to_the_following_eval():
    tokens = pd.DataFrame({0: [10, 0, 0, 30], 1: [0, 10, 10, 10]}, index=[1, 2, 3, 4])
    intervals = fg.interval_band_tokens(tokens, np.array([0, 2, 4]))
    # (0, 2]: steps 1, 2 ; (2, 4]: steps 3, 4
    assert intervals.loc[2].tolist() == [10, 10]
    assert intervals.loc[4].tolist() == [30, 20]


def test_step_band_tokens_from_lengths_uses_the_probe_band_convention():
    # band b holds (lo, hi]: a mean length of exactly 96 belongs to band 0, 97 to band 1; beyond every band: none
    wide = fg.step_band_tokens_from_lengths(
        np.array([1, 2, 3]), np.array([10, 20, 30]), np.array([96.0, 97.0, 5000.0]), [(0, 96), (96, 152)]
    )
    assert wide.index.tolist() == [1, 2]
    assert wide.to_numpy().tolist() == [[10, 0], [0, 20]]


# ------------------------------------------------------------------------------------------ a simulated training run
BATCHES_PER_EPOCH = np.array([30, 25, 20, 20, 15, 10])  # batches of each length band per epoch (120 steps)


def band_shares_per_step(order: str, epochs: int, rng: np.random.Generator, rows: int = 16) -> np.ndarray:
    """x[t, b]: share of step t's real tokens from band b under a batch order.

    bucketed: one band per step, batches shuffled every epoch; bucket_sequential: each epoch visits the bands in
    order, all of a band's batches consecutively; full_random: every step mixes `rows` samples drawn at random.
    """
    bands = BATCHES_PER_EPOCH.size
    labels = np.repeat(np.arange(bands), BATCHES_PER_EPOCH)
    shares = []
    for _ in range(epochs):
        if order == "bucketed":
            shares.append(np.eye(bands)[rng.permutation(labels)])
        elif order == "bucket_sequential":
            shares.append(np.eye(bands)[labels])
        else:
            mix = BATCHES_PER_EPOCH / BATCHES_PER_EPOCH.sum()
            shares.append(rng.multinomial(rows, mix, size=labels.size) / rows)
    return np.concatenate(shares)


def simulate_probe_run(order="bucketed", recency=0.01, decay=0.05, epochs=8, every=10, noise=0.005, seed=0):
    """Probe losses and band tokens of a run with a planted recency drift.

    Each step moves a recency state z_b by `recency` x (x_b,t - mean share of b), so a band's log probe loss
    falls while it is trained and rises while others are; z decays toward 0 at rate `decay` (the model drifts
    back). log L_b(t) = level_b + shared learning curve(t) - z_b(t) + evaluation noise. recency = 0: the null.
    """
    rng = np.random.default_rng(seed)
    shares = band_shares_per_step(order, epochs, rng)
    n_steps, bands = shares.shape
    mean_share = BATCHES_PER_EPOCH / BATCHES_PER_EPOCH.sum()
    state = np.zeros((n_steps + 1, bands))
    for t in range(n_steps):
        state[t + 1] = (1 - decay) * state[t] + recency * (shares[t] - mean_share)
    steps = np.arange(0, n_steps + 1, every)
    curve = -0.5 * np.log1p(steps / 50)
    log_loss = np.log(np.linspace(2.0, 3.0, bands)) + curve[:, None] - state[steps]
    probe_loss = pd.DataFrame(np.exp(log_loss + noise * rng.standard_normal(log_loss.shape)), index=steps)
    tokens = pd.DataFrame(4096 * shares, index=np.arange(1, n_steps + 1))
    return probe_loss, tokens


def dynamics(order, recency, seed=0, **kwargs):
    probe_loss, tokens = simulate_probe_run(order, recency, seed=seed, **kwargs)
    period = fg.order_period_steps(order, int(BATCHES_PER_EPOCH.sum()))
    return fg.probe_dynamics(probe_loss, tokens, start_step=0.2 * probe_loss.index[-1], period_steps=period)


# --------------------------------------------------------------------------------------------- residual amplitude
def test_residual_amplitude_reads_a_planted_band_relative_swing():
    steps = np.arange(1, 101) * 10
    curve = 2.0 - 0.2 * np.log(steps)  # a learning curve every band shares: not a swing
    swing = 0.04 * np.where(np.arange(100) % 10 < 5, 1.0, -1.0)  # bands take turns, +-0.04 in log loss
    frame = pd.DataFrame({0: np.exp(curve + swing), 1: np.exp(curve - swing), 2: np.exp(curve + 0.3)}, index=steps)
    # band-relative: g_0 = +-(0.04 - 0) ... minus the mean of the three bands -> +-0.04, +-0.04, 0
    assert fg.residual_amplitude(frame) == pytest.approx((0.04 + 0.04 + 0.0) / 3, rel=0.05)
    shared = pd.DataFrame({b: np.exp(curve + 0.1 * b) for b in range(3)}, index=steps)
    assert fg.residual_amplitude(shared) == pytest.approx(0.0, abs=1e-9)


def test_residual_amplitude_of_pure_evaluation_noise_is_its_band_relative_std():
    rng = np.random.default_rng(0)
    steps = np.arange(1, 401) * 10
    bands, sigma = 4, 0.01
    noise = sigma * rng.standard_normal((400, bands))
    frame = pd.DataFrame(np.exp(3.0 - 0.3 * np.log(steps)[:, None] + noise), index=steps)
    # e_b = noise_b - mean over bands: std sigma sqrt(1 - 1/B)
    assert fg.residual_amplitude(frame) == pytest.approx(sigma * np.sqrt(1 - 1 / bands), rel=0.08)


def test_residual_amplitude_needs_enough_evals():
    frame = pd.DataFrame({0: [3.0, 2.9, 2.8], 1: [3.1, 2.8, 2.7]}, index=[10, 20, 30])
    assert np.isnan(fg.residual_amplitude(frame))


# -------------------------------------------------------------------------------------------------- own-share slope
def test_own_share_slope_reads_the_planted_recency_effect():
    # no decay: each interval of 10 steps moves log L_b by -recency x 10 x (s_b - mean share) exactly
    results = [dynamics("bucketed", 0.01, seed=seed, decay=0.0) for seed in range(4)]
    for result in results:
        assert result.own_share_slope == pytest.approx(-0.1, abs=3 * result.own_share_slope_se + 1e-3)
        assert 0 < result.own_share_slope_se < 0.01


def test_own_share_slope_of_the_null_is_zero_within_its_standard_error():
    betas, errors = [], []
    for seed in range(12):
        result = dynamics("bucketed", 0.0, seed=seed)
        betas.append(result.own_share_slope)
        errors.append(result.own_share_slope_se)
    betas = np.asarray(betas)
    assert np.all(np.abs(betas) < 4 * np.asarray(errors))
    # the standard error is calibrated: it matches the spread of the estimate over seeds (within sampling error)
    assert np.std(betas, ddof=1) == pytest.approx(np.mean(errors), rel=0.5)


def test_own_share_slope_ignores_a_shared_learning_curve_with_drifting_shares():
    """Band 1's share grows over training while every band's loss drops ever less: without the trend the slope
    would read "more band-1 tokens -> smaller drop" although no band responds to its share."""
    rng = np.random.default_rng(3)
    n = 150
    steps = np.arange(n + 1) * 10 + 10
    later = np.clip(np.linspace(0.1, 0.9, n) + 0.1 * rng.standard_normal(n), 0, 1)
    log_loss = np.log(3.0) - 0.5 * np.log(steps / 10)
    loss = pd.DataFrame({b: np.exp(log_loss + 0.001 * rng.standard_normal(n + 1)) for b in (0, 1)}, index=steps)
    tokens = pd.DataFrame({0: 1000 * (1 - later), 1: 1000 * later}, index=steps[1:])
    result = fg.own_share_slope(loss, tokens)
    assert abs(result.beta) < 3 * result.se + 1e-3


# -------------------------------------------------------------------------------------------------- cross-band effect
def _linear_share_model(effect: np.ndarray, n: int = 400, seed: int = 0, noise: float = 5e-4):
    """y_b,k = sum_a effect[a, b] s_a,k + shared shrinking drop + noise, shares random per interval."""
    rng = np.random.default_rng(seed)
    bands = effect.shape[0]
    shares = rng.dirichlet(np.ones(bands), n)
    steps = np.arange(n + 1) * 10 + 10
    drop = -0.05 / np.sqrt(steps[1:] / 10)
    changes = shares @ effect + drop[:, None] + noise * rng.standard_normal((n, bands))
    loss = pd.DataFrame(np.exp(np.log(3.0) + np.r_[np.zeros((1, bands)), np.cumsum(changes, axis=0)]), index=steps)
    return loss, pd.DataFrame(1000 * shares, index=steps[1:])


def test_planted_zero_cross_effect_reads_zero_where_the_all_shares_fit_reads_positive():
    effect = np.diag(np.full(4, -0.2))  # each band helps itself, no band touches another
    loss, tokens = _linear_share_model(effect)
    result = fg.cross_band_effects(loss, tokens)
    assert result.mean == pytest.approx(0.0, abs=1e-3)
    assert np.nanmax(np.abs(result.matrix.to_numpy())) < 3e-3
    # the non-identifiable version (slope of y_b on each s_a alone, the share sum constraint ignored) is biased up:
    # with shares summing to 1, every other band's share rises when b's falls, and b's loss rises with it
    naive = [np.polyfit(tokens[a] / 1000, np.diff(np.log(loss[b])), 1)[0] for a in range(4) for b in range(4) if a != b]
    assert np.mean(naive) > 0.03


def test_planted_cross_effects_read_as_contrasts_against_the_reference_band():
    effect = np.diag(np.full(4, -0.2))
    effect[3, 0] = 0.12  # the longest band hurts the shortest
    effect[2, 0] = 0.05
    loss, tokens = _linear_share_model(effect, seed=1)
    result = fg.cross_band_effects(loss, tokens)
    assert result.reference == {0: 1, 1: 0, 2: 1, 3: 2}
    assert result.matrix.loc[3, 0] == pytest.approx(0.12, abs=5e-3)  # M[3, 0] - M[r(0) = 1, 0]
    assert result.matrix.loc[2, 0] == pytest.approx(0.05, abs=5e-3)
    assert result.matrix.loc[3, 1] == pytest.approx(0.0, abs=5e-3)  # M[3, 1] - M[0, 1] = 0
    assert np.isnan(result.matrix.loc[1, 0]) and np.isnan(result.matrix.loc[0, 0])  # reference and diagonal
    assert result.mean == pytest.approx(np.nanmean(result.matrix.to_numpy()))
    assert result.mean > 0.01


def test_cross_band_effect_needs_three_bands():
    loss, tokens = _linear_share_model(np.diag([-0.2, -0.2]))
    assert np.isnan(fg.cross_band_effects(loss, tokens).mean)


# ---------------------------------------------------------------------------------------------------------- loop
def test_only_periodic_orders_have_a_period():
    assert fg.order_period_steps("bucket_sequential", 120) == 120
    for shuffled in ("sorted_static", "full_random", "bucketed", "bucketed_megabatch", "packed", None):
        assert fg.order_period_steps(shuffled, 120) is None
    assert fg.order_period_steps("bucket_sequential", None) is None  # period unknown


def test_loop_score_high_for_a_forgetting_loop_and_near_zero_when_mixed():
    rng = np.random.default_rng(2)
    steps = np.arange(1, 81) * 25
    trend = 3.0 - 0.3 * np.log(steps)
    wave = 0.05 * np.sin(2 * np.pi * np.arange(80) / 4)  # the bands take turns every 4 evals (100 steps)
    loop = pd.DataFrame({0: trend + wave, 1: trend - wave}, index=steps) + 0.002 * rng.standard_normal((80, 2))
    mixed = pd.DataFrame({0: trend, 1: trend + 0.2}, index=steps) + 0.02 * rng.standard_normal((80, 2))
    looped = fg.loop_score(loop, 100)
    assert looped.lag_evals == 4
    assert looped.per_band[0] > 0.8 and looped.per_band[1] > 0.8
    assert abs(fg.loop_score(mixed, 100).score) < 0.3


def test_loop_score_ignores_the_learning_curve_all_bands_share():
    steps = np.arange(1, 61) * 10
    shared = 20 * np.exp(-steps / 150) + 2 + 0.3 * (np.arange(60) % 5 == 0)  # a bump every 5 evals, in every band
    frame = pd.DataFrame({0: shared, 1: 1.3 * shared, 2: 0.8 * shared}, index=steps)
    assert np.isnan(fg.loop_score(frame, 50).score)  # nothing band-specific is left
    assert np.allclose(fg.band_residuals(frame).to_numpy(), 0, atol=1e-9)


def test_loop_score_is_nan_when_the_period_is_longer_than_half_the_probe_series():
    steps = np.arange(1, 21) * 10
    frame = pd.DataFrame({0: 3 - 0.1 * np.log(steps), 1: 3.2 - 0.1 * np.log(steps)}, index=steps)
    result = fg.loop_score(frame, 150)
    assert np.isnan(result.score) and result.lag_evals == 15


# ---------------------------------------------------------------------------------------- detection (simulation)
def test_a_recency_drift_under_the_shuffled_bucketed_order_is_detected_by_amplitude_and_slope():
    """The case the first loop score missed: bucketed order (no period), a planted recency drift. The amplitude
    separates it from full_random with the same drift and from the null; beta is negative and significant; the loop
    score does not apply (NaN); the cross effect reads zero since no band touches another."""
    seeds = range(5)
    drift = [dynamics("bucketed", 0.01, seed) for seed in seeds]
    mixed = [dynamics("full_random", 0.01, seed) for seed in seeds]
    null = [dynamics("bucketed", 0.0, seed) for seed in seeds]
    amplitude = {name: np.mean([r.residual_amplitude for r in runs])
                 for name, runs in (("drift", drift), ("mixed", mixed), ("null", null))}
    assert amplitude["drift"] > 1.6 * amplitude["mixed"] and amplitude["drift"] > 1.6 * amplitude["null"]
    assert amplitude["mixed"] < 1.4 * amplitude["null"]  # well-mixed batches leave little but the noise
    for result in drift:
        assert result.own_share_slope < -5 * result.own_share_slope_se
        assert np.isnan(result.loop_score) and result.loop_lag_evals == 0
        assert abs(result.cross_band_effect) < 0.01
    for result in null:
        assert abs(result.own_share_slope) < 4 * result.own_share_slope_se


def test_the_sequential_positive_control_shows_the_loop_signature():
    loop = [dynamics("bucket_sequential", 0.01, seed) for seed in range(3)]
    null = [dynamics("bucket_sequential", 0.0, seed) for seed in range(3)]
    assert all(r.loop_lag_evals == 12 for r in loop)  # 120 steps per epoch / an eval every 10 steps
    assert min(r.loop_score for r in loop) > 0.6
    assert max(abs(r.loop_score) for r in null) < 0.3
    assert min(r.residual_amplitude for r in loop) > 3 * max(r.residual_amplitude for r in null)


def test_probe_dynamics_uses_only_the_window_after_the_steady_state_start():
    probe_loss, tokens = simulate_probe_run("bucketed", 0.0, seed=1)
    disturbed = probe_loss.copy()
    disturbed.loc[disturbed.index < 200, 0] *= np.exp(0.5)  # an early band-specific transient
    kept = fg.probe_dynamics(probe_loss, tokens, start_step=200)
    assert fg.probe_dynamics(disturbed, tokens, start_step=200).residual_amplitude == kept.residual_amplitude
    assert fg.probe_dynamics(disturbed, tokens, start_step=0).residual_amplitude > 2 * kept.residual_amplitude
    assert kept.window_start_step == 200 and kept.window_evals == len(probe_loss.loc[200:])
    assert set(kept.per_band.columns) >= {"residual_amplitude", "loop", "own_share_slope"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50))
def test_band_forgetting_bounds(acc):
    value = fg.band_forgetting(acc)
    assert 0.0 <= value <= fg.final_drop(acc) + 1e-12 or value <= max(acc) - min(acc) + 1e-12
    assert 0.0 <= value <= max(acc) - min(acc) + 1e-12
    assert 0.0 <= fg.final_drop(acc) <= 1.0
