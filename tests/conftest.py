import os

import numpy as np
import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture
def cpu_lengths() -> np.ndarray:
    """A CPU-scale heavy-ish length distribution (the seed shape / 8)."""
    from dflash_lab.data.lengths import reference_lengths

    return reference_lengths("cpu", 3000, seed=7)
