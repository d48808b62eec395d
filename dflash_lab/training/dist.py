"""Distributed setup: who am I (rank, world size, local rank, master address), the process group, threads, device.

The environment is read, in order of precedence, from

1. torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
2. a submitit or Slurm job with more than one task, through ``submitit.helpers.TorchDistributedEnvironment`` (the
   task's global and local rank, the number of tasks, the first host of the job as master and a port derived from
   the job id); this is how ``hydra/launcher=slurm``, ``hydra/launcher=local`` and a plain ``srun`` start ranks,
3. otherwise a single process (rank 0 of 1).

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
from dataclasses import dataclass, replace
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
        source: where the values came from: ``torchrun``, ``submitit`` or ``single``.
        device: the torch device this rank computes on (set by :func:`setup`).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    source: str = "single"
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that writes run files and talks to W&B."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when more than one rank takes part."""
        return self.world_size > 1


def _job_env() -> DistEnv | None:
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
    master_addr = os.environ.get("MASTER_ADDR") or job.master_addr
    if len(set(hostnames)) <= 1 and "MASTER_ADDR" not in os.environ:
        master_addr = "127.0.0.1"  # one node: loopback always resolves (a local job's hostname may not)
    return DistEnv(rank=job.rank, world_size=job.world_size, local_rank=job.local_rank, master_addr=master_addr,
                   master_port=int(job.master_port), source="submitit")


def detect_env() -> DistEnv:
    """Rank, world size, local rank and master address of this process (see the module docstring).

    Example:
        >>> detect_env().source in ("single", "torchrun", "submitit")
        True
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            source="torchrun",
        )
    return _job_env() or DistEnv()


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
    env = detect_env()
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


def setup(device: str = "cpu", num_threads: int | None = None, backend: str | None = None) -> DistEnv:
    """Join the job (:func:`init_distributed`), select this rank's device and its torch thread count.

    Args:
        device: ``cpu`` or ``cuda`` (each rank takes GPU ``local_rank``).
        num_threads: torch threads per rank; None: the Slurm task's CPUs, else this process's CPUs / ranks on it.
        backend: process-group backend (None: nccl on GPU, gloo on CPU).
    """
    env = init_distributed(backend)
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
    """Leave the process group (if any); safe to call more than once."""
    if is_initialized():
        torch_dist.destroy_process_group()
