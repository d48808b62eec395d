"""Conformance suite: every policy must satisfy the same contract (lhotse-style, parametrized over policies, and
over the bucketed ones again with ``bucket_by=random``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from dflash_lab.sampling import POLICIES, build_policy, policy_keys

MAX_TOKENS = 2048
PARAMS = {
    "sorted_static": {},
    "full_random": {},
    "bucketed": {"boundaries": [0, 96, 152, 216, 304, 412, 1024]},
    "bucketed_megabatch": {"boundaries": [0, 96, 152, 216, 304, 412, 1024], "megabatch_batches": 4},
    "packed": {"chunk_rows": 8},
    "bucket_sequential": {"boundaries": [0, 96, 152, 216, 304, 412, 1024]},
}
# Every bucketed policy again with bucket_by=random (the negative control): variant "<policy>+random".
PARAMS.update({f"{name}+random": {**params, "bucket_by": "random"}
               for name, params in list(PARAMS.items()) if "bucket_by" in policy_keys(name)})
# Policies whose batch composition must change between epochs (sorted_static only reshuffles batch order).
COMPOSITION_CHANGES = {"full_random", "bucketed", "bucketed_megabatch", "packed", "bucket_sequential",
                       "bucketed+random", "bucketed_megabatch+random", "bucket_sequential+random"}


def policy_of(variant):
    """The policy a variant builds (``bucketed+random`` -> ``bucketed``)."""
    return variant.split("+")[0]


def make(name, lengths, **kw):
    return build_policy(policy_of(name), lengths, max_tokens=MAX_TOKENS, seed=3, **{**PARAMS[name], **kw})


def test_every_policy_is_covered():
    assert {policy_of(v) for v in PARAMS} == set(POLICIES)
    keyed = {name for name in POLICIES if "bucket_by" in policy_keys(name)}
    assert keyed == {"bucketed", "bucketed_megabatch", "bucket_sequential"}
    assert {v for v in PARAMS if v.endswith("+random")} == {f"{name}+random" for name in keyed}


@pytest.fixture(params=sorted(PARAMS))
def name(request):
    return request.param


def cost_ok(name, batch, lengths):
    if name == "packed":
        return lengths[batch].sum() <= MAX_TOKENS
    return len(batch) * lengths[batch].max() <= MAX_TOKENS


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_coverage_budget_and_equal_steps(name, world_size, cpu_lengths):
    per_rank = [make(name, cpu_lengths, world_size=world_size, rank=r) for r in range(world_size)]
    for epoch in (0, 1):
        counts = [len(p.batches(epoch)) for p in per_rank]
        assert len(set(counts)) == 1, f"ranks got different batch counts {counts}"
        seen = Counter()
        for p in per_rank:
            for batch in p.batches(epoch):
                assert batch.dtype == np.int64 and batch.size > 0
                assert cost_ok(name, batch, cpu_lengths)
                seen.update(batch.tolist())
        # Every sample once; the remainder rule (drop_last=False) repeats at most world_size - 1 batches.
        assert set(seen) == set(range(cpu_lengths.size))
        diag = per_rank[0].diagnostics(epoch)
        assert sum(seen.values()) - cpu_lengths.size == diag["repeated_remainder"]
        if world_size == 1:
            assert diag["repeated_remainder"] == 0


def test_drop_last_drops_and_counts(name, cpu_lengths):
    w = 8
    ranks = [make(name, cpu_lengths, world_size=w, rank=r, drop_last=True) for r in range(w)]
    seen = Counter(i for p in ranks for b in p.batches(0) for i in b.tolist())
    assert max(seen.values()) == 1
    assert cpu_lengths.size - len(seen) == ranks[0].diagnostics(0)["dropped_remainder"]


def test_step_batches_are_length_neighbours(name, cpu_lengths):
    """The W batches of one step have similar longest rows, so no rank waits on a much longer batch."""
    w = 4
    plan = make(name, cpu_lengths, world_size=w).global_plan(0)
    key = (lambda b: (cpu_lengths[b] ** 2).sum()) if name == "packed" else (lambda b: cpu_lengths[b].max())
    step_spread = [np.ptp([key(b) for b in plan.batches[s * w : (s + 1) * w]]) for s in range(plan.steps)]
    random_spread = [np.ptp([key(b) for b in plan.batches[s : s + w * 37 : 37]]) for s in range(plan.steps // 2)]
    assert np.median(step_spread) < 0.5 * np.median(random_spread)


@pytest.mark.integration
def test_same_plan_in_a_fresh_process(name, cpu_lengths, tmp_path):
    np.save(tmp_path / "l.npy", cpu_lengths)
    code = (
        "import json, sys, numpy as np\n"
        "from dflash_lab.sampling import build_policy\n"
        f"p = build_policy({policy_of(name)!r}, np.load(sys.argv[1]), max_tokens={MAX_TOKENS}, seed=3, world_size=2, "
        f"rank=1, "
        f"**{PARAMS[name]!r})\n"
        "print(json.dumps([b.tolist() for b in p.batches(2)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "l.npy")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    here = [b.tolist() for b in make(name, cpu_lengths, world_size=2, rank=1).batches(2)]
    assert json.loads(out.stdout) == here


def test_epochs_differ_as_the_policy_says(name, cpu_lengths):
    p = make(name, cpu_lengths)
    e0, e1 = p.batches(0), p.batches(1)
    assert [b.tolist() for b in e0] != [b.tolist() for b in e1], "batch order must change between epochs"
    as_sets = lambda bs: {tuple(sorted(b.tolist())) for b in bs}  # noqa: E731
    if name in COMPOSITION_CHANGES:
        assert len(as_sets(e0) & as_sets(e1)) < 0.05 * len(e1)
    else:
        assert as_sets(e0) == as_sets(e1)


def test_seed_changes_plan(name, cpu_lengths):
    a = [b.tolist() for b in make(name, cpu_lengths).batches(0)]
    b = [b.tolist() for b in build_policy(policy_of(name), cpu_lengths, max_tokens=MAX_TOKENS, seed=4,
                                          **PARAMS[name]).batches(0)]
    assert a != b


@pytest.mark.parametrize("world_size", [1, 3])
def test_state_round_trip_mid_epoch(name, world_size, cpu_lengths):
    for rank in range(world_size):
        p = make(name, cpu_lengths, world_size=world_size, rank=rank)
        p.set_epoch(1)
        it = iter(p)
        for _ in range(5):
            next(it)
        state = json.loads(json.dumps(p.state_dict()))  # must survive serialisation
        rest = list(it)
        fresh = make(name, cpu_lengths, world_size=world_size, rank=rank)
        fresh.load_state_dict(state)
        fresh.set_epoch(state["epoch"])  # a trainer calls set_epoch again: it must keep the position
        assert list(fresh) == rest
        assert list(fresh) == [b.tolist() for b in p.batches(1)], "the next pass starts the epoch from batch 0"


def test_state_at_epoch_end_points_to_next_epoch(name, cpu_lengths):
    p = make(name, cpu_lengths)
    p.set_epoch(0)
    list(p)
    state = p.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (1, 0)


def test_explicit_consumed_count_overrides_prefetch(name, cpu_lengths):
    p = make(name, cpu_lengths)
    it = iter(p)
    for _ in range(10):
        next(it)  # a DataLoader may have prefetched ahead of training
    state = p.state_dict(batches_consumed=4)
    q = make(name, cpu_lengths)
    q.load_state_dict(state)
    assert next(iter(q)) == p.batches(0)[4].tolist()


def test_mismatched_state_is_refused(name, cpu_lengths):
    state = make(name, cpu_lengths, world_size=2).state_dict()
    with pytest.raises(ValueError, match="world_size"):
        make(name, cpu_lengths, world_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="max_tokens"):
        build_policy(
            policy_of(name), cpu_lengths, max_tokens=MAX_TOKENS * 2, seed=3, world_size=2, **PARAMS[name]
        ).load_state_dict(state)
    other = cpu_lengths.copy()
    other[0] += 1
    with pytest.raises(ValueError, match="lengths"):
        make(name, other, world_size=2).load_state_dict(state)


def test_len_matches_iteration(name, cpu_lengths):
    p = make(name, cpu_lengths, world_size=2, rank=1)
    p.set_epoch(3)
    assert len(p) == len(list(p)) == p.steps_in_epoch(3)


def test_max_samples_cap(name, cpu_lengths):
    p = make(name, cpu_lengths, max_samples=5)
    assert max(b.size for b in p.batches(0)) <= 5


def test_overlong_modes(name):
    lengths = np.array([10, 20, 3000, 40, 50, 5000, 60])
    with pytest.raises(ValueError, match="overlong"):
        make(name, lengths)
    extra = {"boundaries": [0, 100, MAX_TOKENS]} if "boundaries" in policy_keys(policy_of(name)) else {}
    t = build_policy(policy_of(name), lengths, max_tokens=MAX_TOKENS, overlong="truncate",
                     **{**PARAMS[name], **extra})
    assert t.diagnostics(0)["truncated"] == 2 and t.lengths.max() == MAX_TOKENS
    assert sorted(i for b in t.batches(0) for i in b.tolist()) == list(range(7))
    extra = {"boundaries": [0, 100]} if "boundaries" in policy_keys(policy_of(name)) else {}
    d = build_policy(policy_of(name), lengths, max_tokens=MAX_TOKENS, overlong="drop", **{**PARAMS[name], **extra})
    assert d.diagnostics(0)["dropped_overlong"] == 2
    assert sorted(i for b in d.batches(0) for i in b.tolist()) == [0, 1, 3, 4, 6]
