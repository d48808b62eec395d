"""Property-based tests (hypothesis) over random length arrays, for every policy."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dflash_lab.sampling import POLICIES, build_policy, policy_keys

lengths_strategy = arrays(np.int64, st.integers(1, 400), elements=st.integers(1, 512))


def params_for(name, lengths):
    if "boundaries" in policy_keys(name):
        return {"boundaries": None, "num_buckets": 3, "fit_method": "optimal"}
    return {}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=lengths_strategy,
    name=st.sampled_from(sorted(POLICIES)),
    world_size=st.integers(1, 5),
    max_tokens=st.integers(512, 4096),
    max_samples=st.one_of(st.none(), st.integers(1, 16)),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
)
def test_plan_invariants(lengths, name, world_size, max_tokens, max_samples, seed, epoch):
    kw = dict(max_tokens=max_tokens, seed=seed, world_size=world_size, max_samples=max_samples)
    kw.update(params_for(name, lengths))
    ranks = [build_policy(name, lengths, rank=r, **kw) for r in range(world_size)]
    per_rank = [p.batches(epoch) for p in ranks]
    assert len({len(b) for b in per_rank}) == 1
    seen = np.concatenate([b for bs in per_rank for b in bs])
    assert set(seen.tolist()) == set(range(lengths.size))  # every sample at least once
    assert seen.size - lengths.size == ranks[0].diagnostics(epoch)["repeated_remainder"]
    for bs in per_rank:
        for b in bs:
            if max_samples is not None:
                assert b.size <= max_samples
            if ranks[0].packed:
                assert lengths[b].sum() <= max_tokens
            else:
                assert b.size * lengths[b].max() <= max_tokens
    again = build_policy(name, lengths, rank=world_size - 1, **kw).batches(epoch)
    assert [b.tolist() for b in again] == [b.tolist() for b in per_rank[-1]]


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_strategy, name=st.sampled_from(sorted(POLICIES)), cut=st.integers(0, 50))
def test_resume_anywhere(lengths, name, cut):
    kw = dict(max_tokens=1024, seed=1, world_size=2, rank=0, **params_for(name, lengths))
    p = build_policy(name, lengths, **kw)
    p.set_epoch(2)
    full = list(p)
    cut = min(cut, len(full))
    q = build_policy(name, lengths, **kw)
    q.set_epoch(2)
    it = iter(q)
    for _ in range(cut):
        next(it)
    r = build_policy(name, lengths, **kw)
    r.load_state_dict(q.state_dict())
    r.set_epoch(r.epoch)
    if cut < len(full):
        assert list(r) == full[cut:]
    else:  # the state after an epoch's last batch names batch 0 of the next epoch
        assert r.epoch == 3 and list(r) == [b.tolist() for b in p.batches(3)]


@settings(max_examples=40, deadline=None)
@given(
    step_bucket=arrays(np.int64, st.integers(0, 200), elements=st.integers(0, 5)),
    run_length=st.integers(1, 9),
    sequential=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_bucket_run_order_is_a_permutation_in_runs(step_bucket, run_length, sequential, seed):
    from dflash_lab.sampling.core import bucket_run_order

    order = bucket_run_order(step_bucket, np.random.default_rng(seed), run_length=run_length, sequential=sequential)
    assert sorted(order.tolist()) == list(range(step_bucket.size))
    consumed = step_bucket[order]
    if sequential:
        assert np.all(np.diff(consumed) >= 0)
    elif run_length > 1 and consumed.size:
        changes = np.flatnonzero(consumed[1:] != consumed[:-1]) + 1
        blocks = np.diff(np.r_[0, changes, consumed.size])
        # Every maximal same-bucket block is whole runs: a multiple of R, plus the bucket's one shorter run.
        shorts = [int((step_bucket == b).sum()) % run_length for b in consumed[np.r_[0, changes]]]
        assert all(size % run_length in (0, short) for size, short in zip(blocks, shorts))


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_strategy, extra=st.integers(0, 2000), world_size=st.integers(1, 4), seed=st.integers(0, 99))
def test_equal_real_tokens_invariants(lengths, extra, world_size, seed):
    target = int(lengths.max()) + extra
    ranks = [build_policy("full_random", lengths, max_tokens=4096, seed=seed, world_size=world_size, rank=r,
                          real_tokens_per_step=target) for r in range(world_size)]
    batches = [b for p in ranks for b in p.batches(0)]
    assert set(np.concatenate(batches).tolist()) == set(range(lengths.size))
    assert all(lengths[b].sum() <= target + lengths.max() // 2 for b in batches)
