"""A run's directory, as the run that owns it sees it: who may write it, which records it holds, and what a launch
that trains nothing leaves behind (nothing changed).

- One writer: rank 0 takes the directory's lock (:mod:`dflash_lab.run_lock`) before anything in it is opened.
- The run owns its config record, ``run_config.json`` (:data:`record.RUN_CONFIG_FILE`: the resolved config, the
  launch's task overrides and Hydra's files of that launch), written under the lock when a launch starts training
  (:meth:`RunDirectory.running`) and by nothing else: a launch refused by the lock, refused before its loop (a
  changed setting, other data, incomplete records, a fresh start over an ended run) or with nothing to do (a
  finished run) leaves it byte-identical. Analysis, export and the planner read it.
- Hydra writes ``.hydra/{config,hydra,overrides}.yaml`` before the run starts: they describe the latest launch. A
  launch that trains nothing puts back the run's (those of the checkpoint it would have resumed, else those of
  the run record), so the folder keeps describing the run in it; a running run rewrites its own if a launch
  refused by the lock replaced them (:meth:`RunDirectory.keep_hydra_files`, at every checkpoint).
- A fresh start over the records of a run that ended is refused unless ``overwrite=true``
  (:meth:`RunDirectory.check_fresh_start`); a resume whose side files do not cover its checkpoint is refused
  (:func:`check_records_cover`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dflash_lab import record
from dflash_lab.run_lock import RunDirLock
from dflash_lab.run_lock import describe as describe_holder
from dflash_lab.run_logger import write_json_atomic

HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def read_hydra_files(run_dir: Path) -> dict[str, str]:
    """The text of the run's ``.hydra`` files (config, hydra, overrides) as they are now."""
    files = {}
    for name in HYDRA_FILES:
        path = run_dir / ".hydra" / name
        if path.is_file():
            files[name] = path.read_text()
    return files


def write_hydra_files(run_dir: Path, files: dict[str, str]) -> bool:
    """Write back the ``.hydra`` files that differ from ``files``; True if any did."""
    changed = False
    for name, text in files.items():
        path = run_dir / ".hydra" / name
        if path.parent.is_dir() and (not path.is_file() or path.read_text() != text):
            path.write_text(text)
            changed = True
    return changed


def launch_overrides(hydra_files: dict[str, str]) -> list[str] | None:
    """The task overrides of a launch, from the text of its ``.hydra/overrides.yaml`` (None: not there).

    Example:
        >>> launch_overrides({"overrides.yaml": "- sampler=bucketed\\n- seed=1\\n"})
        ['sampler=bucketed', 'seed=1']
    """
    import yaml

    text = hydra_files.get("overrides.yaml")
    if text is None:
        return None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return [str(item) for item in loaded] if isinstance(loaded, list) else None


def write_run_config(run_dir: Path, config: dict[str, Any], hydra_files: dict[str, str]) -> None:
    """Write the run's config record (``run_config.json``): the resolved config it trains with, the task
    overrides of this launch and this launch's ``.hydra`` files (atomic: a reader never sees half a file)."""
    write_json_atomic(Path(run_dir) / record.RUN_CONFIG_FILE,
                      {"config": json.loads(json.dumps(config, default=str)),
                       "overrides": launch_overrides(hydra_files), "hydra_files": dict(hydra_files)})


