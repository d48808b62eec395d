"""The policy registry and the one door into it: every sampler key is checked here (or by the policy it belongs
to) with ``dflash_lab.config_check`` before any value is used or cast; unknown keys are refused with the valid
ones listed."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Mapping

from ..config_check import as_bool, as_choice, as_int, refuse_unknown_keys
from .bucket_sequential import BucketSequential
from .bucketed import Bucketed
from .bucketed_megabatch import BucketedMegabatch
from .core import OVERLONG_MODES, TokenBudget, admit, validate_lengths
from .full_random import FullRandom
from .packed import Packed
from .policy import Policy
from .sorted_static import SortedStatic

POLICIES = {
    cls.name: cls for cls in (SortedStatic, FullRandom, Bucketed, BucketedMegabatch, Packed, BucketSequential)
}
# Keys every policy accepts (the budget and the remainder/overlong rules); the rest are the policy's own.
COMMON_KEYS = ("max_samples", "quadratic_length", "max_block_tokens", "drop_last", "overlong")


def policy_keys(name: str) -> list[str]:
    """Every ``sampler.*`` key policy ``name`` accepts besides ``name`` and ``max_tokens``.

    Example:
        >>> policy_keys("packed")
        ['chunk_rows', 'drop_last', 'max_block_tokens', 'max_samples', 'overlong', 'quadratic_length']
    """
    as_choice("sampler.name", name, POLICIES)
    own = [p for p in inspect.signature(POLICIES[name].__init__).parameters
           if p not in ("self", "admission", "budget", "seed", "world_size", "drop_last")]
    return sorted({*own, *COMMON_KEYS})


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
        **params: ``max_samples``, ``quadratic_length``, ``max_block_tokens``, ``drop_last``, ``overlong``
            (error|truncate|drop), and the
            policy's own (``policy_keys(name)``: ``boundaries``/``num_buckets``/``fit_method``/``run_length``/
            ``bucket_by``, ``megabatch_batches``, ``chunk_rows``, ``real_tokens_per_step``).

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
    seed = as_int("seed", seed, minimum=0, example=0)
    world_size = as_int("world_size", world_size, minimum=1)
    rank = as_int("rank", rank, minimum=0)
    raw = validate_lengths(lengths)
    drop_last = as_bool("sampler.drop_last", params.pop("drop_last", False))
    overlong = as_choice("sampler.overlong", params.pop("overlong", "error"), OVERLONG_MODES)
    budget = TokenBudget(max_tokens, params.pop("max_samples", None), params.pop("quadratic_length", None),
                         params.pop("max_block_tokens", None))
    cls = POLICIES[name]
    if cls is Packed and budget.quadratic_length is not None:
        raise ValueError("sampler.quadratic_length does not apply to packed rows (no padding); remove it")
    admission = admit(raw, budget.longest_allowed(), overlong, block_tokens, budget.max_block_tokens)
    if admission.kept.size == 0:
        raise ValueError("no sample fits the budget after overlong=drop; raise sampler.max_tokens")
    planner = cls(admission, budget, seed=seed, world_size=world_size, drop_last=drop_last, **params)
    config = {
        "name": name, "max_tokens": budget.max_tokens, "seed": seed, "max_samples": budget.max_samples,
        "quadratic_length": budget.quadratic_length, "drop_last": drop_last, "overlong": overlong,
        **{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in params.items()},
        "boundaries": planner.boundaries,
    }
    if config.get("bucket_by") == "length":
        # Length keying is what every state written before bucket_by existed used: leaving the default out of the
        # config keeps their fingerprints, while a random-keyed state is refused by a length-keyed policy (and
        # the reverse) with bucket_by named among the differing keys.
        del config["bucket_by"]
    if admission.block_tokens is not None and budget.max_block_tokens is not None:
        # The plan depends on the block budget and tokens too: a resume on data with other anchor counts is refused.
        # (Without a block budget the config stays as before, so older checkpoints keep resuming.)
        config["max_block_tokens"] = budget.max_block_tokens
        config["block_tokens_digest"] = hashlib.sha256(admission.block_tokens.tobytes()).hexdigest()[:16]
    return Policy(planner, admission, world_size=world_size, rank=rank, config=config, raw_lengths=raw)


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
    if params.get("max_block_tokens") == "auto":
        # auto is the largest block budget that fits the GPU (``model.footprint.memory_plan``, which the trainer
        # and planner run first); with no GPU to fit (CPU training, a direct build) there is no block budget.
        params["max_block_tokens"] = None
    return build_policy(name, lengths, max_tokens=max_tokens, seed=seed, world_size=world_size, rank=rank,
                        block_tokens=block_tokens, **params)
