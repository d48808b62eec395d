"""Bad sampler inputs are refused before any cast, with a message that names the key (and the fix)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from dflash_lab.data.lengths import reference_lengths
from dflash_lab.sampling import POLICIES, build_policy, fit_boundaries, smallest_k_for_efficiency, validate_lengths
from dflash_lab.sampling.core import MAX_BUDGET, TokenBudget, pack_in_order

LENGTHS = reference_lengths("cpu", 400, seed=1)  # max 1024
BOUNDS = [0, 96, 152, 216, 304, 412, 1024]
BASE = {name: {"boundaries": BOUNDS} if "bucket" in name else {} for name in POLICIES}


def build(name, **kw):
    params = {"max_tokens": 4096, **BASE[name], **kw}
    return build_policy(name, LENGTHS, **params)


@pytest.mark.parametrize(
    "name, key, value, match",
    [
        ("full_random", "max_tokens", "abc", r"sampler\.max_tokens='abc': must be an integer \(e\.g\."),
        ("full_random", "max_tokens", 4096.9, r"sampler\.max_tokens=4096\.9: must be a whole number"),
        ("full_random", "max_tokens", True, r"sampler\.max_tokens=True: must be an integer, not a boolean"),
        ("full_random", "max_tokens", 0, r"sampler\.max_tokens=0: must be >= 1"),
        ("full_random", "max_tokens", float("nan"), r"sampler\.max_tokens=nan: must be a finite integer"),
        ("full_random", "max_tokens", 1e30, r"sampler\.max_tokens=\d+: must be <= 9007199254740992"),
        ("full_random", "max_tokens", MAX_BUDGET + 1, r"sampler\.max_tokens=\d+: must be <="),
        ("full_random", "max_samples", 2.5, r"sampler\.max_samples=2\.5"),
        ("full_random", "max_samples", 0, r"sampler\.max_samples=0: must be >= 1"),
        ("full_random", "max_samples", "8", r"sampler\.max_samples='8'"),
        ("full_random", "quadratic_length", 0, r"sampler\.quadratic_length=0: must be positive"),
        ("full_random", "quadratic_length", "big", r"sampler\.quadratic_length='big': must be a number"),
        ("full_random", "drop_last", "false", r"sampler\.drop_last='false': must be true or false"),
        ("full_random", "drop_last", 1, r"sampler\.drop_last=1"),
        ("full_random", "overlong", "ignore", r"sampler\.overlong='ignore': choose one of error, truncate, drop"),
        ("full_random", "real_tokens_per_step", 0, r"sampler\.real_tokens_per_step=0: must be >= 1"),
        ("full_random", "real_tokens_per_step", "3000", r"sampler\.real_tokens_per_step='3000'"),
        ("full_random", "real_tokens_per_step", 100, r"sampler\.real_tokens_per_step=100 is below the longest"),
        ("bucketed", "boundaries", [0, "a", 1024], r"sampler\.boundaries=\[0, 'a', 1024\]: 'a' is not an integer"),
        ("bucketed", "boundaries", [0, float("nan"), 1024], r"sampler\.boundaries=.*nan is not an integer"),
        ("bucketed", "boundaries", [0, 100, 1e30], r"sampler\.boundaries=.* is not an integer token length up to"),
        ("bucketed", "boundaries", 5, r"sampler\.boundaries=5: must be a list"),
        ("bucketed", "num_buckets", 2.5, r"sampler\.num_buckets=2\.5"),
        ("bucketed", "num_buckets", True, r"sampler\.num_buckets=True"),
        ("bucketed", "fit_method", "magic", r"sampler\.fit_method='magic': choose one of quantile"),
        ("bucketed", "run_length", 0, r"sampler\.run_length=0: must be >= 1"),
        ("bucketed_megabatch", "run_length", 1.5, r"sampler\.run_length=1\.5"),
        ("bucketed_megabatch", "megabatch_batches", "16", r"sampler\.megabatch_batches='16'"),
        ("bucketed_megabatch", "megabatch_batches", 0, r"sampler\.megabatch_batches=0"),
        ("packed", "chunk_rows", 0, r"sampler\.chunk_rows=0: must be >= 1"),
        ("packed", "chunk_rows", 2.5, r"sampler\.chunk_rows=2\.5"),
        ("packed", "quadratic_length", 512, r"sampler\.quadratic_length does not apply to packed rows"),
        ("bucket_sequential", "fit_method", None, r"sampler\.fit_method=None"),
    ],
)
def test_bad_sampler_value_names_the_key(name, key, value, match):
    with pytest.raises(ValueError, match=match):
        build(name, **{key: value})


def test_num_buckets_checked_when_fitting():
    for value, match in [(0, r"sampler\.num_buckets=0: must be >= 1"), ("6", r"sampler\.num_buckets='6'")]:
        with pytest.raises(ValueError, match=match):
            build("bucketed", boundaries=None, num_buckets=value)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("seed", -1, r"seed=-1: must be >= 0"),
        ("seed", "0", r"seed='0': must be an integer"),
        ("world_size", 0, r"world_size=0: must be >= 1"),
        ("world_size", 2.5, r"world_size=2\.5"),
        ("rank", -1, r"rank=-1: must be >= 0"),
        ("rank", "0", r"rank='0'"),
    ],
)
def test_bad_layout_names_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        build("sorted_static", **{key: value})
    with pytest.raises(ValueError, match=r"rank=2 is outside \[0, world_size=2\)"):
        build("sorted_static", world_size=2, rank=2)


@pytest.mark.parametrize("name, stray", [("full_random", "run_length"), ("bucketed", "megabatch_batches"),
                                         ("bucket_sequential", "run_length"), ("packed", "boundaries")])
def test_a_key_of_another_policy_is_refused_with_the_valid_ones_listed(name, stray):
    with pytest.raises(ValueError, match=rf"unknown {name} sampler key\(s\) \['{stray}'\]; valid keys: .*drop_last"):
        build(name, **{stray: 1})


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("max_tokens", [10**10, 1e10, MAX_BUDGET])
def test_a_huge_budget_needs_memory_bounded_by_the_samples(name, max_tokens):
    """A budget of 1e10 once allocated a Python list of budget / shortest sample entries (a MemoryError)."""
    tracemalloc.start()
    try:
        policy = build(name, max_tokens=max_tokens)
        batches = policy.batches(0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak / 2**20:.1f} MB for 400 samples"
    assert sorted(i for b in batches for i in b.tolist()) == list(range(LENGTHS.size))
    if name in ("full_random", "sorted_static", "packed"):
        assert len(batches) == 1  # everything fits in one batch


def test_pack_in_order_ceiling_list_is_at_most_the_sample_count():
    order = np.arange(3)
    batches, widest = pack_in_order(order, np.array([1.0, 1.0, 1.0]), TokenBudget(MAX_BUDGET))
    assert [b.tolist() for b in batches] == [[0, 1, 2]] and widest.tolist() == [1.0]


BAD_LENGTHS = [
    ([5, -2, 3], r"lengths must be positive: 1 sample\(s\) have length <= 0 \(first at index 1, length -2\)"),
    ([5, 0], r"lengths must be positive"),
    ([5.0, float("nan")], r"lengths must be whole token counts: index 1 holds nan"),
    ([5.0, float("inf")], r"index 1 holds inf"),
    ([5.0, 2.5], r"index 1 holds 2\.5"),
    ([5.0, 1e30], r"lengths must be at most 2,147,483,647 tokens: 1 sample\(s\) are longer \(first at index 1"),
    (np.array([5, 2**63 + 5], dtype=np.uint64), r"at most 2,147,483,647 tokens.*length 9223372036854775813"),
    ([5, 2**70], r"at most 2,147,483,647 tokens"),
    ([True, False], r"got dtype bool"),
    (["a", "b"], r"got dtype <U1"),
    ([5, None], r"must be numbers"),
    ([[1, 2]], r"1-D array"),
    ([], r"lengths is empty"),
]


@pytest.mark.parametrize("lengths, match", BAD_LENGTHS)
@pytest.mark.parametrize("entry", ["validate_lengths", "build_policy", "fit_boundaries", "smallest_k"])
def test_one_lengths_check_wherever_lengths_enter(entry, lengths, match):
    calls = {
        "validate_lengths": lambda: validate_lengths(lengths),
        "build_policy": lambda: build_policy("full_random", lengths, max_tokens=4096),
        "fit_boundaries": lambda: fit_boundaries(lengths, 3, "optimal"),
        "smallest_k": lambda: smallest_k_for_efficiency(lengths, 0.9, max_tokens=4096),
    }
    with pytest.raises(ValueError, match=match):
        calls[entry]()


def test_negative_lengths_no_longer_fit_to_a_silent_answer():
    with pytest.raises(ValueError, match="positive"):
        fit_boundaries(np.array([-5, -1, 3]), 2, "quantile")


def test_fit_boundaries_refuses_unknown_options():
    unknown = r"unknown fit_boundaries key\(s\) \['max_tokens'\]; valid keys: max_candidates"
    with pytest.raises(ValueError, match=unknown):
        fit_boundaries(LENGTHS, 3, "optimal", max_tokens=4096)
    with pytest.raises(ValueError, match=r"sampler\.num_buckets=0"):
        fit_boundaries(LENGTHS, 0)
    with pytest.raises(ValueError, match=r"sampler\.fit_method='best'"):
        fit_boundaries(LENGTHS, 3, "best")
    assert fit_boundaries(LENGTHS, 3, "optimal", max_candidates=50)[-1] == LENGTHS.max()


@pytest.mark.parametrize(
    "state, match",
    [
        (None, r"sampler state must be the mapping Policy\.state_dict\(\) returns .* got NoneType"),
        ([1, 2], r"got list"),
        ({}, r"sampler state lacks \['version', 'epoch', 'batches_consumed', 'fingerprint'\]"),
    ],
)
def test_load_state_dict_refuses_what_is_not_a_state(state, match):
    with pytest.raises(ValueError, match=match):
        build("bucketed").load_state_dict(state)


def test_load_state_dict_checks_position_values():
    policy = build("bucketed")
    good = policy.state_dict()
    for key, value, match in [
        ("epoch", "1", r"sampler state epoch='1'"),
        ("epoch", -1, r"sampler state epoch=-1: must be >= 0"),
        ("batches_consumed", 2.5, r"sampler state batches_consumed=2\.5"),
        ("batches_consumed", 10**6, r"batches_consumed=1000000 is past the end of epoch 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            build("bucketed").load_state_dict({**good, key: value})
