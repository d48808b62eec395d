"""Pre-submission checks for multirun sweeps: catch a bad launcher config or sweep value before any job exists.

A sweep on Slurm fails slowly: jobs wait in the queue, start, and only then does a bad value surface, once per
job. :class:`ValidateLaunch` is a Hydra callback, registered by ``conf/hydra/launcher/{slurm,local}.yaml`` and
by the ``sweeps/*.yaml`` files, whose ``on_multirun_start`` runs in the submitting process after the config is
composed and before the sweeper hands anything to the launcher. It checks:

* the launcher (``hydra.launcher.*``, submitit slurm or local):
  ``tasks_per_node`` must not exceed ``gpus_per_node`` when GPUs are requested (one rank drives one GPU;
  ``gpus_per_node=0`` with several tasks is a valid CPU run, which is how CI tests DDP), positive counts,
  a ``signal_delay_s`` shorter than the job's time limit, and (Slurm) that a named ``partition`` exists and that
  its nodes can hold the request per node (CPUs = ``tasks_per_node`` x ``cpus_per_task``, ``mem_gb``,
  ``gpus_per_node``; ``sinfo -N``, the default partition when none is named): Slurm would otherwise leave the job
  PENDING forever while the launcher waits;
* every job of the sweep, composed exactly as the job will compose it (same overrides as Hydra's
  ``BasicSweeper`` expands them): ``sampler.boundaries`` must be a valid boundary list (strictly increasing
  integers starting at 0, or a preset name), and ``sampler.num_buckets`` a positive integer that does not
  contradict an explicit list.

Every problem is reported at once, each naming the key, the offending value and the fix, in a
:class:`LaunchConfigError`; Hydra prints it and exits non-zero, and nothing is submitted.

After submission (Slurm), :class:`QueueWatch` polls ``squeue`` while the launcher waits for results: a job that
leaves the queue without writing its results (cancelled, failed before start, killed) ends the wait with an
error naming the job, its last state and its log, instead of a wait that never ends (submitit learns job states
from ``sacct``, which clusters without accounting storage do not answer).

Example (what a user sees)::

    $ python -m dflash_lab.train -m hydra/launcher=slurm hydra.launcher.tasks_per_node=16
    dflash_lab.cluster.launch.LaunchConfigError: launch config rejected before submission (1 problem):
      - hydra.launcher.tasks_per_node=16 exceeds hydra.launcher.gpus_per_node=8: ...
"""

from __future__ import annotations

import _thread
import logging
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

# Boundary presets accepted by ``sampler.boundaries`` (see dflash_lab/sampling/bucketed.py).
_BOUNDARY_PRESETS = ("auto", "seed", "cpu")   # auto: resolved with the data (sampling.resolve_auto_boundaries)


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


@dataclass(frozen=True)
class SlurmNode:
    """One node of one partition, as ``sinfo -N`` lists it (a node in two partitions appears twice)."""

    name: str
    partition: str
    default: bool      # the partition is the cluster's default (``*`` in sinfo)
    cpus: int
    mem_mb: int        # RealMemory, MB (Slurm's "GB" is 1024 MB)
    gpus: int          # GPUs in the node's generic resources


def parse_sinfo_nodes(text: str) -> list[SlurmNode]:
    """Nodes from ``sinfo -h -N -a -o %N|%P|%c|%m|%G`` output.

    Example:
        >>> parse_sinfo_nodes("n1|gpu*|64|512000|gpu:a100:4(S:0-1),gpu:h100:2\\nn2|debug|2|20000|(null)")
        ... # doctest: +NORMALIZE_WHITESPACE
        [SlurmNode(name='n1', partition='gpu', default=True, cpus=64, mem_mb=512000, gpus=6),
         SlurmNode(name='n2', partition='debug', default=False, cpus=2, mem_mb=20000, gpus=0)]
    """
    nodes = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, partition, cpus, mem, gres = fields
        gpus = sum(int(count) for count in re.findall(r"gpu(?::[^:,()]+)?:(\d+)", gres))
        nodes.append(SlurmNode(name, partition.rstrip("*"), partition.endswith("*"), int(cpus.rstrip("+")),
                               int(mem.rstrip("+")), gpus))
    return nodes


