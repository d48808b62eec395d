"""Processes for data preparation: how many (``data.num_proc``), and a map over them that keeps the input order.

Algorithm: :func:`ordered_map` calls ``function(shared, task)`` for every task and yields the results in task
order. With one process it runs them here, one after the other. Otherwise a ``ProcessPoolExecutor`` of
``num_proc`` workers runs them; ``shared`` (a tokenizer, a file name) reaches each worker once, at its start: on
Linux the workers are forked, as torch's DataLoader forks its workers, so they inherit it without pickling and
without importing anything again; elsewhere they are spawned and ``shared`` is pickled once per worker. At most
``2 x num_proc`` tasks run or wait ahead of the result being awaited, so at most that many results are held,
whatever the number of tasks. While it waits for the next result, ``on_wait`` is called at the latest every
``wait_s()`` seconds (a progress line).

Properties: the results and their order are those of the one-process loop, for any ``num_proc`` (a task's
result may depend only on ``shared`` and the task). A worker that dies (killed for memory) stops the map with an
error naming ``data.num_proc``.

Cost: starting the workers (a fork each: milliseconds) and pickling each task and result between processes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from typing import Any

_SHARED: Any = None   # a worker's copy of ``shared`` (set by _start_worker)


def available_cpus() -> int:
    """The CPUs this process may use: its CPU affinity (``os.sched_getaffinity``; ``os.cpu_count`` where there is
    none), capped by Slurm's ``SLURM_CPUS_PER_TASK`` when set (a job step that does not bind its tasks to cores
    still gives each task only that many).

    Example:
        >>> available_cpus() >= 1
        True
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        cpus = min(cpus, int(slurm))
    return max(cpus, 1)


def resolve_num_proc(num_proc: int | None) -> int:
    """``data.num_proc`` as a number of processes: None means :func:`available_cpus`.

    Raises:
        ValueError: a value that is not a positive integer.

    Example:
        >>> resolve_num_proc(3)
        3
    """
    if num_proc is None:
        return available_cpus()
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"data.num_proc={num_proc!r}: give a number of processes >= 1, or null for the CPUs this "
                         f"process may use ({available_cpus()} here)")
    return num_proc


def _start_worker(shared: Any) -> None:
    global _SHARED
    _SHARED = shared
    # Ctrl-C reaches every process of the terminal's group: the parent stops the map, the workers stay quiet.
    # A handler inherited from a training process (preemption signals) must not run in a worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in ("SIGTERM", "SIGUSR1", "SIGUSR2"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)


def _run_in_worker(function: Callable[[Any, Any], Any], task: Any) -> Any:
    return function(_SHARED, task)


def ordered_map(function: Callable[[Any, Any], Any], shared: Any, tasks: Iterable, *, num_proc: int,
                on_wait: Callable[[], None] | None = None,
                wait_s: Callable[[], float] = lambda: 1.0) -> Iterator[Any]:
    """``function(shared, task)`` for each task, yielded in task order, computed in ``num_proc`` processes
    (module docstring).

    Args:
        function: a module-level function (workers find it by name).
        shared: what every call needs (a tokenizer, settings): sent to each worker once.
        tasks: small, picklable descriptions of the work (byte ranges of a file).
        num_proc: processes; 1 runs every call in this process.
        on_wait: called while waiting for a result, at the latest every ``wait_s()`` seconds.
        wait_s: how long to wait for a result before calling ``on_wait`` (asked anew each time).

    Raises:
        RuntimeError: a worker process died.

    Example:
        >>> list(ordered_map(pow, 2, range(5), num_proc=2))
        [1, 2, 4, 8, 16]
    """
    if num_proc <= 1:
        for task in tasks:
            yield function(shared, task)
        return
    method = "fork" if sys.platform.startswith("linux") else None
    pool = concurrent.futures.ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context(method),
                                                  initializer=_start_worker, initargs=(shared,))
    pending: collections.deque = collections.deque()
    remaining = iter(tasks)
    try:
        for task in remaining:
            pending.append(pool.submit(_run_in_worker, function, task))
            if len(pending) >= 2 * num_proc:
                break
        while pending:
            try:
                result = pending[0].result(timeout=max(wait_s(), 0.01))
            except concurrent.futures.TimeoutError:
                if on_wait is not None:
                    on_wait()
                continue
            pending.popleft()
            for task in remaining:   # one in, one out
                pending.append(pool.submit(_run_in_worker, function, task))
                break
            yield result
    except BrokenProcessPool as error:
        raise RuntimeError(f"a data preparation worker died ({error}; killed for lack of memory?): lower "
                           f"data.num_proc (now {num_proc})") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
