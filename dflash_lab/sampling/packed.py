"""packed: documents packed into rows of at most ``max_tokens`` real tokens, trained with per-document attention.

Algorithm: each epoch draw a random order of all documents and cut it into chunks of about ``chunk_rows`` rows'
worth of tokens. Each chunk is bin-packed with best-fit-decreasing (longest document first, into the open row with
the least sufficient free space; ``best_fit_decreasing``). A chunk's underfull rows (more than
``CARRY_FREE_SHARE`` of the row free; at most a sixteenth of the chunk's rows, emptiest first) are not emitted: they
stay open into the next chunk, whose documents fill them, so only the epoch's last chunk can leave an underfull
row. One row is one rank's batch for one step; with W ranks a step takes W rows of similar attention cost (sum of
squared document lengths), and the order of steps is shuffled.

Properties: no padding inside a row, and rows are full: row fill >= 0.999 on the reference workloads at full size
(seed, heavy-tailed, bimodal at budget 32,768; the CPU shape at 4,096), against 0.990-0.992 without the carry;
the only loss left is the epoch's last rows. Composition changes every epoch because chunks are re-drawn (a
carried row just spans two neighbouring chunks of the random order). Rows are fairly length-homogeneous
(within-row length spread ~0.16 on the CPU shape, like bucketed's ~0.17), because best-fit-decreasing places a
chunk's long documents first and fills the last rows with short ones. The model must mask attention per
document (the packed collator marks documents with ``doc_ids`` and restarts ``position_ids``). Larger chunks pack
a little tighter; smaller chunks give more random row composition.

Cost: O(N) for the permutation + O(n log n) sort and O(n log r) bisection per chunk (n documents, r open rows);
each document is placed once (a carried row is continued, not re-packed): O(N log N) per epoch overall.
"""

from __future__ import annotations

import bisect
from itertools import chain
from collections.abc import Sequence

import numpy as np

from ..config_check import as_int
from .core import StepPlan, arrange_steps, epoch_rng, split_at
from .policy import Policy

# A row with more than this share of its tokens free is underfull: it stays open into the next chunk.
CARRY_FREE_SHARE = 0.002


def best_fit_decreasing(
    docs: np.ndarray,
    lengths: np.ndarray,
    capacity: int,
    max_docs: int | None,
    open_rows: Sequence[tuple[np.ndarray, int]] = (),
    block_tokens: np.ndarray | None = None,
    block_capacity: int | None = None,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Best-fit-decreasing bin packing of ``docs`` into rows of ``capacity`` tokens.

    Each document, longest first, goes to the open row whose free space is smallest but sufficient (found by
    bisection over a sorted list of free spaces); rows with less space than the shortest document, or holding
    ``max_docs`` documents, are closed. ``open_rows`` are partly filled rows to continue, as (documents, free
    tokens) pairs; they come first in the result. With a block budget (``block_tokens`` per document and
    ``block_capacity`` per row) a row must also have the document's block tokens free: the search walks on from
    the best token fit to the next rows until one has (a new row when none has), and a row whose free block
    tokens fall below the chunk's smallest document's is closed. Cost: O(n log n) sort + O(n log r) bisection
    (r open rows) with list inserts of O(r); with a block budget the walk adds at most O(r) per document.

    Returns:
        ``(rows, free)``: each row's document indices, and each row's free tokens.

    Example:
        >>> rows, free = best_fit_decreasing(np.arange(4), np.array([6, 5, 4, 3]), 10, None)
        >>> [r.tolist() for r in rows], free.tolist()
        ([[0, 2], [1, 3]], [0, 2])
        >>> rows, free = best_fit_decreasing(np.array([2, 3]), np.array([6, 5, 4, 3]), 10, None, [(np.array([0]), 4)])
        >>> [r.tolist() for r in rows], free.tolist()
        ([[0, 2], [3]], [0, 7])
        >>> rows, _ = best_fit_decreasing(np.arange(4), np.array([6, 5, 4, 3]), 10, None,
        ...                               block_tokens=np.array([8, 8, 8, 8]), block_capacity=16)
        >>> [r.tolist() for r in rows]
        [[0, 2], [1, 3]]
        >>> rows, _ = best_fit_decreasing(np.arange(4), np.array([6, 5, 4, 3]), 10, None,
        ...                               block_tokens=np.array([8, 8, 16, 8]), block_capacity=16)
        >>> [r.tolist() for r in rows]
        [[0, 3], [1], [2]]
    """
    order = docs[np.argsort(-lengths[docs], kind="stable")]
    sizes = lengths[order].tolist()
    smallest = sizes[-1] if sizes else capacity + 1
    use_blocks = block_tokens is not None and block_capacity is not None
    rows: list[list[int]] = [r.tolist() for r, _ in open_rows]
    blocks, block_left, smallest_block = _block_room(order, open_rows, block_tokens, block_capacity)
    block_cap = int(block_capacity) if use_blocks else 0

    def stays_open(row: int, left: int) -> bool:
        return (left >= smallest and (max_docs is None or len(rows[row]) < max_docs)
                and (not use_blocks or block_left[row] >= smallest_block))

    # Free space of open rows, ascending, and the row id of each entry.
    free_of = sorted((int(left), row) for row, (_, left) in enumerate(open_rows) if stays_open(row, int(left)))
    free = [left for left, _ in free_of]
    row_of_free = [row for _, row in free_of]
    for doc, size, block in zip(order.tolist(), sizes, blocks):
        slot = bisect.bisect_left(free, size)
        if use_blocks:  # walk on to the first sufficient row with room for the document's block tokens
            while slot < len(free) and block_left[row_of_free[slot]] < block:
                slot += 1
        if slot == len(free):
            row = len(rows)
            rows.append([doc])
            block_left.append(block_cap - block)
            left = capacity - size
        else:
            left = free.pop(slot) - size
            row = row_of_free.pop(slot)
            rows[row].append(doc)
            block_left[row] -= block
        if stays_open(row, left):
            slot = bisect.bisect_left(free, left)
            free.insert(slot, left)
            row_of_free.insert(slot, row)
    return _rows_and_free(rows, lengths, capacity)


def _block_room(order: np.ndarray, open_rows: Sequence[tuple[np.ndarray, int]], block_tokens: np.ndarray | None,
                block_capacity: int | None) -> tuple[list[int], list[int], int]:
    """The block budget's bookkeeping for :func:`best_fit_decreasing`: each document's block tokens (in ``order``;
    zeros without a budget), each open row's free block tokens, and the smallest document's block tokens."""
    if block_tokens is None or block_capacity is None:
        return [0] * order.size, [0] * len(open_rows), 0
    blocks = block_tokens[order].tolist()
    left = [int(block_capacity) - int(block_tokens[r].sum()) for r, _ in open_rows]
    return blocks, left, min(blocks) if blocks else 0


def _rows_and_free(rows: list[list[int]], lengths: np.ndarray, capacity: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Rows of document lists as index arrays, and each row's free tokens."""
    if not rows:
        return [], np.zeros(0, dtype=np.int64)
    counts = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(counts.sum()))
    ends = np.cumsum(counts)
    used = np.add.reduceat(lengths[flat], ends - counts)
    return split_at(flat, ends[:-1].tolist()), capacity - used


