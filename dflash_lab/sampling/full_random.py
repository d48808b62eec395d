"""full_random: a fresh permutation every epoch, greedy batches in that order.

Algorithm: each epoch draw a permutation of all samples, walk it and close a batch when the next sample would
break the budget. With W ranks, batches are grouped into steps of W neighbours by cost (only the step grouping
looks at length; composition stays random), and the order of steps is shuffled.

Two budgets (``real_tokens_per_step``):
- ``null`` (default): the padded budget, ``rows x longest <= max_tokens``, as every padded policy.
- ``T`` (an integer): equal real tokens per step. A batch closes at the sample boundary nearest to T real tokens
  (sum of lengths; ``Policy.pack``), so the mean real tokens per step is about T and full_random can be
  compared with a length-grouped policy at equal real tokens: set T to that policy's ``real_tokens_per_step``
  from the planner table. The padded budget is then NOT applied to batches: padded tokens per batch (rows x
  longest) grow to about T / padding efficiency and exceed ``max_tokens``, so memory per step grows accordingly:
  ~2.5 T on the seed and CPU shapes (padding efficiency falls to ~0.39: larger random batches have longer longest
  rows), ~3.4 T on the bimodal shape, ~7.7 T on the heavy-tailed one. ``max_tokens`` still sets which samples
  are admitted (the overlong rule, identical for every policy compared), ``max_samples`` still caps rows, T must
  be at least the longest admitted sample, and ``quadratic_length`` does not apply (refused): the policy base's
  equal-real-tokens budget (``Policy.use_real_tokens``). Steps group batches of similar padded size.

Properties: maximal diversity (composition repeat ~ 0, adjacent-length correlation ~ 0, every batch mixes lengths);
but a batch is padded to its longest sample, so on heavy-tailed data about half of the compute is padding
(padding efficiency ~ 0.5 on the seed workload: the 25.1 -> 12 Ktok/s drop).

Cost: O(N) per epoch (permutation + one packing pass) + O(B log B) to group B batches into steps.
"""

from __future__ import annotations

from .core import StepPlan, arrange_steps, epoch_rng
from .policy import Policy


class FullRandom(Policy):
    name = "full_random"

    def setup(self, *, real_tokens_per_step: int | None) -> None:
        self.use_real_tokens(real_tokens_per_step)

    def plan(self, epoch: int) -> StepPlan:
        rng = epoch_rng(self.seed, epoch, stream=20)
        kept = self.admission.kept
        batches, cost = self.pack(kept[rng.permutation(kept.size)])
        return arrange_steps(batches, cost, self.world_size, rng, drop_last=self.drop_last)
