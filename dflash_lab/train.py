"""Train a DFlash draft model with a chosen batching policy: ``python -m dflash_lab.train sampler=bucketed``.

With no arguments this runs a complete small training on the CPU (embedded synthetic data, tiny Qwen3 target
pretrained once and cached, about 5 minutes on 2 cores) and shows a live progress bar (loss, acc, Ktok/s, pad_eff,
ETA). ``train(cfg)`` does the work and returns the summary dict; ``main()`` is the thin Hydra wrapper.

The loop, top to bottom (nanoGPT-style, one function):
    1. config -> plain dicts/dataclasses (components never see a DictConfig); distributed init; run directory;
    2. model (frozen target + trainable draft) and tokenizer, dataset and held-out split, policy, DataLoader
       (``batch_sampler=policy``; padded or packed collator truncating samples to ``policy.lengths``);
    3. AdamW over the draft, linear warm-up (``trainer.warmup_frac``) then cosine to ``min_lr_ratio x lr``;
    4. resume from ``<run_dir>/checkpoints/last.pt`` when present (model, optimizer, scheduler, sampler position,
       RNG states, step, W&B id) so the continuation equals an uninterrupted run;
    5. per step: fetch ``grad_accum`` micro-batches, forward/backward each (anchors drawn from a generator seeded by
       (seed, rank, step, micro-batch)), normalise by the global weight sum, clip, one host sync for all step
       statistics (reduced across ranks), non-finite check, optimizer + scheduler step; then logging, probes,
       presentation records, checkpoints (all counted as overhead);
    6. end: probes, checkpoint, presentations.parquet, acceptance length tau of the trained and of the untrained
       draft, ``summary.json``.

Timing: ``compute_time_s`` of a step covers moving the batch to the device, forward, backward, gradient scaling,
clipping, the statistics sync and the optimizer step; everything else inside the loop (data loading, sampler,
metrics, logging, probes, checkpoints) is overhead. ``overhead_frac`` = 1 - compute / wall time of the loop
(``dflash_lab.metrics.throughput.overhead_fraction``); model building and the final tau measurement are outside the
loop and reported separately (``setup_time_s``, ``tau_time_s``).

Resume: a run directory that already holds ``checkpoints/last.pt`` is always continued (``python -m dflash_lab.train
hydra.run.dir=<run dir> ...``, or a requeued Slurm job); ``resume=true`` additionally insists that a checkpoint
exists. Rows a killed run logged after its last checkpoint are dropped from metrics.jsonl / probes.jsonl /
presentations.parquet, so every step appears once. ``trainer.max_steps`` may grow between the two parts; the LR
schedule always spans the configured epochs.

Failure and preemption: a non-finite loss or gradient norm stops the run (``summary.json`` status ``failed``; the
last good checkpoint is kept; exit code 1), or skips the update with ``trainer.skip_nonfinite=true``. SIGUSR2 /
SIGTERM (``trainer.preempt_signals``) or ``dflash_lab.checkpoint.request_checkpoint()`` make the loop checkpoint at the
next step boundary and exit with code 75 (see :mod:`dflash_lab.checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from dflash_lab import checkpoint as ckpt
from dflash_lab import dist
from dflash_lab.data import Collator, build_dataset, collate_padded
from dflash_lab.metrics import throughput
from dflash_lab.model import build_model, heldout_prompts, measure_acceptance
from dflash_lab.probes import DEFAULT_BANDS, PresentationRecorder, ProbeSets, validate_bands
from dflash_lab.run_logger import (
    RunLogger, close_text_log, load_or_create_run_id, setup_text_log, write_json_atomic,
)
from dflash_lab.sampling import policy_from_config

FAILED_EXIT_CODE = 1


# --------------------------------------------------------------------------------------------------------- settings


@dataclass
class TrainerSettings:
    """The ``trainer`` config group (conf/trainer/cpu.yaml, gpu.yaml). See those files for each key's meaning."""

    device: str = "cpu"
    precision: str = "fp32"
    epochs: int = 2
    max_steps: int | None = None
    grad_accum: int = 1
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    global_loss_norm: bool = True
    skip_nonfinite: bool = False
    num_threads: int | None = None
    num_workers: int = 0
    log_every: int = 1
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    progress: bool = True
    steady_warmup_steps: int = 10
    tau_every: int = 0
    measure_tau: bool = True
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGUSR2", "SIGTERM"])
    dist_backend: str | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainerSettings:
        """Build from the config group, refusing unknown keys (a typo must not silently keep a default)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown trainer key(s) {unknown}; valid keys: {', '.join(sorted(known))}")
        settings = cls(**values)
        settings.betas = tuple(settings.betas)  # type: ignore[assignment]
        settings.validate()
        return settings

    def validate(self) -> None:
        """Clear errors naming the key and the fix."""
        if self.epochs < 1:
            raise ValueError(f"trainer.epochs={self.epochs}: train for at least 1 epoch")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"trainer.max_steps={self.max_steps}: use null (no cap) or a count >= 0")
        if self.grad_accum < 1:
            raise ValueError(f"trainer.grad_accum={self.grad_accum}: use 1 (no accumulation) or more")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"trainer.warmup_frac={self.warmup_frac}: choose a share of the steps in [0, 1)")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"trainer.precision={self.precision!r}: choose fp32 or bf16 (bf16 autocast needs a GPU)")
        if self.precision == "bf16" and not self.device.startswith("cuda"):
            raise ValueError("trainer.precision=bf16 is for GPUs; on CPU use trainer.precision=fp32 (or trainer=gpu)")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"trainer.device={self.device} but no CUDA device is visible; use trainer=cpu")
        if self.ckpt_every < 0 or self.log_every < 1:
            raise ValueError("trainer.ckpt_every must be >= 0 (0: only at the end) and trainer.log_every >= 1")


@dataclass
class ProbeSettings:
    """The ``probes`` section of conf/train.yaml."""

    every: int = 50
    bands: list[int] = field(default_factory=lambda: list(DEFAULT_BANDS))
    per_band: int = 2
    seed: int = 0
    max_tokens: int = 4096
    presentations: bool = True

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ProbeSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown probes key(s) {unknown}; valid keys: {', '.join(sorted(known))}")
        settings = cls(**values)
        settings.bands = validate_bands(settings.bands)
        if settings.every < 0:
            raise ValueError(f"probes.every={settings.every}: use 0 (off) or a step interval")
        return settings


def lr_multiplier(step: int, total_steps: int, warmup_frac: float, min_lr_ratio: float) -> float:
    """Linear warm-up over ``warmup_frac`` of the steps, then cosine from 1 down to ``min_lr_ratio``.

    Example:
        >>> [round(lr_multiplier(s, 100, 0.04, 0.1), 3) for s in (0, 3, 4, 52, 100)]
        [0.25, 1.0, 1.0, 0.55, 0.1]
    """
    warmup = max(1, int(round(warmup_frac * total_steps))) if warmup_frac > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    if step >= total_steps:
        return min_lr_ratio
    progress = (step - warmup) / max(1, total_steps - warmup)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def anchor_seed(seed: int, step: int, slot: int = 0) -> int:
    """Seed of the anchor generator for one batch of a step: resume redraws the same anchors.

    ``slot`` is the batch's position among the step's ``world_size x grad_accum`` batches
    (``micro x world_size + rank``), not the rank alone, so a 2-rank run and a 1-rank run with ``grad_accum=2``
    that see the same global batches also draw the same anchors.
    """
    return int(np.random.SeedSequence([int(seed), int(step), int(slot)]).generate_state(1)[0])


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Move the batch's tensors to `device` (non-blocking from pinned memory on GPU)."""
    if device.type == "cpu":
        return batch
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def _plain(cfg: DictConfig | dict) -> dict[str, Any]:
    """A resolved plain-dict copy of the config (the one place a DictConfig is read)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    return dict(cfg)


def _read_history(metrics_path: Path) -> list[dict[str, Any]]:
    """Rows already in ``metrics.jsonl`` (a resumed run's summary covers the whole run)."""
    if not metrics_path.is_file():
        return []
    return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]


