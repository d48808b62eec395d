"""The jobs a sweep planned, and which of them never started (a sweep killed mid-way, a launcher that died).

A multirun's jobs are the expansion of its sweep: the sweeper's ``params`` (a sweep file's
``hydra.sweeper.params``) and the launch's task overrides (``seed=0,1,2``), expanded as Hydra's basic sweeper does
(the cartesian product, in order), job ``n`` being the ``n``-th. Hydra records both in the sweep folder before any
job runs (``multirun.yaml``), and each job's folder starts with its number (``<n>_<sampler>..._s<seed>``,
conf/train.yaml ``hydra.sweep.subdir``). A planned job without a folder never started: no run record names it, so
``compare`` and a relaunch into the same folder name it here (:func:`sweep_jobs`, :func:`describe_unstarted`).

Cost: reading one YAML file and listing one folder per sweep.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MULTIRUN_FILE = "multirun.yaml"   # Hydra's record of the launch, in the sweep folder
_JOB_FOLDER = re.compile(r"^(\d+)_")


def planned_jobs(params: Mapping[str, Any] | None, task_overrides: Sequence[str]) -> list[list[str]]:
    """The override list of every job, in job order, as Hydra's basic sweeper expands them.

    Example:
        >>> planned_jobs({"sampler.boundaries": "[0,1024],[0,96,1024]"}, ["seed=0,1", "trainer.max_steps=40"])[1]
        ['sampler.boundaries=[0,1024]', 'seed=1', 'trainer.max_steps=40']
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    arguments = [f"{key}={value}" for key, value in (params or {}).items()] + [str(o) for o in task_overrides]
    overrides = OverridesParser.create().parse_overrides(arguments)
    return [list(job) for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def swept_terms(jobs: list[list[str]]) -> list[list[str]]:
    """Each job's overrides that differ between jobs (what tells the jobs apart).

    Example:
        >>> swept_terms([["a=1", "b=2"], ["a=1", "b=3"]])
        [['b=2'], ['b=3']]
    """
    if len(jobs) < 2:
        return [list(job) for job in jobs]
    common = set(jobs[0]).intersection(*map(set, jobs[1:]))
    return [[term for term in job if term not in common] for job in jobs]


def job_folders(sweep_dir: Path) -> dict[int, Path]:
    """The job folders of a sweep folder by job number (``<n>_...``)."""
    folders = {}
    for path in sorted(Path(sweep_dir).iterdir()) if Path(sweep_dir).is_dir() else []:
        match = _JOB_FOLDER.match(path.name)
        if match and path.is_dir():
            folders.setdefault(int(match.group(1)), path)
    return folders


def job_status(folder: Path | None) -> str:
    """``never started`` (no folder), the status in its ``summary.json``, or ``no summary.json``."""
    if folder is None:
        return "never started"
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return "no summary.json" if not (folder / "summary.json").exists() else "summary.json unreadable"
    return str(summary.get("status")) if isinstance(summary, dict) else "summary.json unreadable"


@dataclass(frozen=True)
class SweepJobs:
    """A sweep's planned jobs and where each stands.

    Attributes:
        sweep_dir: the sweep folder.
        terms: per job (job order), its overrides that tell it apart from the other jobs.
        status: per job, ``job_status`` of its folder.
    """

    sweep_dir: Path
    terms: list[list[str]]
    status: list[str]

    @property
    def unstarted(self) -> list[int]:
        return [job for job, status in enumerate(self.status) if status == "never started"]


def sweep_jobs(sweep_dir: Path, params: Mapping[str, Any] | None = None,
               task_overrides: Sequence[str] | None = None) -> SweepJobs | None:
    """The planned jobs of ``sweep_dir`` (from ``params`` and ``task_overrides``, else its ``multirun.yaml``) and
    their status; None when the plan cannot be read (no ``multirun.yaml``, a sweep Hydra's parser cannot expand
    without the config, e.g. a glob)."""
    import yaml

    if params is None and task_overrides is None:
        try:
            recorded = yaml.safe_load((Path(sweep_dir) / MULTIRUN_FILE).read_text()) or {}
            hydra = recorded["hydra"]
            params, task_overrides = (hydra.get("sweeper") or {}).get("params"), hydra["overrides"]["task"]
        except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
            return None
    try:
        jobs = planned_jobs(params, list(task_overrides or []))
    except Exception:  # noqa: BLE001 - Hydra's parser errors vary; an unreadable plan only means nothing to say
        return None
    folders = job_folders(Path(sweep_dir))
    return SweepJobs(Path(sweep_dir), swept_terms(jobs), [job_status(folders.get(job)) for job in range(len(jobs))])


def describe_unstarted(jobs: SweepJobs, shown: int = 8) -> str | None:
    """One line naming the jobs that never started and how to run them; None when every job started.

    Example:
        >>> describe_unstarted(SweepJobs(Path("multirun/x/t"), [["seed=0"], ["seed=1"]], ["finished", "never started"]))
        'sweep multirun/x/t: 1 of 2 jobs never started: job 1 (seed=1); relaunch the same command with hydra.sweep.dir=multirun/x/t to run them (finished jobs say nothing to do)'
    """
    missing = jobs.unstarted
    if not missing:
        return None
    named = "; ".join(f"job {job} ({' '.join(jobs.terms[job]) or 'no swept value'})" for job in missing[:shown])
    more = f"; and {len(missing) - shown} more" if len(missing) > shown else ""
    return (f"sweep {jobs.sweep_dir}: {len(missing)} of {len(jobs.status)} jobs never started: {named}{more}; relaunch "
            f"the same command with hydra.sweep.dir={jobs.sweep_dir} to run them (finished jobs say nothing to do)")


def unstarted_job_notes(locations: Sequence[str | Path]) -> list[str]:
    """``describe_unstarted`` for the sweep folder of each run location (a local run directory), once per folder."""
    notes, seen = [], set()
    for location in locations:
        sweep_dir = Path(location).parent
        if sweep_dir in seen or not (sweep_dir / MULTIRUN_FILE).is_file():
            continue
        seen.add(sweep_dir)
        jobs = sweep_jobs(sweep_dir)
        line = describe_unstarted(jobs) if jobs is not None else None
        if line:
            notes.append(line)
    return notes
