"""Names of runs: the W&B name and group of a run from Hydra's runtime (what a sweep varies, which launch), and the
run folder tag of a sweep job (``hydra.sweep.subdir``: ``3_bucketed_b0-216-1024_s0``).

The folder tag is an OmegaConf resolver, ``${dflash_sweep_tag:}``, registered when this module is imported
(``dflash_lab/__init__.py`` imports it, so every entry point and every Slurm job that unpickles the task has it).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

WANDB_NAME_LIMIT = 96          # characters: W&B's run table shows about this much
TAG_PART_LIMIT = 40            # characters of one swept value in a run folder name
# Swept keys already in the run folder name (``<job#>_<sampler>..._s<seed>``) or written as one letter.
IN_FOLDER_NAME = {"sampler", "seed"}
SHORT_KEYS = {"sampler.boundaries": "b", "sampler.num_buckets": "K", "sampler.run_length": "run"}
PATH_KEYS = {"run_dir", "data.path", "model.target_path", "model.target_config", "data.chat_template"}
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def _short_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:6]


def cap(text: str, limit: int, joiner: str = "~") -> str:
    """``text`` when it fits in ``limit`` characters, else its head, ``joiner`` and a stable 6-hex hash of the whole
    (so two long names that share their head stay distinct).

    Example:
        >>> cap("abc", 5), cap("abcdefghijkl", 10), cap("abcdefghijkl", 10, joiner="-")
        ('abc', 'abc~eb4608', 'abc-eb4608')
    """
    return text if len(text) <= limit else f"{text[:limit - 7].rstrip(joiner)}{joiner}{_short_hash(text)}"


def is_path_override(override: str) -> bool:
    """True for overrides that name a file or directory (or configure Hydra itself): noise in a run name.

    Example:
        >>> [is_path_override(o) for o in ("data.path=/d/chat.jsonl", "hydra.run.dir=x", "seed=1", "x.cache_dir=c")]
        [True, True, False, True]
    """
    key, _, value = override.partition("=")
    key = key.lstrip("+~")
    return (key in PATH_KEYS or key.startswith("hydra.") or key.startswith("hydra/") or key.endswith("_dir")
            or key.endswith("_path") or "/" in value)


def short_run_name(overrides: list[str], limit: int = WANDB_NAME_LIMIT) -> str:
    """A readable run name from overrides: path-valued and Hydra overrides dropped, joined by commas, capped at
    ``limit`` characters with a stable hash suffix when cut ("" when nothing is left).

    Example:
        >>> short_run_name(["sampler=packed", "run_dir=/scratch/runs/a", "data.path=/d/c.jsonl", "seed=1"])
        'sampler=packed,seed=1'
    """
    return cap(",".join(o for o in overrides if not is_path_override(o)), limit)


def swept_keys(hydra_cfg: Any) -> set[str]:
    """The keys a multirun varies: its sweep overrides (``key=a,b``, ``choice(...)``, ``range(...)``) as given at
    launch (the sweep dir's ``multirun.yaml``) and the keys of ``hydra.sweeper.params`` (a sweep file's grid).

    Example:
        >>> swept_keys(OmegaConf.create({"sweep": {"dir": "/nonexistent"}, "sweeper": {"params": {"seed": "0,1"}}}))
        {'seed'}
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = {str(k).lstrip("+~") for k in (hydra_cfg.sweeper.get("params") or {})}
    launch_file = Path(hydra_cfg.sweep.dir) / "multirun.yaml"
    if launch_file.is_file():
        given = list(OmegaConf.load(launch_file).hydra.overrides.task)
        keys |= {o.key_or_group for o in OverridesParser.create().parse_overrides(given) if o.is_sweep_override()}
    return keys


