"""Progress of a data preparation pass: a log line at least every ``PROGRESS_EVERY_S`` seconds.

Algorithm: :class:`ItemProgress` counts the items done (conversations) and the bytes of the source they came from;
``advance`` after each chunk of work and ``tick`` while waiting for one write a line when ``every_s`` seconds
have passed since the last line (or the start): items done, their share of the source (bytes), items per second
and the ETA (the bytes left at the bytes-per-second so far). Lines go to the ``dflash_lab.data`` logger, plain
lines with no carriage returns: the same on a terminal and in a Slurm log (the planner's and the trainer's
logging shows them on the console and in their log files).

Cost: a clock read per call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dflash_lab.metrics.throughput import format_eta

PROGRESS_EVERY_S = 10.0   # the longest silence while preparing data
log = logging.getLogger("dflash_lab.data")


def format_bytes(count: float) -> str:
    """A size for humans, decimal units.

    Example:
        >>> format_bytes(3.26e9), format_bytes(512)
        ('3.26 GB', '512 B')
    """
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count:.0f} B"


class ItemProgress:
    """Items done out of a source of ``total_bytes`` bytes, logged at least every ``every_s`` seconds.

    Args:
        what: the source, as named in the lines (a file name).
        total_bytes: the source's size; the share done and the ETA are counted in its bytes.
        unit: what an item is, plural ("conversations").
        every_s: the longest time between two lines.
        clock: seconds (monotonic).

    Example:
        >>> progress = ItemProgress("chat.jsonl", 1000, every_s=0.0)
        >>> progress.advance(10, 250)
        >>> progress.lines
        1
    """

    def __init__(self, what: str, total_bytes: int, *, unit: str = "conversations",
                 every_s: float = PROGRESS_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.what, self.total_bytes, self.unit, self.every_s, self.clock = what, total_bytes, unit, every_s, clock
        self.started = self.last_line = clock()
        self.items = self.bytes = self.lines = 0

    def elapsed(self) -> float:
        return self.clock() - self.started

    def due_in(self) -> float:
        """Seconds until the next line is due (<= 0: now)."""
        return self.every_s - (self.clock() - self.last_line)

    def advance(self, items: int, nbytes: int) -> None:
        """Count ``items`` more done from ``nbytes`` more bytes of the source; a line if one is due."""
        self.items += items
        self.bytes += nbytes
        self.tick()

    def tick(self) -> None:
        """A line if one is due."""
        if self.due_in() <= 0:
            log.info(self.line())
            self.lines += 1
            self.last_line = self.clock()

    def line(self) -> str:
        """Items done, share of the source, items per second, ETA.

        Example:
            >>> times = iter([0.0, 20.0])
            >>> progress = ItemProgress("chat.jsonl", 1000, clock=lambda: next(times))
            >>> progress.items, progress.bytes = 4000, 250
            >>> progress.line()
            'data: 4,000 conversations (25% of chat.jsonl) in 20s: 200 conversations/s, ETA 1m 00s'
        """
        elapsed = self.elapsed()
        rate = self.items / elapsed if elapsed > 0 else float("nan")
        share = self.bytes / self.total_bytes if self.total_bytes else 1.0
        eta = elapsed * (self.total_bytes - self.bytes) / self.bytes if self.bytes else float("nan")
        return (f"data: {self.items:,} {self.unit} ({share:.0%} of {self.what}) in {format_eta(elapsed)}: "
                f"{rate:,.0f} {self.unit}/s, ETA {format_eta(eta)}")
