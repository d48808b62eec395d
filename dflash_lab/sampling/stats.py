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


MATCH_BUCKETED = "bucketed"   # full_random's sampler.real_tokens_per_step: bucketed


def resolve_matched_real_tokens(sampler_cfg: dict[str, Any], lengths: np.ndarray, *, builtin_corpus: bool,
                                seed: int, world_size: int) -> dict[str, Any]:
    """``sampler.real_tokens_per_step: bucketed`` (full_random at the question arm's real tokens per step), resolved
    where the data is known: the mean real tokens per rank and step of the bucketed plan over the same lengths,
    budget (max_tokens, max_samples, overlong), seed and world size, with bucketed's automatic boundaries
    (:func:`dflash_lab.sampling.bucketed.resolve_auto_boundaries`) and bucketed's default fit, epoch 0; rounded,
    and at least the longest admitted sample (full_random's floor for T). Any other value is returned as given.
    Without a block budget: on a GPU with ``max_block_tokens`` the bucketed arm's steps may carry fewer tokens.

    Why from a plan, not a number in the arm file: the protocol runs on any data, and T depends on its lengths.

    Example:
        >>> cfg = {"name": "full_random", "max_tokens": 400, "overlong": "error", "real_tokens_per_step": "bucketed"}
        >>> lengths = np.array([10, 12, 14, 90, 95, 100] * 20)
        >>> resolve_matched_real_tokens(cfg, lengths, builtin_corpus=False, seed=0, world_size=1)["real_tokens_per_step"]
        357
    """
    cfg = dict(sampler_cfg)
    if cfg.get("real_tokens_per_step") != MATCH_BUCKETED:
        return cfg
    from .bucketed import resolve_auto_boundaries

    auto = resolve_auto_boundaries({"boundaries": "auto", "num_buckets": None}, builtin_corpus=builtin_corpus)
    bucketed = build_policy("bucketed", lengths, max_tokens=cfg["max_tokens"], seed=seed, world_size=world_size,
                            max_samples=cfg.get("max_samples"), overlong=cfg["overlong"],
                            boundaries=auto["boundaries"], num_buckets=auto["num_buckets"])
    longest = int(bucketed.admission.lengths[bucketed.admission.kept].max())
    cfg["real_tokens_per_step"] = max(longest, int(round(plan_stats(bucketed)["real_tokens_per_step"])))
    return cfg