def _config_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_differences(a, b, name + ".")
        elif a != b:
            out.append(name)
    return out


# Keys that may change between a run and its continuation without changing what is computed.
_RESUME_TOLERATED = ("resume", "run_dir", "logger", "trainer.max_steps", "trainer.progress", "trainer.ckpt_every",
                     "trainer.keep_checkpoints", "trainer.num_workers", "trainer.preempt_signals", "trainer.tau_every",
                     "trainer.measure_tau")


# ------------------------------------------------------------------------------------------------------------ train


def train(cfg: DictConfig | dict) -> dict[str, Any]:
    """Run (or continue) one training run and return its summary (the content of ``summary.json``).

    Args:
        cfg: the composed config of conf/train.yaml (``run_dir`` must resolve: Hydra sets it; tests pass a path).

    Returns:
        The summary dict: sampler, seed, steps, epochs, ktok_s, pad_eff, eta_s, full_run_eta_s, final_loss,
        final_acc, tau, tau_baseline, overhead_frac, world_size, status, plus timing details.

    Raises:
        checkpoint.Preempted: after a requested checkpoint (SystemExit with code 75).
        ValueError: a bad config value (the message names the key and the fix).
    """
    try:
        return _train(cfg)
    except Exception as exc:
        _mark_failed(cfg, exc)
        raise
    finally:
        _teardown()


