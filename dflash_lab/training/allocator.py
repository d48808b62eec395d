"""The CUDA caching allocator's settings for a GPU run: expandable segments, unless the user set the allocator.

Why (docs/gpu.md, "Fragmentation and expandable segments"): all six steps the first H200 run lost to out-of-memory
under its 96 GiB cap failed with 1.48-8.73 GiB reserved by PyTorch but unallocated, each asking for less than
that (0.43-2.44 GiB): free memory split across segments that cannot serve one request. The steps of this
project change shape every step (bucket lengths, packed rows, anchors per document), the case PyTorch's
documentation gives for ``expandable_segments:True`` (``docs/source/notes/cuda.rst``, "Optimizing memory usage
with PYTORCH_CUDA_ALLOC_CONF": allocations of slightly different sizes leave slivers at the ends of fixed
segments; an expandable segment grows instead, so they tile into it). The allocator's own out-of-memory message
names the same setting.

Rules: only for a run on CUDA; a user's ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` (the device-generic
name torch reads too), whatever its value, is left as it is. The variable is set before the allocator starts (it
reads its settings once, at CUDA's first use); should CUDA already be initialised in this process, the setting is
applied through ``torch.cuda.memory._set_allocator_settings`` as well (it takes effect for new segments). Child
processes (ranks, the GPU check's stages) inherit the variable.

Cost: one environment lookup.
"""

from __future__ import annotations

import os

ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
DEFAULT = "expandable_segments:True"


def configure_cuda_allocator(device_type: str, environ: dict | None = None) -> dict[str, str | None]:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for a CUDA run unless the user set the allocator.

    Args:
        device_type: ``cuda`` or ``cpu`` (the run's device; nothing is set off CUDA).
        environ: the environment to read and set (default ``os.environ``).

    Returns:
        ``{"cuda_alloc_conf": the setting in force (None off CUDA or when unset), "cuda_alloc_conf_source": why}``,
        for the run's logs and the GPU check's setup line.

    Example:
        >>> env = {}
        >>> configure_cuda_allocator("cuda", env)["cuda_alloc_conf"], env["PYTORCH_CUDA_ALLOC_CONF"]
        ('expandable_segments:True', 'expandable_segments:True')
        >>> configure_cuda_allocator("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
        {'cuda_alloc_conf': 'max_split_size_mb:512', 'cuda_alloc_conf_source': "the user's PYTORCH_CUDA_ALLOC_CONF"}
        >>> configure_cuda_allocator("cpu", {})["cuda_alloc_conf"] is None
        True
    """
    environ = os.environ if environ is None else environ
    if device_type != "cuda":
        return {"cuda_alloc_conf": None, "cuda_alloc_conf_source": "not a CUDA run"}
    for name in ENV_NAMES:
        if name in environ:
            return {"cuda_alloc_conf": environ[name], "cuda_alloc_conf_source": f"the user's {name}"}
    environ[ENV_NAMES[0]] = DEFAULT
    if environ is os.environ:
        _apply_if_initialised()
    return {"cuda_alloc_conf": DEFAULT, "cuda_alloc_conf_source": "default (dflash_lab.training.allocator)"}


def _apply_if_initialised() -> None:
    """The allocator read its settings when CUDA started: give it the setting at run time too."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(DEFAULT)
