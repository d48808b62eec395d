"""Train a DFlash draft model with a chosen batching policy: ``python -m dflash_lab.train sampler=bucketed``.

With no arguments this runs a complete small training on the CPU (embedded synthetic data, tiny Qwen3 target
pretrained once and cached; its time: README.md, "Two commands on a fresh machine"). ``train(cfg)`` does the work and returns the summary dict;
``main()`` is the thin Hydra wrapper.

:func:`train` reads as the algorithm:
    1. setup: the settings checked at the door (:mod:`dflash_lab.training.settings`), the process group, the run directory
       claimed (:mod:`dflash_lab.records.run_dir`: one writer), the newest intact checkpoint, the run's parts
       (:mod:`dflash_lab.training.components`: model, data, memory plan, policy, loader, AdamW, LR schedule, DDP);
    2. resume: model, optimizer, sampler position, RNG and run totals from the checkpoint; changed settings take
       effect or are refused (``checkpoint.check_resume_config``); a finished run directory is left untouched;
    3. the step loop (:func:`run_loop`): the step's micro-batches, one optimizer step (:mod:`dflash_lab.training.step`), its
       record row, scheduled evaluation (:mod:`dflash_lab.training.evaluation`), checkpoints (:class:`Checkpointer`);
    4. finish: final probes and checkpoint, acceptance length tau (trained vs untrained draft), ``summary.json``.

Run files, their columns and the step numbering are defined in :mod:`dflash_lab.records.record`. Timing
(``record.TimeLedger``): the run's wall time splits into setup, compute (moving the batch to the device, forward,
backward, scaling, clipping, the statistics sync, the optimizer step), data wait, scheduled evaluation (probes,
tau), checkpointing and other (logging, bookkeeping), over every segment of the run; ``overhead_frac`` is the
loop's own overhead, ``eval_frac`` the evaluation's share (``metrics.throughput``). A step's ``step_time_s`` is its
data wait, compute and bookkeeping: the probes and checkpoints after it are not.

Failure and preemption: a non-finite loss stops the run (status ``failed``, the last good checkpoint kept, exit
code 1) or skips the update with ``trainer.skip_nonfinite=true``. SIGUSR2/SIGTERM make the loop checkpoint at the
next step boundary, record status ``preempted`` and exit with code 75; during the final tau measurement they end it early (status
``preempted``, partial tau recorded), and the requeued job measures tau again.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from dflash_lab.analysis.protocol import PROTOCOL_FILE
from dflash_lab.analysis.schema import DEFAULT_ENDPOINTS
from dflash_lab.analysis.sizing import verdict_probe_warning
from dflash_lab.records import checkpoint as ckpt
from dflash_lab.training import dist
from dflash_lab.records import record
from dflash_lab.training.components import Components, build_components
from dflash_lab.training.evaluation import Evaluation
from dflash_lab.training.peers import PeerFailure
from dflash_lab.refusal import Refused, describe_failure, full_disk, unwritable_file
from dflash_lab.records.run_dir import RunDirectory
from dflash_lab.records.run_lock import RunDirBusy
from dflash_lab.records.run_logger import close_text_log, setup_text_log
from dflash_lab.records.run_names import name_wandb_run
from dflash_lab.training.run_records import Bookkeeping, Checkpointer, RunRecords, StepClock
from dflash_lab.training.settings import RunSettings
from dflash_lab.training.step import (Position, StepBatches, StepResult, StepSums, UpdateGuard, anchor_seed, gradient_sync,
                             scale_to_global_mean, to_device)

FAILED_EXIT_CODE = 1
REFUSED_EXIT_CODE = 2  # a refused config, resume or dataset (the one-line message says why and the fix)
LOCKED_EXIT_CODE = 3   # another live run holds the run directory (dflash_lab/records/run_lock.py); nothing was written


@dataclass
class TrainHooks:
    """Observation points for tests and tools (all optional; a run without hooks is the production path).

    Attributes:
        after_forward: ``(step, micro, out) -> out`` called on each micro-batch's StepOutput before backward
            (``step`` = the number this update will carry).
        after_step: ``(row) -> None`` called with each step's metrics row after it was recorded.
    """

    after_forward: Callable[[int, int, Any], Any] | None = None
    after_step: Callable[[dict[str, Any]], None] | None = None


# ------------------------------------------------------------------------------------------------------ train
def train(cfg: DictConfig | Mapping, hooks: TrainHooks | None = None) -> dict[str, Any]:
    """Run (or continue) one training run and return its summary (the content of ``summary.json``).

    Args:
        cfg: the composed config of conf/train.yaml (``run_dir`` must resolve: Hydra sets it; tests pass a path).
        hooks: optional observation points (see :class:`TrainHooks`).

    Raises:
        checkpoint.Preempted: after a requested checkpoint (SystemExit with code 75).
        ValueError: a bad config value (the message names the key and the fix).
        run_lock.RunDirBusy: another live run holds the run directory.
    """
    directory, settings, env = None, None, None
    try:
        started = time.perf_counter()
        settings = RunSettings.from_config(cfg)
        trainer = settings.trainer
        env = dist.setup(trainer.device, trainer.num_threads, trainer.dist_backend, master_addr=trainer.master_addr,
                         rendezvous_timeout_s=trainer.rendezvous_timeout_s, peer_timeout_s=trainer.peer_timeout_s)
        directory = RunDirectory(settings.run_dir, env.is_main)
        dist.on_peer_stop(lambda line: _stopped_by_peer(directory, line))
        return _train(settings, env, directory, hooks or TrainHooks(), started)
    except RunDirBusy as exc:
        dist.explain_failure(exc)   # the other ranks stop too, naming this rank's refusal
        raise   # another run owns the directory: nothing of it was touched
    except Exception as exc:
        reported = dist.explain_failure(exc)   # the other ranks stop too; a peer's loss is named as the cause
        if directory is None and isinstance(exc, PeerFailure) and settings is not None:
            directory = _directory_for_record(settings)   # the ranks never met: rank 0 still records why
        if directory is not None:
            directory.restore_if_refused()   # refused before its loop: the directory keeps the run's own config
            directory.record_failure(reported)
            if isinstance(reported, PeerFailure) and reported.lost and reported.rank == 0 and env.rank == 1:
                directory.record_writer_lost(reported)   # rank 0, the writer, is gone: rank 1 says why
        if isinstance(reported, PeerFailure) and logging.getLogger("dflash_lab").handlers:
            logging.getLogger("dflash_lab").error(str(reported))   # the rank's text log (main() prints the line)
        if reported is not exc:
            raise reported from exc
        raise
    finally:
        ckpt.uninstall_preemption_handler()
        close_text_log()
        if directory is not None:
            directory.release()
        dist.cleanup()


def _directory_for_record(settings: RunSettings) -> RunDirectory | None:
    """Rank 0's run directory, claimed, to record a failure of the rendezvous (None: another rank, or another live
    run holds the directory)."""
    if not dist.detect_env(settings.trainer.master_addr).is_main:
        return None
    directory = RunDirectory(settings.run_dir, is_main=True)
    try:
        directory.claim()
    except RunDirBusy:
        return None
    return directory


def _stopped_by_peer(directory: RunDirectory, line: str) -> None:
    """Another rank stopped the run while this rank's main thread waits in a collective (the heartbeat thread calls
    this just before the process exits with code 1): the one line goes to the log, ``summary.json`` (rank 0) and
    stderr, and the run directory's lock is released."""
    logging.getLogger("dflash_lab").error(line)
    directory.record_failure(PeerFailure(line))
    directory.release()
    print(f"dflash_lab.train: error: {line}", file=sys.stderr, flush=True)


