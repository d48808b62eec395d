"""On-disk caches shared by datasets and the tiny target: a hashed key, a directory built once, atomically.

Algorithm: ``build_once(path, build)`` returns at once when ``path`` exists. Otherwise it takes an exclusive
lock on ``path + ".lock"`` (``filelock``) (so DDP ranks or parallel jobs wait for one builder instead of racing;
a process that finds the lock taken logs that it waits for the builder, and again every minute it waits),
checks again, lets ``build`` fill a private temporary directory next to ``path`` and renames it into place
(``os.replace`` is atomic on one file system), so a reader never sees a half-written cache. Temporary
directories of a builder that was killed are removed by the next builder of the same entry.

Cost: one ``stat`` when the cache exists; otherwise whatever ``build`` costs.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)
WAIT_LOG_EVERY_S = 60.0   # a process waiting for another one's build says so again this often


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: ``cache_dir`` if given, else ``$DFLASH_LAB_CACHE``, else ``~/.cache/dflash_lab``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("DFLASH_LAB_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dflash_lab"


def config_hash(obj) -> str:
    """16 hex digits of sha256 over the canonical JSON of ``obj`` (dict keys sorted)."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def source_hash(*modules) -> str:
    """Hash of the code of ``modules``: a cache built by older code is never reused.

    The hash covers the syntax tree without docstrings, so comments, docstrings and formatting can change
    without invalidating caches (the tiny target's pretraining is long to redo); any change to the code does.
    """
    digest = hashlib.sha256()
    for module in modules:
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        digest.update(ast.dump(tree, include_attributes=False).encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def file_lock(lock_path: Path, waiting_for: str | None = None, log_every_s: float = WAIT_LOG_EVERY_S):
    """Exclusive lock held for the ``with`` block (blocks until free): ``filelock.FileLock``, an OS-level lock that
    a killed holder releases with its process. When the lock is taken, a log line says what this process waits for
    (``waiting_for``), again every ``log_every_s`` seconds, and when the wait ends."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        what = waiting_for or str(lock_path)
        log.info(f"waiting for another process to finish building {what} (it holds {lock_path})")
        started = time.monotonic()
        while True:
            try:
                lock.acquire(timeout=log_every_s)
                break
            except Timeout:
                log.info(f"still waiting for the build of {what} ({time.monotonic() - started:.0f} s)")
        log.info(f"waited {time.monotonic() - started:.1f} s for the build of {what}")
    try:
        yield
    finally:
        lock.release()


def build_once(path: Path, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """Make sure directory ``path`` exists, building it with ``build(tmp_dir)`` at most once.

    Args:
        path: final cache directory.
        build: fills the given (empty, temporary) directory; it is renamed to ``path`` on success and removed
            on failure.

    Returns:
        (path, built): built is True when this call ran ``build``.
    """
    path = Path(path)
    if path.is_dir():
        return path, False
    with file_lock(path.with_name(path.name + ".lock"), waiting_for=str(path)):
        if path.is_dir():  # another process finished while we waited for the lock
            return path, False
        # Holding the lock, nobody else builds this entry: temporary dirs left by a killed builder are stale.
        for stale in path.parent.glob(path.name + ".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
        try:
            build(tmp)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return path, True
