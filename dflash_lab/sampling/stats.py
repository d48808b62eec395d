"""Plan diagnostics: what a policy's plan costs (padding) and how diverse it is, before any training.

Every number uses the one definition in ``dflash_lab.metrics.throughput`` (padding) or
``dflash_lab.metrics.diversity`` (composition repeat, adjacent-length correlation, bucket run length, spread).
``smallest_k_for_efficiency`` picks the fewest fitted buckets whose *measured* plan reaches a padding target.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..config_check import as_float, as_int
from ..metrics import diversity
from ..metrics.throughput import batch_token_counts, block_token_counts, padding_efficiency
from .boundaries import bucket_ids, fit_boundaries
from .build import build_policy
from .policy import Policy


def plan_padding(batches: Sequence[np.ndarray], lengths: np.ndarray, *, packed: bool) -> dict[str, Any]:
    """Real, padded and attention tokens of a list of batches (``metrics.throughput.batch_token_counts``)."""
    counts = batch_token_counts(batches, lengths, packed=packed)
    return {
        "real_tokens": int(counts.real.sum()),
        "padded_tokens": int(counts.padded.sum()),
        "pad_eff": padding_efficiency(counts.real, counts.padded),
        "per_batch_real": counts.real,
        "per_batch_padded": counts.padded,
        "per_batch_attention": counts.attention,
    }


def plan_stats(policy: Policy, *, epoch: int = 0, bands: Sequence[int] | None = None) -> dict[str, Any]:
    """Diagnostics of one epoch's global plan (all ranks), plus composition repeat against epoch + 1.

    Args:
        policy: the policy.
        epoch: the epoch to describe.
        bands: boundaries used for "bucket run length" when the policy has none (a fixed set makes policies
            comparable); defaults to the policy's own buckets (its boundaries; with ``bucket_by: random`` its
            random groups, which no length band can see), else 6 equal-count bands.

    Returns:
        A flat dict: pad_eff, budget_fill, real/padded tokens, real_tokens_per_step (mean real tokens of one
        rank's batch: the value to give ``full_random``'s ``real_tokens_per_step`` for an equal-real-tokens
        comparison), batches and steps per epoch, mean/max samples per batch, composition_repeat,
        adjacent_length_corr, bucket_run_length, within_batch_spread, and the sampling diagnostics (kept, dropped,
        truncated, repeated/dropped by the remainder rule).
    """
    plan = policy.global_plan(epoch)
    lengths = policy.lengths
    batches = plan.batches
    padding = plan_padding(batches, lengths, packed=policy.packed)
    sizes = np.fromiter((b.size for b in batches), dtype=np.int64, count=len(batches))
    own_groups = bands is None and policy.bucket_by == "random"
    if bands is None:
        bands = policy.boundaries
    if bands is None:
        kept_lengths = lengths[policy.admission.kept]
        qs = np.unique(np.quantile(kept_lengths, np.linspace(0, 1, 7)[1:-1], method="higher").astype(np.int64))
        bands = [0, *[int(q) for q in qs if q < kept_lengths.max()], int(kept_lengths.max())]
    if own_groups:  # bucket of each step (its rank-0 batch): the random group it was packed from
        rank0 = batches[:: policy.world_size]
        step_bucket = np.fromiter((policy.bucket_of(b) for b in rank0), dtype=np.int64, count=len(rank0))
    else:
        longest = diversity.batch_reduce(batches, lengths.astype(np.int64), np.maximum)
        step_bucket = bucket_ids(longest, bands)[:: policy.world_size]  # bucket of each step (its rank-0 batch)
    next_batches = policy.plan(epoch + 1).batches
    return {
        "policy": policy.name,
        "bucket_by": policy.bucket_by,  # length | random (the negative control's groups) | None: no buckets
        "pad_eff": padding["pad_eff"],
        # Share of the per-step token budget holding real tokens (packed: the row fill).
        "budget_fill": padding["real_tokens"] / max(1, len(batches) * int(policy.config["max_tokens"])),
        "real_tokens": padding["real_tokens"],
        "padded_tokens": padding["padded_tokens"],
        "real_tokens_per_step": padding["real_tokens"] / max(1, len(batches)),  # per rank, like max_tokens
        "batches_per_epoch": len(batches),
        "steps_per_epoch": plan.steps,
        "mean_samples_per_batch": float(sizes.mean()) if sizes.size else float("nan"),
        "max_samples_per_batch": int(sizes.max()) if sizes.size else 0,
        "composition_repeat": diversity.composition_repeat(batches, next_batches),
        # Consumption order is per rank: rank 0 sees one batch of each step.
        "adjacent_length_corr": diversity.adjacent_length_correlation(
            diversity.batch_mean_lengths(batches[:: policy.world_size], lengths)
        ),
        "bucket_run_length": diversity.bucket_run_length(step_bucket),
        "within_batch_spread": diversity.within_batch_spread(batches, lengths),
        **{k: v for k, v in policy.diagnostics(epoch).items() if k != "steps"},
        **block_stats(policy, batches),
    }


def batch_block_tokens(policy: Policy, batches: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per batch: block tokens trained and block slots run (``metrics.throughput.block_token_counts``); zeros
    for a policy built without block tokens."""
    blocks = policy.admission.block_tokens
    if blocks is None or not len(batches):
        empty = np.zeros(len(batches))
        return empty, empty
    return block_token_counts(batches, blocks, packed=policy.packed)


