"""Collators: samples -> the collated batch dict of docs/CONTRACTS.md, padded (one row per document) or packed.

Batch fields (both layouts):
    input_ids Long[R, T]; loss_mask Bool[R, T] (False on padding); position_ids Long[R, T] (0 at each document
    start); doc_ids Long[R, T] (0..D-1 in sample_index order, -1 on padding); sample_index Long[D];
    real_tokens int (sum of document lengths); padded_tokens int (R x T; a packed row counts its used length).
Padded: R = D, T = longest (effective) length. Packed: R = 1, T = sum of lengths, no padding inside the row.
Every sample is first truncated to its effective length (the sampler's ``overlong=truncate`` lengths).

Cost: O(real tokens) copies; no Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _truncated(samples: Sequence[dict], lengths) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if len(lengths) != len(samples):
        raise ValueError(f"collate got {len(samples)} samples but {len(lengths)} effective lengths")
    out = []
    for sample, length in zip(samples, lengths):
        ids = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        mask = torch.as_tensor(sample["loss_mask"], dtype=torch.bool)
        length = min(int(length), ids.numel())
        if length <= 0:
            raise ValueError("collate got a sample with effective length 0: drop empty samples in the sampler")
        out.append((ids[:length], mask[:length]))
    return out


def collate_padded(samples: Sequence[dict], sample_index, lengths, pad_id: int) -> dict:
    """One document per row, right-padded to the longest row.

    Args:
        samples: dicts with ``input_ids`` and ``loss_mask`` (np or torch), in batch order.
        sample_index: dataset indices of the samples (D of them).
        lengths: effective length of each sample (same order); samples are truncated to it.
        pad_id: id written on padding.

    Returns:
        The CONTRACTS.md batch dict with R = D rows.

    Example:
        >>> s = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
        >>> collate_padded(s, [3, 9], [3, 1], pad_id=0)["doc_ids"].tolist()
        [[0, 0, 0], [1, -1, -1]]
    """
    docs = _truncated(samples, lengths)
    rows, width = len(docs), max(ids.numel() for ids, _ in docs)
    input_ids = torch.full((rows, width), int(pad_id), dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.bool)
    position_ids = torch.zeros((rows, width), dtype=torch.long)
    doc_ids = torch.full((rows, width), -1, dtype=torch.long)
    for row, (ids, mask) in enumerate(docs):
        n = ids.numel()
        input_ids[row, :n] = ids
        loss_mask[row, :n] = mask
        position_ids[row, :n] = torch.arange(n)
        doc_ids[row, :n] = row
    real = sum(ids.numel() for ids, _ in docs)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "doc_ids": doc_ids,
        "sample_index": torch.as_tensor(np.asarray(sample_index, dtype=np.int64)),
        "real_tokens": int(real),
        "padded_tokens": int(rows * width),
    }


def collate_packed(samples: Sequence[dict], sample_index, lengths, pad_id: int) -> dict:
    """All documents of the batch concatenated into ONE row; positions restart and doc_ids change per document.

    Args:
        samples, sample_index, lengths: as in :func:`collate_padded`.
        pad_id: unused (a packed row has no padding); kept so both collators share one signature.

    Returns:
        The CONTRACTS.md batch dict with R = 1 and T = sum of the effective lengths.

    Example:
        >>> s = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9], "loss_mask": [0, 1]}]
        >>> collate_packed(s, [3, 9], [3, 2], pad_id=0)["position_ids"].tolist()
        [[0, 1, 2, 0, 1]]
    """
    del pad_id
    docs = _truncated(samples, lengths)
    input_ids = torch.cat([ids for ids, _ in docs])[None]
    loss_mask = torch.cat([mask for _, mask in docs])[None]
    position_ids = torch.cat([torch.arange(ids.numel()) for ids, _ in docs])[None]
    doc_ids = torch.cat([torch.full((ids.numel(),), d, dtype=torch.long) for d, (ids, _) in enumerate(docs)])[None]
    real = int(input_ids.shape[1])
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "doc_ids": doc_ids,
        "sample_index": torch.as_tensor(np.asarray(sample_index, dtype=np.int64)),
        "real_tokens": real,
        "padded_tokens": real,
    }


class Collator:
    """DataLoader ``collate_fn``: reads each sample's ``index``, truncates to the policy's effective lengths.

    Args:
        pad_id: padding id (``tokenizer.pad_token_id``).
        packed: True for packing policies (``policy.packed``): one row per batch.
        effective_lengths: ``policy.lengths`` (np.int64[N], indexed by dataset index); None keeps full samples.

    Example:
        >>> collate = Collator(pad_id=0, packed=False)
        >>> collate([{"input_ids": [5, 6], "loss_mask": [0, 1], "index": 4}])["sample_index"].tolist()
        [4]
    """

    def __init__(self, pad_id: int, packed: bool, effective_lengths: np.ndarray | None = None):
        self.pad_id = int(pad_id)
        self.packed = bool(packed)
        self.effective_lengths = None if effective_lengths is None else np.asarray(effective_lengths, dtype=np.int64)

    def __call__(self, samples: Sequence[dict]) -> dict:
        if any("index" not in s for s in samples):
            raise ValueError("Collator needs each sample's 'index' (TokenizedDataset.__getitem__ provides it)")
        index = np.asarray([int(s["index"]) for s in samples], dtype=np.int64)
        if self.effective_lengths is None:
            lengths = [len(s["input_ids"]) for s in samples]
        else:
            lengths = self.effective_lengths[index]
        collate = collate_packed if self.packed else collate_padded
        return collate(samples, index, lengths, self.pad_id)
