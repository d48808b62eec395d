"""Scheduled evaluation of the draft during a run, on rank 0: the probe bands and the acceptance length tau.

- Probes (``probes.every`` steps, at step 0 and at the end, and ``probes.warmup_evals`` more inside the LR warmup:
  ``metrics.gradients.warmup_probe_steps``): loss and accuracy of every length band of the held-out probe sets
  (:class:`dflash_lab.training.probes.ProbeSets`), one row per band in ``probes.jsonl``. A step is probed once,
  even when the schedules and the end of the run meet on it (its number is remembered across a resume).
- Tau (``trainer.tau_every`` steps, and at the end): the real acceptance length of greedy speculative decoding over
  held-out prompts spread over the probe bands (``model.decode_num_prompts`` in all, one band after another; null:
  every held-out sample with supervision), so one measurement also gives tau per band (``tau_by_band``;
  ``tau_band_min``, ``tau_band_mean`` over the bands that have prompts) and its prompt-bootstrap standard error
  (``tau_se``); at the end also the untrained draft's (same initial weights), the baseline of the gain.
  ``model.tau_method``: ``replay`` (the target's greedy continuations and features are computed once, at the first
  measurement, and each draft's decoding chain is replayed on them: the same accepted lists at the cost of the
  draft's forwards, dflash_lab.model.decoding.replay_chain) or ``generate`` (real speculative decoding each time).

Their time is the ledger's scheduled evaluation (``record.TimeLedger.evaluation``): apart from the training loop's
overhead, reported as ``eval_frac``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from dflash_lab.config_check import as_choice, as_int
from dflash_lab.metrics.draft_quality import acceptance_length_tau, tau_bootstrap_se
from dflash_lab.metrics.gradients import warmup_probe_steps
from dflash_lab.model import measure_acceptance
from dflash_lab.model.decoding import TargetContinuations, banded_prompts, replay_acceptance
from dflash_lab.records import record
from dflash_lab.training.probes import ProbeSets, heldout_evaluator
from dflash_lab.training.settings import ProbeSettings

PROGRESS_EVERY_S = 30.0   # tau progress lines at least this often (and one per tenth of the prompts)
TAU_METHODS = ("replay", "generate")   # model.tau_method


def tau_prompt_warning(found: int, wanted: int, heldout: int) -> str | None:
    """A warning when the held-out split holds fewer tau prompts than ``model.decode_num_prompts`` asks for.

    Example:
        >>> print(tau_prompt_warning(6, 12, 9))  # doctest: +ELLIPSIS
        tau: only 6 of the 12 prompts of model.decode_num_prompts exist (the held-out split holds 9 samples): ...
    """
    if found >= wanted:
        return None
    return (f"tau: only {found} of the {wanted} prompts of model.decode_num_prompts exist (the held-out split holds "
            f"{heldout} samples): tau, tau per band and tau_band_min rest on {found} prompts; raise "
            f"data.probe_fraction for more held-out samples, or set model.decode_num_prompts={found}")


def tau_by_band(prompt_bands: list[int], accepted_per_prompt: list[list[int]], num_bands: int) -> list[float | None]:
    """Tau per probe band: the verify steps of all the band's measured prompts pooled (a prompt with many steps
    weighs more, as in the overall tau); None for a band without a verify step. The minimum over the bands that
    have one is ``tau_band_min``.

    Example:
        >>> tau_by_band([0, 0, 2], [[0, 2], [1], [3, 3]], num_bands=3)
        [2.0, None, 4.0]
    """
    accepted: list[list[int]] = [[] for _ in range(num_bands)]
    for band, steps in zip(prompt_bands, accepted_per_prompt):
        accepted[band].extend(steps)
    return [acceptance_length_tau(steps) if steps else None for steps in accepted]


class Evaluation:
    """The run's scheduled evaluation (see the module docstring).

    Args:
        model: the DFlashModel being trained (put in eval mode while evaluated, then back in train mode).
        heldout_ds: the held-out split (probe sets and tau prompts come from it).
        pad_id, device, autocast: as the training step uses them, so probes see the same numerics.
        probes: the ``probes`` settings; tau_every: ``trainer.tau_every``; model_cfg: the ``model`` section (its
            ``decode_*`` keys size the tau measurement, ``tau_method`` chooses how it is made).
        log_probes: ``(rows) -> None`` writes probe rows (``RunLogger.log_probes``); log_tau: ``(row) -> None``
            writes a tau.jsonl row (``RunLogger.log_tau``) for each measurement of the trained draft.
        ledger: the run's time ledger; is_main: rank 0 evaluates, other ranks skip.
        last_probe_step: the step last probed (from the checkpoint on resume).
        warmup_steps: the LR schedule's warmup W (``probes.warmup_evals`` evaluations are spread over it, at most
            one per step: fewer asked for than W steps is said in a warning).
        measure_tau: ``trainer.measure_tau`` (with ``tau_every`` 0 and this off, no tau warning is given).
    """

    def __init__(self, *, model, heldout_ds, pad_id: int, device: torch.device, autocast, probes: ProbeSettings,
                 tau_every: int, model_cfg: Mapping[str, Any], log_probes: Callable[[list[dict]], None],
                 log_tau: Callable[[dict], None], ledger: record.TimeLedger, is_main: bool, log: logging.Logger,
                 warmup_steps: int, last_probe_step: int | None = None, measure_tau: bool = True):
        self.model, self.settings, self.tau_every = model, probes, tau_every
        self.log_probes, self.log_tau, self.ledger, self.is_main, self.log = log_probes, log_tau, ledger, is_main, log
        self.last_probe_step = last_probe_step
        self.warmup_probe_steps = frozenset(warmup_probe_steps(warmup_steps, probes.warmup_evals))
        if probes.every > 0 and probes.warmup_evals > len(self.warmup_probe_steps) and is_main:
            log.warning(f"probes.warmup_evals={probes.warmup_evals}: the LR warmup lasts {warmup_steps} step(s), so "
                        f"it gets {len(self.warmup_probe_steps)} evaluation(s), at most one per step (steps "
                        f"{sorted(self.warmup_probe_steps)[:8]}{' ...' if len(self.warmup_probe_steps) > 8 else ''})")
        self.probe_sets = None
        if probes.every > 0:
            self.probe_sets = ProbeSets(heldout_ds.lengths, probes.bands, probes.per_band, probes.seed,
                                        probes.max_tokens)
            if self.probe_sets.empty_bands:
                log.warning(f"probes: no held-out samples in band(s) {self.probe_sets.empty_bands} of "
                            f"probes.bands={self.probe_sets.bands}")
        self.evaluate_batch = heldout_evaluator(model, heldout_ds, pad_id, device, autocast)
        self.tau_method = as_choice("model.tau_method", model_cfg["tau_method"], TAU_METHODS)
        wanted = as_int("model.decode_num_prompts", model_cfg["decode_num_prompts"], minimum=1, allow_none=True)
        self.prompts, self.prompt_bands = banded_prompts(
            heldout_ds, probes.bands, num_prompts=len(heldout_ds) if wanted is None else wanted,
            max_prompt_tokens=int(model_cfg["decode_max_prompt_tokens"]))
        self.num_bands = len(probes.bands) - 1
        self.new_tokens = int(model_cfg["decode_max_new_tokens"])
        self.continuations: TargetContinuations | None = None   # replay: built at the first measurement
        measured = measure_tau or tau_every > 0   # no tau measured: how many prompts it would have is moot
        short = tau_prompt_warning(len(self.prompts), wanted, len(heldout_ds)) if wanted is not None else None
        if short and measured and is_main:
            log.warning(short)

    def after_step(self, step: int, end_step: int) -> None:
        """What the schedule asks after ``step``: probes every ``probes.every`` steps and at the warmup's
        evaluations (none when probes are off), tau every ``tau_every`` steps before the end (the end measures it
        anyway)."""
        if self.settings.every and (step % self.settings.every == 0 or step in self.warmup_probe_steps):
            self.probe(step)
        if self.tau_every and step % self.tau_every == 0 and step < end_step and self.is_main:
            with self._evaluating("tau"):
                measured = self.measure(self.model)
            row = self.tau_row(step, measured)
            self.log_tau(row)
            self.log.info(f"step {step}: tau {row['tau']:.3f}, by band "
                          f"{[round(t, 3) if t is not None else None for t in row['tau_by_band']]}")

    def tau_row(self, step: int, measured: dict[str, Any]) -> dict[str, Any]:
        """A tau.jsonl row (record.TAU_FIELDS) from one measurement of the trained draft: tau, its prompt-bootstrap
        standard error (``tau_bootstrap_se``: 1000 resamples of the prompts, seed 0) and prompt count, and tau per
        band with the bands' minimum and mean (each band's tau pools the verify steps of all its prompts)."""
        by_band = self.by_band(measured)
        bands = [t for t in by_band if t is not None]
        return {"step": step, "tau": float(measured["tau"]),
                "tau_se": tau_bootstrap_se(measured["accepted_per_prompt"]), "tau_prompts": int(measured["prompts"]),
                "tau_band_min": min(bands, default=math.nan),
                "tau_band_mean": float(np.mean(bands)) if bands else math.nan, "tau_by_band": by_band}

    def probe_bands(self) -> list[int] | None:
        """The bands every probe evaluation writes a row for (bands without held-out samples are left out); None
        when probes are off."""
        return None if self.probe_sets is None else [probe.band for probe in self.probe_sets.sets]

    def probe(self, step: int) -> None:
        """Evaluate every probe band once for this step number (rank 0)."""
        if self.probe_sets is None or step == self.last_probe_step:
            return
        self.last_probe_step = step
        if self.is_main:
            with self._evaluating("probe"):
                self.log_probes(self.probe_sets.evaluate(self.evaluate_batch, step, seed=self.settings.seed))

    def final_tau(self, step: int, should_stop: Callable[[], bool],
                  recorded: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Tau of the trained draft and of the untrained one (rank 0): ``tau``, ``tau_se``, ``tau_prompts``,
        ``tau_baseline``, ``tau_baseline_se``, ``tau_by_band``, ``tau_baseline_by_band``, ``tau_band_min``,
        ``tau_band_mean`` and ``complete``; a ``should_stop`` request ends it early (partial tau, NaN baseline,
        complete False). Its cost per draft: ``model.decode_num_prompts`` x ``model.decode_max_new_tokens`` tokens of
        draft forwards (replay; the target's continuations once per run) or of draft and target forwards
        (generate); the log tells its start, its progress (a line per tenth of the prompts, and every 30 s) and its
        end. A complete measurement is also a tau.jsonl row of ``step``. ``recorded``: tau.jsonl's row of ``step``
        when the trained draft of this step was measured already (a relaunch of a run that finished, or that a
        preemption stopped while it measured the untrained draft): it is taken as it is, and only the untrained
        draft is measured, so tau.jsonl never holds a step twice."""
        nothing = [None] * self.num_bands
        result = {"tau": math.nan, "tau_se": math.nan, "tau_prompts": 0, "tau_baseline": math.nan,
                  "tau_baseline_se": math.nan, "tau_by_band": nothing, "tau_baseline_by_band": nothing,
                  "tau_band_min": math.nan, "tau_band_mean": math.nan, "complete": True}
        if not self.is_main:
            return result
        with self._evaluating("tau"):
            if recorded is not None:
                self.log.info(f"tau (trained draft): step {step} was measured already ({record.TAU_FILE}: tau "
                              f"{recorded['tau']}): not measured again; the untrained draft's is measured")
                # JSON keeps a non-finite figure as null: back to NaN, as a measurement gives it
                row = {key: math.nan if value is None and key != "tau_by_band" else value
                       for key, value in recorded.items()}
                complete = True
            else:
                measured = self._measure("trained draft", self.model, should_stop)
                row, complete = self.tau_row(step, measured), bool(measured["complete"])
                if complete:
                    self.log_tau(row)
            result.update({key: row[key] for key in ("tau", "tau_se", "tau_prompts", "tau_by_band", "tau_band_min",
                                                     "tau_band_mean")},
                          complete=complete)
            if complete:   # the untrained draft (same initial weights), rebuilt and measured here
                untrained = self._measure("untrained draft", self.model.baseline_model(), should_stop)
                if untrained["complete"]:
                    result.update(tau_baseline=float(untrained["tau"]), tau_baseline_by_band=self.by_band(untrained),
                                  tau_baseline_se=tau_bootstrap_se(untrained["accepted_per_prompt"]))
        return result

    def measure(self, model, should_stop: Callable[[], bool] | None = None, on_prompt=None) -> dict[str, Any]:
        """One tau measurement of ``model`` over the tau prompts by ``model.tau_method`` (the dict of
        ``measure_acceptance``). Replay builds the target's continuations at its first call (the target is frozen:
        every later measurement, the untrained draft's too, reuses them); a build that ``should_stop`` interrupts
        is dropped and the measurement is incomplete."""
        if self.tau_method == "generate":
            return measure_acceptance(model, self.prompts, self.new_tokens, should_stop=should_stop,
                                      on_prompt=on_prompt)
        if self.continuations is None:
            started = time.perf_counter()
            built = TargetContinuations.build(self.model, self.prompts, self.new_tokens, should_stop=should_stop)
            if len(built) < len(self.prompts):
                return {"tau": math.nan, "verify_steps": 0, "new_tokens": 0, "prompts": 0, "complete": False,
                        "accepted_per_prompt": []}
            self.continuations = built
            self.log.info(f"tau: the target's greedy continuations of {len(built)} prompts (up to {self.new_tokens} "
                          f"tokens, {sum(map(len, built.tokens))} in all) built in "
                          f"{time.perf_counter() - started:.1f} s, once per run (model.tau_method=replay)")
        return replay_acceptance(model, self.continuations, should_stop=should_stop, on_prompt=on_prompt)

    def by_band(self, measured: dict[str, Any]) -> list[float | None]:
        """Tau per probe band from one measurement (``tau_by_band``)."""
        return tau_by_band(self.prompt_bands, measured["accepted_per_prompt"], self.num_bands)

    def _measure(self, name: str, model, should_stop: Callable[[], bool]) -> dict[str, Any]:
        """One tau measurement, announced and reported as it goes (a large target on a CPU takes minutes)."""
        started = last_report = time.perf_counter()
        total = len(self.prompts)
        self.log.info(f"tau ({name}): {total} held-out prompts x up to {self.new_tokens} new tokens by "
                      f"{self.tau_method} (model.decode_num_prompts, model.decode_max_new_tokens, model.tau_method)")

        every = max(1, -(-total // 10))   # a line per tenth of the prompts, or per PROGRESS_EVERY_S if sooner

        def report(done: int, of: int, tau_so_far: float) -> None:
            nonlocal last_report
            now = time.perf_counter()
            if done < of and (done % every == 0 or now - last_report >= PROGRESS_EVERY_S):
                last_report = now
                self.log.info(f"tau ({name}): {done}/{of} prompts, tau so far {tau_so_far:.3f}, "
                              f"{now - started:.0f} s")

        measured = self.measure(model, should_stop=should_stop, on_prompt=report)
        self.log.info(f"tau ({name}): {measured['tau']:.3f} (bootstrap SE "
                      f"{tau_bootstrap_se(measured['accepted_per_prompt']):.3f}) over {measured['prompts']}/{total} "
                      f"prompts in {time.perf_counter() - started:.1f} s")
        return measured

    @contextlib.contextmanager
    def _evaluating(self, kind: str) -> Iterator[None]:
        """The model in eval mode for one evaluation, its time counted by the ledger."""
        with self.ledger.evaluation(kind):
            self.model.eval()
            try:
                yield
            finally:
                self.model.train()
