"""dflash_lab: measure how batching policies change the speed and learning of DFlash draft-model training."""

__version__ = "0.1.0"

# Registers the ${dflash_sweep_tag:} resolver that conf/train.yaml's hydra.sweep.subdir uses: importing any
# dflash_lab module (every entry point, every Slurm job unpickling the task) registers it first.
from dflash_lab import run_names as _run_names  # noqa: E402,F401
