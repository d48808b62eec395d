"""sampler.bucket_by=random: the negative control of the forgetting ablation on natural data.

Random groups must keep the length buckets' sizes and visiting order while their members are independent of length,
fixed for the run, and batched, sharded and resumed by the same code paths as length buckets.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from dflash_lab.records.checkpoint import check_resume_config
from dflash_lab.data.lengths import reference_lengths
from dflash_lab.sampling import bucket_ids, build_policy, policy_from_config
from dflash_lab.sampling.stats import plan_stats

BOUNDS = [0, 96, 152, 216, 304, 412, 1024]
KEYED = ["bucketed", "bucketed_megabatch", "bucket_sequential"]


@pytest.fixture(scope="module")
def lengths():
    return reference_lengths("cpu", 6000, seed=11)


def make(name, lengths, bucket_by="random", seed=3, **kw):
    return build_policy(name, lengths, max_tokens=2048, seed=seed, boundaries=BOUNDS, bucket_by=bucket_by, **kw)


def groups_of(policy):
    return [set(m.tolist()) for m in policy.members]


@pytest.mark.parametrize("name", KEYED)
def test_groups_have_the_length_buckets_sizes_and_cover_every_sample_once(name, lengths):
    by_length, by_random = make(name, lengths, "length"), make(name, lengths, "random")
    sizes = np.bincount(bucket_ids(lengths, BOUNDS), minlength=len(BOUNDS) - 1)
    assert [m.size for m in by_length.members] == sizes.tolist()
    assert [m.size for m in by_random.members] == sizes.tolist()
    members = np.concatenate(by_random.members)
    assert sorted(members.tolist()) == list(range(lengths.size))
    assert groups_of(by_random) != groups_of(by_length)


def test_membership_is_independent_of_length(lengths):
    by_length, by_random = make("bucketed", lengths, "length"), make("bucketed", lengths, "random")
    mean, sd = lengths.mean(), lengths.std()
    for group in by_random.members:
        # a random draw without replacement: the group mean is within 4 standard errors of the overall mean
        standard_error = sd / np.sqrt(group.size) * np.sqrt(1 - group.size / lengths.size)
        assert abs(lengths[group].mean() - mean) < 4 * standard_error
    length_means = [lengths[m].mean() for m in by_length.members]
    assert np.all(np.diff(length_means) > 0) and length_means[-1] > 5 * length_means[0]
    # rank correlation of sample length and its group id: ~0 for random groups, ~1 for length buckets
    def rank_corr(policy):
        ranks = np.argsort(np.argsort(lengths))
        return np.corrcoef(ranks, policy.sample_bucket)[0, 1]
    assert abs(rank_corr(by_random)) < 4 / np.sqrt(lengths.size)
    assert rank_corr(by_length) > 0.9


@pytest.mark.parametrize("name", KEYED)
def test_groups_are_fixed_for_the_run_and_batches_stay_inside_them(name, lengths):
    policy = make(name, lengths)
    sample_group = policy.sample_bucket
    compositions = []
    for epoch in (0, 1, 2):
        batches = policy.batches(epoch)
        for batch in batches:
            assert np.unique(sample_group[batch]).size == 1, "a batch mixes random groups"
            assert policy.bucket_of(batch) == sample_group[batch[0]]
        per_group = Counter()
        for batch in batches:
            per_group.update({int(sample_group[batch[0]]): batch.size})
        assert [per_group[g] for g in range(len(BOUNDS) - 1)] == [m.size for m in policy.members]
        compositions.append({tuple(sorted(b.tolist())) for b in batches})
    assert len(compositions[0] & compositions[1]) < 0.05 * len(compositions[1])  # reshuffled inside the groups
    # bucket_of under random keying is the group, not the length bucket of the longest sample
    longest_bucket = [bucket_ids(lengths[b].max(keepdims=True), BOUNDS)[0] for b in policy.batches(0)]
    assert [policy.bucket_of(b) for b in policy.batches(0)] != longest_bucket


def test_same_seed_same_plan_other_seed_other_groups(lengths):
    a, b = make("bucket_sequential", lengths), make("bucket_sequential", lengths)
    assert groups_of(a) == groups_of(b)
    assert [x.tolist() for x in a.batches(1)] == [x.tolist() for x in b.batches(1)]
    other = make("bucket_sequential", lengths, seed=4)
    assert groups_of(other) != groups_of(a)
    assert [len(g) for g in groups_of(other)] == [len(g) for g in groups_of(a)]
    # the policy seed decides the groups for every bucketed policy alike: one assignment per (lengths, seed)
    assert groups_of(make("bucketed", lengths)) == groups_of(a)


def test_bucket_sequential_visits_groups_in_the_length_order(lengths):
    by_length, by_random = make("bucket_sequential", lengths, "length"), make("bucket_sequential", lengths)
    for policy in (by_length, by_random):
        for epoch in (0, 1):
            visited = [policy.bucket_of(b) for b in policy.batches(epoch)]
            assert visited == sorted(visited), "groups are visited one after another, ascending"
            assert sorted(set(visited)) == list(range(len(BOUNDS) - 1))
    # Where the token budget does not decide (a row cap binds first), each group takes exactly as many batches as
    # the length bucket it replaces.
    capped = {"max_tokens": 10**6, "max_samples": 8}
    by_length = build_policy("bucket_sequential", lengths, boundaries=BOUNDS, bucket_by="length", seed=3, **capped)
    by_random = build_policy("bucket_sequential", lengths, boundaries=BOUNDS, bucket_by="random", seed=3, **capped)
    assert ([by_length.bucket_of(b) for b in by_length.batches(0)]
            == [by_random.bucket_of(b) for b in by_random.batches(0)])


def test_resume_mid_epoch_and_world_size_two(lengths):
    ranks = [make("bucket_sequential", lengths, world_size=2, rank=r) for r in range(2)]
    assert len(ranks[0].batches(1)) == len(ranks[1].batches(1))
    seen = Counter(i for p in ranks for b in p.batches(1) for i in b.tolist())
    assert set(seen) == set(range(lengths.size))
    assert sum(seen.values()) - lengths.size == ranks[0].diagnostics(1)["repeated_remainder"]
    for rank, policy in enumerate(ranks):
        policy.set_epoch(1)
        it = iter(policy)
        for _ in range(7):
            next(it)
        state = json.loads(json.dumps(policy.state_dict()))
        assert state["config"]["bucket_by"] == "random"
        rest = list(it)
        fresh = make("bucket_sequential", lengths, world_size=2, rank=rank)
        fresh.load_state_dict(state)
        fresh.set_epoch(state["epoch"])
        assert list(fresh) == rest


def test_a_changed_bucket_by_is_refused_on_resume(lengths):
    state = make("bucketed", lengths).state_dict()
    with pytest.raises(ValueError, match="bucket_by"):
        make("bucketed", lengths, "length").load_state_dict(state)
    with pytest.raises(ValueError, match="bucket_by"):
        make("bucketed", lengths).load_state_dict(make("bucketed", lengths, "length").state_dict())
    # the run config check refuses it before any state is read (sampler keys never change on resume)
    with pytest.raises(ValueError, match="sampler.bucket_by"):
        check_resume_config({"sampler": {"bucket_by": "length"}}, {"sampler": {"bucket_by": "random"}})


def test_length_keying_keeps_the_config_of_states_written_before_bucket_by(lengths):
    default = build_policy("bucketed", lengths, max_tokens=2048, seed=3, boundaries=BOUNDS)
    explicit = make("bucketed", lengths, "length")
    assert "bucket_by" not in default.state_dict()["config"]
    assert explicit.fingerprint == default.fingerprint
    assert explicit.bucket_by == default.bucket_by == "length"


@pytest.mark.parametrize("value", ["lenght", "Random", None, 1])
def test_a_bad_bucket_by_is_refused_naming_the_key(lengths, value):
    with pytest.raises(ValueError, match=r"sampler\.bucket_by=.*choose length .* or random"):
        make("bucketed", lengths, value)


@pytest.mark.parametrize("name", ["sorted_static", "full_random", "packed"])
@pytest.mark.parametrize("value", ["random", "length"])
def test_bucket_by_on_a_policy_without_buckets_is_refused(lengths, name, value):
    with pytest.raises(ValueError, match=rf"sampler\.bucket_by does not apply to {name}.*remove sampler\.bucket_by"):
        build_policy(name, lengths, max_tokens=2048, bucket_by=value)


def test_config_override_builds_the_control_and_unbucketed_configs_refuse_it():
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["sampler=bucket_sequential", "sampler.bucket_by=random"])
        with pytest.raises(Exception, match="bucket_by"):
            compose(config_name="train", overrides=["sampler=full_random", "sampler.bucket_by=random"])
    sampler_cfg = OmegaConf.to_container(cfg.sampler, resolve=True)
    policy = policy_from_config(sampler_cfg, reference_lengths("cpu", 2000), seed=0)
    assert policy.bucket_by == "random" and policy.name == "bucket_sequential"


def test_plan_stats_show_random_groups_are_length_mixed(lengths):
    stats = {by: plan_stats(make("bucket_sequential", lengths, by)) for by in ("length", "random")}
    mixed = plan_stats(build_policy("full_random", lengths, max_tokens=2048, seed=3))
    assert stats["random"]["bucket_by"] == "random" and mixed["bucket_by"] is None
    assert stats["random"]["within_batch_spread"] > 0.8 * mixed["within_batch_spread"]
    assert stats["length"]["within_batch_spread"] < 0.5 * stats["random"]["within_batch_spread"]
    assert stats["length"]["adjacent_length_corr"] > 0.5 and abs(stats["random"]["adjacent_length_corr"]) < 0.2
    # the visiting structure is the control's: one run per group, as one run per length bucket
    groups = len(BOUNDS) - 1
    for by in ("length", "random"):
        assert stats[by]["bucket_run_length"] == pytest.approx(stats[by]["steps_per_epoch"] / groups)
