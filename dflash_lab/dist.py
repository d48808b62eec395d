"""Distributed setup: who am I (rank, world size, local rank, master address) and the process group.

The environment is read, in order of precedence, from

1. torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
2. submitit (``submitit.JobEnvironment()``: the task's global rank, local rank and number of tasks; the master is the
   first node of the job), which is how ``hydra/launcher=slurm`` and ``hydra/launcher=local`` start ranks,
3. plain Slurm variables (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_JOB_NODELIST``) for ``srun``,
4. otherwise a single process (rank 0 of 1).

Backend: ``nccl`` when CUDA is available, ``gloo`` on CPU. One process per GPU; ``local_rank`` selects the GPU.

Example:
    >>> env = init_distributed()       # no-op for a single process
    >>> env.rank, env.world_size
    (0, 1)
    >>> cleanup()
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as torch_dist

DEFAULT_MASTER_PORT = 29517


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, 0..world_size-1.
        world_size: number of processes (ranks) in the job.
        local_rank: rank on this node; selects the GPU.
        master_addr: host of rank 0, used for the TCP rendezvous.
        master_port: port of that rendezvous.
        source: where the values came from: ``torchrun``, ``submitit``, ``slurm`` or ``single``.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    source: str = "single"

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that writes run files and talks to W&B."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when more than one rank takes part."""
        return self.world_size > 1


def _first_slurm_host(nodelist: str) -> str:
    """First host name of a Slurm node list such as ``node[03-05,07]`` or ``a1,a2``."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError):
        pass  # scontrol is not on every machine that sets SLURM_* variables; parse the common forms ourselves
    match = re.match(r"^([^\[,]+)(?:\[(\d+))?", nodelist)
    if not match:
        return "127.0.0.1"
    return match.group(1) + (match.group(2) or "")


def _port_from_job_id(job_id: str | None) -> int:
    """A job-specific port, so two jobs sharing a node do not collide on the rendezvous port."""
    if job_id and job_id.split("_")[0].isdigit():
        return 20000 + int(job_id.split("_")[0]) % 20000
    return DEFAULT_MASTER_PORT


def detect_env(environ: dict[str, str] | None = None) -> DistEnv:
    """Read rank, world size, local rank and master address from torchrun, submitit or Slurm.

    Args:
        environ: environment mapping to read (default ``os.environ``); tests pass their own.

    Returns:
        The :class:`DistEnv` of this process; a single process when no launcher variables are set.

    Example:
        >>> detect_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
        DistEnv(rank=1, world_size=2, local_rank=1, master_addr='h', master_port=1234, source='torchrun')
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            source="torchrun",
        )
    if "SUBMITIT_EXECUTOR" in env or "SUBMITIT_FOLDER" in env:
        submitit_env = _submitit_env(env)
        if submitit_env is not None:
            return submitit_env
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            master_port=int(env.get("MASTER_PORT") or _port_from_job_id(env.get("SLURM_JOB_ID"))),
            source="slurm",
        )
    return DistEnv()


def _submitit_env(env) -> DistEnv | None:
    """Rank and world from ``submitit.JobEnvironment()`` (works for both submitit_slurm and submitit_local)."""
    try:
        import submitit

        job_env = submitit.JobEnvironment()
        rank, world_size, local_rank = job_env.global_rank, job_env.num_tasks, job_env.local_rank
        hostnames = list(getattr(job_env, "hostnames", []) or [])
        job_id = str(job_env.job_id)
    except Exception:  # not inside a submitit job after all (e.g. the variable leaked into a child shell)
        return None
    master_addr = env.get("MASTER_ADDR") or (hostnames[0] if hostnames else "127.0.0.1")
    if len(hostnames) <= 1 and "MASTER_ADDR" not in env:
        master_addr = "127.0.0.1"  # single node (submitit_local reports the local hostname): loopback always works
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        master_addr=master_addr,
        master_port=int(env.get("MASTER_PORT") or _port_from_job_id(job_id)),
        source="submitit",
    )


_ENV: DistEnv = DistEnv()


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> DistEnv:
    """Detect the environment and, when world_size > 1, join the process group.

    Args:
        backend: ``gloo`` or ``nccl``; default ``nccl`` when CUDA is available, else ``gloo``.
        timeout_s: collective timeout in seconds (a rank that never arrives fails the job after this long).

    Returns:
        The :class:`DistEnv` of this process. Calling it again after a successful init returns the same value.

    Raises:
        RuntimeError: if ``nccl`` is asked for without CUDA.
    """
    global _ENV
    env = detect_env()
    _ENV = env
    if env.world_size <= 1 or (torch_dist.is_available() and torch_dist.is_initialized()):
        return env
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA; on CPU use 'gloo' (trainer.dist_backend=gloo)")
        torch.cuda.set_device(env.local_rank)
    torch_dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return env


def current_env() -> DistEnv:
    """The environment found by the last :func:`init_distributed` (a single process before that)."""
    return _ENV


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
    """Every rank's picklable `obj` as a list in rank order (``[obj]`` for one process). Collective: all ranks call it."""
    if not is_initialized():
        return [obj]
    out = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank (identity for one process). Collective: all ranks call it."""
    if not is_initialized():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src)
    return box[0]


def cleanup() -> None:
    """Leave the process group (if any); safe to call more than once."""
    global _ENV
    if is_initialized():
        torch_dist.destroy_process_group()
    _ENV = DistEnv()
