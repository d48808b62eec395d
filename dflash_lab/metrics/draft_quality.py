"""Draft-quality metrics, each defined once (docs/metrics.md, "Draft quality").

    accuracy                      = argmax-correct share over supervised block slots 1..bs-1
    per-position accuracy acc_k   = correct_k / count_k for slot k
    estimated acceptance length   = 1 + sum_k prod_(i<=k) acc_i
    acceptance length tau         = mean over verify steps of (accepted draft tokens + 1)

Cost: O(block size) and O(verify steps).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def per_position_accuracy(correct: Sequence[float] | np.ndarray, count: Sequence[float] | np.ndarray) -> np.ndarray:
    """acc_k = correct_k / count_k (0 where a slot was never supervised).

    Example:
        >>> per_position_accuracy([3, 1], [4, 4]).tolist()
        [0.75, 0.25]
    """
    correct = np.asarray(correct, dtype=np.float64)
    count = np.asarray(count, dtype=np.float64)
    return np.divide(correct, count, out=np.zeros_like(correct), where=count > 0)


def estimated_acceptance_length(per_position_acc: Sequence[float] | np.ndarray) -> float:
    """1 + sum_k prod_(i<=k) acc_i: expected accepted tokens + 1 if slot errors were independent.

    Example:
        >>> estimated_acceptance_length([0.5, 0.5])
        1.75
    """
    acc = np.clip(np.asarray(per_position_acc, dtype=np.float64), 0.0, 1.0)
    return float(1.0 + np.cumprod(acc).sum())


def acceptance_length_tau(accepted_per_step: Sequence[int] | np.ndarray) -> float:
    """tau = mean over verify steps of (accepted + 1); NaN when there was no verify step.

    Example:
        >>> acceptance_length_tau([0, 2, 1])
        2.0
    """
    accepted = np.asarray(accepted_per_step, dtype=np.float64)
    if accepted.size == 0:
        return float("nan")
    return float(np.mean(accepted + 1.0))
