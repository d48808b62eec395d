"""Tiny target: built by our own pretraining, cached by config hash, built once under concurrency; learning check."""

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_lab.data import Collator, build_dataset
from dflash_lab.data.cache import build_once
from dflash_lab.model import build_model
from dflash_lab.model import target as target_module
from dflash_lab.presets import preset

torch.set_num_threads(1)

SMALL = dict(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64,
             pretrain_steps=4, pretrain_tokens_per_step=256, pretrain_window=64,
             pretrain_data={"kind": "synthetic", "num_samples": 80, "seed": 0}, block_size=4)


def tiny(cache_dir, **overrides):
    """A tiny model built from conf/model/tiny.yaml with ``overrides`` (the preset gives every other key)."""
    return build_model(**preset("model", "tiny", cache_dir=str(cache_dir), **overrides),
                       activation_checkpointing=False)


@pytest.mark.integration
def test_tiny_target_is_pretrained_once_then_loaded_from_cache(tmp_path, monkeypatch):
    model, tok = tiny(tmp_path, **SMALL)
    meta = model.target.dflash_meta
    assert meta["pretrain_stats"]["steps"] == 4 and np.isfinite(meta["pretrain_stats"]["loss"])
    assert model.target.config.hidden_size == 32 and tok.vocab_size == model.target.config.vocab_size

    def boom(*args, **kwargs):
        raise AssertionError("pretrained again although the cache exists")

    monkeypatch.setattr(target_module, "pretrain_tiny_target", boom)
    again, _ = tiny(tmp_path, **SMALL)
    assert again.target.dflash_meta["path"] == meta["path"]
    for a, b in zip(model.target.parameters(), again.target.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(AssertionError, match="pretrained again"):
        tiny(tmp_path, **{**SMALL, "pretrain_steps": 5})   # new key: new target


def test_build_once_runs_the_builder_once_under_concurrency(tmp_path):
    calls = []

    def slow_build(directory):
        calls.append(1)
        time.sleep(0.3)
        (directory / "done").write_text("ok")

    threads = [threading.Thread(target=build_once, args=(tmp_path / "entry", slow_build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (tmp_path / "entry" / "done").read_text() == "ok"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry", "entry.lock"]   # no temporary leftovers


def test_failed_build_leaves_no_cache(tmp_path):
    def broken(directory):
        (directory / "half").write_text("x")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        build_once(tmp_path / "entry", broken)
    assert not (tmp_path / "entry").exists() and [p.name for p in tmp_path.iterdir()] == ["entry.lock"]


@pytest.mark.integration
def test_bad_model_config_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="model.kind"):
        build_model("big", activation_checkpointing=False)
    with pytest.raises(ValueError, match="model.target_path"):
        build_model(**preset("model", "hf"), activation_checkpointing=False)
    with pytest.raises(ValueError, match=r"unknown model key\(s\) \['blok_size'\] for model.kind=tiny; valid keys: "
                                         r".*block_size"):
        build_model(**preset("model", "tiny"), blok_size=8, activation_checkpointing=False)
    with pytest.raises(ValueError, match=r"unknown model key\(s\) \['target_path'\] for model.kind=tiny"):
        build_model(**preset("model", "tiny"), target_path="/models/x", activation_checkpointing=False)
    without_block_size = {k: v for k, v in preset("model", "tiny").items() if k != "block_size"}
    with pytest.raises(ValueError, match=r"model.kind=tiny lacks model.block_size: the presets"):
        build_model(**without_block_size, activation_checkpointing=False)
    with pytest.raises(ValueError, match="model.block_size"):
        tiny(tmp_path, **{**SMALL, "block_size": 1})
    with pytest.raises(ValueError, match="model.fixed_anchors"):
        tiny(tmp_path, **{**SMALL, "fixed_anchors": -1})


@pytest.mark.integration
def test_a_few_hundred_draft_steps_lower_the_loss_and_beat_the_baseline_tau(tmp_path):
    from dflash_lab.model import heldout_prompts, measure_acceptance

    config = {**SMALL, "pretrain_steps": 150, "pretrain_tokens_per_step": 1024, "pretrain_window": 128,
              "pretrain_data": {"kind": "synthetic", "num_samples": 400, "seed": 0}, "anchor_density": 0.125}
    model, tok = tiny(tmp_path, **config)
    train, heldout = build_dataset("synthetic", tokenizer=tok, num_samples=400, cache_dir=str(tmp_path)).split()
    collate = Collator(tok.pad_token_id, packed=True)
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    short = np.flatnonzero(train.lengths <= 200)
    losses = []
    for _ in range(300):
        batch = collate([train[int(i)] for i in rng.choice(short, 6, replace=False)])
        out = model(batch, generator)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss.detach()))
    assert np.mean(losses[-30:]) < 0.85 * np.mean(losses[:10])
    prompts = heldout_prompts(heldout, 6)
    trained = measure_acceptance(model, prompts, 32)["tau"]
    baseline = measure_acceptance(model.baseline_model(), prompts, 32)["tau"]
    assert trained > baseline


def test_stale_temporary_dirs_of_a_killed_builder_are_removed(tmp_path):
    (tmp_path / "entry.tmp-dead").mkdir()
    (tmp_path / "entry.tmp-dead" / "half").write_text("x")
    build_once(tmp_path / "entry", lambda directory: (directory / "done").write_text("ok"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry", "entry.lock"]


@pytest.mark.integration
def test_two_fresh_caches_pretrain_the_same_weights_whatever_the_thread_count(tmp_path):
    """The reviewer's case on one machine: the same config in two empty caches gives the same target, even when the
    callers run different thread counts; the digest is recorded in the cache and on the model, and pretraining
    leaves the caller's threads and RNG as they were (a run goes on the same whether it built the cache or not)."""
    config = {**SMALL, "pretrain_steps": 5}
    torch.manual_seed(123)
    first, _ = tiny(tmp_path / "a", **config)   # pretrains
    draw_after_pretraining = torch.rand(3)
    torch.manual_seed(123)
    tiny(tmp_path / "a", **config)   # loads
    assert torch.equal(torch.rand(3), draw_after_pretraining)
    torch.set_num_threads(2)
    try:
        second, _ = tiny(tmp_path / "b", **config)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert first.target.dflash_meta["path"] != second.target.dflash_meta["path"]
    assert len(first.target_digest) == 16 and first.target_digest == second.target_digest
    assert first.target.dflash_meta["target_digest"] == first.target_digest
    assert target_module.weights_digest(first.target) == first.target_digest
    other_seed, _ = tiny(tmp_path / "a", **{**config, "pretrain_seed": 1})
    assert other_seed.target_digest != first.target_digest


@pytest.mark.integration
def test_a_tampered_cached_target_is_refused_naming_the_directory_to_delete(tmp_path):
    from safetensors.torch import load_file, save_file

    model, _ = tiny(tmp_path, **SMALL)
    directory = Path(model.target.dflash_meta["path"])
    weights = load_file(directory / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1e-3
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=rf"cached tiny target {directory} has weights digest \w+, but its "
                                           rf"meta.json records {model.target_digest}.*rm -rf"):
        tiny(tmp_path, **SMALL)
    (directory / "model.safetensors").unlink()
    with pytest.raises(RuntimeError, match="lacks model.safetensors.*run again to pretrain"):
        tiny(tmp_path, **SMALL)


def test_checkpoint_digest_reads_names_sizes_ends_and_config(tmp_path):
    """The hf target's digest: a change of config.json, of a weight file's end, or a file added changes it; a bad
    directory is refused naming model.target_path."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "model-00001.safetensors").write_bytes(bytes(range(256)) * 20000)   # ~5 MiB: start, middle, end
    digest = target_module.checkpoint_digest(tmp_path)
    assert len(digest) == 16 and target_module.checkpoint_digest(tmp_path) == digest
    data = bytearray((tmp_path / "model-00001.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / "model-00001.safetensors").write_bytes(bytes(data))
    changed_end = target_module.checkpoint_digest(tmp_path)
    assert changed_end != digest
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 8}')
    assert target_module.checkpoint_digest(tmp_path) not in (digest, changed_end)
    with pytest.raises(ValueError, match="model.target_path=.*no config.json or no"):
        target_module.checkpoint_digest(tmp_path / "missing")
