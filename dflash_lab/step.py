"""One optimizer step of the draft: where the run stands (:class:`Position`), the step's micro-batches
(:class:`StepBatches`), the update itself (:class:`OptimizerStep`) and its rules (the learning rate, the anchors'
seed, skipped updates).

A step (:class:`OptimizerStep`): ``grad_accum`` micro-batches, each moved to the device and run forward (anchors
drawn from a generator seeded by (seed, step, slot), so a resumed run redraws them) and backward, DDP
all-reducing gradients on the last one only. With ``trainer.global_loss_norm`` the gradients of the raw weighted
CE sums are divided by the global supervision weight (every supervised block counts the same, whatever batch it
is in); then clipping, ONE host sync that gathers every statistic of every rank (``record.gather_step_stats``),
and the update: taken when loss and gradient norm are finite, skipped when the batch supervises nothing or (with
``trainer.skip_nonfinite``) when they are not finite, otherwise the run fails. ``trainer.max_consecutive_skips``
skips in a row also fail it: a diverged run never reports success.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from dflash_lab import checkpoint as ckpt
from dflash_lab import dist, record
from dflash_lab.settings import TrainerSettings


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up over ``warmup_frac`` of ``total_steps``, then cosine from ``peak_lr`` to ``min_lr_ratio x``.

    Example:
        >>> schedule = LRSchedule(peak_lr=1.0, total_steps=100, warmup_frac=0.04, min_lr_ratio=0.1)
        >>> [round(schedule.lr(s), 3) for s in (0, 3, 4, 52, 100)]
        [0.25, 1.0, 1.0, 0.55, 0.1]
    """

    peak_lr: float
    total_steps: int
    warmup_frac: float
    min_lr_ratio: float

    def lr(self, step: int) -> float:
        """The learning rate of the update that follows ``step`` completed updates."""
        warmup = max(1, int(round(self.warmup_frac * self.total_steps))) if self.warmup_frac > 0 else 0
        if step < warmup:
            return self.peak_lr * (step + 1) / warmup
        if step >= self.total_steps:
            return self.peak_lr * self.min_lr_ratio
        progress = (step - warmup) / max(1, self.total_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}



def anchor_seed(seed: int, step: int, slot: int = 0) -> int:
    """Seed of the anchor generator for one batch of a step: resume redraws the same anchors.

    ``slot`` is the batch's position among the step's ``world_size x grad_accum`` batches (``micro x world_size +
    rank``), so a 2-rank run and a 1-rank run with ``grad_accum=2`` over the same global batches draw the same anchors.
    """
    return int(np.random.SeedSequence([int(seed), int(step), int(slot)]).generate_state(1)[0])


@dataclass
class StepResult:
    """What one step did: its statistics (every rank's, reduced), the learning rate it used, its compute time, the
    per-document lengths and scores (presentations), and whether the update was taken, skipped or failed."""

    stats: record.StepStats
    lr: float
    compute_s: float
    doc_lengths: list[np.ndarray]
    doc_correct: torch.Tensor
    doc_count: torch.Tensor
    skipped: str | None   # why the update was skipped; None: it was taken (or the run failed)
    failure: str = ""     # non-empty: the run stops here (the message says why and the fix)