def _train(settings: RunSettings, env: dist.DistEnv, directory: RunDirectory, hooks: TrainHooks,
           started: float) -> dict[str, Any]:
    # ---- 1. setup: the run directory, its log, the checkpoint to resume, the run's parts -----------------------
    log, checkpoints, state = open_run(settings, env, directory)
    device = torch.device(env.device)
    parts = build_components(settings, env, device, log)
    # a sweep's run (its folder's protocol.json, frozen at launch) is compared on the forgetting endpoints by default
    in_sweep = (Path(settings.run_dir).parent / PROTOCOL_FILE).is_file()
    short = verdict_probe_warning(settings.config["analysis"], end_step=parts.plan.end_step,
                                  probes_every=parts.probes.every, n_bands=len(parts.probes.bands) - 1,
                                  undeclared=DEFAULT_ENDPOINTS if in_sweep else ())
    if short:   # before step 1: a verdict that cannot be computed is said now, not after the runs
        log.warning(short)
    # ---- 2. resume --------------------------------------------------------------------------------------------
    position = resume(state, parts, settings, log)
    if state is not None and position.step >= parts.plan.end_step:
        finished = directory.finished_summary(position.step)
        if finished is not None:
            log.info(f"run already finished at step {position.step}: nothing to do (summary.json unchanged)")
            directory.restore_if_refused()   # trained nothing: the run's files stay the run's (.hydra put back)
            return finished
    run = start(settings, env, device, directory, log, checkpoints, state, parts, position, hooks, started)
    # ---- 3. the step loop ---------------------------------------------------------------------------------------
    failure = run_loop(run)
    # ---- 4. finish ----------------------------------------------------------------------------------------------
    return finish(run, failure)