def slurm_nodes(timeout_s: float = 30.0) -> list[SlurmNode]:
    """Every node of every partition of the reachable Slurm cluster (``sinfo -N``).

    Raises:
        LaunchConfigError: sinfo is not installed or the controller does not answer.
    """
    slurm_partitions(timeout_s)  # the same clear errors when Slurm is missing or down
    out = subprocess.run(["sinfo", "-h", "-N", "-a", "-o", "%N|%P|%c|%m|%G"], capture_output=True, text=True,
                         timeout=timeout_s)
    return parse_sinfo_nodes(out.stdout) if out.returncode == 0 else []


KEY = "hydra.launcher."


@dataclass(frozen=True)
class NodeRequest:
    """What a job asks of each node: ``tasks_per_node x cpus_per_task`` CPUs (Slurm's default: 1 per task),
    ``gpus_per_node`` GPUs, ``mem_gb`` (None: the partition's default), on ``nodes`` nodes."""

    tasks: int
    cpus_per_task: int
    gpus: int
    nodes: int
    mem_gb: float | None

    @classmethod
    def of(cls, launcher_cfg: Any) -> NodeRequest:
        mem_gb = _get(launcher_cfg, "mem_gb")
        return cls(tasks=int(_get(launcher_cfg, "tasks_per_node", 1)),
                   cpus_per_task=int(_get(launcher_cfg, "cpus_per_task", 1)),
                   gpus=int(_get(launcher_cfg, "gpus_per_node", 0)), nodes=int(_get(launcher_cfg, "nodes", 1)),
                   mem_gb=None if mem_gb is None else float(mem_gb))

    @property
    def cpus(self) -> int:
        return self.tasks * self.cpus_per_task

    @property
    def mem_mb(self) -> float | None:
        return None if self.mem_gb is None else self.mem_gb * 1024

    def fits(self, node: SlurmNode) -> bool:
        return node.cpus >= self.cpus and node.gpus >= self.gpus and (self.mem_mb is None or node.mem_mb >= self.mem_mb)


def _have(values: list, unit: str = "") -> str:
    most = max(values)
    return f"{'' if min(values) == most else 'at most '}{most:g}{unit}"


def _cpu_problem(want: NodeRequest, partition: str, members: list[SlurmNode], nodes) -> str | None:
    cpus = [n.cpus for n in members]
    if max(cpus) >= want.cpus:
        return None
    fix = (f"set {KEY}cpus_per_task={max(cpus) // want.tasks}" if max(cpus) >= want.tasks
           else f"set {KEY}tasks_per_node={max(cpus)} {KEY}cpus_per_task=1")
    return (f"{KEY}tasks_per_node={want.tasks} x {KEY}cpus_per_task={want.cpus_per_task} asks {want.cpus} CPUs per "
            f"node; nodes in partition {partition} have {_have(cpus)}: {fix} (or choose a partition with bigger "
            f"nodes: {KEY}partition=...)")


def _gpu_problem(want: NodeRequest, partition: str, members: list[SlurmNode], nodes) -> str | None:
    gpus = [n.gpus for n in members]
    if max(gpus) >= want.gpus:
        return None
    with_gpus = sorted({n.partition for n in nodes if n.gpus >= want.gpus})
    fix = (f"{KEY}gpus_per_node=0 {KEY}tasks_per_node=N for a CPU run" if max(gpus) == 0
           else f"{KEY}gpus_per_node={max(gpus)}")
    return (f"{KEY}gpus_per_node={want.gpus} asks {want.gpus} GPUs per node; nodes in partition {partition} have "
            f"{_have(gpus)}: set {fix}" + (f", or {KEY}partition={with_gpus[0]} (has such nodes)" if with_gpus else ""))


