"""dflash_lab/model/random_target.py through model=hf's builder: a target directory written by
scripts/make_random_qwen3.py --random-init (config, tokenizer, random_weights.json, no weights) builds a seeded
random target, names it ``random-...``, and a directory holding weights too is refused."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dflash_lab.model.build import DRAFT_KEYS, build_hf_model
from dflash_lab.model.random_target import load_random_hf_target, random_target_digest
from dflash_lab.presets import preset

ROOT = Path(__file__).resolve().parent.parent
SIZE = {"hidden": 32, "layers": 4, "heads": 2, "kv_heads": 1, "head_dim": 16, "intermediate": 64}


@pytest.fixture(scope="module")
def make_random_qwen3():
    spec = importlib.util.spec_from_file_location("make_random_qwen3", ROOT / "scripts" / "make_random_qwen3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_random_qwen3


def build(target_path: Path):
    cfg = preset("model", "hf", draft_layers=1, fixed_anchors=0, compile_layers=False)
    keys = ("dtype", "device", "attn_implementation", "mask_token_id", "target_config", *DRAFT_KEYS)
    return build_hf_model(target_path=str(target_path), **{k: cfg[k] for k in keys}, activation_checkpointing=False)


def test_a_random_init_directory_builds_a_seeded_random_target(make_random_qwen3, tmp_path):
    first = make_random_qwen3(tmp_path / "a", **SIZE, random_init=True)
    assert json.loads((first / "random_weights.json").read_text()) == {"seed": 0}
    assert not list(first.glob("*.safetensors")) and not list(first.glob("*.bin"))
    model, tokenizer = build(first)
    again, _ = load_random_hf_target(make_random_qwen3(tmp_path / "b", **SIZE, random_init=True), 0, dtype="auto",
                                     device="cpu", attn_implementation="sdpa")
    other, _ = load_random_hf_target(first, 1, dtype="auto", device="cpu", attn_implementation="sdpa")
    weights = list(model.target.parameters())
    assert all(torch.equal(a, b) for a, b in zip(weights, again.parameters()))
    assert not torch.equal(weights[1], list(other.parameters())[1])
    assert model.target_digest == random_target_digest(tmp_path / "b", 0) != random_target_digest(first, 1)
    assert model.target_digest.startswith("random-") and not any(p.requires_grad for p in weights)
    assert model.target.config.num_hidden_layers == 4 and tokenizer.mask_token_id < weights[0].shape[0]


def test_the_qwen3_8b_shape_is_the_presets(make_random_qwen3, tmp_path):
    directory = make_random_qwen3(tmp_path / "q", shape="qwen3_8b", random_init=True)
    config = json.loads((directory / "config.json").read_text())
    shape = preset("model", "qwen3_8b")["target_config"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "max_position_embeddings"):
        assert config[key] == shape[key], key


def test_a_directory_with_weights_and_the_marker_is_refused(make_random_qwen3, tmp_path):
    directory = make_random_qwen3(tmp_path / "w", **SIZE)   # with weights
    (directory / "random_weights.json").write_text('{"seed": 0}')
    with pytest.raises(ValueError, match="holds weights .* and random_weights.json"):
        build(directory)
