"""Pre-submission checks for multirun sweeps: catch a bad launcher config or sweep value before any job exists.

A sweep on Slurm fails slowly: jobs wait in the queue, start, and only then does a bad value surface, once per
job. :class:`ValidateLaunch` is a Hydra callback, registered by ``conf/hydra/launcher/{slurm,local}.yaml`` and
by the ``sweeps/*.yaml`` files, whose ``on_multirun_start`` runs in the submitting process after the config is
composed and before the sweeper hands anything to the launcher. It checks:

* the launcher (``hydra.launcher.*``, submitit slurm or local):
  ``tasks_per_node`` must not exceed ``gpus_per_node`` when GPUs are requested (one rank drives one GPU;
  ``gpus_per_node=0`` with several tasks is a valid CPU run, which is how CI tests DDP), positive counts,
  a ``signal_delay_s`` shorter than the job's time limit, and (Slurm) that a named ``partition`` exists
  (``sinfo -h -a -o %P``; no partition named means the cluster default);
* every job of the sweep, composed exactly as the job will compose it (same overrides as Hydra's
  ``BasicSweeper`` expands them): ``sampler.boundaries`` must be a valid boundary list (strictly increasing
  integers starting at 0, or a preset name), and ``sampler.num_buckets`` a positive integer that does not
  contradict an explicit list.

Every problem is reported at once, each naming the key, the offending value and the fix, in a
:class:`LaunchConfigError`; Hydra prints it and exits non-zero, and nothing is submitted.

Example (what a user sees)::

    $ python -m dflash_lab.train -m hydra/launcher=slurm hydra.launcher.tasks_per_node=16
    dflash_lab.launch.LaunchConfigError: launch config rejected before submission (1 problem):
      - hydra.launcher.tasks_per_node=16 exceeds hydra.launcher.gpus_per_node=8: ...
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

# Boundary presets accepted by ``sampler.boundaries`` (see dflash_lab/sampling/bucketed.py).
_BOUNDARY_PRESETS = ("seed", "cpu")


class LaunchConfigError(ValueError):
    """A launcher setting or sweep value that would fail (or silently misbehave) once submitted."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        count = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"launch config rejected before submission ({count} problem{'s' if count != 1 else ''}); "
            f"nothing was submitted:\n{lines}"
        )


# ----------------------------------------------------------------------------------------------- launcher checks


def launcher_kind(launcher_cfg: Any) -> str | None:
    """``"slurm"``, ``"local"`` (submitit executors) or None for any other launcher (e.g. Hydra's basic one)."""
    target = str(_get(launcher_cfg, "_target_") or "")
    if target.endswith("SlurmLauncher"):
        return "slurm"
    if target.endswith("LocalLauncher"):
        return "local"
    return None


