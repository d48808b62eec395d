"""What a run writes to its directory and shows while it runs, one object each:

- :class:`RunRecords`: metric and probe rows (``RunLogger``: JSONL, W&B), presentations (one row per example
  seen, ``presentations.parquet``) and ``summary.json``, built from all of them by ``record.build_summary``; with
  data=jsonl, the lines the loader skipped (``data_skipped.jsonl``);
- :class:`Checkpointer`: the full state a restart needs (draft weights, optimizer, LR schedule, sampler position,
  anchor RNG, position and totals, the resolved config and its ``.hydra`` files, the data digest, the W&B run id);
- :class:`StepClock`: a step's time, the ETA, and the progress bar or log lines;
- :class:`Bookkeeping`: the one call the training loop makes after each step (records, clock, scheduled evaluation,
  checkpoints, preemption).

The files, their columns and the step numbering are defined in :mod:`dflash_lab.records.record`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from dflash_lab.records import checkpoint as ckpt
from dflash_lab.training import dist
from dflash_lab.records import record
from dflash_lab.training.components import Components
from dflash_lab.training.evaluation import Evaluation
from dflash_lab.metrics import gradients, throughput
from dflash_lab.training.probes import PresentationRecorder
from dflash_lab.records.run_dir import RunDirectory, check_records_cover
from dflash_lab.records.run_logger import RunLogger
from dflash_lab.training.settings import RunSettings
from dflash_lab.training.step import Position, StepResult


class RunRecords:
    """The run's record files as this segment writes them: metric and probe rows (``RunLogger``: JSONL, W&B),
    presentations (one row per example seen, ``presentations.parquet``) and ``summary.json`` built from all of
    them by ``record.build_summary``. On resume, rows logged after the checkpoint are dropped and the files must
    cover the run up to it."""

    def __init__(self, logger: RunLogger, presentations: PresentationRecorder | None, *, plan: record.PlanFacts,
                 identity: dict[str, Any], data_counts: dict[str, Any], ledger: record.TimeLedger,
                 steady_warmup_steps: int, warmup_steps: int, grad_clip: float):
        self.logger, self.presentations, self.plan = logger, presentations, plan
        self.identity, self.data_counts, self.ledger = identity, data_counts, ledger
        self.steady_warmup_steps = steady_warmup_steps
        self.warmup_steps, self.grad_clip = warmup_steps, grad_clip   # the LR schedule's W, trainer.grad_clip
        self.checkpoint_step: int | None = None   # the run's last checkpoint (summary.json: checkpoint_step)
        self.run_id: str | None = None            # this segment's W&B run id (rank 0; checkpoints keep it)

    @classmethod
    def open(cls, settings: RunSettings, env: dist.DistEnv, directory: RunDirectory, parts: Components,
             position: Position, checkpoint_extra: dict[str, Any] | None, checkpoint_run_id: str | None,
             ledger: record.TimeLedger, log: logging.Logger) -> RunRecords:
        """The records of this segment: checked to cover the run up to the checkpoint, then rows after it dropped
        and W&B started (``checkpoint_extra``: the resumed checkpoint's ``extra``, which says what the records held
        when it was written; ``checkpoint_run_id``: its W&B run id; both None on a fresh start). A refused resume
        changes no file: the check runs on the rows as read, before any file is trimmed or W&B is started."""
        logger = RunLogger(directory.path, is_main=env.is_main, resume_step=position.loaded_step, log=log,
                           read_only=True)
        # the file is resumed (rows after the checkpoint dropped) even when this segment records none; in memory
        # only (written at the next checkpoint), but a fresh start removes it
        presentations = PresentationRecorder(directory.path / record.PRESENTATIONS_FILE, parts.probes.bands)
        recording = settings.probes.presentations
        dropped = presentations.resume(position.loaded_step) if env.is_main else 0
        if env.is_main and position.loaded_step:
            expected = checkpoint_extra or {}
            problem = presentations.resume_problem or (
                f"{record.PRESENTATIONS_FILE} is missing or empty"
                if recording and presentations.covered_step() is None else None)
            rows = expected.get("presentation_rows")
            if recording and not problem and rows is not None and len(presentations) != rows:
                problem = (f"{record.PRESENTATIONS_FILE} holds {len(presentations)} rows up to step "
                           f"{position.loaded_step}, the checkpoint's run had written {rows} (steps "
                           f"{presentations.missing_steps(position.loaded_step)} lack theirs)")
            check_records_cover(position.loaded_step, logger.history, logger.probed_steps,
                                expected.get("last_probe_step"), problem,
                                probed_steps_expected=expected.get("probed_steps"),
                                tau_steps=logger.tau_steps, tau_steps_expected=expected.get("tau_steps"),
                                probe_bands=logger.probe_bands,
                                probe_bands_expected=expected.get("probe_bands"),
                                incomplete_rows=logger.incomplete_rows, mistyped_rows=logger.mistyped_rows,
                                unusable_lines=logger.unusable_lines)
        # the records are the run's: from here on they are written
        run_id = directory.wandb_run_id(checkpoint_run_id, log) if env.is_main else None
        wandb_settings, wandb_config = wandb_run_settings(settings, parts, env)
        logger.start(wandb_settings=wandb_settings, config=wandb_config, run_id=run_id)
        if env.is_main:
            if dropped:
                log.info(f"resume: removed {dropped} presentation rows logged after step {position.loaded_step}")
            if recording:
                presentations.warm_up()
            write_data_skipped(directory.path, parts.train_ds, log)
        records = cls(logger, presentations if recording else None, plan=parts.plan,
                      identity={**parts.identity(settings, env.world_size), **env.topology()},
                      data_counts=parts.data_counts(), ledger=ledger,
                      steady_warmup_steps=settings.trainer.steady_warmup_steps,
                      warmup_steps=parts.schedule.warmup_steps, grad_clip=settings.trainer.grad_clip)
        records.checkpoint_step = position.loaded_step or None
        records.run_id = run_id
        return records

    def step(self, step: int, epoch: int, result: StepResult, micro_batches: list[dict[str, Any]], policy,
             timing: StepClock) -> dict[str, Any]:
        """Record one step: its presentations and its metrics row (returned)."""
        if self.presentations is not None:
            self.presentations.record(
                np.concatenate([b["sample_index"].numpy() for b in micro_batches]),
                np.concatenate(result.doc_lengths), result.doc_correct.cpu().numpy(), result.doc_count.cpu().numpy(),
                epoch=epoch, step=step)
        step_time, eta = timing.step_done(step)
        row = record.step_row(step=step, epoch=epoch, stats=result.stats, lr=result.lr, grad_clip=self.grad_clip,
                              bucket=policy.bucket_of(micro_batches[0]["sample_index"].numpy()),
                              step_time_s=step_time, compute_time_s=result.compute_s, eta_s=eta)
        self.logger.log_step(row)
        return row

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` was written: ``summary.json`` (status running) says so and counts the steps, so
        a relaunch after a kill -9 that also lost ``checkpoints/`` knows that rows of steps that ran are at stake
        (``RunDirectory.check_fresh_start``)."""
        self.checkpoint_step = int(step)
        self.summary("running", steps=step)

    def summary(self, status: str, steps: int, **extra: Any) -> dict[str, Any]:
        """Write ``summary.json`` (rank 0) and return it. ``warmup_steps`` is the LR schedule's W; ``gradients``
        the gradient norm and clip fraction per bucket and phase (``metrics.gradients.gradient_stats``)."""
        gradient_rows = gradients.gradient_stats(self.logger.history, warmup=self.warmup_steps,
                                                 grad_clip=self.grad_clip, bands=self.identity["probe_bands"])
        summary = record.build_summary(self.logger.history, self.plan, self.ledger.totals, identity=self.identity,
                                       status=status, steps=steps, steady_warmup_steps=self.steady_warmup_steps,
                                       extra={**self.data_counts, "checkpoint_step": self.checkpoint_step,
                                              "warmup_steps": self.warmup_steps,
                                              "gradients": {"grad_clip": self.grad_clip, "rows": gradient_rows,
                                                            "grouped_by": gradients.grouped_by(
                                                                self.identity["boundaries"] is not None)},
                                              **extra},
                                       times=self.ledger.split())
        self.logger.write_summary(summary)
        return summary