def _train(cfg: DictConfig | dict) -> dict[str, Any]:
    """The body of :func:`train` (which adds the crash marking and the teardown)."""
    t_setup = time.perf_counter()
    # ---- 1. config -> plain values ---------------------------------------------------------------------------
    config = _plain(cfg)
    trainer = TrainerSettings.from_dict(dict(config.get("trainer") or {}))
    probe_cfg = ProbeSettings.from_dict(dict(config.get("probes") or {}))
    sampler_cfg = dict(config["sampler"])
    model_cfg = dict(config["model"])
    data_cfg = dict(config["data"])
    logger_cfg = dict(config.get("logger") or {})
    seed = int(config.get("seed", 0))
    run_dir = Path(config["run_dir"])
    resume = config.get("resume", False)

    env = dist.init_distributed(trainer.dist_backend)
    device = torch.device(f"cuda:{env.local_rank}" if trainer.device.startswith("cuda") else trainer.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Threads: the cores of this machine shared by its ranks (one process per rank).
    # Threads per rank: Slurm's per-task CPU allocation when there is one, else the CPUs this process may use
    # (taskset/cgroup aware) shared by the ranks of a single-node torchrun.
    slurm_cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    default_threads = int(slurm_cpus) if slurm_cpus else len(os.sched_getaffinity(0)) // env.world_size
    torch.set_num_threads(trainer.num_threads or max(1, default_threads))
    run_dir.mkdir(parents=True, exist_ok=True)
    log = setup_text_log(run_dir, env.rank)
    log.info(f"run dir {run_dir}; rank {env.rank}/{env.world_size} ({env.source}); device {device}")
    ckpt.clear_checkpoint_request()
    if trainer.preempt_signals:
        ckpt.install_preemption_handler(trainer.preempt_signals)

    manager = ckpt.CheckpointManager(run_dir / "checkpoints", keep=trainer.keep_checkpoints)
    state = manager.load_latest(map_location="cpu")
    if resume is True and state is None:
        raise FileNotFoundError(
            f"resume=true but {manager.directory} holds no checkpoint; to continue a run pass its directory "
            f"(hydra.run.dir=<old run dir>), or drop resume=true to start fresh"
        )
    if state is not None:
        differing = [k for k in _config_differences(state.get("config", {}), config)
                     if not k.startswith(_RESUME_TOLERATED)]
        if differing:
            log.warning(f"resume: config differs from the checkpoint's in {differing}; continuing with the new values")

    # ---- 2. model, data, policy, loader ----------------------------------------------------------------------
    torch.manual_seed(seed)  # the draft's initial weights
    model, tokenizer = build_model(**model_cfg)
    model.to(device)
    dataset = build_dataset(tokenizer=tokenizer, **data_cfg)
    train_ds, heldout_ds = dataset.split()
    policy = policy_from_config(sampler_cfg, train_ds.lengths, seed=seed, world_size=env.world_size, rank=env.rank)
    collate = Collator(pad_id=tokenizer.pad_token_id, packed=policy.packed, effective_lengths=policy.lengths)
    loader = torch.utils.data.DataLoader(
        train_ds,
        batch_sampler=policy,
        collate_fn=collate,
        num_workers=trainer.num_workers,
        pin_memory=device.type == "cuda",
    )
    # Steps per epoch can differ between epochs (token-budget packing of a new order): plan them all now.
    batches_per_epoch = [len(policy.batches(e)) for e in range(trainer.epochs)]
    steps_per_epoch = [math.ceil(n / trainer.grad_accum) for n in batches_per_epoch]
    total_steps = sum(steps_per_epoch)
    end_step = total_steps if trainer.max_steps is None else min(total_steps, trainer.max_steps)

    # ---- 3. optimizer and schedule (over the configured full run, so a max_steps cap does not reshape it) ----
    params = list(model.trainable_parameters())
    optimizer = torch.optim.AdamW(params, lr=trainer.lr, betas=trainer.betas, weight_decay=trainer.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, total_steps, trainer.warmup_frac, trainer.min_lr_ratio)
    )
    train_model: torch.nn.Module = model
    if env.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # The frozen target is identical on every rank (same weights from the same cache/path): skip broadcasting it.
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        DDP._set_params_and_buffers_to_ignore_for_model(model, frozen)
        train_model = DDP(model, device_ids=[env.local_rank] if device.type == "cuda" else None)
    anchor_generator = torch.Generator(device="cpu")
    autocast = (
        torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        if trainer.precision == "bf16"
        else contextlib.nullcontext()
    )

    # ---- 4. resume -----------------------------------------------------------------------------------------
    step, epoch, consumed = 0, 0, 0
    extra: dict[str, Any] = {}
    if state is not None:
        model.load_draft_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        policy.load_state_dict(state["sampler"])
        ckpt.restore_rng_state(state["rng"], anchor_generator)
        step = int(state["step"])
        epoch, consumed = int(state["sampler"]["epoch"]), int(state["sampler"]["batches_consumed"])
        extra = dict(state.get("extra") or {})
        log.info(f"resumed from {manager.latest_path()} at step {step} (epoch {epoch}, batch {consumed})")
    else:
        policy.set_epoch(0)

    run_id = None
    if env.is_main:
        run_id = load_or_create_run_id(run_dir, (state or {}).get("wandb_run_id"))
    wandb_settings = logger_cfg if logger_cfg.get("kind") == "wandb" else None
    run_logger = RunLogger(
        run_dir, is_main=env.is_main, wandb_settings=wandb_settings, config=config, run_id=run_id, log=log
    )
    run_logger.truncate_after(step)
    history = _read_history(run_logger.metrics_path) if env.is_main else []

    probes = None
    if probe_cfg.every > 0:
        probes = ProbeSets(heldout_ds.lengths, probe_cfg.bands, probe_cfg.per_band, probe_cfg.seed,
                           probe_cfg.max_tokens)
        if probes.empty_bands:
            log.warning(f"probes: no held-out samples in band(s) {probes.empty_bands} of probes.bands={probes.bands}")
    presentations = PresentationRecorder(run_dir / "presentations.parquet", probe_cfg.bands)
    if state is not None and env.is_main:
        presentations.resume(step)
    if probe_cfg.presentations and env.is_main:
        presentations.warm_up()

    def evaluate_probe(indices: np.ndarray, generator: torch.Generator):
        lengths = heldout_ds.lengths[indices]
        batch = collate_padded([heldout_ds[int(i)] for i in indices], indices, lengths, tokenizer.pad_token_id)
        with autocast:
            return model.evaluate(_to_device(batch, device), generator)

    probe_time = [0.0]  # seconds spent in probe evaluations (part of the overhead), reported in summary.json

    def run_probes(at_step: int) -> None:
        if probes is not None and env.is_main:
            t_probe = time.perf_counter()
            model.eval()
            run_logger.log_probes(probes.evaluate(evaluate_probe, at_step, seed=probe_cfg.seed))
            model.train()
            probe_time[0] += time.perf_counter() - t_probe

    def save_checkpoint() -> Path | None:
        """Collective (presentations are gathered from every rank); rank 0 writes."""
        if probe_cfg.presentations:
            presentations.gather(dist.all_gather_objects)
        if not env.is_main:
            return None
        run_logger.flush()
        if probe_cfg.presentations:
            presentations.write()
        return manager.save(
            {
                "model": model.draft_state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "sampler": policy.state_dict(batches_consumed=consumed),
                "rng": ckpt.capture_rng_state(anchor_generator),
                "step": step,
                "epoch": epoch,
                "config": config,
                "wandb_run_id": run_id,
                "extra": {"skipped_steps": skipped_steps, "ema_step_time": ema_step_time},
            },
            step=step,
        )

    tau_baseline = None
    skipped_steps = int(extra.get("skipped_steps", 0))
    # tau settings belong to the model config (decode_*): the same prompts for every policy
    decode_new_tokens = int(model_cfg.get("decode_max_new_tokens", 64))
    prompts = heldout_prompts(heldout_ds, num_prompts=int(model_cfg.get("decode_num_prompts", 16)),
                              max_prompt_tokens=int(model_cfg.get("decode_max_prompt_tokens", 128)))
    setup_time_s = time.perf_counter() - t_setup

    # ---- 5. the loop ---------------------------------------------------------------------------------------
    summary_base = {"sampler": policy.name, "seed": seed, "epochs": trainer.epochs, "world_size": env.world_size}
    run_logger.write_summary({**summary_base, "steps": step, "status": "running"})
    log.info(
        f"{policy.name}: {len(train_ds)} train / {len(heldout_ds)} held-out samples, {batches_per_epoch} batches "
        f"per epoch per rank, {total_steps} steps planned, running to step {end_step}"
    )
    model.train()
    if step == 0:
        run_probes(0)  # the starting point of every band's curve (forgetting is measured against it)
    pbar = tqdm(total=end_step, initial=step, disable=not (env.is_main and trainer.progress), desc=policy.name,
                dynamic_ncols=True, mininterval=1.0)
    ema_step_time = extra.get("ema_step_time")
    ema_ktok = None
    compute_total = 0.0
    status = "running"
    failure = ""
    last_loss = last_acc = math.nan
    batch_iter = None
    t_loop = time.perf_counter()
    t_step_start = t_loop

    while step < end_step:
        # -- data: this step's micro-batches (sampler + dataset + collate time is overhead) --
        if batch_iter is None:
            batch_iter = iter(loader)
        micro_batches = []
        while len(micro_batches) < trainer.grad_accum and consumed < batches_per_epoch[epoch]:
            micro_batches.append(next(batch_iter))
            consumed += 1

        # -- forward / backward / optimizer (compute) --
        t_compute = time.perf_counter()
        micro_stats, doc_correct, doc_count = [], [], []  # detached, on the device: no host sync yet
        for micro, batch in enumerate(micro_batches):
            batch = _to_device(batch, device)
            anchor_generator.manual_seed(anchor_seed(seed, step, micro * env.world_size + env.rank))
            # DDP all-reduces gradients on the last micro-batch only
            last_micro = micro == len(micro_batches) - 1
            sync = train_model.no_sync() if env.distributed and not last_micro else contextlib.nullcontext()
            with sync:
                with autocast:
                    out = train_model(batch, anchor_generator)
                # global norm: backward the raw weighted CE sum, divide the gradients by the global weight below;
                # local norm: the mean over this rank's micro-batches (DDP then averages the ranks)
                objective = out.weighted_ce_sum if trainer.global_loss_norm else out.loss / len(micro_batches)
                objective.backward()
            micro_stats.append(torch.stack([out.weighted_ce_sum.detach().double(), out.weight_sum.double(),
                                            out.correct.double(), out.count.double()]))
            doc_correct.append(out.doc_correct)
            doc_count.append(out.doc_count)
        ce_sum, weight_sum, correct, count = torch.stack(micro_stats).sum(dim=0)
        if trainer.global_loss_norm:
            # grads hold (1/W) x sum over ranks of d(CE sum) (DDP averages): rescale to d(global CE sum / global weight)
            global_weight = dist.all_reduce_sum(weight_sum.clone())
            scale = (env.world_size / global_weight.clamp_min(1e-12)).float()
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, trainer.grad_clip if trainer.grad_clip > 0 else math.inf)
        # One host sync per step: every statistic (and the preemption flag) in one vector, gathered over ranks.
        sample_index = np.concatenate([b["sample_index"].numpy() for b in micro_batches])
        doc_lengths = policy.lengths[sample_index]  # effective (truncated) lengths, as collated
        host_stats = torch.tensor([
            sum(b["real_tokens"] for b in micro_batches), sum(b["padded_tokens"] for b in micro_batches),
            doc_lengths.size, float((doc_lengths.astype(np.float64) ** 2).sum()), float(doc_lengths.sum()),
            float(doc_lengths.max()), float(ckpt.checkpoint_requested()),
        ], dtype=torch.float64).to(device, non_blocking=True)
        local = torch.cat([torch.stack([ce_sum, weight_sum, correct, count, grad_norm.double()]), host_stats])
        gathered = dist.all_gather_rows(local)
        n_stats = gathered.shape[1]
        flat = torch.cat([gathered.flatten(), torch.cat(doc_correct).double(), torch.cat(doc_count).double()])
        values = flat.cpu().numpy()  # <- the CPU-GPU sync point of the step
        per_rank = values[: gathered.numel()].reshape(-1, n_stats)
        docs = values[gathered.numel():].reshape(2, -1)
        g_ce, g_weight, g_correct, g_count = per_rank[:, :4].sum(axis=0)
        g_grad_norm = per_rank[0, 4]
        g_real, g_padded, g_docs, g_sq, g_len_sum = per_rank[:, 5:10].sum(axis=0)
        g_max_len = per_rank[:, 10].max()
        preempt = bool(per_rank[:, 11].max() > 0)
        loss = g_ce / g_weight if g_weight > 0 else math.nan
        acc = g_correct / g_count if g_count > 0 else math.nan
        lr_now = optimizer.param_groups[0]["lr"]

        finite = math.isfinite(g_ce) and math.isfinite(g_grad_norm) and g_weight > 0
        if finite:
            optimizer.step()
        elif g_weight <= 0 and math.isfinite(g_ce):
            log.warning(f"step {step}: no supervised block in the batch (weight sum 0); update skipped")
            skipped_steps += 1
        elif trainer.skip_nonfinite:
            log.warning(f"step {step}: non-finite loss/grad norm ({loss}, {g_grad_norm}); update skipped "
                        f"(trainer.skip_nonfinite=true)")
            skipped_steps += 1
        else:
            status = "failed"
            failure = (f"non-finite loss at step {step} (loss={loss}, grad_norm={g_grad_norm}); stopping. The last good "
                       f"checkpoint is {manager.latest_path()}; lower trainer.lr or set trainer.skip_nonfinite=true")
            log.error(failure)
        optimizer.zero_grad(set_to_none=True)
        compute_s = time.perf_counter() - t_compute
        if status == "failed":
            break
        scheduler.step()
        compute_total += compute_s

        # -- bookkeeping (overhead): metrics, records, epoch roll-over, probes, checkpoints --
        if probe_cfg.presentations:
            presentations.record(sample_index, doc_lengths, docs[0], docs[1], epoch=epoch, step=step)
        step_epoch = epoch
        if consumed >= batches_per_epoch[epoch]:
            epoch, consumed = epoch + 1, 0
            batch_iter = None
            if epoch < trainer.epochs:
                policy.set_epoch(epoch)
        step += 1
        now = time.perf_counter()
        step_time = now - t_step_start
        t_step_start = now
        ema_step_time = throughput.ema_update(ema_step_time, step_time)
        ktok = throughput.ktok_per_s(g_real, step_time)
        ema_ktok = throughput.ema_update(ema_ktok, ktok)
        eta = throughput.eta_seconds(end_step - step, ema_step_time)
        if math.isfinite(loss):
            last_loss, last_acc = loss, acc
        row = {
            "step": step, "epoch": step_epoch, "loss": loss, "acc": acc, "lr": lr_now, "grad_norm": g_grad_norm,
            "real_tokens": int(g_real), "padded_tokens": int(g_padded),
            "pad_eff": throughput.padding_efficiency(g_real, g_padded), "batch_size": int(g_docs),
            "max_len": int(g_max_len), "mean_len": g_len_sum / max(g_docs, 1),
            "bucket": policy.bucket_of(sample_index),  # rank 0's batch (ranks of one step share a length range)
            "sq_tokens": int(g_sq), "step_time_s": step_time, "compute_time_s": compute_s, "ktok_s": ktok,
            "eta_s": eta,
        }
        if env.is_main:
            history.append(row)
            if step % trainer.log_every == 0:
                run_logger.log_step(row)
            pbar.update(1)
            pbar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}", ktok_s=f"{ema_ktok:.1f}",
                             pad_eff=f"{row['pad_eff']:.2f}", eta=f"{eta:.0f}s", refresh=False)
        if probe_cfg.every and step % probe_cfg.every == 0 and step < end_step:
            run_probes(step)
        if trainer.tau_every and step % trainer.tau_every == 0 and env.is_main and step < end_step:
            model.eval()
            log.info(f"step {step}: tau {measure_acceptance(model, prompts, max_new_tokens=decode_new_tokens)['tau']:.3f}")
            model.train()
        if preempt:
            path = save_checkpoint()
            log.warning(f"checkpoint requested ({ckpt.request_reason() or 'another rank'}): saved step {step} to "
                        f"{path}; exiting with code {ckpt.PREEMPTED_EXIT_CODE} for a requeue")
            run_logger.write_summary({**summary_base, "steps": step, "status": "running"})
            run_logger.close(exit_code=ckpt.PREEMPTED_EXIT_CODE)
            pbar.close()
            ckpt.run_previous_handler()  # e.g. submitit's requeue (it may exit here on rank 0)
            raise ckpt.Preempted(step, path)
        if trainer.ckpt_every and step % trainer.ckpt_every == 0 and step < end_step:
            save_checkpoint()

    # ---- 6. end of run ---------------------------------------------------------------------------------------
    pbar.close()
    if status != "failed":
        run_probes(step)
        save_checkpoint()
    run_logger.flush()
    wall_s = time.perf_counter() - t_loop

    tau = math.nan
    t_tau = time.perf_counter()
    if status != "failed" and trainer.measure_tau and env.is_main:
        model.eval()
        tau = float(measure_acceptance(model, prompts, max_new_tokens=decode_new_tokens)["tau"])
        # the untrained draft (same initial weights): rebuilt and measured here, so a continuation gets it too
        tau_baseline = float(
            measure_acceptance(model.baseline_model(), prompts, max_new_tokens=decode_new_tokens)["tau"]
        )
    tau_time_s = time.perf_counter() - t_tau
    if status != "failed":
        status = "finished"  # what was asked (all epochs, or up to trainer.max_steps) is done
    if not math.isfinite(last_loss):  # a continuation that ran no step: report the last logged values
        finite_rows = [r for r in history if r.get("loss") is not None and math.isfinite(r["loss"])]
        if finite_rows:
            last_loss, last_acc = finite_rows[-1]["loss"], finite_rows[-1]["acc"]

    ktok_series = [r["ktok_s"] for r in history]
    step_times = np.asarray([r["step_time_s"] for r in history], dtype=np.float64)
    steady = step_times[trainer.steady_warmup_steps:] if step_times.size > trainer.steady_warmup_steps else step_times
    steady_step_time = float(np.median(steady)) if steady.size else math.nan  # steady state, like Ktok/s
    summary = {
        **summary_base,
        "steps": step,
        "ktok_s": throughput.steady_state_ktok_s(ktok_series, trainer.steady_warmup_steps),
        "pad_eff": throughput.padding_efficiency([r["real_tokens"] for r in history],
                                                 [r["padded_tokens"] for r in history]),
        "eta_s": throughput.eta_seconds(total_steps - step, steady_step_time),
        "full_run_eta_s": throughput.full_run_eta_seconds(trainer.epochs, round(total_steps / trainer.epochs),
                                                          steady_step_time),
        "final_loss": last_loss,
        "final_acc": last_acc,
        "tau": tau,
        "tau_baseline": tau_baseline,
        "overhead_frac": throughput.overhead_fraction(compute_total, wall_s),
        "status": status,
        "total_steps": total_steps,
        "skipped_steps": skipped_steps,
        "wall_time_s": wall_s,
        "compute_time_s": compute_total,
        "probe_time_s": probe_time[0],
        "setup_time_s": setup_time_s,
        "tau_time_s": tau_time_s,
        "step_time_s": steady_step_time,
        "error": failure or None,
    }
    run_logger.write_summary(summary)
    run_logger.close(exit_code=FAILED_EXIT_CODE if status == "failed" else 0)
    log.info(
        f"{status}: step {step}/{total_steps}, loss {last_loss:.4f}, acc {last_acc:.4f}, "
        f"{summary['ktok_s']:.2f} Ktok/s, pad_eff {summary['pad_eff']:.3f}, overhead {summary['overhead_frac']:.3%}, "
        f"tau {tau:.3f} (untrained {math.nan if tau_baseline is None else tau_baseline:.3f}), loop {wall_s:.1f}s"
    )
    return summary


