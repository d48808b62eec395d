"""Boundary validation and fitting, and the bad-input contract of build_policy."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_lab.sampling import bucket_ids, build_policy, fit_boundaries, smallest_k_for_efficiency, validate_boundaries
from dflash_lab.sampling.stats import plan_stats


def lognormal(n=20000, seed=0):
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(np.exp(rng.normal(np.log(216), 0.8, n))), 2, 1024).astype(np.int64)


@pytest.mark.parametrize(
    "boundaries, match",
    [
        ([0, 300, 200, 1024], "unsorted"),
        ([0, 200, 200, 1024], "duplicate"),
        ([10, 200, 1024], "first boundary must be 0"),
        ([0, 200, 500], "below the longest sample"),
        ([0], "at least two"),
        ([0, 1.5, 1024], "not an integer"),
        ("nonsense", "unknown preset"),
    ],
)
def test_bad_boundaries_are_named(boundaries, match):
    with pytest.raises(ValueError, match=match):
        build_policy("bucketed", lognormal(), max_tokens=4096, boundaries=boundaries)


@pytest.mark.parametrize(
    "lengths, kwargs, match",
    [
        ([], {}, "empty"),
        ([5, 0, 3], {}, "positive"),
        ([5, -2, 3], {}, "positive"),
        ([5, 3000, 3], {}, "overlong"),
        ([5, 6], {"name": "bogus"}, "sampler.name='bogus'"),
        ([5, 6], {"name": "bucketed", "num_buckets": 2, "fit_method": "magic"}, "fit_method"),
        ([5, 6], {"name": "bucketed", "boundaries": None}, "boundaries"),   # left out, it is auto (the preset)
        ([5, 6], {"colour": "red"}, r"unknown full_random sampler key\(s\) \['colour'\]; valid keys: drop_last"),
        ([5, 6], {"overlong": "ignore"}, "overlong"),
        ([5, 6], {"max_tokens": 0}, "max_tokens"),
        ([5, 6], {"world_size": 2, "rank": 2}, "rank"),
    ],
)
def test_bad_input_gets_a_clear_error(lengths, kwargs, match):
    kwargs = {"name": "full_random", "max_tokens": 2048, **kwargs}
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        build_policy(name, np.asarray(lengths, dtype=np.int64), **kwargs)


def test_seed_boundaries_on_seed_workload_and_presets():
    from dflash_lab.data.lengths import reference_lengths

    lengths = reference_lengths("seed", 50000)
    p = build_policy("bucketed", lengths, max_tokens=32768, boundaries="seed")
    assert p.boundaries == [0, 770, 1216, 1728, 2432, 3296, 8192]
    assert 0.75 < plan_stats(p)["pad_eff"] < 0.86


@pytest.mark.parametrize("method", ["quantile", "equal_tokens", "optimal"])
@pytest.mark.parametrize("k", [1, 2, 6, 16])
def test_fit_shape(method, k):
    lengths = lognormal()
    b = fit_boundaries(lengths, k, method)
    assert validate_boundaries(b, int(lengths.max())) == b
    assert 2 <= len(b) <= k + 1 and b[-1] == lengths.max()


def test_quantile_buckets_hold_equal_counts():
    lengths = lognormal(60000)
    b = fit_boundaries(lengths, 6, "quantile")
    counts = np.bincount(bucket_ids(lengths, b))
    assert counts.min() > 0.8 * lengths.size / 6 and counts.max() < 1.2 * lengths.size / 6


def test_equal_tokens_buckets_hold_equal_tokens():
    lengths = lognormal(60000)
    b = fit_boundaries(lengths, 4, "equal_tokens")
    bucket = bucket_ids(lengths, b)
    tokens = np.bincount(bucket, weights=lengths)
    assert tokens.min() > 0.8 * lengths.sum() / 4


def test_optimal_dp_matches_brute_force():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 40, size=300)
    values = np.unique(lengths)

    def cost(uppers):
        edges = [0, *uppers]
        return sum(((lengths > lo) & (lengths <= hi)).sum() * hi for lo, hi in zip(edges[:-1], edges[1:]))

    import itertools

    best = min(cost([*c, values[-1]]) for c in itertools.combinations(values[:-1], 2))
    assert cost(fit_boundaries(lengths, 3, "optimal")[1:]) == best


@pytest.mark.parametrize("workload", ["seed", "heavy_tailed", "bimodal"])
def test_optimal_beats_quantile_at_same_k(workload):
    from dflash_lab.data.lengths import reference_lengths

    lengths = reference_lengths(workload, 40000, seed=2)
    effs = {}
    for method in ("quantile", "optimal"):
        p = build_policy("bucketed", lengths, max_tokens=32768, boundaries=fit_boundaries(lengths, 6, method))
        effs[method] = plan_stats(p)["pad_eff"]
    assert effs["optimal"] > effs["quantile"]


def test_smallest_k_reaches_target_and_is_minimal():
    lengths = lognormal(20000)
    found = smallest_k_for_efficiency(lengths, 0.9, max_tokens=4096)
    assert found["pad_eff"] >= 0.9
    assert all(eff < 0.9 for k, eff in found["curve"][:-1])
    with pytest.raises(ValueError, match="no bucket count"):
        smallest_k_for_efficiency(lengths, 0.9999, max_tokens=4096, max_k=2)


def test_fitted_boundaries_through_config_keys():
    lengths = lognormal()
    p = build_policy("bucketed", lengths, max_tokens=4096, boundaries=None, num_buckets=4, fit_method="quantile")
    assert len(p.boundaries) == 5
    with pytest.raises(ValueError, match="conflicts"):
        build_policy("bucketed", lengths, max_tokens=4096, boundaries=[0, 100, 1024], num_buckets=4)


def test_quadratic_cost_shrinks_long_batches():
    lengths = lognormal()
    plain = build_policy("sorted_static", lengths, max_tokens=4096)
    quad = build_policy("sorted_static", lengths, max_tokens=4096, quadratic_length=512)
    for b in quad.batches(0):
        longest = lengths[b].max()
        assert b.size * (longest + longest**2 / 512) <= 4096
    assert len(quad.batches(0)) > len(plain.batches(0))


def reference_greedy(costs, limit, cap):
    """The obvious one-pass greedy packer, as an oracle for the vectorised one."""
    sizes, rows, widest = [], 0, 0.0
    for cost in costs:
        wider = max(widest, cost)
        if (rows + 1) * wider > limit or rows == cap:
            sizes.append(rows)
            rows, widest = 1, cost
        else:
            rows, widest = rows + 1, wider
    return sizes + [rows]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [None, 1, 3, 50])
def test_vectorised_greedy_equals_one_pass_greedy(seed, cap):
    from dflash_lab.sampling.core import TokenBudget, pack_in_order

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 600, size=rng.integers(1, 3000))
    budget = TokenBudget(1024, cap, 300.0 if seed % 2 else None)
    costs = budget.row_cost(lengths)
    order = rng.permutation(lengths.size)
    costs[order[costs[order] > 1024]] = 1024  # keep every single row admissible
    batches, widest = pack_in_order(order, costs, budget)
    assert [b.size for b in batches] == reference_greedy(costs[order].tolist(), 1024.0, cap or lengths.size + 1)
    assert np.concatenate(batches).tolist() == order.tolist()
    assert np.allclose(widest, [costs[b].max() for b in batches])


# ---- issue 43: empty buckets are said, with the list that says what the run does ---------------------------------
def test_empty_buckets_are_named_with_the_boundaries_that_drop_them():
    from dflash_lab.sampling import build_policy
    from dflash_lab.sampling.boundaries import empty_bucket_warning

    lengths = np.array([10, 20, 50, 60, 300, 310])
    assert empty_bucket_warning([0, 20, 60, 310], lengths) is None
    text = empty_bucket_warning([0, 20, 40, 60, 310, 500, 900], lengths)   # a gap (20, 40] and two past the end
    assert text == ("sampler.boundaries=[0, 20, 40, 60, 310, 500, 900]: buckets 1 (20, 40], 4 (310, 500], 5 (500, 900] "
                    "hold no sample (the longest is 310 tokens), so they make no batch: this run has 3 buckets, not 6. "
                    "Drop the empty buckets' upper boundaries to say so: sampler.boundaries=[0,20,60,310]")
    suggested = [0, 20, 60, 310]
    assert empty_bucket_warning(suggested, lengths) is None   # the fix it names leaves no empty bucket
    for bucket_by in ("length", "random"):   # each bucket makes batches exactly when it holds a sample
        policy = build_policy("bucketed", lengths, max_tokens=1024, boundaries=[0, 20, 40, 60, 310, 500, 900],
                              bucket_by=bucket_by)
        assert sorted({policy.bucket_of(batch) for batch in policy.batches(0)}) == [0, 2, 3]
