"""All-state checkpoints: independent files, an atomic pointer, the newest intact one on resume, and preemption.

A checkpoint is one ``torch.save`` dict holding everything needed to continue a run exactly: ``model`` (the draft),
``optimizer``, ``schedule`` (the LR schedule's parameters), ``sampler`` (the policy's tiny state), ``rng`` (python,
numpy, torch CPU and CUDA, anchor generator), ``step``, ``epoch``, ``config`` (the resolved run config),
``wandb_run_id`` and ``extra`` (run totals, last probed step).

Files in ``<run_dir>/checkpoints/``:
    ``step_<N>.pt``  one independent file per save, written to ``step_<N>.pt.tmp``, fsynced, renamed into place;
                     the newest ``keep`` are kept.
    ``last.json``    a small pointer ``{"file": "step_<N>.pt", "step": N}``, written atomically after the file it
                     names. It is informational: resume picks the newest *intact* step file by step number, so
                     a kill between the rename and the pointer update loses nothing, and a truncated newest
                     file falls back to the one before, with a log line naming both.
Stale ``*.tmp`` files of a killed save are removed when the manager starts.

Resume and changed settings (:func:`check_resume_config`): a continuation may change what does not alter the
computation (logging, checkpoint cadence, progress bar...), may change the schedule and optimizer settings
(``trainer.lr``, ``trainer.max_steps``... take effect: the LR schedule is rebuilt from the new values), and is
refused for everything else (data, sampler, model, seed...), with the keys and the fix in the message.

Preemption: :func:`install_preemption_handler` binds SIGUSR2/SIGTERM to :func:`request_checkpoint`, which only sets a
flag. The training loop reads it at every step boundary (OR-reduced across ranks), checkpoints, calls the handler
ours replaced (submitit's requeue), and raises :class:`Preempted` (exit code 75). Tau measurement polls it too.

Example:
    >>> import tempfile, pathlib
    >>> manager = CheckpointManager(pathlib.Path(tempfile.mkdtemp()) / "checkpoints", keep=2)
    >>> _ = manager.save({"step": 3, "model": {}}, step=3)
    >>> manager.load_latest()["step"]
    3
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_lab.records.record import CHECKPOINT_DIR
from dflash_lab.refusal import Refused

PREEMPTED_EXIT_CODE = 75
"""Exit code after a preemption checkpoint (EX_TEMPFAIL: "try again")."""

CHECKPOINT_FORMAT_VERSION = 2
POINTER_NAME = "last.json"
_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")
log = logging.getLogger("dflash_lab")


class Preempted(SystemExit):
    """Raised by the training loop after it checkpointed on request; exits the process with code 75."""

    def __init__(self, step: int, path: Path | None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.path = path

    def __str__(self) -> str:
        return f"preempted: checkpoint of step {self.step} written to {self.path}; exit code {PREEMPTED_EXIT_CODE}"


class NoIntactCheckpoint(Refused, RuntimeError):
    """Checkpoint files exist but none can be read: the run cannot continue from them (a refusal: one line)."""


def _atomic_write(path: Path, write) -> Path:
    """``write(handle)`` into ``path.tmp``, fsync, rename onto ``path`` (atomic on POSIX file systems)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(path: Path | str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load one checkpoint file (it holds numpy/python RNG state, so ``weights_only=False``: only load checkpoints
    you wrote yourself)."""
    return torch.load(Path(path), map_location=map_location, weights_only=False)


def unreadable_reason(error: BaseException) -> str:
    """Why a checkpoint file did not load, in one short line (torch's messages run over several sentences).

    Example:
        >>> unreadable_reason(RuntimeError("PytorchStreamReader failed reading zip archive: failed finding "
        ...                                "central directory. This is an internal miniz error. If you ..."))
        'RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory'
    """
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text.split('. ')[0][:120]}" if text else type(error).__name__


class CheckpointManager:
    """Writes, prunes and finds the checkpoints of one run directory.

    Args:
        directory: ``<run_dir>/checkpoints``.
        keep: how many ``step_<N>.pt`` files to keep (>= 1).
    """

    def __init__(self, directory: Path | str, keep: int = 2):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"trainer.keep_checkpoints={keep!r}: keep at least one checkpoint (an integer >= 1)")
        self.directory = Path(directory)
        self.keep = keep
        if self.directory.is_dir():
            stale = sorted(self.directory.glob("*.tmp"))
            for path in stale:
                path.unlink(missing_ok=True)
            if stale:
                log.info(f"checkpoints: removed {len(stale)} unfinished save(s) of a killed run: "
                         f"{', '.join(p.name for p in stale)}")

    @property
    def pointer_path(self) -> Path:
        return self.directory / POINTER_NAME

    def step_files(self) -> list[tuple[int, Path]]:
        """(step, path) of every ``step_<N>.pt``, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _STEP_FILE.match(p.name))]
        return sorted(found)

    def pointer(self) -> dict[str, Any] | None:
        """The ``last.json`` pointer, or None when it is missing or unreadable."""
        try:
            value = json.loads(self.pointer_path.read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write ``step_<step>.pt``, then the pointer, then prune old step files. Returns the step file's path."""
        state = {**state, "format_version": CHECKPOINT_FORMAT_VERSION}
        path = _atomic_write(self.directory / f"step_{step}.pt", lambda handle: torch.save(state, handle))
        pointer = json.dumps({"file": path.name, "step": int(step)}).encode()
        _atomic_write(self.pointer_path, lambda handle: handle.write(pointer))
        for _, old in self.step_files()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest_path(self) -> Path | None:
        """The newest step file by step number (not checked for integrity), or None."""
        files = self.step_files()
        return files[-1][1] if files else None

    def newest_intact(self, map_location: str | torch.device = "cpu", damaged: list[str] | None = None,
                      skip: Path | str | None = None) -> tuple[int, Path, dict[str, Any]] | None:
        """(step, path, state) of the newest step file that loads, or None; ``damaged`` collects the newer files
        that do not (``name (why)``); ``skip``: a file not to consider (one known to be damaged)."""
        skipped = Path(skip).resolve() if skip is not None else None
        for step, path in reversed(self.step_files()):
            if path.resolve() == skipped:
                continue
            try:
                return step, path, load_checkpoint(path, map_location=map_location)
            except Exception as exc:  # noqa: BLE001 - a truncated file must not hide an older good one
                if damaged is not None:
                    damaged.append(f"{path.name} ({unreadable_reason(exc)})")
        return None

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
        """The newest intact checkpoint (None when there is none); logs which file and why.

        Raises:
            NoIntactCheckpoint: files exist but none loads; the message says how to restart.
        """
        if not self.step_files():
            return None
        pointer = self.pointer() or {}
        damaged: list[str] = []
        found = self.newest_intact(map_location, damaged)
        if found is not None:
            step, path, state = found
            version = state.get("format_version")
            if version != CHECKPOINT_FORMAT_VERSION:  # a layout this code would misread: refuse, naming both
                raise ValueError(
                    f"{path} has checkpoint format_version {version!r}; this version of dflash_lab reads format "
                    f"{CHECKPOINT_FORMAT_VERSION}: resume it with the dflash_lab version that wrote it, or start a "
                    f"fresh run directory (hydra.run.dir=<new dir>)")
            reasons = []
            if damaged:
                reasons.append(f"newer file(s) unreadable: {'; '.join(damaged)}")
            if pointer.get("file") not in (None, path.name):
                reasons.append(f"the pointer {POINTER_NAME} names {pointer.get('file')}")
            why = f" ({'; '.join(reasons)})" if reasons else ""
            log.info(f"resuming from {path} at step {step}: the newest intact checkpoint{why}")
            state["_path"] = str(path)
            return state
        raise NoIntactCheckpoint(
            f"no intact checkpoint in {self.directory}: {'; '.join(damaged)}. The run cannot continue from these "
            f"files: start a fresh run directory (hydra.run.dir=<new dir>), or move {self.directory} away to "
            f"restart this run from step 0"
        )


def load_run_checkpoint(run_dir: Path | str, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
    """The newest intact checkpoint of a run directory (export, analysis, tests), or None."""
    return CheckpointManager(Path(run_dir) / CHECKPOINT_DIR).load_latest(map_location)


# ---------------------------------------------------------------------------------------- changed settings
# Keys whose change does not alter what is computed (dotted prefixes; "x_" matches every key starting with x_).
RESUME_TOLERATED = (
    "resume", "run_dir", "experiment", "logger", "analysis", "trainer.progress", "trainer.log_every", "trainer.log_every_s",
    "trainer.ckpt_every", "trainer.keep_checkpoints", "trainer.num_workers", "trainer.num_threads",
    "trainer.preempt_signals", "trainer.tau_every", "trainer.measure_tau", "trainer.steady_warmup_steps",
    "trainer.dist_backend", "trainer.master_addr", "trainer.rendezvous_timeout_s", "trainer.peer_timeout_s",
    "model.decode_", "probes.every", "trainer.cpu_step_warn_s", "data.max_truncated_fraction",
    "data.num_proc",   # the processes that tokenize a file: the same store for any value
)
# Keys added to the config after some checkpoints were written, with the value that computes what those runs
# computed: absent in the checkpoint's config and at this value now is no change.
NEUTRAL_WHEN_ADDED = {"sampler.bucket_by": "length"}
# ``probes.bands=auto`` resolves only once the data is loaded: the trainer compares the resolved bands with the
# checkpoint's (train.resume), so here the switch from a list to auto is let through.
RESOLVED_LATER = {"probes.bands": "auto"}
# Keys whose change takes effect on resume: the schedule is rebuilt, optimizer settings are re-applied.
RESUME_TAKES_EFFECT = (
    "trainer.lr", "trainer.min_lr_ratio", "trainer.warmup_frac", "trainer.max_steps", "trainer.epochs",
    "trainer.weight_decay", "trainer.betas", "trainer.grad_clip", "trainer.skip_nonfinite",
)


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") or (p.endswith("_") and key.startswith(p)) for p in prefixes)


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts.

    Example:
        >>> config_differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 0})
        ['a.c', 'd']
    """
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_differences(a, b, name + ".")
        elif a != b:
            out.append(name)
    return out


def check_resume_config(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Classify what changed since the checkpoint: returns the keys that take effect; refuses the rest.

    Example:
        >>> check_resume_config({"trainer": {"lr": 1e-3, "progress": True}}, {"trainer": {"lr": 2e-3, "progress": False}})
        ['trainer.lr']
        >>> check_resume_config({"seed": 0}, {"seed": 1})
        Traceback (most recent call last):
        ...
        ValueError: resume: seed (0 -> 1) changed since the checkpoint; a continuation must compute the same run. ...
        >>> check_resume_config({"sampler": {"name": "b"}}, {"sampler": {"name": "b", "bucket_by": "length"}})
        []
    """
    def value(config: Mapping[str, Any], key: str) -> Any:
        for part in key.split("."):
            config = config.get(part) if isinstance(config, Mapping) else None
        return config

    changed = [k for k in config_differences(old, new)
               if not (k in NEUTRAL_WHEN_ADDED and value(old, k) is None and value(new, k) == NEUTRAL_WHEN_ADDED[k])
               and not (k in RESOLVED_LATER and value(new, k) == RESOLVED_LATER[k])]
    effective = [k for k in changed if _matches(k, RESUME_TAKES_EFFECT)]
    refused = [k for k in changed if not _matches(k, RESUME_TAKES_EFFECT) and not _matches(k, RESUME_TOLERATED)]
    if refused:
        detail = ", ".join(f"{k} ({value(old, k)!r} -> {value(new, k)!r})" for k in refused)
        raise ValueError(
            f"resume: {detail} changed since the checkpoint; a continuation must compute the same run. Restore the "
            f"original value(s), or start a fresh run directory (hydra.run.dir=<new dir>)"
        )
    return effective


