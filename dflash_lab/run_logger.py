"""Run-directory logging: ``metrics.jsonl``, ``probes.jsonl``, ``summary.json``, per-rank text logs, and W&B.

Rules (ARCHITECTURE.md "Rules of the house"):
    * only rank 0 writes run files and talks to W&B (at the end it also attaches :data:`RUN_FILES` to the W&B run) (:class:`RunLogger` is a no-op sink on other ranks);
    * every rank writes its own text log ``train_rank{r}.log`` (:func:`setup_text_log`);
    * the field names of ``metrics.jsonl`` are :data:`METRIC_FIELDS`, exactly as docs/CONTRACTS.md lists them, and
      W&B receives the same names.

Cost: rows are buffered in memory and appended to disk only at :meth:`RunLogger.flush` (called at checkpoints and
at the end), so no per-step file flush slows training. Because a resumed run continues from its last checkpoint,
:func:`truncate_jsonl` removes rows a killed run logged after that checkpoint, so no step appears twice.

W&B never stops training: :class:`WandbSink` catches every exception from ``wandb.init``/``wandb.log``/``finish``,
warns once, and from then on the run continues with local files only. The run id is kept in
``<run_dir>/wandb_run_id.txt`` (and in checkpoints) so a resumed run continues the same W&B run
(``resume="allow"``); ``WANDB_DIR`` is set inside the run directory.

Example:
    >>> import tempfile, pathlib
    >>> run_dir = pathlib.Path(tempfile.mkdtemp())
    >>> logger = RunLogger(run_dir, is_main=True)
    >>> logger.log_step({name: 0 for name in METRIC_FIELDS})
    >>> logger.close()
    >>> (run_dir / "metrics.jsonl").read_text().count("\\n")
    1
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import warnings
from pathlib import Path
from typing import Any

METRIC_FIELDS = (
    "step",
    "epoch",
    "loss",
    "acc",
    "lr",
    "grad_norm",
    "real_tokens",
    "padded_tokens",
    "pad_eff",
    "batch_size",
    "max_len",
    "mean_len",
    "bucket",
    "sq_tokens",
    "step_time_s",
    "compute_time_s",
    "ktok_s",
    "eta_s",
)
"""Fields of one ``metrics.jsonl`` row, in order (docs/CONTRACTS.md)."""

PROBE_FIELDS = ("step", "band", "band_lo", "band_hi", "loss", "acc", "tokens")
"""Fields of one ``probes.jsonl`` row (docs/CONTRACTS.md)."""

SUMMARY_FIELDS = (
    "sampler",
    "seed",
    "steps",
    "epochs",
    "ktok_s",
    "pad_eff",
    "eta_s",
    "full_run_eta_s",
    "final_loss",
    "final_acc",
    "tau",
    "tau_baseline",
    "overhead_frac",
    "world_size",
    "status",
)
"""Fields of ``summary.json`` (docs/CONTRACTS.md)."""

STATUSES = ("finished", "failed", "running")

RUN_FILES = ("metrics.jsonl", "probes.jsonl", "presentations.parquet", "summary.json")
"""Run files attached to the W&B run at the end (analysis prefers them to the W&B history)."""


def json_safe(value: Any) -> Any:
    """A value JSON can hold strictly: non-finite floats become null, numpy/torch scalars become Python numbers."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def setup_text_log(run_dir: Path | str, rank: int, name: str = "dflash_lab") -> logging.Logger:
    """Attach ``<run_dir>/train_rank{rank}.log`` to the ``dflash_lab`` logger (once per file) and return it.

    Messages also propagate to the root logger, which Hydra sends to the console and ``train.log``.
    """
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    path = Path(run_dir) / f"train_rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    for handler in list(logger.handlers):
        if isinstance(handler, logging.FileHandler) and getattr(handler, "_dflash_rank_log", False):
            if Path(handler.baseFilename) == path.resolve():
                return logger
            logger.removeHandler(handler)  # a previous run in the same process: log to the new run dir
            handler.close()
    handler = logging.FileHandler(path, mode="a")
    handler._dflash_rank_log = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s"))
    logger.addHandler(handler)
    return logger


