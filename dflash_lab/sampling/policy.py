"""The policy base: what every batching policy shares, written once, so that a policy module holds its batching alone.

A policy module subclasses :class:`Policy` with its ``name``, a ``setup`` that takes and checks its own
``sampler.*`` keys (the keys of its ``conf/sampler/<name>.yaml``) and ``plan(epoch)``: the global plan of one epoch,
every rank's batches grouped into steps (``core.StepPlan``), a pure function of (lengths, config, seed, epoch, world
size). The base holds the rest (the idea of lhotse's ``CutSampler``):

- construction, checked once: seed, world size, rank and ``drop_last``; the lengths (``core.validate_lengths``)
  admitted under the overlong rule and the block budget (``core.admit``); then the policy's ``setup``;
- the step budget (:meth:`Policy.pack`): greedy batches along an order under the padded budget (``rows x widest <=
  max_tokens``, ``core.pack_in_order``), or of about ``real_tokens`` real tokens each where the policy asks for
  equal real tokens per step (:meth:`Policy.use_real_tokens`, ``sampler.real_tokens_per_step``);
- rank sharding: step s is global batches ``[s*W, s*W+W)``; rank r takes ``s*W + r``;
- the torch ``batch_sampler`` protocol (``set_epoch``, ``__iter__``, ``__len__``) and exact, replay-free resume. The
  state is tiny, ``{version, epoch, batches_consumed, fingerprint, config}``; resume = rebuild the epoch plan and
  slice it, no data replayed. The fingerprint hashes the policy config, seed, world size and the lengths; a state
  made for anything else is refused with the differing keys named.

Cost: construction O(N) (lengths check and admission) plus the policy's setup; an epoch's plan is computed once and
cached (``global_plan``); the state is O(1).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Any, ClassVar, Iterator

import numpy as np

from ..config_check import as_bool, as_int
from .boundaries import bucket_ids
from .core import MAX_BUDGET, StepPlan, TokenBudget, admit, pack_in_order, pack_real_tokens, validate_lengths

STATE_VERSION = 1
STATE_KEYS = ("version", "epoch", "batches_consumed", "fingerprint")


def fingerprint(parts: dict[str, Any], lengths: np.ndarray) -> str:
    """A short hash of everything a plan depends on: policy config, seed, world size and the lengths."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    digest = hashlib.sha256(blob)
    digest.update(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


class Policy:
    """A batching policy: a torch ``batch_sampler`` with exact, replay-free resume (see the module docstring).

    Args:
        lengths: one token count per sample.
        budget: the step's token budget (``core.TokenBudget``).
        seed: plan seed; with (lengths, config, epoch, world_size) it fixes every batch.
        world_size, rank: data-parallel layout; each rank gets the same number of batches.
        drop_last: the remainder rule (``core.group_into_steps``).
        overlong: error | truncate | drop, for samples the budget cannot hold (``core.admit``).
        block_tokens: block tokens of each sample under the model's anchor rule; needed with a block budget.
        **own: the policy's own keys, passed to its ``setup``.

    Example:
        >>> import numpy as np
        >>> from dflash_lab.sampling import build_policy
        >>> p = build_policy("sorted_static", np.array([5, 3, 8, 2]), max_tokens=8)
        >>> [len(b) for b in p.batches(0)] == [len(b) for b in p.batches(0)]
        True
    """

    name: ClassVar[str]
    packed: ClassVar[bool] = False   # a batch is one packed row of several documents (per-document attention)
    boundaries: list[int] | None = None   # bucket boundaries (the bucketed policies)
    bucket_by: str | None = None   # what decides bucket membership (``sampler.bucket_by``); None: no buckets

    def __init__(self, lengths: Any, budget: TokenBudget, *, seed: int, world_size: int, rank: int, drop_last: bool,
                 overlong: str, block_tokens: Any = None, **own: Any) -> None:
        self.seed = as_int("seed", seed, minimum=0, example=0)
        self.world_size = as_int("world_size", world_size, minimum=1)
        self.rank = as_int("rank", rank, minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank={self.rank} is outside [0, world_size={self.world_size}); check RANK/WORLD_SIZE")
        raw = validate_lengths(lengths)
        self.drop_last = as_bool("sampler.drop_last", drop_last)
        self.budget = budget
        self.admission = admit(raw, budget.longest_allowed(), overlong, block_tokens, budget.max_block_tokens)
        if self.admission.kept.size == 0:
            raise ValueError("no sample fits the budget after overlong=drop; raise sampler.max_tokens")
        self.real_tokens: int | None = None   # set by use_real_tokens: batches of about this many real tokens
        self.setup(**own)
        self.config = self._config(overlong, own)
        self.fingerprint = fingerprint({**self.config, "world_size": self.world_size}, raw)
        self.epoch = 0
        self._cached: tuple[int, StepPlan] | None = None
        self._resume_at = 0  # batches of self.epoch already consumed (set by load_state_dict)
        self._position = 0  # batches of self.epoch handed out so far

    # -- what a policy module writes ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Take and check the policy's own keys (none here); runs once, after the samples are admitted."""

    def plan(self, epoch: int) -> StepPlan:
        """The global plan of ``epoch``: every rank's batches, grouped into steps of ``world_size`` batches."""
        raise NotImplementedError(f"{type(self).__name__} must define plan(epoch)")

    # -- the step budget ---------------------------------------------------------------------------------------
    def use_real_tokens(self, real_tokens_per_step: Any) -> None:
        """Close batches at about ``real_tokens_per_step`` real tokens (sum of lengths) instead of the padded budget;
        None keeps the padded budget. ``max_tokens`` still decides which samples are admitted (the overlong rule)
        and ``max_samples`` still caps rows; the quadratic row cost does not apply (refused), and the target must
        hold the longest admitted sample."""
        key = "sampler.real_tokens_per_step"
        if real_tokens_per_step in ("bucketed", "full_random"):   # the other policy's plan decides T
            raise ValueError(f"{key}={real_tokens_per_step} is resolved where the data is known (the trainer and the planner: "
                             f"sampling.stats.resolve_matched_real_tokens); give a number to build a policy directly")
        self.real_tokens = as_int(key, real_tokens_per_step, minimum=1, maximum=MAX_BUDGET, allow_none=True)
        if self.real_tokens is None:
            return
        if self.budget.quadratic_length is not None:
            raise ValueError(f"sampler.quadratic_length applies to the padded budget, which {key} replaces; set one "
                             f"of them to null")
        longest = int(self.admission.lengths[self.admission.kept].max())
        if self.real_tokens < longest:
            raise ValueError(f"{key}={self.real_tokens} is below the longest admitted sample ({longest} tokens); "
                             f"raise it to at least {longest} (or null for the padded budget)")

    @functools.cached_property
    def row_cost(self) -> np.ndarray:
        """The padded budget's cost of each sample's row (``TokenBudget.row_cost`` of the effective lengths)."""
        return self.budget.row_cost(self.admission.lengths)

    def pack(self, order: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """Greedy batches along ``order`` under the step budget, and each batch's cost (the step-grouping key): its
        widest row under the padded budget; its padded tokens (rows x longest) under equal real tokens."""
        blocks = self.admission.block_tokens
        if self.real_tokens is None:
            return pack_in_order(order, self.row_cost, self.budget, blocks)
        lengths = self.admission.lengths
        batches = pack_real_tokens(order, lengths, self.real_tokens, self.budget.max_samples, blocks,
                                   self.budget.max_block_tokens)
        sizes = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
        starts = np.cumsum(sizes) - sizes  # batches are consecutive slices of `order`
        return batches, sizes * np.maximum.reduceat(lengths[order], starts)

    # -- what the policy is ------------------------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        """Effective sample lengths (after ``overlong=truncate``); collators truncate samples to these."""
        return self.admission.lengths

    def bucket_of(self, indices: Any) -> int:
        """Bucket id of a batch: the length bucket of its longest sample; -1 for policies without buckets."""
        if self.boundaries is None:
            return -1
        indices = np.asarray(indices, dtype=np.int64)
        longest = indices[np.argmax(self.admission.lengths[indices])]
        return int(bucket_ids(self.admission.lengths[[longest]], self.boundaries)[0])

    def _config(self, overlong: str, own: Mapping[str, Any]) -> dict[str, Any]:
        """What the plan depends on besides the lengths and world size, as the sampler state records it."""
        budget = self.budget
        config = {
            "name": self.name, "max_tokens": budget.max_tokens, "seed": self.seed, "max_samples": budget.max_samples,
            "quadratic_length": budget.quadratic_length, "drop_last": self.drop_last, "overlong": overlong,
            **{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in own.items()},
            "boundaries": self.boundaries,
        }
        if config.get("bucket_by") == "length":
            # Length keying is what every state written before bucket_by existed used: leaving the default out of the
            # config keeps their fingerprints, while a random-keyed state is refused by a length-keyed policy (and
            # the reverse) with bucket_by named among the differing keys.
            del config["bucket_by"]
        if self.admission.block_tokens is not None and budget.max_block_tokens is not None:
            # The plan depends on the block budget and tokens too: a resume on data with other anchor counts is
            # refused. (Without a block budget the config stays as before, so older checkpoints keep resuming.)
            config["max_block_tokens"] = budget.max_block_tokens
            config["block_tokens_digest"] = hashlib.sha256(self.admission.block_tokens.tobytes()).hexdigest()[:16]
        return config

    # -- plans -------------------------------------------------------------------------------------------------
    def global_plan(self, epoch: int) -> StepPlan:
        """All ranks' batches of one epoch (steps of ``world_size`` consecutive batches). Cached per epoch."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.plan(epoch))
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
