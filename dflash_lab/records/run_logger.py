"""Writing a run directory: the append-only files, summary.json, per-rank text logs, and W&B.

Rules:
    * only rank 0 writes run files and talks to W&B (:class:`RunLogger` is a no-op sink on other ranks);
    * every rank writes its own text log ``train_rank<r>.log`` (:func:`setup_text_log`);
    * names and columns of every file come from :mod:`dflash_lab.records.record`; W&B receives the same names.

Exact under faults: on start, :class:`RunLogger` applies the record's one resume rule to metrics.jsonl,
probes.jsonl and tau.jsonl (keep rows with ``step <=`` the checkpoint's step; a fresh start keeps none), dropping
unusable lines with a count in the log. The trainer reads them first and changes nothing (``read_only=True``) until
the resume check passed (:meth:`RunLogger.start`): a refused resume leaves every file as it was and starts no W&B
run. After that every row is appended and flushed as it is produced (a kill loses nothing that a later resume would
keep), so no step ever appears twice.

W&B names (what a sweep's runs look like side by side): per-step values as ``train/<field>`` with ``step`` and a
cumulative ``tokens_seen`` as axes, probe values as ``probe/<lo>-<hi>/<loss|acc>`` (the band's length range), the
final figures as ``final/<field>`` summary keys; the run config carries the resolved boundaries and bucket count
as scalars under ``resolved``. Run name, group and tags are set by the trainer's Hydra entry point.

W&B never stops training: :class:`WandbSink` catches every exception from ``wandb.init``/``log``/``finish``, warns
once, and from then on the run continues with local files only. The run id lives in ``wandb_run_id.txt`` (and in
checkpoints) so a continuation reuses it (``resume="allow"``).

Example:
    >>> import tempfile, pathlib
    >>> from dflash_lab.records.record import STEP_FIELDS
    >>> run_dir = pathlib.Path(tempfile.mkdtemp())
    >>> logger = RunLogger(run_dir, is_main=True, resume_step=None)
    >>> logger.log_step({name: 1 for name in STEP_FIELDS})
    >>> logger.close()
    >>> (run_dir / "metrics.jsonl").read_text().count("\\n")
    1
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import warnings
from pathlib import Path
from typing import Any

from dflash_lab.records.record import (
    METRICS_FILE, PROBE_FIELDS, PROBES_FILE, RUN_FILES, STEP_FIELDS, SUMMARY_FILE, TAU_FIELDS, TAU_FILE,
    WANDB_ID_FILE,
    is_number, json_safe, rank_log_name, read_jsonl_lines, rows_lacking, rows_mistyped, rows_through,
)

LOGGER_NAME = "dflash_lab"


def setup_text_log(run_dir: Path | str, rank: int) -> logging.Logger:
    """Attach ``<run_dir>/train_rank<r>.log`` to the ``dflash_lab`` logger (once per file) and return it."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    path = (Path(run_dir) / rank_log_name(rank)).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    for handler in list(logger.handlers):
        if getattr(handler, "_dflash_rank_log", False):
            if Path(handler.baseFilename) == path:
                return logger
            logger.removeHandler(handler)  # a previous run in the same process: log to the new run dir
            handler.close()
    handler = logging.FileHandler(path, mode="a")
    handler._dflash_rank_log = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s"))
    logger.addHandler(handler)
    return logger


def close_text_log() -> None:
    """Detach and close the per-rank log file handler (end of a run; lets tests delete the directory)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        if getattr(handler, "_dflash_rank_log", False):
            logger.removeHandler(handler)
            handler.close()


def write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    """Write a JSON file through a temporary file and a rename (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: json_safe(v) for k, v in obj.items()}, indent=2) + "\n")
    os.replace(tmp, path)


def kept_rows(path: Path, last_step: int | None) -> tuple[list[dict[str, Any]], int, list[tuple[int, str]]]:
    """The resume rule applied to one JSON-lines file, read only: (kept rows, removed rows, unusable lines as (line
    number, why): ``record.read_jsonl_lines``)."""
    rows, unusable = read_jsonl_lines(path)
    kept = rows_through(rows, last_step)
    return list(kept), len(rows) - len(kept), unusable


def rewrite_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a JSON-lines file by ``rows`` through a temporary copy and a rename (a reader never sees half a
    file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, path)


