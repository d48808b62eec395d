"""Draft-quality metrics, each defined once (docs/metrics.md, "Draft quality").

    accuracy                      = argmax-correct share over supervised block slots 1..bs-1
    per-position accuracy acc_k   = correct_k / count_k for slot k
    estimated acceptance length   = 1 + sum_k prod_(i<=k) acc_i
    acceptance length tau         = mean over verify steps of (accepted draft tokens + 1)
    standard error of tau         = std over 1000 prompt resamples (seed 0) of sum(accepted + 1) / verify steps

Cost: O(block size) and O(verify steps); the bootstrap O(resamples x prompts).
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


def tau_bootstrap_se(accepted_per_prompt: Sequence[Sequence[int]], resamples: int = 1000, seed: int = 0) -> float:
    """Prompt-bootstrap standard error of tau: draw the prompts with replacement ``resamples`` times, tau of a
    resample = sum over its prompts of sum(accepted + 1) / its verify steps, SE = their standard deviation (ddof 1).

    Prompts are the unit that is resampled because a prompt's verify steps are correlated (an easy continuation
    accepts long blocks throughout). A resample without a verify step is left out; NaN with fewer than two prompts
    holding one. The fixed ``seed`` makes the figure reproducible.

    Cost: O(resamples x prompts) after one pass over the steps.

    Example:
        >>> round(tau_bootstrap_se([[0, 2], [1, 1, 3], [0], [2, 2]]), 2)
        0.31
        >>> tau_bootstrap_se([[1, 2]])
        nan
    """
    tokens = np.asarray([sum(steps) + len(steps) for steps in accepted_per_prompt], dtype=np.float64)
    steps = np.asarray([len(steps) for steps in accepted_per_prompt], dtype=np.float64)
    if int((steps > 0).sum()) < 2:
        return float("nan")
    picks = np.random.default_rng(seed).integers(0, len(steps), size=(resamples, len(steps)))
    resampled_steps = steps[picks].sum(axis=1)
    kept = resampled_steps > 0
    taus = tokens[picks].sum(axis=1)[kept] / resampled_steps[kept]
    return float(np.std(taus, ddof=1)) if taus.size >= 2 else float("nan")