def block_stats(policy: Policy, batches: Sequence[np.ndarray]) -> dict[str, Any]:
    """Block tokens of a plan built with them (``sampling.anchors``): ``block_tokens`` (block slots run, padding
    slots included, mean per rank and step: what ``sampler.max_block_tokens`` bounds), ``block_tokens_max`` (the
    worst batch), ``block_pad_eff`` (trained / run block tokens), ``block_per_token`` (trained block tokens per
    real token) and ``thinned`` (samples whose anchors alone exceed the block budget); empty without them."""
    if policy.admission.block_tokens is None or not len(batches):
        return {}
    trained, slots = batch_block_tokens(policy, batches)
    real = batch_token_counts(batches, policy.lengths, packed=policy.packed).real
    return {"block_tokens": float(slots.mean()), "block_tokens_max": int(slots.max()),
            "block_pad_eff": float(trained.sum() / max(1, slots.sum())),
            "block_per_token": float(trained.sum() / max(1, real.sum())), "thinned": policy.admission.thinned}


def supervision_shares(policy: Policy, bands: Sequence[int], *, epoch: int = 0) -> dict[str, float]:
    """Share of one epoch plan's block tokens (the supervision) in each length band ``(lo, hi]``, counting every
    presentation (repeated remainder batches twice, dropped ones not). Under a per-document anchor rule the shares
    are the data's own whatever the policy: a batch's make-up never changes a document's anchors."""
    from .anchors import supervision_share

    blocks = policy.admission.block_tokens
    if blocks is None:
        return {}
    plan = policy.global_plan(epoch)
    counts = np.bincount(np.concatenate(plan.batches), minlength=blocks.size) if plan.batches else None
    return supervision_share(blocks, policy.lengths, list(bands), counts)


