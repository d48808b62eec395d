"""End to end: the forgetting instruments fire on the planted curriculum and stay quiet on a shuffled order.

Two short real trainings on the aligned skills corpus (each length band its own conflicting lookup table), the
ablation's settings cut to ~3 epochs: bucket_sequential (every epoch visits the buckets in order, so each band is
trained, then overwritten by the next band's table) against full_random with the same seed. The band-relative
residual amplitude must be clearly larger under the curriculum, and the loop score must exist for its periodic
order only. A metric that cannot see this cannot see anything.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from dflash_lab.analysis.local import load_local_run
from dflash_lab.analysis.summarize import analyse_run
from dflash_lab.train import train

pytestmark = pytest.mark.integration   # trains, compiles or starts processes: scripts/test.sh

ABLATION = [  # sweeps/forgetting_ablation.yaml, fewer steps and probes
    "data.band_skills=aligned", "data.num_samples=1000", "trainer.lr=3e-3", "trainer.epochs=10",
    "trainer.max_steps=240", "trainer.measure_tau=false", "trainer.ckpt_every=0", "trainer.num_threads=1",
    "trainer.progress=false", "probes.every=10", "probes.per_band=12", "seed=0",
]


def _run(tmp_path: Path, sampler: str) -> dict:
    run_dir = tmp_path / sampler
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"run_dir={run_dir}", f"sampler={sampler}", *ABLATION])
    assert train(cfg)["status"] == "finished"
    return analyse_run(load_local_run(run_dir)).row


def test_bucket_sequential_shows_the_forgetting_signature_full_random_does_not(tmp_path):
    curriculum, shuffled = _run(tmp_path, "bucket_sequential"), _run(tmp_path, "full_random")
    # bands take turns: each band's loss moves against the others' far more than under shuffling
    assert curriculum["residual_amplitude"] > 1.5 * shuffled["residual_amplitude"], (curriculum, shuffled)
    # the loop score exists for the periodic order only, and there a band's residual repeats epoch to epoch
    assert math.isnan(shuffled["loop_score"]) and curriculum["loop_score"] > 0
    # what is forgotten is relearned: more band forgetting, not a failure to learn at all
    assert curriculum["band_forgetting"] > shuffled["band_forgetting"]
