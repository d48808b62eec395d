"""Tiny target: built by our own pretraining, cached by config hash, built once under concurrency; learning check."""

import json
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


# ---------------------------------------------------------------------- the shipped reference targets (issue 33)
def _reference(seed: int) -> dict:
    (entry,) = [e for e in target_module.shipped_targets() if e["name"] == f"tiny_s{seed}"]
    return entry


def _spec(section: dict):
    from dflash_lab.data.tokenizer import ByteTokenizer
    from dflash_lab.model.build import tiny_target_spec

    keys = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position_embeddings",
            "pretrain_steps", "pretrain_tokens_per_step", "pretrain_lr", "pretrain_window", "pretrain_seed",
            "pretrain_max_seconds")
    arch, pretrain = tiny_target_spec(**{key: section[key] for key in keys})
    return ByteTokenizer(), arch, pretrain, dict(section["pretrain_data"])


@pytest.mark.parametrize("seed", range(5))
def test_the_default_target_and_the_protocols_five_are_shipped_and_found_by_their_settings(seed):
    tokenizer, arch, pretrain, corpus = _spec(preset("model", "tiny", pretrain_seed=seed))
    entry = target_module.shipped_target(tokenizer, arch, pretrain, corpus)
    assert entry is not None and entry["name"] == f"tiny_s{seed}" and len(entry["target_digest"]) == 16
    assert entry["settings"]["pretrain"]["seed"] == seed
    other = _spec(preset("model", "tiny", pretrain_seed=seed, pretrain_steps=401))
    assert target_module.shipped_target(*other) is None   # another recipe: pretrained locally


def _reference_targets_script():
    """scripts/make_reference_targets.py as a module (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_reference_targets",
                                                  Path(__file__).resolve().parents[1] / "scripts"
                                                  / "make_reference_targets.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_every_tiny_target_of_the_forgetting_ablation_is_shipped_and_found_by_its_jobs_settings():
    """The six targets the forgetting ablation's 45 jobs load (aligned and independent skills corpora x target
    seeds 0-2: its data carries band skills, so each is pretrained on the run's own corpus) are shipped: each job's
    settings, composed as Hydra launches it, find a manifest entry (scripts/make_reference_targets.py --sweeps)."""
    sections = _reference_targets_script().sweep_sections("forgetting_ablation")
    assert [name for name, _ in sections] == [f"tiny_{skills}_n1000_s{seed}" for skills in ("aligned", "independent")
                                              for seed in range(3)]
    for name, section in sections:
        entry = target_module.shipped_target(*_spec(section))
        assert entry is not None and entry["name"] == name, name
        assert entry["settings"]["corpus"]["band_skills"] == section["pretrain_data"]["band_skills"]


def test_check_without_a_manifest_fails_naming_it_and_the_command_that_writes_it(tmp_path, capsys):
    """--check of a folder with no manifest.json verifies nothing: one error line names the missing file and the
    command that writes it, the exit status is 1, and the folder is not created."""
    out = tmp_path / "targets"
    assert _reference_targets_script().main(["--check", "--out", str(out)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert str(out / target_module.MANIFEST) in lines[0]
    assert f"python scripts/make_reference_targets.py --out {out}" in lines[0]
    assert not out.exists()


def test_check_of_a_manifest_listing_no_target_fails_naming_it_and_the_command_that_writes_it(tmp_path, capsys):
    """--check of a manifest.json whose 'targets' list is empty verifies nothing: one error line names the manifest
    and the command that writes its targets, and the exit status is 1 (not a silent success)."""
    out = tmp_path / "targets"
    out.mkdir()
    (out / target_module.MANIFEST).write_text(json.dumps({"about": "emptied", "targets": []}))
    assert _reference_targets_script().main(["--check", "--out", str(out)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert str(out / target_module.MANIFEST) in lines[0] and "lists none" in lines[0]
    assert f"python scripts/make_reference_targets.py --out {out}" in lines[0]


def test_a_shipped_target_loads_with_the_manifests_digest_without_pretraining(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("pretrained although a shipped target matches")

    monkeypatch.setattr(target_module, "pretrain_tiny_target", boom)
    tokenizer, arch, pretrain, corpus = _spec(preset("model", "tiny"))
    model, meta = target_module.load_or_build_tiny_target(tokenizer=tokenizer, arch=arch, pretrain=pretrain,
                                                          corpus=corpus, cache_dir=None)
    assert meta["source"] == "shipped" and meta["target_digest"] == _reference(0)["target_digest"]
    assert target_module.weights_digest(model) == meta["target_digest"]
    assert Path(meta["path"]).parent == target_module.SHIPPED_DIR


def test_a_damaged_shipped_file_is_refused_naming_the_reinstall(tmp_path):
    import shutil

    shipped = tmp_path / "targets"
    shutil.copytree(target_module.SHIPPED_DIR, shipped)
    entry = _reference(0)
    data = bytearray((shipped / entry["file"]).read_bytes())
    data[-5] ^= 0x01   # one bit of the last tensor's bytes
    (shipped / entry["file"]).write_bytes(bytes(data))
    tokenizer, arch, pretrain, corpus = _spec(preset("model", "tiny"))
    with pytest.raises(RuntimeError, match=rf"shipped tiny target .*{entry['file']} has weights digest \w+, but the "
                                           rf"manifest records {entry['target_digest']}: reinstall dflash_lab"):
        target_module.load_shipped_target(entry, tokenizer, corpus, None, directory=shipped)


def test_a_shipped_target_whose_corpus_changed_is_pretrained_here_instead(monkeypatch, caplog):
    entry = {**_reference(0), "corpus_digest": "0" * 16}   # as if the corpus generator had changed since
    calls = []
    monkeypatch.setattr(target_module, "load_or_build_tiny_target", lambda **kwargs: calls.append(kwargs) or "local")
    tokenizer, arch, pretrain, corpus = _spec(preset("model", "tiny"))
    assert target_module.load_shipped_target(entry, tokenizer, corpus, None) == "local"
    assert calls[0]["shipped"] is False and calls[0]["pretrain"] == pretrain
    assert "the corpus generator changed" in caplog.text


@pytest.mark.integration
def test_the_default_target_has_one_digest_in_fresh_caches_whatever_the_cpu_kernels(tmp_path):
    """The acceptance of issue 33: the default tiny target in two fresh caches, one process with
    ATEN_CPU_CAPABILITY=avx2, has one digest: the shipped manifest's (docs/results.md states it)."""
    import os
    import subprocess
    import sys

    script = ("from dflash_lab.model.build import build_model; from dflash_lab.presets import preset; import torch\n"
              "model, _ = build_model(**preset('model', 'tiny'), activation_checkpointing=False)\n"
              "print(model.target_digest, model.target.dflash_meta['source'], torch.backends.cpu.get_cpu_capability())")
    seen = []
    for name, capability in (("a", None), ("b", "avx2")):
        env = {**os.environ, "DFLASH_LAB_CACHE": str(tmp_path / name)}
        env.pop("ATEN_CPU_CAPABILITY", None)
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        seen.append(out.stdout.split())
    assert seen[1][2] == "AVX2"
    assert {tuple(row[:2]) for row in seen} == {(_reference(0)["target_digest"], "shipped")}
    results = (Path(__file__).resolve().parents[1] / "docs" / "results.md").read_text()
    assert _reference(0)["target_digest"] in results


