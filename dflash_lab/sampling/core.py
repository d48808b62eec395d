"""Shared machinery of every batching policy: validation, token budgets, packing passes, steps.

A policy only decides *which samples go together and in what order*. Everything else lives here, once:

- ``validate_lengths``: the one check of a lengths array, wherever lengths enter (policies, boundary fitting,
  the planner): positive whole numbers up to ``MAX_LENGTH``, checked in the input's own dtype before any cast.
- ``TokenBudget``: when a padded batch is full. A row of length ``l`` costs ``l`` (or ``l + l^2/q`` with a quadratic
  term), a batch costs ``rows x max row cost`` and must stay ``<= max_tokens``; optionally ``rows <= max_samples``
  and, with ``max_block_tokens``, the batch's block tokens (its documents' anchors x block size, ``anchors.py``)
  ``<= max_block_tokens``: the second budget that bounds the draft's work, which tokens alone do not.
- ``pack_in_order``: greedy packing along a given order (one pass, O(N), memory O(N) whatever the budget), closing
  a batch at whichever budget (tokens, rows, block tokens) the next sample would break first;
  ``pack_real_tokens``: batches of about a target number of real tokens (sum of lengths) instead.
- ``group_into_steps``: turns a global batch list into steps of ``world_size`` batches. Batches are sorted by a cost
  key so the W batches of one step are neighbours in length (no rank waits on a much longer batch), and the
  incomplete last step is dropped or filled by repeating its sorted neighbours (``drop_last``).
  ``arrange_steps`` then shuffles the order of steps; ``bucket_run_order`` orders them in same-bucket runs.

Determinism: every random choice draws from ``epoch_rng(seed, epoch, stream)``, a ``numpy`` generator keyed by a
``SeedSequence``; a plan is a pure function of (lengths, policy config, seed, epoch, world size). ``policy.py`` holds
the policy base: what every policy shares (its arguments, sharding, the ``batch_sampler`` protocol, resumable state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config_check import as_choice, as_float, as_int

OVERLONG_MODES = ("error", "truncate", "drop")
# Longest sample a plan accepts: token positions are int32 in the models trained here, and squared lengths (the
# attention cost) must stay far inside int64. A larger value is a data error, never a length to cast.
MAX_LENGTH = 2**31 - 1
# Largest token budget: budgets are compared as float64, which is exact for integers up to 2^53.
MAX_BUDGET = 2**53


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """The generator for one (seed, epoch, stream): identical in every process and on every platform."""
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(epoch), int(stream)]))


def validate_lengths(lengths: Any) -> np.ndarray:
    """Check a lengths array at the door and return it as int64.

    Values are checked in the input's own dtype before the cast, so NaN, fractions, negative numbers and values
    too large for int64 (``1e30``, a ``uint64`` above 2^63) are refused instead of wrapping around.

    Raises:
        ValueError: not one-dimensional, empty, not numeric, non-whole, non-positive or above ``MAX_LENGTH``.

    Example:
        >>> validate_lengths([3.0, 5]).tolist()
        [3, 5]
        >>> validate_lengths([3, float("nan")])
        Traceback (most recent call last):
        ...
        ValueError: lengths must be whole token counts: index 1 holds nan; fix the dataset's length column
    """
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D array of sample lengths, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("lengths is empty: the dataset has no samples; check the data config (data.path, filters)")
    if arr.dtype.kind == "O":  # Python ints beyond int64, or mixed objects: numbers are compared as floats
        odd = [i for i, v in enumerate(arr) if isinstance(v, bool) or not isinstance(v, (int, float, np.number))]
        if odd:
            raise ValueError(
                f"lengths must be numbers (token counts): index {odd[0]} holds {arr[odd[0]]!r}; fix the dataset's "
                f"lengths"
            )
        arr = arr.astype(np.float64)
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"lengths must be integer token counts, got dtype {arr.dtype}; fix the dataset's lengths")
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            raise ValueError(
                f"lengths must be whole token counts: index {int(bad[0])} holds {arr[bad[0]].item()}; "
                f"fix the dataset's length column"
            )
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        raise ValueError(
            f"lengths must be positive: {bad.size} sample(s) have length <= 0 (first at index {int(bad[0])}, "
            f"length {arr[bad[0]].item()}); remove empty samples from the dataset"
        )
    bad = np.flatnonzero(arr > MAX_LENGTH)
    if bad.size:
        raise ValueError(
            f"lengths must be at most {MAX_LENGTH:,} tokens: {bad.size} sample(s) are longer (first at index "
            f"{int(bad[0])}, length {arr[bad[0]].item()}); the length column is corrupt or in the wrong unit"
        )
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True)
class TokenBudget:
    """When a padded batch is full: ``rows x max(row cost) <= max_tokens`` and ``rows <= max_samples``.

    Values are checked (``config_check``) before use: ``max_tokens`` a positive integer up to ``MAX_BUDGET``,
    ``max_samples`` a positive integer or None, ``quadratic_length`` a positive number or None.

    Args:
        max_tokens: padded token budget per rank per step.
        max_samples: optional cap on rows per batch.
        quadratic_length: optional q; a row of length l then costs ``l + l^2 / q`` (lhotse's ``quadratic_duration``
            idea: long rows cost more than linear because of attention).
        max_block_tokens: optional cap on a batch's block tokens (sum over its documents of anchors x block size;
            the per-sample counts come with the lengths, ``Admission.block_tokens``).

    Example:
        >>> TokenBudget(4096, quadratic_length=1024).longest_allowed()  # 1599 + 1599^2 / 1024 <= 4096
        1599
    """

    max_tokens: int
    max_samples: int | None = None
    quadratic_length: float | None = None
    max_block_tokens: int | None = None

    def __post_init__(self) -> None:
        max_tokens = as_int("sampler.max_tokens", self.max_tokens, minimum=1, maximum=MAX_BUDGET, example=4096)
        max_block_tokens = as_int("sampler.max_block_tokens", self.max_block_tokens, minimum=1, maximum=MAX_BUDGET,
                                  allow_none=True, example=65536)
        object.__setattr__(self, "max_block_tokens", max_block_tokens)
        max_samples = as_int("sampler.max_samples", self.max_samples, minimum=1, allow_none=True, example=64)
        q = as_float("sampler.quadratic_length", self.quadratic_length, allow_none=True, example=4096)
        if q is not None and q <= 0:
            raise ValueError(f"sampler.quadratic_length={q:g}: must be positive, or null for a linear row cost")
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "max_samples", max_samples)
        object.__setattr__(self, "quadratic_length", q)

    def row_cost(self, lengths: np.ndarray) -> np.ndarray:
        """Cost of a row of each length (monotone in length, so a batch's max cost is its longest row's)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        if self.quadratic_length is None:
            return lengths
        return lengths + lengths * lengths / float(self.quadratic_length)

    def longest_allowed(self) -> int:
        """Longest sample that fits alone in the budget."""
        if self.quadratic_length is None:
            return int(self.max_tokens)
        q, b = float(self.quadratic_length), float(self.max_tokens)
        # l + l^2/q <= b  <=>  l <= q/2 * (sqrt(1 + 4b/q) - 1)
        longest = int(np.floor(q / 2.0 * (np.sqrt(1.0 + 4.0 * b / q) - 1.0)))
        while longest > 0 and self.row_cost(np.array([longest]))[0] > b:
            longest -= 1
        return longest


