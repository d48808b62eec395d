"""Synthetic corpus, tokenizer, dataset cache and held-out split."""

import numpy as np
import pytest
import torch

from dflash_lab.data import ByteTokenizer, build_dataset
from dflash_lab.data import synthetic
from dflash_lab.data.lengths import reference_lengths

torch.set_num_threads(1)


def test_byte_tokenizer_round_trip_and_chat_mask():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo, wörld\n")) == "héllo, wörld\n"
    assert min(tok.encode("\x00abc")) >= 8 and tok.vocab_size == 264
    ids, mask = tok.encode_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    supervised = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(supervised) == "yo" and supervised[-1] == tok.eos_token_id
    assert tok.decode([i for i, m in zip(ids, mask) if not m]) == "hi"


def test_synthetic_is_deterministic_and_follows_reference_lengths(tmp_path):
    a = build_dataset("synthetic", num_samples=400, seed=3, cache_dir=tmp_path / "a")
    b = build_dataset("synthetic", num_samples=400, seed=3, cache_dir=tmp_path / "b")
    assert a.lengths.dtype == np.int64
    np.testing.assert_array_equal(a.lengths, np.maximum(reference_lengths("cpu", 400, seed=3), 32))
    for i in (0, 17, 399):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"])
        assert torch.equal(a[i]["loss_mask"], b[i]["loss_mask"])
        assert len(a[i]["input_ids"]) == a.lengths[i]
        assert a[i]["loss_mask"][-2:].all() and not a[i]["loss_mask"][0]
    c = build_dataset("synthetic", num_samples=400, seed=4, cache_dir=tmp_path / "a")
    assert not np.array_equal(a.lengths, c.lengths)


def test_content_changes_with_length(tmp_path):
    ds = build_dataset("synthetic", num_samples=600, seed=0, cache_dir=tmp_path)
    tok = ByteTokenizer()
    styles = {}
    for i in range(len(ds)):
        styles.setdefault(synthetic.style_of(int(ds.lengths[i])), tok.decode(ds[i]["input_ids"]))
    assert set(styles) == {"reply", "explain", "reason"}
    assert "tell me about" in styles["reply"] and "step 1:" in styles["explain"] and " plus " in styles["reason"]


def test_lengths_come_from_cache_without_touching_samples(tmp_path, monkeypatch):
    first = build_dataset("synthetic", num_samples=200, cache_dir=tmp_path)

    def boom(*args, **kwargs):
        raise AssertionError("samples were regenerated although the cache exists")

    monkeypatch.setattr(synthetic, "iter_synthetic", boom)
    again = build_dataset("synthetic", num_samples=200, cache_dir=tmp_path)
    np.testing.assert_array_equal(first.lengths, again.lengths)
    with pytest.raises(AssertionError):
        build_dataset("synthetic", num_samples=201, cache_dir=tmp_path)  # another config: another cache


def test_split_is_disjoint_stratified_and_deterministic(tmp_path):
    ds = build_dataset("synthetic", num_samples=1000, cache_dir=tmp_path, probe_fraction=0.1)
    train, heldout = ds.split()
    assert len(train) + len(heldout) == len(ds) and len(heldout) == 100
    assert not set(train.source_indices) & set(heldout.source_indices)
    np.testing.assert_array_equal(heldout.source_indices, ds.split()[1].source_indices)
    # Stratified: every length decile of the corpus has held-out samples.
    deciles = np.quantile(ds.lengths, np.linspace(0, 1, 11))
    counts = np.histogram(heldout.lengths, bins=deciles)[0]
    assert counts.min() >= 5
    sample = heldout[3]
    assert sample["index"] == 3
    assert torch.equal(sample["input_ids"], ds[int(heldout.source_indices[3])]["input_ids"])
    np.testing.assert_array_equal(train.lengths, ds.lengths[train.source_indices])


def test_bad_config_values_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="data.kind"):
        build_dataset("nope", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="data.num_samples"):
        build_dataset("synthetic", num_samples=0, cache_dir=tmp_path)
    ds = build_dataset("synthetic", num_samples=50, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="data.probe_fraction"):
        ds.split(probe_fraction=1.5)


def test_source_hash_ignores_comments_and_docstrings_but_not_code(tmp_path, monkeypatch):
    import importlib.util

    from dflash_lab.data.cache import source_hash

    def module_from(text, name):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    base = module_from('"""Doc."""\ndef f(x):\n    """Doc."""\n    return x + 1\n', "m1")
    cosmetic = module_from('"""Other doc."""\n\n\ndef f(x):  # why\n    return x + 1\n', "m2")
    changed = module_from('def f(x):\n    return x + 2\n', "m3")
    assert source_hash(base) == source_hash(cosmetic) != source_hash(changed)


def test_pickled_dataset_reopens_the_memory_map(tmp_path):
    import pickle

    ds = build_dataset("synthetic", num_samples=120, cache_dir=tmp_path)
    train, _ = ds.split()
    blob = pickle.dumps(train)
    assert len(blob) < 20_000     # the token arrays are not inside the pickle
    clone = pickle.loads(blob)
    assert torch.equal(clone[5]["input_ids"], train[5]["input_ids"])
    np.testing.assert_array_equal(clone.lengths, train.lengths)
