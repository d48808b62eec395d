"""The policy registry and the one door into it: the keys a caller gives are checked against the policy's (unknown keys
are refused with the valid ones listed), the keys it leaves out are completed from the policy's preset
(``conf/sampler/<name>.yaml``, the one home of every sampler default), and each value is checked where it is used
(``core.TokenBudget``, the policy base, the policy's ``setup``) before it is cast."""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Mapping

from ..config_check import as_choice, refuse_unknown_keys
from .bucket_sequential import BucketSequential
from .bucketed import Bucketed
from .bucketed_megabatch import BucketedMegabatch
from .core import TokenBudget
from .full_random import FullRandom
from .packed import Packed
from .policy import Policy
from .sorted_static import SortedStatic

POLICIES = {
    cls.name: cls for cls in (SortedStatic, FullRandom, Bucketed, BucketedMegabatch, Packed, BucketSequential)
}
# Keys every policy accepts (the budget and the remainder/overlong rules); the rest are the policy's own.
COMMON_KEYS = ("max_samples", "quadratic_length", "max_block_tokens", "drop_last", "overlong")


def setup_keys(cls: type[Policy]) -> set[str]:
    """The keys a policy class's ``setup`` takes; a ``**keys`` of its own passes them on to its parent's setup."""
    parameters = inspect.signature(cls.setup).parameters.values()
    keys = {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        parent = next(base for base in cls.__mro__[1:] if "setup" in vars(base))
        keys |= setup_keys(parent)
    return keys


def policy_keys(name: str) -> list[str]:
    """Every ``sampler.*`` key policy ``name`` accepts besides ``name`` and ``max_tokens``.

    Example:
        >>> policy_keys("packed")
        ['chunk_rows', 'drop_last', 'max_block_tokens', 'max_samples', 'overlong', 'quadratic_length']
    """
    as_choice("sampler.name", name, POLICIES)
    return sorted({*setup_keys(POLICIES[name]), *COMMON_KEYS})


@functools.lru_cache(maxsize=None)
def _preset_keys(name: str) -> dict[str, Any]:
    from ..presets import preset

    values = preset("sampler", name)
    del values["name"], values["max_tokens"]   # the policy's name, and the budget every caller gives
    return values


def build_policy(
    name: str,
    lengths: Any,
    *,
    max_tokens: int,
    seed: int = 0,
    world_size: int = 1,
    rank: int = 0,
    block_tokens: Any = None,
    **params: Any,
) -> Policy:
    """Build a batching policy over a lengths array.

    Args:
        name: a key of ``POLICIES`` (``sorted_static``, ``full_random``, ``bucketed``, ``bucketed_megabatch``,
            ``packed``, ``bucket_sequential``).
        lengths: one token count per sample (checked by ``core.validate_lengths``).
        max_tokens: padded token budget per rank per step (``packed``: real tokens per row).
        seed: plan seed; with (lengths, params, epoch, world_size) it fixes every batch.
        world_size, rank: data-parallel layout; each rank gets the same number of batches.
        block_tokens: block tokens of each sample under the model's anchor rule (``sampling.anchors``); needed
            with ``max_block_tokens`` (a step's second budget), otherwise optional and unused.
        **params: ``max_samples``, ``quadratic_length``, ``max_block_tokens`` (``auto``: the largest that fits the
            GPU, which ``model.footprint.memory_plan`` resolves first; left ``auto``, no block budget),
            ``drop_last``, ``overlong`` (error|truncate|drop), and the policy's own (``policy_keys(name)``:
            ``boundaries``/``num_buckets``/``fit_method``/``run_length``/``bucket_by``, ``megabatch_batches``,
            ``chunk_rows``, ``real_tokens_per_step``). A key left out takes its value in ``conf/sampler/<name>.yaml``.

    Raises:
        ValueError: unknown policy or key, bad value, lengths, boundaries or budget (the message names the key).

    Example:
        >>> import numpy as np
        >>> p = build_policy("bucketed", np.array([10, 20, 300, 400]), max_tokens=800, boundaries=[0, 100, 400])
        >>> sorted(len(b) for b in p.batches(0))
        [2, 2]
    """
    valid = policy_keys(name)
    if "bucket_by" in params and "bucket_by" not in valid:
        bucketed = [n for n in POLICIES if "bucket_by" in policy_keys(n)]
        raise ValueError(
            f"sampler.bucket_by does not apply to {name}: it has no buckets to key (bucket_by chooses the members of "
            f"the buckets of {', '.join(bucketed)}); remove sampler.bucket_by, or choose one of those policies"
        )
    refuse_unknown_keys(f"{name} sampler", params, valid)
    params = {**copy.deepcopy(_preset_keys(name)), **params}
    if params["max_block_tokens"] == "auto":
        # auto is the largest block budget that fits the GPU (``model.footprint.memory_plan``, which the trainer
        # and planner run first); with no GPU to fit (CPU training, a direct build) there is no block budget.
        params["max_block_tokens"] = None
    budget = TokenBudget(max_tokens, params.pop("max_samples"), params.pop("quadratic_length", None),
                         params.pop("max_block_tokens"))
    return POLICIES[name](lengths, budget, seed=seed, world_size=world_size, rank=rank, block_tokens=block_tokens,
                          **params)


def policy_from_config(
    sampler_cfg: Mapping[str, Any], lengths: Any, *, seed: int, world_size: int = 1, rank: int = 0,
    block_tokens: Any = None,
) -> Policy:
    """Build a policy from a plain ``conf/sampler/<name>.yaml`` mapping (``name`` and ``max_tokens`` + the rest).

    Example:
        >>> policy_from_config({"name": "sorted_static", "max_tokens": 64}, [30, 20, 10], seed=0).steps_in_epoch(0)
        2
    """
    if not isinstance(sampler_cfg, Mapping):
        raise ValueError(f"the sampler config must be a mapping (conf/sampler/<name>.yaml), got {sampler_cfg!r}")
    params = dict(sampler_cfg)
    missing = [k for k in ("name", "max_tokens") if k not in params]
    if missing:
        raise ValueError(f"the sampler config lacks {missing}: set sampler=<name> (conf/sampler/*.yaml) and "
                         f"sampler.max_tokens")
    name, max_tokens = params.pop("name"), params.pop("max_tokens")
    return build_policy(name, lengths, max_tokens=max_tokens, seed=seed, world_size=world_size, rank=rank,
                        block_tokens=block_tokens, **params)
