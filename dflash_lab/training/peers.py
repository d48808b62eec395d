"""The ranks of a distributed run: how they meet (rendezvous), which node each runs on, and how the run ends when
one of them is missing, in seconds and with one line that names it.

**Rendezvous** (:func:`rendezvous`). Rank 0 opens a TCP key-value store (torch's ``TCPStore``) at the master
address; every rank connects to it, writes ``joined/<rank>`` (its node name) and waits for rank 0's verdict. Rank 0
counts the ranks that joined for at most ``timeout_s`` seconds, then publishes either the run's topology (every
rank's node) or the ranks that never joined. Each way of not meeting ends in a :class:`PeerFailure` within the
bound, naming the rank:

- the master address does not resolve here: at once, on the rank that cannot resolve it;
- the master cannot be reached (no route, a firewall, nothing listening): after ``timeout_s``, on that rank;
- a rank never starts (or starts too late): after ``timeout_s``, on rank 0, which names the missing ranks, and on
  the ranks that joined, which read rank 0's verdict.

The process group (gloo or nccl) is then built on this store, so it never starts before every rank is there.

**Heartbeats** (:class:`PeerWatch`). Each rank runs a thread that adds 1 to its counter ``beat/<rank>`` every
``interval_s`` (``timeout_s / 10``, at most 1 s) over its own connection to the store. It also watches the run's
one ``stop`` key, which the first rank to fail sets (``compare_set``: the first writer wins) to
``{rank, node, what, why}``:

- a rank whose code fails (an exception) sets ``stop`` to its one-line error (``what="failed"``);
- a rank whose collective fails (a peer's socket closed: gloo says so at once) takes a roll call: the ranks whose
  counters do not move for ``3 x interval_s`` and that did not say goodbye are lost, and it sets ``stop`` to the
  lowest of them (``what="lost"``);
- rank 0's thread also judges: a rank whose counter has not moved for ``timeout_s`` is lost (a killed or frozen
  process, or a lost node, while every other rank waits in a collective that would otherwise wait for the process
  group's timeout, 30 minutes by default; nccl waits like that);
- a rank whose connection to the store breaks has lost rank 0, which hosts it.

A thread that sees ``stop`` set by another rank gives its main thread ``2 x interval_s`` to end by itself (it may
be failing already); a main thread blocked in a collective does not, and the thread ends the process: it calls
the ``on_stop`` callback (the trainer records the failure and prints the line) and exits with code 1. So every
rank ends within about ``timeout_s`` of the loss, and every record names the same rank.

**Goodbye.** A rank that ends sets ``bye/<rank>`` first (so no roll call takes it for lost); rank 0, which hosts
the store, waits up to ``3 x interval_s`` for the others' goodbyes before it exits, so the last readers of the
verdict can still read it.

Cost: one store ``add`` and one ``check`` per rank per interval, plus one ``multi_get`` of every counter on rank 0;
a few hundred bytes a second per rank, nothing on the training step.

Example (one process; a real run has world_size > 1)::

    >>> import socket
    >>> with socket.socket() as s:
    ...     s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    >>> store, nodes = rendezvous("127.0.0.1", port, rank=0, world_size=1, node="n1", timeout_s=5)
    >>> nodes
    ['n1']
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as torch_dist

def key_prefix() -> str:
    """The namespace of this attempt's keys in the store: under torchrun the store is its agent's, which outlives
    a restart of the workers (``TORCHELASTIC_RESTART_COUNT`` tells them apart)."""
    return f"dflash/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _agent_store() -> bool:
    """torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT: every rank, rank 0 too, is its client."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
SETTING_ADDR = "trainer.master_addr"
SETTING_RENDEZVOUS = "trainer.rendezvous_timeout_s"
SETTING_PEERS = "trainer.peer_timeout_s"
# what a collective raises when a peer's socket closes or a collective times out (gloo's errors are plain
# RuntimeErrors whose text names the transport)
_PEER_ERROR_TEXT = ("gloo", "nccl", "connection reset", "connection closed", "broken pipe", "socket timeout",
                    "connection refused", "timed out")


class PeerFailure(RuntimeError):
    """A rank could not join the run, or the run lost a rank: the message is one line naming the rank, its node and
    the setting to change.

    Attributes:
        rank: the rank that was lost or failed first (None: a rendezvous failure, the message names the ranks).
        lost: True when that rank was lost (its process gone), False when it failed with an error of its own.
    """

    def __init__(self, message: str, rank: int | None = None, lost: bool = False):
        super().__init__(message)
        self.rank, self.lost = rank, lost


