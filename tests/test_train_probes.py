"""dflash_lab.training.probes: fixed probe sets per band, band evaluation rows, presentation records and their resume."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from dflash_lab.sampling import bucket_ids
from dflash_lab.training.probes import (
    DEFAULT_BANDS, PRESENTATION_COLUMNS, PresentationRecorder, ProbeSets, validate_bands,
)


def test_one_length_to_band_rule_outside_is_minus_one():
    bands = [0, 96, 152]
    assert bucket_ids(np.array([1, 96, 97, 152, 5000]), bands).tolist() == [0, 0, 1, 1, -1]


def test_bad_bands_name_the_key():
    for bad in ([0], [5, 10], [0, 10, 10]):
        with pytest.raises(ValueError, match="probes.bands"):
            validate_bands(bad)


def test_probe_sets_fixed_by_probe_seed_not_run():
    lengths = np.random.default_rng(0).integers(2, 1024, size=500)
    a = ProbeSets(lengths, DEFAULT_BANDS, per_band=3, seed=0, max_tokens=4096)
    b = ProbeSets(lengths, DEFAULT_BANDS, per_band=3, seed=0, max_tokens=4096)
    c = ProbeSets(lengths, DEFAULT_BANDS, per_band=3, seed=1, max_tokens=4096)
    assert [s.indices.tolist() for s in a.sets] == [s.indices.tolist() for s in b.sets]
    assert [s.indices.tolist() for s in a.sets] != [s.indices.tolist() for s in c.sets]
    for probe in a.sets:
        assert probe.indices.size == 3
        assert np.all(bucket_ids(lengths[probe.indices], DEFAULT_BANDS) == probe.band)


def test_empty_band_is_reported_and_small_band_takes_all():
    lengths = np.array([10, 20, 100])
    sets = ProbeSets(lengths, [0, 50, 150, 300], per_band=4, seed=0, max_tokens=4096)
    assert [s.band for s in sets.sets] == [0, 1] and sets.empty_bands == [2]
    assert sets.sets[0].indices.tolist() == [0, 1]


def test_chunks_respect_token_cap():
    lengths = np.array([100, 100, 100, 100])
    sets = ProbeSets(lengths, [0, 200], per_band=4, seed=0, max_tokens=250)
    assert [c.tolist() for c in sets.chunks(sets.sets[0])] == [[0, 1], [2, 3]]


def test_evaluate_rows_pool_chunks_and_use_a_fixed_generator():
    lengths = np.array([100, 100, 100, 10])
    sets = ProbeSets(lengths, [0, 50, 200], per_band=4, seed=0, max_tokens=250)
    draws = []

    def fake_eval(indices, generator):
        draws.append(torch.rand(1, generator=generator).item())
        n = float(len(indices))
        return SimpleNamespace(weighted_ce_sum=torch.tensor(2.0 * n), weight_sum=torch.tensor(n),
                               correct=torch.tensor(n), count=torch.tensor(4 * n))

    rows = sets.evaluate(fake_eval, step=7, seed=3)
    first_draws = list(draws)
    sets.evaluate(fake_eval, step=8, seed=3)
    assert draws[len(first_draws):] == first_draws  # the same anchors at every evaluation
    assert [(r["band"], r["band_lo"], r["band_hi"], r["tokens"]) for r in rows] == [(0, 0, 50, 4), (1, 50, 200, 12)]
    assert all(r["step"] == 7 and r["loss"] == 2.0 and r["acc"] == 0.25 for r in rows)


def test_unscored_band_gives_nan():
    sets = ProbeSets(np.array([5]), [0, 50], per_band=1, seed=0, max_tokens=4096)
    zero = SimpleNamespace(weighted_ce_sum=0.0, weight_sum=0.0, correct=0, count=0)
    row = sets.evaluate(lambda idx, g: zero, step=0, seed=0)[0]
    assert math.isnan(row["loss"]) and math.isnan(row["acc"]) and row["tokens"] == 0


def test_presentations_written_and_resumed(tmp_path):
    path = tmp_path / "presentations.parquet"
    recorder = PresentationRecorder(path, [0, 96, 1024])
    recorder.record(np.array([4, 9, 2]), np.array([50, 500, 3]), np.array([3, 1, 0]), np.array([4, 2, 0]),
                    epoch=0, step=0)
    recorder.write()
    recorder.record(np.array([1]), np.array([90]), np.array([1]), np.array([1]), epoch=0, step=5)
    recorder.write()
    table = pq.read_table(path).to_pandas()
    assert list(table.columns) == list(PRESENTATION_COLUMNS)
    assert table["sample_index"].tolist() == [4, 9, 1]  # the unscored document (count 0) is not recorded
    assert table["band"].tolist() == [0, 1, 0]
    assert table["acc"].tolist() == [0.75, 0.5, 1.0]

    again = PresentationRecorder(path, [0, 96, 1024])
    assert again.resume(3) == 1  # the record's rule: rows of steps after the checkpoint are trained again
    again.record(np.array([7]), np.array([20]), np.array([0]), np.array([2]), epoch=0, step=4)
    again.write()
    table = pq.read_table(path).to_pandas()
    assert table["step"].tolist() == [0, 0, 4] and len(again) == 3
    fresh = PresentationRecorder(path, [0, 96, 1024])
    assert fresh.resume(None) == 0 and not path.exists()  # a fresh start keeps nothing of an earlier attempt


def test_gather_merges_ranks(tmp_path):
    recorder = PresentationRecorder(tmp_path / "p.parquet", [0, 96, 1024])
    recorder.record(np.array([1]), np.array([10]), np.array([1]), np.array([1]), epoch=0, step=0)
    other_rank = {name: np.array([5]) if name != "acc" else np.array([0.5], dtype=np.float32)
                  for name in PRESENTATION_COLUMNS}
    recorder.gather(lambda mine: [mine, other_rank])
    recorder.write()
    assert sorted(pq.read_table(tmp_path / "p.parquet")["sample_index"].to_pylist()) == [1, 5]


# ---- issue 31: what the scheduled evaluation says before step 1 ------------------------------------------------
@pytest.mark.parametrize("measure_tau", [False, True])
def test_a_clamped_warmup_is_said_and_the_tau_prompt_warning_only_with_tau(tmp_path, caplog, measure_tau):
    import contextlib
    import logging

    from dflash_lab.data.datasets import build_dataset
    from dflash_lab.training.evaluation import Evaluation
    from dflash_lab.training.settings import ProbeSettings

    bands = [0, 96, 152, 216, 304, 412, 1024]
    _, heldout = build_dataset("synthetic", cache_dir=str(tmp_path), num_samples=200).split(bands=bands, per_band=2)
    probes = ProbeSettings(every=5, warmup_evals=1000, bands=bands, per_band=2, seed=0, max_tokens=4096,
                           presentations=False)
    model_cfg = {"tau_method": "replay", "decode_num_prompts": 10_000, "decode_max_prompt_tokens": 64,
                 "decode_max_new_tokens": 8}
    log = logging.getLogger("test-evaluation")
    with caplog.at_level(logging.WARNING, logger="test-evaluation"):
        evaluation = Evaluation(model=None, heldout_ds=heldout, pad_id=0, device=torch.device("cpu"),
                                autocast=contextlib.nullcontext(), probes=probes, tau_every=0, model_cfg=model_cfg,
                                log_probes=lambda rows: None, log_tau=lambda row: None, ledger=None, is_main=True,
                                log=log, warmup_steps=19, measure_tau=measure_tau)
    assert evaluation.warmup_probe_steps == frozenset(range(1, 20))
    assert ("probes.warmup_evals=1000: the LR warmup lasts 19 step(s), so it gets 19 evaluation(s), at most one per "
            "step") in caplog.text
    assert ("tau: only" in caplog.text) == measure_tau   # no tau measured (trainer.measure_tau=false): nothing to say