def recorded_hydra_files(run_dir: Path) -> dict[str, str]:
    """The ``.hydra`` files of the launch that last trained the run, from its record (``{}``: none recorded)."""
    try:
        data = json.loads((Path(run_dir) / record.RUN_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("hydra_files") if isinstance(data, dict) else None
    return {str(k): v for k, v in files.items() if isinstance(v, str)} if isinstance(files, dict) else {}


class RunDirectory:
    """The run directory of one process of a run (rank 0 writes; other ranks only read).

    Args:
        path: the run directory (created if missing).
        is_main: rank 0 (takes the lock, writes files).
    """

    def __init__(self, path: Path, is_main: bool):
        self.path, self.is_main = Path(path), is_main
        self._lock: RunDirLock | None = None
        self.launch_hydra_files: dict[str, str] = {}   # this launch's, as Hydra wrote them before the run started
        self._restore_on_refusal: dict[str, str] = {}  # the resumed checkpoint's, put back if this launch is refused
        self.fresh_start = False    # no checkpoint to resume (set when the checkpoint was looked for)
        self.loop_started = False

    def claim(self) -> str | None:
        """Create the directory and (rank 0) take its lock, before anything in it is opened. Raises
        ``run_lock.RunDirBusy`` when a live process holds it; returns who held a stale lock taken over."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.launch_hydra_files = read_hydra_files(self.path)
        if not self.is_main:
            return None
        self._lock = RunDirLock(self.path).acquire()
        return describe_holder(self._lock.replaced) if self._lock.replaced else None

    def resuming(self, checkpoint_hydra_files: dict[str, str] | None) -> None:
        """A checkpoint is being resumed: if this launch is refused before its loop, its ``.hydra`` files go back."""
        self._restore_on_refusal = dict(checkpoint_hydra_files or {})

    def running(self, config: dict[str, Any]) -> None:
        """The loop starts: this launch trains the run, so its config (``config``: the resolved config it trains
        with), task overrides and ``.hydra`` files become the run's record (``run_config.json``, rank 0)."""
        self._restore_on_refusal = {}
        self.loop_started = True
        if self.is_main:
            write_run_config(self.path, config, self.launch_hydra_files)

    def restore_if_refused(self) -> None:
        """This launch trains nothing (refused before its loop, crashed before ``running``, or nothing to do):
        put back the run's ``.hydra`` files (the resumed checkpoint's, else the run record's). Its own record
        (``run_config.json``) was never touched."""
        files, self._restore_on_refusal = self._restore_on_refusal, {}
        if not self.is_main or self.loop_started or self._lock is None:
            return
        write_hydra_files(self.path, files or recorded_hydra_files(self.path))

    def record_failure(self, error: BaseException) -> None:
        """After a crash or a refusal of this launch (rank 0, directory claimed), ``summary.json`` says so: the
        running summary of a run whose loop started gets status failed and the error; a fresh start refused before
        its loop (a config the model or data refuses) gets a summary of its own (status failed, steps 0), so the
        folder says what happened. A refused resume leaves every file as it was."""
        if self._lock is None:
            return
        summary = self.summary()
        message = f"{type(error).__name__}: {error}"
        if self.loop_started and summary is not None and summary.get("status") == "running":
            summary.update(status="failed", error=message)
        elif self.fresh_start and not self.loop_started and (summary is None or summary.get("status") == "running"):
            summary = {"status": "failed", "steps": 0, "error": message}
        else:
            return
        write_json_atomic(self.path / record.SUMMARY_FILE, summary)

    def keep_hydra_files(self, log: logging.Logger) -> None:
        """Rewrite this run's ``.hydra`` files if another launch in the directory (refused by the lock, but only
        after Hydra had written its own) replaced them."""
        if write_hydra_files(self.path, self.launch_hydra_files):
            log.warning(f"another launch rewrote {self.path / '.hydra'}; this run's config files are restored")

    def release(self) -> None:
        """Drop the lock (a clean end leaves nothing to take over)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __getstate__(self) -> dict:
        # submitit pickles the task for a requeue: a copy holds no lock
        return {**self.__dict__, "_lock": None}

    def check_fresh_start(self, overwrite: bool, log: logging.Logger) -> None:
        """A fresh start in a directory whose records are of a run that ended (finished, failed or preempted) but
        whose checkpoints are gone would replace them: refused unless ``overwrite=true``. Records of an attempt that
        died before its first checkpoint (status running, or none: a kill, a lost node, a Slurm requeue) are of this
        same run: they are dropped and the run starts over, with a log line."""
        metrics = self.path / record.METRICS_FILE
        summary_path = self.path / record.SUMMARY_FILE
        if not ((metrics.is_file() and metrics.stat().st_size > 0) or summary_path.is_file()):
            return
        if overwrite:
            log.warning(f"overwrite=true: replacing the records of the earlier run in {self.path}")
            return
        summary = self.summary() or {}
        status = summary.get("status")
        if status not in ("finished", "failed", "preempted"):
            log.warning("an earlier attempt ended before its first checkpoint: its rows are dropped and the run "
                        "starts over")
            return
        if status == "failed" and summary.get("steps") == 0:
            log.warning(f"an earlier attempt failed before its first step ({summary.get('error')}): the run starts "
                        f"over")
            return
        raise ValueError(f"{self.path} holds the records of a run that ended (status {status}) but no checkpoint to "
                         f"continue from: starting fresh would replace them. Use another directory "
                         f"(hydra.run.dir=<new dir>), restore its checkpoints/, or pass overwrite=true to replace "
                         f"them")

    def summary(self) -> dict[str, Any] | None:
        """The run's ``summary.json`` (None when missing or unreadable)."""
        try:
            summary = json.loads((self.path / record.SUMMARY_FILE).read_text())
        except (OSError, ValueError):
            return None
        return summary if isinstance(summary, dict) else None

    def finished_summary(self, step: int) -> dict[str, Any] | None:
        """``summary.json`` of a run that finished at ``step`` (None if it did not, or the file is unreadable)."""
        summary = self.summary()
        if summary is not None and summary.get("status") == "finished" and summary.get("steps") == step:
            return summary
        return None


def check_records_cover(step: int, history: list[dict[str, Any]], probed_steps: set[int],
                        last_probe_step: int | None, presentations_problem: str | None) -> None:
    """On resume from a checkpoint of ``step``: the side files must hold the run up to it (every metrics row
    1..step, the probe evaluation of the checkpoint's last probe step, presentations up to the last checkpoint when
    recorded); otherwise the run would end "finished" with holes in its records, so it is refused."""
    problems = []
    steps = [int(row["step"]) for row in history]
    if steps != list(range(1, step + 1)):
        problems.append(f"{record.METRICS_FILE} holds {len(set(steps) & set(range(1, step + 1)))} of the {step} "
                        f"steps up to it")
    if last_probe_step is not None and last_probe_step not in probed_steps:
        problems.append(f"{record.PROBES_FILE} lacks the probe evaluation of step {last_probe_step}")
    if presentations_problem:
        problems.append(presentations_problem)
    if problems:
        raise ValueError(f"resume from the checkpoint of step {step}: {'; '.join(problems)}. The run's records are "
                         f"incomplete: restore them, or start a fresh run directory (hydra.run.dir=<new dir>)")