def close_text_log(name: str = "dflash_lab") -> None:
    """Detach and close the per-rank log file handler (end of a run; lets tests delete the directory)."""
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        if getattr(handler, "_dflash_rank_log", False):
            logger.removeHandler(handler)
            handler.close()


def truncate_jsonl(path: Path, max_step: int) -> int:
    """Keep only rows with ``step <= max_step`` (and drop a torn last line); returns the number of rows removed.

    Used on resume: rows logged after the checkpoint being resumed belong to steps that will be run again.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, removed = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            removed += 1  # a line cut by the kill
            continue
        if int(row.get("step", -1)) <= max_step:
            kept.append(line)
        else:
            removed += 1
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return removed


def write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    """Write a JSON file through a temporary file and a rename (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: json_safe(v) for k, v in obj.items()}, indent=2) + "\n")
    os.replace(tmp, path)


class WandbSink:
    """Weights & Biases behind a guard: any exception warns once and disables W&B; training goes on.

    Args:
        run_dir: the run directory; W&B files go to ``<run_dir>/wandb`` (``WANDB_DIR``).
        settings: the ``logger`` config group as a dict: ``mode`` (offline | online | disabled), ``project``,
            ``entity``, ``group``, ``job_type``, ``name``, ``tags``.
        config: the full resolved run config (a plain dict).
        run_id: the W&B run id to create or continue.
        log: text logger for the one warning.
    """

    def __init__(
        self,
        run_dir: Path,
        settings: dict[str, Any],
        config: dict[str, Any],
        run_id: str,
        log: logging.Logger,
    ):
        self.log = log
        self.run = None
        self.failed = False
        self.run_id = run_id
        try:
            os.environ["WANDB_DIR"] = str(run_dir)
            import wandb

            self._wandb = wandb
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
            # metrics are indexed by our own "step" field, so a resumed run may re-log a step without W&B
            # rejecting it for going backwards
            self.run.define_metric("step")
            self.run.define_metric("*", step_metric="step")
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
        """True while W&B is up and has not failed."""
        return self.run is not None and not self.failed

    def log_row(self, row: dict[str, Any]) -> None:
        """``run.log(row)``; a failure disables W&B for the rest of the run."""
        if not self.active:
            return
        try:
            self.run.log(row)
        except Exception as exc:  # noqa: BLE001
            self._fail("log", exc)

    def update_summary(self, summary: dict[str, Any]) -> None:
        """Copy the final figures into the W&B run summary."""
        if not self.active:
            return
        try:
            self.run.summary.update({k: v for k, v in summary.items() if v is not None})
        except Exception as exc:  # noqa: BLE001
            self._fail("summary", exc)

    def save_files(self, paths: list[Path], base_path: Path) -> None:
        """Attach run files (metrics.jsonl, probes.jsonl, presentations.parquet, summary.json) to the W&B run, so
        analysis can read the exact tables from W&B (offline: they are copied into the run's ``files/``)."""
        if not self.active:
            return
        try:
            for path in paths:
                if Path(path).is_file():
                    self.run.save(str(path), base_path=str(base_path), policy="now")
        except Exception as exc:  # noqa: BLE001
            self._fail("save", exc)

    def finish(self, exit_code: int = 0) -> None:
        """Close the W&B run (offline: its files stay under ``<run_dir>/wandb``)."""
        if not self.active:
            return
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as exc:  # noqa: BLE001
            self._fail("finish", exc)
        self.run = None


def load_or_create_run_id(run_dir: Path, from_checkpoint: str | None = None) -> str:
    """The W&B run id of this run directory: the checkpoint's, else ``wandb_run_id.txt``, else a new one (saved)."""
    path = Path(run_dir) / "wandb_run_id.txt"
    run_id = from_checkpoint or (path.read_text().strip() if path.is_file() else "")
    if not run_id:
        run_id = secrets.token_hex(4)
    path.write_text(run_id + "\n")
    return run_id


