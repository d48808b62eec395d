"""dflash_lab: measure how batching policies change the speed and learning of DFlash draft-model training."""

__version__ = "0.1.0"

import importlib.util as _importlib_util  # noqa: E402

# Registers the config resolvers: ${dflash_sweep_tag:} (conf/train.yaml's hydra.sweep.subdir) and
# ${dflash_target_seed:...} (conf/model/tiny.yaml's pretrain_seed). Importing any dflash_lab module (every entry
# point, every Slurm job unpickling the task) registers them first. Without omegaconf no config can be composed,
# so there is nothing to register: the model, sampling and footprint modules then still import (a bare GPU image,
# before scripts/gpu_check.sh has installed its wheelhouse; docs/gpu.md).
if _importlib_util.find_spec("omegaconf") is not None:
    from dflash_lab import replicates as _replicates  # noqa: E402,F401
    from dflash_lab.records import run_names as _run_names  # noqa: E402,F401