class WandbSink:
    """Weights & Biases behind a guard: any exception warns once and disables W&B; training goes on.

    Args:
        run_dir: the run directory; W&B files go to ``<run_dir>/wandb``.
        settings: the ``logger`` section: ``mode`` (offline | online | disabled), ``project``, ``entity``,
            ``group``, ``job_type``, ``name``, ``tags``.
        config: the full resolved run config (a plain dict).
        run_id: the W&B run id to create or continue.
        log: text logger for the one warning.
    """

    def __init__(self, run_dir: Path, settings: dict[str, Any], config: dict[str, Any], run_id: str,
                 log: logging.Logger):
        self.log = log
        self.run = None
        self.failed = False
        try:
            os.environ["WANDB_DIR"] = str(run_dir)
            import wandb

            self.run = wandb.init(
                project=settings.get("project") or "dflash_lab",
                entity=settings.get("entity"),
                group=settings.get("group"),
                job_type=settings.get("job_type"),
                name=settings.get("name"),
                tags=list(settings.get("tags") or []),
                config=config,
                id=run_id,
                resume="allow",
                mode=settings.get("mode") or "offline",
                dir=str(run_dir),
                reinit="finish_previous",
            )
            # metrics are indexed by our own "step" field, so a resumed run may re-log a step
            self.run.define_metric("step")
            self.run.define_metric("tokens_seen")
            self.run.define_metric("train/*", step_metric="step")
            self.run.define_metric("probe/*", step_metric="step")
        except Exception as exc:  # noqa: BLE001 - any W&B problem must leave training running
            self._fail("init", exc)

    def _fail(self, where: str, exc: BaseException) -> None:
        if not self.failed:
            message = f"W&B {where} failed ({type(exc).__name__}: {exc}); continuing with local run files only"
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            self.log.warning(message)
        self.failed = True
        self.run = None

    @property
    def active(self) -> bool:
        return self.run is not None and not self.failed

    def call(self, where: str, fn, *args, **kwargs) -> None:
        """Run one W&B call; a failure disables W&B for the rest of the run."""
        if not self.active:
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self._fail(where, exc)

    def log_row(self, row: dict[str, Any]) -> None:
        self.call("log", lambda: self.run.log(row))

    def update_summary(self, summary: dict[str, Any]) -> None:
        self.call("summary", lambda: self.run.summary.update({k: v for k, v in summary.items() if v is not None}))

    def save_files(self, paths: list[Path], base_path: Path) -> None:
        """Attach run files to the W&B run, so analysis can read the exact tables from W&B."""
        def save() -> None:
            for path in paths:
                if Path(path).is_file():
                    self.run.save(str(path), base_path=str(base_path), policy="now")
        self.call("save", save)

    def finish(self, exit_code: int = 0) -> None:
        self.call("finish", lambda: self.run.finish(exit_code=exit_code))
        self.run = None


def load_or_create_run_id(run_dir: Path, from_checkpoint: str | None = None) -> str:
    """The W&B run id of this run directory: the checkpoint's, else ``wandb_run_id.txt``, else a new one (saved)."""
    path = Path(run_dir) / WANDB_ID_FILE
    run_id = from_checkpoint or (path.read_text().strip() if path.is_file() else "")
    if not run_id:
        run_id = secrets.token_hex(4)
    path.write_text(run_id + "\n")
    return run_id