class Packed(Policy):
    name = "packed"
    packed = True

    def setup(self, *, chunk_rows: int) -> None:
        if self.budget.quadratic_length is not None:
            raise ValueError("sampler.quadratic_length does not apply to packed rows (no padding); remove it")
        self.chunk_rows = as_int("sampler.chunk_rows", chunk_rows, minimum=1, example=64)
        admission, max_tokens = self.admission, self.budget.max_tokens
        # Chunks are cut on an int64 running token count: a chunk larger than the whole dataset is one chunk.
        total_tokens = int(admission.lengths[admission.kept].sum())
        self.chunk_tokens = min(self.chunk_rows * max_tokens, total_tokens + 1)
        self.carry_free = int(CARRY_FREE_SHARE * max_tokens)
        self.carry_rows = max(1, self.chunk_rows // 16)
        kept_blocks = None if admission.block_tokens is None else admission.block_tokens[admission.kept]
        self.min_block = int(kept_blocks.min()) if kept_blocks is not None and kept_blocks.size else 0

    def underfull(self, rows: list[np.ndarray], free: np.ndarray) -> np.ndarray:
        """Indices of the rows to carry on: the emptiest rows over ``carry_free`` free that could take documents."""
        open_rows = free > self.carry_free
        if self.budget.max_samples is not None:  # a row full by document count cannot be improved
            open_rows &= np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)) < self.budget.max_samples
        blocks = self.admission.block_tokens
        if blocks is not None and self.budget.max_block_tokens is not None:  # nor one full by block tokens
            room = self.budget.max_block_tokens - np.fromiter((int(blocks[r].sum()) for r in rows), np.int64,
                                                              count=len(rows))
            open_rows &= room >= self.min_block
        candidates = np.flatnonzero(open_rows)
        return candidates[np.argsort(-free[candidates], kind="stable")[: self.carry_rows]]

    def plan(self, epoch: int) -> StepPlan:
        rng = epoch_rng(self.seed, epoch, stream=50)
        lengths, kept = self.admission.lengths, self.admission.kept
        order = kept[rng.permutation(kept.size)]
        chunk_of = np.cumsum(lengths[order]) // self.chunk_tokens
        chunks = split_at(order, (np.flatnonzero(np.diff(chunk_of)) + 1).tolist())
        rows: list[np.ndarray] = []
        carried: list[tuple[np.ndarray, int]] = []  # (documents, free tokens) of rows continued in the next chunk
        for i, chunk in enumerate(chunks):
            chunk_rows, free = best_fit_decreasing(
                chunk, lengths, self.budget.max_tokens, self.budget.max_samples, carried,
                self.admission.block_tokens, self.budget.max_block_tokens,
            )
            carried = []
            if i + 1 < len(chunks):
                hand_on = self.underfull(chunk_rows, free)
                carried = [(chunk_rows[r], free[r]) for r in hand_on]
                emitted = np.ones(len(chunk_rows), dtype=bool)
                emitted[hand_on] = False
                chunk_rows = [r for r, keep in zip(chunk_rows, emitted) if keep]
            rows += chunk_rows
        # Step grouping key: a row's attention cost, so the W rows of one step take about the same time.
        sq = lengths.astype(np.float64) ** 2
        flat = np.concatenate(rows)
        starts = np.cumsum([0] + [r.size for r in rows[:-1]])
        attention_cost = np.add.reduceat(sq[flat], starts)
        return arrange_steps(rows, attention_cost, self.world_size, rng, drop_last=self.drop_last)
