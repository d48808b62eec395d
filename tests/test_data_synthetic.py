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


# ---- band skills (data.band_skills) ---------------------------------------------------------------------------------

SKILL_BANDS = list(synthetic.DEFAULT_SKILL_BANDS)
# sha256 over the first 50 samples' ids (int64 little-endian) and loss masks (uint8) of the default corpus
# (num_samples=3000, seed=0), recorded before band skills existed: band_skills=none must stay byte-identical.
DEFAULT_CORPUS_HASH50 = "5c654717c1c3854363eb78d8b00ac3aa6dfc0550e9c637ab400c607f8b9815ab"


def _hash50(ds) -> str:
    import hashlib

    digest = hashlib.sha256()
    for i in range(50):
        digest.update(ds[i]["input_ids"].numpy().astype("<i8").tobytes())
        digest.update(ds[i]["loss_mask"].numpy().astype("u1").tobytes())
    return digest.hexdigest()


def _cue_and_pairs(ds, i):
    """(skill index named by the prompt's cue, [(noun, value)] of the reply's complete items)."""
    import re

    text = ByteTokenizer().decode(ds[i]["input_ids"].tolist())
    cue = re.match(r"\W*in (\w+):", text).group(1)
    return synthetic.SKILL_CUES.index(cue), re.findall(r"(\w+) is (\w+)\.", text)


def test_band_skills_none_is_the_default_corpus_byte_for_byte(tmp_path):
    ds = build_dataset("synthetic", num_samples=3000, seed=0, cache_dir=tmp_path, band_skills="none",
                       skill_bands=SKILL_BANDS)
    assert _hash50(ds) == DEFAULT_CORPUS_HASH50
    assert ds.meta["config"] == {"num_samples": 3000, "seed": 0, "min_length": 32}  # the cache key of today


def test_band_skills_are_deterministic_and_never_share_a_cache_entry(tmp_path):
    dirs = {}
    for mode in synthetic.BAND_SKILLS:
        a = build_dataset("synthetic", num_samples=300, seed=2, cache_dir=tmp_path / "a", band_skills=mode)
        b = build_dataset("synthetic", num_samples=300, seed=2, cache_dir=tmp_path / "b", band_skills=mode)
        dirs[mode] = a.meta["directory"].split("/")[-1]
        for i in (0, 150, 299):
            assert torch.equal(a[i]["input_ids"], b[i]["input_ids"])
        # a pure function of (seed, index): a larger corpus starts with the same samples
        bigger = build_dataset("synthetic", num_samples=400, seed=2, cache_dir=tmp_path / "a", band_skills=mode)
        assert torch.equal(bigger[123]["input_ids"], a[123]["input_ids"])
    assert len(set(dirs.values())) == 3


def test_tables_conflict_on_every_noun():
    tables = synthetic.skill_tables(seed=0, num_skills=len(SKILL_BANDS) - 1)
    for noun in synthetic.SKILL_NOUNS:
        values = [t[noun] for t in tables]
        assert len({v[0] for v in values}) == len(values)   # different first letters, hence different words
        assert all(5 <= len(v) <= 8 for v in values)
    assert synthetic.skill_tables(0, 6) == tables and synthetic.skill_tables(1, 6) != tables


def test_aligned_skill_is_the_length_band_and_replies_follow_its_table(tmp_path):
    from dflash_lab.sampling.boundaries import bucket_ids

    ds = build_dataset("synthetic", num_samples=600, seed=0, cache_dir=tmp_path, band_skills="aligned")
    tables = synthetic.skill_tables(0, len(SKILL_BANDS) - 1)
    bands = bucket_ids(ds.lengths, SKILL_BANDS)
    assert set(bands.tolist()) == set(range(len(SKILL_BANDS) - 1))
    for i in range(len(ds)):
        skill, pairs = _cue_and_pairs(ds, i)
        assert skill == bands[i]
        assert pairs and all(tables[skill][noun] == value for noun, value in pairs)


