"""Helpers shared by test modules (import them from here, never from another test module): a small training config
composed in-process, the command line of the trainer as a subprocess, and a root-proof read-only check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_module

from dflash_lab import checkpoint as ckpt
from dflash_lab.train import TrainHooks

ROOT = Path(__file__).resolve().parents[1]

# A small run: a 2-layer target pretrained for a few steps (cached), 300 synthetic samples, a 1024-token budget.
SMALL = [
    "++model.hidden_size=64", "++model.num_layers=2", "++model.num_heads=4", "++model.num_kv_heads=2",
    "++model.intermediate_size=128", "++model.pretrain_steps=20", "++model.pretrain_tokens_per_step=2048",
    "++model.block_size=4", "++data.num_samples=300", "sampler.max_tokens=1024",
    "trainer.num_threads=1", "trainer.progress=false", "model.decode_num_prompts=2", "model.decode_max_new_tokens=8",
    "trainer.epochs=2", "probes.every=5", "probes.per_band=2",
]
# The command-line settings of a short CPU run.
SHORT_CLI = ["logger=none", "trainer.measure_tau=false", "trainer.progress=false", "trainer.max_steps=30",
             "probes.every=10", "trainer.ckpt_every=10", "trainer.num_threads=1"]


def compose_small(run_dir: Path, *overrides: str):
    """The SMALL training config for ``run_dir`` with ``overrides``."""
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        return compose(config_name="train", overrides=[f"run_dir={run_dir}", *SMALL, *overrides])


def stop_at(step: int) -> TrainHooks:
    """Hooks that request a checkpoint-and-exit during update ``step`` (what SIGUSR2 does on a cluster)."""
    def after_forward(at_step, micro, out):
        if at_step == step:
            ckpt.request_checkpoint("test")
        return out
    return TrainHooks(after_forward=after_forward)


def train_cli(*args: str, prefix: tuple[str, ...] = (), timeout: int = 300,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m dflash_lab.train ARGS`` from the repository root (``prefix``: a command to run it under)."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    environment.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([*prefix, sys.executable, "-m", "dflash_lab.train", *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def without_permission_override() -> tuple[str, ...] | None:
    """A command prefix under which file permissions hold (root drops the capabilities that bypass them), () for
    a user they hold for already, None when root cannot drop them here (``setpriv`` missing)."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        return None
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner")
