"""dflash_lab.training.peers and the rendezvous of dflash_lab.training.dist: ranks meet within a bound or the run
stops with one line naming the rank; a lost rank (killed, frozen) ends every rank, naming it.

Unit tier: the rendezvous in one process (ranks as threads, each with its own store connection), the master address
rules, the topology record and the launcher's reading of the trainer's error lines. Integration tier (real processes,
real gloo): a rank killed with SIGKILL mid-collective is named by the survivor in seconds; a frozen rank (SIGSTOP)
ends the blocked survivor through its heartbeat thread within the peer timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from dflash_lab.cluster.launch import QueueWatch
from dflash_lab.training import dist, peers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _meet(port: int, world: int, ranks: list[int], timeout_s: float) -> dict[int, object]:
    """Run the rendezvous of ``ranks`` (of ``world``) as threads; returns rank -> (nodes) or the exception."""
    results: dict[int, object] = {}
    stores = []   # rank 0's store lives as long as its process would (the process group holds it)

    def one(rank: int) -> None:
        try:
            store, nodes = peers.rendezvous("127.0.0.1", port, rank=rank, world_size=world, node=f"n{rank + 1}",
                                            timeout_s=timeout_s)
            stores.append(store)
            results[rank] = nodes
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return results


def test_ranks_meet_and_learn_every_rank_node():
    results = _meet(_free_port(), 3, [0, 1, 2], timeout_s=20)
    assert results == {0: ["n1", "n2", "n3"], 1: ["n1", "n2", "n3"], 2: ["n1", "n2", "n3"]}


def test_a_rank_that_never_joins_is_named_by_every_rank_within_the_bound():
    started = time.monotonic()
    results = _meet(_free_port(), 3, [0, 1], timeout_s=2)   # rank 2 never starts
    took = time.monotonic() - started
    for rank in (0, 1):
        assert isinstance(results[rank], peers.PeerFailure), results
        assert "rank 2 never joined within 2 s (trainer.rendezvous_timeout_s)" in str(results[rank])
    assert str(results[0]).startswith("rank 0 (node n1): the rendezvous at 127.0.0.1:")
    assert took < 2 + 5, took   # rank 0's bound, plus the time it gives the others to read the verdict


def test_a_master_name_that_does_not_resolve_fails_at_once_naming_rank_address_and_setting():
    started = time.monotonic()
    with pytest.raises(peers.PeerFailure) as caught:
        peers.rendezvous("no-such-node.invalid", 29999, rank=1, world_size=2, node="n2", timeout_s=30,
                         master_source="the first node's name")
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert message.startswith("rank 1 (node n2) cannot reach the rendezvous master no-such-node.invalid:29999 "
                              "(from the first node's name): the name 'no-such-node.invalid' does not resolve here")
    assert "set trainer.master_addr=" in message and "\n" not in message


def test_a_master_that_nobody_opened_fails_after_the_bound():
    port = _free_port()   # nothing listens there
    started = time.monotonic()
    with pytest.raises(peers.PeerFailure, match=r"rank 1 \(node n2\) cannot reach the rendezvous master "
                                                r"127\.0\.0\.1:\d+ \(from trainer\.master_addr\) within 2 s "
                                                r"\(trainer\.rendezvous_timeout_s\)"):
        peers.rendezvous("127.0.0.1", port, rank=1, world_size=2, node="n2", timeout_s=2)
    assert time.monotonic() - started < 2 + 10


def test_master_address_rules(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert dist.master_address(None, ["a", "a"]) == ("127.0.0.1", "loopback (one node)")
    assert dist.master_address("10.1.2.3", ["a", "b"]) == ("10.1.2.3", "trainer.master_addr")
    # a node Slurm does not know (or no Slurm here): its name, and the record says so
    addr, source = dist.master_address(None, ["no-such-node-here", "b"])
    assert addr == "no-such-node-here" and "scontrol gave no NodeAddr" in source
    monkeypatch.setenv("MASTER_ADDR", "10.9.9.9")
    assert dist.master_address(None, ["a", "b"]) == ("10.9.9.9", "the MASTER_ADDR environment variable")
    assert dist.master_address("10.1.2.3", ["a", "b"])[0] == "10.1.2.3"   # the setting wins


def test_topology_record_of_even_and_uneven_layouts():
    even = dist.DistEnv(world_size=4, nodes=("g1", "g1", "g2", "g2"), master_addr="10.0.0.1", master_port=20001,
                        master_source="trainer.master_addr").topology()
    assert even == {"topology": "2x2", "num_nodes": 2, "tasks_per_node": 2, "rank_nodes": ["g1", "g1", "g2", "g2"],
                    "rendezvous": "10.0.0.1:20001 (trainer.master_addr)"}
    uneven = dist.DistEnv(world_size=3, nodes=("g1", "g2", "g2")).topology()
    assert (uneven["topology"], uneven["tasks_per_node"]) == ("1+2", [1, 2])
    single = dist.DistEnv(node="box").topology()
    assert (single["topology"], single["rank_nodes"], single["rendezvous"]) == ("1x1", ["box"], None)


def test_gloo_errors_become_one_line_without_their_source_location():
    exc = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                       "[127.0.0.1]:9947. This is typically caused by a remote worker crashing. Check the logs of "
                       "the remote worker before reporting an error. GLHF!")
    assert peers.is_peer_error(exc)
    assert peers._short(exc) == "Connection closed by peer [127.0.0.1]:9947"
    assert not peers.is_peer_error(ValueError("sampler.max_tokens=0: give a positive number"))


def test_the_launcher_leads_with_the_runs_own_error_lines(tmp_path):
    # a job whose ranks printed why they stopped: the waiting command shows those lines first, once each
    folder = tmp_path / "sweep" / ".submitit" / "12"
    folder.mkdir(parents=True)
    line = "rank 1 (node vm2) was lost: its heartbeat stopped; every rank stopped"
    (folder / "12_0_log.err").write_text(f"[W socket.cpp] noise\ndflash_lab.train: error: {line}\n(HYDRA...)\n")
    (folder / "12_1_log.err").write_text("srun: error: vm2: task 1: Killed\n")
    message = QueueWatch(str(tmp_path / "sweep" / ".submitit" / "%j"), tasks=2)._describe(
        "12", folder, ("FAILED", "NonZeroExitCode"), None, [])
    assert message.startswith(f"Slurm job 12 failed (FAILED): {line}\n")
    assert f"hydra.sweep.dir={tmp_path / 'sweep'}" in message


# ------------------------------------------------------------------------------------ real processes (gloo)
def _rank_main(rank: int, port: int, peer_timeout_s: float, report: str) -> None:
    """One rank of a 2-rank gloo job that all-reduces until it fails; writes what it reports to ``report``."""
    import torch

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_distributed(backend="gloo", rendezvous_timeout_s=30, peer_timeout_s=peer_timeout_s)
    dist.on_peer_stop(lambda text: Path(report).write_text(f"thread: {text}"))
    Path(report + ".ready").write_text(str(os.getpid()))
    try:
        x = torch.ones(8)
        while True:
            dist.all_reduce_sum(x)
            time.sleep(0.01)
    except Exception as exc:  # noqa: BLE001 - what the trainer does with it
        Path(report).write_text(f"main: {dist.explain_failure(exc)}")
    finally:
        dist.cleanup()


def _start_two_ranks(tmp_path: Path, peer_timeout_s: float):
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_rank_main, args=(r, port, peer_timeout_s, str(tmp_path / f"rank{r}.txt")))
             for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{r}.txt.ready").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, "the two ranks did not start"
        time.sleep(0.1)
    time.sleep(1.0)   # a few collectives and heartbeats
    return procs


@pytest.mark.integration
def test_a_rank_killed_mid_collective_is_named_by_the_survivor_in_seconds(tmp_path):
    procs = _start_two_ranks(tmp_path, peer_timeout_s=10)
    killed = time.monotonic()
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[0].join(60)
    took = time.monotonic() - killed
    assert procs[0].exitcode == 0, procs[0].exitcode   # it ended by itself, through its main thread
    text = (tmp_path / "rank0.txt").read_text()
    assert text.startswith("main: rank 1 (node ") and " was lost: its heartbeat stopped (" in text, text
    assert took < 10, took   # gloo fails at once; the roll call takes 3 heartbeat intervals


@pytest.mark.integration
def test_a_frozen_rank_ends_the_blocked_survivor_within_the_peer_timeout(tmp_path):
    # SIGSTOP: the peer's sockets stay open, so gloo waits (for the process group's 30-minute timeout); rank 0's
    # heartbeat thread finds rank 1 silent, ends its blocked process with code 1 and reports the line
    procs = _start_two_ranks(tmp_path, peer_timeout_s=3)
    frozen = time.monotonic()
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        procs[0].join(60)
        took = time.monotonic() - frozen
    finally:
        os.kill(procs[1].pid, signal.SIGKILL)
    assert procs[0].exitcode == 1
    text = (tmp_path / "rank0.txt").read_text()
    assert text.startswith("thread: rank 1 (node ") and "heartbeat stopped" in text and \
        "(trainer.peer_timeout_s=3)" in text, text
    assert 3 <= took < 3 + 8, took