def _mark_failed(cfg: DictConfig | dict, exc: BaseException) -> None:
    """After a crash: rank 0 sets ``status: failed`` and the error in ``summary.json`` (analysis marks the run)."""
    try:
        run_dir = Path(_plain(cfg)["run_dir"])
        summary_path = run_dir / "summary.json"
        if dist.current_env().is_main and summary_path.is_file():
            summary = json.loads(summary_path.read_text())
            if summary.get("status") != "running":  # not this run's summary (e.g. a refused resume)
                return
            summary.update(status="failed", error=f"{type(exc).__name__}: {exc}")
            write_json_atomic(summary_path, summary)
    except Exception:  # noqa: BLE001 - never hide the original error behind a reporting error
        logging.getLogger("dflash_lab").exception("could not mark summary.json as failed")


def _teardown() -> None:
    """Release what train() took: signal handlers, the rank log file, the process group."""
    ckpt.uninstall_preemption_handler()
    close_text_log()
    dist.cleanup()


@hydra.main(config_path="pkg://dflash_lab.conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """``python -m dflash_lab.train [overrides]``: run :func:`train`; exit 1 when the run failed."""
    summary = train(cfg)
    if summary["status"] == "failed":
        raise SystemExit(FAILED_EXIT_CODE)
    return summary.get("final_loss")


if __name__ == "__main__":
    main()
