"""bucketed: length buckets, shuffled inside each bucket every epoch, batch order shuffled.

Algorithm: boundaries ``[b0=0 < b1 < ... < bK]`` put a sample of length l in bucket k when ``b_k < l <= b_(k+1)``.
Boundaries are given (the seed's ``[0, 770, 1216, 1728, 2432, 3296, 8192]`` is a preset) or fitted from the
lengths (``num_buckets`` + ``fit_method``: quantile, equal_tokens, optimal; see ``boundaries.py``). Each epoch:
shuffle the members of every bucket, pack each bucket greedily under the token budget, then shuffle the order of
steps. With W ranks, a step's W batches come from one bucket (neighbours by longest row), except where a bucket's
batch count is not a multiple of W and a step straddles two adjacent buckets.

Properties: padding bounded by the bucket width (about 0.80 with the seed's 6 buckets on the seed workload);
composition changes every epoch, but each batch is length-homogeneous, and consecutive steps jump between buckets
(adjacent-length correlation ~ 0, bucket run length ~ 1 + 1/K).

Cost: O(N) per epoch (one permutation per bucket + one packing pass) + O(B log B) step grouping.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .boundaries import bucket_ids, fit_boundaries, validate_boundaries
from .core import Admission, StepPlan, TokenBudget, arrange_steps, epoch_rng, pack_in_order

SEED_BOUNDARIES = [0, 770, 1216, 1728, 2432, 3296, 8192]
CPU_BOUNDARIES = [0, 96, 152, 216, 304, 412, 1024]  # the seed's boundaries / 8, for the CPU-scale workload


def resolve_boundaries(
    lengths: np.ndarray,
    boundaries: Sequence[int] | str | None,
    num_buckets: int | None,
    fit_method: str,
    max_tokens: int,
) -> list[int]:
    """Boundaries from an explicit list, a preset name (``seed``, ``cpu``) or a fit; validated against lengths."""
    if isinstance(boundaries, str):
        presets = {"seed": SEED_BOUNDARIES, "cpu": CPU_BOUNDARIES}
        if boundaries not in presets:
            raise ValueError(f"sampler.boundaries={boundaries!r}: unknown preset; use a list or one of {list(presets)}")
        boundaries = presets[boundaries]
    if boundaries is None:
        if num_buckets is None:
            raise ValueError(
                "bucketed needs sampler.boundaries (a list such as [0, 770, 1216, 1728, 2432, 3296, 8192]) "
                "or sampler.num_buckets (with sampler.fit_method) to fit them"
            )
        boundaries = fit_boundaries(lengths, num_buckets, fit_method, max_tokens=max_tokens)
    elif num_buckets is not None and num_buckets != len(boundaries) - 1:
        raise ValueError(
            f"sampler.num_buckets={num_buckets} conflicts with sampler.boundaries ({len(boundaries) - 1} buckets); "
            f"set sampler.boundaries=null to fit boundaries, or num_buckets=null to use the list"
        )
    return validate_boundaries(boundaries, int(lengths.max()))


class Bucketed:
    name = "bucketed"
    packed = False

    def __init__(
        self,
        admission: Admission,
        budget: TokenBudget,
        *,
        seed: int,
        world_size: int,
        drop_last: bool,
        boundaries: Sequence[int] | str | None = None,
        num_buckets: int | None = None,
        fit_method: str = "optimal",
    ):
        self.admission, self.budget = admission, budget
        self.seed, self.world_size, self.drop_last = seed, world_size, drop_last
        kept_lengths = admission.lengths[admission.kept]
        self.boundaries = resolve_boundaries(kept_lengths, boundaries, num_buckets, fit_method, budget.max_tokens)
        bucket_of_kept = bucket_ids(kept_lengths, self.boundaries)
        # Members of each bucket in dataset order; the per-epoch shuffle starts from this fixed order.
        by_bucket = np.argsort(bucket_of_kept, kind="stable")
        counts = np.bincount(bucket_of_kept, minlength=len(self.boundaries) - 1)
        self.members = np.split(admission.kept[by_bucket], np.cumsum(counts)[:-1])
        self._row_cost = budget.row_cost(admission.lengths)

    def order_bucket(self, members: np.ndarray, bucket: int, rng: np.random.Generator) -> np.ndarray:
        """The consumption order of one bucket's samples this epoch: a plain shuffle."""
        return members[rng.permutation(members.size)]

    def plan(self, epoch: int) -> StepPlan:
        rng = epoch_rng(self.seed, epoch, stream=30)
        batches: list[np.ndarray] = []
        keys = []
        for bucket, members in enumerate(self.members):
            packed, widest = pack_in_order(self.order_bucket(members, bucket, rng), self._row_cost, self.budget)
            batches += packed
            keys.append(np.stack([np.full(len(packed), bucket, dtype=np.float64), widest], axis=1))
        key = np.concatenate(keys) if keys else np.zeros((0, 2))
        return arrange_steps(batches, key, self.world_size, rng, drop_last=self.drop_last)