def slurm_partitions(timeout_s: float = 30.0) -> list[str]:
    """Partition names of the reachable Slurm cluster (``sinfo -h -a -o %P``, default marker ``*`` removed).

    Raises:
        LaunchConfigError: sinfo is not installed or the controller does not answer.
    """
    if shutil.which("sinfo") is None:
        raise LaunchConfigError([
            "hydra/launcher=slurm but `sinfo` is not installed here, so the partition cannot be checked and jobs "
            "cannot be submitted. Fix: run from a Slurm login node, start the local test cluster with "
            "scripts/slurm_up.sh, or use hydra/launcher=local"
        ])
    try:
        out = subprocess.run(["sinfo", "-h", "-a", "-o", "%P"], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out = None
    if out is None or out.returncode != 0:
        detail = "timed out" if out is None else (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise LaunchConfigError([
            f"hydra/launcher=slurm but the Slurm controller does not answer (`sinfo -h -a -o %P`: {detail}). "
            "Fix: check `sinfo` works on this machine (start the local test cluster with scripts/slurm_up.sh), "
            "or use hydra/launcher=local"
        ])
    return sorted({line.strip().rstrip("*") for line in out.stdout.splitlines() if line.strip()})


def check_launcher(launcher_cfg: Any, partitions: Sequence[str] | None = None) -> list[str]:
    """Problems with a submitit launcher config (empty list when it is fine).

    Args:
        launcher_cfg: ``cfg.hydra.launcher`` (DictConfig or dict).
        partitions: the cluster's partitions; queried with :func:`slurm_partitions` when needed and not given.

    Returns:
        One message per problem, each naming the key and the fix.

    Example:
        >>> check_launcher({"_target_": "x.LocalLauncher", "gpus_per_node": 8, "tasks_per_node": 16, "nodes": 1})
        ... # doctest: +ELLIPSIS
        ['hydra.launcher.tasks_per_node=16 exceeds hydra.launcher.gpus_per_node=8: ...']
    """
    kind = launcher_kind(launcher_cfg)
    if kind is None:
        return []
    problems: list[str] = []
    key = "hydra.launcher."

    def as_int(name: str, default: int | None = None) -> int | None:
        value = _get(launcher_cfg, name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{key}{name}={value!r} must be an integer. Fix: e.g. {key}{name}=1")
            return None
        return value

    nodes = as_int("nodes", 1)
    tasks = as_int("tasks_per_node", 1)
    gpus = as_int("gpus_per_node")
    cpus = as_int("cpus_per_task")
    timeout_min = as_int("timeout_min")

    if nodes is not None and nodes < 1:
        problems.append(f"{key}nodes={nodes}: a job needs at least one node. Fix: {key}nodes=1")
    if kind == "local" and nodes is not None and nodes > 1:
        problems.append(
            f"{key}nodes={nodes}: hydra/launcher=local runs on this machine only. "
            f"Fix: {key}nodes=1, or hydra/launcher=slurm for several nodes"
        )
    if gpus is not None and gpus < 0:
        problems.append(f"{key}gpus_per_node={gpus} is negative. Fix: {key}gpus_per_node=0 for a CPU run")
    if tasks is not None and tasks < 1:
        fix = (
            f"{key}tasks_per_node=N (with {key}gpus_per_node=0 the task count no longer follows the GPU count; "
            f"CPU DDP on one machine: {key}tasks_per_node=2)"
            if gpus == 0
            else f"{key}tasks_per_node=1 or more"
        )
        problems.append(f"{key}tasks_per_node={tasks}: every job needs at least one task (one rank). Fix: {fix}")
    if tasks is not None and gpus is not None and gpus > 0 and tasks > gpus:
        problems.append(
            f"{key}tasks_per_node={tasks} exceeds {key}gpus_per_node={gpus}: each task is one rank that drives one "
            f"GPU, so {tasks - gpus} rank(s) per node would have no GPU. Fix: {key}tasks_per_node={gpus} "
            f"(or raise {key}gpus_per_node), or {key}gpus_per_node=0 for a CPU run with {tasks} tasks"
        )
    if cpus is not None and cpus < 1:
        problems.append(f"{key}cpus_per_task={cpus}: must be at least 1. Fix: {key}cpus_per_task=1, or null")
    mem_gb = _get(launcher_cfg, "mem_gb")
    if mem_gb is not None and (isinstance(mem_gb, bool) or not isinstance(mem_gb, (int, float)) or mem_gb <= 0):
        problems.append(f"{key}mem_gb={mem_gb!r}: must be a positive number of GB, or null for the cluster default")
    if timeout_min is not None and timeout_min < 1:
        problems.append(f"{key}timeout_min={timeout_min}: must be at least 1 minute. Fix: e.g. {key}timeout_min=60")

    if kind == "slurm":
        delay = _get(launcher_cfg, "signal_delay_s")
        if isinstance(delay, int) and timeout_min is not None and timeout_min >= 1 and delay >= timeout_min * 60:
            problems.append(
                f"{key}signal_delay_s={delay} is not shorter than {key}timeout_min={timeout_min} "
                f"({timeout_min * 60} s): the checkpoint-and-requeue signal would arrive as soon as the job starts. "
                f"Fix: lower {key}signal_delay_s (e.g. 120) or raise {key}timeout_min"
            )
        max_num_timeout = _get(launcher_cfg, "max_num_timeout")
        if isinstance(max_num_timeout, int) and max_num_timeout < 0:
            problems.append(f"{key}max_num_timeout={max_num_timeout}: must be >= 0 (requeues after a timeout)")
        partition = _get(launcher_cfg, "partition")
        if partition not in (None, ""):
            known = list(partitions) if partitions is not None else slurm_partitions()
            for name in str(partition).split(","):
                if name.strip() not in known:
                    problems.append(
                        f"{key}partition={partition!r}: partition {name.strip()!r} does not exist on this cluster "
                        f"(sinfo lists: {', '.join(known) or 'none'}). Fix: {key}partition=<one of those>, or "
                        f"{key}partition=null for the cluster's default partition"
                    )
        elif partitions is None:
            slurm_partitions()  # fail early, with a clear message, when Slurm itself is unreachable
    return problems


# ---------------------------------------------------------------------------------------------- sweep value checks


def check_sampler(sampler_cfg: Any, where: str = "") -> list[str]:
    """Problems with a composed ``sampler`` group's boundary settings (empty list when fine).

    Args:
        sampler_cfg: ``cfg.sampler`` of one job.
        where: prefix that says which job (``"job #3 (sampler.boundaries=[0,5,3]): "``).

    Returns:
        One message per problem, naming the key and the fix.

    Example:
        >>> check_sampler({"name": "bucketed", "boundaries": [0, 152, 96]})  # doctest: +ELLIPSIS
        ['sampler.boundaries=[0, 152, 96] is not a valid boundary list (unsorted entries 152 and 96; ...']
    """
    if sampler_cfg is None or "boundaries" not in sampler_cfg:
        return []  # policies without buckets have nothing to check here
    boundaries = _get(sampler_cfg, "boundaries")
    num_buckets = _get(sampler_cfg, "num_buckets")
    problems: list[str] = []
    fix = (
        "Fix: give strictly increasing integer token lengths starting at 0, e.g. "
        "sampler.boundaries=[0,96,152,216,304,412,1024] (quote the whole override in the shell), a preset "
        f"({' or '.join(_BOUNDARY_PRESETS)}), or sampler.boundaries=null sampler.num_buckets=K to fit K buckets"
    )
    bad_count = isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 1
    if num_buckets is not None and bad_count:
        problems.append(
            f"{where}sampler.num_buckets={num_buckets!r} must be a positive integer (K buckets to fit). "
            f"Fix: e.g. sampler.num_buckets=6, or null to use sampler.boundaries"
        )
        if boundaries is None:
            return problems
        num_buckets = None
    if boundaries is None:
        if num_buckets is None:
            problems.append(
                f"{where}sampler.boundaries=null and sampler.num_buckets=null: "
                f"{sampler_cfg.get('name', 'the sampler')} needs one of them. {fix}"
            )
        return problems
    if isinstance(boundaries, str):
        if boundaries not in _BOUNDARY_PRESETS:
            problems.append(f"{where}sampler.boundaries={boundaries!r} is neither a list nor a preset name. {fix}")
        return problems
    from dflash_lab.sampling import validate_boundaries  # the same check the sampler applies at build time

    try:
        values = validate_boundaries(list(boundaries) if _is_sequence(boundaries) else boundaries)
    except ValueError as exc:
        shown = list(boundaries) if _is_sequence(boundaries) else boundaries
        reason = str(exc)
        if reason.startswith("sampler.boundaries=") and ": " in reason:
            reason = reason.split(": ", 1)[1]  # the value is already shown in front
        problems.append(f"{where}sampler.boundaries={shown} is not a valid boundary list ({reason}). {fix}")
        return problems
    if num_buckets is not None and num_buckets != len(values) - 1:
        problems.append(
            f"{where}sampler.num_buckets={num_buckets} contradicts sampler.boundaries={values} "
            f"({len(values) - 1} buckets). Fix: add sampler.boundaries=null to fit {num_buckets} buckets, "
            f"or sampler.num_buckets=null to use the list"
        )
    return problems


def expand_sweep(config: DictConfig) -> list[list[str]]:
    """The per-job override lists Hydra's BasicSweeper will launch for this multirun config.

    Combines ``hydra.sweeper.params`` (sweep files) with the command-line task overrides, exactly as
    ``BasicSweeper.sweep`` does. Other sweepers (Optuna, ...) choose values at run time: one empty list is
    returned and only the base config is checked.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper_target = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    if not sweeper_target.endswith("BasicSweeper"):
        return [[]]
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None)
    params = OmegaConf.to_container(params, resolve=False) if params is not None else {}
    arguments = [f"{k}={v}" for k, v in params.items()]
    arguments += list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
    overrides = OverridesParser.create().parse_overrides(arguments)
    batches = BasicSweeper.split_arguments(overrides, max_batch_size=None)
    return [job for batch in batches for job in batch]


def check_sweep(config: DictConfig) -> list[str]:
    """Compose every job of the sweep like the job itself will and check its sampler settings."""
    from hydra.core.global_hydra import GlobalHydra

    jobs = expand_sweep(config)
    if not GlobalHydra.instance().is_initialized() or jobs == [[]]:
        return check_sampler(OmegaConf.select(config, "sampler"))
    loader = GlobalHydra.instance().config_loader()
    problems: list[str] = []
    for num, overrides in enumerate(jobs):
        swept = " ".join(o for o in overrides if not o.startswith("hydra"))
        where = f"job #{num} ({swept}): " if len(jobs) > 1 else ""
        try:
            job_cfg = loader.load_sweep_config(config, list(overrides))
        except Exception as exc:  # composition errors are reported by Hydra too, but without the job number
            problems.append(f"{where}the job's config does not compose: {exc}")
            continue
        problems += check_sampler(OmegaConf.select(job_cfg, "sampler"), where)
    return problems


def validate_multirun(config: DictConfig, partitions: Sequence[str] | None = None) -> None:
    """Run every pre-submission check on a composed multirun config.

    Args:
        config: the config Hydra passes to ``on_multirun_start`` (with its ``hydra`` node).
        partitions: override the partition list (tests); default: ask ``sinfo`` when a partition is named.

    Raises:
        LaunchConfigError: listing every problem found.
    """
    problems = check_launcher(config.hydra.launcher, partitions)
    problems += check_sweep(config)
    if problems:
        raise LaunchConfigError(problems)


class ValidateLaunch(Callback):
    """Hydra callback: :func:`validate_multirun` before a multirun submits anything.

    Registered in config (``hydra.callbacks.validate_launch._target_: dflash_lab.launch.ValidateLaunch``) by the
    launcher configs and the sweep files.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            validate_multirun(config)
        except LaunchConfigError as exc:
            # Hydra turns an Exception raised by a callback into a warning and carries on submitting, so stop
            # with SystemExit (a BaseException it lets through): the message goes to stderr, the exit code is 1.
            raise SystemExit(f"Error: {exc}") from exc
        kind = launcher_kind(config.hydra.launcher)
        if kind is not None:
            launcher = config.hydra.launcher
            log.info(
                "launch checks passed: submitit %s, %s node(s) x %s task(s), gpus_per_node=%s",
                kind, _get(launcher, "nodes", 1), _get(launcher, "tasks_per_node", 1), _get(launcher, "gpus_per_node"),
            )

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Without -m Hydra runs the app in this process and never calls the launcher: say so, since the
        # user evidently expected a cluster job.
        if launcher_kind(OmegaConf.select(config, "hydra.launcher")) is not None:
            log.warning(
                "hydra/launcher=%s is only used by multirun: add -m to submit; running here, in this process",
                launcher_kind(config.hydra.launcher),
            )


# --------------------------------------------------------------------------------------------------------- helpers


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` for a DictConfig or dict, resolving interpolations; `default` when absent or None."""
    if cfg is None:
        return default
    if isinstance(cfg, DictConfig):
        value = OmegaConf.select(cfg, key, default=default)
    else:
        value = cfg.get(key, default)
    return default if value is None else value


def _is_sequence(value: Any) -> bool:
    return OmegaConf.is_list(value) or isinstance(value, (list, tuple))
