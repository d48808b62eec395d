"""Throughput metrics: the one definition of padding efficiency, Ktok/s, ETA and overhead (docs/metrics.md).

Formulas (every caller in training, planner and analysis uses these functions):
    real tokens of a batch    = sum of its samples' lengths
    padded tokens of a batch  = rows x padded row length   (a packed row counts its used length)
    attention tokens of batch = the quadratic (attention) cost: rows x padded length^2, or, for a packed row with
                                per-document attention, the sum of squared document lengths
    padding efficiency        = sum(real) / sum(padded)                      over a window or an epoch plan
    Ktok/s                    = real input tokens per second, summed over all ranks, / 1000
                                live: EMA over steps; reported: median over the steady state (after warm-up)
    Ktok/s over time          = total real tokens / total step time / 1000 (the rate a run's ETA implies; the
                                planner's headline: with steps of unequal cost the median step can be far off it)
    ETA                       = remaining steps x EMA(step time)
    full-run ETA              = epochs x steps per epoch x step time
    ETA shown to people       = days and hours, hours and minutes, ... (format_eta: "4d 17h")
    wall time                 = setup + compute + data wait + scheduled evaluation + checkpointing + other,
                                summed over every segment of a resumed run (other: logging, bookkeeping)
    overhead fraction         = (data wait + other) / (compute + data wait + other): the training loop's own
                                overhead; scheduled evaluation and checkpointing are reported apart
    evaluation fraction       = scheduled evaluation (probes, tau) / wall time
    block tokens of a batch   = sum over its documents of anchors x block size (the draft's trained work; the
                                anchor rule: dflash_lab/sampling/anchors.py)
    block slots of a batch    = block tokens the draft runs: rows x the most block tokens of a row (padded),
                                or the block tokens (a packed row)
    block padding efficiency  = sum(block tokens) / sum(block slots)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenCounts:
    """Per-batch token counts of a list of batches (arrays of equal length, one entry per batch)."""

    real: np.ndarray       # sum of the documents' lengths
    padded: np.ndarray     # rows x longest (padded) | sum of lengths (packed row)
    attention: np.ndarray  # rows x longest^2 (padded) | sum of squared document lengths (packed row)


def batch_token_counts(batches: Sequence[np.ndarray], lengths: np.ndarray, *, packed: bool) -> TokenCounts:
    """The one definition of a batch's real, padded and attention tokens (module docstring), vectorised.

    Args:
        batches: index arrays into ``lengths``, one per batch (a packed batch is ONE row of several documents).
        lengths: effective length of every sample.
        packed: True when each batch is one packed row with per-document attention.

    Example:
        >>> counts = batch_token_counts([np.array([0, 1, 2])], np.array([3, 5, 4]), packed=False)
        >>> int(counts.real[0]), int(counts.padded[0]), int(counts.attention[0])
        (12, 15, 75)
        >>> int(batch_token_counts([np.array([0, 1, 2])], np.array([3, 5, 4]), packed=True).attention[0])
        50
    """
    sizes = batch_sizes(batches)
    if sizes.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return TokenCounts(empty, empty, empty)
    return flat_token_counts(np.asarray(lengths, dtype=np.int64)[np.concatenate(batches)], sizes, packed=packed)


def batch_sizes(batches: Sequence[np.ndarray]) -> np.ndarray:
    """Documents per batch (int64): what ``np.concatenate(batches)`` is cut into."""
    return np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))


def flat_token_counts(per_sample: np.ndarray, sizes: np.ndarray, *, packed: bool) -> TokenCounts:
    """:func:`batch_token_counts` from the batches' lengths laid end to end (``per_sample``, int64) and the
    number of documents of each batch (``sizes``): for a caller that has concatenated the plan already (an
    epoch plan holds ~10^5 batches; concatenating them dominates the cost).

    Example:
        >>> counts = flat_token_counts(np.array([3, 5, 4, 7]), np.array([3, 1]), packed=False)
        >>> counts.real.tolist(), counts.padded.tolist()
        ([12, 7], [15, 7])
    """
    if sizes.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return TokenCounts(empty, empty, empty)
    if np.any(sizes == 0):
        raise ValueError("a batch holds no sample; every batch needs at least one document")
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    real = np.add.reduceat(per_sample, starts)
    if packed:
        return TokenCounts(real, real.copy(), np.add.reduceat(per_sample * per_sample, starts))
    longest = np.maximum.reduceat(per_sample, starts)
    return TokenCounts(real, sizes * longest, sizes * longest * longest)


def token_counts(row_lengths: Sequence[int] | np.ndarray, *, packed: bool) -> tuple[int, int, int]:
    """(real, padded, attention) tokens of ONE batch from its documents' lengths (see batch_token_counts).

    Example:
        >>> token_counts([3, 5, 4], packed=False), token_counts([3, 5, 4], packed=True)
        ((12, 15, 75), (12, 12, 50))
    """
    rows = np.asarray(row_lengths, dtype=np.int64)
    if rows.size == 0:
        return 0, 0, 0
    counts = batch_token_counts([np.arange(rows.size)], rows, packed=packed)
    return int(counts.real[0]), int(counts.padded[0]), int(counts.attention[0])


def padding_efficiency(real_tokens: float | np.ndarray, padded: float | np.ndarray) -> float:
    """sum(real) / sum(padded); 1.0 means no padding. Accepts scalars or per-batch arrays.

    Example:
        >>> padding_efficiency([12, 8], [15, 10])
        0.8
    """
    real_sum = float(np.sum(real_tokens))
    padded_sum = float(np.sum(padded))
    if padded_sum <= 0:
        return float("nan")
    return real_sum / padded_sum


def ktok_per_s(real_tokens_all_ranks: float, seconds: float) -> float:
    """Real (non-pad) input tokens per second across all ranks, in thousands."""
    if seconds <= 0:
        return float("nan")
    return real_tokens_all_ranks / seconds / 1000.0


def ema_update(previous: float | None, value: float, alpha: float = 0.1) -> float:
    """Exponential moving average used for live Ktok/s and step time: prev + alpha x (value - prev)."""
    if previous is None or not np.isfinite(previous):
        return float(value)
    return float(previous + alpha * (value - previous))


def steady_state_ktok_s(ktok_s_per_step: Sequence[float] | np.ndarray, warmup_steps: int = 10) -> float:
    """Reported Ktok/s: median of per-step Ktok/s after the first `warmup_steps` steps (all steps if too few)."""
    values = np.asarray(ktok_s_per_step, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan")
    steady = values[warmup_steps:] if values.size > warmup_steps else values
    return float(np.median(steady))


def ktok_s_over_time(real_tokens_per_step: Sequence[float] | np.ndarray,
                     step_seconds: Sequence[float] | np.ndarray) -> float:
    """Ktok/s over time: the steps' real tokens (all ranks) summed over their times summed, / 1000.

    Example:
        >>> ktok_s_over_time([1000, 1000, 1000], [1.0, 1.0, 8.0])   # the median step says 1.0
        0.3
    """
    seconds = float(np.sum(step_seconds))
    if seconds <= 0:
        return float("nan")
    return float(np.sum(real_tokens_per_step)) / seconds / 1000.0


def eta_seconds(remaining_steps: int, step_time_s: float) -> float:
    """ETA = remaining steps x (EMA of) step time."""
    return float(max(remaining_steps, 0) * step_time_s)


def full_run_eta_seconds(epochs: float, steps_per_epoch: int, step_time_s: float) -> float:
    """ETA of a configured full run: epochs x steps per epoch x step time."""
    return float(epochs * steps_per_epoch * step_time_s)


def format_eta(seconds: float) -> str:
    """A duration for humans, the one ETA format of logs and planner: ``4d 17h``, ``3h 05m``, ``12m 30s``, ``45s``.

    Example:
        >>> format_eta(403200), format_eta(3725), format_eta(45.2), format_eta(float("nan"))
        ('4d 16h', '1h 02m', '45s', '?')
    """
    if not np.isfinite(seconds):
        return "?"
    seconds = int(round(max(seconds, 0)))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def overhead_fraction(compute_seconds: float, overhead_seconds: float) -> float:
    """The training loop's own overhead (data wait + logging + other) over the loop's time (module docstring).

    Example:
        >>> overhead_fraction(9.0, 1.0)
        0.1
    """
    loop = compute_seconds + overhead_seconds
    if loop <= 0:
        return float("nan")
    return float(min(max(overhead_seconds / loop, 0.0), 1.0))


def evaluation_fraction(eval_seconds: float, wall_seconds: float) -> float:
    """Scheduled evaluation (probes, tau) over the run's wall time (module docstring).

    Example:
        >>> evaluation_fraction(3.0, 60.0)
        0.05
    """
    if wall_seconds <= 0:
        return float("nan")
    return float(min(max(eval_seconds / wall_seconds, 0.0), 1.0))


def block_token_counts(batches: Sequence[np.ndarray], block_tokens: np.ndarray, *,
                       packed: bool) -> tuple[np.ndarray, np.ndarray]:
    """The one definition of a batch's block tokens and block slots (module docstring), vectorised.

    Args:
        batches: index arrays into ``block_tokens``, one per batch.
        block_tokens: block tokens of every sample (anchors x block size).
        packed: True when each batch is one packed row.

    Example:
        >>> trained, slots = block_token_counts([np.array([0, 1])], np.array([16, 48]), packed=False)
        >>> int(trained[0]), int(slots[0])
        (64, 96)
    """
    if not len(batches):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    sizes = np.fromiter((b.size for b in batches), dtype=np.int64, count=len(batches))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    per_sample = np.asarray(block_tokens, dtype=np.int64)[np.concatenate(batches)]
    trained = np.add.reduceat(per_sample, starts)
    return trained, (trained if packed else sizes * np.maximum.reduceat(per_sample, starts))