def describe_rank(rank: int, nodes: list[str] | None) -> str:
    """``rank 1 (node vm2)``, or ``rank 1`` when the node is not known."""
    node = nodes[rank] if nodes and 0 <= rank < len(nodes) and nodes[rank] else None
    return f"rank {rank} (node {node})" if node else f"rank {rank}"


def is_peer_error(exc: BaseException) -> bool:
    """True for what a collective raises when a peer is gone (torch's distributed errors, gloo's socket errors)."""
    if isinstance(exc, torch_dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc).lower() for text in _PEER_ERROR_TEXT)


# --------------------------------------------------------------------------------------------------- rendezvous
def _resolve_problem(host: str, port: int) -> str | None:
    """Why ``host`` cannot be resolved here (None: it resolves, or the resolver may yet answer)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return f"the name {host!r} does not resolve here ({exc.strerror})"
    return None


def rendezvous(master_addr: str, master_port: int, *, rank: int, world_size: int, node: str, timeout_s: float,
               master_source: str = SETTING_ADDR) -> tuple[torch_dist.TCPStore, list[str]]:
    """Meet every rank at ``master_addr:master_port`` within ``timeout_s`` seconds.

    Args:
        master_addr, master_port: where rank 0 opens the store (``master_source`` says where the address came from,
            for the message).
        rank, world_size: this rank and the number of ranks.
        node: this rank's node name (recorded for the topology).
        timeout_s: the bound on the whole meeting.

    Returns:
        The store (the process group is built on it) and every rank's node name, in rank order.

    Raises:
        PeerFailure: one line naming the rank that cannot reach the master or the ranks that never joined.
    """
    where = f"{master_addr}:{master_port}"
    me = f"rank {rank} (node {node})"
    fix = (f"set {SETTING_ADDR}=<an address of the first node that every node can reach> (or the MASTER_ADDR "
           f"environment variable)")
    key = key_prefix()
    problem = _resolve_problem(master_addr, master_port)
    if problem:
        raise PeerFailure(f"{me} cannot reach the rendezvous master {where} (from {master_source}): {problem}; {fix}")
    started = time.monotonic()
    try:
        store = torch_dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0 and not _agent_store(),
                                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "ping failed" in reason.lower():   # something answered, but not a rendezvous store
            reason = f"another service answers at {where}, not the rendezvous store ({reason})"
        if rank == 0 and "address already in use" in reason.lower():
            raise PeerFailure(f"{me} cannot open the rendezvous at {where}: port {master_port} is in use on this "
                              f"node; set the MASTER_PORT environment variable to a free port") from None
        raise PeerFailure(f"{me} cannot reach the rendezvous master {where} (from {master_source}) within "
                          f"{timeout_s:g} s ({SETTING_RENDEZVOUS}): {reason}; {fix}") from None
    store.set(f"{key}joined/{rank}", node)
    store.add(f"{key}beat/{rank}", 1)
    store.add(f"{key}joined", 1)
    if rank == 0:
        return store, _count_joined(store, key, world_size, node, where, timeout_s, started)
    left = max(timeout_s - (time.monotonic() - started), 0.0) + 5.0   # rank 0's bound, and time to say it
    try:
        store.wait([f"{key}verdict"], timedelta(seconds=left))
        verdict = json.loads(store.get(f"{key}verdict"))
    except RuntimeError:
        raise PeerFailure(f"{me} joined the rendezvous at {where} but rank 0 gave no verdict within {left:g} s "
                          f"(rank 0 stopped; its log says why)") from None
    store.add(f"{key}verdict_read", 1)
    if verdict.get("missing"):
        raise PeerFailure(f"{me}: the rendezvous at {where} failed: {_never_joined(verdict['missing'], timeout_s)}")
    return store, list(verdict["nodes"])


def _never_joined(missing: list[int], timeout_s: float) -> str:
    ranks = ", ".join(str(r) for r in missing)
    return (f"rank{'s' if len(missing) > 1 else ''} {ranks} never joined within {timeout_s:g} s ({SETTING_RENDEZVOUS}):"
            f" {'they' if len(missing) > 1 else 'it'} did not start, or cannot reach the master (see "
            f"{'their' if len(missing) > 1 else 'its'} log); raise {SETTING_RENDEZVOUS} if ranks start slowly here")


def _count_joined(store: torch_dist.TCPStore, key: str, world_size: int, node: str, where: str, timeout_s: float,
                  started: float) -> list[str]:
    """Rank 0: wait for every rank's ``joined`` key, then publish the verdict (the topology, or who is missing)."""
    while store.add(f"{key}joined", 0) < world_size and time.monotonic() - started < timeout_s:
        time.sleep(0.05)
    joined = [r for r in range(world_size) if store.check([f"{key}joined/{r}"])]
    missing = sorted(set(range(world_size)) - set(joined))
    if missing:
        store.set(f"{key}verdict", json.dumps({"missing": missing}))
        # the ranks that joined read the verdict before this rank, which hosts the store, exits
        deadline = time.monotonic() + 3.0
        while store.add(f"{key}verdict_read", 0) < len(joined) - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        raise PeerFailure(f"rank 0 (node {node}): the rendezvous at {where} failed: {_never_joined(missing, timeout_s)}")
    nodes = [value.decode() for value in store.multi_get([f"{key}joined/{r}" for r in range(world_size)])]
    store.set(f"{key}verdict", json.dumps({"nodes": nodes}))
    return nodes