def _memory_problem(want: NodeRequest, partition: str, members: list[SlurmNode], nodes) -> str | None:
    mems = [n.mem_mb / 1024 for n in members]
    if want.mem_mb is None or max(mems) * 1024 >= want.mem_mb:
        return None
    return (f"{KEY}mem_gb={want.mem_gb:g} asks {want.mem_gb:g} GB per node; nodes in partition {partition} have "
            f"{_have([round(m, 1) for m in mems], ' GB')}: set {KEY}mem_gb={int(max(mems))} or less (or "
            f"{KEY}mem_gb=null for the partition's default)")


def _together_problem(want: NodeRequest, partition: str, members: list[SlurmNode], nodes) -> str | None:
    """Each resource fits some node, but not enough nodes hold all of them together."""
    if any(check(want, partition, members, nodes) for check in (_cpu_problem, _gpu_problem, _memory_problem)):
        return None
    fitting = sum(map(want.fits, members))
    asked = f"{want.cpus} CPUs and {want.gpus} GPUs" + (f" and {want.mem_gb:g} GB" if want.mem_mb else "")
    if fitting:
        return (f"{KEY}nodes={want.nodes} asks {want.nodes} nodes with {asked} each; partition {partition} has "
                f"{fitting} such node(s): set {KEY}nodes={fitting}")
    return (f"the job asks {asked} on one node; no node of partition {partition} has all of them: lower "
            f"{KEY}cpus_per_task, {KEY}gpus_per_node or {KEY}mem_gb")


# one check per resource, in the order the messages are reported
NODE_CHECKS = (_cpu_problem, _gpu_problem, _memory_problem, _together_problem)


def check_node_resources(launcher_cfg: Any, nodes: Sequence[SlurmNode]) -> list[str]:
    """Problems when no partition the job may use has enough nodes that hold its per-node request
    (:class:`NodeRequest`); it may use the named partitions (comma-separated), else the default one. Each partition
    is checked by :data:`NODE_CHECKS`.

    Example:
        >>> (problem,) = check_node_resources({"tasks_per_node": 2, "cpus_per_task": 8, "gpus_per_node": 0},
        ...                                   [SlurmNode("n1", "debug", True, 2, 20000, 0)])
        >>> print(problem)  # doctest: +ELLIPSIS
        hydra.launcher.tasks_per_node=2 x hydra.launcher.cpus_per_task=8 asks 16 CPUs per node; nodes in
        partition debug have 2: set hydra.launcher.cpus_per_task=1 (or choose a partition with bigger nodes: ...)
    """
    want = NodeRequest.of(launcher_cfg)
    named = _get(launcher_cfg, "partition")
    if named:
        allowed = [p.strip() for p in str(named).split(",")]
    else:
        allowed = sorted({n.partition for n in nodes if n.default}) or sorted({n.partition for n in nodes})
    by_partition = {p: [n for n in nodes if n.partition == p] for p in allowed}
    by_partition = {p: members for p, members in by_partition.items() if members}  # unknown: reported elsewhere
    if not by_partition or any(sum(map(want.fits, members)) >= want.nodes for members in by_partition.values()):
        return []
    return [problem for partition, members in by_partition.items() for check in NODE_CHECKS
            if (problem := check(want, partition, members, nodes))]


@dataclass(frozen=True)
class LauncherValues:
    """The launcher keys the checks read (None: absent, or not an integer where one is needed)."""

    kind: str
    nodes: int | None
    tasks: int | None
    gpus: int | None
    cpus: int | None
    timeout_min: int | None
    mem_gb: Any
    signal_delay_s: Any
    max_num_timeout: Any


def _tasks_fix(v: LauncherValues) -> str:
    if v.gpus == 0:
        return (f"{KEY}tasks_per_node=N (with {KEY}gpus_per_node=0 the task count no longer follows the GPU count; "
                f"CPU DDP on one machine: {KEY}tasks_per_node=2)")
    return f"{KEY}tasks_per_node=1 or more"


def _positive(x) -> bool:
    return x is not None and x >= 1


