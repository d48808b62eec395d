"""Plan-diversity metrics (dflash_lab.metrics.diversity): known answers on hand-built batches."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dflash_lab.metrics import diversity as dv


def arrays(*batches):
    return [np.asarray(b, dtype=np.int64) for b in batches]


def test_composition_repeat_counts_identical_sets():
    before = arrays([0, 1], [2, 3], [4])
    assert dv.composition_repeat(before, arrays([1, 0], [2, 4], [3])) == pytest.approx(1 / 3)  # order inside ignored
    assert dv.composition_repeat(before, arrays([4], [3, 2], [0, 1])) == 1.0  # same batches, new order
    assert dv.composition_repeat(before, arrays([0, 1, 2], [3, 4])) == 0.0  # supersets are new batches
    assert dv.composition_repeat(before, [np.array([0, 1], dtype=np.int32)]) == 1.0  # dtype does not matter
    assert math.isnan(dv.composition_repeat(before, []))


def test_batch_reduce_and_mean_lengths():
    lengths = np.array([1, 2, 3, 10])
    batches = arrays([0, 1], [2, 3], [3])
    assert dv.batch_reduce(batches, lengths).tolist() == [3, 13, 10]
    assert dv.batch_reduce(batches, lengths, np.maximum).tolist() == [2, 10, 10]
    assert dv.batch_mean_lengths(batches, lengths).tolist() == [1.5, 6.5, 10.0]
    assert dv.batch_reduce([], lengths).size == 0


def test_adjacent_length_correlation():
    assert dv.adjacent_length_correlation(np.array([1.0, 2, 3, 4])) == pytest.approx(1.0)
    assert dv.adjacent_length_correlation(np.array([1.0, 3, 1, 3, 1])) == pytest.approx(-1.0)
    # pairs (1,2), (2,4), (4,3): deviations (-4/3, -1/3, 5/3) and (-1, 1, 0): cov 1, variances 42/9 and 2
    assert dv.adjacent_length_correlation(np.array([1.0, 2, 4, 3])) == pytest.approx(1 / np.sqrt(42 / 9 * 2))
    assert math.isnan(dv.adjacent_length_correlation(np.array([5.0, 5, 5, 5])))  # no variation
    assert math.isnan(dv.adjacent_length_correlation(np.array([1.0, 2])))  # too short


def test_bucket_run_length():
    assert dv.bucket_run_length(np.array([0, 0, 1, 2, 2, 2])) == 2.0
    assert dv.bucket_run_length(np.array([0, 1, 0, 1])) == 1.0
    assert dv.bucket_run_length(np.array([3, 3, 3])) == 3.0
    assert dv.bucket_run_length(np.array([7])) == 1.0
    assert math.isnan(dv.bucket_run_length(np.array([], dtype=np.int64)))


def test_within_batch_spread():
    lengths = np.array([2, 4, 5, 10, 10])
    # [2, 4]: mean 3, population std 1 -> CV 1/3;  [5]: 0;  [10, 10]: 0
    assert dv.within_batch_spread(arrays([0, 1], [2], [3, 4]), lengths) == pytest.approx((1 / 3) / 3)
    assert dv.within_batch_spread(arrays([0, 1, 2, 3, 4]), lengths) == pytest.approx(np.std(lengths) / np.mean(lengths))
    assert math.isnan(dv.within_batch_spread([], lengths))
