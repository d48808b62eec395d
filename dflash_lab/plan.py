"""Planner: what each batching policy will cost *before* any GPU-day is spent.

``python -m dflash_lab.plan`` composes the same ``conf/`` as training, builds every policy's epoch plan on the
configured data (or a reference length workload, ``data=lengths``), and prints two narrow tables, one row per
policy. The first says which regime the prediction is for and what it predicts: padding efficiency, steps per
epoch, documents, real tokens, padded tokens and block slots per rank and step, predicted Ktok/s over time and on
the median step, ETA of the configured run (``epochs``, ``world_size``; days and hours); lines under it give each
policy's Ktok/s relative to bucketed and, for the FLOPs form, what a target off the trainer GPUs changes. The
second has the diversity diagnostics of ``sampling.stats`` (composition repeat, within-batch spread,
adjacent-length correlation) and, when memory is known, the predicted peak memory and whether it fits; a legend
says what each column measures, and one line recommends the fastest policy that clears the
``recommend.*`` diversity floors (and fits). It writes ``plan.csv`` (every column, full precision), ``plan.json``
(the same, the recommendation in ``meta``) and ``plan.md`` (the printed text, then every column) to its output
directory; ``sweep_k=[lo,hi]`` adds a bucket-count sweep (``k_sweep.csv`` and
``k_sweep.png``: padding efficiency against within-batch diversity, the trade-off the boundaries choose), and
``target_pad_eff=0.9`` reports the fewest fitted buckets whose plan reaches that efficiency. When the model config
gives the target's shape (``model=tiny``, ``model=qwen3_8b``, or ``model.target_config=config.json``), each row also
has the predicted peak GPU memory per rank with and without draft activation checkpointing, model TFLOPs per step,
a ``fits`` verdict against ``gpu_mem_gb`` and the largest ``max_tokens`` that fits (``dflash_lab.model.footprint``).

Cost model (explicit, per rank and step; a step lasts as long as its slowest rank):

    step time = c0 + c1 x padded tokens + c2 x attention tokens

with the token counts of ``metrics.throughput.batch_token_counts`` (the trainer logs the same numbers). Coefficients
come from config (``conf_plan/cost/``), are fitted by non-negative least squares on a run's ``metrics.jsonl``
(``cost.from_run=RUN_DIR``), or are calibrated by a short micro-benchmark of the configured model
(``cost.calibrate=true``); ``cost.target`` (online | offline | disaggregated) says whether the FLOPs form prices
the target's forward. Predicted Ktok/s is Ktok/s over time (the epoch's real tokens over its summed step times,
``throughput.ktok_s_over_time``: what a run's tokens over its wall time measure); the median-step figure (the
trainer's summary definition) is its second column; ETA = epochs x steps per epoch x mean step time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from .config_check import as_bool, as_choice, as_float, as_int, refuse_unknown_keys
from .metrics.throughput import (
    format_eta, full_run_eta_seconds, ktok_per_s, ktok_s_over_time, steady_state_ktok_s, token_counts,
)
from .record import METRICS_FILE, SUMMARY_FILE, read_jsonl
from .sampling import (
    FIT_METHODS, POLICIES, Policy, fit_boundaries, policy_from_config, policy_keys, resolve_auto_boundaries,
    smallest_k_for_efficiency,
    validate_boundaries, validate_lengths,
)
from .sampling.anchors import anchor_rule_name, block_tokens_per_sample, valid_positions_from_lengths
from .sampling.stats import batch_block_tokens, plan_padding, plan_stats, supervision_shares

CONF_DIR = Path(__file__).resolve().parent / "conf"  # package data (dflash_lab.conf), in a checkout and a wheel
PLAN_CONF_DIR = Path(__file__).resolve().parent / "conf_plan"  # groups only the planner uses (cost, data=lengths)
# Keys that describe the budget rather than the policy: the chosen sampler's values apply to every policy compared.
SHARED_KEYS = ("max_tokens", "max_samples", "quadratic_length", "max_block_tokens", "drop_last", "overlong")
# Keys that define the buckets (which boundaries, and what decides membership: bucket_by=random is the negative
# control): the chosen sampler's values apply to every bucketed policy compared.
BUCKET_KEYS = ("boundaries", "num_buckets", "fit_method", "bucket_by")
MAX_SWEEP_K = 256  # more buckets than this is no longer bucketing


# Where the target's forward runs (cost.target): on the trainer GPUs every step (this trainer; SpecForge's online
# mode), or off them: hidden states read from disk (offline) or sent by a separate inference server (disaggregated,
# SpecForge with an SGLang server). Off the trainer GPUs a step does no target forward.
TARGET_MODES = ("online", "offline", "disaggregated")
TRIM_ROUNDS = 3     # CostModel.fit: refits after dropping stalled steps
TRIM_SIGMAS = 2.5   # a step slower than the fit by more than this many robust standard deviations is a stall


@dataclass(frozen=True)
class CostModel:
    """Per-rank step time (seconds) of a batch, one of two forms:

    * linear: ``c0 + c1 x padded tokens + c2 x attention tokens + c3 x block slots + c4 x packed documents``,
      with the token counts of
      ``metrics.throughput.batch_token_counts`` (attention tokens: rows x longest^2 for padded batches, the sum of
      squared document lengths for a packed row) and the block tokens of ``sampling.anchors`` (anchors x block
      size: the draft's work), the same numbers the trainer logs;
    * FLOPs: ``c0 + executed FLOPs / (utilisation x peak)``, with the step's FLOPs from the memory/FLOP model
      (``model.footprint.step_flops``: target, draft, head, with the anchors of each document; ``executed``
      counts what padded batches also run: padded tokens and padding anchor slots) and ``peak`` the GPU's dense
      BF16 FLOP/s (a ``gpu`` preset). Used when ``utilisation`` is set: the share of the peak that executed
      FLOPs run at (hardware FLOP utilisation); MFU (``pred_mfu``) counts model FLOPs only, so it is lower.
      ``target`` (TARGET_MODES) says where the target's forward runs: ``online`` counts it in every step;
      ``offline`` and ``disaggregated`` (off the trainer GPUs) leave it out. The linear form is fitted on this
      trainer's runs, which run the target online, so it is online only.
    """

    c0: float
    c1: float = 0.0
    c2: float = 0.0
    c3: float = 0.0
    c4: float = 0.0   # per document of a packed row: the CPU draft attends per document (one SDPA each), GPU ~0
    utilisation: float | None = None
    peak_tflops: float | None = None
    target: str = "online"

    def __post_init__(self) -> None:
        if self.target not in TARGET_MODES:
            raise ValueError(f"cost.target={self.target!r}: choose one of {', '.join(TARGET_MODES)}")
        if self.target != "online" and self.utilisation is None:
            raise ValueError(f"cost.target={self.target}: only the FLOPs form (cost.utilisation, e.g. cost=seed) "
                             f"can take the target's forward out; the linear coefficients were fitted with it online")

    def step_time(self, padded: np.ndarray, attention: np.ndarray, blocks: np.ndarray | float = 0.0,
                  packed_documents: np.ndarray | float = 0.0) -> np.ndarray:
        """Linear form (``utilisation`` unset)."""
        return (self.c0 + self.c1 * np.asarray(padded, dtype=np.float64)
                + self.c2 * np.asarray(attention, np.float64) + self.c3 * np.asarray(blocks, np.float64)
                + self.c4 * np.asarray(packed_documents, np.float64))

    def flop_step_time(self, flops: np.ndarray) -> np.ndarray:
        """FLOPs form: ``c0 + flops / (utilisation x peak)``."""
        return self.c0 + np.asarray(flops, dtype=np.float64) / (float(self.utilisation) * float(self.peak_tflops)
                                                                * 1e12)

    @classmethod
    def fit(cls, padded: np.ndarray, attention: np.ndarray, step_time: np.ndarray,
            trim_rounds: int = TRIM_ROUNDS, blocks: np.ndarray | None = None,
            packed_documents: np.ndarray | None = None) -> "CostModel":
        """Non-negative least squares (``scipy.optimize.nnls``) of step time on (1, padded, attention, block
        slots, packed documents), robust to stalls.

        Logged step times have a heavy right tail (garbage collection, other processes, a first call of a new
        shape): on a shared CPU the slowest 10% of steps take 1.4x the median and single steps 10x. Least squares
        would follow that tail and predict every step too slow, while Ktok/s is defined on the median step
        (``throughput.steady_state_ktok_s``). So each of ``trim_rounds`` rounds drops the steps slower than the
        current fit by more than TRIM_SIGMAS robust standard deviations (1.4826 x the residuals' median absolute
        deviation) and refits on the rest. Columns are scaled to unit maximum, so the solver sees comparable
        magnitudes; a column that is all zero (no block tokens logged; no packed run in the fit) gets a zero
        coefficient.

        Example:
            >>> padded = np.tile([1000.0, 2000.0, 3000.0, 4000.0], 25)
            >>> times = 0.01 + 1e-5 * padded
            >>> times[::10] *= 5  # stalls
            >>> model = CostModel.fit(padded, np.zeros_like(padded), times)
            >>> round(model.c0, 4), round(model.c1 * 1e5, 3)
            (0.01, 1.0)
        """
        from scipy.optimize import nnls

        y = np.asarray(step_time, dtype=np.float64)
        if y.size < 3:
            raise ValueError(f"need at least 3 logged steps to fit the cost model, got {y.size}")
        optional = [np.zeros_like(y) if v is None else np.asarray(v, np.float64) for v in (blocks, packed_documents)]
        x = np.stack([np.ones_like(y), np.asarray(padded, np.float64), np.asarray(attention, np.float64),
                      *optional], axis=1)
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        keep = np.ones(y.size, dtype=bool)
        for _ in range(trim_rounds + 1):
            coef, _ = nnls(x[keep] / scale, y[keep])
            residual = y - (x / scale) @ coef
            spread = 1.4826 * np.median(np.abs(residual[keep] - np.median(residual[keep])))
            slow = residual > np.median(residual[keep]) + TRIM_SIGMAS * spread
            if spread == 0 or (~slow).sum() < 3 or np.array_equal(~slow, keep):
                break
            keep = ~slow
        return cls(*map(float, coef / scale))

    @classmethod
    def from_run(cls, run_dir: str | Path, warmup_steps: int = 10) -> "CostModel":
        """Fit from a run's metrics.jsonl: per-rank step times against per-rank padded, attention and block tokens
        (runs logged before block tokens were recorded fit without that term)."""
        padded, attention, times, blocks, documents = _run_columns(run_dir, warmup_steps)
        return cls.fit(padded, attention, times, blocks=blocks, packed_documents=documents)

    @classmethod
    def from_runs(cls, run_dirs: Sequence[str | Path], warmup_steps: int = 10) -> "CostModel":
        """Fit on the steps of several runs together (e.g. a padded and a packed one: the per-document cost of
        packed rows on CPU shows only in packed runs)."""
        columns = [_run_columns(run_dir, warmup_steps) for run_dir in run_dirs]
        padded, attention, times, blocks, documents = (np.concatenate(parts) for parts in zip(*columns))
        return cls.fit(padded, attention, times, blocks=blocks, packed_documents=documents)


def _run_columns(run_dir: str | Path, warmup_steps: int) -> tuple[np.ndarray, ...]:
    """(padded, attention, step time, block slots, packed documents) per rank and step of one run directory."""
    run_dir = Path(run_dir)
    rows, bad = read_jsonl(run_dir / METRICS_FILE)
    if not rows:
        raise ValueError(f"cost.from_run={str(run_dir)!r}: no usable {METRICS_FILE} rows there ({bad} unusable "
                         f"lines); point it at a run directory")
    missing = sorted({"padded_tokens", "attn_tokens", "step_time_s"} - set(rows[0]))
    if missing:
        raise ValueError(f"cost.from_run={str(run_dir)!r}: {METRICS_FILE} lacks {missing} (written by an older "
                         f"version of the trainer); fit from a run of this version")
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        summary = {}
    world = int(summary.get("world_size") or 1)
    packed = summary.get("sampler") == "packed"
    rows = rows[warmup_steps:] if len(rows) > warmup_steps + 3 else rows
    column = lambda name: np.asarray([r.get(name) or 0 for r in rows], dtype=np.float64)  # noqa: E731
    # Logged token counts are summed over ranks; the model is per rank. Block slots (what runs, padding anchor
    # slots included) price the draft, as the planner's plans count them.
    documents = column("batch_size") / world if packed else np.zeros(len(rows))
    return (column("padded_tokens") / world, column("attn_tokens") / world, column("step_time_s"),
            column("block_slots") / world, documents)


def calibrate_cost(
    model_cfg: Mapping[str, Any], max_tokens: int, *, row_lengths: Sequence[int] = (), repeats: int = 3, seed: int = 0
) -> CostModel:
    """Fit the cost model from a short micro-benchmark of the configured model (forward + backward + AdamW step).

    Times full-budget padded batches at several row lengths (``max_tokens // length`` rows each) and half-budget
    ones (so the constant term is identifiable), then fits ``CostModel.fit`` on (padded, attention, seconds).
    """
    import time

    import torch

    from .data import collate_padded
    from .model import build_model

    model, tokenizer = build_model(**dict(model_cfg))
    model.train()
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(seed)
    lengths = list(row_lengths) or [n for n in (32, 64, 128, 256, 512, 1024, 2048) if n <= max_tokens]
    padded, attention, seconds = [], [], []
    for length in lengths:
        for share in (1.0, 0.5):
            rows = max(1, int(max_tokens * share) // length)
            ids = torch.randint(4, int(tokenizer.vocab_size), (rows, length), generator=generator)
            samples = [{"input_ids": row, "loss_mask": torch.ones(length, dtype=torch.bool)} for row in ids]
            batch = collate_padded(samples, list(range(rows)), [length] * rows, tokenizer.pad_token_id)
            for attempt in range(repeats + 1):
                start = time.perf_counter()
                out = model(batch, generator)
                out.loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if attempt:  # the first pass warms up allocators and kernels
                    _, batch_padded, batch_attention = token_counts([length] * rows, packed=False)
                    padded.append(batch_padded)
                    attention.append(batch_attention)
                    seconds.append(time.perf_counter() - start)
    return CostModel.fit(np.asarray(padded, float), np.asarray(attention, float), np.asarray(seconds))


def predict_throughput(policy: Policy, cost: CostModel, epochs: float, epoch: int = 0,
                       step_model: Any = None, recompute: bool = False) -> dict[str, float]:
    """Predicted step time, Ktok/s and full-run ETA of a policy's plan under a cost model (all ranks).

    ``ktok_s`` is Ktok/s over time (``throughput.ktok_s_over_time``: the epoch's real tokens over the sum of its
    step times), the rate the ETA implies and the one a run's tokens over its wall time measure; ``ktok_s_median``
    is the trainer's summary definition (``throughput.steady_state_ktok_s``: the median over steps of a step's real
    tokens / its time), which a fitted run's summary can be checked against. The two part when step costs spread
    (a bucketed plan: one cost per bucket). ETA sums step times.
    Block tokens per batch come from the policy's own (``Admission.block_tokens``; none: 0). The FLOPs form of
    the cost model (``cost.utilisation``) needs ``step_model`` (``model.footprint.StepModel``) and also reports
    ``mfu`` (model FLOPs on the trainer GPUs over the run's time at the preset's peak), ``target_flop_share`` (the
    target forward's share of the executed FLOPs when it runs online) and ``ktok_s_target_online`` /
    ``ktok_s_target_off`` (Ktok/s with the target on the trainer GPUs, and off them: ``cost.target``);
    ``recompute`` (draft activation checkpointing) adds the draft forward that checkpointing runs again in backward.
    """
    plan = policy.global_plan(epoch)
    padding = plan_padding(plan.batches, policy.lengths, packed=policy.packed)
    _, per_batch_blocks = batch_block_tokens(policy, plan.batches)   # block slots run, padding slots included
    step_real = padding["per_batch_real"].reshape(plan.steps, policy.world_size).sum(axis=1)

    def step_times_of(per_batch: np.ndarray) -> np.ndarray:
        return per_batch.reshape(plan.steps, policy.world_size).max(axis=1)  # the slowest rank sets the pace

    flop_extras: dict[str, float] = {}
    flops = None
    if cost.utilisation is not None:
        from .model.footprint import batch_shapes, policy_anchors, step_flops

        if step_model is None or cost.peak_tflops is None:
            raise ValueError("cost.utilisation needs the model's shape (model=qwen3_8b or model.target_config) and a "
                             "peak FLOP/s (gpu=rtx_pro_6000|h100|h200, or cost.peak_tflops)")
        shapes = batch_shapes(plan.batches, policy.lengths, packed=policy.packed, model=step_model,
                              anchors=policy_anchors(policy, step_model))
        counted = step_flops(step_model, shapes)
        online = counted["executed"] + (counted["executed_draft"] / 3.0 if recompute else 0.0)
        off = online - counted["executed_target"]
        executed = online if cost.target == "online" else off
        flops = counted["total"] - (0.0 if cost.target == "online" else counted["target"])
        per_batch = cost.flop_step_time(executed)
        if plan.steps:
            flop_extras = {
                "target_flop_share": float(counted["executed_target"].sum() / online.sum()),
                "ktok_s_target_online": ktok_s_over_time(step_real, step_times_of(cost.flop_step_time(online))),
                "ktok_s_target_off": ktok_s_over_time(step_real, step_times_of(cost.flop_step_time(off))),
            }
    else:
        documents = (np.fromiter((b.size for b in plan.batches), np.float64, count=len(plan.batches))
                     if policy.packed else np.zeros(len(plan.batches)))
        per_batch = cost.step_time(padding["per_batch_padded"], padding["per_batch_attention"], per_batch_blocks,
                                   documents)
    step_times = step_times_of(per_batch)
    if not step_times.size:
        return {"step_time_s": float("nan"), "ktok_s": float("nan"), "ktok_s_median": float("nan"),
                "epoch_hours": float("nan"), "eta_s": float("nan"), "eta_days": float("nan")}
    mean_step = float(step_times.mean())
    eta = full_run_eta_seconds(epochs, plan.steps, mean_step)
    out = {
        "step_time_s": mean_step,
        "ktok_s": ktok_s_over_time(step_real, step_times),
        "ktok_s_median": steady_state_ktok_s([ktok_per_s(r, t) for r, t in zip(step_real, step_times)],
                                             warmup_steps=0),
        "epoch_hours": float(step_times.sum()) / 3600.0,
        "eta_s": eta,
        "eta_days": eta / 86400.0,
        **flop_extras,
    }
    if flops is not None:  # model FLOPs of every rank over the epoch's time at world_size x peak
        out["mfu"] = float(flops.sum() / (step_times.sum() * policy.world_size * cost.peak_tflops * 1e12))
    return out


def policy_names(policies: Any) -> list[str]:
    """The ``policies`` key as a list of policy names: ``all``, one name, or a list of names.

    Example:
        >>> policy_names(["bucketed", "full_random"])
        ['bucketed', 'full_random']
    """
    if policies is None or policies == "all":
        return list(POLICIES)
    names = [policies] if isinstance(policies, str) else policies
    if not isinstance(names, Sequence) or len(names) == 0:
        raise ValueError(f"policies={policies!r}: give all or a list of policies, e.g. policies=[bucketed,full_random]")
    unknown = [n for n in names if not isinstance(n, str) or n not in POLICIES]
    if unknown:
        raise ValueError(
            f"policies={list(names)}: unknown {unknown}; choose from {', '.join(POLICIES)} or all "
            f"(e.g. policies=[bucketed,full_random])"
        )
    return list(dict.fromkeys(names))


def sampler_configs(chosen: Mapping[str, Any], policies: Any) -> dict[str, dict[str, Any]]:
    """The sampler config of each compared policy: its own conf/sampler file, with the chosen budget keys applied.

    The chosen sampler (``sampler=...``) is used as composed; the others take their file's policy-specific keys
    and the chosen sampler's budget keys (and bucket keys, ``BUCKET_KEYS``, for bucketed policies) so all share one
    budget and one bucketing: ``sampler.bucket_by=random`` plans every bucketed policy compared as its negative
    control.
    Every config's keys are checked against its policy (``sampling.policy_keys``) before anything is built.
    """
    from omegaconf import OmegaConf

    as_choice("sampler.name", chosen.get("name"), POLICIES)
    out = {}
    for name in policy_names(policies):
        if name == chosen["name"]:
            out[name] = dict(chosen)
            continue
        own = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "sampler" / f"{name}.yaml"), resolve=True)
        for key in SHARED_KEYS + BUCKET_KEYS:
            if key in chosen and key in own:
                own[key] = chosen[key]
        out[name] = own
    for name, sampler_cfg in out.items():
        refuse_unknown_keys(f"{name} sampler", sampler_cfg, ["name", "max_tokens", *policy_keys(name)])
    return out


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
) -> pd.DataFrame:
    """One row per policy: diagnostics (``sampling.stats.plan_stats``) + predicted throughput and ETA, and with
    ``memory`` (``memory_inputs``) the memory plan (``model.footprint.memory_plan``: an ``auto`` block budget and
    checkpointing resolved against the GPU), predicted peak GPU memory, TFLOPs per step and fit
    (``memory_columns``). ``block_tokens`` (per sample, ``sampling.anchors``) add the block-token columns and the
    supervision share per band (``share <lo>-<hi>``, over ``bands`` or the first bucketed policy's boundaries)."""
    rows = []
    share_bands = list(bands) if bands is not None else None
    for name, sampler_cfg in samplers.items():
        requested = sampler_cfg.get("max_block_tokens")
        sampler_cfg, chosen = resolve_block_budget(sampler_cfg, lengths, memory, seed=seed, block_tokens=block_tokens)
        policy = policy_from_config(sampler_cfg, lengths, seed=seed, world_size=world_size, rank=0,
                                    block_tokens=block_tokens)
        if share_bands is None and policy.boundaries:
            share_bands = list(policy.boundaries)
        step_model = memory["model"] if memory else None
        predicted = predict_throughput(policy, cost, epochs, step_model=step_model,
                                       recompute=bool(chosen is not None and chosen.activation_checkpointing))
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
    from .model.footprint import PreflightError, memory_plan

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
    from .model.footprint import USABLE_FRACTION, largest_fitting_block_tokens

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
        >>> memory_inputs({"model": {"kind": "tiny"}, "world_size": 8})["settings"].world_size
        8
    """
    from .model.footprint import ATTENTION_PATHS, Settings, StepModel

    model_cfg = dict(cfg["model"])
    if model_cfg.get("kind") == "hf" and not (model_cfg.get("target_config") or model_cfg.get("target_path")):
        return None
    checkpointing = cfg.get("activation_checkpointing", False)
    if checkpointing != "auto":
        checkpointing = as_bool("activation_checkpointing", checkpointing)
    settings = Settings(precision=as_choice("precision", cfg.get("precision", "bf16"), ["bf16", "fp32"]),
                        activation_checkpointing=checkpointing is True,
                        attention=as_choice("attention", cfg.get("attention", "flex"), list(ATTENTION_PATHS)),
                        world_size=as_int("world_size", cfg["world_size"], minimum=1))
    preset = (cfg.get("gpu") or {}).get("memory_gb")
    gpu_mem_gb = preset if preset is not None else cfg.get("gpu_mem_gb", 80)
    return {"model": StepModel.from_model_config(model_cfg), "settings": settings,
            "activation_checkpointing": checkpointing,
            "gpu_mem_gb": as_float("gpu.memory_gb" if preset is not None else "gpu_mem_gb", gpu_mem_gb, minimum=1.0)}


def memory_columns(policy: Policy, lengths: np.ndarray, sampler_cfg: Mapping[str, Any], *, model, settings,
                   gpu_mem_gb: float, seed: int, block_tokens: np.ndarray | None = None,
                   activation_checkpointing: Any = None) -> dict[str, Any]:
    """``pred_peak_mem_gb`` (worst step), ``pred_peak_mem_gb_ckpt``, ``pred_tflop_per_step``, ``fits``
    (yes | ckpt | no, ``dflash_lab.model.footprint.plan_footprint``), ``ckpt`` (the checkpointing the memory plan
    uses) and ``max_tokens_fit``: the largest ``sampler.max_tokens`` that fits with that checkpointing (the
    configured one when it fits)."""
    from .model.footprint import USABLE_FRACTION, largest_fitting_max_tokens, plan_footprint

    out = plan_footprint(policy, model, settings, gpu_mem_gb=gpu_mem_gb)
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
) -> pd.DataFrame:
    """Padding efficiency and diversity of bucketed (and bucketed_megabatch) plans for K fitted buckets.

    Args:
        k_range: ``[k_min, k_max]`` (``sweep_range`` checks it).
    """
    k_min, k_max = sweep_range(k_range)
    as_choice("sweep_method", method, FIT_METHODS)
    base = {k: v for k, v in sampler_cfg.items() if k in SHARED_KEYS}
    rows = []
    for k in range(k_min, k_max + 1):
        boundaries = fit_boundaries(lengths, k, method)
        for name in ("bucketed", "bucketed_megabatch"):
            cfg = {"name": name, **base, "boundaries": boundaries}
            stats = plan_stats(policy_from_config(cfg, lengths, seed=seed, world_size=world_size))
            rows.append({"num_buckets": k, "boundaries": boundaries, **stats})
    return pd.DataFrame(rows)


def sweep_range(value: Any) -> tuple[int, int]:
    """``sweep_k`` as ``(k_min, k_max)``: two positive integers, k_min <= k_max <= MAX_SWEEP_K.

    Example:
        >>> sweep_range([2, 16])
        (2, 16)
        >>> sweep_range([8, 2])
        Traceback (most recent call last):
        ...
        ValueError: sweep_k=[8, 2]: k_min 8 is above k_max 2; write sweep_k=[2,8]
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"sweep_k={value!r}: must be two bucket counts [k_min, k_max], e.g. sweep_k=[2,16]")
    k_min = as_int("sweep_k[0] (k_min)", value[0], minimum=1, maximum=MAX_SWEEP_K)
    k_max = as_int("sweep_k[1] (k_max)", value[1], minimum=1, maximum=MAX_SWEEP_K)
    if k_min > k_max:
        raise ValueError(
            f"sweep_k={list(value)}: k_min {k_min} is above k_max {k_max}; write sweep_k=[{k_max},{k_min}]"
        )
    return k_min, k_max


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


def conf_keys(group: str) -> dict[Any, list[str]]:
    """Keys of every ``conf/<group>/*.yaml`` and ``conf_plan/<group>/*.yaml`` file, by the file's ``kind`` (or its
    name when it has none)."""
    from omegaconf import OmegaConf

    files = {}
    for path in sorted([*(CONF_DIR / group).glob("*.yaml"), *(PLAN_CONF_DIR / group).glob("*.yaml")]):
        keys = OmegaConf.to_container(OmegaConf.load(path))
        files[keys.get("kind", path.stem)] = list(keys)
    return files


def data_keys(kind: Any) -> list[str]:
    """The keys data kind ``kind`` uses: those of its ``conf/data/*.yaml`` file (config groups mirror code)."""
    files = conf_keys("data")
    as_choice("data.kind", kind, files)
    return files[kind]


def load_lengths(data_cfg: Mapping[str, Any], model_cfg: Mapping[str, Any] | None = None) -> np.ndarray:
    """Sample lengths for planning (``load_plan_data``'s first half)."""
    return load_plan_data(data_cfg, model_cfg)[0]


def load_plan_data(data_cfg: Mapping[str, Any],
                   model_cfg: Mapping[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sample lengths and valid anchor positions for planning: a reference workload (``kind: lengths``: every
    token supervised, ``sampling.anchors.valid_positions_from_lengths``) or a dataset's cached arrays (its own
    loss masks, ``TokenizedDataset.anchor_positions``).

    Raises:
        ValueError: an unknown data kind, a key the kind does not use (e.g. ``data.path`` with ``kind: lengths``),
            a bad value, or lengths that fail ``sampling.validate_lengths``.
    """
    data_cfg = dict(data_cfg)
    kind = data_cfg.get("kind")
    refuse_unknown_keys(f"data (kind={kind})", data_cfg, data_keys(kind))
    del data_cfg["kind"]
    if kind == "lengths":
        from .data.lengths import WORKLOADS, reference_lengths

        workload = as_choice("data.workload", data_cfg["workload"], WORKLOADS)
        num_samples = as_int("data.num_samples", data_cfg["num_samples"], minimum=1, example=800000)
        seed = as_int("data.seed", data_cfg.get("seed", 0), minimum=0)
        lengths = validate_lengths(reference_lengths(workload, num_samples, seed=seed))
        return lengths, valid_positions_from_lengths(lengths)
    from .data import build_dataset
    from .data.tokenizer import ByteTokenizer, HFTokenizerAdapter

    model_cfg = dict(model_cfg or {})
    if model_cfg.get("kind") == "hf":
        # Lengths only need the target's tokenizer, not its weights.
        from transformers import AutoTokenizer

        tokenizer = HFTokenizerAdapter(AutoTokenizer.from_pretrained(model_cfg["target_path"]))
    else:
        tokenizer = ByteTokenizer()
    train, _ = build_dataset(kind, tokenizer=tokenizer, **data_cfg).split()
    return validate_lengths(train.lengths), train.anchor_positions()


# ---- what a person reads: the narrow table, its legend, the recommendation (plan.csv keeps every column) -----------
def _number(digits: int, scale: float = 1.0) -> Callable[[Any], str]:
    return lambda v: "?" if not np.isfinite(v) else f"{v * scale:,.{digits}f}"


def _gib(value: float) -> str:
    return "?" if not np.isfinite(value) else f"{value:.2f}" if value < 10 else f"{value:,.1f}"


@dataclass(frozen=True)
class Column:
    """One column of the printed plan: the plan-table column, its header (with unit), its format and legend."""

    name: str
    header: str
    fmt: Callable[[Any], str]
    legend: str = ""


# The printed plan is two narrow tables: what one rank's step holds and how fast the plan runs (the regime the
# prediction is for), then how diverse its batches are and whether its worst step fits in memory.
STEP_COLUMNS = (
    Column("pad_eff", "pad_eff %", _number(1, 100), "real / padded tokens of the epoch plan (100 = no padding)"),
    Column("steps_per_epoch", "steps/epoch", _number(0), "optimizer steps per epoch (every rank steps together)"),
    Column("mean_samples_per_batch", "docs", _number(1), "documents per rank and step (mean of the epoch plan)"),
    Column("real_tokens_per_step", "real tok", _number(0), "real (non-pad) tokens per rank and step (mean)"),
    Column("padded_tokens_per_step", "padded tok", _number(0),
           "padded tokens per rank and step (rows x longest row; a packed row: its used length; mean)"),
    Column("block_tokens", "blk slots", _number(0),
           "block slots per rank and step: block tokens (anchors x block size, the draft's work) with padding slots "
           "(mean; its bound, sampler.max_block_tokens, is in plan.csv)"),
    Column("pred_ktok_s", "Ktok/s", _number(1),
           "predicted real tokens per second over all ranks, in thousands: the epoch's real tokens over its summed "
           "step times (the rate the ETA implies, a run's tokens over its wall time)"),
    Column("pred_ktok_s_median", "med Ktok/s", _number(1),
           "the same on the median step (the trainer's summary ktok_s); above Ktok/s when a few steps are slow"),
    Column("pred_eta_s", "ETA", format_eta, "predicted wall time of the configured run (epochs x steps x step time)"),
)
DIVERSITY_COLUMNS = (
    Column("composition_repeat", "repeat", _number(2),
           "share of the next epoch's batches identical to one of this epoch's (1 = same batches every epoch)"),
    Column("within_batch_spread", "spread CV", _number(2),
           "within-batch length spread: mean coefficient of variation of lengths inside a batch "
           "(0 = every batch one length)"),
    Column("adjacent_length_corr", "order r", _number(2),
           "correlation of consecutive batches' mean lengths (near 1 = a sorted, drifting order)"),
    Column("pred_peak_mem_gb", "peak GiB", _gib, "predicted peak GPU memory per rank, worst step"),
    Column("fits", "fits", str, "yes | ckpt (only with activation checkpointing) | no, against 90% of gpu_mem_gb"),
)
NARROW_COLUMNS = STEP_COLUMNS + DIVERSITY_COLUMNS
FULL_COLUMNS = (
    "bucket_by", "pad_eff", "budget_fill", "real_tokens_per_step", "padded_tokens_per_step", "steps_per_epoch",
    "mean_samples_per_batch", "max_samples_per_batch",
    "composition_repeat", "adjacent_length_corr", "bucket_run_length", "within_batch_spread",
    "dropped_overlong", "truncated", "repeated_remainder", "pred_ktok_s", "pred_ktok_s_median", "pred_eta_s",
    "block_tokens", "block_tokens_max", "block_pad_eff", "block_per_token", "thinned", "max_block_tokens",
    "max_block_tokens_fit", "pred_mfu", "pred_target_flop_share", "pred_ktok_s_target_online",
    "pred_ktok_s_target_off",
    "pred_peak_mem_gb", "pred_peak_mem_gb_ckpt", "pred_tflop_per_step", "ckpt", "fits", "max_tokens_fit",
)


def _plain_cell(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def full_columns(table: pd.DataFrame) -> list[Column]:
    """Every FULL_COLUMNS column the table has, headed by its own name (ETA in human form, see format_eta).

    Example:
        >>> [c.header for c in full_columns(pd.DataFrame({"fits": ["yes"], "pad_eff": [0.9]}))]
        ['pad_eff', 'fits']
    """
    return [Column(name, name, format_eta if name == "pred_eta_s" else _plain_cell)
            for name in FULL_COLUMNS if name in table.columns]


def to_markdown(table: pd.DataFrame, columns: Sequence[Column]) -> str:
    """A markdown table of ``columns`` (those the table has), cells formatted and padded to line up in a terminal.

    Example:
        >>> table = pd.DataFrame({"pad_eff": [0.5], "pred_eta_s": [403200.0]}, index=["bucketed"])
        >>> print(to_markdown(table, NARROW_COLUMNS))
        | policy   | pad_eff % |    ETA |
        |:---------|----------:|-------:|
        | bucketed |      50.0 | 4d 16h |
    """
    shown = [c for c in columns if c.name in table.columns]
    grid = [["policy", *(c.header for c in shown)]]
    grid += [[str(name), *(c.fmt(table.at[name, c.name]) for c in shown)] for name in table.index]
    widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))]
    line = lambda cells: "| " + " | ".join(  # noqa: E731 - policy left-aligned, figures right-aligned
        cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))) + " |"
    rule = "|:" + "-" * (widths[0] + 1) + "|" + "|".join("-" * (w + 1) + ":" for w in widths[1:]) + "|"
    return "\n".join([line(grid[0]), rule, *(line(row) for row in grid[1:])])


def legend(table: pd.DataFrame, columns: Sequence[Column] = NARROW_COLUMNS) -> str:
    """One line per shown column: its header and what it measures.

    Example:
        >>> print(legend(pd.DataFrame({"pred_eta_s": [1.0]})))
        - ETA: predicted wall time of the configured run (epochs x steps x step time)
    """
    return "\n".join(f"- {c.header}: {c.legend}" for c in columns if c.name in table.columns and c.legend)


# the diversity floors of the recommendation: plan key -> (plan-table column, direction, short name)
FLOORS = {
    "min_within_batch_spread": ("within_batch_spread", ">=", "spread"),
    "max_composition_repeat": ("composition_repeat", "<=", "repeat"),
    "max_adjacent_length_corr": ("adjacent_length_corr", "<=", "order r"),
}


def recommend_floors(values: Mapping[str, Any] | None) -> dict[str, float | None]:
    """The ``recommend`` section checked: each floor a number (null: no floor), unknown keys refused.

    Example:
        >>> recommend_floors({"min_within_batch_spread": 0.1})
        {'min_within_batch_spread': 0.1, 'max_composition_repeat': None, 'max_adjacent_length_corr': None}
        >>> recommend_floors({"min_spread": 0.1})
        Traceback (most recent call last):
        ...
        ValueError: unknown recommend key(s) ['min_spread']; valid keys: max_adjacent_length_corr, ...
    """
    values = dict(values or {})
    refuse_unknown_keys("recommend", values, sorted(FLOORS))
    limits = {"min_within_batch_spread": (0.0, None), "max_composition_repeat": (0.0, 1.0),
              "max_adjacent_length_corr": (-1.0, 1.0)}
    return {key: as_float(f"recommend.{key}", values.get(key), minimum=limits[key][0], maximum=limits[key][1],
                          allow_none=True) for key in FLOORS}


def recommendation(table: pd.DataFrame, floors: Mapping[str, float | None],
                   activation_checkpointing: bool = False) -> dict[str, Any]:
    """The fastest policy (``pred_ktok_s``) that clears every diversity floor and, when memory is known, fits.

    A policy whose ``fits`` is ``ckpt`` qualifies and the line says it needs activation checkpointing (unless it
    is on). A missing (NaN) figure does not clear a floor.

    Returns:
        ``{"policy": name or None, "line": one readable sentence, "excluded": {policy: reasons}}``.

    Example:
        >>> table = pd.DataFrame({"pred_ktok_s": [140.0, 117.0, 68.0], "pred_eta_s": [3600.0, 4300.0, 7400.0],
        ...                       "within_batch_spread": [0.0, 0.17, 0.62]},
        ...                      index=["sorted_static", "bucketed", "full_random"])
        >>> print(recommendation(table, {"min_within_batch_spread": 0.1})["line"])
        recommended: bucketed, the fastest policy (117.0 Ktok/s, ETA 1h 11m) with spread >= 0.1; faster but
        excluded: sorted_static (spread 0.00)
    """
    active = {key: limit for key, limit in floors.items() if limit is not None}
    excluded: dict[str, list[str]] = {}
    for name in table.index:
        reasons = []
        for key, limit in active.items():
            column, direction, short = FLOORS[key]
            value = float(table.at[name, column]) if column in table.columns else float("nan")
            passes = value >= limit if direction == ">=" else value <= limit
            if not passes:  # NaN never passes
                reasons.append(f"{short} {value:.2f}")
        if "fits" in table.columns and table.at[name, "fits"] == "no":
            reasons.append(f"needs {table.at[name, 'pred_peak_mem_gb']:.0f} GiB")
        if not np.isfinite(table.at[name, "pred_ktok_s"]):
            reasons.append("no throughput prediction")
        if reasons:
            excluded[str(name)] = reasons
    conditions = [f"{FLOORS[k][2]} {FLOORS[k][1]} {v:g}" for k, v in active.items()]
    conditions += ["fitting in memory"] if "fits" in table.columns else []
    conditions = ", ".join(conditions[:-1]) + " and " + conditions[-1] if len(conditions) > 1 else "".join(conditions)
    qualifying = table.drop(index=list(excluded)).sort_values("pred_ktok_s", ascending=False)
    if qualifying.empty:
        reasons = "; ".join(f"{name} ({', '.join(why)})" for name, why in excluded.items())
        return {"policy": None, "excluded": excluded,
                "line": f"recommended: none; no policy qualifies ({conditions or 'a throughput prediction'}): "
                        f"{reasons}. Relax the recommend.* floors, or plan with more memory (gpu_mem_gb) or a smaller "
                        f"sampler.max_tokens"}
    best = qualifying.index[0]
    speed = float(qualifying.at[best, "pred_ktok_s"])
    faster = [n for n in excluded if np.isfinite(table.at[n, "pred_ktok_s"]) and table.at[n, "pred_ktok_s"] > speed]
    line = (f"recommended: {best}, the fastest policy ({speed:.1f} Ktok/s, ETA "
            f"{format_eta(qualifying.at[best, 'pred_eta_s'])})" + (f" with {conditions}" if conditions else ""))
    if "fits" in table.columns and table.at[best, "fits"] == "ckpt" and not activation_checkpointing:
        line += " (with activation checkpointing: activation_checkpointing=true)"
    if faster:
        line += "; faster but excluded: " + ", ".join(f"{n} ({', '.join(excluded[n])})" for n in faster)
    return {"policy": str(best), "excluded": excluded, "line": line}


def plan_keys() -> list[str]:
    """Top-level keys of ``conf/plan.yaml``: its own keys and its config groups."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "plan.yaml"))
    groups = [next(iter(entry)) for entry in raw["defaults"] if isinstance(entry, dict)]
    return [k for k in raw if k not in ("defaults", "hydra")] + groups


def cost_from_config(cost_cfg: Mapping[str, Any], model_cfg: Any, max_tokens: int, seed: int,
                     gpu_cfg: Mapping[str, Any] | None = None) -> CostModel:
    """The cost model ``cost.*`` asks for: fitted on a run, calibrated by a micro-benchmark, the FLOPs form at a
    FLOP utilisation (``cost.utilisation``, with the ``gpu`` preset's peak), or given coefficients; ``cost.target``
    says where the target's forward runs (TARGET_MODES; off the trainer GPUs needs the FLOPs form)."""
    valid = sorted({k for keys in conf_keys("cost").values() for k in keys})
    refuse_unknown_keys("cost", cost_cfg, valid)
    target = as_choice("cost.target", cost_cfg.get("target", "online"), TARGET_MODES)
    return replace(_cost_model(cost_cfg, model_cfg, max_tokens, seed, gpu_cfg), target=target)


def _cost_model(cost_cfg: Mapping[str, Any], model_cfg: Any, max_tokens: int, seed: int,
                gpu_cfg: Mapping[str, Any] | None) -> CostModel:
    """``cost_from_config``'s model before ``cost.target`` is applied (online)."""
    from_run = cost_cfg.get("from_run")
    runs = [from_run] if isinstance(from_run, str) else from_run
    if runs is not None and (not isinstance(runs, (list, tuple)) or not all(isinstance(r, str) for r in runs)):
        raise ValueError(f"cost.from_run={from_run!r}: must be a run directory path, a list of them, or null")
    if runs:
        return CostModel.from_runs(runs)
    if as_bool("cost.calibrate", cost_cfg.get("calibrate", False)):
        return calibrate_cost(model_cfg, max_tokens, seed=seed)
    utilisation = as_float("cost.utilisation", cost_cfg.get("utilisation"), minimum=1e-6, maximum=1.0,
                           allow_none=True, example=0.3)
    if utilisation is not None:
        # the gpu preset's peak; else the cost config's own (cost=seed: the seed's RTX PRO 6000)
        peak = (gpu_cfg or {}).get("bf16_dense_tflops") or cost_cfg.get("peak_tflops")
        if peak is None:
            raise ValueError(f"cost.utilisation={utilisation:g} prices steps by their FLOPs at a share of the GPU's "
                             f"peak: choose a gpu preset (gpu=rtx_pro_6000, gpu=h100 or gpu=h200) or set "
                             f"cost.peak_tflops")
        return CostModel(as_float("cost.c0", cost_cfg.get("c0", 0.0), minimum=0.0), utilisation=utilisation,
                         peak_tflops=as_float("gpu.bf16_dense_tflops", peak, minimum=1e-3))
    return CostModel(*(as_float(f"cost.{k}", cost_cfg.get(k, 0.0), minimum=0.0)
                       for k in ("c0", "c1", "c2", "c3", "c4")))


def model_fingerprint(model_cfg: Mapping[str, Any] | None) -> str | None:
    """The dims that set a step's cost: the target's shape and the draft's (layers, block size), as one line; None
    when the model config gives no shape (``model=hf`` without ``target_path`` / ``target_config``).

    Example:
        >>> model_fingerprint({"kind": "tiny", "draft_layers": 1, "block_size": 8})
        'hidden 64, layers 4, heads 4/2, intermediate 192, vocab 264; draft layers 1, block 8'
    """
    from .model.build import target_config_only

    if not model_cfg:
        return None
    try:
        config = target_config_only(**dict(model_cfg))
    except (ValueError, OSError):
        return None
    return (f"hidden {config.hidden_size}, layers {config.num_hidden_layers}, heads {config.num_attention_heads}/"
            f"{config.num_key_value_heads}, intermediate {config.intermediate_size}, vocab {config.vocab_size}; "
            f"draft layers {model_cfg.get('draft_layers')}, block {model_cfg.get('block_size')}")


def _run_model_config(run_dir: str | Path) -> dict | None:
    """The ``model`` section a run trained with (its ``.hydra/config.yaml``), or None when it is not there."""
    from omegaconf import OmegaConf

    file = Path(run_dir) / ".hydra" / "config.yaml"
    if not file.is_file():
        return None
    config = OmegaConf.load(file)
    return OmegaConf.to_container(config.model, resolve=False) if "model" in config else None


def model_preset_config(preset: str) -> dict[str, Any]:
    """The ``model`` section that ``model=<preset>`` gives, composed by Hydra with the preset's defaults list (a
    bare ``OmegaConf.load`` of ``conf/model/qwen3_8b.yaml`` would miss the keys it takes from ``model=hf``).

    Works inside a running Hydra app (the planner's CLI) as outside it: the global Hydra state is set aside for
    the composition and restored after it.

    Example:
        >>> model_preset_config("qwen3_8b")["block_size"], model_preset_config("qwen3_8b")["kind"]
        (16, 'hf')
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf import OmegaConf

    outer = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("dflash_lab.conf", version_base="1.3"):
            cfg = compose("plan", overrides=[f"model={preset}"])
    except MissingConfigException as error:
        raise ValueError(f"cost.calibrated_for={preset!r}: not a model preset (conf/model/); name the model the "
                         f"coefficients were measured on, e.g. cost.calibrated_for=qwen3_8b, or null") from error
    finally:
        restore_gh_from_backup(outer)
    return OmegaConf.to_container(cfg.model, resolve=True)


def cost_calibration_warning(cost_cfg: Mapping[str, Any], model_cfg: Mapping[str, Any] | None) -> str | None:
    """A warning when the cost model was calibrated on another model than the one planned (its ETA is then a
    guess), naming both and the fix; None when they match or the calibration's model is unknown.

    The calibration's model: ``cost.calibrate=true`` times the planned model itself; ``cost.from_run`` runs record
    theirs (``.hydra/config.yaml``); a cost config names it in ``calibrated_for`` (a ``conf/model`` preset).
    """
    if as_bool("cost.calibrate", cost_cfg.get("calibrate", False)):
        return None
    planned = model_fingerprint(model_cfg)
    from_run = cost_cfg.get("from_run")
    if from_run:
        runs = [from_run] if isinstance(from_run, str) else list(from_run)
        fitted = {str(run): model_fingerprint(_run_model_config(run)) for run in runs}
        source = "cost.from_run=" + ",".join(run for run, dims in fitted.items() if dims != planned)
        others = {dims for dims in fitted.values() if dims != planned}
    elif cost_cfg.get("calibrated_for"):
        preset = str(cost_cfg["calibrated_for"])
        source = f"the cost config (calibrated for model={preset})"
        others = {model_fingerprint(model_preset_config(preset))} - {planned}
    else:
        return None
    if not others:
        return None
    kind = (model_cfg or {}).get("kind", "?")
    shown = planned or "its shape unknown (set model.target_path or model.target_config)"
    return (f"warning: the cost model is not calibrated for this model: {source} was fitted on "
            f"{' / '.join(sorted(str(o) for o in others))}, the plan is for model={kind} ({shown}). Predicted "
            f"Ktok/s and ETA are a guess: calibrate with cost.from_run=<a run dir of this model> (a short "
            f"dflash-train run of it) or cost.calibrate=true; coefficients of your own: cost.calibrated_for=null")


def plan_block_tokens(valid: np.ndarray, model_cfg: Mapping[str, Any] | None) -> np.ndarray | None:
    """Block tokens per sample under the model config's anchor rule (``sampling.anchors``); None without one."""
    if not model_cfg or "block_size" not in model_cfg:
        return None
    return block_tokens_per_sample(valid, block_size=as_int("model.block_size", model_cfg["block_size"], minimum=2),
                                   anchors_per_doc=model_cfg.get("anchors_per_doc"),
                                   anchor_density=model_cfg.get("anchor_density"))


def run_plan(cfg: Mapping[str, Any]) -> pd.DataFrame:
    """Plan every configured policy, write plan.csv/json/md (+ the K sweep) to ``out_dir``; return the table.

    Every key is checked before any work: unknown keys are refused (valid ones listed) at the top level and in
    ``sampler``, ``data`` (by data kind) and ``cost``; values are typed (``config_check``).
    """
    refuse_unknown_keys("plan", cfg, plan_keys())
    seed = as_int("seed", cfg["seed"], minimum=0)
    world_size = as_int("world_size", cfg["world_size"], minimum=1, example=8)
    epochs = as_float("epochs", cfg["epochs"], example=6)
    if epochs <= 0:
        raise ValueError(f"epochs={epochs:g}: the configured run needs a positive number of epochs (e.g. epochs=6)")
    bands = cfg.get("bands")
    bands = None if bands is None else validate_boundaries(bands, key="bands")
    sweep_k = None if cfg.get("sweep_k") is None else sweep_range(cfg["sweep_k"])
    sweep_method = as_choice("sweep_method", cfg.get("sweep_method", "optimal"), FIT_METHODS)
    target_pad_eff = as_float("target_pad_eff", cfg.get("target_pad_eff"), maximum=1.0, allow_none=True, example=0.9)
    floors = recommend_floors(cfg.get("recommend"))
    builtin_corpus = (cfg.get("data") or {}).get("kind") == "synthetic"
    samplers = {name: resolve_auto_boundaries(sampler_cfg, builtin_corpus=builtin_corpus)
                for name, sampler_cfg in sampler_configs(cfg["sampler"], cfg.get("policies", "all")).items()}
    max_tokens = as_int("sampler.max_tokens", cfg["sampler"].get("max_tokens"), minimum=1, example=4096)
    cost = cost_from_config(dict(cfg["cost"]), cfg.get("model"), max_tokens, seed, cfg.get("gpu"))
    cost_warning = cost_calibration_warning(dict(cfg["cost"]), cfg.get("model"))   # printed with the plan
    lengths, valid = load_plan_data(cfg["data"], cfg.get("model"))
    block_tokens = plan_block_tokens(valid, cfg.get("model"))

    out_dir = Path(cfg["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    memory = memory_inputs(cfg)
    table = plan_table(lengths, samplers, seed=seed, world_size=world_size, epochs=epochs, cost=cost, bands=bands,
                       memory=memory, block_tokens=block_tokens)
    table.to_csv(out_dir / "plan.csv")
    advice = recommendation(table, floors, activation_checkpointing=bool(
        memory and memory["settings"].activation_checkpointing))
    meta = {"num_samples": int(lengths.size), "mean_length": float(lengths.mean()), "cost_model": asdict(cost),
            "epochs": epochs, "world_size": world_size,
            "memory": {"gpu_mem_gb": memory["gpu_mem_gb"], **asdict(memory["settings"])} if memory else None,
            "recommend": floors, "recommendation": {"policy": advice["policy"], "line": advice["line"]},
            "cost_warning": cost_warning}
    (out_dir / "plan.json").write_text(
        json.dumps({"meta": meta, "policies": json.loads(table.to_json(orient="index"))}, indent=2)
    )
    shares = [c for c in table.columns if c.startswith("share ")]
    readable = (
        f"Plan for {lengths.size:,} samples (mean length {lengths.mean():.0f}), world size {world_size}, "
        f"{epochs:g} epochs; {describe_cost(cost)}\n"
        + (f"{cost_warning}\n" if cost_warning else "")
        + describe_anchors(cfg.get("model"), block_tokens) + "\n"
        + (f"memory: {memory['settings'].precision}, per rank, fits against {memory['gpu_mem_gb']:g} GiB "
           f"(dflash_lab/model/footprint.py)\n\n" if memory else
           "memory columns: set model.target_config=/path/to/config.json (or model=qwen3_8b)\n\n")
        + "Per rank and step (means of the epoch plan), and predicted speed:\n\n"
        + to_markdown(table, STEP_COLUMNS) + "\n\n" + describe_relative_speed(table)
        + describe_target_mode(table, cost)
        + "Diversity and memory:\n\n" + to_markdown(table, DIVERSITY_COLUMNS) + "\n\n"
        + legend(table) + "\n\n" + describe_block_budgets(table)
        + describe_bucket_keying(table)
        + (f"Supervision share per length band (block tokens of an epoch in each band):\n\n"
           f"{to_markdown(table, [Column(c, c.removeprefix('share '), _number(3)) for c in shares])}\n\n"
           if shares else "")
        + advice["line"] + "\n"
    )
    full = to_markdown(table, full_columns(table))
    (out_dir / "plan.md").write_text(f"{readable}\n## Every column (full precision in plan.csv)\n\n{full}\n")
    print(readable)
    if sweep_k is not None:
        sweep = sweep_bucket_counts(
            lengths, sweep_k, cfg["sampler"], method=sweep_method, seed=seed, world_size=world_size
        )
        sweep.to_csv(out_dir / "k_sweep.csv", index=False)
        plot_k_sweep(sweep, out_dir / "k_sweep.png")
        print(f"\nK sweep written to {out_dir / 'k_sweep.csv'} and k_sweep.png")
    if target_pad_eff is not None:
        shared = {k: v for k, v in cfg["sampler"].items()
                  if k in SHARED_KEYS and k not in ("max_tokens", "max_block_tokens")}
        found = smallest_k_for_efficiency(
            lengths, target_pad_eff, max_tokens=max_tokens, method=sweep_method, seed=seed, **shared
        )
        (out_dir / "smallest_k.json").write_text(json.dumps(found, indent=2))
        print(f"\nfewest buckets reaching padding efficiency {target_pad_eff}: K={found['num_buckets']} "
              f"boundaries={found['boundaries']} (pad_eff {found['pad_eff']:.3f})")
    print(f"\nwrote {out_dir / 'plan.csv'}, plan.json, plan.md (every column)")
    return table


def describe_block_budgets(table: pd.DataFrame) -> str:
    """One line naming each policy's block budget in force and the largest that fits (empty without them).

    Example:
        >>> t = pd.DataFrame({"max_block_tokens": [40721], "max_block_tokens_fit": [40721], "ckpt": ["off"]},
        ...                  index=["bucketed"])
        >>> print(describe_block_budgets(t).strip())
        block budget in force / largest that fits the GPU: bucketed 40,721 / 40,721 (checkpointing off)
    """
    if "max_block_tokens_fit" not in table.columns:
        return ""
    number = lambda v: "none" if v is None or v != v else f"{int(v):,}"  # noqa: E731
    parts = [f"{name} {number(row['max_block_tokens'])} / {number(row['max_block_tokens_fit'])}"
             + (f" (checkpointing {row['ckpt']})" if "ckpt" in row else "") for name, row in table.iterrows()]
    return "block budget in force / largest that fits the GPU: " + "; ".join(parts) + "\n\n"


def describe_bucket_keying(table: pd.DataFrame) -> str:
    """One line naming the policies planned with ``bucket_by=random`` (empty when none is).

    Example:
        >>> t = pd.DataFrame({"bucket_by": ["random", None]}, index=["bucket_sequential", "full_random"])
        >>> print(describe_bucket_keying(t).strip())  # doctest: +ELLIPSIS
        bucket_by=random (the negative control): bucket_sequential plan fixed random groups of the length ...
    """
    if "bucket_by" not in table.columns:
        return ""
    random_keyed = [str(name) for name in table.index if table.at[name, "bucket_by"] == "random"]
    if not random_keyed:
        return ""
    return (f"bucket_by=random (the negative control): {', '.join(random_keyed)} plan fixed random groups of the "
            f"length buckets' sizes, members independent of length (their bucket run length counts the groups)\n\n")


def describe_relative_speed(table: pd.DataFrame, baseline: str = "bucketed") -> str:
    """One line giving each policy's predicted Ktok/s as a share of ``baseline``'s, over time and on the median
    step (empty without the baseline or another policy).

    Example:
        >>> t = pd.DataFrame({"pred_ktok_s": [19.4, 25.7], "pred_ktok_s_median": [20.3, 32.0]},
        ...                  index=["full_random", "bucketed"])
        >>> print(describe_relative_speed(t).strip())
        Ktok/s relative to bucketed, over time (median step): full_random 0.755 (0.634)
    """
    if baseline not in table.index or len(table.index) < 2:
        return ""
    over_time, median = table.at[baseline, "pred_ktok_s"], table.at[baseline, "pred_ktok_s_median"]
    parts = [f"{name} {row['pred_ktok_s'] / over_time:.3f} ({row['pred_ktok_s_median'] / median:.3f})"
             for name, row in table.iterrows() if name != baseline]
    return f"Ktok/s relative to {baseline}, over time (median step): " + "; ".join(parts) + "\n\n"


def describe_target_mode(table: pd.DataFrame, cost: CostModel) -> str:
    """One line saying where the cost model runs the target's forward and what the other place would give
    (FLOPs form only: empty for the linear one, which is fitted with the target online).

    Example:
        >>> t = pd.DataFrame({"pred_target_flop_share": [0.35], "pred_ktok_s_target_online": [25.1],
        ...                   "pred_ktok_s_target_off": [39.6]}, index=["bucketed"])
        >>> print(describe_target_mode(t, CostModel(0.0, utilisation=0.3, peak_tflops=500)).strip())
        target online (cost.target): its forward runs on the trainer GPUs every step, on every padded token
        (bucketed 35% of the executed FLOPs). Off them (cost.target=offline or disaggregated: hidden states from disk
        or another server) Ktok/s would be bucketed 39.6
    """
    if cost.utilisation is None or "pred_ktok_s_target_off" not in table.columns:
        return ""
    shares = ", ".join(f"{name} {row['pred_target_flop_share']:.0%}" for name, row in table.iterrows())
    if cost.target == "online":
        other = ", ".join(f"{name} {row['pred_ktok_s_target_off']:.1f}" for name, row in table.iterrows())
        return (f"target online (cost.target): its forward runs on the trainer GPUs every step, on every padded "
                f"token ({shares} of the executed FLOPs). Off them (cost.target=offline or disaggregated: hidden "
                f"states from disk or another server) Ktok/s would be {other}\n\n")
    other = ", ".join(f"{name} {row['pred_ktok_s_target_online']:.1f}" for name, row in table.iterrows())
    return (f"target {cost.target} (cost.target): the trainer GPUs run no target forward (memory columns still hold "
            f"the target's weights and features). With it online (cost.target=online: {shares} of the executed "
            f"FLOPs) Ktok/s would be {other}\n\n")


def describe_cost(cost: CostModel) -> str:
    """One line naming the cost model's form and coefficients.

    Example:
        >>> describe_cost(CostModel(0.0, utilisation=0.2, peak_tflops=500))
        'cost model: step = executed FLOPs (target online) / (0.2 x 500 TFLOP/s) + 0 s'
    """
    if cost.utilisation is not None:
        return (f"cost model: step = executed FLOPs (target {cost.target}) / ({cost.utilisation:g} x "
                f"{cost.peak_tflops:g} TFLOP/s) + {cost.c0:g} s")
    return (f"cost model: step = {cost.c0:g} + {cost.c1:g} x padded + {cost.c2:g} x attention + {cost.c3:g} x "
            f"block slots + {cost.c4:g} x packed documents")


def describe_anchors(model_cfg: Mapping[str, Any] | None, block_tokens: np.ndarray | None) -> str:
    """One line naming the anchor rule the block-token columns use.

    Example:
        >>> describe_anchors({"block_size": 16, "anchors_per_doc": 512, "anchor_density": None}, np.array([16]))
        'anchor rule: recipe (min(512, valid positions) anchors per document, block size 16)'
    """
    if block_tokens is None or not model_cfg:
        return "anchor rule: unknown (no model config): no block-token columns"
    density = model_cfg.get("anchor_density")
    if anchor_rule_name(density) == "recipe":
        what = f"min({model_cfg.get('anchors_per_doc')}, valid positions) anchors per document"
    else:
        what = f"ceil({density:g} x valid positions) anchors per document, at most {model_cfg.get('anchors_per_doc')}"
    return f"anchor rule: {anchor_rule_name(density)} ({what}, block size {model_cfg['block_size']})"


def main() -> None:
    import hydra
    from omegaconf import DictConfig, OmegaConf

    @hydra.main(config_path="pkg://dflash_lab.conf", config_name="plan", version_base="1.3")
    def _app(cfg: DictConfig) -> None:
        run_plan(OmegaConf.to_container(cfg, resolve=True))

    _app()


if __name__ == "__main__":
    main()
