"""sorted_static: sort once by length, pack once, reshuffle only the order of batches each epoch.

Algorithm: a global stable sort by length (ties broken by a seeded permutation, so equal-length samples are not
grouped by dataset order), then greedy token-budget packing along that order (``rows x longest <= max_tokens``).
The batches are built once for the whole run; each epoch only the order of steps is reshuffled. With W ranks, the
W batches of a step are neighbours in sorted order.

Properties: the least padding of any padded policy (>= 0.99 on the seed workload); every batch is
length-homogeneous and its composition never changes across epochs (composition repeat = 1), so the model sees
the same groups every epoch and long and short samples in separate steps.

Cost: O(N log N) once (sort + one packing pass); each epoch O(B) to shuffle B batches.
"""

from __future__ import annotations

import numpy as np

from .core import StepPlan, arrange_steps, epoch_rng
from .policy import Policy


class SortedStatic(Policy):
    name = "sorted_static"

    def setup(self) -> None:
        lengths, kept = self.admission.lengths, self.admission.kept
        tie_break = kept[epoch_rng(self.seed, 0, stream=10).permutation(kept.size)]
        self._batches, _ = self.pack(tie_break[np.argsort(lengths[tie_break], kind="stable")])
        # Position in sorted order is the step-grouping key: a step takes W consecutive sorted batches.
        self._key = np.arange(len(self._batches))

    def plan(self, epoch: int) -> StepPlan:
        return arrange_steps(
            self._batches, self._key, self.world_size, epoch_rng(self.seed, epoch, stream=11), drop_last=self.drop_last
        )