@dataclass
class Admission:
    """Result of applying the overlong rule: the samples a plan may use and their effective lengths."""

    lengths: np.ndarray  # effective lengths (truncated where asked), one per sample
    kept: np.ndarray  # int64 indices of samples that take part in plans
    truncated: int = 0
    dropped: int = 0
    block_tokens: np.ndarray | None = None  # int64 block tokens per sample (anchors x block size), capped at the
    #                                          block budget; None: the plan has no block budget
    thinned: int = 0  # samples whose anchors alone exceed the block budget: capped to it (anchors thinned)


def cap_block_tokens(block_tokens: Any, size: int, max_block_tokens: int | None) -> tuple[np.ndarray | None, int]:
    """Per-sample block tokens checked and capped at the step's block budget: ``(capped, samples capped)``.

    A document whose anchors alone exceed ``max_block_tokens`` keeps ``max_block_tokens // block_size`` of them
    (the model applies the same cap, ``DFlashModel.max_block_tokens``); with a budget of at least the recipe's
    512 x 16 = 8,192 block tokens no document is ever capped.

    Example:
        >>> capped, n = cap_block_tokens([8, 4000, 16], 3, 1024)
        >>> capped.tolist(), n
        ([8, 1024, 16], 1)
    """
    if block_tokens is None:
        if max_block_tokens is not None:
            raise ValueError(
                "sampler.max_block_tokens needs the block tokens of every sample (anchors x block size under the "
                "model's anchor rule); the trainer and planner compute them (sampling.anchors), a direct "
                "build_policy call passes block_tokens=..."
            )
        return None, 0
    arr = np.asarray(block_tokens)
    if arr.shape != (size,) or arr.dtype.kind not in "iu" or (arr.size and int(arr.min()) < 0):
        raise ValueError(f"block_tokens must hold one non-negative integer per sample ({size}), got shape "
                         f"{arr.shape} dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if max_block_tokens is None:
        return arr, 0
    over = arr > max_block_tokens
    return np.minimum(arr, max_block_tokens), int(over.sum())


def admit(lengths: np.ndarray, longest_allowed: int, overlong: str, block_tokens: Any = None,
          max_block_tokens: int | None = None) -> Admission:
    """Apply ``overlong=error|truncate|drop`` to samples longer than ``longest_allowed``; never silently.
    Block tokens (optional) are checked and capped at ``max_block_tokens`` (``cap_block_tokens``)."""
    as_choice("sampler.overlong", overlong, OVERLONG_MODES)
    blocks, thinned = cap_block_tokens(block_tokens, lengths.size, max_block_tokens)
    admission = _admit_lengths(lengths, longest_allowed, overlong)
    admission.block_tokens, admission.thinned = blocks, thinned
    return admission


def _admit_lengths(lengths: np.ndarray, longest_allowed: int, overlong: str) -> Admission:
    too_long = lengths > longest_allowed
    n_over = int(too_long.sum())
    all_idx = np.arange(lengths.size, dtype=np.int64)
    if n_over == 0:
        return Admission(lengths=lengths, kept=all_idx)
    if overlong == "error":
        first = int(np.flatnonzero(too_long)[0])
        raise ValueError(
            f"{n_over} sample(s) are longer than the per-step budget allows ({longest_allowed} tokens; "
            f"the longest is {int(lengths.max())}, first at index {first}). Raise sampler.max_tokens, "
            f"or set sampler.overlong=truncate or sampler.overlong=drop to handle them explicitly"
        )
    if overlong == "truncate":
        return Admission(lengths=np.minimum(lengths, longest_allowed), kept=all_idx, truncated=n_over)
    return Admission(lengths=lengths, kept=all_idx[~too_long], dropped=n_over)


def pack_in_order(
    order: np.ndarray, row_cost: np.ndarray, budget: TokenBudget, block_tokens: np.ndarray | None = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """Greedy token-budget batches along ``order``: close a batch when the next row would break the budget.

    With ``budget.max_block_tokens`` and per-sample ``block_tokens``, a batch also closes when its block slots
    would exceed ``max_block_tokens``: like tokens, block tokens are padded to the batch's widest row (every row
    of a padded batch runs as many anchor slots as its row with the most anchors), so the test is ``rows x most
    block tokens <= max_block_tokens`` (each sample's count is at most the budget, ``cap_block_tokens``, so every
    sample fits alone).

    Cost: one pass over N samples in plain Python floats (about 0.1 us per sample; measured faster here than a
    vectorised binary-lifting variant, whose O(N log R) numpy passes cost more than the single loop), one slicing
    pass and one ``np.maximum.reduceat``. The budget test ``rows x widest <= max_tokens`` is precomputed as a
    per-row-count ceiling on the widest row, for at most min(N, budget / cheapest row) row counts: memory stays
    O(N) however large ``max_tokens`` is.

    Args:
        order: sample indices in the order they are consumed.
        row_cost: per-sample row cost (indexed by sample index), e.g. ``budget.row_cost(lengths)``.
        budget: the token budget.

    Returns:
        ``(batches, widest)``: int64 index arrays in order, and each batch's largest row cost (a sort key).

    Example:
        >>> batches, widest = pack_in_order(np.arange(4), np.array([3.0, 3.0, 5.0, 1.0]), TokenBudget(10))
        >>> [b.tolist() for b in batches], widest.tolist()
        ([[0, 1], [2, 3]], [3.0, 5.0])
    """
    if order.size == 0:
        return [], np.zeros(0)
    ordered_costs = row_cost[order]
    limit = float(budget.max_tokens)
    # No batch holds more rows than the budget divided by the cheapest row, nor more than there are samples.
    cap = min(int(limit // float(ordered_costs.min())), int(order.size))
    if budget.max_samples:
        cap = min(cap, int(budget.max_samples))
    # allowed[r]: the widest row a batch may have once it holds r+1 rows; -1 closes a batch at the row cap.
    allowed = [limit / (rows + 1) for rows in range(cap)] + [-1.0]
    cuts: list[int] = []
    close = cuts.append
    rows, widest = 0, 0.0
    if budget.max_block_tokens is None or block_tokens is None:
        for position, cost in enumerate(ordered_costs.tolist()):
            if cost > widest:
                widest = cost
            if widest > allowed[rows]:
                close(position)
                rows, widest = 1, cost
            else:
                rows += 1
    else:  # the same pass with the widest row's block tokens (a separate loop keeps the common case fast)
        block_limit, widest_block = int(budget.max_block_tokens), 0
        for position, (cost, block) in enumerate(zip(ordered_costs.tolist(), block_tokens[order].tolist())):
            if cost > widest:
                widest = cost
            if block > widest_block:
                widest_block = block
            if widest > allowed[rows] or (rows + 1) * widest_block > block_limit:
                close(position)
                rows, widest, widest_block = 1, cost, block
            else:
                rows += 1
    return split_at(order, cuts), np.maximum.reduceat(ordered_costs, np.asarray([0, *cuts], dtype=np.int64))


def pack_real_tokens(
    order: np.ndarray, lengths: np.ndarray, target: int, max_samples: int | None = None,
    block_tokens: np.ndarray | None = None, max_block_tokens: int | None = None,
) -> list[np.ndarray]:
    """Greedy batches along ``order`` of about ``target`` real tokens each (sum of lengths), ``rows <= max_samples``.

    A batch closes at the sample boundary nearest to ``target``: the next sample joins when the batch would then
    overshoot the target by no more than it now falls short. So a batch holds at most ``target + longest / 2`` real
    tokens and the mean lands close to ``target`` (a strict ``<= target`` rule would fall short by about half a
    mean sample length). Padding is not looked at. With ``max_block_tokens`` a batch also closes before its padded
    block slots (rows x most block tokens, as in ``pack_in_order``) would exceed that budget. Cost: one O(N) pass
    in plain Python ints.

    Example:
        >>> [b.tolist() for b in pack_real_tokens(np.arange(5), np.array([4, 4, 2, 9, 2]), 9)]
        [[0, 1, 2], [3], [4]]
    """
    cap = int(max_samples) if max_samples else int(order.size)
    twice_target = 2 * int(target)
    cuts: list[int] = []
    total = rows = widest_block = 0
    block_limit = int(max_block_tokens) if max_block_tokens is not None and block_tokens is not None else None
    block_of = block_tokens[order].tolist() if block_limit is not None else [0] * order.size
    for position, (length, block) in enumerate(zip(lengths[order].tolist(), block_of)):
        over_blocks = block_limit is not None and (rows + 1) * max(widest_block, block) > block_limit
        if rows and (rows == cap or 2 * total + length > twice_target or over_blocks):  # overshoot > shortfall
            cuts.append(position)
            total = rows = widest_block = 0
        total += length
        rows += 1
        widest_block = max(widest_block, block)
    return split_at(order, cuts)


def split_at(values: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    """``np.split(values, cuts)`` as views, about 4x faster for many small pieces (np.split loops in Python)."""
    return list(map(values.__getitem__, map(slice, [0, *cuts], [*cuts, values.size])))


@dataclass
class StepPlan:
    """One epoch's global plan: ``batches`` in consumption order, ``len(batches) == steps * world_size``."""

    batches: list[np.ndarray]
    world_size: int
    repeated_samples: int = 0  # samples seen twice this epoch to give every rank the same step count
    dropped_samples: int = 0  # samples left out this epoch by drop_last

    @property
    def steps(self) -> int:
        return len(self.batches) // self.world_size


@dataclass
class Steps:
    """Batches grouped into steps: ``index[s]`` holds the W batch indices of step s (in sort-key order)."""

    index: np.ndarray  # int64 [steps, world_size]
    repeated_samples: int
    dropped_samples: int

    def plan(self, batches: list[np.ndarray], order: np.ndarray | None = None) -> StepPlan:
        """The StepPlan taking steps in ``order`` (default: sort-key order)."""
        index = self.index if order is None else self.index[order]
        return StepPlan([batches[i] for i in index.ravel()], self.index.shape[1], self.repeated_samples,
                        self.dropped_samples)


def group_into_steps(batches: list[np.ndarray], sort_key: np.ndarray, world_size: int, *, drop_last: bool) -> Steps:
    """Group batches into steps of ``world_size`` neighbours in cost (steps in sort-key order).

    Remainder rule: when the batch count is not a multiple of W, ``drop_last=True`` drops the last incomplete step
    (its samples are counted in ``dropped_samples``); ``drop_last=False`` fills it with copies of the batches just
    before it in cost order (counted in ``repeated_samples``), so every rank runs the same number of steps.

    Args:
        batches: the epoch's batches in any order.
        sort_key: one number (or a row of a 2-D key, lexicographic) per batch; steps take neighbours in this order.
        world_size: ranks per step.
        drop_last: remainder rule above.
    """
    n = len(batches)
    if n == 0:
        return Steps(np.zeros((0, world_size), dtype=np.int64), 0, 0)
    key = np.asarray(sort_key)
    ordered = np.lexsort(key.T[::-1]) if key.ndim == 2 else np.argsort(key, kind="stable")
    remainder = n % world_size
    repeated = dropped = 0
    if remainder:
        if drop_last:
            tail = ordered[n - remainder :]
            dropped = int(sum(batches[i].size for i in tail))
            ordered = ordered[: n - remainder]
        else:
            missing = world_size - remainder
            # Repeat the closest preceding batches in cost order (cycling if there are fewer than `missing`).
            fill = np.resize(ordered[::-1][remainder:] if n > remainder else ordered, missing)
            repeated = int(sum(batches[i].size for i in fill))
            ordered = np.concatenate([ordered, fill])
    return Steps(ordered.reshape(-1, world_size).astype(np.int64), repeated, dropped)


def arrange_steps(
    batches: list[np.ndarray],
    sort_key: np.ndarray,
    world_size: int,
    rng: np.random.Generator,
    *,
    drop_last: bool,
) -> StepPlan:
    """``group_into_steps``, then shuffle the order of steps."""
    steps = group_into_steps(batches, sort_key, world_size, drop_last=drop_last)
    return steps.plan(batches, rng.permutation(steps.index.shape[0]))


def bucket_run_order(
    step_bucket: np.ndarray, rng: np.random.Generator, *, run_length: int = 1, sequential: bool = False
) -> np.ndarray:
    """Consumption order of steps in runs of consecutive same-bucket steps.

    ``run_length=1``: one permutation of all steps (exactly ``arrange_steps``'s shuffle). ``run_length=R > 1``:
    each bucket's steps are shuffled, cut into runs of R consecutive steps (a bucket's last run may be shorter),
    and the runs are shuffled. ``sequential=True``: each bucket's steps shuffled, buckets in ascending id order.

    Args:
        step_bucket: the bucket id of each step.
        rng: the epoch's generator.
        run_length: R, steps per same-bucket run.
        sequential: visit the buckets in order (runs are whole buckets).

    Returns:
        A permutation of ``range(len(step_bucket))``.

    Example:
        >>> buckets = np.array([1, 0, 1, 0, 1, 0])
        >>> buckets[bucket_run_order(buckets, np.random.default_rng(0), sequential=True)].tolist()
        [0, 0, 0, 1, 1, 1]
        >>> buckets[bucket_run_order(buckets, np.random.default_rng(0), run_length=3)].tolist() in (
        ...     [0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0])
        True
    """
    bucket = np.asarray(step_bucket)
    n = bucket.size
    if run_length == 1 and not sequential:
        return rng.permutation(n)
    shuffled = rng.permutation(n)
    within = shuffled[np.argsort(bucket[shuffled], kind="stable")]  # buckets ascending, shuffled inside
    if sequential or n == 0:
        return within
    sorted_bucket = bucket[within]
    starts = np.flatnonzero(np.r_[True, sorted_bucket[1:] != sorted_bucket[:-1]])
    position_in_bucket = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    run_id = np.cumsum((position_in_bucket % run_length) == 0) - 1
    run_rank = np.argsort(rng.permutation(run_id[-1] + 1))  # run r is consumed run_rank[r]-th
    return within[np.argsort(run_rank[run_id], kind="stable")]
