"""dflash_lab.training.dist: environment detection (torchrun, Slurm, single) and a real 2-process gloo group."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from dflash_lab.training import dist


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_EXECUTOR",
                    "SUBMITIT_FOLDER", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                    "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_NODEID")


@pytest.fixture
def clean_env(monkeypatch):
    for key in LAUNCH_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_single_process_defaults(clean_env):
    env = dist.detect_env()
    assert (env.rank, env.world_size, env.local_rank, env.source) == (0, 1, 0, "single")
    assert env.is_main and not env.distributed


def test_torchrun_variables_win(clean_env):
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
                       "MASTER_PORT": "1234", "SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}.items():
        clean_env.setenv(key, value)
    env = dist.detect_env()
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (
        3, 4, 1, "node7", 1234, "torchrun")
    assert not env.is_main and env.distributed


def test_slurm_job_through_submitit_environment(clean_env):
    import random

    for key, value in {"SLURM_JOB_ID": "123456", "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
                       "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1"}.items():
        clean_env.setenv(key, value)
    env = dist.detect_env()
    assert (env.rank, env.world_size, env.local_rank, env.source) == (5, 8, 1, "submitit")
    assert env.master_addr == "gpu03"
    assert env.master_port == random.Random("123456").randint(20000, 60000)  # submitit's port rule


def test_single_task_slurm_job_is_a_single_process(clean_env):
    clean_env.setenv("SLURM_JOB_ID", "7")
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")
    assert dist.detect_env().world_size == 1


def test_init_without_launcher_is_a_noop(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SUBMITIT_EXECUTOR", "SUBMITIT_FOLDER"):
        monkeypatch.delenv(key, raising=False)
    env = dist.init_distributed()
    assert env.world_size == 1 and not dist.is_initialized()
    x = torch.tensor([2.0])
    assert dist.all_reduce_sum(x).item() == 2.0
    assert dist.all_gather_rows(torch.tensor([1.0, 2.0])).shape == (1, 2)
    assert dist.all_gather_objects({"a": 1}) == [{"a": 1}]
    dist.cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, results):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    env = dist.init_distributed()
    assert env.world_size == world and dist.is_initialized()
    total = dist.all_reduce_sum(torch.tensor([float(rank + 1)]))
    rows = dist.all_gather_rows(torch.tensor([float(rank), 10.0 * rank]))
    objs = dist.all_gather_objects({"rank": rank})
    results[rank] = (total.item(), rows.tolist(), objs)
    dist.cleanup()


@pytest.mark.integration
def test_two_process_gloo_group():
    port = _free_port()
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(2, port, results), nprocs=2, join=True)
    for rank in range(2):
        total, rows, objs = results[rank]
        assert total == 3.0
        assert rows == [[0.0, 0.0], [1.0, 10.0]]
        assert objs == [{"rank": 0}, {"rank": 1}]