# ---- issue 43: the shipped targets' manifest torn or missing is named, with what happens ------------------------
def test_a_torn_or_missing_manifest_of_the_shipped_targets_is_named_with_what_happens(tmp_path, caplog):
    import logging
    import shutil

    from dflash_lab.refusal import Refused

    shipped = tmp_path / "targets"
    shutil.copytree(target_module.SHIPPED_DIR, shipped)
    manifest = shipped / target_module.MANIFEST
    spec = _spec(preset("model", "tiny"))
    assert target_module.shipped_target(*spec, directory=shipped)["name"] == "tiny_s0"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])   # torn: was an anonymous JSONDecodeError
    with pytest.raises(Refused, match=rf"^the shipped targets' manifest {manifest} cannot be read \(JSONDecodeError: "
                                      r".*\): no tiny target can be matched to its shipped file until it is restored; "
                                      r"reinstall dflash_lab \(pip install --force-reinstall\), or restore the file"):
        target_module.shipped_target(*spec, directory=shipped)
    manifest.unlink()   # missing: was quietly [] (every target pretrained here, another digest)
    with caplog.at_level(logging.WARNING, logger=target_module.log.name):
        assert target_module.shipped_target(*spec, directory=shipped) is None
    n_files = len(list(shipped.glob("*.safetensors")))
    assert (f"the shipped targets' manifest {manifest} is missing: the {n_files} shipped tiny target files beside it "
            f"cannot be matched to a run's settings, so this tiny target is pretrained on this machine instead") \
        in caplog.text and "reinstall dflash_lab" in caplog.text
    assert target_module.shipped_targets(tmp_path) == []   # a folder without shipped files: nothing to say
