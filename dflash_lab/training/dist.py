"""Distributed setup: who am I (rank, world size, local rank, node), where the ranks meet (the master address),
the process group, threads, device.

The environment is read, in order of precedence, from

1. torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
2. a submitit or Slurm job with more than one task, through ``submitit.helpers.TorchDistributedEnvironment`` (the
   task's global and local rank, the number of tasks, the job's nodes, a port from ``MASTER_PORT`` or the job id);
   this is how ``hydra/launcher=slurm``, ``hydra/launcher=local`` and a plain ``srun`` start ranks,
3. otherwise a single process (rank 0 of 1).

The master address (where rank 0 opens the rendezvous, :func:`master_address`) is, first to last: the
``trainer.master_addr`` setting, the ``MASTER_ADDR`` environment variable, ``127.0.0.1`` when every rank runs on
one node, else the first node's ``NodeAddr`` as Slurm knows it (``scontrol show node``: the address slurmctld
reaches that node's slurmd at, so every node can reach it), else the first node's name. A node's *name* is not
used first because it need not resolve, or may resolve to an interface the other nodes cannot reach: a rendezvous
at an unreachable name waits silently for the process group's timeout (30 minutes).

The ranks then meet (:func:`dflash_lab.training.peers.rendezvous`: bounded by ``rendezvous_timeout_s``, one line
naming a rank that cannot reach the master or never joins), the process group is built on the rendezvous store,
and a heartbeat thread (:class:`dflash_lab.training.peers.PeerWatch`) ends every rank within ``peer_timeout_s`` of
a rank's loss. The rendezvous also gives every rank's node name: :attr:`DistEnv.nodes`, the run's topology.

Backend: ``nccl`` when CUDA is available, ``gloo`` on CPU. One process per GPU; ``local_rank`` selects the GPU.
:func:`setup` also sets the torch thread count per rank (a Slurm job's CPUs per task, else the CPUs this process may
use shared by the ranks of the node) and selects the device.

Example:
    >>> env = init_distributed()       # no-op for a single process
    >>> env.rank, env.world_size
    (0, 1)
    >>> cleanup()
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from dflash_lab.training import peers

DEFAULT_MASTER_PORT = 29517
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, 0..world_size-1.
        world_size: number of processes (ranks) in the job.
        local_rank: rank on this node; selects the GPU.
        master_addr: host of rank 0, used for the TCP rendezvous.
        master_port: port of that rendezvous.
        source: where the values came from: ``torchrun``, ``submitit`` or ``single``.
        device: the torch device this rank computes on (set by :func:`setup`).
        node: this rank's node name (Slurm's ``SLURMD_NODENAME``, else the host name).
        master_source: where ``master_addr`` came from (named in messages about the rendezvous).
        nodes: every rank's node name, in rank order (set once the ranks have met; ``(node,)`` for one process).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = LOOPBACK
    master_port: int = DEFAULT_MASTER_PORT
    source: str = "single"
    device: str = "cpu"
    node: str = ""
    master_source: str = "loopback (one process)"
    nodes: tuple[str, ...] = ()

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that writes run files and talks to W&B."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when more than one rank takes part."""
        return self.world_size > 1

    def topology(self) -> dict[str, Any]:
        """The run's topology as its records state it (``summary.json``, ``run_config.json``): ``topology`` (nodes x
        ranks per node), ``num_nodes``, ``tasks_per_node`` (a list when nodes differ), each rank's node
        (``rank_nodes``) and where the ranks met (``rendezvous``; null for one process).

        Example:
            >>> topology = DistEnv(world_size=2, nodes=("gpu1", "gpu2"), master_addr="10.0.0.1").topology()
            >>> topology["topology"], topology["num_nodes"], topology["tasks_per_node"]
            ('2x1', 2, 1)
        """
        nodes = list(self.nodes) or [self.node or socket.gethostname()]
        names = list(dict.fromkeys(nodes))   # first-seen order: rank 0's node first
        per_node = [nodes.count(name) for name in names]
        even = len(set(per_node)) == 1
        return {"topology": f"{len(names)}x{per_node[0]}" if even else "+".join(map(str, per_node)),
                "num_nodes": len(names), "tasks_per_node": per_node[0] if even else per_node, "rank_nodes": nodes,
                "rendezvous": (f"{self.master_addr}:{self.master_port} ({self.master_source})"
                               if self.world_size > 1 else None)}


