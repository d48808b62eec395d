"""All-state checkpoints, written atomically, and the preemption hook.

A checkpoint is one ``torch.save`` dict holding everything needed to continue a run exactly (STYLE.md rule 7):
``model`` (the trainable draft's state dict), ``optimizer``, ``scheduler``, ``sampler`` (the policy's tiny state:
version, epoch, batches_consumed, fingerprint), ``rng`` (python, numpy, torch CPU, CUDA, anchor generator), ``step``,
``epoch``, ``config`` (the resolved run config as a plain dict), ``wandb_run_id`` and ``extra`` (trainer bookkeeping).

Files in ``<run_dir>/checkpoints/``:
    ``step_<N>.pt``  one per save; the newest ``keep`` of them are kept (default 2: the last and the one before,
                     so a checkpoint that turns out to precede a divergence still has a good predecessor).
    ``last.pt``      a copy of the newest good checkpoint; resume reads it (falling back to the newest step file).
A checkpoint is only ever written from a state whose step losses were finite, so ``last.pt`` is always the last
good state. Each file is written to ``<name>.tmp`` and renamed into place, so a kill mid-write never leaves a
truncated checkpoint behind.

Preemption (used by the Slurm launcher; issue 5):
    * :func:`install_preemption_handler` binds SIGUSR2 and SIGTERM (configurable) to :func:`request_checkpoint`,
      which only sets a flag (signal-safe). The training loop polls :func:`checkpoint_requested` at every step
      boundary (the flag is OR-reduced across ranks, so every rank stops at the same step), writes a checkpoint,
      then calls the signal handlers that were installed before ours (e.g. submitit's requeue handler) and finally
      raises :class:`Preempted`, a ``SystemExit`` with code :data:`PREEMPTED_EXIT_CODE` (75, EX_TEMPFAIL).
    * Anything else (a watchdog, a test) may call :func:`request_checkpoint` directly.
    * The requeued job re-runs in the same run directory; the trainer finds ``checkpoints/last.pt`` and continues
      with no lost or repeated step.

Example:
    >>> import tempfile, pathlib
    >>> manager = CheckpointManager(pathlib.Path(tempfile.mkdtemp()) / "checkpoints", keep=2)
    >>> _ = manager.save({"step": 3, "model": {}}, step=3)
    >>> manager.load_latest()["step"]
    3
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch

PREEMPTED_EXIT_CODE = 75
"""Exit code after a preemption checkpoint (EX_TEMPFAIL: "try again"); Slurm scripts requeue on it."""

CHECKPOINT_FORMAT_VERSION = 1
_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


class Preempted(SystemExit):
    """Raised by the training loop after it checkpointed on request; exits the process with code 75."""

    def __init__(self, step: int, path: Path | None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.path = path

    def __str__(self) -> str:
        return f"preempted: checkpoint of step {self.step} written to {self.path}; exit code {PREEMPTED_EXIT_CODE}"


def atomic_torch_save(obj: Any, path: Path) -> Path:
    """``torch.save`` to ``path.tmp``, fsync, then rename onto ``path`` (atomic on POSIX file systems)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def _atomic_copy(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` through a temporary file and a rename (a hard link when possible: no bytes copied)."""
    tmp = dst.with_name(dst.name + ".tmp")
    if tmp.exists():
        tmp.unlink()
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


class CheckpointManager:
    """Writes, prunes and finds the checkpoints of one run directory.

    Args:
        directory: ``<run_dir>/checkpoints``.
        keep: how many ``step_<N>.pt`` files to keep (>= 1); ``last.pt`` is kept in addition.
    """

    def __init__(self, directory: Path | str, keep: int = 2):
        if keep < 1:
            raise ValueError(f"trainer.keep_checkpoints={keep}: keep at least one checkpoint")
        self.directory = Path(directory)
        self.keep = keep

    @property
    def last_path(self) -> Path:
        """``<dir>/last.pt``."""
        return self.directory / "last.pt"

    def step_files(self) -> list[tuple[int, Path]]:
        """(step, path) of every ``step_<N>.pt``, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _STEP_FILE.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write ``step_<step>.pt`` and ``last.pt`` atomically, then prune old step files.

        Args:
            state: the full checkpoint dict (see the module docstring).
            step: optimizer steps completed; names the file.

        Returns:
            The path of the step file.
        """
        state = dict(state)
        state.setdefault("format_version", CHECKPOINT_FORMAT_VERSION)
        path = atomic_torch_save(state, self.directory / f"step_{step}.pt")
        _atomic_copy(path, self.last_path)
        for _, old in self.step_files()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest_path(self) -> Path | None:
        """``last.pt`` if present, else the newest step file, else None."""
        if self.last_path.is_file():
            return self.last_path
        files = self.step_files()
        return files[-1][1] if files else None

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
        """Load the newest checkpoint (None when there is none). Falls back to older files if one is unreadable."""
        candidates = ([self.last_path] if self.last_path.is_file() else []) + [p for _, p in reversed(self.step_files())]
        errors = []
        for path in candidates:
            try:
                return load_checkpoint(path, map_location=map_location)
            except Exception as exc:  # a damaged file must not hide an older good one
                errors.append(f"{path.name}: {exc}")
        if errors:
            raise RuntimeError(f"no readable checkpoint in {self.directory}: " + "; ".join(errors))
        return None


def load_checkpoint(path: Path | str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load one checkpoint file written by :class:`CheckpointManager` (it holds numpy/python RNG state, so the
    file is loaded with ``weights_only=False``: only load checkpoints you wrote yourself)."""
    return torch.load(Path(path), map_location=map_location, weights_only=False)


# ----------------------------------------------------------------------------------------------------------- RNG state


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


# ------------------------------------------------------------------------------------------------------- preemption

_checkpoint_requested = False
_request_reason = ""
_previous_handlers: dict[int, Any] = {}


def request_checkpoint(reason: str = "requested") -> None:
    """Ask the training loop to checkpoint at the next step boundary and then exit with code 75.

    Only sets a flag, so it is safe to call from a signal handler or another thread.
    """
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

    Only possible from the main thread; elsewhere (e.g. a thread-based launcher) nothing is installed and an empty
    list is returned; :func:`request_checkpoint` still works.

    Args:
        signal_names: names such as ``"SIGUSR2"`` (``trainer.preempt_signals``).

    Returns:
        The names actually installed.

    Raises:
        ValueError: for a name that is not a signal of this platform.
    """
    installed = []
    for name in signal_names:
        signum = getattr(signal, name, None)
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
    """After the preemption checkpoint: call the handler our hook replaced for the signal that fired (e.g.
    submitit's checkpoint-and-requeue handler, which requeues the job and exits). Default/ignore handlers are
    skipped; the caller then raises :class:`Preempted`."""
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