# ---------------------------------------------------------------------------------------------------- heartbeats
class PeerWatch:
    """Heartbeats and the run's ``stop`` verdict (see the module docstring).

    Args:
        store: the rendezvous store (the watch thread talks over its own clone of the connection).
        rank, nodes: this rank and every rank's node name.
        timeout_s: a rank silent this long is lost.
        on_stop: called from the watch thread, with the verdict's one line, when another rank stopped the run and
            this rank's main thread did not end by itself (blocked in a collective); the process then exits 1.
    """

    def __init__(self, store: torch_dist.TCPStore, rank: int, nodes: list[str], timeout_s: float,
                 on_stop: Callable[[str], None] | None = None):
        self.rank, self.nodes, self.world_size = rank, list(nodes), len(nodes)
        self.timeout_s = float(timeout_s)
        self.interval_s = min(1.0, self.timeout_s / 10)
        self.on_stop = on_stop
        self.key = key_prefix()
        self._main_store = store
        self._store = store.clone()   # the thread's own connection: no lock shared with the process group's
        self._closed = threading.Event()
        self._handled = threading.Event()   # the main thread is ending the run itself
        self._verdict: dict[str, Any] | None = None
        self.stopping = False   # this rank ends the run on a failure (:meth:`stop_run`)
        self._lost: set[int] = set()   # ranks found lost: no goodbye to wait for
        self._thread = threading.Thread(target=self._run, name="dflash-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    # ---- the thread
    def _run(self) -> None:
        others = [r for r in range(self.world_size) if r != self.rank]
        last = {r: (-1, time.monotonic()) for r in others}   # rank -> (counter, when it last moved)
        while not self._closed.wait(self.interval_s):
            try:
                self._store.add(f"{self.key}beat/{self.rank}", 1)
                if self.rank == 0:
                    self._judge(others, last)
                verdict = self._read_stop(self._store)
            except RuntimeError:   # the store is gone: rank 0, which hosts it, ended
                if self._closed.is_set():
                    return
                verdict = self._verdict or {"rank": 0, "what": "lost", "why": "its store stopped answering"}
            if verdict is not None and verdict.get("rank") != self.rank:
                self._end_for(verdict)
                return

    def _judge(self, others: list[int], last: dict[int, tuple[int, float]]) -> None:
        """Rank 0: a rank whose counter has not moved for ``timeout_s`` and that said no goodbye is lost."""
        now = time.monotonic()
        counters = self._store.multi_get([f"{self.key}beat/{r}" for r in others])
        for r, value in zip(others, counters):
            count = int(value)
            if count != last[r][0]:
                last[r] = (count, now)
            elif now - last[r][1] > self.timeout_s and not self._store.check([f"{self.key}bye/{r}"]):
                self._set_stop(self._store, r, "lost",
                               f"its heartbeat stopped {now - last[r][1]:.0f} s ago ({SETTING_PEERS}="
                               f"{self.timeout_s:g}): the process was killed or froze, or its node failed")
                return

    def _end_for(self, verdict: dict[str, Any]) -> None:
        """Another rank stopped the run: let the main thread end by itself, else end the process here."""
        self._verdict = verdict
        if self._handled.wait(2 * self.interval_s) or self._closed.is_set():
            return
        line = self.describe(verdict)
        try:
            if self.on_stop is not None:
                self.on_stop(line)
            else:
                print(line, file=sys.stderr, flush=True)
        finally:
            os._exit(1)

    # ---- the main thread
    def _read_stop(self, store: torch_dist.TCPStore) -> dict[str, Any] | None:
        if not store.check([f"{self.key}stop"]):
            return None
        verdict = json.loads(store.get(f"{self.key}stop"))
        if verdict.get("what") == "lost":
            self._lost.add(int(verdict["rank"]))
        return verdict

    def _set_stop(self, store: torch_dist.TCPStore, rank: int, what: str, why: str) -> dict[str, Any]:
        """Set the run's stop verdict unless a rank set one first; returns the verdict that stands."""
        mine = json.dumps({"rank": rank, "node": self.nodes[rank] if rank < len(self.nodes) else "", "what": what,
                           "why": why})
        verdict = json.loads(store.compare_set(f"{self.key}stop", "", mine))
        if verdict.get("what") == "lost":
            self._lost.add(int(verdict["rank"]))
        return verdict

    def describe(self, verdict: dict[str, Any]) -> str:
        """The verdict as the one line every rank reports."""
        who = describe_rank(int(verdict["rank"]), self.nodes)
        if verdict.get("what") == "lost":
            return (f"{who} was lost: {verdict.get('why')}; every rank stopped. Relaunch the same command (the same "
                    f"run or sweep directory) to resume from the newest checkpoint")
        return f"{who} failed: {verdict.get('why')}; every rank stopped"

    def stop_run(self, exc: BaseException) -> PeerFailure | None:
        """The main thread ends the run because of ``exc``; the other ranks are told (the ``stop`` verdict, unless
        a rank set it first) and this rank says goodbye. Returns the verdict as a :class:`PeerFailure` when the
        cause is another rank's (``exc`` is a failed collective: the rank that was lost, or that failed first),
        None when ``exc`` is this rank's own error (reported as it is)."""
        self._handled.set()
        self.stopping = True
        verdict = None
        try:
            verdict = self._read_stop(self._main_store)
            if not is_peer_error(exc):
                if verdict is None:
                    self._set_stop(self._main_store, self.rank, "failed", _short(exc))
                verdict = None
            elif verdict is None:
                lost = self.roll_call()
                verdict = (self._set_stop(self._main_store, lost[0], "lost", f"its heartbeat stopped ({_short(exc)}):"
                                          f" the process was killed or died, or its node failed") if lost
                           else self._set_stop(self._main_store, self.rank, "failed", _short(exc)))
        except RuntimeError:   # the store is gone with rank 0
            verdict = self._verdict or {"rank": 0, "what": "lost", "why": "its store stopped answering"}
        self.close(linger=True)
        if verdict is None or verdict.get("rank") == self.rank:
            return None
        return PeerFailure(self.describe(verdict), rank=int(verdict["rank"]), lost=verdict.get("what") == "lost")

    def roll_call(self) -> list[int]:
        """The ranks whose counters do not move for ``3 x interval_s`` and that said no goodbye (the store gone:
        ``[0]``)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [f"{self.key}beat/{r}" for r in others]
        try:
            before = self._main_store.multi_get(keys)
            time.sleep(3 * self.interval_s)
            after = self._main_store.multi_get(keys)
            return [r for r, a, b in zip(others, before, after)
                    if a == b and not self._main_store.check([f"{self.key}bye/{r}"])]
        except RuntimeError:
            return [0]

    def close(self, linger: bool = False) -> None:
        """Say goodbye and stop the thread. ``linger`` (rank 0, ending on a failure): wait up to ``3 x
        interval_s`` for the other ranks' goodbyes, so they can still read the verdict from the store it hosts."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._main_store.set(f"{self.key}bye/{self.rank}", "1")
            if linger and self.rank == 0:
                deadline = time.monotonic() + 3 * self.interval_s + 1.0
                others = [f"{self.key}bye/{r}" for r in range(1, self.world_size) if r not in self._lost]
                while others and time.monotonic() < deadline and not self._main_store.check(others):
                    time.sleep(0.05)
        except RuntimeError:
            pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.interval_s + 1.0)


def _short(exc: BaseException) -> str:
    """An exception as one short line: gloo's and nccl's source location and closing advice (which names no rank)
    are dropped.

    Example:
        >>> _short(RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9947. "
        ...                     "This is typically caused by a remote worker crashing. GLHF!"))
        'Connection closed by peer [127.0.0.1]:9947'
    """
    text = " ".join(str(exc).split()) or type(exc).__name__
    if is_peer_error(exc):
        text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
        text = re.split(r"\.\s+(?=This is typically|Check the logs|GLHF)", text)[0].rstrip(".")
    return text if len(text) <= 400 else text[:397] + "..."