def write_data_skipped(run_dir: Path, dataset, log: logging.Logger) -> Path | None:
    """Copy the data=jsonl loader's list of skipped lines (line number, reason, message) into the run directory as
    ``data_skipped.jsonl`` (empty: nothing skipped) and name it in the log; other kinds write nothing. Rewritten
    on resume with the same content (the data digest is checked first)."""
    rows = dataset.skipped_lines()
    if rows is None:
        return None
    path = Path(run_dir) / record.DATA_SKIPPED_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)
    if rows:
        log.warning(f"data: the {len(rows)} skipped line(s) of data.path, with their line numbers, reasons and "
                    f"messages: {path}")
    return path


def wandb_run_settings(settings: RunSettings, parts: Components,
                       env: dist.DistEnv) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The W&B settings with the tags a sweep's runs differ by (policy, K buckets, seed), and the config W&B records
    (the run's, with its overrides and what the policy resolved); no W&B: (None, the run's config)."""
    if settings.wandb is None:
        return None, settings.config
    policy, plan = parts.policy, parts.plan
    k = len(policy.boundaries) - 1 if policy.boundaries else None
    wandb_settings = dict(settings.wandb)
    wandb_settings["tags"] = list(dict.fromkeys([*(wandb_settings.get("tags") or []), policy.name,
                                                 *([f"K{k}"] if k else []), f"seed{settings.seed}"]))
    resolved = {"boundaries": str(policy.boundaries), "num_buckets": k, "steps_per_epoch": plan.steps_per_epoch[0],
                "end_step": plan.end_step}
    return wandb_settings, {**settings.config, "overrides": list(wandb_settings.get("overrides") or []),
                            "resolved": resolved}


class Checkpointer:
    """Saves the run's full state: draft weights, optimizer, LR schedule, sampler position, anchor RNG, position,
    run totals, the resolved config and its ``.hydra`` files, the data digest and the W&B run id. Collective
    (presentations are gathered from every rank); rank 0 writes."""

    def __init__(self, checkpoints: ckpt.CheckpointManager, settings: RunSettings, env: dist.DistEnv,
                 directory: RunDirectory, parts: Components, records: RunRecords, evaluation: Evaluation,
                 run_id: str | None, log: logging.Logger):
        self.checkpoints, self.settings, self.env, self.directory = checkpoints, settings, env, directory
        self.parts, self.records, self.evaluation, self.run_id, self.log = parts, records, evaluation, run_id, log

    def save(self, position: Position) -> Path | None:
        with self.records.ledger.part("checkpoint"):
            presentations = self.records.presentations
            if presentations is not None:
                presentations.gather(dist.all_gather_objects)
            if not self.env.is_main:
                return None
            if presentations is not None:
                presentations.write()
            self.records.ledger.save()   # the checkpoint's totals hold the run's wall time up to this save
            self.directory.keep_hydra_files(self.log)
            parts = self.parts
            path = self.checkpoints.save({
                "model": parts.model.draft_state_dict(), "optimizer": parts.optimizer.state_dict(),
                "schedule": parts.schedule.state_dict(),
                "sampler": parts.policy.state_dict(batches_consumed=position.consumed),
                "rng": ckpt.capture_rng_state(parts.anchor_generator), "step": position.step,
                "epoch": position.epoch, "config": self.settings.config,
                "data_digest": parts.train_ds.content_digest, "hydra_files": self.directory.launch_hydra_files,
                "wandb_run_id": self.run_id,
                "extra": {"totals": position.totals.state_dict(),
                          "last_probe_step": self.evaluation.last_probe_step,
                          # what the records hold now: a resume from this checkpoint checks them against it
                          "probed_steps": sorted(self.records.logger.probed_steps),
                          "probe_bands": self.evaluation.probe_bands(),
                          "tau_steps": sorted(self.records.logger.tau_steps),
                          "presentation_rows": len(presentations) if presentations is not None else None},
            }, step=position.step)
            self.records.checkpointed(position.step)
            return path

    def due(self, step: int) -> bool:
        """A scheduled save after ``step`` (every ``trainer.ckpt_every`` steps; the end saves anyway)."""
        every = self.settings.trainer.ckpt_every
        return bool(every) and step % every == 0 and step < self.parts.plan.end_step

    def latest(self) -> Path | None:
        return self.checkpoints.latest_path()


class StepClock:
    """A step's time (data wait, compute and bookkeeping; not the evaluation and saves after it), the ETA from its
    moving average, and what the user sees: a tqdm bar on a terminal, else a log line every ``log_every`` steps and
    at least every ``log_every_s`` seconds (the first step's line too: a Slurm log shows life within a minute, however
    slow the steps)."""

    def __init__(self, end_step: int, start_step: int, *, show_bar: bool, log_every: int, name: str,
                 log: logging.Logger, log_every_s: float = 0.0, clock: Callable[[], float] = time.perf_counter):
        self.end_step, self.show_bar, self.log_every, self.log = end_step, show_bar, log_every, log
        self.log_every_s, self.clock = log_every_s, clock
        self.bar = tqdm(total=end_step, initial=start_step, disable=not show_bar, desc=name, dynamic_ncols=True,
                        mininterval=1.0)
        self.ema_step_time = self.ema_ktok = None
        self.last_line: float | None = None   # when the last progress line was logged (None: none yet)
        self.started = clock()                 # the seconds to the first line count from here
        self.restart()

    def restart(self) -> None:
        """The next step's time starts now."""
        self.t_start = time.perf_counter()

    def step_done(self, step: int) -> tuple[float, float]:
        """The step's time and the run's ETA."""
        now = time.perf_counter()
        step_time, self.t_start = now - self.t_start, now
        self.ema_step_time = throughput.ema_update(self.ema_step_time, step_time)
        return step_time, throughput.eta_seconds(self.end_step - step, self.ema_step_time)

    def show(self, row: dict[str, Any], stats: record.StepStats) -> None:
        """The step on the bar, or its log line (``stats``: the loss as a float, NaN where the row holds None)."""
        self.ema_ktok = throughput.ema_update(self.ema_ktok, row["ktok_s"] or 0.0)
        eta = throughput.format_eta(row["eta_s"])
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{stats.loss:.3f}", acc=f"{stats.acc:.3f}", ktok_s=f"{self.ema_ktok:.1f}",
                             pad_eff=f"{row['pad_eff']:.2f}", eta=eta, refresh=False)
        step = row["step"]
        if not self.show_bar and self.line_due(step):
            self.last_line = self.clock()
            self.log.info(f"step {step}/{self.end_step} epoch {row['epoch']} loss {stats.loss:.4f} acc "
                          f"{stats.acc:.3f} {self.ema_ktok:.1f} Ktok/s pad_eff {row['pad_eff']:.2f} ETA {eta}")

    def line_due(self, step: int) -> bool:
        """A progress line after ``step``: every ``log_every`` steps, the last step, and when ``log_every_s``
        seconds passed since the last line (or since the clock started, for the first one)."""
        if step % self.log_every == 0 or step == self.end_step:
            return True
        since = self.clock() - (self.last_line if self.last_line is not None else self.started)
        return self.log_every_s > 0 and since >= self.log_every_s

    def close(self) -> None:
        self.bar.close()


