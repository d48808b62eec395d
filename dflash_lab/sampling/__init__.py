"""Batching policies: how samples are grouped into batches and in what order, one policy per module.

``build_policy(name, lengths, *, max_tokens, seed=0, world_size=1, rank=0, **params)`` returns a ``Policy``:
``batches(epoch)`` (this rank's batches in consumption order), the torch ``batch_sampler`` protocol
(``set_epoch``, ``__iter__``, ``__len__``) and ``state_dict()``/``load_state_dict()`` for exact resume.

| policy               | module                  | padding        | composition across epochs |
|----------------------|-------------------------|----------------|---------------------------|
| sorted_static        | sorted_static.py        | least          | never changes             |
| full_random          | full_random.py          | most           | fully random              |
| bucketed             | bucketed.py             | bucket width   | random inside buckets     |
| bucketed_megabatch   | bucketed_megabatch.py   | near sorted    | random inside buckets     |
| packed               | packed.py               | none (rows)    | random chunks             |
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .boundaries import FIT_METHODS, bucket_ids, fit_boundaries, smallest_k_for_efficiency, validate_boundaries
from .bucketed import CPU_BOUNDARIES, SEED_BOUNDARIES, Bucketed
from .bucketed_megabatch import BucketedMegabatch
from .core import Policy, StepPlan, TokenBudget, admit, validate_lengths
from .full_random import FullRandom
from .packed import Packed
from .sorted_static import SortedStatic

POLICIES = {cls.name: cls for cls in (SortedStatic, FullRandom, Bucketed, BucketedMegabatch, Packed)}

__all__ = [
    "POLICIES", "FIT_METHODS", "CPU_BOUNDARIES", "SEED_BOUNDARIES", "Policy", "StepPlan", "TokenBudget",
    "build_policy", "policy_from_config", "fit_boundaries", "smallest_k_for_efficiency", "validate_boundaries",
    "bucket_ids",
]

# Keys every policy accepts; the rest are policy-specific and checked against the policy's signature.
_COMMON = ("max_samples", "quadratic_length", "drop_last", "overlong")


def build_policy(
    name: str,
    lengths: Any,
    *,
    max_tokens: int,
    seed: int = 0,
    world_size: int = 1,
    rank: int = 0,
    **params: Any,
) -> Policy:
    """Build a batching policy over a lengths array.

    Args:
        name: ``sorted_static``, ``full_random``, ``bucketed``, ``bucketed_megabatch`` or ``packed``.
        lengths: one token count per sample.
        max_tokens: padded token budget per rank per step (``packed``: real tokens per row).
        seed: plan seed; with (lengths, params, epoch, world_size) it fixes every batch.
        world_size, rank: data-parallel layout; each rank gets the same number of batches.
        **params: ``max_samples``, ``quadratic_length``, ``drop_last``, ``overlong`` (error|truncate|drop), and the
            policy's own (``boundaries``/``num_buckets``/``fit_method``, ``megabatch_batches``, ``chunk_rows``).

    Raises:
        ValueError: unknown policy or parameter, bad lengths, boundaries or budget (the message names the fix).

    Example:
        >>> p = build_policy("bucketed", np.array([10, 20, 300, 400]), max_tokens=800, boundaries=[0, 100, 400])
        >>> sorted(len(b) for b in p.batches(0))
        [2, 2]
    """
    if name not in POLICIES:
        raise ValueError(f"unknown sampler {name!r}: choose one of {', '.join(POLICIES)} (sampler=<name>)")
    cls = POLICIES[name]
    raw = validate_lengths(lengths)
    max_samples = params.pop("max_samples", None)
    quadratic_length = params.pop("quadratic_length", None)
    drop_last = bool(params.pop("drop_last", False))
    overlong = params.pop("overlong", "error")
    if cls is Packed and quadratic_length is not None:
        raise ValueError("sampler.quadratic_length does not apply to packed rows (no padding); remove it")
    import inspect

    own = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "admission", "budget")]
    unknown = sorted(set(params) - set(own))
    if unknown:
        allowed = sorted(set(own) - {"seed", "world_size", "drop_last"}) + list(_COMMON)
        raise ValueError(f"sampler {name!r} has no parameter(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
    budget = TokenBudget(int(max_tokens), max_samples, quadratic_length)
    admission = admit(raw, budget.longest_allowed(), overlong)
    if admission.kept.size == 0:
        raise ValueError("no sample fits the budget after overlong=drop; raise sampler.max_tokens")
    planner = cls(admission, budget, seed=int(seed), world_size=int(world_size), drop_last=drop_last, **params)
    config = {
        "name": name, "max_tokens": int(max_tokens), "seed": int(seed), "max_samples": max_samples,
        "quadratic_length": quadratic_length, "drop_last": drop_last, "overlong": overlong,
        **{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in params.items()},
        "boundaries": planner.boundaries,
    }
    return Policy(planner, admission, world_size=int(world_size), rank=int(rank), config=config, raw_lengths=raw)


def policy_from_config(
    sampler_cfg: Mapping[str, Any], lengths: Any, *, seed: int, world_size: int = 1, rank: int = 0
) -> Policy:
    """Build a policy from a plain ``conf/sampler/<name>.yaml`` mapping (``name`` and ``max_tokens`` + the rest)."""
    params = dict(sampler_cfg)
    if "name" not in params or "max_tokens" not in params:
        raise ValueError("the sampler config needs `name` and `max_tokens` (see conf/sampler/*.yaml)")
    name, max_tokens = params.pop("name"), params.pop("max_tokens")
    return build_policy(name, lengths, max_tokens=max_tokens, seed=seed, world_size=world_size, rank=rank, **params)
