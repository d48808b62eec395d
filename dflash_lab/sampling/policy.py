"""A planner wrapped as a torch ``batch_sampler`` with rank sharding and exact, replay-free resume.

Rank sharding: step s is global batches ``[s*W, s*W+W)``; rank r takes ``s*W + r``. State is tiny:
``{version, epoch, batches_consumed, fingerprint, config}``; resume = rebuild the epoch plan + slice, no data
replayed. The fingerprint hashes the policy config, seed, world size and the lengths; a state made for anything
else is refused with the differing keys named.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np

from ..config_check import as_int
from .boundaries import bucket_ids
from .core import Admission, Planner, StepPlan

STATE_VERSION = 1
STATE_KEYS = ("version", "epoch", "batches_consumed", "fingerprint")


def fingerprint(parts: dict[str, Any], lengths: np.ndarray) -> str:
    """A short hash of everything a plan depends on: policy config, seed, world size and the lengths."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    digest = hashlib.sha256(blob)
    digest.update(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


class Policy:
    """A batching policy as a torch ``batch_sampler`` with exact, replay-free resume.

    Example:
        >>> import numpy as np
        >>> from dflash_lab.sampling import build_policy
        >>> p = build_policy("sorted_static", np.array([5, 3, 8, 2]), max_tokens=8)
        >>> [len(b) for b in p.batches(0)] == [len(b) for b in p.batches(0)]
        True
    """

    def __init__(
        self,
        planner: Planner,
        admission: Admission,
        *,
        world_size: int,
        rank: int,
        config: dict[str, Any],
        raw_lengths: np.ndarray,
    ) -> None:
        world_size = as_int("world_size", world_size, minimum=1)
        rank = as_int("rank", rank, minimum=0)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={world_size}); check RANK/WORLD_SIZE")
        self.planner = planner
        self.admission = admission
        self.world_size = world_size
        self.rank = rank
        self.config = dict(config)
        self.fingerprint = fingerprint({**self.config, "world_size": world_size}, raw_lengths)
        self.epoch = 0
        self._cached: tuple[int, StepPlan] | None = None
        self._resume_at = 0  # batches of self.epoch already consumed (set by load_state_dict)
        self._position = 0  # batches of self.epoch handed out so far

    # -- what the policy is ------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.planner.name

    @property
    def packed(self) -> bool:
        """True when a batch is one packed row of several documents (train with per-document attention)."""
        return self.planner.packed

    @property
    def boundaries(self) -> list[int] | None:
        return self.planner.boundaries

    @property
    def lengths(self) -> np.ndarray:
        """Effective sample lengths (after ``overlong=truncate``); collators truncate samples to these."""
        return self.admission.lengths

    @property
    def bucket_by(self) -> str | None:
        """What decides bucket membership (``sampler.bucket_by``: length | random); None without buckets."""
        return getattr(self.planner, "bucket_by", None)

    def bucket_of(self, indices: Any) -> int:
        """Bucket id of a batch: the bucket its longest sample was packed from; -1 for policies without buckets.

        ``bucket_by: length``: the length bucket of the longest sample (the boundaries rule). ``bucket_by: random``:
        the random group it was packed from, so "which bucket" keeps its meaning for the negative control.
        """
        if self.boundaries is None:
            return -1
        indices = np.asarray(indices, dtype=np.int64)
        longest = indices[np.argmax(self.admission.lengths[indices])]
        if self.bucket_by == "random":
            return int(self.planner.sample_bucket[longest])
        return int(bucket_ids(self.admission.lengths[[longest]], self.boundaries)[0])

    # -- plans -------------------------------------------------------------------------------------------------
    def global_plan(self, epoch: int) -> StepPlan:
        """All ranks' batches of one epoch (steps of ``world_size`` consecutive batches). Cached per epoch."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.planner.plan(epoch))
        return self._cached[1]

    def batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of ``epoch`` in consumption order."""
        return self.global_plan(epoch).batches[self.rank :: self.world_size]

    def steps_in_epoch(self, epoch: int) -> int:
        return self.global_plan(epoch).steps

    def diagnostics(self, epoch: int) -> dict[str, int]:
        """Kept / dropped / truncated / repeated counts for one epoch (lhotse-style sampling diagnostics)."""
        plan = self.global_plan(epoch)
        return {
            "samples": int(self.admission.lengths.size),
            "kept": int(self.admission.kept.size),
            "dropped_overlong": self.admission.dropped,
            "truncated": self.admission.truncated,
            "repeated_remainder": plan.repeated_samples,
            "dropped_remainder": plan.dropped_samples,
            "steps": plan.steps,
        }

    # -- batch_sampler protocol ----------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``__iter__`` walks; keeps a loaded resume position for that same epoch."""
        if epoch != self.epoch:
            self._resume_at = 0
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches this rank gets in the current epoch (the same on every rank)."""
        return self.steps_in_epoch(self.epoch)

    def __iter__(self) -> Iterator[list[int]]:
        start, self._resume_at = self._resume_at, 0
        mine = self.batches(self.epoch)
        self._position = start
        for batch in mine[start:]:
            self._position += 1
            yield batch.tolist()

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """Tiny resumable state. Pass ``batches_consumed`` when a DataLoader prefetches ahead of training.

        The state names the *next* batch: after the last batch of an epoch it points at batch 0 of the next epoch.
        """
        consumed = self._position if batches_consumed is None else int(batches_consumed)
        epoch = self.epoch
        if consumed >= self.steps_in_epoch(epoch):
            epoch, consumed = epoch + 1, 0
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "batches_consumed": consumed,
            "fingerprint": self.fingerprint,
            "config": {**self.config, "world_size": self.world_size},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at exactly the next batch; refuse a state made for another config, dataset or world size.

        Raises:
            ValueError: ``state`` is not a ``state_dict()`` mapping, has another version, does not match this
                policy (the message names the differing keys), or points past the end of its epoch.
        """
        if not isinstance(state, Mapping):
            raise ValueError(
                f"sampler state must be the mapping Policy.state_dict() returns (keys {', '.join(STATE_KEYS)}), "
                f"got {type(state).__name__}; the checkpoint holds no usable sampler state: restart from an "
                f"intact checkpoint or start a fresh run directory"
            )
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}; it was not written by Policy.state_dict(), cannot resume")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"sampler state version {state['version']!r} is not {STATE_VERSION}; cannot resume")
        if state["fingerprint"] != self.fingerprint:
            theirs = state.get("config") or {}
            theirs = theirs if isinstance(theirs, Mapping) else {}
            mine = {**self.config, "world_size": self.world_size}
            diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
            detail = f"differing keys: {', '.join(diff)}" if diff else "the sample lengths (dataset) differ"
            raise ValueError(
                f"sampler state does not match this policy ({detail}). Resuming would replay or skip data; "
                f"restore the original sampler/data config and world size, or start a fresh run directory"
            )
        epoch = as_int("sampler state epoch", state["epoch"], minimum=0)
        consumed = as_int("sampler state batches_consumed", state["batches_consumed"], minimum=0)
        if consumed > self.steps_in_epoch(epoch):
            raise ValueError(
                f"sampler state batches_consumed={consumed} is past the end of epoch {epoch} "
                f"({self.steps_in_epoch(epoch)} batches per rank); the state is corrupt, cannot resume"
            )
        self.epoch = epoch
        self._resume_at = self._position = consumed