# (applies, message): each rule reads the checked values, in the order the problems are reported
LAUNCHER_RULES = (
    (lambda v: v.nodes is not None and v.nodes < 1,
     lambda v: f"{KEY}nodes={v.nodes}: a job needs at least one node. Fix: {KEY}nodes=1"),
    (lambda v: v.kind == "local" and v.nodes is not None and v.nodes > 1,
     lambda v: f"{KEY}nodes={v.nodes}: hydra/launcher=local runs on this machine only. "
               f"Fix: {KEY}nodes=1, or hydra/launcher=slurm for several nodes"),
    (lambda v: v.gpus is not None and v.gpus < 0,
     lambda v: f"{KEY}gpus_per_node={v.gpus} is negative. Fix: {KEY}gpus_per_node=0 for a CPU run"),
    (lambda v: v.tasks is not None and v.tasks < 1,
     lambda v: f"{KEY}tasks_per_node={v.tasks}: every job needs at least one task (one rank). Fix: {_tasks_fix(v)}"),
    (lambda v: v.tasks is not None and v.gpus is not None and 0 < v.gpus < v.tasks,
     lambda v: f"{KEY}tasks_per_node={v.tasks} exceeds {KEY}gpus_per_node={v.gpus}: each task is one rank that drives "
               f"one GPU, so {v.tasks - v.gpus} rank(s) per node would have no GPU. Fix: {KEY}tasks_per_node={v.gpus} "
               f"(or raise {KEY}gpus_per_node), or {KEY}gpus_per_node=0 for a CPU run with {v.tasks} tasks"),
    (lambda v: v.cpus is not None and v.cpus < 1,
     lambda v: f"{KEY}cpus_per_task={v.cpus}: must be at least 1. Fix: {KEY}cpus_per_task=1, or null"),
    (lambda v: v.mem_gb is not None and (isinstance(v.mem_gb, bool) or not isinstance(v.mem_gb, (int, float))
                                         or v.mem_gb <= 0),
     lambda v: f"{KEY}mem_gb={v.mem_gb!r}: must be a positive number of GB, or null for the cluster default"),
    (lambda v: v.timeout_min is not None and v.timeout_min < 1,
     lambda v: f"{KEY}timeout_min={v.timeout_min}: must be at least 1 minute. Fix: e.g. {KEY}timeout_min=60"),
    (lambda v: (v.kind == "slurm" and isinstance(v.signal_delay_s, int) and _positive(v.timeout_min)
                and v.signal_delay_s >= v.timeout_min * 60),
     lambda v: f"{KEY}signal_delay_s={v.signal_delay_s} is not shorter than {KEY}timeout_min={v.timeout_min} "
               f"({v.timeout_min * 60} s): the checkpoint-and-requeue signal would arrive as soon as the job starts. "
               f"Fix: lower {KEY}signal_delay_s (e.g. 120) or raise {KEY}timeout_min"),
    (lambda v: v.kind == "slurm" and isinstance(v.max_num_timeout, int) and v.max_num_timeout < 0,
     lambda v: f"{KEY}max_num_timeout={v.max_num_timeout}: must be >= 0 (requeues after a timeout)"),
)