# ------------------------------------------------------------------------------------------------------ setup
def open_run(settings: RunSettings, env: dist.DistEnv,
             directory: RunDirectory) -> tuple[logging.Logger, ckpt.CheckpointManager, dict[str, Any] | None]:
    """Claim the run directory (one writer), open its text log, arm the preemption handler and load the newest
    intact checkpoint; refuse a ``resume=true`` without one, and a fresh start over the records of a run that
    ended. Returns the log, the checkpoint manager and the checkpoint's state (None: a fresh start)."""
    stale = directory.claim()   # before anything of the directory is opened (dflash_lab/records/run_lock.py)
    log = setup_text_log(directory.path, env.rank)
    if stale:
        log.warning(f"run lock: took over a stale lock of {stale} (that process is gone)")
    directory.remove_unfinished_writes(log)   # a kill between writing a file's temporary copy and its rename
    log.info(f"run dir {directory.path}; rank {env.rank}/{env.world_size} ({env.source}); device {env.device}; "
             f"node {env.node}")
    if env.distributed:
        topology = env.topology()
        log.info(f"topology {topology['topology']} (nodes x ranks per node): {', '.join(topology['rank_nodes'])} "
                 f"(rank order); rendezvous {topology['rendezvous']}")
    ckpt.clear_checkpoint_request()
    if settings.trainer.preempt_signals:
        ckpt.install_preemption_handler(settings.trainer.preempt_signals)
    checkpoints = ckpt.CheckpointManager(directory.path / record.CHECKPOINT_DIR,
                                         keep=settings.trainer.keep_checkpoints)
    state = checkpoints.load_latest()
    directory.fresh_start = state is None
    if state is None:
        if settings.resume:
            raise FileNotFoundError(f"resume=true but {checkpoints.directory} holds no checkpoint; pass the run's "
                                    f"directory (hydra.run.dir=<old run dir>), or drop resume=true to start fresh")
        if env.is_main:
            directory.check_fresh_start(settings.overwrite, log)
        return log, checkpoints, None
    directory.resuming(state.get("hydra_files"))
    # refused changes stop here, before the model is built; the accepted ones are logged on resume
    state["changed"] = ckpt.check_resume_config(state["config"], settings.config)
    return log, checkpoints, state


