"""Names of runs: the W&B name and group of a run from Hydra's runtime (what a sweep varies, which launch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict


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


def name_wandb_run(cfg: DictConfig) -> None:
    """W&B run name and group from Hydra's runtime: the run's overrides (what a sweep varies) and its launch.

    name: ``logger.name`` if set, else the job's overrides of the swept keys in a multirun
    (``sampler.boundaries=[0,216,1024],seed=1``), else all its overrides (Hydra's ``override_dirname``), else the
    policy and seed; group: ``logger.group`` if set, else ``<experiment>/<launch directory>`` (one group per
    launch, so a re-run sweep never merges into an older one).
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
        cfg.logger.name = (cfg.logger.name or ",".join(varied) or hydra_cfg.job.override_dirname
                           or f"{cfg.sampler.name}_s{cfg.seed}")
        cfg.logger.group = cfg.logger.group or f"{cfg.experiment}/{Path(launch).name}"
        cfg.logger.overrides = task  # what compare groups W&B runs by
