"""The DFlash block objective: anchors, blocks, the keys each block sees and the decayed cross-entropy weights.

Anchors: a position t may anchor a block when loss_mask[t] and loss_mask[t+1] hold and t, t+1 belong to the
same document (packed rows hold several). Each document gets ``quota = min(valid, anchors_per_doc)`` anchors,
or ``ceil(anchor_density * valid)`` (at least 1, at most anchors_per_doc) when a density is set, drawn without
replacement: one uniform number per (row, position) from the caller's ``torch.Generator`` (so a step's anchors
are a pure function of the batch shape and the generator state: reproducible and resumable), sorted by
(document, random) inside each row, the first ``quota`` of each document kept.
The rule is ``dflash_lab.sampling.anchors`` (where samplers read the block tokens each document brings to a step);
``anchor_quota`` is its torch form. A step's block budget (``max_block_tokens``, the sampler's second budget) is
met by the sampler; should a batch still exceed it (a batch not planned with block tokens, e.g. a benchmark's),
the anchors are thinned: in a packed row every document's quota by the same factor (``thin_quota``, largest
remainders first), in a padded batch (one document per row, every row running the widest row's slots) each
document is capped at an equal share ``max_anchors // rows``; no document loses more than its fair share.
Fixed anchors (``fixed_anchors``): the same valid positions, but ranked by a hash of (example id, position), so an
example is scored on the same blocks every time it is seen (per-example forgetting, probe bands).

Blocks: block n = [token at anchor_n, MASK x (bs - 1)] at positions pos(anchor_n) + 0..bs-1.
Visible keys (``draft_key_intervals``): block n sees the context keys of its anchor's document strictly before the
anchor (the decoder has no target hidden state for its anchor yet), all of its own block, and nothing of any other
block. Documents are contiguous runs of a row, so the context is one interval [document start, anchor). Padding
blocks (rows with fewer anchors) still see their own block, so no attention row is empty and nothing is NaN.
Labels: slot k >= 1 predicts the token at anchor + k, weight exp(-(k - 1) / gamma) when that token is in the
same document and supervised, else 0.

Cost: one sort of R x T keys per step (two stable sorts for fixed anchors); O(R x N x bs) for blocks and intervals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_lab.model.attention import KeyIntervals, document_starts


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
    context_start: torch.Tensor  # Long[R, N] first context key the block sees (its document's start)


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


def thin_quota(quota: torch.Tensor, max_anchors: int | None) -> torch.Tensor:
    """Quotas scaled down to ``max_anchors`` in total, proportionally (module docstring); unchanged when they fit.

    Each document keeps ``floor(q x f)`` with ``f = max_anchors / sum(q)``; the anchors left over go one each to
    the documents with the largest remainders (ties: lower document id), so the total is exactly ``max_anchors``.

    Example:
        >>> thin_quota(torch.tensor([300, 100, 0]), 200).tolist()
        [150, 50, 0]
        >>> thin_quota(torch.tensor([3, 3, 3]), 4).tolist()
        [2, 1, 1]
        >>> thin_quota(torch.tensor([5, 2]), None).tolist()
        [5, 2]
    """
    total = int(quota.sum().item())
    if max_anchors is None or total <= int(max_anchors):
        return quota
    exact = quota.double() * (int(max_anchors) / total)
    kept = torch.floor(exact).long()
    left = int(max_anchors) - int(kept.sum().item())
    if left > 0:
        remainder = exact - kept
        order = torch.argsort(-remainder, stable=True)[:left]
        kept[order] += 1
    return torch.minimum(kept, quota)


def sample_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, generator: torch.Generator | None,
                   anchors_per_doc: int | None, anchor_density: float | None, num_docs: int | None = None,
                   max_anchors: int | None = None):
    """Draw anchors per document.

    Args:
        loss_mask: Bool[R, T]; doc_ids: Long[R, T] (-1 on padding).
        generator: random source (its device is used to draw, results are moved to the batch device).
        anchors_per_doc: cap (or fixed count without a density) of anchors per document.
        anchor_density: anchors per valid position (None: use anchors_per_doc).
        num_docs: D (default: max doc id + 1).
        max_anchors: the step's anchor budget (``max_block_tokens // block_size``); quotas over it are thinned
            (``thin_quota``). None: no budget.

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
    if max_anchors is not None and docs == rows:
        # one document per row (a padded batch): every row runs the widest row's anchor slots, so the budget caps
        # each document at an equal share of it, as the sampler's rows x widest test does
        quota = quota.clamp(max=max(1, int(max_anchors) // rows))
    else:
        quota = thin_quota(quota, max_anchors)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    noise = torch.rand((rows, length), generator=generator, device=gen_device, dtype=torch.float64).to(device)
    # Sort key groups a row's valid positions by document, in random order inside a document.
    key = torch.where(ok, doc_ids.double() + noise, torch.full_like(noise, float("inf")))
    _, order = key.sort(dim=1)
    return _first_per_document(ok, doc_ids, quota, order)


def fixed_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, position_ids: torch.Tensor,
                  sample_index: torch.Tensor, per_doc: int):
    """The fixed anchors of each document: ``min(per_doc, valid)`` positions drawn once from its example id.

    Each valid position p of example e gets the key ``hash(e, p)`` (a 32-bit integer mix of the example id and the
    document-relative position, ties broken by p); a document's anchors are its ``per_doc`` smallest keys. The draw
    is a pure function of (example id, position), so it is the same in every epoch, on every rank, packed or padded,
    and the anchors for k are a subset of those for k + 1.

    Args:
        loss_mask, doc_ids: as in :func:`sample_anchors`; position_ids: Long[R, T] (restart at each document).
        sample_index: Long[D] example ids of the documents (``batch["sample_index"]``).
        per_doc: anchors per document.

    Returns:
        (anchors, valid, anchor_doc) as :func:`sample_anchors` returns them.

    Example:
        >>> mask = torch.ones(1, 40, dtype=torch.bool); doc = torch.zeros(1, 40, dtype=torch.long)
        >>> a = fixed_anchors(mask, doc, torch.arange(40)[None], torch.tensor([7]), 3)[0]
        >>> torch.equal(a, fixed_anchors(mask, doc, torch.arange(40)[None], torch.tensor([7]), 3)[0])
        True
    """
    ok = valid_anchor_mask(loss_mask, doc_ids)
    num_docs = max(int(sample_index.numel()), 1)
    example = sample_index.to(doc_ids.device)[doc_ids.clamp(min=0)]
    key = (_mix32(_mix32(example & _MASK32) ^ (position_ids & _MASK32)) << _POSITION_BITS) + position_ids
    key = torch.where(ok, key, torch.full_like(key, torch.iinfo(torch.long).max))
    by_key = key.argsort(dim=1, stable=True)
    group = torch.where(ok, doc_ids, torch.full_like(doc_ids, num_docs)).gather(1, by_key)
    order = by_key.gather(1, group.argsort(dim=1, stable=True))   # by document, by key inside a document
    quota = torch.bincount(doc_ids[ok], minlength=num_docs).clamp(max=int(per_doc))
    return _first_per_document(ok, doc_ids, quota, order)


_MASK32 = 0xFFFFFFFF
_POSITION_BITS = 24   # key = hash << 24 | position: unique for documents shorter than 16M tokens, fits in int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def _first_per_document(ok: torch.Tensor, doc_ids: torch.Tensor, quota: torch.Tensor, order: torch.Tensor):
    """Keep the first ``quota[d]`` valid positions of each document d in ``order`` (valid positions grouped by
    document, in the order of preference inside a document); returned sorted by position, padding slots last."""
    rows, length = ok.shape
    device = ok.device
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
    """Block tokens, positions, labels, weights and visible context for given anchors (module docstring)."""
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
    # Visible context: the anchor's document up to, not including, the anchor (documents are contiguous runs).
    context_start = torch.where(valid, document_starts(doc_ids).gather(1, anchors), anchors)
    return Blocks(anchors, valid, anchor_doc, block_ids.view(rows, -1), block_positions.view(rows, -1),
                  labels, label_ok, weights, context_start)


def draft_key_intervals(blocks: Blocks, context_len: int, *, backend: str = "auto",
                        single_document_rows: bool | None = None) -> KeyIntervals:
    """Keys each block token sees: context [document start, anchor) and its own block (module docstring).

    Keys are laid out as ``[context (context_len) ; block tokens (N bs)]``; padding slots see their own block only.
    """
    rows, slots = blocks.anchors.shape
    bs = blocks.labels.shape[2]
    lo = torch.where(blocks.valid, blocks.context_start, 0).repeat_interleave(bs, dim=1)
    hi = torch.where(blocks.valid, blocks.anchors, 0).repeat_interleave(bs, dim=1)
    own_lo = context_len + torch.arange(slots, device=lo.device).repeat_interleave(bs) * bs
    own_lo = own_lo.expand(rows, -1)
    return KeyIntervals(lo, hi, own_lo, own_lo + bs, kv_len=context_len + slots * bs, backend=backend,
                        single_document_rows=single_document_rows)


def default_gamma(block_size: int) -> float:
    """DFlash's decay constant by block size (7 for 16, 5 for 10, 4 for 8), else block_size / 2 rounded."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(int(block_size), float(max(1, math.floor(block_size / 2))))
