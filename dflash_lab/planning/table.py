"""The plan table: one row per policy (diagnostics, predicted throughput, the memory plan and its columns), and the
bucket-count sweep."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from ..config_check import as_bool, as_choice, as_float, as_int
from ..sampling import FIT_METHODS, Policy, fit_boundaries, policy_from_config
from ..sampling.stats import plan_stats, supervision_shares
from .config import SHARED_KEYS, sweep_range
from .cost import CostModel, predict_throughput


def plan_table(
    lengths: np.ndarray,
    samplers: Mapping[str, Mapping[str, Any]],
    *,
    seed: int,
    world_size: int,
    epochs: float,
    cost: CostModel,
    bands: Sequence[int] | None = None,
    memory: Mapping[str, Any] | None = None,
    block_tokens: np.ndarray | None = None,
    comm_s: float = 0.0,
    on_policy: Callable[[str], None] | None = None,
) -> pd.DataFrame:
    """One row per policy: diagnostics (``sampling.stats.plan_stats``) + predicted throughput and ETA (every step
    plus ``comm_s``, the gradient all-reduce across nodes: ``cost.gradient_allreduce_seconds``), and with
    ``memory`` (``memory_inputs``) the memory plan (``model.footprint.memory_plan``: an ``auto`` block budget and
    checkpointing resolved against the GPU), predicted peak GPU memory, TFLOPs per step and fit
    (``memory_columns``). ``block_tokens`` (per sample, ``sampling.anchors``) add the block-token columns and the
    supervision share per band (``share <lo>-<hi>``, over ``bands`` or the first bucketed policy's boundaries).
    ``on_policy(text)`` is told which policy is planned (``planning.progress.StageTimer.stage``)."""
    rows = []
    share_bands = list(bands) if bands is not None else None
    for number, (name, sampler_cfg) in enumerate(samplers.items(), start=1):
        if on_policy is not None:
            on_policy(f"policy {name} ({number} of {len(samplers)}): its epoch plans, diversity and predicted speed"
                      + (", memory" if memory else ""))
        requested = sampler_cfg.get("max_block_tokens")
        sampler_cfg, chosen = resolve_block_budget(sampler_cfg, lengths, memory, seed=seed, block_tokens=block_tokens)
        policy = policy_from_config(sampler_cfg, lengths, seed=seed, world_size=world_size, rank=0,
                                    block_tokens=block_tokens)
        if share_bands is None and policy.boundaries:
            share_bands = list(policy.boundaries)
        step_model = memory["model"] if memory else None
        predicted = predict_throughput(policy, cost, epochs, step_model=step_model,
                                       recompute=bool(chosen is not None and chosen.activation_checkpointing),
                                       comm_s=comm_s)
        stats = plan_stats(policy, bands=bands)
        rows.append(
            {
                **stats,
                "padded_tokens_per_step": stats["padded_tokens"] / max(1, stats["batches_per_epoch"]),
                **{f"pred_{k}": v for k, v in predicted.items()},
                **(memory_columns(policy, lengths, sampler_cfg, seed=seed, block_tokens=block_tokens,
                                  **{**memory, "settings": chosen}) if memory else {}),
                "max_block_tokens": sampler_cfg.get("max_block_tokens"),
                "boundaries": policy.boundaries,
                "_policy": policy,
            }
        )
        if memory and block_tokens is not None:
            fits = rows[-1]["fits"] == "yes" or (rows[-1]["fits"] == "ckpt" and chosen.activation_checkpointing)
            rows[-1]["max_block_tokens_fit"] = largest_block_budget(
                requested if fits else None, sampler_cfg, lengths, memory, chosen, seed=seed, world_size=world_size,
                block_tokens=block_tokens)
    if block_tokens is not None:
        if on_policy is not None:
            on_policy("supervision share per length band")
        if share_bands is None:
            share_bands = quantile_bands(lengths)
        for row in rows:
            row.update({f"share {band}": v for band, v in supervision_shares(row["_policy"], share_bands).items()})
    for row in rows:
        del row["_policy"]
    return pd.DataFrame(rows).set_index("policy")


def quantile_bands(lengths: np.ndarray, count: int = 6) -> list[int]:
    """``count`` equal-count length bands (edges, first 0, last the longest).

    Example:
        >>> quantile_bands(np.arange(1, 101), 4)
        [0, 26, 51, 76, 100]
    """
    qs = np.unique(np.quantile(lengths, np.linspace(0, 1, count + 1)[1:-1], method="higher").astype(np.int64))
    return [0, *[int(q) for q in qs if q < lengths.max()], int(lengths.max())]


def resolve_block_budget(sampler_cfg: Mapping[str, Any], lengths: np.ndarray, memory: Mapping[str, Any] | None, *,
                         seed: int, block_tokens: np.ndarray | None) -> tuple[dict[str, Any], Any]:
    """The sampler config with ``max_block_tokens`` resolved (``auto``: ``model.footprint.memory_plan``), and the
    memory settings with the checkpointing the plan chose (None without memory inputs: ``auto`` = no budget)."""
    cfg = dict(sampler_cfg)
    if memory is None:
        if cfg.get("max_block_tokens") == "auto":
            cfg["max_block_tokens"] = None
        return cfg, None
    from ..model.footprint import PreflightError, memory_plan

    try:
        chosen = memory_plan(memory["model"], lengths, cfg, memory["settings"],
                             activation_checkpointing=memory["activation_checkpointing"],
                             gpu_mem_gb=memory["gpu_mem_gb"], seed=seed, block_tokens=block_tokens)
    except PreflightError:
        # nothing fits: plan at the smallest budget that keeps the objective, so the row shows its peak and "no"
        cfg["max_block_tokens"] = int(block_tokens.max()) if block_tokens is not None else None
        return cfg, replace(memory["settings"], activation_checkpointing=memory["activation_checkpointing"] is True)
    cfg["max_block_tokens"] = chosen.max_block_tokens
    return cfg, replace(memory["settings"], activation_checkpointing=chosen.activation_checkpointing)


def largest_block_budget(requested: Any, sampler_cfg: Mapping[str, Any], lengths: np.ndarray,
                         memory: Mapping[str, Any], settings: Any, *, seed: int, world_size: int,
                         block_tokens: np.ndarray) -> int | None:
    """The largest ``sampler.max_block_tokens`` that fits the GPU with the memory plan's checkpointing (the
    resolved value when it was ``auto``; None when no budget that keeps the objective fits)."""
    from ..model.footprint import USABLE_FRACTION, largest_fitting_block_tokens

    if requested == "auto":
        return sampler_cfg.get("max_block_tokens")
    return largest_fitting_block_tokens(lengths, sampler_cfg, memory["model"], settings,
                                        budget_gb=USABLE_FRACTION * memory["gpu_mem_gb"], seed=seed,
                                        world_size=world_size, block_tokens=block_tokens)


def memory_inputs(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """Inputs of the memory/FLOP columns from the plan config: the model's shape from its config alone (no
    weights), ``precision``, ``activation_checkpointing`` (true | false | auto), ``attention``, ``world_size``
    and the GPU's memory (``gpu.memory_gb`` of a preset, else ``gpu_mem_gb``). None (columns left out) when the
    model config gives no target shape (``model=hf`` without ``target_config`` or ``target_path``).

    Example:
        >>> from dflash_lab.presets import preset
        >>> plan_section = {"world_size": 8, "activation_checkpointing": False, "precision": "bf16",
        ...                 "attention": "flex", "gpu_mem_gb": 80}     # conf/plan.yaml's keys
        >>> memory_inputs({"model": preset("model", "tiny"), **plan_section})["settings"].world_size
        8
    """
    from ..model.footprint import ATTENTION_PATHS, Settings, StepModel

    model_cfg = dict(cfg["model"])
    if model_cfg.get("kind") == "hf" and not (model_cfg.get("target_config") or model_cfg.get("target_path")):
        return None
    checkpointing = cfg["activation_checkpointing"]
    if checkpointing != "auto":
        checkpointing = as_bool("activation_checkpointing", checkpointing)
    settings = Settings(precision=as_choice("precision", cfg["precision"], ["bf16", "fp32"]),
                        activation_checkpointing=checkpointing is True,
                        attention=as_choice("attention", cfg["attention"], list(ATTENTION_PATHS)),
                        world_size=as_int("world_size", cfg["world_size"], minimum=1))
    preset = (cfg.get("gpu") or {}).get("memory_gb")
    gpu_mem_gb = preset if preset is not None else cfg["gpu_mem_gb"]
    return {"model": StepModel.from_model_config(model_cfg), "settings": settings,
            "activation_checkpointing": checkpointing,
            "gpu_mem_gb": as_float("gpu.memory_gb" if preset is not None else "gpu_mem_gb", gpu_mem_gb, minimum=1.0)}


def memory_columns(policy: Policy, lengths: np.ndarray, sampler_cfg: Mapping[str, Any], *, model, settings,
                   gpu_mem_gb: float, seed: int, block_tokens: np.ndarray | None = None,
                   activation_checkpointing: Any = None) -> dict[str, Any]:
    """``pred_peak_mem_gb`` (worst step) and ``pred_gpu_use`` (its share of ``gpu_mem_gb``),
    ``pred_peak_mem_gb_ckpt``, ``pred_tflop_per_step``, ``fits``
    (yes | ckpt | no, ``dflash_lab.model.footprint.plan_footprint``), ``ckpt`` (the checkpointing the memory plan
    uses) and ``max_tokens_fit``: the largest ``sampler.max_tokens`` that fits with that checkpointing (the
    configured one when it fits)."""
    from ..model.footprint import USABLE_FRACTION, largest_fitting_max_tokens, plan_footprint

    out = plan_footprint(policy, model, settings, gpu_mem_gb=gpu_mem_gb)
    out["pred_gpu_use"] = out["pred_peak_mem_gb"] / gpu_mem_gb   # the worst step's share of the GPU's memory
    fits_now = out["fits"] == "yes" or (out["fits"] == "ckpt" and settings.activation_checkpointing)
    out["ckpt"] = "on" if settings.activation_checkpointing else "off"
    out["max_tokens_fit"] = int(sampler_cfg["max_tokens"]) if fits_now else largest_fitting_max_tokens(
        lengths, sampler_cfg, model, settings, budget_gb=USABLE_FRACTION * gpu_mem_gb, seed=seed,
        world_size=policy.world_size, block_tokens=block_tokens)
    return out


def sweep_bucket_counts(
    lengths: np.ndarray,
    k_range: Sequence[int],
    sampler_cfg: Mapping[str, Any],
    *,
    method: str,
    seed: int,
    world_size: int,
    on_count: Callable[[str], None] | None = None,
) -> pd.DataFrame:
    """Padding efficiency and diversity of bucketed (and bucketed_megabatch) plans for K fitted buckets.

    Args:
        k_range: ``[k_min, k_max]`` (``sweep_range`` checks it).
        on_count: told which bucket count is planned (``planning.progress.StageTimer.stage``).
    """
    k_min, k_max = sweep_range(k_range)
    as_choice("sweep_method", method, FIT_METHODS)
    base = {k: v for k, v in sampler_cfg.items() if k in SHARED_KEYS}
    rows = []
    for k in range(k_min, k_max + 1):
        if on_count is not None:
            on_count(f"K sweep: {k} buckets ({k - k_min + 1} of {k_max - k_min + 1})")
        boundaries = fit_boundaries(lengths, k, method)
        for name in ("bucketed", "bucketed_megabatch"):
            cfg = {"name": name, **base, "boundaries": boundaries}
            stats = plan_stats(policy_from_config(cfg, lengths, seed=seed, world_size=world_size))
            rows.append({"num_buckets": k, "boundaries": boundaries, **stats})
    return pd.DataFrame(rows)


def plot_k_sweep(sweep: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, group in sweep.groupby("policy"):
        ax.plot(group["within_batch_spread"], group["pad_eff"], marker="o", label=name)
        for _, row in group.iterrows():
            ax.annotate(str(row["num_buckets"]), (row["within_batch_spread"], row["pad_eff"]), fontsize=7)
    ax.set_xlabel("within-batch length spread (mean CV): higher = more mixed batches")
    ax.set_ylabel("padding efficiency")
    ax.set_title("Bucket count K: padding vs batch diversity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
