"""The planner's cost model: per-rank step time of a batch (linear, fitted on runs or timed; or FLOP-priced at a
utilisation of the GPU's peak, the target's forward online or off the trainer GPUs), its prediction of a plan's
Ktok/s and ETA, and the warning when it was calibrated on another model."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..config_check import as_bool, as_choice, as_float, refuse_unknown_keys
from ..metrics.throughput import full_run_eta_seconds, ktok_per_s, ktok_s_over_time, steady_state_ktok_s, token_counts
from ..records.record import METRICS_FILE, SUMMARY_FILE, read_jsonl
from ..sampling import Policy
from ..sampling.stats import batch_block_tokens, plan_padding
from .config import conf_keys


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

    from ..data import collate_padded
    from ..model import build_model

    model, tokenizer = build_model(**dict(model_cfg), activation_checkpointing=False)
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


GRADIENT_BYTES = 4   # the draft's gradients DDP all-reduces: fp32 master weights (bf16 autocast computes, fp32 grads)


def gradient_allreduce_seconds(trainable_params: int, *, world_size: int, nodes: int, busbw_gbs: float) -> float:
    """Seconds per optimizer step of the gradient all-reduce across nodes, added to a step's time.

    ``t = 2 (W - 1) / W x S / busbw`` with ``S`` the gradient bytes (``GRADIENT_BYTES`` x the draft's trainable
    parameters), ``W`` the ranks and ``busbw`` the all-reduce bus bandwidth across the nodes in GB/s, as
    nccl-tests' ``all_reduce_perf`` reports it (its "busbw" is defined as algbw x 2 (W - 1) / W, so this is the
    time that benchmark measures for ``S`` bytes). On one node (``nodes=1``) it is 0: the all-reduce over
    NVLink/PCIe is inside the measured step times the cost model is calibrated on. Not overlapped with the backward
    (DDP overlaps its gradient buckets with it): an upper bound on what the nodes add.

    Example:
        >>> round(gradient_allreduce_seconds(1_000_000_000, world_size=16, nodes=2, busbw_gbs=40), 4)
        0.1875
        >>> gradient_allreduce_seconds(1_000_000_000, world_size=8, nodes=1, busbw_gbs=40)
        0.0
    """
    if nodes <= 1 or world_size <= 1:
        return 0.0
    size = GRADIENT_BYTES * float(trainable_params)
    return 2.0 * (world_size - 1) / world_size * size / (float(busbw_gbs) * 1e9)


def predict_throughput(policy: Policy, cost: CostModel, epochs: float, epoch: int = 0,
                       step_model: Any = None, recompute: bool = False, comm_s: float = 0.0) -> dict[str, float]:
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
    ``comm_s`` (:func:`gradient_allreduce_seconds`: the gradient all-reduce across nodes) is added to every step
    and reported as ``comm_s``.
    """
    plan = policy.global_plan(epoch)
    padding = plan_padding(plan.batches, policy.lengths, packed=policy.packed)
    _, per_batch_blocks = batch_block_tokens(policy, plan.batches)   # block slots run, padding slots included
    step_real = padding["per_batch_real"].reshape(plan.steps, policy.world_size).sum(axis=1)

    def step_times_of(per_batch: np.ndarray) -> np.ndarray:
        # the slowest rank sets the pace; then every rank waits for the gradient all-reduce across nodes
        return per_batch.reshape(plan.steps, policy.world_size).max(axis=1) + comm_s

    flop_extras: dict[str, float] = {}
    flops = None
    if cost.utilisation is not None:
        from ..model.footprint import batch_shapes, policy_anchors, step_flops

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
        "comm_s": float(comm_s),
        **flop_extras,
    }
    if flops is not None:  # model FLOPs of every rank over the epoch's time at world_size x peak
        out["mfu"] = float(flops.sum() / (step_times.sum() * policy.world_size * cost.peak_tflops * 1e12))
    return out


