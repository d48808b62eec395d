"""packed: documents packed into rows of at most ``max_tokens`` real tokens, trained with per-document attention.

Algorithm: each epoch draw a random order of all documents and cut it into chunks of about ``chunk_rows`` rows'
worth of tokens. Each chunk is bin-packed with best-fit-decreasing (longest document first, into the open row with
the least sufficient free space; see ``core.best_fit_decreasing``). One row is one rank's batch for one step; with W
ranks a step takes W rows of similar attention cost (sum of squared document lengths), and the order of steps is
shuffled.

Properties: no padding inside a row (row fill >= 0.99 on the seed workload: only each chunk's last rows are
underfull); composition changes every epoch because chunks are re-drawn; a row mixes long and short documents.
The model must mask attention per document (the packed collator marks documents with ``doc_ids`` and restarts
``position_ids``). Larger chunks fill rows better; smaller chunks give more random row composition.

Cost: O(N) for the permutation + O(n log n) sort and O(n log r) bisection per chunk (n documents, r open rows):
O(N log N) per epoch overall.
"""

from __future__ import annotations

import numpy as np

from .core import Admission, StepPlan, TokenBudget, arrange_steps, best_fit_decreasing, epoch_rng


class Packed:
    name = "packed"
    packed = True
    boundaries = None

    def __init__(
        self,
        admission: Admission,
        budget: TokenBudget,
        *,
        seed: int,
        world_size: int,
        drop_last: bool,
        chunk_rows: int = 64,
    ):
        if int(chunk_rows) != chunk_rows or chunk_rows < 1:
            raise ValueError(f"sampler.chunk_rows={chunk_rows!r}: must be a positive integer")
        self.admission, self.budget = admission, budget
        self.seed, self.world_size, self.drop_last = seed, world_size, drop_last
        self.chunk_tokens = int(chunk_rows) * budget.max_tokens

    def plan(self, epoch: int) -> StepPlan:
        rng = epoch_rng(self.seed, epoch, stream=50)
        lengths, kept = self.admission.lengths, self.admission.kept
        order = kept[rng.permutation(kept.size)]
        chunk_of = np.cumsum(lengths[order]) // self.chunk_tokens
        cuts = np.flatnonzero(np.diff(chunk_of)) + 1
        rows: list[np.ndarray] = []
        for chunk in np.split(order, cuts):
            rows += best_fit_decreasing(chunk, lengths, self.budget.max_tokens, self.budget.max_samples)
        # Step grouping key: a row's attention cost, so the W rows of one step take about the same time.
        sq = lengths.astype(np.float64) ** 2
        flat = np.concatenate(rows)
        starts = np.cumsum([0] + [r.size for r in rows[:-1]])
        attention_cost = np.add.reduceat(sq[flat], starts)
        return arrange_steps(rows, attention_cost, self.world_size, rng, drop_last=self.drop_last)
