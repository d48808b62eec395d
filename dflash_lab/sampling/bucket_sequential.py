"""bucket_sequential: every epoch walks the length buckets in order, shortest first, one bucket at a time.

POSITIVE CONTROL ONLY, never for production. This is the pathological curriculum the forgetting question fears:
the model trains on one length band for a long stretch, then moves on and never revisits it until the next epoch.
If length-grouped batching can cause a forgetting loop, this order must show it; an ablation whose metrics cannot
tell this policy from ``full_random`` cannot detect a loop at all.

Algorithm: buckets and per-epoch packing exactly as ``bucketed`` (members reshuffled inside each bucket every
epoch, greedy token-budget batches, the same boundaries keys and presets). Steps are then ordered bucket by bucket
in ascending length: all of a bucket's steps consecutively, their order shuffled inside the bucket
(``core.bucket_run_order(sequential=True)``). With W ranks a step's W batches come from one bucket, except where a
bucket's batch count is not a multiple of W: then at most one step per bucket boundary mixes batches of adjacent
buckets (every rank keeps the same step count and each sample is used once).

Properties: padding as ``bucketed``; composition changes every epoch; bucket run length = steps per bucket
(the whole bucket), adjacent-length correlation near 1; the bucket sequence has period one epoch.

``bucket_by: random`` (``bucketed``'s key) makes it the NEGATIVE CONTROL for natural data: the same number of
buckets, the same bucket sizes (samples per bucket) and the same visiting order (group 0 first, each group's
steps consecutively), but each group is a fixed random draw of samples, independent of length. Whatever the
sequential visiting itself does to a loop metric shows in both; only what comes from length-homogeneous
stretches differs. The ``bucket`` metric is then the group id; the adjacent-length correlation falls to ~0 and
groups take more steps than their length buckets (mixed lengths pad more).

Cost: as ``bucketed``: O(N) per epoch + O(B log B) step grouping and ordering.
"""

from __future__ import annotations

from typing import Sequence

from .bucketed import Bucketed
from .core import StepPlan, bucket_run_order, epoch_rng


class BucketSequential(Bucketed):
    name = "bucket_sequential"

    def setup(self, *, boundaries: Sequence[int] | str | None, num_buckets: int | None, fit_method: str,
              bucket_by: str) -> None:
        self.make_buckets(boundaries, num_buckets, fit_method, bucket_by)   # bucketed's buckets; no run_length

    def plan(self, epoch: int) -> StepPlan:
        rng = epoch_rng(self.seed, epoch, stream=60)
        batches, steps, step_bucket = self.bucket_steps(rng)
        return steps.plan(batches, bucket_run_order(step_bucket, rng, sequential=True))
