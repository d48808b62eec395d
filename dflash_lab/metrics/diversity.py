"""Plan diversity: how random a policy's batches are (docs/metrics.md, "Plan diversity"). One definition each.

Formulas:
    composition repeat       = fraction of epoch e+1 batches identical (as sets) to some epoch e batch
    adjacent-length corr.    = Pearson corr(mean length of batch t, mean length of batch t+1), consumption order
    bucket run length        = mean length of runs of consecutive steps drawn from the same bucket
    within-batch spread      = mean over batches of the coefficient of variation (std / mean) of their lengths
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _batch_keys(batches: Sequence[np.ndarray]) -> set[bytes]:
    return {np.sort(b).astype(np.int64).tobytes() for b in batches}


def composition_repeat(batches_before: Sequence[np.ndarray], batches_after: Sequence[np.ndarray]) -> float:
    """Fraction of ``batches_after`` whose sample set equals some batch of ``batches_before``.

    Example:
        >>> composition_repeat([np.array([1, 2]), np.array([3])], [np.array([2, 1]), np.array([3, 4])])
        0.5
    """
    if len(batches_after) == 0:
        return float("nan")
    seen = _batch_keys(batches_before)
    hits = sum(np.sort(b).astype(np.int64).tobytes() in seen for b in batches_after)
    return hits / len(batches_after)


def batch_reduce(batches: Sequence[np.ndarray], values: np.ndarray, ufunc: np.ufunc = np.add) -> np.ndarray:
    """Per-batch reduction of ``values[sample]`` (sum by default) without a Python loop over samples."""
    sizes = np.fromiter((b.size for b in batches), dtype=np.int64, count=len(batches))
    if sizes.size == 0:
        return np.zeros(0)
    flat = values[np.concatenate(batches)]
    return ufunc.reduceat(flat, np.concatenate([[0], np.cumsum(sizes)[:-1]]))


def batch_mean_lengths(batches: Sequence[np.ndarray], lengths: np.ndarray) -> np.ndarray:
    sizes = np.fromiter((b.size for b in batches), dtype=np.float64, count=len(batches))
    return batch_reduce(batches, lengths.astype(np.float64)) / np.maximum(sizes, 1)


def adjacent_length_correlation(mean_lengths: np.ndarray) -> float:
    """Pearson correlation between consecutive batches' mean lengths (0: no order; near 1: sorted runs)."""
    x = np.asarray(mean_lengths, dtype=np.float64)
    if x.size < 3 or np.std(x[:-1]) == 0 or np.std(x[1:]) == 0:
        return float("nan")
    return float(np.corrcoef(x[:-1], x[1:])[0, 1])


def bucket_run_length(bucket_sequence: np.ndarray) -> float:
    """Mean length of runs of equal consecutive bucket ids (1 = the bucket changes every step).

    Example:
        >>> bucket_run_length(np.array([0, 0, 1, 2, 2, 2]))
        2.0
    """
    seq = np.asarray(bucket_sequence)
    if seq.size == 0:
        return float("nan")
    runs = 1 + int(np.count_nonzero(seq[1:] != seq[:-1]))
    return seq.size / runs


def within_batch_spread(batches: Sequence[np.ndarray], lengths: np.ndarray) -> float:
    """Mean coefficient of variation of lengths inside a batch (0 = every batch length-homogeneous)."""
    if len(batches) == 0:
        return float("nan")
    sizes = np.fromiter((b.size for b in batches), dtype=np.float64, count=len(batches))
    lengths = lengths.astype(np.float64)
    mean = batch_reduce(batches, lengths) / sizes
    mean_sq = batch_reduce(batches, lengths * lengths) / sizes
    std = np.sqrt(np.maximum(mean_sq - mean * mean, 0.0))
    return float(np.mean(std / mean))