def smallest_k_for_efficiency(
    lengths: np.ndarray,
    target: float,
    *,
    max_tokens: int,
    method: str = "optimal",
    max_k: int = 32,
    seed: int = 0,
    **policy_params: Any,
) -> dict[str, Any]:
    """Fewest buckets whose measured bucketed plan (epoch 0) reaches ``target`` padding efficiency.

    Returns:
        ``{"num_buckets", "boundaries", "pad_eff", "curve": [(k, pad_eff), ...]}``.

    Raises:
        ValueError: when no K up to ``max_k`` reaches the target (the message gives the best reached).
    """
    target = as_float("target_pad_eff", target, maximum=1.0, example=0.9)
    if target <= 0:
        raise ValueError(f"target_pad_eff={target:g}: must be a padding efficiency in (0, 1], e.g. 0.9")
    max_k = as_int("max_k", max_k, minimum=1)
    curve = []
    for k in range(1, max_k + 1):
        boundaries = fit_boundaries(lengths, k, method)
        policy = build_policy(
            "bucketed", lengths, max_tokens=max_tokens, seed=seed, boundaries=boundaries, **policy_params
        )
        eff = plan_padding(policy.global_plan(0).batches, policy.lengths, packed=False)["pad_eff"]
        curve.append((k, eff))
        if eff >= target:
            return {"num_buckets": k, "boundaries": boundaries, "pad_eff": eff, "curve": curve}
    best_k, best_eff = max(curve, key=lambda kv: kv[1])
    raise ValueError(
        f"no bucket count up to {max_k} reaches padding efficiency {target:.3f} with method {method!r} "
        f"(best {best_eff:.3f} at K={best_k}); lower the target, raise max_k, or use bucketed_megabatch/packed"
    )


# sampler.real_tokens_per_step: <policy>: the named policy's mean real tokens per rank and step over the same data.
# full_random: bucketed (equal real tokens per step: full_random at the length-grouped policy's larger step);
# bucketed: full_random (equal optimizer updates per epoch: bucketed at full_random's smaller step).
MATCHED_POLICIES = ("bucketed", "full_random")
MATCH_BUCKETED = "bucketed"   # full_random's sampler.real_tokens_per_step: bucketed


def reference_real_tokens(name: str, sampler_cfg: dict[str, Any], lengths: np.ndarray, *, builtin_corpus: bool,
                          seed: int, world_size: int) -> int:
    """The mean real tokens per rank and step (rounded) of policy ``name``'s own plan (its padded budget; bucketed
    with its automatic boundaries and default fit, :func:`dflash_lab.sampling.bucketed.resolve_auto_boundaries`)
    over ``lengths`` with the budget of ``sampler_cfg`` (max_tokens, max_samples, overlong), seed and world size,
    epoch 0; at least the longest admitted sample (the floor of a real-token budget)."""
    from .bucketed import resolve_auto_boundaries

    extra: dict[str, Any] = {}
    if name == "bucketed":
        auto = resolve_auto_boundaries({"boundaries": "auto", "num_buckets": None}, builtin_corpus=builtin_corpus)
        extra = {"boundaries": auto["boundaries"], "num_buckets": auto["num_buckets"]}
    reference = build_policy(name, lengths, max_tokens=sampler_cfg["max_tokens"], seed=seed, world_size=world_size,
                             max_samples=sampler_cfg.get("max_samples"), overlong=sampler_cfg["overlong"], **extra)
    longest = int(reference.admission.lengths[reference.admission.kept].max())
    return max(longest, int(round(plan_stats(reference)["real_tokens_per_step"])))