def test_independent_skills_are_uniform_in_every_band_with_the_same_lengths(tmp_path):
    from dflash_lab.sampling.boundaries import bucket_ids

    aligned = build_dataset("synthetic", num_samples=3000, seed=0, cache_dir=tmp_path, band_skills="aligned")
    independent = build_dataset("synthetic", num_samples=3000, seed=0, cache_dir=tmp_path, band_skills="independent")
    np.testing.assert_array_equal(aligned.lengths, independent.lengths)
    k = len(SKILL_BANDS) - 1
    skills = synthetic.sample_skills(independent.lengths, 0, "independent", SKILL_BANDS)
    for i in (0, 1, 2, 500, 2999):  # the rendered cue is the drawn skill
        assert _cue_and_pairs(independent, i)[0] == skills[i]
    bands = bucket_ids(independent.lengths, SKILL_BANDS)
    for band in range(k):
        counts = np.bincount(skills[bands == band], minlength=k)
        expected = counts.sum() / k
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (band, counts)   # chi-square, 5 degrees of freedom: p = 0.001


def test_probe_split_gives_every_band_its_probes(tmp_path):
    from dflash_lab.sampling.boundaries import bucket_ids

    ds = build_dataset("synthetic", num_samples=3000, seed=0, cache_dir=tmp_path, band_skills="aligned")
    plain = bucket_ids(ds.lengths[ds.heldout_indices()], SKILL_BANDS)
    assert np.bincount(plain, minlength=6).min() < 24   # the stratified share alone leaves (304, 412] short
    train, heldout = ds.split(bands=SKILL_BANDS, per_band=24)
    assert np.bincount(bucket_ids(heldout.lengths, SKILL_BANDS), minlength=6).min() >= 24
    assert set(ds.heldout_indices()) <= set(heldout.source_indices)   # top-up only adds
    assert not set(train.source_indices) & set(heldout.source_indices)
    assert len(train) + len(heldout) == len(ds)
    np.testing.assert_array_equal(heldout.source_indices, ds.split(bands=SKILL_BANDS, per_band=24)[1].source_indices)


def test_probe_top_ups_are_capped_so_a_small_file_is_not_drained_into_probes(tmp_path):
    """A small corpus with many bands and many probes per band: the top-ups stop at probe_fraction of the data
    (held out at most 2 x probe_fraction), handed out one per band in turn so every band gets some."""
    from dflash_lab.sampling.boundaries import bucket_ids

    ds = build_dataset("synthetic", num_samples=300, seed=0, cache_dir=tmp_path)
    bands = [0, 96, 152, 216, 304, 412, 1024]
    heldout = ds.heldout_indices(bands=bands, per_band=24)
    assert len(heldout) <= 2 * 0.05 * len(ds) and len(heldout) > len(ds.heldout_indices())
    per_band = np.bincount(bucket_ids(ds.lengths[heldout], bands), minlength=6)
    plain = np.bincount(bucket_ids(ds.lengths[ds.heldout_indices()], bands), minlength=6)
    assert (per_band - plain).min() >= 1 and (per_band - plain).max() - (per_band - plain).min() <= 1


@pytest.mark.parametrize("overrides, key", [
    ({"band_skills": "mixed"}, "data.band_skills"),
    ({"band_skills": "aligned", "skill_bands": [0, 152, 96, 1024]}, "data.skill_bands"),
    ({"band_skills": "aligned", "skill_bands": [10, 96, 1024]}, "data.skill_bands"),
    ({"band_skills": "aligned", "skill_bands": [0, 96, 512]}, "data.skill_bands"),
    ({"band_skills": "aligned", "skill_bands": list(range(0, 1100, 50))}, "data.skill_bands"),
    ({"band_skills": "none", "skill_bands": [0, 96, 96, 1024]}, "data.skill_bands"),
])
def test_bad_band_skills_name_the_key(tmp_path, overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_dataset("synthetic", num_samples=200, cache_dir=tmp_path, **overrides)


def test_band_skills_none_checks_only_the_form_of_skill_bands(tmp_path):
    ds = build_dataset("synthetic", num_samples=100, cache_dir=tmp_path, band_skills="none", skill_bands=[0, 96, 512])
    assert ds.meta["config"] == {"num_samples": 100, "seed": 0, "min_length": 32}


def test_band_skills_belong_to_synthetic_data(tmp_path):
    with pytest.raises(ValueError, match="data.band_skills"):
        build_dataset("code", num_samples=5, cache_dir=tmp_path, band_skills="aligned")
