"""Bucket boundaries: validation, assignment, and fitting from a lengths array.

Convention: boundaries ``[b0=0 < b1 < ... < bK]``; a sample of length l is in bucket k when ``b_k < l <= b_(k+1)``.

Fitting methods (``fit_boundaries``):
- ``quantile``: equal sample count per bucket (cut at the i/K quantiles). O(N log N).
- ``equal_tokens``: equal total tokens per bucket (cut where the cumulative token count crosses i/K). O(N log N).
- ``optimal``: minimise expected padded tokens when every sample is padded to its bucket's longest length,
  ``sum_k count_k x b_(k+1)``, by exact dynamic programming over candidate upper bounds (the distinct lengths, or
  ``max_candidates`` quantile-spaced ones when there are more). Greedy token-budget batches inside a shuffled bucket
  are padded to a batch maximum close to the bucket's top, so this is the padding the bucketed policy pays, as an
  upper bound. O(K x D^2) vectorised over D candidates (D <= 2048 by default: well under a second).

Lengths enter through ``core.validate_lengths`` (positive whole numbers that fit int64, checked before any cast);
``sampling.stats.smallest_k_for_efficiency`` picks the fewest fitted buckets whose measured plan reaches a target.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Sequence

import numpy as np

from ..config_check import as_choice, as_int, refuse_unknown_keys
from ..metrics.bands import bucket_ids  # noqa: F401  (re-exported: sampling.bucket_ids)
from .core import MAX_LENGTH, validate_lengths

FIT_METHODS = ("quantile", "equal_tokens", "optimal")


def validate_boundaries(
    boundaries: Sequence[Any], longest: int | None = None, *, key: str = "sampler.boundaries"
) -> list[int]:
    """Check a boundary list and return it as plain ints (``key`` is the config key named in errors).

    Raises:
        ValueError: fewer than two entries, non-integers, first not 0, not strictly increasing (unsorted or
            duplicate), or a last boundary below the longest sample.

    Example:
        >>> validate_boundaries([0, 770, 1216, 8192], longest=5000)
        [0, 770, 1216, 8192]
    """
    if isinstance(boundaries, (str, bytes, Mapping)) or not isinstance(boundaries, Iterable):
        raise ValueError(f"{key}={boundaries!r}: must be a list of integers like [0, 770, 1216, 8192]")
    values = list(boundaries)
    if len(values) < 2:
        raise ValueError(f"{key}={values}: needs at least two entries [0, longest] (one bucket)")
    as_ints = []
    for v in values:
        try:
            as_ints.append(as_int(key, v, maximum=MAX_LENGTH))
        except ValueError:
            raise ValueError(f"{key}={values}: {v!r} is not an integer token length up to {MAX_LENGTH:,}") from None
    if as_ints[0] != 0:
        raise ValueError(f"{key}={as_ints}: the first boundary must be 0 (got {as_ints[0]}); prepend 0")
    steps = np.diff(as_ints)
    if np.any(steps <= 0):
        i = int(np.flatnonzero(steps <= 0)[0])
        kind = "duplicate" if steps[i] == 0 else "unsorted"
        raise ValueError(
            f"{key}={as_ints}: {kind} entries {as_ints[i]} and {as_ints[i + 1]}; "
            f"boundaries must be strictly increasing"
        )
    if longest is not None and as_ints[-1] < longest:
        raise ValueError(
            f"{key}={as_ints}: the last boundary {as_ints[-1]} is below the longest sample ({longest}); "
            f"raise it to at least {longest}"
        )
    return as_ints


def empty_bucket_warning(boundaries: Sequence[int], lengths: np.ndarray,
                         key: str = "sampler.boundaries") -> str | None:
    """What to say when some buckets of ``boundaries`` hold none of ``lengths`` (a list that reaches past the longest
    sample, or a gap in the lengths): such a bucket makes no batch, so the run has fewer buckets than its list
    says. The fix drops each empty bucket's upper boundary (merging it into the next; the last one's ends the list
    at the boundary below it, which still covers the longest sample). None when every bucket holds a sample.

    Example:
        >>> print(empty_bucket_warning([0, 96, 1024, 2048], np.array([50, 300, 987])))
        sampler.boundaries=[0, 96, 1024, 2048]: bucket 2 (1024, 2048] holds no sample (the longest is 987 tokens), so it makes no batch: this run has 2 buckets, not 3. Drop the empty buckets' upper boundaries to say so: sampler.boundaries=[0,96,1024]
    """
    ids = bucket_ids(lengths, boundaries)
    counts = np.bincount(ids[ids >= 0], minlength=len(boundaries) - 1)
    empty = np.flatnonzero(counts == 0).tolist()
    if not empty or len(empty) == len(counts):
        return None
    shown = ", ".join(f"{k} ({boundaries[k]}, {boundaries[k + 1]}]" for k in empty)
    kept = [b for i, b in enumerate(boundaries) if i == 0 or i - 1 not in empty]
    several = len(empty) > 1
    return (f"{key}={list(boundaries)}: bucket{'s' if several else ''} {shown} "
            f"{'hold' if several else 'holds'} no sample (the longest is {int(np.max(lengths))} tokens), so "
            f"{'they make' if several else 'it makes'} no batch: this run has {len(counts) - len(empty)} buckets, not "
            f"{len(counts)}. Drop the empty buckets' upper boundaries to say so: {key}=[{','.join(map(str, kept))}]")


def fit_boundaries(
    lengths: np.ndarray, num_buckets: int, method: str = "optimal", *, max_candidates: int = 2048, **unknown: Any
) -> list[int]:
    """Fit bucket boundaries to a lengths array.

    Args:
        lengths: sample lengths (checked by ``core.validate_lengths``).
        num_buckets: K, the number of buckets (fewer are returned when there are fewer distinct lengths).
        method: ``quantile``, ``equal_tokens`` or ``optimal`` (see the module docstring).
        max_candidates: ``optimal`` only: cap on candidate upper bounds for the dynamic program.
        **unknown: refused (a misspelt option must never fall back to a default).

    Returns:
        ``[0, b1, ..., bK]`` with ``bK = max(lengths)``.

    Raises:
        ValueError: bad lengths, ``num_buckets``, ``method`` or an unknown option (the message names it).

    Example:
        >>> fit_boundaries(np.array([1, 2, 3, 4, 10, 11, 12, 13]), 2, "quantile")
        [0, 4, 13]
    """
    refuse_unknown_keys("fit_boundaries", unknown, ["max_candidates"])
    max_candidates = as_int("max_candidates", max_candidates, minimum=2)
    k = as_int("sampler.num_buckets", num_buckets, minimum=1, example=6)
    as_choice("sampler.fit_method", method, FIT_METHODS)
    lengths = validate_lengths(lengths)
    longest = int(lengths.max())
    if method == "optimal":
        inner = _optimal_uppers(lengths, k, max_candidates)
    else:
        ordered = np.sort(lengths)
        if method == "quantile":
            positions = (np.arange(1, k) * ordered.size) // k
        else:
            cumulative = np.cumsum(ordered)
            positions = np.searchsorted(cumulative, np.arange(1, k) * cumulative[-1] / k, side="left")
        inner = ordered[np.clip(positions - 1, 0, ordered.size - 1)].tolist()
    cuts = sorted({int(b) for b in inner if 0 < b < longest})
    return [0, *cuts, longest]


def _optimal_uppers(lengths: np.ndarray, k: int, max_candidates: int) -> list[int]:
    """Exact DP: choose K upper bounds minimising sum over buckets of count x upper bound."""
    values, counts = np.unique(lengths, return_counts=True)
    if values.size > max_candidates:
        # Quantile-spaced candidates keep the DP small; the optimum is exact over this candidate set.
        picks = np.unique(np.quantile(values.repeat(counts), np.linspace(0, 1, max_candidates), method="higher"))
        keep = np.searchsorted(values, picks)
        cum = np.concatenate([[0], np.cumsum(counts)])
        values, counts = values[keep], np.diff(np.concatenate([[0], cum[keep + 1]]))
    d = values.size
    k = min(k, d)
    upper = np.concatenate([[0.0], values.astype(np.float64)])  # candidate 0 = the virtual boundary 0
    below = np.concatenate([[0.0], np.cumsum(counts, dtype=np.float64)])  # samples <= candidate
    best = below * upper  # one bucket (0, upper_j]
    choice = np.zeros((k, d + 1), dtype=np.int64)
    invalid = np.tril(np.ones((d + 1, d + 1), dtype=bool))  # i >= j: a bucket must be non-empty
    for buckets in range(1, k):
        # cost[i, j] = best[i] + (below[j] - below[i]) * upper[j]
        cost = best[:, None] + (below[None, :] - below[:, None]) * upper[None, :]
        cost[invalid] = np.inf
        choice[buckets] = np.argmin(cost, axis=0)
        best = cost[choice[buckets], np.arange(d + 1)]
    cuts, j = [], d
    for buckets in range(k - 1, 0, -1):
        j = int(choice[buckets, j])
        cuts.append(int(upper[j]))
    return sorted(cuts)

