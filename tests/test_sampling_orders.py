"""Step orders: bucketed run_length, the bucket_sequential positive control, and equal real tokens per step."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from dflash_lab.data.lengths import reference_lengths
from dflash_lab.sampling import build_policy, bucket_ids
from dflash_lab.sampling.core import bucket_run_order
from dflash_lab.sampling.stats import plan_stats

BOUNDS = [0, 96, 152, 216, 304, 412, 1024]


@pytest.fixture(scope="module")
def lengths():
    return reference_lengths("cpu", 20000, seed=3)


def plan_hash(policy, epoch):
    return hashlib.sha256(json.dumps([b.tolist() for b in policy.global_plan(epoch).batches]).encode()).hexdigest()


@pytest.mark.parametrize(
    "name, params, digest",
    [
        # Plans of the version before run_length existed (same lengths, seed 5, W=3, epoch 2).
        ("bucketed", {"boundaries": BOUNDS}, "8ea272f532050595"),
        ("bucketed_megabatch", {"boundaries": BOUNDS}, "2c22b6312ef7ab26"),
        ("bucketed", {"boundaries": None, "num_buckets": 4, "fit_method": "quantile"}, "057c7889a40c0890"),
        ("full_random", {}, "1251e1b87179b872"),
        ("sorted_static", {}, "7fe6b7c33254850b"),
    ],
)
def test_defaults_and_run_length_1_reproduce_earlier_plans(lengths, name, params, digest):
    policy = build_policy(name, lengths, max_tokens=4096, seed=5, world_size=3, **params)
    assert plan_hash(policy, 2)[:16] == digest
    if "bucket" in name:
        explicit = build_policy(name, lengths, max_tokens=4096, seed=5, world_size=3, run_length=1, **params)
        assert plan_hash(explicit, 2)[:16] == digest
    else:
        explicit = build_policy(name, lengths, max_tokens=4096, seed=5, world_size=3, **params,
                                **({"real_tokens_per_step": None} if name == "full_random" else {}))
        assert plan_hash(explicit, 2)[:16] == digest


@pytest.mark.parametrize("run_length", [2, 3, 7])
def test_bucket_run_order_makes_runs_of_exactly_r(run_length):
    rng = np.random.default_rng(0)
    step_bucket = np.repeat([0, 1, 2, 3], [20, 17, 9, 1])
    order = bucket_run_order(step_bucket, rng, run_length=run_length)
    assert sorted(order.tolist()) == list(range(step_bucket.size))
    consumed = step_bucket[order]
    for bucket, count in enumerate([20, 17, 9, 1]):
        positions = np.flatnonzero(consumed == bucket)
        # Maximal blocks of consecutive positions are whole runs (adjacent runs of one bucket may merge): R steps
        # each, except the bucket's one shorter run of count % R.
        blocks = np.split(positions, np.flatnonzero(np.diff(positions) > 1) + 1)
        remainders = [len(block) % run_length for block in blocks]
        short = count % run_length
        assert sum(r != 0 for r in remainders) == (short != 0), (bucket, [len(b) for b in blocks])
        assert set(remainders) <= {0, short}


def test_bucket_run_order_shuffles_inside_buckets_and_runs():
    step_bucket = np.repeat([0, 1], [40, 40])
    orders = [bucket_run_order(step_bucket, np.random.default_rng(s), run_length=4) for s in range(2)]
    assert orders[0].tolist() != orders[1].tolist()
    first_bucket = step_bucket[orders[0]]
    assert np.count_nonzero(first_bucket[1:] != first_bucket[:-1]) > 3  # runs interleave, not one block per bucket
    within = orders[0][first_bucket == 0]
    assert within.tolist() != sorted(within.tolist())  # steps shuffled inside the bucket


@pytest.mark.parametrize("world_size", [1, 4])
def test_run_length_doses_the_bucket_run_length(lengths, world_size):
    """bucket_run_length reads about R x its R=1 value (the R=1 value is 1/(1-q), q = chance two steps share a
    bucket, since adjacent runs of one bucket merge); adjacent-length correlation rises with R."""
    stats = {
        r: plan_stats(build_policy("bucketed", lengths, max_tokens=4096, boundaries=BOUNDS, run_length=r,
                                   world_size=world_size))
        for r in (1, 4, 8)
    }
    base = stats[1]["bucket_run_length"]
    assert 1.0 < base < 1.6
    for r in (4, 8):
        assert 0.8 * r * base <= stats[r]["bucket_run_length"] <= 1.2 * r * base
    corr = [stats[r]["adjacent_length_corr"] for r in (1, 4, 8)]
    assert corr[0] < 0.15 < 0.6 < corr[1] < corr[2]
    assert stats[8]["pad_eff"] == pytest.approx(stats[1]["pad_eff"], abs=1e-3)  # same batches, new order


def test_run_length_applies_to_bucketed_megabatch(lengths):
    one = plan_stats(build_policy("bucketed_megabatch", lengths, max_tokens=4096, boundaries=BOUNDS))
    eight = plan_stats(build_policy("bucketed_megabatch", lengths, max_tokens=4096, boundaries=BOUNDS, run_length=8))
    assert eight["bucket_run_length"] > 5 * one["bucket_run_length"]


def batch_buckets(policy, epoch):
    longest = np.array([policy.lengths[b].max() for b in policy.global_plan(epoch).batches])
    return bucket_ids(longest, policy.boundaries)


def test_bucket_sequential_visits_buckets_shortest_first(lengths):
    policy = build_policy("bucket_sequential", lengths, max_tokens=4096, boundaries=BOUNDS)
    for epoch in (0, 1):
        buckets = batch_buckets(policy, epoch)
        assert np.all(np.diff(buckets) >= 0) and buckets[0] == 0 and buckets[-1] == len(BOUNDS) - 2
    stats = plan_stats(policy)
    assert stats["bucket_run_length"] == pytest.approx(stats["steps_per_epoch"] / (len(BOUNDS) - 1))
    assert stats["adjacent_length_corr"] > 0.85
    # Members are reshuffled inside each bucket every epoch, and batches are not visited in width order.
    e0, e1 = policy.batches(0), policy.batches(1)
    assert {tuple(sorted(b.tolist())) for b in e0}.isdisjoint({tuple(sorted(b.tolist())) for b in e1[:50]})
    first_bucket = [b for b, k in zip(e0, batch_buckets(policy, 0)) if k == 0]
    widest = [policy.lengths[b].max() for b in first_bucket]
    assert abs(np.corrcoef(np.arange(len(widest)), widest)[0, 1]) < 0.3


@pytest.mark.parametrize("world_size", [2, 8])
def test_bucket_sequential_steps_stay_inside_one_bucket_where_possible(lengths, world_size):
    policy = build_policy("bucket_sequential", lengths, max_tokens=4096, boundaries=BOUNDS, world_size=world_size)
    buckets = batch_buckets(policy, 0).reshape(-1, world_size)
    mixed = int(np.count_nonzero(buckets.min(axis=1) != buckets.max(axis=1)))
    assert mixed <= len(BOUNDS) - 2  # at most one step per bucket boundary
    step_bucket = buckets[:, 0]
    assert np.all(np.diff(step_bucket) >= 0)
    assert all(len(b) == policy.steps_in_epoch(0) for b in
               (build_policy("bucket_sequential", lengths, max_tokens=4096, boundaries=BOUNDS,
                             world_size=world_size, rank=r).batches(0) for r in range(world_size)))


def test_equal_real_tokens_per_step_matches_a_length_grouped_policy(lengths):
    bucketed = plan_stats(build_policy("bucketed", lengths, max_tokens=4096, boundaries=BOUNDS))
    target = int(round(bucketed["real_tokens_per_step"]))
    default = plan_stats(build_policy("full_random", lengths, max_tokens=4096))
    policy = build_policy("full_random", lengths, max_tokens=4096, real_tokens_per_step=target)
    equal = plan_stats(policy)
    assert default["real_tokens_per_step"] < 0.7 * target  # the padded budget starves full_random of real tokens
    assert equal["real_tokens_per_step"] == pytest.approx(target, rel=0.02)
    real = np.array([lengths[b].sum() for b in policy.batches(0)])
    padded = np.array([b.size * lengths[b].max() for b in policy.batches(0)])
    assert real.max() <= target + lengths.max() // 2
    assert padded.mean() > 4096  # padded tokens grow past max_tokens: the memory cost of equal real tokens
    assert equal["pad_eff"] < default["pad_eff"]
    assert equal["composition_repeat"] < 0.05


def test_equal_real_tokens_keeps_max_samples_and_refuses_quadratic(lengths):
    policy = build_policy("full_random", lengths, max_tokens=4096, real_tokens_per_step=3000, max_samples=4)
    assert max(b.size for b in policy.batches(0)) <= 4
    with pytest.raises(ValueError, match=r"sampler\.quadratic_length applies to the padded budget"):
        build_policy("full_random", lengths, max_tokens=4096, real_tokens_per_step=3000, quadratic_length=512)
