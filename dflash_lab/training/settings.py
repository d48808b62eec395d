"""The training run's settings, checked at the door: every section of the composed config becomes a typed object
(unknown keys, missing keys and badly typed values are refused with a message naming the key and the fix), and
nothing past :meth:`RunSettings.from_config` reads a DictConfig.

Each settings class declares its section (``SPEC``: one check per key; ``SECTION``: the spec and the preset that
gives every key), and a rule that reads two keys or the machine in its ``__post_init__``; :class:`RunSettings`
declares the whole config from them (the sections its builders check, the policy, data and model sections, pass as
given). The config is checked in one pass (``config_check.check_section``), each group once, where its settings
object is built.

One home per default: the values live in the YAML presets (conf/train.yaml, conf/trainer/*.yaml, conf/logger/*.yaml;
``dflash_lab.presets`` reads them for code that holds a section in part); the settings here declare each key's type
(a dataclass field with no default) and its one check (``SPEC``), never a value."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dflash_lab.config_check import (Kinds, Section, as_bool, as_choice, as_float, as_given, as_int,
                                     check_section)
from dflash_lab.training.probes import validate_bands


def _preset_gives(section: str, preset: str) -> str:
    """The fix for a missing key of a section that a preset gives whole."""
    return (f"{preset} gives every {section} key; compose the config, or complete the section with "
            f"dflash_lab.presets.preset({section!r}, ...)")


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


def _address(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or any(c.isspace() or c in ":/" for c in value.strip()):
        raise ValueError(f"{key}={value!r}: give a host name or IP address every node can reach, e.g. {key}=10.0.0.1 "
                         f"(no port: the port is MASTER_PORT), or null to take it from the job")
    return value.strip()


@dataclass
class TrainerSettings:
    """The ``trainer`` section (conf/trainer/cpu.yaml gives and explains every key; gpu.yaml changes some)."""

    device: str
    precision: str
    epochs: int
    max_steps: int | None
    grad_accum: int
    lr: float
    lr_scaling: str | None   # sqrt | linear: lr x (real tokens per step / full_random's) ** 0.5 | 1 (sampling.stats)
    min_lr_ratio: float
    warmup_frac: float
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float
    global_loss_norm: bool
    skip_nonfinite: bool
    max_consecutive_skips: int   # skipped updates in a row after which the run fails (a diverged run)
    activation_checkpointing: bool | str   # auto: on where the preflight says the step needs it
    gpu_mem_gb: float | None
    num_threads: int | None
    cpu_step_warn_s: float   # model=hf on a CPU: a predicted step above this is announced
    num_workers: int
    log_every: int
    log_every_s: float   # a progress line at least this often without a terminal (0: every log_every steps only)
    ckpt_every: int
    keep_checkpoints: int
    progress: bool
    steady_warmup_steps: int
    tau_every: int
    measure_tau: bool
    preempt_signals: list[str]
    dist_backend: str | None
    master_addr: str | None      # where the ranks meet (null: MASTER_ADDR, loopback on one node, the first NodeAddr)
    rendezvous_timeout_s: float  # every rank joins within this, or the run stops naming the rank (training.peers)
    peer_timeout_s: float        # a rank silent this long is lost: every rank stops, naming it

    SPEC = {
        "device": lambda k, v: v if isinstance(v, str) and (v == "cpu" or v.startswith("cuda"))
        else as_choice(k, v, ["cpu", "cuda"]),
        "precision": lambda k, v: as_choice(k, v, ["fp32", "bf16"]),
        "epochs": _int(1), "max_steps": _int(0, allow_none=True), "grad_accum": _int(1),
        "lr": _float(minimum=0.0),
        "lr_scaling": lambda k, v: None if v is None else as_choice(k, v, ["sqrt", "linear"]),
        "min_lr_ratio": _float(0.0, 1.0), "warmup_frac": _float(0.0, 0.999),
        "weight_decay": _float(minimum=0.0), "betas": _betas, "grad_clip": _float(minimum=0.0),
        "global_loss_norm": as_bool, "skip_nonfinite": as_bool, "max_consecutive_skips": _int(1),
        "activation_checkpointing": lambda k, v: v if v == "auto" else as_bool(k, v),
        "gpu_mem_gb": lambda k, v: as_float(k, v, minimum=1.0, allow_none=True),
        "num_threads": _int(1, allow_none=True), "cpu_step_warn_s": _float(minimum=0.0), "num_workers": _int(0),
        "log_every": _int(1), "log_every_s": _float(minimum=0.0),
        "ckpt_every": _int(0), "keep_checkpoints": _int(1), "progress": as_bool, "steady_warmup_steps": _int(0),
        "tau_every": _int(0), "measure_tau": as_bool, "preempt_signals": _signals,
        "dist_backend": lambda k, v: None if v is None else as_choice(k, v, ["gloo", "nccl"]),
        "master_addr": lambda k, v: _address(k, v),
        "rendezvous_timeout_s": _float(minimum=1.0), "peer_timeout_s": _float(minimum=2.0),
    }
    SECTION = Section(SPEC, missing=_preset_gives("trainer", "conf/trainer/cpu.yaml"))

    def __post_init__(self) -> None:
        if self.precision == "bf16" and not self.device.startswith("cuda"):
            raise ValueError("trainer.precision=bf16 is for GPUs; on CPU use trainer.precision=fp32 (or trainer=gpu)")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"trainer.device={self.device} but no CUDA device is visible; use trainer=cpu")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainerSettings:
        """Build from the config section; unknown keys and badly typed values are refused, naming the key."""
        return cls(**check_section("trainer", values, cls.SECTION))


@dataclass
class ProbeSettings:
    """The ``probes`` section of conf/train.yaml (which gives and explains every key)."""

    every: int
    warmup_evals: int        # extra evaluations evenly spaced inside the LR warmup (metrics.gradients)
    bands: list[int] | str   # auto: the built-in corpus's bands, else the data's length quantiles
    per_band: int
    seed: int
    max_tokens: int
    presentations: bool

    SPEC = {"every": _int(0), "warmup_evals": _int(0), "bands": lambda k, v: v if v == "auto" else validate_bands(v),
            "per_band": _int(1), "seed": _int(0), "max_tokens": _int(1), "presentations": as_bool}
    SECTION = Section(SPEC, missing=_preset_gives("probes", "conf/train.yaml"))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ProbeSettings:
        return cls(**check_section("probes", values, cls.SECTION))


# The logger section: its keys depend on its kind (conf/logger/none.yaml, wandb.yaml); main() adds logger.overrides.
WANDB_NAMES = ("project", "entity", "group", "job_type", "name", "tags", "overrides")
WANDB = Section({"kind": as_given, "mode": lambda k, v: as_choice(k, v, ["offline", "online", "disabled"]),
                 **dict.fromkeys(WANDB_NAMES, as_given)},
                missing="conf/logger/wandb.yaml gives it (logger=wandb)", optional=WANDB_NAMES)
LOGGER = Kinds({"none": Section({"kind": as_given}, missing="conf/logger/none.yaml gives every logger key"),
                "wandb": WANDB}, missing="choose a preset (logger=none | wandb)")
# The gpu section (conf/gpu/*.yaml): the memory the preflight plans for; the planner reads and checks the rest.
GPU = Section({"name": as_given, "memory_gb": lambda k, v: as_float(k, v, minimum=1.0, allow_none=True),
               "bf16_dense_tflops": as_given, "source": as_given},
              missing=_preset_gives("gpu", "conf/gpu/none.yaml"))


def plain_config(cfg: DictConfig | Mapping) -> dict[str, Any]:
    """A resolved plain-dict copy of the config (the one place a DictConfig is read)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    return dict(cfg)