def _launcher_values(launcher_cfg: Any, kind: str, problems: list[str]) -> LauncherValues:
    """The keys the rules read; an integer key holding something else is a problem (and None here)."""
    def integer(name: str, default: int | None = None) -> int | None:
        value = _get(launcher_cfg, name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{KEY}{name}={value!r} must be an integer. Fix: e.g. {KEY}{name}=1")
            return None
        return value

    return LauncherValues(kind=kind, nodes=integer("nodes", 1), tasks=integer("tasks_per_node", 1),
                          gpus=integer("gpus_per_node"), cpus=integer("cpus_per_task"),
                          timeout_min=integer("timeout_min"), mem_gb=_get(launcher_cfg, "mem_gb"),
                          signal_delay_s=_get(launcher_cfg, "signal_delay_s"),
                          max_num_timeout=_get(launcher_cfg, "max_num_timeout"))


def _partition_problems(launcher_cfg: Any, partitions: Sequence[str]) -> list[str]:
    partition = _get(launcher_cfg, "partition")
    if partition in (None, ""):
        return []
    known = list(partitions)
    return [f"{KEY}partition={partition!r}: partition {name.strip()!r} does not exist on this cluster (sinfo lists: "
            f"{', '.join(known) or 'none'}). Fix: {KEY}partition=<one of those>, or {KEY}partition=null for the "
            f"cluster's default partition"
            for name in str(partition).split(",") if name.strip() not in known]


def check_launcher(launcher_cfg: Any, partitions: Sequence[str] | None = None,
                   cluster_nodes: Sequence[SlurmNode] | None = None) -> list[str]:
    """Problems with a submitit launcher config (empty list when it is fine): the keys' types, then
    :data:`LAUNCHER_RULES`, then (Slurm) the partitions and the nodes' resources (:func:`check_node_resources`).

    Args:
        launcher_cfg: ``cfg.hydra.launcher`` (DictConfig or dict).
        partitions: the cluster's partitions (tests); with ``cluster_nodes`` both None, Slurm is asked (``sinfo``).
        cluster_nodes: the cluster's nodes (tests), for the per-node resource check; skipped when only
            ``partitions`` is given.

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
    values = _launcher_values(launcher_cfg, kind, problems)
    problems += [message(values) for applies, message in LAUNCHER_RULES if applies(values)]
    if kind != "slurm":
        return problems
    if partitions is None and cluster_nodes is None:
        cluster_nodes = slurm_nodes()  # also fails early, with a clear message, when Slurm is unreachable
    if partitions is None:
        partitions = sorted({n.partition for n in cluster_nodes})
    problems += _partition_problems(launcher_cfg, partitions)
    if cluster_nodes is not None and not problems:  # counts are valid integers here
        problems += check_node_resources(launcher_cfg, cluster_nodes)
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
    from dflash_lab.analysis.sweep_jobs import planned_jobs

    sweeper_target = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    if not sweeper_target.endswith("BasicSweeper"):
        return [[]]
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None)
    params = OmegaConf.to_container(params, resolve=False) if params is not None else {}
    return planned_jobs(params, list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False)))


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


def validate_multirun(config: DictConfig, partitions: Sequence[str] | None = None,
                      cluster_nodes: Sequence[SlurmNode] | None = None) -> None:
    """Run every pre-submission check on a composed multirun config.

    Args:
        config: the config Hydra passes to ``on_multirun_start`` (with its ``hydra`` node).
        partitions, cluster_nodes: override what ``sinfo`` reports (tests); default: ask Slurm (Slurm only).

    Raises:
        LaunchConfigError: listing every problem found.
    """
    problems = check_launcher(config.hydra.launcher, partitions, cluster_nodes)
    problems += check_sweep(config)
    if problems:
        raise LaunchConfigError(problems)


# ------------------------------------------------------------------------------------- waiting for submitted jobs

# squeue states of a job that will not run (again); a requeued or preempted job goes back to PENDING instead.
_GONE_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "REVOKED", "SPECIAL_EXIT", "TIMEOUT"}


def squeue_state(job_id: str, timeout_s: float = 20.0) -> tuple[str, str] | None:
    """(state, reason) of one job or array element from ``squeue -t all``; ``("GONE", ...)`` when Slurm no
    longer knows it; None when squeue does not answer (try again later)."""
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-r", "-j", job_id.split("_")[0], "-o", "%i|%T|%r"],
                             capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return ("GONE", "no longer known to Slurm") if "Invalid job id" in out.stderr else None
    for line in out.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 3 and fields[0] == job_id:
            return fields[1], fields[2]
    return "GONE", "no longer known to Slurm"


class QueueWatch:
    """Ends the launcher's wait when a submitted Slurm job leaves the queue without its results.

    A thread finds the sweep's jobs in submitit's folders (``.submitit/<job id>/<job id>_submitted.pkl``; an
    array element's id is ``<array id>_<index>``), polls ``squeue`` every ``poll_s`` seconds, and when a job is
    gone (a final state, or unknown to Slurm) on two polls in a row while one of its ``tasks`` result files is
    missing, it interrupts the waiting main thread, which exits with an error naming the job, its last state and
    reason, and its log.

    Args:
        submitit_folder: ``hydra.launcher.submitit_folder`` (``%j`` stands for the job id).
        tasks: tasks per job (``nodes x tasks_per_node``); each writes ``<job id>_<task>_result.pkl``.
        poll_s: seconds between polls.
    """

    def __init__(self, submitit_folder: str, tasks: int, poll_s: float = 5.0):
        self.pattern, self.tasks, self.poll_s = str(submitit_folder), int(tasks), float(poll_s)
        self.message: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-queue-watch", daemon=True)
        self._previous_handler = None
        self._earlier: set[str] = set()   # jobs of an earlier launch into the same sweep directory (a relaunch)

    def start(self) -> QueueWatch:
        """Install the main thread's handler (call from the main thread) and start polling. Jobs already in the
        submitit folder belong to an earlier launch into the same sweep directory (a relaunch that resumes its
        runs): they are not this launch's to wait for."""
        self._earlier = set(self._job_folders())
        self._previous_handler = signal.signal(signal.SIGUSR1, self._raise_in_main_thread)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and restore the previous SIGUSR1 handler."""
        self._stop.set()
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._previous_handler)
            self._previous_handler = None

    def _raise_in_main_thread(self, signum, frame) -> None:
        self.stop()
        raise SystemExit(f"Error: {self.message}")

    def _job_folders(self) -> dict[str, Path]:
        if "%j" not in self.pattern:
            return {}
        parent = Path(self.pattern.split("%j")[0])
        found = parent.glob("*") if parent.is_dir() else []
        # A job's folder holds its pickled task; an array's own folder (its sbatch file only) is not a job.
        return {p.name: p for p in found
                if re.fullmatch(r"\d+(_\d+)?", p.name) and (p / f"{p.name}_submitted.pkl").exists()}

    def _has_results(self, job_id: str, folder: Path) -> bool:
        return all((folder / f"{job_id}_{task}_result.pkl").exists() for task in range(self.tasks))

    def _run(self) -> None:
        strikes: dict[str, int] = {}
        last_seen: dict[str, tuple[str, str]] = {}  # the last live state, for jobs Slurm forgets at once
        while not self._stop.wait(self.poll_s):
            for job_id, folder in sorted(self._job_folders().items()):
                if job_id in self._earlier:
                    continue
                if strikes.get(job_id) == -1 or self._has_results(job_id, folder):
                    strikes[job_id] = -1  # finished with its results: the launcher will collect them
                    continue
                state = squeue_state(job_id)
                if state is None or state[0] not in _GONE_STATES | {"GONE"}:
                    strikes[job_id] = 0
                    if state is not None:
                        last_seen[job_id] = state
                    continue
                strikes[job_id] = strikes.get(job_id, 0) + 1
                if strikes[job_id] >= 2 and not self._has_results(job_id, folder):
                    others = [j for j in self._job_folders()
                              if j != job_id and strikes.get(j) != -1 and j not in self._earlier]
                    self.message = self._describe(job_id, folder, state, last_seen.get(job_id), others)
                    _thread.interrupt_main(signal.SIGUSR1)
                    return

    def _describe(self, job_id: str, folder: Path, state: tuple[str, str], last_seen: tuple[str, str] | None,
                  others: list[str]) -> str:
        logs = sorted(folder.glob(f"{job_id}_*_log.err"))
        errors = _run_errors(logs)
        if errors:   # the run said why it stopped, in one line per cause (every rank names the same lost rank)
            sweep_dir = folder.parent.parent if folder.parent.name == ".submitit" else None
            relaunch = (f" To go on: the same command with hydra.sweep.dir={sweep_dir} (each run resumes from its "
                        f"newest checkpoint)." if sweep_dir is not None else "")
            running = (f"\nOther jobs of this sweep may still be queued or running ({', '.join(sorted(others))}): "
                       f"`scancel {job_id.split('_')[0]}` cancels them" if others else "")
            return (f"Slurm job {job_id} failed ({state[0] if state[0] != 'GONE' else 'ended'}): "
                    + "\n  ".join(errors) + f"\nJob files: {folder}.{relaunch}{running}")
        tail = ""
        if logs:
            lines = [line for line in logs[0].read_text(errors="replace").splitlines() if line.strip()]
            tail = "; its log ends:\n    " + "\n    ".join(lines[-5:]) if lines else "; its log is empty"
        if state[0] != "GONE":
            shown = f"state {state[0]}, reason: {state[1]}"
        else:
            before = f"last seen {last_seen[0]} ({last_seen[1]}); " if last_seen else ""
            shown = f"{before}Slurm no longer knows it: cancelled, or ended and purged"
        running = (f"\nOther jobs of this sweep may still be queued or running ({', '.join(sorted(others))}): "
                   f"`scancel {job_id.split('_')[0]}` cancels them" if others else "")
        return (f"Slurm job {job_id} left the queue without a result ({shown}); the launcher stops waiting for it. "
                f"Job files: {folder}{tail}{running}")


RUN_ERROR_PREFIX = "dflash_lab.train: error: "   # how the trainer prints the one-line reason it stopped


def _run_errors(logs: list[Path]) -> list[str]:
    """The distinct one-line errors the trainer printed in a job's task logs (rank order), without the prefix."""
    found: dict[str, None] = {}
    for log_file in logs:
        try:
            text = log_file.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(RUN_ERROR_PREFIX):
                found.setdefault(line[len(RUN_ERROR_PREFIX):].strip(), None)
    return list(found)


class RecordProtocol(Callback):
    """Hydra callback: the sweep's analysis protocol frozen in ``<sweep dir>/protocol.json`` before its runs start
    (``analysis.protocol.record_protocol``: the declared section, every key resolved, the rules version, the
    analysis code's digest). Registered for every multirun by conf/train.yaml (``hydra.callbacks.record_protocol``).
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if OmegaConf.select(config, "hydra.callbacks.validate_launch") is not None:
            return   # ValidateLaunch records it once its checks pass: a refused launch leaves no sweep folder
        record_sweep_protocol(config)


def record_sweep_protocol(config: DictConfig) -> None:
    """Write the sweep's ``protocol.json`` (``analysis.protocol.record_protocol``); a bad ``analysis`` section stops
    the launch, naming the key. A relaunch into the same sweep folder says that the first launch's protocol is kept
    (naming each key this launch declares otherwise) and where its jobs stand (finished, unfinished, never
    started); a sweep whose runs cannot yield the forgetting endpoints at the configured steps is said now."""
    from dflash_lab.analysis.protocol import PROTOCOL_FILE, kept_protocol_note, record_protocol

    section = OmegaConf.select(config, "analysis")
    section = OmegaConf.to_container(section, resolve=True) if section is not None else None
    sweep_dir = Path(config.hydra.sweep.dir)
    relaunch = (sweep_dir / PROTOCOL_FILE).is_file()
    try:
        path = record_protocol(sweep_dir, section)
    except ValueError as exc:   # Hydra turns a callback's Exception into a warning: stop with SystemExit
        raise SystemExit(f"Error: {exc}") from exc
    if relaunch:
        note = kept_protocol_note(path, section)
        (log.warning if note.startswith("relaunch: protocol.json keeps") else log.info)(note)
        jobs = relaunch_jobs_note(config)
        if jobs:
            log.info(jobs)
    else:
        log.info("analysis protocol recorded in %s", path)
    short = launch_probe_warning(config, section)
    if short:
        log.warning(short)


def _swept_keys(config: DictConfig) -> tuple[set[str], list[list[str]]]:
    """The keys whose value differs between the launch's jobs, and the jobs' overrides (Hydra's expansion)."""
    try:
        jobs = expand_sweep(config)
    except Exception:  # noqa: BLE001 - a sweep Hydra's parser cannot expand here (a glob): nothing to say
        return set(), []
    varying = set()
    for index, term in enumerate(jobs[0] if jobs else []):
        if any(len(job) <= index or job[index] != term for job in jobs):
            varying.add(term.split("=", 1)[0].lstrip("+~"))
    return varying, jobs


def relaunch_jobs_note(config: DictConfig) -> str | None:
    """Where the jobs of a relaunch into an existing sweep folder stand: finished (they say nothing to do),
    unfinished (they continue), and never started (named: they run now)."""
    from dflash_lab.analysis.sweep_jobs import sweep_jobs

    params = OmegaConf.select(config, "hydra.sweeper.params")
    params = OmegaConf.to_container(params, resolve=False) if params is not None else None
    jobs = sweep_jobs(Path(config.hydra.sweep.dir), params, list(OmegaConf.select(config, "hydra.overrides.task")
                                                                 or []))
    if jobs is None or not jobs.status:
        return None
    finished = [job for job, status in enumerate(jobs.status) if status == "finished"]
    unfinished = [f"job {job} ({status})" for job, status in enumerate(jobs.status)
                  if status not in ("finished", "never started")]
    unstarted = [f"job {job} ({' '.join(jobs.terms[job])})" for job in jobs.unstarted]
    return (f"relaunch into {jobs.sweep_dir}: {len(finished)} of {len(jobs.status)} jobs finished (nothing to do)"
            + (f"; unfinished, continued now: {', '.join(unfinished)}" if unfinished else "")
            + (f"; never started, run now: {'; '.join(unstarted)}" if unstarted else ""))


def launch_probe_warning(config: DictConfig, section: dict | None) -> str | None:
    """At launch, when ``trainer.max_steps`` fixes every run's length (and neither it nor ``probes.every`` nor
    ``analysis.window`` is swept): whether the runs' probes can yield the endpoints the comparison reports
    (declared, else the default ones: residual_amplitude and own_share_slope need 8 probe evaluations in the
    analysis window). None when they can, or when the launch cannot know (each run checks itself before step 1)."""
    from dflash_lab.analysis.schema import DEFAULT_ENDPOINTS
    from dflash_lab.analysis.sizing import verdict_probe_warning

    max_steps, every = OmegaConf.select(config, "trainer.max_steps"), OmegaConf.select(config, "probes.every")
    if not isinstance(max_steps, int) or not isinstance(every, int) or every <= 0:
        return None
    swept, _ = _swept_keys(config)
    if swept & {"trainer", "trainer.max_steps", "trainer.epochs", "probes.every", "analysis.window", "analysis",
                "analysis.endpoints", "probes", "probes.bands"}:
        return None
    bands = OmegaConf.select(config, "probes.bands")
    n_bands = 6 if bands == "auto" or bands is None else len(bands) - 1   # auto: 6 bands (probes.resolve_bands)
    return verdict_probe_warning(section, end_step=max_steps, probes_every=every, n_bands=n_bands,
                                 undeclared=DEFAULT_ENDPOINTS, who=f"every run of this sweep (trainer.max_steps="
                                                                   f"{max_steps})")


class ValidateLaunch(Callback):
    """Hydra callback: :func:`validate_multirun` before a multirun submits anything.

    Registered in config (``hydra.callbacks.validate_launch._target_: dflash_lab.cluster.launch.ValidateLaunch``) by the
    launcher configs and the sweep files.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            validate_multirun(config)
        except LaunchConfigError as exc:
            # Hydra turns an Exception raised by a callback into a warning and carries on submitting, so stop
            # with SystemExit (a BaseException it lets through): the message goes to stderr, the exit code is 1.
            raise SystemExit(f"Error: {exc}") from exc
        record_sweep_protocol(config)   # the checks passed: the protocol is frozen before anything runs
        kind = launcher_kind(config.hydra.launcher)
        if kind is not None:
            launcher = config.hydra.launcher
            log.info(
                "launch checks passed: submitit %s, %s node(s) x %s task(s), gpus_per_node=%s",
                kind, _get(launcher, "nodes", 1), _get(launcher, "tasks_per_node", 1), _get(launcher, "gpus_per_node"),
            )
        if kind == "slurm" and _get(config.hydra.launcher, "submitit_folder"):
            tasks = int(_get(launcher, "nodes", 1)) * int(_get(launcher, "tasks_per_node", 1))
            self._watch = QueueWatch(_get(launcher, "submitit_folder"), tasks).start()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.stop()

    def __getstate__(self) -> dict:
        # submitit pickles the launcher, and with it the Hydra callbacks, into every job: the watch (a thread)
        # belongs to the submitting process only.
        return {k: v for k, v in self.__dict__.items() if k != "_watch"}

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
