"""Refusals and environment failures as one line each: what the command line prints instead of a traceback.

- :class:`Refused`: a command stopped for a named cause whose message says the fix (a launch: a damaged cache, no
  intact checkpoint, a run directory that cannot be written...; compare: an --out it must not replace, runs that
  are not replicates...). ``python -m dflash_lab.train`` prints its message in one line and exits with code 2, as it
  does for the ``ValueError``/``FileNotFoundError`` of a refused config; the traceback only with
  ``HYDRA_FULL_ERROR=1``; ``python -m dflash_lab.compare`` and ``export`` likewise. Subclasses also derive from the
  builtin error they replace (``RuntimeError``, ``PermissionError``), so callers that caught those still do.
- :func:`unwritable_file`: a file the run must write that refuses it (permissions, ``chattr +i``, a read-only
  file system, a directory in its place), named with its path, in one line and in ``summary.json``'s ``error``.
- :func:`output_directory_problem`: an output directory a command would create where a file stands (the path, or
  one of its parents), named before the command does any work (``mkdir``'s ``FileExistsError`` is a traceback).
- :func:`full_disk`: the "no space left" or "file too large" error behind a failure, however deep in the chain
  (torch's checkpoint writer reports ``unexpected pos`` and keeps the ``OSError`` only as its context; safetensors
  keeps only its text, ``(os error 27)``), so the run and its ``summary.json`` name the real cause.

Example:
    >>> import errno
    >>> try:
    ...     try:
    ...         raise OSError(errno.EFBIG, "File too large")
    ...     except OSError:
    ...         raise RuntimeError("unexpected pos 575168 vs 575060")
    ... except RuntimeError as exc:
    ...     describe_failure(exc)
    'disk full: [Errno 27] File too large (while: RuntimeError: unexpected pos 575168 vs 575060): free space (or raise the file size limit, ulimit -f) and relaunch'
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
UNWRITABLE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR)   # a file the run cannot write


class Refused(Exception):
    """A command (a launch, compare, export) refused for a named cause; the message says the fix (printed as one
    line by the command line, exit code 2)."""


class DamagedCache(Refused, RuntimeError):
    """A cache entry (tiny target, tokenized data) whose files do not hold what was recorded when it was built;
    the message names the directory to delete so that the next run rebuilds it."""


class RunDirUnwritable(Refused, PermissionError):
    """The run directory (or its ``run.lock``) cannot be written; the message names the path and the fix."""


def output_directory_problem(path: os.PathLike | str) -> str | None:
    """Why ``path`` cannot be an output directory (made with ``mkdir(parents=True, exist_ok=True)``): it, or the
    nearest of its parents that is there, is a file (or anything but a directory); None when it can. Nothing is
    created.

    Example:
        >>> output_directory_problem(__file__) == f"{__file__} is an existing file, not a directory"
        True
        >>> output_directory_problem(os.path.join(__file__, "out")) == (
        ...     f"{os.path.join(__file__, 'out')}: its parent {__file__} is an existing file, not a directory")
        True
        >>> output_directory_problem(os.path.dirname(__file__)) is None
        True
    """
    path = Path(path)
    for place in (path, *path.parents):
        if place.is_dir():
            return None
        if place.exists() or place.is_symlink():   # a file, a link to nothing, a socket...
            what = "an existing file, not a directory" if place.is_file() else "there and not a directory"
            return f"{path} is {what}" if place == path else f"{path}: its parent {place} is {what}"
    return None


def full_disk(error: BaseException) -> OSError | None:
    """The out-of-space error (``ENOSPC``, ``EFBIG``: a file size limit, ``EDQUOT``) in ``error``'s chain (itself,
    its cause or its context), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in FULL_DISK_ERRNOS:
            return error
        for number in FULL_DISK_ERRNOS:   # writers in Rust or C++ (safetensors) keep only the text of the OSError
            if f"(os error {number})" in str(error):
                return OSError(number, os.strerror(number))
        error = error.__cause__ or error.__context__
    return None


def unwritable_file(error: BaseException) -> OSError | None:
    """The error of a named file that cannot be written (``EACCES``, ``EPERM``: e.g. ``chattr +i``, ``EROFS``,
    ``EISDIR``) in ``error``'s chain, or None.

    Example:
        >>> unwritable_file(PermissionError(1, "Operation not permitted", "run/metrics.jsonl")).filename
        'run/metrics.jsonl'
        >>> unwritable_file(PermissionError(1, "Operation not permitted")) is None   # no file named: not this case
        True
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in UNWRITABLE_ERRNOS and error.filename:
            return error
        error = error.__cause__ or error.__context__
    return None


def describe_failure(error: BaseException) -> str:
    """One line for a run's failure: the full-disk or unwritable-file cause and its fix where there is one, else
    ``Type: message``.

    Example:
        >>> describe_failure(PermissionError(1, "Operation not permitted", "run/metrics.jsonl"))
        'cannot write run/metrics.jsonl: [Errno 1] Operation not permitted: make it a writable file (chmod u+w; an immutable one: chattr -i) and relaunch'
    """
    disk = full_disk(error)
    if disk is None:
        blocked = unwritable_file(error)
        if blocked is None:
            return f"{type(error).__name__}: {error}"
        target = getattr(blocked, "filename2", None)   # os.replace(temporary copy, the file): the file it replaces
        named = f"{target} (from its temporary copy {blocked.filename})" if target else blocked.filename
        return (f"cannot write {named}: [Errno {blocked.errno}] {blocked.strerror}: make it a writable file (chmod "
                f"u+w; an immutable one: chattr -i) and relaunch")
    where = f" writing {disk.filename}" if disk.filename else ""
    outer = f" (while: {type(error).__name__}: {error})" if disk is not error else ""
    return (f"disk full{where}: [Errno {disk.errno}] {disk.strerror}{outer}: free space (or raise the file size "
            f"limit, ulimit -f) and relaunch")