def resolve_matched_real_tokens(sampler_cfg: dict[str, Any], lengths: np.ndarray, *, builtin_corpus: bool,
                                seed: int, world_size: int) -> dict[str, Any]:
    """``sampler.real_tokens_per_step: <policy>`` resolved where the data is known, in both directions: the other
    policy's mean real tokens per rank and step over the same lengths, budget, seed and world size
    (:func:`reference_real_tokens`). full_random with ``bucketed``: full_random at the question arm's real tokens
    per step (equal real tokens per step); bucketed with ``full_random``: bucketed at full_random's (equal
    optimizer updates per epoch). Any number or null is returned as given. The trainer and the planner both call
    this, so a plan and a run of one config resolve the same T. Without a block budget: on a GPU with
    ``max_block_tokens`` the reference's steps may carry fewer tokens.

    Why from a plan, not a number in the arm file: the protocol runs on any data, and T depends on its lengths.

    Raises:
        ValueError: a policy name that is not the other of the pair (one line naming the key and the choices).

    Example:
        >>> cfg = {"name": "full_random", "max_tokens": 400, "overlong": "error", "real_tokens_per_step": "bucketed"}
        >>> lengths = np.array([10, 12, 14, 90, 95, 100] * 20)
        >>> resolve_matched_real_tokens(cfg, lengths, builtin_corpus=False, seed=0, world_size=1)["real_tokens_per_step"]
        357
        >>> cfg = {"name": "bucketed", "max_tokens": 400, "overlong": "error", "real_tokens_per_step": "full_random"}
        >>> resolve_matched_real_tokens(cfg, lengths, builtin_corpus=False, seed=0, world_size=1)["real_tokens_per_step"]
        221
    """
    cfg = dict(sampler_cfg)
    value = cfg.get("real_tokens_per_step")
    if not isinstance(value, str):
        return cfg
    if cfg.get("name") not in MATCHED_POLICIES or value not in MATCHED_POLICIES or value == cfg.get("name"):
        raise ValueError(f"sampler.real_tokens_per_step={value} for sampler={cfg.get('name')}: give a number, null, "
                         f"or the other policy of the pair (sampler=full_random: bucketed; sampler=bucketed: "
                         f"full_random)")
    cfg["real_tokens_per_step"] = reference_real_tokens(value, cfg, lengths, builtin_corpus=builtin_corpus,
                                                        seed=seed, world_size=world_size)
    return cfg


LR_SCALING = {"sqrt": 0.5, "linear": 1.0}   # trainer.lr_scaling: the exponent of the real-tokens-per-step ratio


def lr_scale(rule: str | None, sampler_cfg: dict[str, Any], lengths: np.ndarray, *, builtin_corpus: bool, seed: int,
             world_size: int) -> dict[str, Any]:
    """``trainer.lr_scaling``: the factor on the peak LR for a policy whose steps carry more (or fewer) real tokens
    than full_random's: (T / T_full_random) ** exponent (``LR_SCALING``: sqrt 0.5, linear 1), T the mean real
    tokens per rank and step of this run's own plan (``sampler_cfg`` resolved) and T_full_random that of
    full_random's plan over the same data, budget and seed (:func:`reference_real_tokens`). None: factor 1.

    Why sqrt is the protocol's rule: the loss is a mean over supervised tokens, so a step of r times the tokens has
    1/r the gradient noise; for Adam-type optimizers the square-root rule (lr x sqrt(r)) keeps the training
    dynamics' noise scale (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"),
    where the linear rule belongs to SGD (Goyal et al. 2017).

    Example:
        >>> lengths = np.array([10, 12, 14, 90, 95, 100] * 20)
        >>> cfg = {"name": "bucketed", "max_tokens": 400, "overlong": "error", "boundaries": [0, 50, 100]}
        >>> scale = lr_scale("sqrt", cfg, lengths, builtin_corpus=False, seed=0, world_size=1)
        >>> scale["real_tokens"], scale["reference_real_tokens"], round(scale["factor"], 3)
        (357, 221, 1.27)
    """
    if rule is None:
        return {"rule": None, "factor": 1.0, "real_tokens": None, "reference_real_tokens": None}
    if rule not in LR_SCALING:
        raise ValueError(f"trainer.lr_scaling={rule!r}: choose null, sqrt or linear (the LR times (real tokens per "
                         f"step / full_random's) ** 0.5 or ** 1), e.g. trainer.lr_scaling=sqrt")
    own = build_policy(sampler_cfg["name"], lengths, seed=seed, world_size=world_size,
                       **{k: v for k, v in sampler_cfg.items() if k not in ("name", "max_block_tokens")})
    tokens = float(plan_stats(own)["real_tokens_per_step"])
    reference = reference_real_tokens("full_random", sampler_cfg, lengths, builtin_corpus=builtin_corpus, seed=seed,
                                      world_size=world_size)
    return {"rule": rule, "factor": (tokens / reference) ** LR_SCALING[rule], "real_tokens": int(round(tokens)),
            "reference_real_tokens": reference}
