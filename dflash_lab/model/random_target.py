"""A Hugging Face target with random weights at a real shape, for speed and memory checks without its weights.

A target directory (``model.target_path``) holding config.json, a tokenizer and ``random_weights.json``
(``{"seed": s}``) instead of weight files is built from its config with random weights on the training device:
``AutoModelForCausalLM.from_config`` (the library's own initialisation) under ``torch.manual_seed(s)``, in the
training dtype (bf16 on GPU), nothing read but the config and the tokenizer. A Qwen3-8B target so takes seconds,
where writing and reading its 16 GB of weights would take minutes (``scripts/make_random_qwen3.py --random-init``
writes such a directory; ``scripts/gpu_check.sh``'s train stage runs ``python -m dflash_lab.train model=hf`` on one).
The run's RNG state is left as it was. Its ``target_digest`` is ``random-`` + a digest of config.json and the seed:
compare never takes such a run for one trained against real weights. A directory holding both the marker and
weight files is refused (which one was meant is not known). Nothing trained on random weights means anything but
speed and memory; the log says so at load.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

RANDOM_WEIGHTS_FILE = "random_weights.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def random_weights_seed(target_path: str | Path | None) -> int | None:
    """The seed of a random-weight target directory (module docstring); None for any other directory.

    Raises:
        ValueError: the directory holds both the marker and weight files, or the marker has no integer seed.
    """
    if not target_path:
        return None
    path = Path(target_path).expanduser()
    marker = path / RANDOM_WEIGHTS_FILE
    if not marker.is_file():
        return None
    weights = [p.name for pattern in WEIGHT_PATTERNS for p in path.glob(pattern)]
    if weights:
        raise ValueError(f"model.target_path={str(target_path)!r} holds weights ({weights[0]}, ...) and "
                         f"{RANDOM_WEIGHTS_FILE}: remove the marker to train on the weights, or the weights to "
                         f"build random ones")
    seed = json.loads(marker.read_text()).get("seed")
    if not isinstance(seed, int):
        raise ValueError(f"{marker}: 'seed' must be an integer (got {seed!r}); write it with "
                         f"scripts/make_random_qwen3.py --random-init")
    return seed


def load_random_hf_target(target_path: str | Path, seed: int, *, dtype: str, device: str | None,
                          attn_implementation: str):
    """The target of ``target_path``'s config.json with random weights, frozen, and its tokenizer (module
    docstring); ``dtype``, ``device`` and ``attn_implementation`` as ``load_hf_target`` takes them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(target_path).expanduser()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(path)
    cuda_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices), device:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn_implementation)
    model.eval()
    model.requires_grad_(False)
    log.warning(f"target {path}: RANDOM weights (seed {seed}, {RANDOM_WEIGHTS_FILE}): a speed and memory check, "
                f"nothing it trains means more")
    return model, AutoTokenizer.from_pretrained(path)


def random_target_digest(target_path: str | Path, seed: int) -> str:
    """``random-`` + 16 hex digits of a sha256 over config.json's text and the seed."""
    config = (Path(target_path).expanduser() / "config.json").read_bytes()
    return "random-" + hashlib.sha256(config + f"|seed={seed}".encode()).hexdigest()[:16]