def varied_keys(hydra_cfg: Any) -> set[str]:
    """The keys whose value differs between the jobs of a multirun: sweep overrides given at launch and the
    ``hydra.sweeper.params`` entries holding more than one value (a single-valued entry, ``sampler: bucketed``,
    is a setting, not an axis).

    Example:
        >>> varied_keys(OmegaConf.create({"sweep": {"dir": "/nonexistent"},
        ...                               "sweeper": {"params": {"seed": "0,1", "sampler": "bucketed"}}}))
        {'seed'}
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = hydra_cfg.sweeper.get("params") or {}
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    keys = {o.key_or_group for o in parsed if o.is_sweep_override()}
    launch_file = Path(hydra_cfg.sweep.dir) / "multirun.yaml"
    if launch_file.is_file():
        given = list(OmegaConf.load(launch_file).hydra.overrides.task)
        keys |= {o.key_or_group for o in OverridesParser.create().parse_overrides(given) if o.is_sweep_override()}
    return keys


def sweep_tag(hydra_cfg: Any) -> str:
    """``_<value>_<value>`` of what this multirun varies besides sampler and seed (already in the folder name),
    filesystem-safe: ``sampler.boundaries=[0,216,1024]`` -> ``b0-216-1024``, ``sampler.num_buckets=4`` -> ``K4``, a
    group (``+arm=aligned_bucketed``) -> its option, another key -> ``<last key part>-<value>``; each value capped at
    TAG_PART_LIMIT characters with a hash. "" outside a multirun or when only sampler/seed vary.

    Example:
        >>> job = OmegaConf.create({"mode": "MULTIRUN", "sweep": {"dir": "/nonexistent"}, "runtime": {"choices": {}},
        ...     "sweeper": {"params": {"sampler.boundaries": "[0,216,1024],[0,1024]", "seed": "0,1"}},
        ...     "overrides": {"task": ["sampler.boundaries=[0,216,1024]", "seed=1"]}})
        >>> sweep_tag(job)
        '_b0-216-1024'
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if str(hydra_cfg.get("mode")) not in ("MULTIRUN", "RunMode.MULTIRUN"):
        return ""
    varied = varied_keys(hydra_cfg) - IN_FOLDER_NAME
    groups = set((hydra_cfg.get("runtime") or {}).get("choices") or {})
    parts = []
    for override in OverridesParser.create().parse_overrides(list(hydra_cfg.overrides.task)):
        key = override.key_or_group
        if key not in varied:
            continue
        value = _UNSAFE.sub("-", override.input_line.partition("=")[2].replace(",", "-")).strip("-")
        if key in SHORT_KEYS:
            part = SHORT_KEYS[key] + value
        elif key in groups:
            part = value
        else:
            part = f"{key.rsplit('.', 1)[-1]}-{value}"
        parts.append(cap(part, TAG_PART_LIMIT, joiner="-"))
    return "".join(f"_{part}" for part in parts)


def _sweep_tag_resolver() -> str:
    from hydra.core.hydra_config import HydraConfig

    return sweep_tag(HydraConfig.get()) if HydraConfig.initialized() else ""


if not OmegaConf.has_resolver("dflash_sweep_tag"):
    OmegaConf.register_new_resolver("dflash_sweep_tag", _sweep_tag_resolver)


def name_wandb_run(cfg: DictConfig) -> None:
    """W&B run name and group from Hydra's runtime: the run's overrides (what a sweep varies) and its launch.

    name: ``logger.name`` if set, else the job's overrides of the swept keys in a multirun
    (``sampler.boundaries=[0,216,1024],seed=1``), else its overrides without the path-valued and Hydra ones
    (``run_dir``, ``data.path``, ``model.target_path``, ``hydra.*``: a name, not a record of the command), else the
    policy and seed; capped at WANDB_NAME_LIMIT characters with a stable hash when cut (:func:`short_run_name`).
    group: ``logger.group`` if set, else ``<experiment>/<launch directory>`` (one group per launch, so a re-run
    sweep never merges into an older one). The full override list stays in ``logger.overrides``.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    if cfg.get("logger", {}).get("kind") != "wandb" or not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    launch = hydra_cfg.sweep.dir if multirun else hydra_cfg.run.dir
    task = list(hydra_cfg.overrides.task)
    swept = swept_keys(hydra_cfg) if multirun else set()
    varied = [o.input_line for o in OverridesParser.create().parse_overrides(task) if o.key_or_group in swept]
    with open_dict(cfg):
        cfg.logger.name = (cfg.logger.name or short_run_name(varied) or short_run_name(task)
                           or f"{cfg.sampler.name}_s{cfg.seed}")
        cfg.logger.group = cfg.logger.group or f"{cfg.experiment}/{Path(launch).name}"
        cfg.logger.overrides = task  # what compare groups W&B runs by