class Bookkeeping:
    """Everything the training loop does after an optimizer step that is not training, behind one call
    (:meth:`after_step`): the step's records and what the user sees, the scheduled evaluation, a requested
    checkpoint-and-exit (preemption) and the scheduled checkpoints."""

    def __init__(self, *, records: RunRecords, evaluation: Evaluation, checkpointer: Checkpointer, clock: StepClock,
                 policy, end_step: int, is_main: bool, log: logging.Logger,
                 after_step: Callable[[dict[str, Any]], None] | None = None):
        self.records, self.evaluation, self.checkpointer, self.clock = records, evaluation, checkpointer, clock
        self.policy, self.end_step, self.is_main, self.log, self.after_step_hook = (policy, end_step, is_main, log,
                                                                                     after_step)

    def after_step(self, position: Position, epoch: int, result: StepResult,
                   micro_batches: list[dict[str, Any]]) -> None:
        """Record the step that brought the run to ``position.step``, then evaluate, checkpoint or exit for a
        requeue as scheduled (raises ``checkpoint.Preempted`` after a requested checkpoint)."""
        step = position.step
        row = self.records.step(step, epoch, result, micro_batches, self.policy, self.clock)
        if self.is_main:
            self.clock.show(row, result.stats)
        if self.after_step_hook is not None:
            self.after_step_hook(row)
        self.evaluation.after_step(step, self.end_step)
        if result.stats.stop_requested:
            self.preempt(position)
        if self.checkpointer.due(step):
            self.checkpointer.save(position)
        self.clock.restart()   # the next step's time starts after this one's evaluation and saves

    def preempt(self, position: Position) -> None:
        """A checkpoint was requested (SIGUSR2/SIGTERM on some rank): save, record, and exit for a requeue."""
        path = self.checkpointer.save(position)
        self.log.warning(f"checkpoint requested ({ckpt.request_reason() or 'another rank'}): saved step "
                         f"{position.step} to {path}; exiting with code {ckpt.PREEMPTED_EXIT_CODE} for a requeue")
        self.records.summary("preempted", steps=position.step)   # a requeue (or a relaunch) continues it
        self.records.logger.close(exit_code=ckpt.PREEMPTED_EXIT_CODE)
        self.clock.close()
        ckpt.run_previous_handler()  # e.g. submitit's requeue (it may exit here on rank 0)
        raise ckpt.Preempted(position.step, path)
