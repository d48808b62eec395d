"""Progress lines for a command that may run long (the planner on millions of samples: minutes, no table until the
end): what it is doing and for how long, on stderr.

:class:`StageTimer` is a context manager around the work. The work names its stage as it goes (``stage(text)``: "reading
the data", "policy bucketed (3 of 6): ..."); a daemon thread prints ``<name>: <elapsed> s, <stage>`` once ``every_s``
seconds have passed since the start, then every ``every_s`` seconds, whatever the stage and however long one
stage lasts (a line per stage change alone would leave a slow stage silent). A command that ends sooner prints no
line; one that printed any ends with ``<name>: done in <elapsed> s``. Only timing decides when a line is printed, and
it goes to stderr: what the command prints on stdout and writes to its files stays the same, run after run.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> with StageTimer("plan", every_s=0, stream=out) as progress:   # every_s=0: no lines at all
    ...     progress.stage("reading the data")
    >>> out.getvalue()
    ''
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class StageTimer:
    """Progress lines on a timer, each naming the stage the work is in (module docstring).

    Args:
        name: what prefixes each line (the command: ``plan``).
        every_s: seconds before the first line and between lines; 0 turns them off.
        stream: where the lines go (default: ``sys.stderr`` as it is when a line is written).
        tick_s: how often the thread looks at the clock (a line is at most this late).
    """

    def __init__(self, name: str, every_s: float, stream: TextIO | None = None, tick_s: float = 0.25):
        self.name, self.every_s, self.stream = name, float(every_s), stream
        self.tick_s = min(tick_s, self.every_s) if self.every_s > 0 else tick_s
        self.current = "starting"
        self.lines = 0
        self._started = self._last = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def stage(self, text: str) -> None:
        """What the work does from now on (named in the next line)."""
        self.current = text

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def _write(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(f"{self.name}: {text}\n")
        stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            if now - self._last >= self.every_s:
                self._last = now
                self.lines += 1
                self._write(f"{now - self._started:.0f} s, {self.current}")

    def __enter__(self) -> StageTimer:
        self._started = self._last = time.monotonic()
        if self.every_s > 0:
            self._thread = threading.Thread(target=self._run, name=f"{self.name}-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.lines:
            self._write(f"done in {self.elapsed():.0f} s" if exc_info[0] is None else
                        f"stopped after {self.elapsed():.0f} s, {self.current}")
