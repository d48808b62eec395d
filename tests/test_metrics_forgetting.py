"""Forgetting metrics on hand-made tables and synthetic series with known answers (METRICS.md, "Forgetting")."""

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
        (2, 1, 0.1), (2, 11, 0.3),
        # example 3 (band 1): not learned -> learned -> stays learned (0.5 counts as learned) -> 0 events
        (3, 2, 0.2), (3, 12, 0.5), (3, 22, 0.7),
        # example 4 (band 1): presented once -> excluded (no pair to compare)
        (4, 3, 0.9),
        # example 5 (band 1): learned -> forgotten -> 1 event
        (5, 4, 0.6), (5, 14, 0.49),
    ]
    frame = pd.DataFrame(rows, columns=["sample_index", "step", "acc"])
    frame["band"] = frame["sample_index"].map({1: 0, 2: 0, 3: 1, 4: 1, 5: 1})
    frame["epoch"] = frame["step"] // 10
    frame["length"] = 50
    return frame.sample(frac=1.0, random_state=0)  # shuffled: the functions must sort by step themselves


def test_example_forgetting_events_counted_by_hand(presentations):
    per_example = fg.example_forgetting_events(presentations)
    assert per_example["events"].to_dict() == {1: 2, 2: 0, 3: 0, 4: 0, 5: 1}
    assert per_example["ever_learned"].to_dict() == {1: True, 2: False, 3: True, 4: True, 5: True}
    summary = fg.example_forgetting(presentations)
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


def test_single_presentations_give_nan_not_zero():
    rows = pd.DataFrame({"sample_index": [1, 2], "step": [0, 1], "acc": [0.9, 0.1], "band": [0, 1]})
    assert np.isnan(fg.example_forgetting(rows).events_per_example)


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


def test_interval_band_fractions_assign_steps_to_the_following_eval():
    tokens = pd.DataFrame({0: [10, 0, 0, 30], 1: [0, 10, 10, 10]}, index=[1, 2, 3, 4])
    fractions = fg.interval_band_fractions(tokens, np.array([0, 2, 4]))
    # (0, 2]: steps 1, 2 -> 10 / 20 ; (2, 4]: steps 3, 4 -> 30 / 50
    assert fractions.loc[2].tolist() == pytest.approx([0.5, 0.5])
    assert fractions.loc[4].tolist() == pytest.approx([0.6, 0.4])


def _planted_interference(n_evals=120, effect=0.08, seed=0):
    """Two probe bands (0 short, 1 long). Each eval interval trains a random share x of long tokens; the short band's
    loss rises by `effect` x x (long -> short interference) while both bands improve with the rest."""
    rng = np.random.default_rng(seed)
    steps_per_interval = 10
    eval_steps = np.arange(n_evals + 1) * steps_per_interval
    x_long = rng.uniform(0, 1, n_evals)
    short = np.r_[3.0, 3.0 + np.cumsum(-0.02 * (1 - x_long) + effect * x_long + 0.002 * rng.standard_normal(n_evals))]
    long_ = np.r_[3.0, 3.0 + np.cumsum(-0.03 * x_long + 0.002 * rng.standard_normal(n_evals))]
    probe_loss = pd.DataFrame({0: short, 1: long_}, index=eval_steps)
    # per-step tokens: every step of interval k is long with probability x_long[k]
    step_rows = []
    for k in range(n_evals):
        for s in range(eval_steps[k] + 1, eval_steps[k + 1] + 1):
            long_tokens = int(round(1000 * x_long[k]))
            step_rows.append((s, 1000 - long_tokens, long_tokens))
    tokens = pd.DataFrame(step_rows, columns=["step", 0, 1]).set_index("step")
    return probe_loss, tokens


def test_planted_long_to_short_interference_is_recovered():
    probe_loss, tokens = _planted_interference()
    fractions = fg.interval_band_fractions(tokens, probe_loss.index.to_numpy())
    matrix = fg.interference_matrix(probe_loss, fractions)
    # d short / d x_long = effect + 0.02 (the improvement lost when training on long instead of short)
    assert matrix.loc[1, 0] == pytest.approx(0.08 + 0.02, abs=0.005)
    assert matrix.loc[0, 0] == pytest.approx(-(0.08 + 0.02), abs=0.005)  # x_short = 1 - x_long
    assert matrix.loc[1, 1] == pytest.approx(-0.03, abs=0.005)  # long training helps long
    assert fg.mean_cross_interference(matrix) == pytest.approx((matrix.loc[1, 0] + matrix.loc[0, 1]) / 2)


