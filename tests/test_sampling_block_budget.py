"""Block tokens as a second step budget (``sampler.max_block_tokens``), for every policy, and the anchor rule they
come from: the sampler's counts match the model's draw, thinning is fair, supervision shares do not depend on the
policy, resume refuses other block counts."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from dflash_lab.model.objective import anchor_quota, sample_anchors, thin_quota
from dflash_lab.sampling import POLICIES, build_policy
from dflash_lab.sampling.anchors import (
    anchors_per_sample, block_tokens_per_sample, supervision_share, valid_positions_from_lengths,
)
from dflash_lab.sampling.core import cap_block_tokens
from dflash_lab.sampling.stats import batch_block_tokens, supervision_shares

MAX_TOKENS = 2048
BOUNDARIES = [0, 96, 152, 216, 304, 412, 1024]
PARAMS = {
    "sorted_static": {}, "full_random": {}, "packed": {"chunk_rows": 8},
    "bucketed": {"boundaries": BOUNDARIES}, "bucket_sequential": {"boundaries": BOUNDARIES},
    "bucketed_megabatch": {"boundaries": BOUNDARIES, "megabatch_batches": 4},
}
RECIPE = {"block_size": 8, "anchors_per_doc": 64, "anchor_density": None}


def recipe_blocks(lengths):
    return block_tokens_per_sample(valid_positions_from_lengths(lengths), **RECIPE)


@pytest.fixture(params=sorted(POLICIES))
def name(request):
    return request.param


def test_every_policy_is_covered():
    assert set(PARAMS) == set(POLICIES)


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("max_block_tokens", [600, 3000])
def test_every_batch_respects_both_budgets_and_every_sample_is_seen(name, world_size, max_block_tokens,
                                                                     cpu_lengths):
    blocks = recipe_blocks(cpu_lengths)
    capped = np.minimum(blocks, max_block_tokens)
    for epoch in (0, 1):
        seen = Counter()
        for rank in range(world_size):
            policy = build_policy(name, cpu_lengths, max_tokens=MAX_TOKENS, seed=1, world_size=world_size, rank=rank,
                                  max_block_tokens=max_block_tokens, block_tokens=blocks, **PARAMS[name])
            _, slots = batch_block_tokens(policy, policy.batches(epoch))
            assert (slots <= max_block_tokens).all(), (name, int(slots.max()))
            for batch in policy.batches(epoch):
                if name == "packed":
                    assert cpu_lengths[batch].sum() <= MAX_TOKENS
                    assert capped[batch].sum() <= max_block_tokens
                else:
                    assert len(batch) * cpu_lengths[batch].max() <= MAX_TOKENS
                    assert len(batch) * capped[batch].max() <= max_block_tokens
                seen.update(batch.tolist())
        assert set(seen) == set(range(cpu_lengths.size))


def test_the_block_budget_binds_and_changes_the_plan(name, cpu_lengths):
    blocks = recipe_blocks(cpu_lengths)
    free = build_policy(name, cpu_lengths, max_tokens=MAX_TOKENS, seed=1, block_tokens=blocks, **PARAMS[name])
    bound = build_policy(name, cpu_lengths, max_tokens=MAX_TOKENS, seed=1, block_tokens=blocks,
                         max_block_tokens=1024, **PARAMS[name])
    _, free_slots = batch_block_tokens(free, free.batches(0))
    assert free_slots.max() > 1024 and len(bound.batches(0)) > len(free.batches(0))
    # the same plan with and without block tokens when there is no block budget (old checkpoints keep resuming)
    plain = build_policy(name, cpu_lengths, max_tokens=MAX_TOKENS, seed=1, **PARAMS[name])
    assert plain.fingerprint == free.fingerprint
    assert [b.tolist() for b in plain.batches(0)] == [b.tolist() for b in free.batches(0)]


def test_a_resume_with_other_block_counts_is_refused(cpu_lengths):
    blocks = recipe_blocks(cpu_lengths)
    policy = build_policy("bucketed", cpu_lengths, max_tokens=MAX_TOKENS, block_tokens=blocks, max_block_tokens=900,
                          boundaries=BOUNDARIES)
    other = build_policy("bucketed", cpu_lengths, max_tokens=MAX_TOKENS, block_tokens=blocks // 2 * 2 + 8,
                         max_block_tokens=900, boundaries=BOUNDARIES)
    with pytest.raises(ValueError, match="fresh run directory"):
        other.load_state_dict(policy.state_dict())


def test_block_budget_inputs_are_checked(cpu_lengths):
    with pytest.raises(ValueError, match="needs the block tokens of every sample"):
        build_policy("bucketed", cpu_lengths, max_tokens=MAX_TOKENS, max_block_tokens=900, boundaries=BOUNDARIES)
    with pytest.raises(ValueError, match="one non-negative integer per sample"):
        build_policy("packed", cpu_lengths, max_tokens=MAX_TOKENS, max_block_tokens=900,
                     block_tokens=np.ones(3, dtype=np.int64))
    with pytest.raises(ValueError, match="sampler.max_block_tokens"):
        build_policy("packed", cpu_lengths, max_tokens=MAX_TOKENS, max_block_tokens=0,
                     block_tokens=recipe_blocks(cpu_lengths))


def test_a_document_over_the_budget_alone_is_capped_and_counted():
    capped, thinned = cap_block_tokens(np.array([8, 4096, 512]), 3, 1000)
    assert capped.tolist() == [8, 1000, 512] and thinned == 1
    policy = build_policy("packed", np.array([100, 600, 50]), max_tokens=1024, max_block_tokens=1000,
                          block_tokens=np.array([8, 4096, 512]))
    assert policy.admission.thinned == 1


def test_supervision_shares_are_the_datas_own_under_every_policy(cpu_lengths):
    blocks = recipe_blocks(cpu_lengths)
    data_share = supervision_share(blocks, cpu_lengths, BOUNDARIES)
    for name in POLICIES:
        policy = build_policy(name, cpu_lengths, max_tokens=MAX_TOKENS, seed=2, block_tokens=blocks,
                              max_block_tokens=1500, drop_last=True, **PARAMS[name])
        shares = supervision_shares(policy, BOUNDARIES)
        assert shares.keys() == data_share.keys()
        assert max(abs(shares[k] - data_share[k]) for k in shares) < 0.02, name
    # short documents anchor almost every position: their share of the supervision exceeds their share of tokens
    token_share = np.bincount(np.searchsorted(BOUNDARIES[1:-1], cpu_lengths), weights=cpu_lengths) / cpu_lengths.sum()
    assert data_share["0-96"] > token_share[0]


@pytest.mark.parametrize("rule", [(64, None), (64, 0.0625), (None, 0.25), (512, 0.5)])
def test_the_samplers_anchor_counts_are_the_models(rule):
    anchors_per_doc, density = rule
    valid = np.random.default_rng(0).integers(0, 3000, 500)
    if anchors_per_doc is None and density is None:
        pytest.skip("no rule")
    expected = anchor_quota(torch.from_numpy(valid), anchors_per_doc, density).numpy()
    assert np.array_equal(anchors_per_sample(valid, anchors_per_doc, density), expected)


def test_thinning_is_proportional_and_exact():
    quota = torch.tensor([300, 100, 7, 0, 41])
    kept = thin_quota(quota, 200)
    assert int(kept.sum()) == 200 and (kept <= quota).all()
    share = kept.double() / quota.clamp(min=1).double()
    assert float(share[:3].max() - share[:3].min()) < 0.15   # every document loses about the same share
    assert torch.equal(thin_quota(quota, 10_000), quota)


def test_the_models_anchor_draw_honours_the_block_budget():
    generator = torch.Generator().manual_seed(0)
    # a packed row of three documents: the budget is thinned over them in proportion
    doc_ids = torch.tensor([[0] * 50 + [1] * 30 + [2] * 20])
    mask = torch.ones_like(doc_ids, dtype=torch.bool)
    _, valid, anchor_doc = sample_anchors(mask, doc_ids, generator, 64, None, 3, max_anchors=40)
    per_doc = torch.bincount(anchor_doc[valid], minlength=3)
    assert int(valid.sum()) == 40 and per_doc.tolist() == [20, 12, 8]
    # a padded batch (one document per row): every row is capped at an equal share
    doc_ids = torch.tensor([[0] * 60, [1] * 40 + [-1] * 20])
    mask = doc_ids >= 0
    _, valid, _ = sample_anchors(mask, doc_ids, generator, 64, None, 2, max_anchors=50)
    assert valid.sum(dim=1).tolist() == [25, 25] and valid.shape[1] == 25


def test_dataset_anchor_positions_match_the_models_valid_positions(tmp_path):
    from dflash_lab.data import build_dataset
    from dflash_lab.data.tokenizer import ByteTokenizer
    from dflash_lab.model.objective import valid_anchor_mask

    dataset = build_dataset("synthetic", tokenizer=ByteTokenizer(), cache_dir=str(tmp_path), num_samples=60)
    counts = dataset.anchor_positions(chunk_tokens=500)   # several chunks
    for i in range(len(dataset)):
        sample = dataset[i]
        mask = sample["loss_mask"][None]
        expected = int(valid_anchor_mask(mask, torch.zeros_like(mask, dtype=torch.long)).sum())
        assert counts[i] == expected
