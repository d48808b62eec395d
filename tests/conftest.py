import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# One compile cache for every test process and the training subprocesses they start (inherited environment):
# flex_attention is compiled once per machine, later processes load the kernels (a few seconds instead of ~30).
_CACHE = Path(os.environ.get("DFLASH_LAB_CACHE", Path.home() / ".cache" / "dflash_lab")).expanduser()
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "torchinductor"))
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")


@pytest.fixture
def cpu_lengths() -> np.ndarray:
    """A CPU-scale heavy-ish length distribution (the seed shape / 8)."""
    from dflash_lab.data.lengths import reference_lengths

    return reference_lengths("cpu", 3000, seed=7)
