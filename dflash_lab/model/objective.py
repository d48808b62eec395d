"""The DFlash block objective: anchors, blocks, the block attention mask and the decayed cross-entropy weights.

Anchors: a position t may anchor a block when loss_mask[t] and loss_mask[t+1] hold and t, t+1 belong to the
same document (packed rows hold several). Each document gets ``quota = min(valid, anchors_per_doc)`` anchors,
or ``ceil(anchor_density * valid)`` (at least 1, at most anchors_per_doc) when a density is set, drawn without
replacement: one uniform number per (row, position) from the caller's ``torch.Generator`` (so a step's anchors
are a pure function of the batch shape and the generator state: reproducible and resumable), sorted by
(document, random) inside each row, the first ``quota`` of each document kept.

Blocks: block n = [token at anchor_n, MASK x (bs - 1)] at positions pos(anchor_n) + 0..bs-1.
Mask: block n sees context keys j with doc(j) == doc(anchor_n) and j < anchor_n (strictly before: the decoder
has no target hidden state for its anchor yet), all of its own block, and nothing of any other block. Padding
blocks (rows with fewer anchors) still see their own block, so no attention row is empty and nothing is NaN.
Labels: slot k >= 1 predicts the token at anchor + k, weight exp(-(k - 1) / gamma) when that token is in the
same document and supervised, else 0.

Cost: one sort of R x T keys per step, masks of R x (N bs) x (T + N bs) booleans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Blocks:
    """Anchors and everything derived from them for one batch (R rows, N anchor slots, bs block size)."""

    anchors: torch.Tensor        # Long[R, N] row index of each anchor (0 where invalid)
    valid: torch.Tensor          # Bool[R, N] real anchor (False: padding slot)
    anchor_doc: torch.Tensor     # Long[R, N] document id of the anchor (-1 where invalid)
    block_ids: torch.Tensor      # Long[R, N * bs] anchor token then MASKs
    block_positions: torch.Tensor  # Long[R, N * bs]
    labels: torch.Tensor         # Long[R, N, bs] token at anchor + k (arbitrary where weight is 0)
    label_ok: torch.Tensor       # Bool[R, N, bs] slot k >= 1, inside the row, same document, supervised
    weights: torch.Tensor        # Float[R, N, bs] exp(-(k-1)/gamma) * label_ok
    attn_mask: torch.Tensor      # Bool[R, 1, N * bs, T + N * bs]


def valid_anchor_mask(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """Bool[R, T]: positions t with loss_mask[t], loss_mask[t+1] and doc(t) == doc(t+1) >= 0."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    return ok


def anchor_quota(valid_per_doc: torch.Tensor, anchors_per_doc: int | None,
                 anchor_density: float | None) -> torch.Tensor:
    """Anchors per document from its count of valid positions (see module docstring)."""
    if anchor_density is not None:
        quota = torch.ceil(valid_per_doc.double() * float(anchor_density)).long().clamp(min=1)
        if anchors_per_doc is not None:
            quota = quota.clamp(max=int(anchors_per_doc))
    elif anchors_per_doc is not None:
        quota = torch.full_like(valid_per_doc, int(anchors_per_doc))
    else:
        raise ValueError("set model.anchors_per_doc or model.anchor_density (both are null)")
    return torch.minimum(quota, valid_per_doc)