class RunLogger:
    """Rank 0's writer of ``metrics.jsonl`` / ``probes.jsonl`` / ``summary.json`` and its W&B sink.

    Args:
        run_dir: the run directory.
        is_main: False on ranks > 0: every method is then a no-op.
        wandb_settings: the ``logger`` group as a dict, or None for ``logger=none``.
        config: the full resolved config (for W&B).
        run_id: W&B run id (see :func:`load_or_create_run_id`).
        log: text logger for warnings.
    """

    def __init__(
        self,
        run_dir: Path | str,
        *,
        is_main: bool,
        wandb_settings: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        run_id: str | None = None,
        log: logging.Logger | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.log = log or logging.getLogger("dflash_lab")
        self._metric_rows: list[str] = []
        self._probe_rows: list[str] = []
        self.wandb: WandbSink | None = None
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if wandb_settings is not None and wandb_settings.get("mode", "offline") != "disabled":
            self.wandb = WandbSink(self.run_dir, wandb_settings, config or {}, run_id or secrets.token_hex(4), self.log)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def probes_path(self) -> Path:
        return self.run_dir / "probes.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.run_dir / "summary.json"

    def truncate_after(self, step: int) -> None:
        """Resume: drop rows of steps > `step` that an interrupted run logged after its last checkpoint."""
        if not self.is_main:
            return
        removed = truncate_jsonl(self.metrics_path, step) + truncate_jsonl(self.probes_path, step)
        if removed:
            self.log.info(f"resume: removed {removed} metric/probe rows logged after step {step}")

    def log_step(self, row: dict[str, Any]) -> None:
        """Buffer one ``metrics.jsonl`` row (exactly :data:`METRIC_FIELDS`) and send it to W&B."""
        if not self.is_main:
            return
        missing = [name for name in METRIC_FIELDS if name not in row]
        if missing:
            raise KeyError(f"metrics row lacks {missing}; every row must carry exactly {METRIC_FIELDS}")
        clean = {name: json_safe(row[name]) for name in METRIC_FIELDS}
        self._metric_rows.append(json.dumps(clean))
        if self.wandb is not None:
            self.wandb.log_row(clean)

    def log_probes(self, rows: list[dict[str, Any]]) -> None:
        """Buffer ``probes.jsonl`` rows; W&B gets them as ``probe/<band>/loss`` and ``probe/<band>/acc``."""
        if not self.is_main or not rows:
            return
        for row in rows:
            self._probe_rows.append(json.dumps({name: json_safe(row[name]) for name in PROBE_FIELDS}))
        if self.wandb is not None:
            flat: dict[str, Any] = {"step": rows[0]["step"]}
            for row in rows:
                flat[f"probe/{row['band']}/loss"] = json_safe(row["loss"])
                flat[f"probe/{row['band']}/acc"] = json_safe(row["acc"])
            self.wandb.log_row(flat)

    def flush(self) -> None:
        """Append buffered rows to disk (at checkpoints and at the end: no per-step file I/O)."""
        if not self.is_main:
            return
        for path, rows in ((self.metrics_path, self._metric_rows), (self.probes_path, self._probe_rows)):
            if rows:
                with open(path, "a") as handle:
                    handle.write("\n".join(rows) + "\n")
                rows.clear()

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json`` atomically (contract fields first) and mirror it to the W&B run summary."""
        if not self.is_main:
            return
        if summary.get("status") not in STATUSES:
            raise ValueError(f"summary status {summary.get('status')!r} is not one of {STATUSES}")
        ordered = {name: summary.get(name) for name in SUMMARY_FIELDS}
        ordered.update({k: v for k, v in summary.items() if k not in ordered})
        write_json_atomic(self.summary_path, ordered)
        if self.wandb is not None:
            self.wandb.update_summary({k: json_safe(v) for k, v in ordered.items()})

    def close(self, exit_code: int = 0) -> None:
        """Flush files and finish W&B."""
        if not self.is_main:
            return
        self.flush()
        if self.wandb is not None:
            self.wandb.save_files([self.run_dir / name for name in RUN_FILES], self.run_dir)
            self.wandb.finish(exit_code)