class RunLogger:
    """Rank 0's writer of metrics.jsonl, probes.jsonl, tau.jsonl and summary.json, with its W&B sink.

    Args:
        run_dir: the run directory.
        is_main: False on ranks > 0: every method is then a no-op.
        resume_step: the step of the checkpoint being resumed (None: a fresh start). Files are trimmed to it.
        wandb_settings: the ``logger`` section for W&B, or None (no W&B).
        config: the full resolved config (for W&B).
        run_id: W&B run id (see :func:`load_or_create_run_id`).
        log: text logger.
        read_only: read the files as the resume rule keeps them, and change nothing (no file trimmed, no W&B run)
            until :meth:`start`, which then takes the W&B arguments: the trainer checks the rows first, so a
            refused resume leaves the directory as it was.

    Attributes:
        history: metrics rows of the whole run so far (all segments), for the summary.
        probed_steps: steps at which probe rows exist (a step is never probed twice).
        probe_bands: step -> the bands its probe rows hold (one row per band of an evaluation).
        tau_steps: steps at which tau.jsonl rows exist.
        tau_rows: step -> its tau.jsonl row (what a measurement of the draft at that step found).
        incomplete_rows: file name -> {step: the columns its kept rows lack} (files whose rows are whole are left
            out): the resume check refuses them (``run_dir.check_records_cover``).
        mistyped_rows: file name -> {step: {column: value}} of kept rows that hold a value of another type than the
            trainer writes (``record.rows_mistyped``; files without any are left out): refused the same way.
        unusable_lines: file name -> [(line number, why)] of the lines read as no row (``record.read_jsonl_lines``;
            files without any are left out): removed by :meth:`start`, named by a refusal.
    """

    def __init__(self, run_dir: Path | str, *, is_main: bool, resume_step: int | None,
                 wandb_settings: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
                 run_id: str | None = None, log: logging.Logger | None = None, read_only: bool = False):
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.resume_step = resume_step
        self.log = log or logging.getLogger(LOGGER_NAME)
        self.history: list[dict[str, Any]] = []
        self.probed_steps: set[int] = set()
        self.probe_bands: dict[int, set[int]] = {}
        self.tau_steps: set[int] = set()
        self.tau_rows: dict[int, dict[str, Any]] = {}
        self.incomplete_rows: dict[str, dict[int, list[str]]] = {}
        self.mistyped_rows: dict[str, dict[int, dict[str, Any]]] = {}
        self.unusable_lines: dict[str, list[tuple[int, str]]] = {}
        self.tokens_seen = 0
        self.wandb: WandbSink | None = None
        # file name -> what the resume rule keeps of it (rows, rows removed, unusable lines), written by start()
        self._kept: dict[str, tuple[list[dict[str, Any]], int, list[tuple[int, str]]]] = {}
        if not is_main:
            return
        self._kept = {name: kept_rows(self.run_dir / name, resume_step)
                      for name in (METRICS_FILE, PROBES_FILE, TAU_FILE)}
        self.history = self._kept[METRICS_FILE][0]
        probes, taus = self._kept[PROBES_FILE][0], self._kept[TAU_FILE][0]
        for row in probes:   # a band of another type is refused by name (mistyped_rows), not counted as one
            band = row.get("band")
            self.probe_bands.setdefault(int(row["step"]), set()).update([band] if is_number(band) else [])
        self.probed_steps = set(self.probe_bands)
        self.tau_rows = {int(row["step"]): row for row in taus}
        self.tau_steps = set(self.tau_rows)
        columns = {METRICS_FILE: STEP_FIELDS, PROBES_FILE: PROBE_FIELDS, TAU_FILE: TAU_FIELDS}
        lacking = {name: rows_lacking(self._kept[name][0], columns[name]) for name in columns}
        self.incomplete_rows = {name: steps for name, steps in lacking.items() if steps}
        mistyped = {name: rows_mistyped(self._kept[name][0], columns[name]) for name in columns}
        self.mistyped_rows = {name: steps for name, steps in mistyped.items() if steps}
        self.unusable_lines = {name: read[2] for name, read in self._kept.items() if read[2]}
        if not read_only:
            self.start(wandb_settings=wandb_settings, config=config, run_id=run_id)

    def start(self, *, wandb_settings: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
              run_id: str | None = None) -> None:
        """Apply the resume rule to the files (rows after ``resume_step`` and unusable lines removed, with a log
        line) and start W&B (arguments as the constructor's): from here on the run writes its records."""
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name, (rows, removed, unusable) in self._kept.items():
            path = self.run_dir / name
            if path.is_file() and (removed or unusable or self.resume_step is None):
                rewrite_jsonl(path, rows)
        self.tokens_seen = int(sum(row.get("real_tokens") or 0 for row in self.history))
        removed = {name: kept[1] for name, kept in self._kept.items()}
        if sum(removed.values()):
            self.log.info(f"resume: removed {removed[METRICS_FILE]} metric and {removed[PROBES_FILE]} probe rows "
                          f"logged after step {self.resume_step} (they are run again)"
                          + (f"; and {removed[TAU_FILE]} tau row(s)" if removed[TAU_FILE] else ""))
        if self.unusable_lines:   # e.g. the last line, torn by a kill (one of a step the checkpoint covers is refused)
            self.log.warning("repaired (e.g. a line torn by a kill): "
                             + "; ".join(f"skipped {len(lines)} unusable line(s) in {name}, removed from the file"
                                         for name, lines in self.unusable_lines.items()))
        if wandb_settings is not None and wandb_settings["mode"] != "disabled":
            self.wandb = WandbSink(self.run_dir, wandb_settings, config or {}, run_id or secrets.token_hex(4),
                                   self.log)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_FILE

    @property
    def probes_path(self) -> Path:
        return self.run_dir / PROBES_FILE

    @property
    def tau_path(self) -> Path:
        return self.run_dir / TAU_FILE

    @property
    def summary_path(self) -> Path:
        return self.run_dir / SUMMARY_FILE

    @staticmethod
    def _append(path: Path, rows: list[dict[str, Any]]) -> None:
        with open(path, "a") as handle:
            handle.write("".join(json.dumps(row) + "\n" for row in rows))
            handle.flush()

    def log_step(self, row: dict[str, Any]) -> None:
        """Append one metrics.jsonl row (exactly STEP_FIELDS) and send it to W&B."""
        if not self.is_main:
            return
        missing = [name for name in STEP_FIELDS if name not in row]
        if missing:
            raise KeyError(f"metrics row lacks {missing}; every row carries exactly {STEP_FIELDS}")
        clean = {name: json_safe(row[name]) for name in STEP_FIELDS}
        self._append(self.metrics_path, [clean])
        self.history.append(clean)
        self.tokens_seen += int(clean["real_tokens"] or 0)
        if self.wandb is not None:
            self.wandb.log_row({"step": clean["step"], "tokens_seen": self.tokens_seen,
                                **{f"train/{k}": v for k, v in clean.items() if k != "step"}})

    def log_probes(self, rows: list[dict[str, Any]]) -> None:
        """Append probes.jsonl rows of one evaluation; W&B gets ``probe/<lo>-<hi>/loss`` and ``.../acc``."""
        if not self.is_main or not rows:
            return
        clean = [{name: json_safe(row[name]) for name in PROBE_FIELDS} for row in rows]
        self._append(self.probes_path, clean)
        self.probed_steps.add(int(clean[0]["step"]))
        self.probe_bands.setdefault(int(clean[0]["step"]), set()).update(row["band"] for row in clean)
        if self.wandb is not None:
            flat: dict[str, Any] = {"step": clean[0]["step"], "tokens_seen": self.tokens_seen}
            for row in clean:
                flat[f"probe/{row['band_lo']}-{row['band_hi']}/loss"] = row["loss"]
                flat[f"probe/{row['band_lo']}-{row['band_hi']}/acc"] = row["acc"]
            self.wandb.log_row(flat)

    def log_tau(self, row: dict[str, Any]) -> None:
        """Append one tau.jsonl row (exactly TAU_FIELDS); W&B gets ``tau/mean``, ``tau/band_min`` and
        ``tau/band<i>``."""
        if not self.is_main:
            return
        clean = {name: json_safe(row[name]) for name in TAU_FIELDS}
        self._append(self.tau_path, [clean])
        self.tau_steps.add(int(clean["step"]))
        self.tau_rows[int(clean["step"])] = clean
        if self.wandb is not None:
            self.wandb.log_row({"step": clean["step"], "tokens_seen": self.tokens_seen, "tau/mean": clean["tau"],
                                "tau/band_min": clean["tau_band_min"],
                                **{f"tau/band{i}": t for i, t in enumerate(clean["tau_by_band"] or [])}})

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write summary.json atomically and mirror it to the W&B run summary as ``final/<key>``."""
        if not self.is_main:
            return
        write_json_atomic(self.summary_path, summary)
        if self.wandb is not None:
            self.wandb.update_summary({f"final/{k}": json_safe(v) for k, v in summary.items()
                                       if not isinstance(v, (dict, list))})

    def close(self, exit_code: int = 0) -> None:
        """Attach the run files to W&B and finish it."""
        if not self.is_main or self.wandb is None:
            return
        self.wandb.save_files([self.run_dir / name for name in RUN_FILES], self.run_dir)
        self.wandb.finish(exit_code)


__all__ = ["RunLogger", "WandbSink", "close_text_log", "kept_rows", "load_or_create_run_id", "rewrite_jsonl",
           "setup_text_log", "write_json_atomic"]
