"""One writer per run directory: an exclusive lock on ``<run dir>/run.lock``, held by rank 0 for the whole run.

Mechanism: ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the lock file, whose content names the holder (host, pid, start
time) as one JSON line. The kernel drops a flock when its process dies, however it dies (kill -9, OOM), so a lock
left by a dead process is free at once: the next run takes it and logs the holder it replaces as stale. A live
holder makes the second process stop within a second, naming the holder and the fix; nothing of the directory is
written first (the check comes before the run's log, checkpoints and records are opened).

Limits: flock is per host. On a shared file system two hosts see each other's lock only where the file system
passes flock through (Lustre with ``flock`` mounts, NFSv4); the holder's host is in the file either way, and a
lock whose holder is on another host is reported with that host. Ranks > 0 never take the lock (rank 0 alone
writes run files); a Slurm requeue starts after the preempted process has exited, so its lock is free.

The lock file is opened without following a symbolic link: a ``run.lock`` that is a link (or that cannot be
written) is refused in one line naming the fix (``refusal.RunDirUnwritable``); the link's target is never touched.

Cost: one open, one flock and one small write per run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from dflash_lab.refusal import RunDirUnwritable

LOCK_FILE = "run.lock"


class RunDirBusy(RuntimeError):
    """Another live process holds the run directory; the message names it and the fix."""


def _holder(text: str) -> dict:
    try:
        holder = json.loads(text)
        return holder if isinstance(holder, dict) else {}
    except ValueError:
        return {}


def describe(holder: dict) -> str:
    """``host H pid P since T`` of a lock file's content.

    Example:
        >>> describe({"host": "node1", "pid": 42, "started": "2026-12-03T08:00:00"})
        'host node1 pid 42 since 2026-12-03T08:00:00'
    """
    return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} since {holder.get('started', '?')}"


class RunDirLock:
    """The lock of one run directory (``acquire`` / ``release``; also a context manager).

    Example:
        >>> import tempfile
        >>> with RunDirLock(Path(tempfile.mkdtemp())) as lock:
        ...     lock.held
        True
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._file = None
        self.replaced: dict | None = None   # a stale holder this lock took over (its process had died)

    @property
    def held(self) -> bool:
        return self._file is not None

    def __getstate__(self) -> dict:
        # A lock is held by a process: a copy (submitit pickles the task and its globals for a requeue) holds none.
        return {**self.__dict__, "_file": None}

    def acquire(self) -> "RunDirLock":
        """Take the lock, or raise RunDirBusy naming the live holder. Records this process as the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self._open()
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _holder(handle.read())
            handle.close()
            raise RunDirBusy(
                f"run directory {self.path.parent} is in use by {describe(holder)}: two runs must not write one "
                f"directory. Wait for that run to end (or stop it), or start this one elsewhere "
                f"(hydra.run.dir=<another dir>)") from None
        handle.seek(0)
        previous = _holder(handle.read())
        self.replaced = previous or None    # written by a process that died holding the lock (a clean end clears it)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        handle.flush()
        self._file = handle
        return self

    def _open(self):
        """The lock file, opened for reading and writing; never through a symbolic link (the lock would empty
        whatever file the link names): a link, or a file or directory that cannot be written, is refused."""
        try:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP or self.path.is_symlink():
                raise RunDirUnwritable(
                    f"{self.path} is a symbolic link (to {os.readlink(self.path)}): the run's lock file must be its "
                    f"own file, or taking the lock would empty the link's target. Remove the link (rm "
                    f"'{self.path}') and launch again") from None
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            raise RunDirUnwritable(
                f"cannot write the run directory's lock file {self.path} ({exc.strerror}): make it and its directory "
                f"writable (chmod u+w '{self.path.parent}' '{self.path}'), or start this run elsewhere "
                f"(hydra.run.dir=<another dir>)") from None
        return os.fdopen(descriptor, "r+")

    def release(self) -> None:
        """Clear the holder and drop the lock (a clean end leaves nothing to take over)."""
        if self._file is None:
            return
        try:
            self._file.seek(0)
            self._file.truncate()
            self._file.flush()
        finally:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