class OptimizerStep:
    """Runs one step of the draft over its micro-batches (see the module docstring). Holds the pieces a step uses;
    its only state is the count of skipped updates in a row."""

    def __init__(self, *, model, train_model, optimizer: torch.optim.Optimizer, schedule: LRSchedule,
                 trainer: TrainerSettings, env: dist.DistEnv, device: torch.device, seed: int, lengths: np.ndarray,
                 packed: bool, score_fixed: bool, anchor_generator: torch.Generator, autocast,
                 after_forward: Callable[[int, int, Any], Any] | None = None):
        self.model, self.train_model, self.optimizer, self.schedule = model, train_model, optimizer, schedule
        self.trainer, self.env, self.device, self.seed = trainer, env, device, seed
        self.lengths, self.packed, self.score_fixed = lengths, packed, score_fixed
        self.anchor_generator, self.after_forward = anchor_generator, after_forward
        self.params = list(model.trainable_parameters())
        self.autocast = autocast   # bf16 autocast on GPU, else a null context
        self.consecutive_skips = 0

    def __call__(self, step: int, micro_batches: list[dict[str, Any]], totals: record.RunTotals) -> StepResult:
        """The update that follows ``step`` completed ones; counts a skipped update in ``totals.skipped_steps``."""
        t_compute = time.perf_counter()
        trainer, env = self.trainer, self.env
        device_sums = torch.zeros(5, dtype=torch.float64, device=self.device)  # ce, weight, correct, count, blocks
        doc_correct, doc_count, block_slots = [], [], 0
        for micro, batch in enumerate(micro_batches):
            batch = {k: (v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
            self.anchor_generator.manual_seed(anchor_seed(self.seed, step, micro * env.world_size + env.rank))
            last_micro = micro == len(micro_batches) - 1
            # DDP all-reduces gradients on the last micro-batch only
            sync = self.train_model.no_sync() if env.distributed and not last_micro else contextlib.nullcontext()
            with sync:
                with self.autocast:
                    # the fixed-anchor pass scores each example where it is scored every time (presentations)
                    out = self.train_model(batch, self.anchor_generator, score_fixed=self.score_fixed)
                if self.after_forward is not None:
                    out = self.after_forward(step + 1, micro, out)
                # global norm: backward the raw weighted CE sum and divide the gradients by the global weight
                # below; local norm: the mean over this rank's micro-batches (DDP then averages the ranks)
                objective = out.weighted_ce_sum if trainer.global_loss_norm else out.loss / len(micro_batches)
                objective.backward()
            device_sums += torch.stack([out.weighted_ce_sum.detach().double(), out.weight_sum.double(),
                                        out.correct.double(), out.count.double(), out.num_blocks.double()])
            block_slots += out.num_slots * self.model.block_size
            doc_correct.append(out.doc_correct)
            doc_count.append(out.doc_count)
        if trainer.global_loss_norm:
            # DDP averaged (1/W) x sum over ranks of d(CE sum): rescale to d(global CE sum / global weight)
            global_weight = dist.all_reduce_sum(device_sums[1].clone())
            scale = (env.world_size / global_weight.clamp_min(1e-12)).float()
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params,
                                                   trainer.grad_clip if trainer.grad_clip > 0 else math.inf)
        doc_lengths = [self.lengths[b["sample_index"].cpu().numpy()] for b in micro_batches]
        stats = record.gather_step_stats({
            "ce_sum": device_sums[0], "weight_sum": device_sums[1], "correct": device_sums[2],
            "count": device_sums[3], "block_tokens": device_sums[4] * self.model.block_size,
            "block_slots": float(block_slots), "grad_norm": grad_norm,
            "stop_requested": float(ckpt.checkpoint_requested()),
            **record.local_batch_stats(doc_lengths, packed=self.packed),
        }, dist.all_gather_rows, self.device)
        lr = self.schedule.lr(step)
        skipped, failure = self._update(step, stats, lr, totals)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(stats=stats, lr=lr, compute_s=time.perf_counter() - t_compute, doc_lengths=doc_lengths,
                          doc_correct=torch.cat(doc_correct), doc_count=torch.cat(doc_count), skipped=skipped,
                          failure=failure)

    def _update(self, step: int, stats: record.StepStats, lr: float,
                totals: record.RunTotals) -> tuple[str | None, str]:
        """Take the update, or skip it, or fail: returns (why it was skipped, why the run fails)."""
        if stats.finite:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.consecutive_skips = 0
            return None, ""
        if stats.weight_sum <= 0 and math.isfinite(stats.ce_sum):
            skip = "no supervised block in the batch (weight sum 0)"
        elif self.trainer.skip_nonfinite:
            skip = f"non-finite loss/grad norm ({stats.loss}, {stats.grad_norm}) (trainer.skip_nonfinite=true)"
        else:
            return None, (f"non-finite loss at step {step + 1} (loss={stats.loss}, grad_norm={stats.grad_norm}); "
                          f"lower trainer.lr or set trainer.skip_nonfinite=true")
        totals.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips < self.trainer.max_consecutive_skips:
            return skip, ""
        return skip, (f"{self.consecutive_skips} updates in a row skipped (steps {step + 2 - self.consecutive_skips}"
                      f"..{step + 1}; {totals.skipped_steps} in all): the run has diverged or its batches supervise "
                      f"nothing; lower trainer.lr, check the data, or raise trainer.max_consecutive_skips")


@dataclass
class Position:
    """Where the run stands: the loop's tiny resumable state (the sampler's own is in its ``state_dict``)."""

    totals: record.RunTotals
    step: int = 0                      # completed optimizer steps
    epoch: int = 0
    consumed: int = 0                  # batches of this epoch already trained on
    loaded_step: int | None = None     # the checkpoint's step this segment started from (None: a fresh start)


class StepBatches:
    """Each step's ``grad_accum`` micro-batches from the policy's DataLoader, epoch after epoch (a step never spans
    two epochs); the position's epoch and consumed count move with them, so a checkpoint resumes mid-epoch."""

    def __init__(self, loader: torch.utils.data.DataLoader, policy, plan: record.PlanFacts, grad_accum: int,
                 epochs: int, position: Position):
        self.loader, self.policy, self.plan = loader, policy, plan
        self.grad_accum, self.epochs, self.position = grad_accum, epochs, position
        self._iterator = None

    def next_step(self) -> tuple[list[dict[str, Any]], int]:
        """The next step's micro-batches and the epoch they belong to."""
        position = self.position
        epoch = position.epoch
        if self._iterator is None:
            self._iterator = iter(self.loader)
        micro_batches = []
        while len(micro_batches) < self.grad_accum and position.consumed < self.plan.batches_per_epoch[epoch]:
            micro_batches.append(next(self._iterator))
            position.consumed += 1
        if position.consumed >= self.plan.batches_per_epoch[epoch]:   # the epoch is done: the next one starts
            position.epoch, position.consumed, self._iterator = epoch + 1, 0, None
            if position.epoch < self.epochs:
                self.policy.set_epoch(position.epoch)
        return micro_batches, epoch
