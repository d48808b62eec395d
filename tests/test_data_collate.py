"""Collators produce exactly the CONTRACTS.md batch dict."""

import numpy as np
import pytest
import torch

from dflash_lab.data import Collator, collate_packed, collate_padded

FIELDS = {"input_ids", "loss_mask", "position_ids", "doc_ids", "sample_index", "real_tokens", "padded_tokens"}


def _samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = np.zeros(n, dtype=bool)
        mask[n // 3:] = True
        out.append({"input_ids": torch.from_numpy(rng.integers(8, 200, n)), "loss_mask": torch.from_numpy(mask),
                    "index": i})
    return out


def test_padded_layout():
    samples = _samples([5, 9, 3])
    batch = collate_padded(samples, [10, 11, 12], [5, 7, 3], pad_id=0)   # sample 1 truncated to 7
    assert set(batch) == FIELDS
    assert batch["input_ids"].shape == (3, 7) and batch["input_ids"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.bool
    assert batch["doc_ids"].tolist()[2] == [2, 2, 2, -1, -1, -1, -1]
    assert batch["position_ids"][1].tolist() == list(range(7))
    assert batch["sample_index"].tolist() == [10, 11, 12]
    assert batch["real_tokens"] == 15 and batch["padded_tokens"] == 21
    assert not batch["loss_mask"][batch["doc_ids"] < 0].any()
    assert (batch["input_ids"][batch["doc_ids"] < 0] == 0).all()
    assert torch.equal(batch["input_ids"][1, :7], samples[1]["input_ids"][:7])


def test_packed_layout_has_one_row_and_no_padding():
    samples = _samples([5, 9, 3])
    batch = collate_packed(samples, [4, 2, 8], [5, 9, 3], pad_id=0)
    assert set(batch) == FIELDS
    assert batch["input_ids"].shape == (1, 17)
    assert (batch["doc_ids"] >= 0).all()
    assert batch["doc_ids"][0].tolist() == [0] * 5 + [1] * 9 + [2] * 3
    assert batch["position_ids"][0].tolist() == list(range(5)) + list(range(9)) + list(range(3))
    assert batch["real_tokens"] == batch["padded_tokens"] == 17
    assert torch.equal(batch["input_ids"][0, 5:14], samples[1]["input_ids"])
    assert batch["sample_index"].tolist() == [4, 2, 8]


def test_collator_uses_sample_index_and_effective_lengths():
    samples = _samples([6, 4])
    for s, index in zip(samples, (3, 1)):
        s["index"] = index
    effective = np.array([9, 2, 9, 5])   # policy.lengths, indexed by dataset index
    padded = Collator(pad_id=0, packed=False, effective_lengths=effective)(samples)
    assert padded["sample_index"].tolist() == [3, 1]
    assert padded["input_ids"].shape == (2, 5) and padded["real_tokens"] == 7
    packed = Collator(pad_id=0, packed=True, effective_lengths=effective)(samples)
    assert packed["input_ids"].shape == (1, 7)
    with pytest.raises(ValueError, match="index"):
        Collator(pad_id=0, packed=False)([{"input_ids": [1, 2], "loss_mask": [0, 1]}])