def node_name() -> str:
    """This rank's node name: Slurm's (``SLURMD_NODENAME``: several slurmd on one host have several names), else
    the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def slurm_node_addr(node: str, timeout_s: float = 15.0) -> str | None:
    """The ``NodeAddr`` Slurm holds for ``node`` (``scontrol show node -o NODE``), or None when Slurm cannot say.

    Example:
        >>> slurm_node_addr("no-such-node-here", timeout_s=5) is None
        True
    """
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for field in out.stdout.split() if out.returncode == 0 else []:
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1] or None
    return None


def master_address(setting: str | None, hostnames: list[str]) -> tuple[str, str]:
    """Where rank 0 opens the rendezvous, and where that came from (see the module docstring for the order).

    Args:
        setting: ``trainer.master_addr`` (None: not set).
        hostnames: the job's nodes, first node first.

    Example:
        >>> master_address(None, ["gpu1", "gpu1"])
        ('127.0.0.1', 'loopback (one node)')
        >>> master_address("10.0.0.7", ["gpu1", "gpu2"])
        ('10.0.0.7', 'trainer.master_addr')
    """
    if setting:
        return setting, peers.SETTING_ADDR
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"], "the MASTER_ADDR environment variable"
    if len(set(hostnames)) <= 1:
        return LOOPBACK, "loopback (one node)"   # one node: loopback always resolves (a job's node name may not)
    first = hostnames[0]
    address = slurm_node_addr(first)
    if address:
        return address, f"the NodeAddr of the first node {first} (scontrol show node)"
    return first, f"the first node's name {first} (scontrol gave no NodeAddr)"


def _job_env(master_setting: str | None = None) -> DistEnv | None:
    """Rank/world/master of a multi-task submitit or Slurm job (None outside one, or with a single task)."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        if "SLURM_JOB_ID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1") or 1) <= 1:
            return None
        # a plain `srun` task: to submitit this is the environment of a Slurm job, which it only recognises
        # through this variable (its executor sets it for the jobs it submits)
        os.environ["SUBMITIT_EXECUTOR"] = "slurm"
    try:
        from submitit.helpers import TorchDistributedEnvironment

        job = TorchDistributedEnvironment()
        hostnames = list(job._job_env.hostnames)
    except Exception:  # not inside a job after all (e.g. a variable leaked into a child shell)
        return None
    if job.world_size <= 1:
        return None
    master_addr, source = master_address(master_setting, hostnames)
    return DistEnv(rank=job.rank, world_size=job.world_size, local_rank=job.local_rank, master_addr=master_addr,
                   master_port=int(job.master_port), source="submitit", node=node_name(), master_source=source)