# ------------------------------------------------------------------------------------------------- RNG state
def capture_rng_state(anchor_generator: torch.Generator | None = None) -> dict[str, Any]:
    """Python, numpy, torch (CPU and every CUDA device) RNG states, plus the anchor generator's state."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if anchor_generator is not None:
        state["anchor"] = anchor_generator.get_state()
    return state


def restore_rng_state(state: dict[str, Any], anchor_generator: torch.Generator | None = None) -> None:
    """Inverse of :func:`capture_rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if anchor_generator is not None and "anchor" in state:
        anchor_generator.set_state(state["anchor"])


# ------------------------------------------------------------------------------------------------ preemption
_checkpoint_requested = False
_request_reason = ""
_previous_handlers: dict[int, Any] = {}


def request_checkpoint(reason: str = "requested") -> None:
    """Ask the training loop to checkpoint at the next step boundary and exit with code 75 (signal-safe)."""
    global _checkpoint_requested, _request_reason
    _checkpoint_requested = True
    _request_reason = reason


def checkpoint_requested() -> bool:
    """True once :func:`request_checkpoint` was called (by a signal or directly) and not yet cleared."""
    return _checkpoint_requested


def request_reason() -> str:
    """Why the checkpoint was requested (the signal name, or the caller's reason)."""
    return _request_reason


def clear_checkpoint_request() -> None:
    """Reset the flag (the trainer does this at start-up, so a stale request from an earlier run is ignored)."""
    global _checkpoint_requested, _request_reason
    _checkpoint_requested = False
    _request_reason = ""


def _on_signal(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    request_checkpoint(signal.Signals(signum).name)


def install_preemption_handler(signal_names: list[str] | tuple[str, ...] = ("SIGUSR2", "SIGTERM")) -> list[str]:
    """Bind the given signals to :func:`request_checkpoint`, remembering the handlers they replace.

    Only possible from the main thread; elsewhere nothing is installed and an empty list is returned.

    Raises:
        ValueError: for a name that is not a signal of this platform.
    """
    installed = []
    for name in signal_names:
        signum = getattr(signal, str(name), None)
        if not isinstance(signum, signal.Signals):
            raise ValueError(f"trainer.preempt_signals: {name!r} is not a signal name on this platform (e.g. SIGUSR2)")
        try:
            previous = signal.signal(signum, _on_signal)
        except ValueError:  # not the main thread
            return installed
        if previous is not _on_signal:
            _previous_handlers[int(signum)] = previous
        installed.append(name)
    return installed


def run_previous_handler() -> None:
    """After the preemption checkpoint: call the handler ours replaced for the signal that fired (e.g. submitit's
    requeue handler, which may exit here). Default/ignore handlers are skipped."""
    signum = getattr(signal, _request_reason, None)
    previous = _previous_handlers.get(int(signum)) if isinstance(signum, signal.Signals) else None
    if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
        previous(int(signum), None)


def uninstall_preemption_handler() -> None:
    """Put back the handlers that :func:`install_preemption_handler` replaced."""
    for signum, previous in list(_previous_handlers.items()):
        try:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        except ValueError:
            pass  # not the main thread: leave it
        _previous_handlers.pop(signum, None)