def resume(state: dict[str, Any] | None, parts: Components, settings: RunSettings, log: logging.Logger) -> Position:
    """The run's position: from the checkpoint (model, optimizer, sampler position, anchor RNG, totals restored
    into ``parts``), or step 0 of epoch 0. Refuses other data than the checkpoint's, and a ``trainer.max_steps``
    that ends before it."""
    if state is None:
        parts.policy.set_epoch(0)
        return Position(totals=record.RunTotals())
    checkpoint_bands = (state["config"].get("probes") or {}).get("bands")
    if checkpoint_bands not in (None, "auto") and list(checkpoint_bands) != list(parts.probes.bands):
        raise ValueError(f"resume: probes.bands resolves to {parts.probes.bands} but the checkpoint's run probed "
                         f"{list(checkpoint_bands)}: pass probes.bands={list(checkpoint_bands)} to continue it, or "
                         f"start a fresh run directory (hydra.run.dir=<new dir>)")
    if state.get("data_digest") not in (None, parts.train_ds.content_digest):
        raise ValueError(f"the data changed since the checkpoint (content digest {state['data_digest']} then, "
                         f"{parts.train_ds.content_digest} now; data.* = {settings.config['data']}): restore the data "
                         f"the run started with, or start a fresh run directory (hydra.run.dir=<new dir>)")
    trainer = settings.trainer
    parts.model.load_draft_state_dict(state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    for group in parts.optimizer.param_groups:  # optimizer settings from the config (changed ones take effect)
        group.update(betas=trainer.betas, weight_decay=trainer.weight_decay)
    parts.policy.load_state_dict(state["sampler"])
    ckpt.restore_rng_state(state["rng"], parts.anchor_generator)
    position = Position(totals=record.RunTotals.from_state(state["extra"]["totals"]), step=int(state["step"]),
                        epoch=int(state["sampler"]["epoch"]), consumed=int(state["sampler"]["batches_consumed"]),
                        loaded_step=int(state["step"]))
    if state["changed"]:
        log.info(f"resume: {', '.join(state['changed'])} changed since the checkpoint and take effect now; LR "
                 f"schedule {state['schedule']} -> {parts.schedule.state_dict()}")
    if position.step > parts.plan.end_step:
        raise ValueError(f"trainer.max_steps={trainer.max_steps} ends this run at step {parts.plan.end_step}, but "
                         f"its checkpoint is at step {position.step}: raise trainer.max_steps to at least "
                         f"{position.step}, or start a fresh run directory (hydra.run.dir=<new dir>) to train fewer "
                         f"steps")
    return position


@dataclass
class Run:
    """A run ready to step: its settings, parts and position, where its micro-batches come from, and the
    bookkeeping the loop calls once per step."""

    settings: RunSettings
    env: dist.DistEnv
    device: torch.device
    log: logging.Logger
    parts: Components
    position: Position
    ledger: record.TimeLedger
    batches: StepBatches
    books: Bookkeeping
    hooks: TrainHooks


def start(settings: RunSettings, env: dist.DistEnv, device: torch.device, directory: RunDirectory,
          log: logging.Logger, checkpoints: ckpt.CheckpointManager, state: dict[str, Any] | None, parts: Components,
          position: Position, hooks: TrainHooks, started: float) -> Run:
    """Open the records (checked against the checkpoint), the evaluation and the checkpointer; write the
    ``running`` summary; probe step 0 of a fresh run. From here on this launch's config is the run's
    (``run_config.json``)."""
    position.totals.segments += 1
    ledger = record.TimeLedger(position.totals, start=started)   # this segment's wall time counts from its start
    last_probe_step = state["extra"].get("last_probe_step") if state is not None else None
    # checks the records against the checkpoint before it writes any of them (or W&B): a refusal changes nothing
    records = RunRecords.open(settings, env, directory, parts, position, (state or {}).get("extra"),
                              (state or {}).get("wandb_run_id"), ledger, log)
    evaluation = Evaluation(model=parts.model, heldout_ds=parts.heldout_ds, pad_id=parts.tokenizer.pad_token_id,
                            device=device, autocast=parts.autocast, probes=parts.probes,
                            tau_every=settings.trainer.tau_every, model_cfg=settings.config["model"],
                            log_probes=records.logger.log_probes, log_tau=records.logger.log_tau, ledger=ledger,
                            is_main=env.is_main, log=log, last_probe_step=last_probe_step,
                            warmup_steps=parts.schedule.warmup_steps, measure_tau=settings.trainer.measure_tau)
    trainer, plan = settings.trainer, parts.plan
    clock = StepClock(plan.end_step, position.step, show_bar=env.is_main and trainer.progress and sys.stderr.isatty(),
                      log_every=trainer.log_every, log_every_s=trainer.log_every_s, name=parts.policy.name, log=log)
    checkpointer = Checkpointer(checkpoints, settings, env, directory, parts, records, evaluation, records.run_id,
                                log)
    books = Bookkeeping(records=records, evaluation=evaluation, checkpointer=checkpointer, clock=clock,
                        policy=parts.policy, end_step=plan.end_step, is_main=env.is_main, log=log,
                        after_step=hooks.after_step)
    run = Run(settings=settings, env=env, device=device, log=log, parts=parts, position=position, ledger=ledger,
              batches=StepBatches(parts.loader, parts.policy, plan, trainer.grad_accum, trainer.epochs, position),
              books=books, hooks=hooks)
    if plan.end_step == 0:
        log.warning("trainer.max_steps=0: this launch trains no step (it builds the target, the data and their caches)"
                    "; set trainer.max_steps=N or null to train")
    log.info(f"{parts.policy.name}: {len(parts.train_ds)} train / {len(parts.heldout_ds)} held-out samples; steps "
             f"per epoch {list(plan.steps_per_epoch)}; running steps {position.step}..{plan.end_step} of "
             f"{plan.total_steps}")
    ledger.add("setup", time.perf_counter() - started)
    directory.running(settings.config, env.topology())   # the run's config record (run_config.json)
    records.summary("running", steps=position.step)
    parts.model.train()
    if position.step == 0:
        evaluation.probe(0)  # the start of every band's curve
    clock.restart()
    return run


# ------------------------------------------------------------------------------------------------- the loop
def run_loop(run: Run) -> str:
    """Train from the run's position to its end step: the DFlash recipe, one optimizer step per iteration. Returns
    why the run failed ("" when it reached the end); raises ``checkpoint.Preempted`` after a requested checkpoint."""
    settings, env, device, parts, position = run.settings, run.env, run.device, run.parts, run.position
    trainer, model, train_model, optimizer = settings.trainer, parts.model, parts.train_model, parts.optimizer
    params = list(model.trainable_parameters())
    max_norm = trainer.grad_clip if trainer.grad_clip > 0 else math.inf
    anchors, guard = parts.anchor_generator, UpdateGuard(trainer)
    while position.step < parts.plan.end_step:
        with run.ledger.part("data_wait"):
            micro_batches, epoch = run.batches.next_step()
        compute_started = time.perf_counter()
        lr = parts.schedule.lr(position.step)
        sums = StepSums(device, model.block_size)
        for micro, batch in enumerate(micro_batches):
            batch = to_device(batch, device)
            # anchors are drawn from (seed, step, slot): a resumed run and any world size redraw the same ones
            anchors.manual_seed(anchor_seed(settings.seed, position.step, micro * env.world_size + env.rank))
            with gradient_sync(train_model, env, last_micro=micro == len(micro_batches) - 1):
                with parts.autocast:
                    # forward: the target's hidden states condition the draft's blocks; the fixed-anchor pass scores
                    # each example where it is scored every time (presentations)
                    out = train_model(batch, anchors, score_fixed=settings.probes.presentations)
                if run.hooks.after_forward is not None:
                    out = run.hooks.after_forward(position.step + 1, micro, out)
                # global norm: backward the raw weighted CE sum, divided by the global weight below; local norm: the
                # mean over this rank's micro-batches (DDP then averages the ranks)
                loss = out.weighted_ce_sum if trainer.global_loss_norm else out.loss / len(micro_batches)
                loss.backward()
            sums.add(out)
        if trainer.global_loss_norm:
            scale_to_global_mean(params, sums.weight, env)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        doc_lengths = [parts.policy.lengths[b["sample_index"].cpu().numpy()] for b in micro_batches]
        stats = sums.gather(grad_norm, doc_lengths, packed=parts.policy.packed)   # the step's one host sync
        skipped, failure = guard.check(position.step, stats, position.totals)
        if stats.finite:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if skipped:
            run.log.warning(f"step {position.step + 1}: {skipped}; update skipped")
        if failure:
            return failure
        compute_s = time.perf_counter() - compute_started
        run.ledger.add("compute", compute_s)
        position.step += 1
        run.books.after_step(position, epoch, StepResult(
            stats=stats, lr=lr, compute_s=compute_s, doc_lengths=doc_lengths, doc_correct=torch.cat(sums.doc_correct),
            doc_count=torch.cat(sums.doc_count), skipped=skipped), micro_batches)
    return ""


# ------------------------------------------------------------------------------------------------------ finish
def exit_line(status: str, step: int, total_steps: int, summary: Mapping[str, Any], env: dist.DistEnv,
              tau_not_measured: str = "") -> str:
    """The run's last log line. Rank 0 keeps the metric history and measures tau, so only its summary holds the
    loss, accuracy, throughput and tau; another rank's would read NaN, so its line names rank 0 as the holder.
    ``tau_not_measured``: why rank 0 measured no tau (``trainer.measure_tau=false``, a failed run); its line says
    so instead of a NaN tau that reads like a broken measurement.

    Example:
        >>> print(exit_line("finished", 40, 40, {"wall_time_s": 12.3}, dist.DistEnv(rank=1, world_size=2)))
        finished: step 40/40 on rank 1 of 2, 12 s; the loss, accuracy, throughput and tau are in rank 0's log line \
and summary.json (only rank 0 keeps the metric history)
        >>> line = exit_line("finished", 40, 40, {"final_loss": 2.5, "final_acc": 0.4, "ktok_s": 1.0, "pad_eff": 0.9,
        ...                  "overhead_frac": 0.1, "eval_frac": 0.0, "wall_time_s": 12.3, "tau": float("nan"),
        ...                  "tau_baseline": float("nan")}, dist.DistEnv(), tau_not_measured="trainer.measure_tau=false")
        >>> line.split(", ")[-1]
        'tau not measured (trainer.measure_tau=false)'
    """
    if not env.is_main:
        return (f"{status}: step {step}/{total_steps} on rank {env.rank} of {env.world_size}, "
                f"{summary['wall_time_s']:.0f} s; the loss, accuracy, throughput and tau are in rank 0's log line "
                f"and summary.json (only rank 0 keeps the metric history)")
    tau = (f"tau not measured ({tau_not_measured})" if tau_not_measured
           else f"tau {summary['tau']:.3f} (untrained {summary['tau_baseline']:.3f})")
    return (f"{status}: step {step}/{total_steps}, loss {summary['final_loss']:.4f}, acc "
            f"{summary['final_acc']:.4f}, {summary['ktok_s']:.2f} Ktok/s, pad_eff {summary['pad_eff']:.3f}, "
            f"overhead {summary['overhead_frac']:.1%}, evaluation {summary['eval_frac']:.1%} of "
            f"{summary['wall_time_s']:.0f} s, {tau}")


def finish(run: Run, failure: str) -> dict[str, Any]:
    """End the run: final probes and checkpoint, tau of the trained and untrained draft, ``summary.json``, the exit
    line. A failed run keeps its last good checkpoint; a preemption during tau exits for a requeue."""
    position, trainer, log = run.position, run.settings.trainer, run.log
    run.books.clock.close()
    status = "finished"   # what was asked (all epochs, or up to trainer.max_steps) is done
    if failure:
        status, failure = "failed", f"{failure}. The last good checkpoint is {run.books.checkpointer.latest()}"
        log.error(failure)
    else:
        run.books.evaluation.probe(position.step)
        if position.step != position.loaded_step:
            run.books.checkpointer.save(position)
    # summary.json keeps an unmeasured tau as null (analysis notes why from run_config's trainer.measure_tau)
    taus = {"tau": math.nan, "tau_baseline": math.nan}
    tau_not_measured = ("the run failed" if status == "failed"
                        else "" if trainer.measure_tau else "trainer.measure_tau=false")
    if not tau_not_measured and run.env.is_main:
        # a relaunch of a run that finished (its summary.json lost) finds the trained draft measured: never twice
        taus = run.books.evaluation.final_tau(position.step, should_stop=ckpt.checkpoint_requested,
                                              recorded=run.books.records.logger.tau_rows.get(position.step))
        taus.pop("complete")
        if ckpt.checkpoint_requested():
            status = "preempted"
    summary = run.books.records.summary(status, steps=position.step, **taus, error=failure or None)
    run.books.records.logger.close(exit_code={"failed": FAILED_EXIT_CODE,
                                        "preempted": ckpt.PREEMPTED_EXIT_CODE}.get(status, 0))
    if status == "finished" and position.step == 0:   # trainer.max_steps=0: a launch that only builds
        log.info("finished without training: trainer.max_steps=0 trains no step; the target, the data and their "
                 "caches are built, and summary.json records steps 0")
        return summary
    log.info(exit_line(status, position.step, run.parts.plan.total_steps, summary, run.env, tau_not_measured))
    if status == "preempted":
        log.warning(f"tau measurement interrupted ({ckpt.request_reason()}); exiting with code "
                    f"{ckpt.PREEMPTED_EXIT_CODE}: the requeued job measures it again")
        ckpt.run_previous_handler()
        raise ckpt.Preempted(position.step, run.books.checkpointer.latest())
    return summary


@hydra.main(config_path="pkg://dflash_lab.conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """``python -m dflash_lab.train [overrides]``: run :func:`train`; exit 1 when the run failed."""
    name_wandb_run(cfg)
    try:
        summary = train(cfg)
    except RunDirBusy as exc:  # a refusal, not a crash: the one-line reason, no traceback
        print(f"dflash_lab.train: {exc}", file=sys.stderr)
        raise SystemExit(LOCKED_EXIT_CODE) from None
    except PeerFailure as exc:  # a rank that cannot join, or the run lost one: the line names the rank and the fix
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"dflash_lab.train: error: {exc}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(FAILED_EXIT_CODE) from None
    except (Refused, ValueError, FileNotFoundError) as exc:  # refused config, resume, data, cache: names the fix
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"dflash_lab.train: error: {exc}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(REFUSED_EXIT_CODE) from None
    except Exception as exc:  # a full disk, a record file it cannot write: the cause in one line, naming the file
        if (full_disk(exc) is None and unwritable_file(exc) is None) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"dflash_lab.train: error: {describe_failure(exc)}\n(HYDRA_FULL_ERROR=1 shows the traceback)",
              file=sys.stderr)
        raise SystemExit(FAILED_EXIT_CODE) from None
    if summary["status"] == "failed":
        raise SystemExit(FAILED_EXIT_CODE)
    return summary.get("final_loss")


if __name__ == "__main__":
    main()
