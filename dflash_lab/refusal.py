"""Refusals and environment failures as one line each: what the command line prints instead of a traceback.

- :class:`Refused`: a launch stopped for a named cause whose message says the fix (a damaged cache, no intact
  checkpoint, a run directory that cannot be written...). ``python -m dflash_lab.train`` prints its message in one
  line and exits with code 2, as it does for the ``ValueError``/``FileNotFoundError`` of a refused config; the
  traceback only with ``HYDRA_FULL_ERROR=1``. Subclasses also derive from the builtin error they replace
  (``RuntimeError``, ``PermissionError``), so callers that caught those still do.
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

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class Refused(Exception):
    """A launch refused for a named cause; the message says the fix (printed as one line by the command line)."""


class DamagedCache(Refused, RuntimeError):
    """A cache entry (tiny target, tokenized data) whose files do not hold what was recorded when it was built;
    the message names the directory to delete so that the next run rebuilds it."""


class RunDirUnwritable(Refused, PermissionError):
    """The run directory (or its ``run.lock``) cannot be written; the message names the path and the fix."""


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


def describe_failure(error: BaseException) -> str:
    """One line for a run's failure: the full-disk cause and its fix where there is one, else ``Type: message``."""
    disk = full_disk(error)
    if disk is None:
        return f"{type(error).__name__}: {error}"
    where = f" writing {disk.filename}" if disk.filename else ""
    outer = f" (while: {type(error).__name__}: {error})" if disk is not error else ""
    return (f"disk full{where}: [Errno {disk.errno}] {disk.strerror}{outer}: free space (or raise the file size "
            f"limit, ulimit -f) and relaunch")
