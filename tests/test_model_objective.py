"""Anchor sampling, block construction and the block attention mask (dflash_lab.model.objective)."""

import math

import pytest
import torch

from dflash_lab.data import collate_packed, collate_padded
from dflash_lab.model.objective import (
    anchor_quota, build_blocks, draft_key_intervals, fixed_anchors, sample_anchors, valid_anchor_mask,
)

torch.set_num_threads(1)
MASK = 3


def _batch(packed: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in (30, 7, 50, 12):
        mask = torch.rand(n, generator=g) < 0.7
        mask[: n // 4] = False
        samples.append({"input_ids": torch.randint(8, 100, (n,), generator=g), "loss_mask": mask})
    lengths = [len(s["input_ids"]) for s in samples]
    collate = collate_packed if packed else collate_padded
    return collate(samples, list(range(len(samples))), lengths, pad_id=0)


@pytest.mark.parametrize("packed", [False, True])
def test_anchors_only_where_two_supervised_tokens_of_one_document(packed):
    batch = _batch(packed)
    lm, doc = batch["loss_mask"], batch["doc_ids"]
    g = torch.Generator().manual_seed(1)
    anchors, valid, anchor_doc = sample_anchors(lm, doc, g, anchors_per_doc=5, anchor_density=None, num_docs=4)
    ok = valid_anchor_mask(lm, doc)
    rows = torch.arange(anchors.shape[0])[:, None].expand_as(anchors)
    assert ok[rows[valid], anchors[valid]].all()
    a = anchors[valid]
    r = rows[valid]
    assert lm[r, a].all() and lm[r, a + 1].all() and (doc[r, a] == doc[r, a + 1]).all()
    assert (anchor_doc[valid] == doc[r, a]).all() and (anchor_doc[~valid] == -1).all()
    # Per document: min(valid positions, 5) distinct anchors.
    valid_per_doc = torch.bincount(doc[ok], minlength=4)
    got = torch.bincount(anchor_doc[valid], minlength=4)
    assert got.tolist() == torch.clamp(valid_per_doc, max=5).tolist()
    pairs = set(zip(r.tolist(), a.tolist()))
    assert len(pairs) == int(valid.sum())


def test_anchor_sampling_is_reproducible_from_the_generator():
    batch = _batch(True)
    def draw(seed):
        return sample_anchors(batch["loss_mask"], batch["doc_ids"], torch.Generator().manual_seed(seed),
                              anchors_per_doc=4, anchor_density=None)[0]
    assert torch.equal(draw(5), draw(5))
    assert not torch.equal(draw(5), draw(6))
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    first = sample_anchors(batch["loss_mask"], batch["doc_ids"], g, 4, None)[0]
    g.set_state(state)   # resume from a saved generator state: the same anchors
    assert torch.equal(first, sample_anchors(batch["loss_mask"], batch["doc_ids"], g, 4, None)[0])


def test_anchor_quota_density_and_cap():
    valid = torch.tensor([0, 3, 40, 1000])
    assert anchor_quota(valid, 64, 0.0625).tolist() == [0, 1, 3, 63]
    assert anchor_quota(valid, 8, None).tolist() == [0, 3, 8, 8]
    with pytest.raises(ValueError, match="anchors_per_doc"):
        anchor_quota(valid, None, None)


@pytest.mark.parametrize("packed", [False, True])
def test_block_mask_labels_and_weights(packed):
    batch = _batch(packed, seed=3)
    bs, gamma = 4, 2.0
    ids, lm, pos, doc = batch["input_ids"], batch["loss_mask"], batch["position_ids"], batch["doc_ids"]
    anchors, valid, anchor_doc = sample_anchors(lm, doc, torch.Generator().manual_seed(0), 6, None, 4)
    blocks = build_blocks(ids, lm, pos, doc, anchors, valid, anchor_doc, block_size=bs, mask_token_id=MASK,
                          gamma=gamma)
    rows, length = ids.shape
    slots = anchors.shape[1]
    mask = draft_key_intervals(blocks, length).dense()
    assert mask.shape == (rows, 1, slots * bs, length + slots * bs)
    for r in range(rows):
        for n in range(slots):
            for k in range(bs):
                q = n * bs + k
                context = mask[r, 0, q, :length]
                block_part = mask[r, 0, q, length:].view(slots, bs)
                assert block_part[n].all(), "a block sees itself bidirectionally"
                assert not torch.cat([block_part[:n], block_part[n + 1:]]).any(), "no other block"
                if valid[r, n]:
                    a = int(anchors[r, n])
                    expected = (doc[r] == doc[r, a]) & (torch.arange(length) < a)
                    assert torch.equal(context, expected), "context: same document, strictly before the anchor"
                    token = blocks.block_ids[r, q]
                    assert token == (ids[r, a] if k == 0 else MASK)
                    assert blocks.block_positions[r, q] == pos[r, a] + k
                    t = a + k
                    ok = k >= 1 and t < length and bool(doc[r, t] == doc[r, a]) and bool(lm[r, t])
                    assert bool(blocks.label_ok[r, n, k]) == ok
                    if ok:
                        assert blocks.labels[r, n, k] == ids[r, t]
                        assert math.isclose(float(blocks.weights[r, n, k]), math.exp(-(k - 1) / gamma), rel_tol=1e-6)
                else:
                    assert not context.any() and not blocks.label_ok[r, n].any()
    assert (blocks.weights[..., 0] == 0).all()


def _fixed_pairs(batch, per_doc):
    """{(example id, document-relative position)} of the fixed anchors of a batch."""
    anchors, valid, anchor_doc = fixed_anchors(batch["loss_mask"], batch["doc_ids"], batch["position_ids"],
                                               batch["sample_index"], per_doc)
    rows = torch.arange(anchors.shape[0])[:, None].expand_as(anchors)
    positions = batch["position_ids"][rows[valid], anchors[valid]]
    examples = batch["sample_index"][anchor_doc[valid]]
    return sorted(zip(examples.tolist(), positions.tolist()))


def test_fixed_anchors_depend_on_the_example_only():
    padded, packed = _batch(False, seed=5), _batch(True, seed=5)
    pairs = _fixed_pairs(padded, 4)
    assert pairs == _fixed_pairs(packed, 4)                       # same anchors whatever the layout
    ok = valid_anchor_mask(padded["loss_mask"], padded["doc_ids"])
    expected_counts = torch.bincount(padded["doc_ids"][ok], minlength=4).clamp(max=4).tolist()
    assert [sum(1 for e, _ in pairs if e == d) for d in range(4)] == expected_counts
    rows = {int(padded["sample_index"][r]): r for r in range(4)}
    assert all(ok[rows[e], p] for e, p in pairs)                  # only valid anchor positions
    assert set(pairs) <= set(_fixed_pairs(padded, 6))            # k anchors are a subset of k + 2 anchors
    # another example id draws other positions (a 50-token document has 30+ valid positions)
    other = dict(padded, sample_index=padded["sample_index"] + 100)
    moved = {p for e, p in _fixed_pairs(other, 4) if e == 102} != {p for e, p in pairs if e == 2}
    assert moved
