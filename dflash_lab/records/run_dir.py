"""A run's directory, as the run that owns it sees it: who may write it, which records it holds, and what a launch
that trains nothing leaves behind (nothing changed).

- One writer: rank 0 takes the directory's lock (:mod:`dflash_lab.records.run_lock`) before anything in it is opened,
  then removes the temporary copies a kill left mid-rewrite (:meth:`RunDirectory.remove_unfinished_writes`).
- The run owns its config record, ``run_config.json`` (:data:`record.RUN_CONFIG_FILE`: the resolved config, the
  launch's task overrides and Hydra's files of that launch), written under the lock when a launch starts training
  (:meth:`RunDirectory.running`) and by nothing else: a launch refused by the lock, refused before its loop (a
  changed setting, other data, incomplete records, a fresh start over an ended run) or with nothing to do (a
  finished run) leaves it byte-identical. Analysis, export and the planner read it.
- Hydra writes ``.hydra/{config,hydra,overrides}.yaml`` before the run starts: they describe the latest launch. A
  launch that trains nothing puts back the run's (those of the checkpoint it would have resumed, else those of
  the run record), so the folder keeps describing the run in it; a running run rewrites its own if a launch
  refused by the lock replaced them (:meth:`RunDirectory.keep_hydra_files`, at every checkpoint).
- A fresh start over records of steps that ran (a run that ended, or one stopped after a checkpoint that is gone
  now) is refused unless ``overwrite=true`` (:meth:`RunDirectory.check_fresh_start`); a resume whose side files do
  not hold what its checkpoint says they held is refused (:func:`check_records_cover`). Refusals are
  ``refusal.Refused`` (one line on the command line) and write nothing in a directory that holds a summary.
- A fresh start is a new W&B run (:meth:`RunDirectory.wandb_run_id`); a continuation keeps the checkpoint's.
- A run or sweep directory that cannot be written stops the launch before Hydra writes into it
  (:class:`CheckRunDirectory`, a Hydra callback).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dflash_lab.records import record
from dflash_lab.refusal import Refused, describe_failure
from dflash_lab.records.run_lock import RunDirLock
from dflash_lab.records.run_lock import describe as describe_holder
from dflash_lab.records.run_logger import load_or_create_run_id, write_json_atomic

REFUSED_EXIT_CODE = 2   # as dflash_lab.train's refusals
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def unwritable_directory(directory: Path) -> tuple[Path, str] | None:
    """(the path, why) where ``directory`` or its ``.hydra`` cannot be written, or None when they can; a directory
    that does not exist yet is checked at its nearest existing parent (nothing is created). A file is created and
    removed in each place (a permission check alone would pass for root on a read-only directory)."""
    directory = Path(directory).absolute()
    places = [directory, directory / ".hydra"] if directory.is_dir() else [
        next(parent for parent in directory.parents if parent.is_dir())]
    for place in places:
        try:
            if place.is_dir():
                tempfile.TemporaryFile(dir=place).close()
        except OSError as exc:
            return place, exc.strerror or str(exc)
    return None


class CheckRunDirectory(Callback):
    """Hydra callback: a run (or sweep) directory that cannot be written stops the launch in one line (exit code 2)
    before Hydra writes ``.hydra/`` into it (Hydra's own error there is a traceback). Registered by
    conf/train.yaml (``hydra.callbacks.check_run_dir``), before the other callbacks."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(OmegaConf.select(config, "hydra.run.dir"), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(OmegaConf.select(config, "hydra.sweep.dir"), "hydra.sweep.dir")

    @staticmethod
    def _check(directory: str | None, key: str) -> None:
        problem = unwritable_directory(Path(directory)) if directory else None
        if problem is not None:   # Hydra turns a callback's Exception into a warning: stop with SystemExit
            where, why = problem
            print(f"dflash_lab.train: error: the run directory {directory} cannot be written ({where}: {why}): make "
                  f"it writable (chmod u+w '{where}'), or choose another ({key}=<dir>)", file=sys.stderr)
            raise SystemExit(REFUSED_EXIT_CODE)


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


def write_run_config(run_dir: Path, config: dict[str, Any], hydra_files: dict[str, str],
                     topology: Mapping[str, Any] | None = None) -> None:
    """Write the run's config record (``run_config.json``): the resolved config it trains with, the task
    overrides of this launch, this launch's ``.hydra`` files and where its ranks ran (``topology``:
    ``DistEnv.topology``) (atomic: a reader never sees half a file)."""
    write_json_atomic(Path(run_dir) / record.RUN_CONFIG_FILE,
                      {"config": json.loads(json.dumps(config, default=str)),
                       "overrides": launch_overrides(hydra_files), "hydra_files": dict(hydra_files),
                       "topology": dict(topology) if topology is not None else None})


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

    def remove_unfinished_writes(self, log: logging.Logger) -> list[str]:
        """Remove the temporary copies (``<file>.tmp`` of ``record.REWRITTEN_FILES``) that a kill left between
        writing a record file's new content and renaming it into place, with a log line; the file itself holds its
        last complete version (rank 0, under the lock). Returns the names removed."""
        if not self.is_main or self._lock is None:
            return []
        stale = [self.path / f"{name}.tmp" for name in record.REWRITTEN_FILES]
        stale = [path for path in stale if path.is_file() or path.is_symlink()]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            log.warning(f"removed {', '.join(path.name for path in stale)}: left by a run killed while it rewrote "
                        f"{', '.join(path.stem for path in stale)}, whose last complete version is kept")
        return [path.name for path in stale]

    def resuming(self, checkpoint_hydra_files: dict[str, str] | None) -> None:
        """A checkpoint is being resumed: if this launch is refused before its loop, its ``.hydra`` files go back."""
        self._restore_on_refusal = dict(checkpoint_hydra_files or {})

    def running(self, config: dict[str, Any], topology: Mapping[str, Any] | None = None) -> None:
        """The loop starts: this launch trains the run, so its config (``config``: the resolved config it trains
        with), task overrides, ``.hydra`` files and topology (nodes, ranks per node, each rank's node) become the
        run's record (``run_config.json``, rank 0)."""
        self._restore_on_refusal = {}
        self.loop_started = True
        if self.is_main:
            write_run_config(self.path, config, self.launch_hydra_files, topology)

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
        running summary of a run whose loop started gets status failed, the error (a full disk named as such:
        ``refusal.describe_failure``) and the steps its metrics hold; a launch stopped before its loop in a
        directory without a ``summary.json`` gets one of its own (status failed, steps 0), so the folder says what
        happened. A launch stopped before its loop in a directory that holds a summary (a refused resume, a refused
        fresh start over an earlier attempt) leaves every file as it was. Never raises: a disk too full to take
        the summary must not hide the error that stopped the run."""
        if self._lock is None:
            return
        summary = self.summary()
        message = describe_failure(error)
        if self.loop_started and summary is not None and summary.get("status") == "running":
            steps = last_metrics_step(self.path / record.METRICS_FILE)
            summary.update(status="failed", error=message, steps=max(int(summary.get("steps") or 0), steps or 0))
        elif not self.loop_started and not (self.path / record.SUMMARY_FILE).exists():
            summary = {"status": "failed", "steps": 0, "error": message}
        else:
            return
        try:
            write_json_atomic(self.path / record.SUMMARY_FILE, summary)
        except OSError:
            logging.getLogger("dflash_lab").error(f"could not record the failure in {record.SUMMARY_FILE}: {message}")

    def record_writer_lost(self, error: BaseException) -> None:
        """Rank 0, the directory's one writer, was lost mid-run (its process is gone, so nothing else writes here):
        another rank marks the running ``summary.json`` failed with ``error``, so the record does not claim a
        running run. Only a summary that says running is changed. Never raises."""
        summary = self.summary()
        if self.is_main or summary is None or summary.get("status") != "running":
            return
        steps = last_metrics_step(self.path / record.METRICS_FILE)
        summary.update(status="failed", error=describe_failure(error),
                       steps=max(int(summary.get("steps") or 0), steps or 0))
        try:
            write_json_atomic(self.path / record.SUMMARY_FILE, summary)
        except OSError:
            logging.getLogger("dflash_lab").error(f"could not record the failure in {record.SUMMARY_FILE}")

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
        """A fresh start in a directory that holds records of steps that ran but no checkpoint to continue from
        would replace them: refused unless ``overwrite=true``. That is a run that ended (finished, failed after
        its first step, preempted), and a run stopped while running (kill -9, a lost node) whose summary says it
        had written a checkpoint (``checkpoint_step``) that is gone now. Records of an attempt that died before its
        first checkpoint (status running without ``checkpoint_step``, or no summary: a kill, a lost node, a Slurm
        requeue) or that failed before its first step are of this same run: the restart computes the same steps,
        so they are dropped with a log line."""
        metrics = self.path / record.METRICS_FILE
        summary_path = self.path / record.SUMMARY_FILE
        if not ((metrics.is_file() and metrics.stat().st_size > 0) or summary_path.is_file()):
            return
        if overwrite:
            log.warning(f"overwrite=true: replacing the records of the earlier run in {self.path}")
            return
        summary = self.summary() or {}
        status, checkpointed = summary.get("status"), summary.get("checkpoint_step")
        if status not in ("finished", "failed", "preempted") and not checkpointed:
            log.warning("an earlier attempt ended before its first checkpoint: its rows are dropped and the run "
                        "starts over")
            return
        if status == "failed" and summary.get("steps") == 0:
            log.warning(f"an earlier attempt failed before its first step ({summary.get('error')}): the run starts "
                        f"over")
            return
        if status == "finished" and summary.get("steps") == 0 and not last_metrics_step(metrics):
            log.info("an earlier launch trained no step (trainer.max_steps=0): the run starts over")
            return
        steps = max(int(summary.get("steps") or 0), last_metrics_step(metrics) or 0)
        what = (f"a run that ended (status {status})" if status in ("finished", "failed", "preempted")
                else f"a run stopped while running (its checkpoint of step {checkpointed} was written)")
        raise RunRecordsAtRisk(
            f"{self.path} holds the records of {what} but no checkpoint to continue from: starting fresh would "
            f"replace the records of its {steps} steps. Use another directory (hydra.run.dir=<new dir>), restore "
            f"its checkpoints/, or pass overwrite=true to replace them")

    def wandb_run_id(self, from_checkpoint: str | None, log: logging.Logger) -> str:
        """The W&B run id of this segment (rank 0, once its records open): a continuation keeps the checkpoint's;
        a fresh start gets a new one, and the offline W&B runs of the records it replaces (``wandb/``) are
        removed, so a replaced run never logs into the old W&B run nor is read back as the new one."""
        if self.fresh_start:
            old = self.path / record.WANDB_DIR
            if old.is_dir() and any(old.iterdir()):
                shutil.rmtree(old)
                log.info(f"fresh start: removed the W&B files of the earlier records ({old})")
            (self.path / record.WANDB_ID_FILE).unlink(missing_ok=True)
        return load_or_create_run_id(self.path, from_checkpoint)

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


def last_metrics_step(path: Path, tail_bytes: int = 1 << 16) -> int | None:
    """The step of the last usable row of ``metrics.jsonl`` (its tail only: a long run's file is not read whole);
    None when there is none."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(handle.seek(0, 2) - tail_bytes, 0))
            lines = handle.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and record.valid_step(row.get("step")):
            return int(row["step"])
    return None


class RunRecordsAtRisk(Refused, ValueError):
    """A launch would replace the records of steps that ran (no checkpoint to continue from): refused unless
    ``overwrite=true``."""


def check_records_cover(step: int, history: list[dict[str, Any]], probed_steps: set[int],
                        last_probe_step: int | None, presentations_problem: str | None, *,
                        probed_steps_expected: list[int] | None = None, tau_steps: set[int] | None = None,
                        tau_steps_expected: list[int] | None = None,
                        probe_bands: Mapping[int, set[int]] | None = None,
                        probe_bands_expected: list[int] | None = None,
                        incomplete_rows: Mapping[str, Mapping[int, list[str]]] | None = None,
                        mistyped_rows: Mapping[str, Mapping[int, Mapping[str, Any]]] | None = None,
                        unusable_lines: Mapping[str, Sequence[tuple[int, str]]] | None = None) -> None:
    """On resume from a checkpoint of ``step``: the side files must hold the run up to it (every metrics row
    1..step, once each, and every row of the JSON-lines files with all its file's columns (``incomplete_rows``:
    file name -> {step: the columns its rows lack}, ``RunLogger.incomplete_rows``), each of the type the trainer
    writes (``mistyped_rows``: file name -> {step: {column: value}}, ``RunLogger.mistyped_rows``); every probe
    evaluation and tau measurement the checkpoint's run had written, or, for checkpoints that do not list them, the
    probe evaluation of its last probe step; every band of each probe evaluation (``probe_bands``: step -> bands
    held; ``probe_bands_expected``: the bands each evaluation wrote, from the checkpoint; else every band seen at
    any step); presentations as many rows as it had written); otherwise the run would end "finished" with holes or
    values it cannot compute with in its records, so it is refused, naming each file, before any file is changed.
    A refusal also names the lines read as no row (``unusable_lines``: file name -> [(line number, why)],
    ``RunLogger.unusable_lines``): a line that held a step the checkpoint covers is why that step is missing.

    Example:
        >>> check_records_cover(2, [{"step": 1}, {"step": 2}], {0}, 0, None, probed_steps_expected=[0],
        ...                     tau_steps={2}, tau_steps_expected=[2])
        >>> check_records_cover(2, [{"step": 1}, {"step": 2}], {2}, 2, None, probed_steps_expected=[0, 2])
        Traceback (most recent call last):
        ...
        dflash_lab.records.run_dir.RunRecordsAtRisk: resume from the checkpoint of step 2: probes.jsonl lacks the probe evaluations of steps [0]. ...
        >>> check_records_cover(2, [{"step": 1}, {"step": 2}], {0, 2}, 2, None, probe_bands={0: {0, 1}, 2: {0}},
        ...                     probe_bands_expected=[0, 1])
        Traceback (most recent call last):
        ...
        dflash_lab.records.run_dir.RunRecordsAtRisk: resume from the checkpoint of step 2: probes.jsonl lacks band rows of probe evaluations: step 2 holds bands [0] of [0, 1] (missing [1]). ...
        >>> check_records_cover(2, [{"step": 1}, {"step": 2}], set(), None, None,
        ...                     incomplete_rows={"metrics.jsonl": {2: ["loss", "acc"]}})
        Traceback (most recent call last):
        ...
        dflash_lab.records.run_dir.RunRecordsAtRisk: resume from the checkpoint of step 2: metrics.jsonl's row of step 2 lacks the columns loss, acc (every row holds the 21 of record.STEP_FIELDS). ...
        >>> check_records_cover(2, [{"step": 1}, {"step": 2}], set(), None, None,
        ...                     mistyped_rows={"metrics.jsonl": {2: {"loss": [1.5, 2.0]}}})
        Traceback (most recent call last):
        ...
        dflash_lab.records.run_dir.RunRecordsAtRisk: resume from the checkpoint of step 2: metrics.jsonl's row of step 2 holds loss [1.5, 2.0] where the trainer writes a number or null. ...
        >>> check_records_cover(2, [{"step": 1}], set(), None, None,
        ...                     unusable_lines={"metrics.jsonl": [(2, 'its step "2" is not a step number')]})
        Traceback (most recent call last):
        ...
        dflash_lab.records.run_dir.RunRecordsAtRisk: resume from the checkpoint of step 2: metrics.jsonl holds 1 of the 2 steps up to it (missing [2]); metrics.jsonl line 2 is read as no row: its step "2" is not a step number. ...
    """
    problems = [_metrics_problem(step, history)]
    problems += [_incomplete_rows_problem(name, lacking) for name, lacking in (incomplete_rows or {}).items()]
    problems += [_mistyped_rows_problem(name, mistyped) for name, mistyped in (mistyped_rows or {}).items()]
    wanted = set(probed_steps_expected or []) | ({last_probe_step} if last_probe_step is not None else set())
    if wanted - probed_steps:
        problems.append(f"{record.PROBES_FILE} lacks the probe evaluations of steps {_some(sorted(wanted - probed_steps))}")
    problems.append(_probe_bands_problem(probe_bands or {}, probe_bands_expected))
    lacking_tau = set(tau_steps_expected or []) - set(tau_steps or ())
    if lacking_tau:
        problems.append(f"{record.TAU_FILE} lacks the tau measurements of steps {_some(sorted(lacking_tau))}")
    problems = [problem for problem in [*problems, presentations_problem] if problem]
    if problems:   # lines read as no row are repaired when the resume goes on; here they may be why a step is missing
        problems += [_unusable_lines_problem(name, lines) for name, lines in (unusable_lines or {}).items() if lines]
        raise RunRecordsAtRisk(
            f"resume from the checkpoint of step {step}: {'; '.join(problems)}. The run's records are incomplete "
            f"or damaged: restore them (e.g. from a backup of the run directory), or start a fresh run directory "
            f"(hydra.run.dir=<new dir>)")


def _metrics_problem(step: int, history: list[dict[str, Any]]) -> str | None:
    """What is wrong with ``metrics.jsonl`` up to ``step`` (a step missing, or a step written twice), or None.

    Example:
        >>> _metrics_problem(3, [{"step": 1}, {"step": 2}, {"step": 2}, {"step": 3}])
        'metrics.jsonl holds step [2] twice (4 rows for the 3 steps up to it)'
    """
    steps = [int(row["step"]) for row in history]
    if steps == list(range(1, step + 1)):
        return None
    missing = sorted(set(range(1, step + 1)) - set(steps))
    if missing:
        return (f"{record.METRICS_FILE} holds {len(set(steps) & set(range(1, step + 1)))} of the {step} steps up "
                f"to it (missing {_some(missing)})")
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    if repeated:
        return (f"{record.METRICS_FILE} holds step {_some(repeated)} twice ({len(steps)} rows for the {step} steps "
                f"up to it)")
    return f"{record.METRICS_FILE} holds its {step} steps out of order"


COLUMNS_OF = {record.METRICS_FILE: ("STEP_FIELDS", record.STEP_FIELDS),
              record.PROBES_FILE: ("PROBE_FIELDS", record.PROBE_FIELDS),
              record.TAU_FILE: ("TAU_FIELDS", record.TAU_FIELDS)}


def _incomplete_rows_problem(name: str, lacking: Mapping[int, list[str]], shown: int = 3) -> str | None:
    """Rows of the JSON-lines file ``name`` that lack columns (``record.rows_lacking``), named by step, or None.

    Example:
        >>> _incomplete_rows_problem("tau.jsonl", {8: ["tau_se"], 4: ["tau_se", "tau_prompts"]})
        'tau.jsonl holds rows without all their columns: step 4 lacks tau_se, tau_prompts; step 8 lacks tau_se (every row holds the 7 of record.TAU_FIELDS)'
    """
    if not lacking:
        return None
    steps = sorted(lacking)
    constant, columns = COLUMNS_OF.get(name, ("", ()))
    of = f" (every row holds the {len(columns)} of record.{constant})" if constant else ""

    def listed(missing: list[str]) -> str:
        return ", ".join(missing) if len(missing) <= 8 else f"{', '.join(missing[:8])} and {len(missing) - 8} more"

    if len(steps) == 1:
        return f"{name}'s row of step {steps[0]} lacks the columns {listed(lacking[steps[0]])}{of}"
    described = "; ".join(f"step {s} lacks {listed(lacking[s])}" for s in steps[:shown])
    more = f"; and {len(steps) - shown} more steps ({_some(steps[shown:])})" if len(steps) > shown else ""
    return f"{name} holds rows without all their columns: {described}{more}{of}"


def _mistyped_rows_problem(name: str, mistyped: Mapping[int, Mapping[str, Any]], shown: int = 3) -> str | None:
    """Rows of the JSON-lines file ``name`` that hold a value of another type than the trainer writes
    (``record.rows_mistyped``), named by step and column with the value and the type the column takes, or None.

    Example:
        >>> _mistyped_rows_problem("metrics.jsonl", {5: {"epoch": "0"}, 4: {"loss": [1.5], "clipped": 1}})
        'metrics.jsonl holds values of another type than the trainer writes: step 4 holds loss [1.5] (a number or null), clipped 1 (true, false or null); step 5 holds epoch "0" (a number or null)'
    """
    if not mistyped:
        return None
    steps = sorted(mistyped)
    if len(steps) == 1 and len(mistyped[steps[0]]) == 1:
        ((column, value),) = mistyped[steps[0]].items()
        return (f"{name}'s row of step {steps[0]} holds {column} {record.shown_value(value)} where the trainer "
                f"writes {record.column_type(column)}")

    def listed(values: Mapping[str, Any]) -> str:
        return ", ".join(f"{column} {record.shown_value(value)} ({record.column_type(column)})"
                         for column, value in values.items())

    described = "; ".join(f"step {s} holds {listed(mistyped[s])}" for s in steps[:shown])
    more = f"; and {len(steps) - shown} more steps ({_some(steps[shown:])})" if len(steps) > shown else ""
    return f"{name} holds values of another type than the trainer writes: {described}{more}"


def _unusable_lines_problem(name: str, lines: Sequence[tuple[int, str]], shown: int = 3) -> str:
    """The lines of the JSON-lines file ``name`` read as no row (``record.read_jsonl_lines``), by number and why.

    Example:
        >>> _unusable_lines_problem("tau.jsonl", [(1, "not JSON (e.g. a line torn by a kill)")])
        'tau.jsonl line 1 is read as no row: not JSON (e.g. a line torn by a kill)'
    """
    if len(lines) == 1:
        return f"{name} line {lines[0][0]} is read as no row: {lines[0][1]}"
    described = "; ".join(f"line {number}: {why}" for number, why in lines[:shown])
    more = f"; and {len(lines) - shown} more lines" if len(lines) > shown else ""
    return f"{name} has lines read as no row ({described}{more})"


def _probe_bands_problem(probe_bands: Mapping[int, set[int]], expected: list[int] | None) -> str | None:
    """Probe evaluations that lack some of their band rows (a row deleted or torn), or None."""
    bands = set(expected) if expected is not None else set().union(*probe_bands.values()) if probe_bands else set()
    short = {s: held for s, held in sorted(probe_bands.items()) if bands - held}
    if not short:
        return None
    described = [f"step {s} holds bands {sorted(held)} of {sorted(bands)} (missing {sorted(bands - held)})"
                 for s, held in list(short.items())[:5]]
    more = f" and {len(short) - 5} more steps" if len(short) > 5 else ""
    return f"{record.PROBES_FILE} lacks band rows of probe evaluations: {'; '.join(described)}{more}"


def _some(steps: list[int], shown: int = 10) -> str:
    """A list of steps, cut after ``shown`` with the count of the rest."""
    return str(steps) if len(steps) <= shown else f"{steps[:shown]} and {len(steps) - shown} more"
