"""Shared test setup: caches kept out of the checkout and the user's cache, and the tiers.

Tiers (``pyproject.toml`` markers): plain ``pytest`` runs the unit tier (no model training, no tiny-target
pretraining, no subprocess, no cluster; its time: README.md, "Two commands on a fresh machine"). ``integration`` tests train, pretrain or start
processes, ``slurm`` tests need the local cluster; ``bash scripts/test.sh`` runs every tier.

Caches: every test process (and the training subprocesses it starts, which inherit the environment) uses one test
cache, ``$DFLASH_LAB_TEST_CACHE`` or ``<temp dir>/dflash_lab-test-cache``: the tiny target is pretrained there once
per machine, flex_attention's compiled kernels are kept there, and Hypothesis keeps its examples there. Nothing is
written into the checkout or into the user's ``~/.cache/dflash_lab``.

Order: the slowest modules run first (``SLOWEST_FIRST``), so both xdist workers end on short modules.
"""

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

sys.dont_write_bytecode = True   # the checkout keeps no test-made __pycache__ (scripts/setup.sh compiles once)

TEST_CACHE = Path(os.environ.get("DFLASH_LAB_TEST_CACHE") or Path(tempfile.gettempdir()) / "dflash_lab-test-cache")
TEST_CACHE.mkdir(parents=True, exist_ok=True)
os.environ["DFLASH_LAB_CACHE"] = str(TEST_CACHE)   # never the user's cache, whatever the shell says
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DIR", str(TEST_CACHE / "wandb"))
os.environ.setdefault("MPLBACKEND", "Agg")
# flex_attention is compiled once per machine; later processes load the kernels (a few seconds instead of ~30)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(TEST_CACHE / "torchinductor"))
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")


def _one_core_per_worker() -> None:
    """Under pytest-xdist with as many cores as workers, pin each worker (and the training processes it starts, which
    inherit the affinity and size their torch threads from it: ``training.dist.setup``) to a core of its own. Left
    alone, each worker's runs take every core, so two workers run 4 spinning torch threads on 2 cores; measured on
    the 2-core machine, the full tier took a quarter longer that way (its time: README.md)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and count.isdigit() and hasattr(os, "sched_setaffinity")):
        return
    cores = sorted(os.sched_getaffinity(0))
    if int(count) >= 2 and len(cores) >= int(count):
        os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})
        os.environ.setdefault("OMP_NUM_THREADS", "1")   # before torch is imported: the worker's own thread pool


_one_core_per_worker()

try:   # Hypothesis writes its example database and unicode tables into ./.hypothesis unless told otherwise
    from hypothesis import configuration as _hypothesis_configuration

    _hypothesis_configuration.set_hypothesis_home_dir(TEST_CACHE / "hypothesis")
except ImportError:   # the GPU image's minimal environment has no Hypothesis: its property tests skip themselves
    pass


@pytest.fixture
def cpu_lengths() -> np.ndarray:
    """A CPU-scale heavy-ish length distribution (the seed shape / 8)."""
    from dflash_lab.data.lengths import reference_lengths

    return reference_lengths("cpu", 3000, seed=7)


# Seconds of test time per module in the full tier (scripts/test.sh --durations=0 on the 2-core machine,
# 2026-12-06; test_gpu_check's with a cold compile cache, as on a fresh machine; test_slurm_multinode's from its
# tests' durations in a fresh-clone `.ci/run`, 2026-12-06). pytest-xdist hands out whole
# modules (--dist loadfile) in collection order (--no-loadscope-reorder: its default order is "most tests first",
# which put these one-test, two-minute modules last, so one worker ran them alone after the other had finished).
# Longest first is the classic two-machine schedule: the tier ends with short modules on both workers. A module
# missing here is short; its order is pytest's. tests/test_docs.py checks that each name is a test module.
SLOWEST_FIRST = {
    "test_slurm_multinode.py": 190, "test_gpu_check.py": 175, "test_slurm.py": 128, "test_notebook_compare.py": 101, "test_train_e2e.py": 98,
    "test_positive_control.py": 82, "test_run_lock.py": 73, "test_run_record_faults.py": 57, "test_packaging.py": 54,
    "test_launch.py": 52, "test_plan.py": 48, "test_bench_data_scale.py": 46, "test_model_tiny.py": 31,
    "test_own_data.py": 29, "test_compare_cli.py": 29, "test_run_record.py": 24, "test_cli_user_runs.py": 24,
    "test_ddp.py": 23, "test_launch_local.py": 20, "test_peers.py": 20, "test_footprint.py": 19, "test_compare_outputs.py": 16,
    "test_compile_limits.py": 13, "test_decoding_replay.py": 11, "test_gpu_deps.py": 11, "test_gradients.py": 11,
}


def pytest_collection_modifyitems(config, items):
    """Slowest modules first (``SLOWEST_FIRST``); a stable sort keeps every module's own test order."""
    rank = {name: position for position, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