def sample_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, generator: torch.Generator | None,
                   anchors_per_doc: int | None, anchor_density: float | None, num_docs: int | None = None):
    """Draw anchors per document.

    Args:
        loss_mask: Bool[R, T]; doc_ids: Long[R, T] (-1 on padding).
        generator: random source (its device is used to draw, results are moved to the batch device).
        anchors_per_doc: cap (or fixed count without a density) of anchors per document.
        anchor_density: anchors per valid position (None: use anchors_per_doc).
        num_docs: D (default: max doc id + 1).

    Returns:
        (anchors Long[R, N], valid Bool[R, N], anchor_doc Long[R, N]); N >= 1.
    """
    rows, length = loss_mask.shape
    device = loss_mask.device
    ok = valid_anchor_mask(loss_mask, doc_ids)
    docs = int(num_docs if num_docs is not None else (int(doc_ids.max().item()) + 1 if doc_ids.numel() else 0))
    docs = max(docs, 1)
    valid_per_doc = torch.bincount(doc_ids[ok], minlength=docs)
    quota = anchor_quota(valid_per_doc, anchors_per_doc, anchor_density)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    noise = torch.rand((rows, length), generator=generator, device=gen_device, dtype=torch.float64).to(device)
    # Sort key groups a row's valid positions by document, in random order inside a document.
    key = torch.where(ok, doc_ids.double() + noise, torch.full_like(noise, float("inf")))
    _, order = key.sort(dim=1)
    sorted_doc = doc_ids.gather(1, order)
    sorted_ok = ok.gather(1, order)
    index = torch.arange(length, device=device).expand(rows, length)
    group_start = torch.ones_like(sorted_ok)
    group_start[:, 1:] = sorted_doc[:, 1:] != sorted_doc[:, :-1]
    start_index = torch.where(group_start, index, torch.zeros_like(index)).cummax(dim=1).values
    rank_in_doc = index - start_index
    keep_sorted = sorted_ok & (rank_in_doc < quota[sorted_doc.clamp(min=0)])
    keep = torch.zeros_like(ok).scatter(1, order, keep_sorted)
    slots = max(int(keep.sum(dim=1).max().item()) if keep.numel() else 0, 1)
    # Kept positions first, in increasing position order; padding slots after them.
    position_key = torch.where(keep, index, index + length)
    first = position_key.sort(dim=1).values[:, :slots]
    valid = first < length
    anchors = torch.where(valid, first, torch.zeros_like(first))
    anchor_doc = torch.where(valid, doc_ids.gather(1, anchors), torch.full_like(anchors, -1))
    return anchors, valid, anchor_doc


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor,
                 anchors: torch.Tensor, valid: torch.Tensor, anchor_doc: torch.Tensor, *, block_size: int,
                 mask_token_id: int, gamma: float | None) -> Blocks:
    """Block tokens, positions, labels, weights and the attention mask for given anchors (module docstring)."""
    rows, length = input_ids.shape
    slots = anchors.shape[1]
    device = input_ids.device
    offsets = torch.arange(block_size, device=device)
    anchor_tokens = input_ids.gather(1, anchors)
    block_ids = torch.full((rows, slots, block_size), int(mask_token_id), dtype=torch.long, device=device)
    block_ids[:, :, 0] = torch.where(valid, anchor_tokens, torch.full_like(anchor_tokens, int(mask_token_id)))
    block_positions = position_ids.gather(1, anchors)[:, :, None] + offsets

    label_index = anchors[:, :, None] + offsets                     # row index of token anchor + k
    inside = label_index < length
    safe = label_index.clamp(max=length - 1).view(rows, -1)
    labels = input_ids.gather(1, safe).view(rows, slots, block_size)
    same_doc = doc_ids.gather(1, safe).view(rows, slots, block_size) == anchor_doc[:, :, None]
    supervised = loss_mask.gather(1, safe).view(rows, slots, block_size)
    label_ok = inside & same_doc & supervised & valid[:, :, None] & (offsets > 0)
    decay = torch.ones(block_size, device=device)
    if gamma is not None and gamma > 0:
        decay = torch.exp(-(offsets - 1).clamp(min=0).float() / float(gamma))
    weights = label_ok.float() * decay

    # Context part: same document, strictly before the anchor. Block part: own block only.
    key_index = torch.arange(length, device=device)
    context_visible = (doc_ids[:, None, :] == anchor_doc[:, :, None]) & (key_index < anchors[:, :, None])
    context_visible &= valid[:, :, None]
    context_visible = context_visible.repeat_interleave(block_size, dim=1)          # [R, N*bs, T]
    block_of = torch.arange(slots * block_size, device=device) // block_size
    own_block = (block_of[:, None] == block_of[None, :]).expand(rows, -1, -1)       # [R, N*bs, N*bs]
    attn_mask = torch.cat([context_visible, own_block], dim=2)[:, None]
    return Blocks(anchors, valid, anchor_doc, block_ids.view(rows, -1), block_positions.view(rows, -1),
                  labels, label_ok, weights, attn_mask)


def default_gamma(block_size: int) -> float:
    """DFlash's decay constant by block size (7 for 16, 5 for 10, 4 for 8), else block_size / 2 rounded."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(int(block_size), float(max(1, math.floor(block_size / 2))))
