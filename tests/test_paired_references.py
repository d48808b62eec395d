"""analysis/paired.py against the reference implementations of the same statistics: scipy's permutation test and
BCa bootstrap, statsmodels' Holm adjustment and paired TOST. The project keeps its own small implementations (exact
sign flips at 5 seeds, one resampling shared by interval and test, NaN-aware Holm); these tests pin them to the
references on the data shapes the sweeps produce (5-16 paired seeds)."""

import numpy as np
import pytest
from scipy import stats

from dflash_lab.analysis import paired

multitest = pytest.importorskip("statsmodels.stats.multitest")
weightstats = pytest.importorskip("statsmodels.stats.weightstats")

RNG = np.random.default_rng(20261203)
SAMPLES = [RNG.normal(loc, scale, size=n) for n, loc, scale in
           [(5, 0.0, 1.0), (5, 1.5, 1.0), (6, 0.3, 0.2), (8, -0.02, 0.05), (10, 0.01, 0.01), (12, 0.5, 2.0)]]


def _mean(x, axis=-1):
    return np.mean(x, axis=axis)


@pytest.mark.parametrize("d", SAMPLES, ids=[f"n{len(d)}_{i}" for i, d in enumerate(SAMPLES)])
def test_sign_flip_p_value_equals_scipys_exact_permutation_test(d):
    reference = stats.permutation_test((d,), _mean, permutation_type="samples", n_resamples=np.inf,
                                       alternative="two-sided", vectorized=True)
    assert paired.sign_flip_p_value(d) == pytest.approx(reference.pvalue, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("d", SAMPLES[2:], ids=[f"n{len(d)}" for d in SAMPLES[2:]])
def test_percentile_interval_agrees_with_scipys_bootstrap(d):
    reference = stats.bootstrap((d,), _mean, method="percentile", n_resamples=20_000, vectorized=True,
                                random_state=np.random.default_rng(1)).confidence_interval
    low, high = paired.bootstrap_interval(d)
    width = reference.high - reference.low
    assert abs(low - reference.low) < 0.05 * width and abs(high - reference.high) < 0.05 * width


@pytest.mark.parametrize("d", [s for s in SAMPLES if len(s) >= 5 and 0.005 < paired.bca_p_value(s) < 0.5],
                         ids=lambda d: f"n{len(d)}")
def test_bca_p_value_is_where_scipys_bca_interval_reaches_zero(d):
    """Inverting the BCa interval: at confidence 1 - p the interval's nearer end sits at 0; a clearly wider interval
    (1 - 0.7p) holds 0, a clearly narrower one (1 - 1.4p) does not (the margins absorb resampling noise)."""
    p = paired.bca_p_value(d)

    def holds_zero(level):
        ci = stats.bootstrap((d,), _mean, method="BCa", confidence_level=level, n_resamples=20_000,
                             vectorized=True, random_state=np.random.default_rng(2)).confidence_interval
        return ci.low <= 0.0 <= ci.high

    assert holds_zero(1 - 0.7 * p)
    assert not holds_zero(1 - 1.4 * p)


def test_holm_equals_statsmodels_multipletests():
    for p_values in ([0.01, 0.04, 0.03], [0.2, 0.001, 0.049, 0.5, 0.012], [0.5, 0.5], [1e-6]):
        expected = multitest.multipletests(p_values, method="holm")[1]
        np.testing.assert_allclose(paired.holm(p_values), expected, rtol=1e-12)


def test_holm_leaves_nan_out_of_the_family_as_statsmodels_would_without_it():
    p_values = [0.01, np.nan, 0.04, 0.03]
    adjusted = paired.holm(p_values)
    assert np.isnan(adjusted[1])
    np.testing.assert_allclose(adjusted[[0, 2, 3]], multitest.multipletests([0.01, 0.04, 0.03], method="holm")[1])


@pytest.mark.parametrize("margin", [0.05, 0.2, 1.0])
@pytest.mark.parametrize("d", SAMPLES, ids=[f"n{len(d)}_{i}" for i, d in enumerate(SAMPLES)])
def test_tost_equals_statsmodels_ttost_paired(d, margin):
    arm, baseline = 10.0 + d, np.full_like(d, 10.0)   # paired values whose differences are d
    expected = weightstats.ttost_paired(arm, baseline, -margin, margin)[0]
    assert paired.tost_p_value(d, margin) == pytest.approx(expected, rel=1e-9, abs=1e-12)