def cost_from_config(cost_cfg: Mapping[str, Any], model_cfg: Any, max_tokens: int, seed: int,
                     gpu_cfg: Mapping[str, Any] | None = None) -> CostModel:
    """The cost model ``cost.*`` asks for: fitted on a run, calibrated by a micro-benchmark, the FLOPs form at a
    FLOP utilisation (``cost.utilisation``, with the ``gpu`` preset's peak), or given coefficients; ``cost.target``
    says where the target's forward runs (TARGET_MODES; off the trainer GPUs needs the FLOPs form)."""
    valid = sorted({k for keys in conf_keys("cost").values() for k in keys})
    refuse_unknown_keys("cost", cost_cfg, valid)
    target = as_choice("cost.target", cost_cfg["target"], TARGET_MODES)
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
        >>> from dflash_lab.presets import preset
        >>> model_fingerprint(preset("model", "tiny"))
        'hidden 64, layers 4, heads 4/2, intermediate 192, vocab 264; draft layers 1, block 8'
    """
    from ..model.build import target_config_only

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
    """The ``model`` section a run trained with (its ``run_config.json``, else ``.hydra/config.yaml``), or None."""
    from ..records.record import read_run_config

    model = read_run_config(run_dir).config.get("model")
    return model if isinstance(model, dict) else None


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


@lru_cache(maxsize=None)
def preset_fingerprint(preset: str) -> str | None:
    """``model_fingerprint`` of a ``conf/model`` preset (composed once per process)."""
    return model_fingerprint(model_preset_config(preset))


def model_preset_named(model_cfg: Mapping[str, Any] | None) -> str | None:
    """The ``conf/model`` preset whose shape the planned model has (``model_fingerprint`` equal), or None (the
    user's own target, or a preset with changed keys).

    Example:
        >>> from dflash_lab.presets import preset
        >>> model_preset_named(preset("model", "tiny")), model_preset_named({**preset("model", "tiny"), "hidden_size": 128})
        ('tiny', None)
    """
    from .config import CONF_DIR

    planned = model_fingerprint(model_cfg)
    if planned is None:
        return None
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        if preset_fingerprint(path.stem) == planned:
            return path.stem
    return None


def cost_preset_for(model_preset: str) -> str | None:
    """The planner's cost preset (``conf_plan/cost``) calibrated for a model preset (its ``calibrated_for``).

    Example:
        >>> cost_preset_for("qwen3_8b"), cost_preset_for("tiny")
        ('seed', 'cpu_tiny')
    """
    import yaml

    from .config import PLAN_CONF_DIR

    for path in sorted((PLAN_CONF_DIR / "cost").glob("*.yaml")):
        if (yaml.safe_load(path.read_text()) or {}).get("calibrated_for") == model_preset:
            return path.stem
    return None


def check_plan_belongs(cost_cfg: Mapping[str, Any], model_cfg: Mapping[str, Any] | None,
                       data_cfg: Mapping[str, Any]) -> None:
    """Refuse a plan whose parts describe different models, where the fix is one word: a cost config calibrated for
    one shipped model preset with another shipped preset planned (cost=seed, the Qwen3-8B run's utilisation, on
    the tiny CPU model prices a 0.1 GiB model at 462,000 Ktok/s), and the seed's workload (Qwen3-8B token lengths)
    planned for the tiny model. The user's own target keeps the warning of :func:`cost_calibration_warning`.

    Raises:
        ValueError: one line naming both sides and the fix.
    """
    kind = (model_cfg or {}).get("kind")
    if (data_cfg or {}).get("kind") == "lengths" and data_cfg.get("workload") == "seed" and kind == "tiny":
        raise ValueError("data.workload=seed is the seed run's Qwen3-8B token lengths (800K conversations, mean 2,137 "
                         "tokens), but the plan is for model=tiny (the default): add model=qwen3_8b (with cost=seed "
                         "for its Ktok/s and ETA), or plan the tiny model on its own scale (data.workload=cpu)")
    calibrated = cost_cfg.get("calibrated_for")
    if (not calibrated or as_bool("cost.calibrate", cost_cfg.get("calibrate", False)) or cost_cfg.get("from_run")
            or preset_fingerprint(str(calibrated)) == model_fingerprint(model_cfg)):
        return
    planned = model_preset_named(model_cfg)
    if planned is None:
        return   # the user's own target: the calibration warning says it is a guess
    own = cost_preset_for(planned)
    raise ValueError(f"the cost model was calibrated for model={calibrated} (cost.calibrated_for), but the plan is for "
                     f"model={planned}{' (the default)' if planned == 'tiny' else ''}: its Ktok/s and ETA would "
                     f"price one model at the other's speed. Add model={calibrated} to plan that model"
                     + (f", or cost={own} for model={planned}" if own else "")
                     + " (coefficients of your own: cost.calibrated_for=null)")


def cost_calibration_warning(cost_cfg: Mapping[str, Any], model_cfg: Mapping[str, Any] | None) -> str | None:
    """A warning when the cost model was calibrated on another model than the one planned (its ETA is then a
    guess), naming both and the fix; None when they match or the calibration's model is unknown.

    The calibration's model: ``cost.calibrate=true`` times the planned model itself; ``cost.from_run`` runs record
    theirs (``run_config.json``, else ``.hydra/config.yaml``); a cost config names it in ``calibrated_for`` (a
    ``conf/model`` preset).
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