def detect_env(master_addr: str | None = None) -> DistEnv:
    """Rank, world size, local rank, node and master address of this process (see the module docstring).

    Args:
        master_addr: ``trainer.master_addr`` (None: from the environment, see :func:`master_address`).

    Example:
        >>> detect_env().source in ("single", "torchrun", "submitit")
        True
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        addr, source = ((master_addr, peers.SETTING_ADDR) if master_addr
                        else (env.get("MASTER_ADDR", LOOPBACK), "the MASTER_ADDR environment variable"))
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=addr,
            master_port=int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            source="torchrun",
            node=node_name(),
            master_source=source,
        )
    return _job_env(master_addr) or DistEnv(node=node_name())


_watch: peers.PeerWatch | None = None


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0, *, master_addr: str | None = None,
                     rendezvous_timeout_s: float = 30.0, peer_timeout_s: float = 20.0) -> DistEnv:
    """Detect the environment and, when world_size > 1, meet the other ranks and join the process group.

    Args:
        backend: ``gloo`` or ``nccl``; default ``nccl`` when CUDA is available, else ``gloo``.
        timeout_s: collective timeout in seconds (the process group's own bound on one collective).
        master_addr: ``trainer.master_addr`` (None: see :func:`master_address`).
        rendezvous_timeout_s: every rank must join within this (:func:`peers.rendezvous`).
        peer_timeout_s: a rank whose heartbeat stops this long is lost, and every rank stops
            (:class:`peers.PeerWatch`).

    Returns:
        The :class:`DistEnv` of this process, with every rank's node. Calling it again after a successful init
        returns the same value.

    Raises:
        RuntimeError: if ``nccl`` is asked for without CUDA.
        peers.PeerFailure: a rank cannot reach the master, or a rank never joined (one line naming it).
    """
    global _watch, _joined_env
    env = detect_env(master_addr)
    if env.world_size <= 1:
        return replace(env, nodes=(env.node,))
    if torch_dist.is_available() and torch_dist.is_initialized():
        return _joined_env or env
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA; on CPU use 'gloo' (trainer.dist_backend=gloo)")
        torch.cuda.set_device(env.local_rank)
    store, nodes = peers.rendezvous(env.master_addr, env.master_port, rank=env.rank, world_size=env.world_size,
                                    node=env.node, timeout_s=rendezvous_timeout_s, master_source=env.master_source)
    torch_dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size,
                                  timeout=timedelta(seconds=timeout_s))
    _watch = peers.PeerWatch(store, env.rank, nodes, peer_timeout_s).start()
    _joined_env = replace(env, nodes=tuple(nodes))
    return _joined_env


_joined_env: DistEnv | None = None   # this process's environment once the ranks have met (with every rank's node)


def on_peer_stop(callback: Callable[[str], None] | None) -> None:
    """What this rank does when another rank stopped the run while this rank's main thread is blocked (called from
    the heartbeat thread with the one-line verdict, before the process exits with code 1): the trainer records the
    failure and prints the line."""
    if _watch is not None:
        _watch.on_stop = callback


def explain_failure(exc: BaseException) -> BaseException:
    """This rank ends the run because of ``exc``: tell the other ranks, and return the error to report, a
    :class:`peers.PeerFailure` naming the rank that was lost or failed first when the cause is another rank's,
    else ``exc`` itself. A single process: ``exc``."""
    if _watch is None:
        return exc
    return _watch.stop_run(exc) or exc


def setup(device: str = "cpu", num_threads: int | None = None, backend: str | None = None, *,
          master_addr: str | None = None, rendezvous_timeout_s: float = 30.0, peer_timeout_s: float = 20.0) -> DistEnv:
    """Join the job (:func:`init_distributed`), select this rank's device and its torch thread count. On CUDA the
    caching allocator gets expandable segments first, unless the user set it (``allocator.configure_cuda_allocator``).

    Args:
        device: ``cpu`` or ``cuda`` (each rank takes GPU ``local_rank``).
        num_threads: torch threads per rank; None: the Slurm task's CPUs, else this process's CPUs / ranks on it.
        backend: process-group backend (None: nccl on GPU, gloo on CPU).
        master_addr, rendezvous_timeout_s, peer_timeout_s: see :func:`init_distributed`.
    """
    from dflash_lab.training.allocator import configure_cuda_allocator

    configure_cuda_allocator("cuda" if device.startswith("cuda") else "cpu")   # before CUDA's first use
    env = init_distributed(backend, master_addr=master_addr, rendezvous_timeout_s=rendezvous_timeout_s,
                           peer_timeout_s=peer_timeout_s)
    if device.startswith("cuda"):
        device = f"cuda:{env.local_rank}"
        torch.cuda.set_device(device)
    slurm_cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    default = int(slurm_cpus) if slurm_cpus else len(os.sched_getaffinity(0)) // max(1, env.world_size)
    torch.set_num_threads(num_threads or max(1, default))
    return replace(env, device=device)


def wrap_ddp(model: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """DistributedDataParallel over the trainable parameters when several ranks take part; the model otherwise.

    The frozen target is identical on every rank (same weights from the same cache or path), so its parameters
    are left out of DDP's initial broadcast and gradient buckets.
    """
    if not env.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    return DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.startswith("cuda") else None)


def is_initialized() -> bool:
    """True when a process group is active (world_size > 1)."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def barrier() -> None:
    """Wait for every rank; a no-op for a single process."""
    if is_initialized():
        torch_dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place (a no-op for one process) and return it."""
    if is_initialized():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor


def all_gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Stack every rank's 1-D `tensor` (same shape on all ranks) into [world_size, n]; [1, n] for one process."""
    if not is_initialized():
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(torch_dist.get_world_size())]
    torch_dist.all_gather(parts, tensor)
    return torch.stack(parts)


def all_gather_objects(obj):
    """Every rank's picklable `obj` as a list in rank order (``[obj]`` for one process). Collective: all ranks call
    it."""
    if not is_initialized():
        return [obj]
    out = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def cleanup() -> None:
    """Stop the heartbeats and leave the process group (if any); safe to call more than once. After a clean end
    every rank stops its heartbeat thread before the barrier, so no thread sees rank 0's store close as a loss."""
    global _watch, _joined_env
    watch, _watch, _joined_env = _watch, None, None
    if watch is not None:
        clean_end = not watch.stopping   # after a failure other ranks may sit in another collective: no barrier
        watch.close()
        if clean_end and is_initialized():
            try:
                torch_dist.barrier()
            except RuntimeError:
                pass   # a rank is gone: the run's verdict is already recorded
    if is_initialized():
        torch_dist.destroy_process_group()
