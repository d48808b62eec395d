"""The pieces of one optimizer step that the training loop (:func:`dflash_lab.train.run_loop`) spells out: where
the run stands (:class:`Position`), the step's micro-batches (:class:`StepBatches`), the learning rate
(:class:`LRSchedule`), the anchors' seed, the device-side sums and their one host sync (:class:`StepSums`), the
global loss normalisation and the update rule (:class:`UpdateGuard`).

The step itself reads in the loop: ``grad_accum`` micro-batches, each moved to the device and run forward (anchors
drawn from a generator seeded by (seed, step, slot), so a resumed run redraws them) and backward, DDP all-reducing
gradients on the last one only. With ``trainer.global_loss_norm`` the gradients of the raw weighted CE sums are
divided by the global supervision weight (every supervised block counts the same, whatever batch it is in); then
clipping, ONE host sync that gathers every statistic of every rank, and the update: taken when loss and gradient
norm are finite, skipped when the batch supervises nothing or (with ``trainer.skip_nonfinite``) when they are not
finite, otherwise the run fails. ``trainer.max_consecutive_skips`` skips in a row also fail it: a diverged run never
reports success.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from dflash_lab.records import checkpoint as ckpt
from dflash_lab.training import dist
from dflash_lab.records import record
from dflash_lab.metrics import gradients
from dflash_lab.training.settings import TrainerSettings


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

    @property
    def warmup_steps(self) -> int:
        """W: the updates of the linear rise (``metrics.gradients.warmup_steps``, the one definition)."""
        return gradients.warmup_steps(self.warmup_frac, self.total_steps)

    def lr(self, step: int) -> float:
        """The learning rate of the update that follows ``step`` completed updates."""
        warmup = self.warmup_steps
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


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The micro-batch's tensors on the training device (other values as they are)."""
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def gradient_sync(train_model, env: dist.DistEnv, last_micro: bool):
    """DDP all-reduces gradients on a step's last micro-batch only: the others run (forward and backward) under
    ``no_sync``."""
    return train_model.no_sync() if env.distributed and not last_micro else contextlib.nullcontext()


def scale_to_global_mean(params: list[torch.nn.Parameter], local_weight: torch.Tensor, env: dist.DistEnv) -> None:
    """Turn the gradients of each rank's raw weighted CE sum into the gradient of (global CE sum / global weight).

    DDP averaged the ranks' gradients (a factor 1/W on their sum), so the factor is W / global weight: every
    supervised block of the global batch counts the same, whatever rank or micro-batch it is in.
    """
    global_weight = dist.all_reduce_sum(local_weight.clone())
    scale = (env.world_size / global_weight.clamp_min(1e-12)).float()
    torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)


class StepSums:
    """One step's device-side sums over its micro-batches (no host sync until :meth:`gather`): the weighted CE, its
    weight, correct and supervised slots, training blocks and block slots, and each document's block scores."""

    def __init__(self, device: torch.device, block_size: int):
        self.device, self.block_size = device, block_size
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)  # ce, weight, correct, count, blocks
        self.block_slots = 0
        self.doc_correct: list[torch.Tensor] = []
        self.doc_count: list[torch.Tensor] = []

    @property
    def weight(self) -> torch.Tensor:
        return self.sums[1]

    def add(self, out) -> None:
        """Add one micro-batch's forward output (a ``StepOutput``)."""
        self.sums += torch.stack([out.weighted_ce_sum.detach().double(), out.weight_sum.double(),
                                  out.correct.double(), out.count.double(), out.num_blocks.double()])
        self.block_slots += out.num_slots * self.block_size
        self.doc_correct.append(out.doc_correct)
        self.doc_count.append(out.doc_count)

    def gather(self, grad_norm: torch.Tensor, doc_lengths: list[np.ndarray], *, packed: bool) -> record.StepStats:
        """Every rank's statistics of the step, reduced: the step's one host sync (``record.gather_step_stats``)."""
        return record.gather_step_stats({
            "ce_sum": self.sums[0], "weight_sum": self.sums[1], "correct": self.sums[2], "count": self.sums[3],
            "block_tokens": self.sums[4] * self.block_size, "block_slots": float(self.block_slots),
            "grad_norm": grad_norm, "stop_requested": float(ckpt.checkpoint_requested()),
            **record.local_batch_stats(doc_lengths, packed=packed),
        }, dist.all_gather_rows, self.device)


@dataclass
class StepResult:
    """What one step did, for the records: its statistics (every rank's, reduced), the learning rate it used, its
    compute time, the per-document lengths and scores (presentations), and why its update was skipped (None: taken)."""

    stats: record.StepStats
    lr: float
    compute_s: float
    doc_lengths: list[np.ndarray]
    doc_correct: torch.Tensor
    doc_count: torch.Tensor
    skipped: str | None = None


class UpdateGuard:
    """Decides whether a step's update is taken, skipped or ends the run (the module docstring's rules). Its only
    state is the count of skipped updates in a row."""

    def __init__(self, trainer: TrainerSettings):
        self.skip_nonfinite, self.max_consecutive_skips = trainer.skip_nonfinite, trainer.max_consecutive_skips
        self.consecutive_skips = 0

    def check(self, step: int, stats: record.StepStats, totals: record.RunTotals) -> tuple[str | None, str]:
        """For the update that follows ``step``: (why it is skipped or None to take it, why the run fails or "").
        A skip is counted in ``totals.skipped_steps``."""
        if stats.finite:
            self.consecutive_skips = 0
            return None, ""
        if stats.weight_sum <= 0 and math.isfinite(stats.ce_sum):
            skip = "no supervised block in the batch (weight sum 0)"
        elif self.skip_nonfinite:
            skip = f"non-finite loss/grad norm ({stats.loss}, {stats.grad_norm}) (trainer.skip_nonfinite=true)"
        else:
            return None, (f"non-finite loss at step {step + 1} (loss={stats.loss}, grad_norm={stats.grad_norm}); "
                          f"lower trainer.lr or set trainer.skip_nonfinite=true")
        totals.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips < self.max_consecutive_skips:
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
