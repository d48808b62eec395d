"""full_random: a fresh permutation every epoch, greedy batches in that order.

Algorithm: each epoch draw a permutation of all samples, walk it and close a batch when the next sample would
break the budget. With W ranks, batches are grouped into steps of W neighbours by cost (only the step grouping
looks at length; composition stays random), and the order of steps is shuffled.

Two budgets (``real_tokens_per_step``):
- ``null`` (default): the padded budget, ``rows x longest <= max_tokens``, as every padded policy.
- ``T`` (an integer): equal real tokens per step. A batch closes at the sample boundary nearest to T real tokens
  (sum of lengths; ``core.pack_real_tokens``), so the mean real tokens per step is about T and full_random can be
  compared with a length-grouped policy at equal real tokens: set T to that policy's ``real_tokens_per_step``
  from the planner table. The padded budget is then NOT applied to batches: padded tokens per batch (rows x
  longest) grow to about T / padding efficiency and exceed ``max_tokens``, so memory per step grows accordingly:
  ~2.5 T on the seed and CPU shapes (padding efficiency falls to ~0.39: larger random batches have longer longest
  rows), ~3.4 T on the bimodal shape, ~7.7 T on the heavy-tailed one. ``max_tokens`` still sets which samples
  are admitted (the overlong rule, identical for every policy compared), ``max_samples`` still caps rows, T must
  be at least the longest admitted sample, and ``quadratic_length`` does not apply (refused). Steps group batches
  of similar padded size.

Properties: maximal diversity (composition repeat ~ 0, adjacent-length correlation ~ 0, every batch mixes lengths);
but a batch is padded to its longest sample, so on heavy-tailed data about half of the compute is padding
(padding efficiency ~ 0.5 on the seed workload: the 25.1 -> 12 Ktok/s drop).

Cost: O(N) per epoch (permutation + one packing pass) + O(B log B) to group B batches into steps.
"""

from __future__ import annotations

import numpy as np

from ..config_check import as_int
from .core import (
    MAX_BUDGET, Admission, StepPlan, TokenBudget, arrange_steps, epoch_rng, pack_in_order, pack_real_tokens,
)


class FullRandom:
    name = "full_random"
    packed = False
    boundaries = None
    bucket_by = None  # no buckets to key (sampler.bucket_by is refused)

    def __init__(
        self,
        admission: Admission,
        budget: TokenBudget,
        *,
        seed: int,
        world_size: int,
        drop_last: bool,
        real_tokens_per_step: int | None = None,
    ):
        key = "sampler.real_tokens_per_step"
        if real_tokens_per_step == "bucketed":
            raise ValueError(f"{key}=bucketed is resolved where the data is known (the trainer and the planner: "
                             f"sampling.stats.resolve_matched_real_tokens); give a number to build a policy directly")
        self.real_tokens = as_int(key, real_tokens_per_step, minimum=1, maximum=MAX_BUDGET, allow_none=True)
        self.admission, self.budget = admission, budget
        self.seed, self.world_size, self.drop_last = seed, world_size, drop_last
        if self.real_tokens is not None:
            if budget.quadratic_length is not None:
                raise ValueError(
                    f"sampler.quadratic_length applies to the padded budget, which {key} replaces; set one of them "
                    f"to null"
                )
            longest = int(admission.lengths[admission.kept].max())
            if self.real_tokens < longest:
                raise ValueError(
                    f"{key}={self.real_tokens} is below the longest admitted sample ({longest} tokens); raise it to "
                    f"at least {longest} (or null for the padded budget)"
                )
        self._row_cost = budget.row_cost(admission.lengths)

    def plan(self, epoch: int) -> StepPlan:
        rng = epoch_rng(self.seed, epoch, stream=20)
        kept = self.admission.kept
        order = kept[rng.permutation(kept.size)]
        if self.real_tokens is None:
            batches, widest = pack_in_order(order, self._row_cost, self.budget, self.admission.block_tokens)
            return arrange_steps(batches, widest, self.world_size, rng, drop_last=self.drop_last)
        lengths = self.admission.lengths
        batches = pack_real_tokens(order, lengths, self.real_tokens, self.budget.max_samples,
                                   self.admission.block_tokens, self.budget.max_block_tokens)
        sizes = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
        starts = np.cumsum(sizes) - sizes  # batches are consecutive slices of `order`
        padded = sizes * np.maximum.reduceat(lengths[order], starts)
        return arrange_steps(batches, padded, self.world_size, rng, drop_last=self.drop_last)
