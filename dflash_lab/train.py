"""Train a DFlash draft model with a chosen batching policy: ``python -m dflash_lab.train sampler=bucketed``.

With no arguments this runs a complete small training on the CPU (embedded synthetic data, tiny Qwen3 target
pretrained once and cached, a few minutes on 2 cores). ``train(cfg)`` does the work and returns the summary dict;
``main()`` is the thin Hydra wrapper.

Read top to bottom:
    1. settings (every section checked at the door), process group, run directory, the newest intact checkpoint;
    2. model (frozen target + trainable draft), data and held-out split, policy, DataLoader;
    3. AdamW over the draft; the LR schedule (warm-up, cosine) spans the run's end step, which is
       ``trainer.max_steps`` when set, else every configured epoch;
    4. resume: model, optimizer, sampler position, RNG, run totals; changed settings take effect or are refused
       (``checkpoint.check_resume_config``); a finished run directory is left untouched;
    5. the loop: ``grad_accum`` micro-batches, forward/backward, global loss normalisation, clip, ONE host sync for
       every statistic, optimizer step; then bookkeeping (record row), scheduled evaluation (probes), checkpoints;
    6. the end: final probes and checkpoint, acceptance length tau (trained vs untrained draft), ``summary.json``.

Run files, their columns and the step numbering are defined in :mod:`dflash_lab.record`. Timing
(``record.TimeLedger``): the run's wall time splits into setup, compute (moving the batch to the device, forward,
backward, scaling, clipping, the statistics sync, the optimizer step), data wait, scheduled evaluation (probes,
tau), checkpointing and other (logging, bookkeeping), over every segment of the run; ``overhead_frac`` is the
loop's own overhead, ``eval_frac`` the evaluation's share (``metrics.throughput``). A step's ``step_time_s`` is its
data wait, compute and bookkeeping: the probes and checkpoints after it are not.

Failure and preemption: a non-finite loss stops the run (status ``failed``, the last good checkpoint kept, exit
code 1) or skips the update with ``trainer.skip_nonfinite=true``. SIGUSR2/SIGTERM make the loop checkpoint at the
next step boundary and exit with code 75; during the final tau measurement they end it early (status
``preempted``, partial tau recorded), and the requeued job measures tau again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from dflash_lab import checkpoint as ckpt
from dflash_lab import dist, record
from dflash_lab.config_check import (
    as_bool,
    as_choice,
    as_float,
    as_int,
    refuse_unknown_keys,
)
from dflash_lab.data import Collator, build_dataset
from dflash_lab.metrics import throughput
from dflash_lab.model import build_model, footprint, heldout_prompts, measure_acceptance
from dflash_lab.probes import (
    DEFAULT_BANDS,
    PresentationRecorder,
    ProbeSets,
    heldout_evaluator,
    validate_bands,
)
from dflash_lab.run_lock import RunDirBusy, RunDirLock
from dflash_lab.run_lock import describe as describe_holder
from dflash_lab.run_logger import (
    RunLogger,
    close_text_log,
    load_or_create_run_id,
    setup_text_log,
    write_json_atomic,
)
from dflash_lab.run_names import name_wandb_run
from dflash_lab.sampling import policy_from_config
from dflash_lab.sampling.anchors import anchor_rule_name, block_tokens_per_sample

FAILED_EXIT_CODE = 1
REFUSED_EXIT_CODE = 2  # a refused config, resume or dataset (the one-line message says why and the fix)
LOCKED_EXIT_CODE = 3   # another live run holds the run directory (dflash_lab/run_lock.py); nothing was written
CONFIG_SECTIONS = ("sampler", "data", "model", "trainer", "gpu", "logger", "probes", "analysis", "seed", "resume",
                   "overwrite",
                   "run_dir", "experiment")


# --------------------------------------------------------------------------------------------------- settings
def _checked(section: str, values: Mapping[str, Any], spec: dict[str, Callable[[str, Any], Any]]) -> dict[str, Any]:
    """Refuse unknown keys, then check each given value with its checker (named ``section.key`` in errors)."""
    refuse_unknown_keys(section, values, spec)
    return {k: spec[k](f"{section}.{k}", v) for k, v in values.items()}


def _int(minimum: int, allow_none: bool = False):
    return lambda key, v: as_int(key, v, minimum=minimum, allow_none=allow_none)


def _float(minimum: float | None = None, maximum: float | None = None):
    return lambda key, v: as_float(key, v, minimum=minimum, maximum=maximum)


def _betas(key: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{key}={value!r}: give two numbers, e.g. {key}=[0.9,0.95]")
    return tuple(as_float(f"{key}[{i}]", v, minimum=0.0, maximum=0.999999) for i, v in enumerate(value))


def _signals(key: str, value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key}={value!r}: give a list of signal names, e.g. {key}=[SIGUSR2,SIGTERM]")
    return list(value)


@dataclass
class TrainerSettings:
    """The ``trainer`` section (conf/trainer/cpu.yaml, gpu.yaml explain each key)."""

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
    max_consecutive_skips: int = 10   # skipped updates in a row after which the run fails (a diverged run)
    activation_checkpointing: bool | str = False   # auto: on where the preflight says the step needs it
    gpu_mem_gb: float | None = None
    num_threads: int | None = None
    num_workers: int = 0
    log_every: int = 50
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    progress: bool = True
    steady_warmup_steps: int = 10
    tau_every: int = 0
    measure_tau: bool = True
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGUSR2", "SIGTERM"])
    dist_backend: str | None = None

    SPEC = {
        "device": lambda k, v: v if isinstance(v, str) and (v == "cpu" or v.startswith("cuda"))
        else as_choice(k, v, ["cpu", "cuda"]),
        "precision": lambda k, v: as_choice(k, v, ["fp32", "bf16"]),
        "epochs": _int(1), "max_steps": _int(0, allow_none=True), "grad_accum": _int(1),
        "lr": _float(minimum=0.0), "min_lr_ratio": _float(0.0, 1.0), "warmup_frac": _float(0.0, 0.999),
        "weight_decay": _float(minimum=0.0), "betas": _betas, "grad_clip": _float(minimum=0.0),
        "global_loss_norm": as_bool, "skip_nonfinite": as_bool, "max_consecutive_skips": _int(1),
        "activation_checkpointing": lambda k, v: v if v == "auto" else as_bool(k, v),
        "gpu_mem_gb": lambda k, v: as_float(k, v, minimum=1.0, allow_none=True),
        "num_threads": _int(1, allow_none=True), "num_workers": _int(0), "log_every": _int(1),
        "ckpt_every": _int(0), "keep_checkpoints": _int(1), "progress": as_bool, "steady_warmup_steps": _int(0),
        "tau_every": _int(0), "measure_tau": as_bool, "preempt_signals": _signals,
        "dist_backend": lambda k, v: None if v is None else as_choice(k, v, ["gloo", "nccl"]),
    }

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainerSettings:
        """Build from the config section; unknown keys and badly typed values are refused, naming the key."""
        settings = cls(**_checked("trainer", values, cls.SPEC))
        if settings.precision == "bf16" and not settings.device.startswith("cuda"):
            raise ValueError("trainer.precision=bf16 is for GPUs; on CPU use trainer.precision=fp32 (or trainer=gpu)")
        if settings.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"trainer.device={settings.device} but no CUDA device is visible; use trainer=cpu")
        return settings


@dataclass
class ProbeSettings:
    """The ``probes`` section of conf/train.yaml."""

    every: int = 50
    bands: list[int] = field(default_factory=lambda: list(DEFAULT_BANDS))
    per_band: int = 24
    seed: int = 0
    max_tokens: int = 4096
    presentations: bool = True

    SPEC = {"every": _int(0), "bands": lambda k, v: validate_bands(v), "per_band": _int(1), "seed": _int(0),
            "max_tokens": _int(1), "presentations": as_bool}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ProbeSettings:
        return cls(**_checked("probes", values, cls.SPEC))


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up over ``warmup_frac`` of ``total_steps``, then cosine from ``peak_lr`` to ``min_lr_ratio x``.

    Example:
        >>> schedule = LRSchedule(peak_lr=1.0, total_steps=100, warmup_frac=0.04, min_lr_ratio=0.1)
        >>> [round(schedule.lr(s), 3) for s in (0, 3, 4, 52, 100)]
        [0.25, 1.0, 1.0, 0.55, 0.1]
    """

    peak_lr: float
    total_steps: int
    warmup_frac: float
    min_lr_ratio: float

    def lr(self, step: int) -> float:
        """The learning rate of the update that follows ``step`` completed updates."""
        warmup = max(1, int(round(self.warmup_frac * self.total_steps))) if self.warmup_frac > 0 else 0
        if step < warmup:
            return self.peak_lr * (step + 1) / warmup
        if step >= self.total_steps:
            return self.peak_lr * self.min_lr_ratio
        progress = (step - warmup) / max(1, self.total_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class TrainHooks:
    """Observation points for tests and tools (all optional; a run without hooks is the production path).

    Attributes:
        after_forward: ``(step, micro, out) -> out`` called on each micro-batch's StepOutput before backward
            (``step`` = the number this update will carry).
        after_step: ``(row) -> None`` called with each step's metrics row after it was recorded.
    """

    after_forward: Callable[[int, int, Any], Any] | None = None
    after_step: Callable[[dict[str, Any]], None] | None = None


LOGGER_KEYS = {"none": ("kind",),
               "wandb": ("kind", "mode", "project", "entity", "group", "job_type", "name", "tags", "overrides")}


def logger_settings(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``logger`` section checked (kind none | wandb, known keys only); the W&B settings, or None."""
    kind = as_choice("logger.kind", values.get("kind", "none"), list(LOGGER_KEYS))
    refuse_unknown_keys("logger", values, LOGGER_KEYS[kind])
    if kind == "wandb":
        as_choice("logger.mode", values.get("mode", "offline"), ["offline", "online", "disabled"])
        return dict(values)
    return None


def anchor_seed(seed: int, step: int, slot: int = 0) -> int:
    """Seed of the anchor generator for one batch of a step: resume redraws the same anchors.

    ``slot`` is the batch's position among the step's ``world_size x grad_accum`` batches (``micro x world_size +
    rank``), so a 2-rank run and a 1-rank run with ``grad_accum=2`` over the same global batches draw the same anchors.
    """
    return int(np.random.SeedSequence([int(seed), int(step), int(slot)]).generate_state(1)[0])


def plan_facts(policy, epochs: int, grad_accum: int, max_steps: int | None) -> record.PlanFacts:
    """Exact steps per epoch (token-budget packing differs between epochs) and the run's end step."""
    batches = tuple(len(policy.batches(e)) for e in range(epochs))
    steps_per_epoch = tuple(math.ceil(n / grad_accum) for n in batches)
    diagnostics = [policy.diagnostics(e) for e in range(epochs)]
    total = sum(steps_per_epoch)
    return record.PlanFacts(
        steps_per_epoch=steps_per_epoch,
        batches_per_epoch=batches,
        end_step=total if max_steps is None else min(total, max_steps),
        dropped_overlong=diagnostics[0]["dropped_overlong"],
        truncated=diagnostics[0]["truncated"],
        repeated_remainder=sum(d["repeated_remainder"] for d in diagnostics),
        dropped_remainder=sum(d["dropped_remainder"] for d in diagnostics),
    )


def gpu_memory_gb(config: Mapping[str, Any], trainer: TrainerSettings, device: torch.device) -> float | None:
    """Memory of one GPU for the memory plan: ``gpu.memory_gb`` (a preset), else ``trainer.gpu_mem_gb``, else the
    device's own total; None on CPU."""
    preset = (config.get("gpu") or {}).get("memory_gb")
    if preset is not None:
        return as_float("gpu.memory_gb", preset, minimum=1.0)
    if trainer.gpu_mem_gb is not None:
        return trainer.gpu_mem_gb
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return None


def resolve_memory_plan(config: Mapping[str, Any], trainer: TrainerSettings, model, dataset, device: torch.device,
                        world_size: int, seed: int) -> tuple[dict[str, Any], footprint.MemoryPlan, np.ndarray | None]:
    """The sampler config with ``max_block_tokens`` resolved, the memory plan (``footprint.memory_plan``: ``auto``
    block budget and checkpointing chosen from the memory model where the GPU's memory is known) and the block
    tokens of every sample under the model's anchor rule (``sampling.anchors``; None without a block budget: the
    pass over the loss mask is skipped when nothing reads it). The model takes the plan's block budget (fair
    thinning of any batch over it) and checkpointing."""
    sampler_cfg = dict(config["sampler"])
    requested = sampler_cfg.get("max_block_tokens")
    gpu_gb = gpu_memory_gb(config, trainer, device)
    needs_blocks = requested is not None and not (requested == "auto" and gpu_gb is None)
    block_tokens = None
    if needs_blocks:
        block_tokens = block_tokens_per_sample(dataset.anchor_positions(), block_size=model.block_size,
                                               anchors_per_doc=model.anchors_per_doc,
                                               anchor_density=model.anchor_density)
    memory = footprint.memory_plan(
        footprint.StepModel.from_model(model), dataset.lengths, sampler_cfg,
        footprint.Settings(precision=trainer.precision, world_size=world_size,
                           attention=footprint.attention_path(device.type, model.attention_backend)),
        activation_checkpointing=trainer.activation_checkpointing, gpu_mem_gb=gpu_gb, seed=seed,
        block_tokens=block_tokens)
    sampler_cfg["max_block_tokens"] = memory.max_block_tokens
    model.max_block_tokens = memory.max_block_tokens
    model.draft.activation_checkpointing = memory.activation_checkpointing
    return sampler_cfg, memory, (block_tokens if memory.max_block_tokens is not None else None)


# The run directory's lock, held by rank 0 from the start of _train to the end of train() (released in its finally).
_HELD_LOCKS: list[RunDirLock] = []
# The .hydra files of the checkpoint being resumed: put back if this launch is refused before its loop starts.
_REFUSAL_RESTORES: list[tuple[Path, dict[str, str]]] = []
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def read_hydra_files(run_dir: Path) -> dict[str, str]:
    """The text of the run's ``.hydra`` files (config, hydra, overrides) as they are now."""
    files = {}
    for name in HYDRA_FILES:
        path = run_dir / ".hydra" / name
        if path.is_file():
            files[name] = path.read_text()
    return files


def keep_hydra_files(run_dir: Path, files: dict[str, str], log: logging.Logger) -> None:
    """Rewrite this run's ``.hydra`` files if another launch in the directory (refused by the run lock, but only
    after Hydra had written its own) replaced them."""
    if read_hydra_files(run_dir) == files:
        return
    for name, text in files.items():
        (run_dir / ".hydra" / name).write_text(text)
    log.warning(f"another launch rewrote {run_dir / '.hydra'}; this run's config files are restored")


def restore_hydra_files() -> None:
    """Hydra rewrites ``.hydra/*.yaml`` before the run starts; a launch refused before its first step puts back the
    files of the checkpoint it would have resumed, so the directory records the run that is in it."""
    while _REFUSAL_RESTORES:
        run_dir, files = _REFUSAL_RESTORES.pop()
        if not dist.current_env().is_main:
            continue
        for name, text in files.items():
            path = run_dir / ".hydra" / name
            if path.parent.is_dir() and (not path.is_file() or path.read_text() != text):
                path.write_text(text)


def _plain(cfg: DictConfig | Mapping) -> dict[str, Any]:
    """A resolved plain-dict copy of the config (the one place a DictConfig is read)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    return dict(cfg)


def check_records_cover(step: int, run_logger: RunLogger, presentations: PresentationRecorder,
                        last_probe_step: int | None, *, presentations_on: bool) -> None:
    """On resume from a checkpoint of ``step``: the side files must hold the run up to it (every metrics row
    1..step, the probe evaluation of the checkpoint's last probe step, presentations up to the last checkpoint when
    recorded); otherwise the run would end "finished" with holes in its records, so it is refused."""
    problems = []
    steps = [int(row["step"]) for row in run_logger.history]
    if steps != list(range(1, step + 1)):
        problems.append(f"{record.METRICS_FILE} holds {len(set(steps) & set(range(1, step + 1)))} of the {step} "
                        f"steps up to it")
    if last_probe_step is not None and last_probe_step not in run_logger.probed_steps:
        problems.append(f"{record.PROBES_FILE} lacks the probe evaluation of step {last_probe_step}")
    if presentations.resume_problem:
        problems.append(presentations.resume_problem)
    elif presentations_on and presentations.covered_step() is None:
        problems.append(f"{record.PRESENTATIONS_FILE} is missing or empty")
    if problems:
        raise ValueError(f"resume from the checkpoint of step {step}: {'; '.join(problems)}. The run's records are "
                         f"incomplete: restore them, or start a fresh run directory (hydra.run.dir=<new dir>)")


def check_fresh_start(run_dir: Path, overwrite: bool, log: logging.Logger) -> None:
    """A fresh start in a directory whose records are of a run that ended (finished, failed or preempted) but whose
    checkpoints are gone would replace them: refused unless ``overwrite=true``. Records of an attempt that died
    before its first checkpoint (status running, or none: a kill, a lost node, a Slurm requeue) are of this same
    run: they are dropped and the run starts over, with a log line."""
    metrics = run_dir / record.METRICS_FILE
    summary_path = run_dir / record.SUMMARY_FILE
    if not ((metrics.is_file() and metrics.stat().st_size > 0) or summary_path.is_file()):
        return
    if overwrite:
        log.warning(f"overwrite=true: replacing the records of the earlier run in {run_dir}")
        return
    try:
        status = json.loads(summary_path.read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        status = None
    if status not in ("finished", "failed", "preempted"):
        log.warning("an earlier attempt ended before its first checkpoint: its rows are dropped and the run starts "
                    "over")
        return
    raise ValueError(f"{run_dir} holds the records of a run that ended (status {status}) but no checkpoint to "
                     f"continue from: starting fresh would replace them. Use another directory "
                     f"(hydra.run.dir=<new dir>), restore its checkpoints/, or pass overwrite=true to replace them")


def _finished_summary(run_dir: Path, step: int) -> dict[str, Any] | None:
    """summary.json of a run that finished at ``step`` (None if it did not, or the file is unreadable)."""
    try:
        summary = json.loads((run_dir / record.SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(summary, dict) and summary.get("status") == "finished" and summary.get("steps") == step:
        return summary
    return None


# ------------------------------------------------------------------------------------------------------ train
def train(cfg: DictConfig | Mapping, hooks: TrainHooks | None = None) -> dict[str, Any]:
    """Run (or continue) one training run and return its summary (the content of ``summary.json``).

    Args:
        cfg: the composed config of conf/train.yaml (``run_dir`` must resolve: Hydra sets it; tests pass a path).
        hooks: optional observation points (see :class:`TrainHooks`).

    Raises:
        checkpoint.Preempted: after a requested checkpoint (SystemExit with code 75).
        ValueError: a bad config value (the message names the key and the fix).
    """
    _HELD_LOCKS.clear()        # a requeued job's unpickled task may carry copies from before the requeue
    _REFUSAL_RESTORES.clear()
    try:
        return _train(cfg, hooks or TrainHooks())
    except RunDirBusy:
        restore_hydra_files()   # another run owns the directory: leave its files as they were
        raise
    except Exception as exc:
        restore_hydra_files()   # refused before it ran (a change, the data, the records): the run's own config
        _mark_failed(cfg, exc)
        raise
    finally:
        _REFUSAL_RESTORES.clear()
        ckpt.uninstall_preemption_handler()
        close_text_log()
        while _HELD_LOCKS:
            _HELD_LOCKS.pop().release()
        dist.cleanup()


def pretrain_corpus_follows_data(model_cfg: Mapping, data_cfg: Mapping) -> dict[str, Any]:
    """The model section, with the tiny target pretrained on the run's own corpus when that is a skills corpus.

    A target that never saw the skill tables could not predict them, so with ``data=synthetic`` and
    ``data.band_skills`` other than ``none`` the tiny target's ``pretrain_data`` becomes the run's synthetic
    config (same seed: same tables; same held-out share: the target never trains on the run's stratified
    held-out samples; the few the probe split adds to short bands, it may have seen).
    Every other run keeps ``model.pretrain_data`` as configured, hence the same cached target.
    """
    model_cfg = dict(model_cfg)
    if (model_cfg.get("kind", "tiny") == "tiny" and data_cfg.get("kind") == "synthetic"
            and data_cfg.get("band_skills", "none") != "none"):
        keys = ("kind", "num_samples", "seed", "min_length", "probe_fraction", "band_skills", "skill_bands")
        model_cfg["pretrain_data"] = {k: data_cfg[k] for k in keys if k in data_cfg}
    return model_cfg


def _train(cfg: DictConfig | Mapping, hooks: TrainHooks) -> dict[str, Any]:
    t_setup = time.perf_counter()
    # ---- 1. settings, process group, run directory, checkpoint -----------------------------------------------
    config = _plain(cfg)
    refuse_unknown_keys("top-level config", config, CONFIG_SECTIONS)
    trainer = TrainerSettings.from_dict(config.get("trainer") or {})
    probe_cfg = ProbeSettings.from_dict(config.get("probes") or {})
    wandb_settings = logger_settings(config.get("logger") or {})
    seed = as_int("seed", config.get("seed", 0), minimum=0)
    resume = as_bool("resume", config.get("resume", False))
    overwrite = as_bool("overwrite", config.get("overwrite", False))
    run_dir = Path(config["run_dir"])
    env = dist.setup(trainer.device, trainer.num_threads, trainer.dist_backend)
    device = torch.device(env.device)
    run_dir.mkdir(parents=True, exist_ok=True)
    if env.is_main:  # one writer per run directory, before anything of it is opened (dflash_lab/run_lock.py)
        _HELD_LOCKS.append(RunDirLock(run_dir).acquire())
    log = setup_text_log(run_dir, env.rank)
    stale = _HELD_LOCKS[-1].replaced if _HELD_LOCKS else None
    if stale:
        log.warning(f"run lock: took over a stale lock of {describe_holder(stale)} (that process is gone)")
    log.info(f"run dir {run_dir}; rank {env.rank}/{env.world_size} ({env.source}); device {device}")
    ckpt.clear_checkpoint_request()
    if trainer.preempt_signals:
        ckpt.install_preemption_handler(trainer.preempt_signals)
    checkpoints = ckpt.CheckpointManager(run_dir / record.CHECKPOINT_DIR, keep=trainer.keep_checkpoints)
    state = checkpoints.load_latest()
    hydra_files = read_hydra_files(run_dir)   # this launch's, as Hydra wrote them before the run started
    if state is not None and state.get("hydra_files"):
        _REFUSAL_RESTORES.append((run_dir, state["hydra_files"]))
    if resume and state is None:
        raise FileNotFoundError(f"resume=true but {checkpoints.directory} holds no checkpoint; pass the run's "
                                f"directory (hydra.run.dir=<old run dir>), or drop resume=true to start fresh")
    if state is None and env.is_main:
        check_fresh_start(run_dir, overwrite, log)
    changed = ckpt.check_resume_config(state["config"], config) if state else []

    # ---- 2. model, data, policy, loader ----------------------------------------------------------------------
    model, tokenizer = build_model(**pretrain_corpus_follows_data(config["model"], config["data"]),
                                   activation_checkpointing=trainer.activation_checkpointing is True)
    model.to(device)
    # probes need probes.per_band held-out samples in every band: the split tops up short bands
    train_ds, heldout_ds = build_dataset(tokenizer=tokenizer, **config["data"]).split(
        bands=probe_cfg.bands if probe_cfg.every > 0 else None, per_band=probe_cfg.per_band)
    data_digest = train_ds.content_digest
    if state is not None and state.get("data_digest") not in (None, data_digest):
        raise ValueError(f"the data changed since the checkpoint (content digest {state['data_digest']} then, "
                         f"{data_digest} now; data.* = {config['data']}): restore the data the run started with, "
                         f"or start a fresh run directory (hydra.run.dir=<new dir>)")
    sampler_cfg, memory, block_tokens = resolve_memory_plan(config, trainer, model, train_ds, device,
                                                            env.world_size, seed)
    log.info(f"memory plan: {memory.reason} (anchor rule {anchor_rule_name(model.anchor_density)})")
    policy = policy_from_config(sampler_cfg, train_ds.lengths, seed=seed, world_size=env.world_size, rank=env.rank,
                                block_tokens=block_tokens)
    longest = int(policy.lengths.max())
    if (probe_cfg.every or probe_cfg.presentations) and longest > probe_cfg.bands[-1]:
        raise ValueError(f"probes.bands={probe_cfg.bands} end at {probe_cfg.bands[-1]} but training samples reach "
                         f"{longest} tokens: extend probes.bands (e.g. append {longest})")
    loader = torch.utils.data.DataLoader(
        train_ds, batch_sampler=policy, num_workers=trainer.num_workers, pin_memory=device.type == "cuda",
        collate_fn=Collator(pad_id=tokenizer.pad_token_id, packed=policy.packed, effective_lengths=policy.lengths),
    )
    plan = plan_facts(policy, trainer.epochs, trainer.grad_accum, trainer.max_steps)
    if device.type == "cuda":  # a config that cannot fit stops here, naming the fix, not at step 1 with an OOM
        fit = footprint.preflight(
            footprint.StepModel.from_model(model), train_ds.lengths, sampler_cfg,
            footprint.Settings(precision=trainer.precision, activation_checkpointing=memory.activation_checkpointing,
                               world_size=env.world_size), gpu_mem_gb=gpu_memory_gb(config, trainer, device),
            seed=seed, block_tokens=block_tokens)
        log.info(f"preflight: predicted peak {fit['pred_peak_mem_gb']:.1f} GiB of {fit['budget_gb']:.1f} usable")
    if plan.dropped_overlong or plan.truncated:
        log.warning(f"sampler.overlong={config['sampler'].get('overlong')}: {plan.dropped_overlong} sample(s) dropped, "
                    f"{plan.truncated} truncated to fit sampler.max_tokens (summary.json 'samples')")

    # ---- 3. optimizer, schedule, DDP ---------------------------------------------------------------------------
    params = list(model.trainable_parameters())
    optimizer = torch.optim.AdamW(params, lr=trainer.lr, betas=trainer.betas, weight_decay=trainer.weight_decay)
    schedule = LRSchedule(trainer.lr, plan.end_step, trainer.warmup_frac, trainer.min_lr_ratio)
    train_model = dist.wrap_ddp(model, env)
    anchor_generator = torch.Generator(device="cpu")
    autocast = (torch.autocast(device_type="cuda", dtype=torch.bfloat16) if trainer.precision == "bf16"
                else contextlib.nullcontext())

    # ---- 4. resume -----------------------------------------------------------------------------------------------
    step, epoch, consumed, last_probe_step = 0, 0, 0, None
    totals = record.RunTotals()
    if state is not None:
        model.load_draft_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        for group in optimizer.param_groups:  # optimizer settings from the config (changed ones take effect)
            group.update(betas=trainer.betas, weight_decay=trainer.weight_decay)
        policy.load_state_dict(state["sampler"])
        ckpt.restore_rng_state(state["rng"], anchor_generator)
        step = int(state["step"])
        epoch, consumed = int(state["sampler"]["epoch"]), int(state["sampler"]["batches_consumed"])
        totals = record.RunTotals.from_state(state["extra"]["totals"])
        last_probe_step = state["extra"].get("last_probe_step")
        if changed:
            log.info(f"resume: {', '.join(changed)} changed since the checkpoint and take effect now; LR schedule "
                     f"{state['schedule']} -> {schedule.state_dict()}")
        if step > plan.end_step:
            raise ValueError(f"trainer.max_steps={trainer.max_steps} ends this run at step {plan.end_step}, but its "
                             f"checkpoint is at step {step}: raise trainer.max_steps to at least {step}, or start a "
                             f"fresh run directory (hydra.run.dir=<new dir>) to train fewer steps")
        finished = _finished_summary(run_dir, step) if step >= plan.end_step else None
        if finished is not None:
            log.info(f"run already finished at step {step}: nothing to do (summary.json unchanged)")
            return finished
    else:
        policy.set_epoch(0)
    loaded_step = step if state is not None else None
    totals.segments += 1
    ledger = record.TimeLedger(totals, start=t_setup)   # this segment's wall time counts from its first line

    run_id = load_or_create_run_id(run_dir, (state or {}).get("wandb_run_id")) if env.is_main else None
    if wandb_settings is not None:  # what a sweep's runs differ by, readable in W&B tables
        k = len(policy.boundaries) - 1 if policy.boundaries else None
        wandb_settings["tags"] = list(dict.fromkeys([*(wandb_settings.get("tags") or []), policy.name,
                                                     *([f"K{k}"] if k else []), f"seed{seed}"]))
        resolved = {"boundaries": str(policy.boundaries), "num_buckets": k,
                    "steps_per_epoch": plan.steps_per_epoch[0], "end_step": plan.end_step}
        wandb_config = {**config, "overrides": list(wandb_settings.get("overrides") or []), "resolved": resolved}
    run_logger = RunLogger(run_dir, is_main=env.is_main, resume_step=loaded_step, log=log, run_id=run_id,
                           wandb_settings=wandb_settings, config=wandb_config if wandb_settings else config)
    presentations = PresentationRecorder(run_dir / record.PRESENTATIONS_FILE, probe_cfg.bands)
    if env.is_main:
        dropped = presentations.resume(loaded_step)
        if dropped:
            log.info(f"resume: removed {dropped} presentation rows logged after step {loaded_step}")
        if loaded_step:
            check_records_cover(loaded_step, run_logger, presentations, last_probe_step,
                                presentations_on=probe_cfg.presentations)
        if probe_cfg.presentations:
            presentations.warm_up()
    probes = None
    if probe_cfg.every > 0:
        probes = ProbeSets(heldout_ds.lengths, probe_cfg.bands, probe_cfg.per_band, probe_cfg.seed,
                           probe_cfg.max_tokens)
        if probes.empty_bands:
            log.warning(f"probes: no held-out samples in band(s) {probes.empty_bands} of probes.bands={probes.bands}")
    evaluate_probe_batch = heldout_evaluator(model, heldout_ds, tokenizer.pad_token_id, device, autocast)
    model_cfg = config["model"]
    prompts = heldout_prompts(heldout_ds, num_prompts=int(model_cfg.get("decode_num_prompts", 16)),
                              max_prompt_tokens=int(model_cfg.get("decode_max_prompt_tokens", 128)))
    decode_new_tokens = int(model_cfg.get("decode_max_new_tokens", 64))
    identity = {"sampler": policy.name, "seed": seed, "epochs": trainer.epochs, "world_size": env.world_size,
                "boundaries": policy.boundaries, "anchor_rule": anchor_rule_name(model.anchor_density),
                "max_block_tokens": memory.max_block_tokens,
                "activation_checkpointing": memory.activation_checkpointing, "data_digest": data_digest}
    data_skipped = dict(train_ds.stats.get("skipped", {}))
    if any(data_skipped.values()):
        log.warning(f"data: skipped lines by reason {data_skipped} (summary.json 'data_skipped')")
    data_truncated = int(train_ds.stats.get("truncated", 0) or 0)   # whole dataset, cut to data.max_length
    if data_truncated:
        log.warning(f"data: {data_truncated} of {train_ds.stats.get('kept', '?')} samples were cut to "
                    f"data.max_length={config['data'].get('max_length')} tokens (summary.json 'data_truncated'); "
                    f"raise data.max_length to keep them whole")

    def run_probes(at_step: int) -> None:
        """Evaluate every probe band (rank 0) once per step number; time counted as overhead."""
        nonlocal last_probe_step
        if probes is None or at_step == last_probe_step:
            return
        last_probe_step = at_step
        if env.is_main:
            with ledger.evaluation("probe"):
                model.eval()
                run_logger.log_probes(probes.evaluate(evaluate_probe_batch, at_step, seed=probe_cfg.seed))
                model.train()

    def save_checkpoint() -> Path | None:
        """Collective (presentations are gathered from every rank); rank 0 writes."""
        with ledger.part("checkpoint"):
            return _save_checkpoint()

    def _save_checkpoint() -> Path | None:
        if probe_cfg.presentations:
            presentations.gather(dist.all_gather_objects)
        if not env.is_main:
            return None
        if probe_cfg.presentations:
            presentations.write()
        ledger.save()   # the checkpoint's totals hold the run's wall time up to this save
        keep_hydra_files(run_dir, hydra_files, log)
        return checkpoints.save({
            "model": model.draft_state_dict(), "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(), "sampler": policy.state_dict(batches_consumed=consumed),
            "rng": ckpt.capture_rng_state(anchor_generator), "step": step, "epoch": epoch, "config": config,
            "data_digest": data_digest, "hydra_files": hydra_files,
            "wandb_run_id": run_id,
            "extra": {"totals": totals.state_dict(), "last_probe_step": last_probe_step},
        }, step=step)

    def write_summary(status: str, **extra: Any) -> dict[str, Any]:
        summary = record.build_summary(run_logger.history, plan, totals, identity=identity, status=status,
                                       steps=step, steady_warmup_steps=trainer.steady_warmup_steps,
                                       extra={"data_skipped": data_skipped, "data_truncated": data_truncated,
                                              **extra}, times=ledger.split())
        run_logger.write_summary(summary)
        return summary

    # ---- 5. the loop -----------------------------------------------------------------------------------------------
    log.info(f"{policy.name}: {len(train_ds)} train / {len(heldout_ds)} held-out samples; steps per epoch "
             f"{list(plan.steps_per_epoch)}; running steps {step}..{plan.end_step} of {plan.total_steps}")
    ledger.add("setup", time.perf_counter() - t_setup)
    _REFUSAL_RESTORES.clear()   # this launch runs: its .hydra files are the run's from here on
    write_summary("running")
    model.train()
    if step == 0:
        run_probes(0)  # the start of every band's curve
    show_bar = env.is_main and trainer.progress and sys.stderr.isatty()
    pbar = tqdm(total=plan.end_step, initial=step, disable=not show_bar, desc=policy.name, dynamic_ncols=True,
                mininterval=1.0)
    status, failure = "running", ""
    consecutive_skips = 0
    ema_step_time = ema_ktok = None
    batch_iter = None
    t_step_start = time.perf_counter()

    while step < plan.end_step:
        # -- data: this step's micro-batches (sampler + dataset + collate time is overhead) --
        with ledger.part("data_wait"):
            if batch_iter is None:
                batch_iter = iter(loader)
            micro_batches = []
            while len(micro_batches) < trainer.grad_accum and consumed < plan.batches_per_epoch[epoch]:
                micro_batches.append(next(batch_iter))
                consumed += 1

        # -- forward / backward / optimizer (compute) --
        t_compute = time.perf_counter()
        device_sums = torch.zeros(5, dtype=torch.float64, device=device)  # ce, weight, correct, count, blocks
        doc_correct, doc_count, block_slots = [], [], 0
        for micro, batch in enumerate(micro_batches):
            batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
            anchor_generator.manual_seed(anchor_seed(seed, step, micro * env.world_size + env.rank))
            last_micro = micro == len(micro_batches) - 1
            # DDP all-reduces gradients on the last micro-batch only
            sync = train_model.no_sync() if env.distributed and not last_micro else contextlib.nullcontext()
            with sync:
                with autocast:
                    # the fixed-anchor pass scores each example where it is scored every time (presentations)
                    out = train_model(batch, anchor_generator, score_fixed=probe_cfg.presentations)
                if hooks.after_forward is not None:
                    out = hooks.after_forward(step + 1, micro, out)
                # global norm: backward the raw weighted CE sum and divide the gradients by the global weight
                # below; local norm: the mean over this rank's micro-batches (DDP then averages the ranks)
                objective = out.weighted_ce_sum if trainer.global_loss_norm else out.loss / len(micro_batches)
                objective.backward()
            device_sums += torch.stack([out.weighted_ce_sum.detach().double(), out.weight_sum.double(),
                                        out.correct.double(), out.count.double(), out.num_blocks.double()])
            block_slots += out.num_slots * model.block_size
            doc_correct.append(out.doc_correct)
            doc_count.append(out.doc_count)
        if trainer.global_loss_norm:
            # DDP averaged (1/W) x sum over ranks of d(CE sum): rescale to d(global CE sum / global weight)
            global_weight = dist.all_reduce_sum(device_sums[1].clone())
            scale = (env.world_size / global_weight.clamp_min(1e-12)).float()
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, trainer.grad_clip if trainer.grad_clip > 0 else math.inf)
        doc_lengths = [policy.lengths[b["sample_index"].cpu().numpy()] for b in micro_batches]
        stats = record.gather_step_stats({
            "ce_sum": device_sums[0], "weight_sum": device_sums[1], "correct": device_sums[2],
            "count": device_sums[3], "block_tokens": device_sums[4] * model.block_size,
            "block_slots": float(block_slots), "grad_norm": grad_norm,
            "stop_requested": float(ckpt.checkpoint_requested()),
            **record.local_batch_stats(doc_lengths, packed=policy.packed),
        }, dist.all_gather_rows, device)
        lr = schedule.lr(step)
        skipped_before = totals.skipped_steps
        if stats.finite:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        elif stats.weight_sum <= 0 and math.isfinite(stats.ce_sum):
            log.warning(f"step {step + 1}: no supervised block in the batch (weight sum 0); update skipped")
            totals.skipped_steps += 1
        elif trainer.skip_nonfinite:
            log.warning(f"step {step + 1}: non-finite loss/grad norm ({stats.loss}, {stats.grad_norm}); update "
                        f"skipped (trainer.skip_nonfinite=true)")
            totals.skipped_steps += 1
        consecutive_skips = consecutive_skips + 1 if totals.skipped_steps > skipped_before else 0
        if consecutive_skips >= trainer.max_consecutive_skips:
            status = "failed"
            failure = (f"{consecutive_skips} updates in a row skipped (steps {step + 2 - consecutive_skips}.."
                       f"{step + 1}; {totals.skipped_steps} in all): the run has diverged or its batches supervise "
                       f"nothing. The last good checkpoint is {checkpoints.latest_path()}; lower trainer.lr, check "
                       f"the data, or raise trainer.max_consecutive_skips")
            log.error(failure)
        elif not stats.finite and totals.skipped_steps == skipped_before:
            status = "failed"
            failure = (f"non-finite loss at step {step + 1} (loss={stats.loss}, grad_norm={stats.grad_norm}); "
                       f"stopping. The last good checkpoint is {checkpoints.latest_path()}; lower trainer.lr or set "
                       f"trainer.skip_nonfinite=true")
            log.error(failure)
        optimizer.zero_grad(set_to_none=True)
        compute_s = time.perf_counter() - t_compute
        if status == "failed":
            break
        step += 1
        ledger.add("compute", compute_s)

        # -- bookkeeping (overhead): presentations, epoch roll-over, the record row, probes, checkpoints --
        if probe_cfg.presentations:
            sample_index = np.concatenate([b["sample_index"].numpy() for b in micro_batches])
            presentations.record(sample_index, np.concatenate(doc_lengths), torch.cat(doc_correct).cpu().numpy(),
                                 torch.cat(doc_count).cpu().numpy(), epoch=epoch, step=step)
        step_epoch = epoch
        if consumed >= plan.batches_per_epoch[epoch]:
            epoch, consumed, batch_iter = epoch + 1, 0, None
            if epoch < trainer.epochs:
                policy.set_epoch(epoch)
        now = time.perf_counter()
        step_time, t_step_start = now - t_step_start, now
        ema_step_time = throughput.ema_update(ema_step_time, step_time)
        eta = throughput.eta_seconds(plan.end_step - step, ema_step_time)
        row = record.step_row(step=step, epoch=step_epoch, stats=stats, lr=lr, bucket=policy.bucket_of(
            micro_batches[0]["sample_index"].numpy()), step_time_s=step_time, compute_time_s=compute_s, eta_s=eta)
        ema_ktok = throughput.ema_update(ema_ktok, row["ktok_s"] or 0.0)
        run_logger.log_step(row)
        if env.is_main:
            pbar.update(1)
            pbar.set_postfix(loss=f"{stats.loss:.3f}", acc=f"{stats.acc:.3f}", ktok_s=f"{ema_ktok:.1f}",
                             pad_eff=f"{row['pad_eff']:.2f}", eta=throughput.format_eta(eta), refresh=False)
            if not show_bar and (step % trainer.log_every == 0 or step == plan.end_step):
                log.info(f"step {step}/{plan.end_step} epoch {step_epoch} loss {stats.loss:.4f} acc {stats.acc:.3f} "
                         f"{ema_ktok:.1f} Ktok/s pad_eff {row['pad_eff']:.2f} ETA {throughput.format_eta(eta)}")
        if hooks.after_step is not None:
            hooks.after_step(row)
        if probe_cfg.every and step % probe_cfg.every == 0:
            run_probes(step)
        if trainer.tau_every and step % trainer.tau_every == 0 and env.is_main and step < plan.end_step:
            with ledger.evaluation("tau"):
                model.eval()
                log.info(f"step {step}: tau {measure_acceptance(model, prompts, decode_new_tokens)['tau']:.3f}")
                model.train()
        if stats.stop_requested:
            path = save_checkpoint()
            log.warning(f"checkpoint requested ({ckpt.request_reason() or 'another rank'}): saved step {step} to "
                        f"{path}; exiting with code {ckpt.PREEMPTED_EXIT_CODE} for a requeue")
            write_summary("running")
            run_logger.close(exit_code=ckpt.PREEMPTED_EXIT_CODE)
            pbar.close()
            ckpt.run_previous_handler()  # e.g. submitit's requeue (it may exit here on rank 0)
            raise ckpt.Preempted(step, path)
        if trainer.ckpt_every and step % trainer.ckpt_every == 0 and step < plan.end_step:
            save_checkpoint()
        t_step_start = time.perf_counter()   # the next step's time starts after this one's evaluation and saves

    # ---- 6. end of run: final probes and checkpoint, tau, summary --------------------------------------------------
    pbar.close()
    if status != "failed":
        run_probes(step)
        if step != loaded_step:
            save_checkpoint()
    tau = tau_baseline = math.nan
    if status != "failed" and trainer.measure_tau and env.is_main:
        with ledger.evaluation("tau"):
            model.eval()
            measured = measure_acceptance(model, prompts, decode_new_tokens, should_stop=ckpt.checkpoint_requested)
            tau = float(measured["tau"])
            if measured["complete"]:  # the untrained draft (same initial weights), rebuilt and measured here
                baseline = measure_acceptance(model.baseline_model(), prompts, decode_new_tokens,
                                              should_stop=ckpt.checkpoint_requested)
                tau_baseline = float(baseline["tau"]) if baseline["complete"] else math.nan
        if ckpt.checkpoint_requested():
            status = "preempted"
    if status == "running":
        status = "finished"  # what was asked (all epochs, or up to trainer.max_steps) is done
    summary = write_summary(status, tau=tau, tau_baseline=tau_baseline,
                            error=failure or None)
    run_logger.close(exit_code={"failed": FAILED_EXIT_CODE, "preempted": ckpt.PREEMPTED_EXIT_CODE}.get(status, 0))
    log.info(f"{status}: step {step}/{plan.total_steps}, loss {summary['final_loss']:.4f}, acc "
             f"{summary['final_acc']:.4f}, {summary['ktok_s']:.2f} Ktok/s, pad_eff {summary['pad_eff']:.3f}, "
             f"overhead {summary['overhead_frac']:.1%}, evaluation {summary['eval_frac']:.1%} of "
             f"{summary['wall_time_s']:.0f} s, tau {tau:.3f} (untrained {tau_baseline:.3f})")
    if status == "preempted":
        log.warning(f"tau measurement interrupted ({ckpt.request_reason()}); exiting with code "
                    f"{ckpt.PREEMPTED_EXIT_CODE}: the requeued job measures it again")
        ckpt.run_previous_handler()
        raise ckpt.Preempted(step, checkpoints.latest_path())
    return summary


def _mark_failed(cfg: DictConfig | Mapping, exc: BaseException) -> None:
    """After a crash: rank 0 sets ``status: failed`` and the error in a running ``summary.json``."""
    try:
        path = Path(_plain(cfg)["run_dir"]) / record.SUMMARY_FILE
        if dist.current_env().is_main and path.is_file():
            summary = json.loads(path.read_text())
            if summary.get("status") != "running":  # not this run's summary (e.g. a refused resume)
                return
            summary.update(status="failed", error=f"{type(exc).__name__}: {exc}")
            write_json_atomic(path, summary)
    except Exception:  # noqa: BLE001 - never hide the original error behind a reporting error
        logging.getLogger("dflash_lab").exception("could not mark summary.json as failed")


@hydra.main(config_path="pkg://dflash_lab.conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """``python -m dflash_lab.train [overrides]``: run :func:`train`; exit 1 when the run failed."""
    name_wandb_run(cfg)
    try:
        summary = train(cfg)
    except RunDirBusy as exc:  # a refusal, not a crash: the one-line reason, no traceback
        print(f"dflash_lab.train: {exc}", file=sys.stderr)
        raise SystemExit(LOCKED_EXIT_CODE) from None
    except (ValueError, FileNotFoundError) as exc:  # a refused config, resume or dataset: the message names the fix
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"dflash_lab.train: error: {exc}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(REFUSED_EXIT_CODE) from None
    if summary["status"] == "failed":
        raise SystemExit(FAILED_EXIT_CODE)
    return summary.get("final_loss")


if __name__ == "__main__":
    main()
