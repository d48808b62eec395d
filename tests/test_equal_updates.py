"""Update count separated from batch composition: bucketed at full_random's real tokens per step (the converse of
full_random at bucketed's), one resolution function for both directions (trainer and planner), and the declared
LR rule for bucketed's larger step (trainer.lr_scaling). Plans only: nothing trains."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_lab.data.lengths import reference_lengths
from dflash_lab.sampling import build_policy
from dflash_lab.sampling.boundaries import bucket_ids
from dflash_lab.sampling.stats import lr_scale, plan_stats, resolve_matched_real_tokens
from dflash_lab.training.settings import TrainerSettings
from dflash_lab.presets import preset

BOUNDS = [0, 96, 152, 216, 304, 412, 1024]
BUDGET = {"max_tokens": 4096, "overlong": "error"}


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return reference_lengths("cpu", 3000, seed=7)


def resolved(name: str, value, lengths, **extra) -> dict:
    return resolve_matched_real_tokens({"name": name, **BUDGET, "real_tokens_per_step": value, **extra}, lengths,
                                       builtin_corpus=False, seed=0, world_size=1)


def test_bucketed_at_full_randoms_real_tokens_makes_as_many_updates_per_epoch(lengths):
    full_random = plan_stats(build_policy("full_random", lengths, max_tokens=4096))
    cfg = resolved("bucketed", "full_random", lengths, boundaries=BOUNDS)
    assert cfg["real_tokens_per_step"] == round(full_random["real_tokens_per_step"])
    policy = build_policy("bucketed", lengths, max_tokens=4096, boundaries=BOUNDS,
                          real_tokens_per_step=cfg["real_tokens_per_step"])
    equal = plan_stats(policy)
    own = plan_stats(build_policy("bucketed", lengths, max_tokens=4096, boundaries=BOUNDS))
    assert own["real_tokens_per_step"] > 1.5 * full_random["real_tokens_per_step"]   # its larger step
    assert equal["real_tokens_per_step"] == pytest.approx(full_random["real_tokens_per_step"], rel=0.03)
    assert equal["steps_per_epoch"] == pytest.approx(full_random["steps_per_epoch"], rel=0.03)   # equal updates
    assert equal["pad_eff"] > 0.75 and equal["bucket_run_length"] < 1.5   # still length-grouped and mixed in time
    for batch in policy.batches(0):   # every batch from one bucket, as bucketed's own
        assert len(set(bucket_ids(lengths[batch], BOUNDS).tolist())) == 1


def test_one_resolution_function_for_both_directions_and_a_bad_name_is_refused(lengths):
    bucketed = plan_stats(build_policy("bucketed", lengths, max_tokens=4096, boundaries="auto", num_buckets=6))
    assert resolved("full_random", "bucketed", lengths)["real_tokens_per_step"] == round(
        bucketed["real_tokens_per_step"])
    assert resolved("bucketed", 2000, lengths)["real_tokens_per_step"] == 2000   # a number stays as given
    for name, value in (("bucketed", "bucketed"), ("packed", "full_random"), ("full_random", "packed")):
        with pytest.raises(ValueError, match=rf"sampler.real_tokens_per_step={value} for sampler={name}: give a "
                                             r"number, null, or the other policy of the pair"):
            resolved(name, value, lengths)
    with pytest.raises(ValueError, match="is resolved where the data is known"):
        build_policy("bucketed", lengths, max_tokens=4096, boundaries=BOUNDS, real_tokens_per_step="full_random")
    with pytest.raises(ValueError, match=r"below the longest admitted sample"):
        build_policy("bucketed", lengths, max_tokens=4096, boundaries=BOUNDS, real_tokens_per_step=100)


def test_the_planner_resolves_bucketed_at_full_randoms_real_tokens_as_the_trainer_does(lengths):
    from dflash_lab.plan import CostModel, plan_table

    samplers = {"bucketed": resolved("bucketed", "full_random", lengths, boundaries=BOUNDS),
                "full_random": {"name": "full_random", **BUDGET}}
    table = plan_table(lengths, samplers, seed=0, world_size=1, epochs=1, cost=CostModel(c0=0.01, c1=1e-5),
                       bands=BOUNDS)
    assert table.loc["bucketed", "real_tokens_per_step"] == pytest.approx(
        table.loc["full_random", "real_tokens_per_step"], rel=0.03)


def test_the_lr_rule_is_sqrt_of_the_real_tokens_ratio_and_declared_in_the_trainer_settings(lengths):
    cfg = {"name": "bucketed", **BUDGET, "boundaries": BOUNDS}
    sqrt, linear = (lr_scale(rule, cfg, lengths, builtin_corpus=False, seed=0, world_size=1)
                    for rule in ("sqrt", "linear"))
    ratio = sqrt["real_tokens"] / sqrt["reference_real_tokens"]
    assert sqrt["factor"] == pytest.approx(ratio ** 0.5, rel=1e-3) and linear["factor"] == pytest.approx(ratio,
                                                                                                       rel=1e-3)
    assert 1.2 < sqrt["factor"] < 1.45
    assert lr_scale(None, cfg, lengths, builtin_corpus=False, seed=0, world_size=1)["factor"] == 1.0
    equal = {**cfg, "real_tokens_per_step": sqrt["reference_real_tokens"]}   # no larger step: no scaling
    assert lr_scale("sqrt", equal, lengths, builtin_corpus=False, seed=0, world_size=1)["factor"] == pytest.approx(
        1.0, abs=0.03)
    assert preset("trainer", "cpu")["lr_scaling"] is None
    with pytest.raises(ValueError, match="trainer.lr_scaling"):
        TrainerSettings.from_dict({**preset("trainer", "cpu"), "lr_scaling": "cube"})