@pytest.mark.parametrize("curve", ["exponential", "power_law"])
def test_interference_does_not_mistake_a_drifting_band_share_for_interference(curve):
    """Band shares that drift over training (e.g. long samples later) while every band's loss drops ever less:
    the plain slope sees "more long tokens -> smaller drop" although no band affects another."""
    rng = np.random.default_rng(3)
    n = 150
    eval_steps = np.arange(n + 1) * 10
    x_long = np.clip(np.linspace(0.1, 0.9, n) + 0.1 * rng.standard_normal(n), 0, 1)
    # the learning curve: big drops first, then small
    drops = -0.5 * np.exp(-eval_steps[1:] / 300) if curve == "exponential" else -0.5 * (eval_steps[1:] / 10) ** -0.5
    loss = pd.DataFrame({b: np.r_[3.0, 3.0 + np.cumsum(drops + 0.001 * rng.standard_normal(n))] for b in (0, 1)},
                        index=eval_steps)
    fractions = pd.DataFrame({0: 1 - x_long, 1: x_long}, index=eval_steps[1:])
    plain = fg.interference_matrix(loss, fractions, remove_learning_curve=False)
    assert plain.loc[1, 0] > 0.1  # the confound: looks like long training hurts short
    partialled = fg.interference_matrix(loss, fractions)
    assert abs(partialled.loc[1, 0]) < 0.03


def test_interference_is_nan_for_a_band_whose_share_never_changes():
    probe_loss = pd.DataFrame({0: np.linspace(3, 2, 6), 1: np.linspace(3, 2.5, 6)}, index=np.arange(6) * 10)
    fractions = pd.DataFrame({0: np.full(5, 0.5), 1: np.full(5, 0.5)}, index=probe_loss.index[1:])
    assert fg.interference_matrix(probe_loss, fractions).isna().all().all()


def test_step_band_tokens_from_lengths_uses_the_probe_band_convention():
    # band b holds (lo, hi]: a mean length of exactly 96 belongs to band 0, 97 to band 1; beyond every band: none
    wide = fg.step_band_tokens_from_lengths(
        np.array([1, 2, 3]), np.array([10, 20, 30]), np.array([96.0, 97.0, 5000.0]), [(0, 96), (96, 152)]
    )
    assert wide.index.tolist() == [1, 2]
    assert wide.to_numpy().tolist() == [[10, 0], [0, 20]]


def test_cycle_lag_found_from_a_periodic_bucket_sequence_and_falls_back_to_epoch():
    rng = np.random.default_rng(1)
    period = np.repeat(np.log([40.0, 120.0, 300.0]), 5)  # 3 buckets x 5 steps: a 15-step cycle
    composition = np.tile(period, 30) + 0.05 * rng.standard_normal(450)
    assert fg.estimate_cycle_lag(composition, steps_per_epoch=450) == fg.CycleLag(15, "composition")
    shuffled = rng.permutation(composition)
    assert fg.estimate_cycle_lag(shuffled, steps_per_epoch=225) == fg.CycleLag(225, "epoch")
    assert fg.estimate_cycle_lag(np.array([]), None) == fg.CycleLag(0, "none")


def test_loop_score_high_for_a_forgetting_loop_and_near_zero_when_mixed():
    rng = np.random.default_rng(2)
    steps = np.arange(1, 81) * 25
    trend = 3.0 - 0.3 * np.log(steps)
    cycle_evals = 4
    # a forgetting loop: the bands take turns, each one's loss rises while the other is trained
    wave = 0.05 * np.sin(2 * np.pi * np.arange(80) / cycle_evals)
    loop = pd.DataFrame({0: trend + wave, 1: trend - wave}, index=steps) + 0.002 * rng.standard_normal((80, 2))
    mixed = pd.DataFrame({0: trend, 1: trend + 0.2}, index=steps) + 0.02 * rng.standard_normal((80, 2))
    looped = fg.loop_score(loop, fg.CycleLag(100, "composition"))
    assert looped.lag_evals == 4
    assert looped.per_band[0] > 0.8 and looped.per_band[1] > 0.8
    assert abs(fg.loop_score(mixed, fg.CycleLag(100, "composition")).score) < 0.3


def test_loop_score_ignores_the_learning_curve_all_bands_share():
    steps = np.arange(1, 61) * 10
    # a steep shared learning curve with a bump every 5 evals: common to all bands, so not a loop
    shared = 20 * np.exp(-steps / 150) + 2 + 0.3 * (np.arange(60) % 5 == 0)
    frame = pd.DataFrame({0: shared, 1: 1.3 * shared, 2: 0.8 * shared}, index=steps)
    result = fg.loop_score(frame, fg.CycleLag(50, "composition"))
    assert np.isnan(result.score)  # nothing band-specific is left
    residuals = fg.probe_loss_residuals(frame)
    assert np.allclose(residuals.to_numpy(), 0, atol=1e-9)


def test_loop_score_is_nan_when_the_cycle_is_longer_than_the_probe_series():
    probe_loss = pd.DataFrame({0: np.linspace(3, 2, 6)}, index=np.arange(6) * 10)
    result = fg.loop_score(probe_loss, fg.CycleLag(500, "epoch"))
    assert np.isnan(result.score) and result.lag_evals == 50


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50))
def test_band_forgetting_bounds(acc):
    value = fg.band_forgetting(acc)
    assert 0.0 <= value <= fg.final_drop(acc) + 1e-12 or value <= max(acc) - min(acc) + 1e-12
    assert 0.0 <= value <= max(acc) - min(acc) + 1e-12
    assert 0.0 <= fg.final_drop(acc) <= 1.0