@dataclass
class RunSettings:
    """Everything a run is told, checked: the typed sections, and the plain config (``config``) that the checkpoint
    and W&B record and the builders of the model, data and policy read (``config["model"]``, ...)."""

    config: dict[str, Any]
    trainer: TrainerSettings
    probes: ProbeSettings
    wandb: dict[str, Any] | None   # the W&B settings; None: no W&B
    gpu_preset_gb: float | None    # gpu.memory_gb: one GPU's memory by the gpu preset (None: gpu=none)
    seed: int
    resume: bool
    overwrite: bool
    run_dir: Path

    SECTION = Section({
        "sampler": as_given, "data": as_given, "model": as_given, "analysis": as_given, "experiment": as_given,
        "trainer": TrainerSettings.SECTION, "probes": ProbeSettings.SECTION, "logger": LOGGER, "gpu": GPU,
        "seed": _int(0), "target_seeds": _int(1), "resume": as_bool, "overwrite": as_bool, "run_dir": as_given,
    }, missing="conf/train.yaml gives every top-level key; compose it (python -m dflash_lab.train, or "
               "hydra.compose(config_name='train'))")

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping) -> RunSettings:
        """Check the composed config of conf/train.yaml (``run_dir`` must resolve: Hydra sets it; tests pass a
        path)."""
        config = plain_config(cfg)
        checked = check_section("", config, cls.SECTION)
        logger = checked["logger"]
        return cls(config=config, trainer=TrainerSettings(**checked["trainer"]),
                   probes=ProbeSettings(**checked["probes"]), wandb=logger if logger["kind"] == "wandb" else None,
                   gpu_preset_gb=checked["gpu"]["memory_gb"], seed=checked["seed"], resume=checked["resume"],
                   overwrite=checked["overwrite"], run_dir=Path(checked["run_dir"]))

    def gpu_memory_gb(self, device: torch.device) -> float | None:
        """Memory of one GPU for the memory plan: ``gpu.memory_gb`` (a preset), else ``trainer.gpu_mem_gb``, else
        the device's own total; None on CPU."""
        if self.gpu_preset_gb is not None:
            return self.gpu_preset_gb
        if self.trainer.gpu_mem_gb is not None:
            return self.trainer.gpu_mem_gb
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory / 2**30
        return None
