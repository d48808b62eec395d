"""Block tokens per sample: the draft's work a document brings to a step, under the model's anchor rule.

A DFlash step trains one block of ``block_size`` tokens per anchor, and the draft's activations and FLOPs grow
with block tokens (anchors x block size), not with input tokens. A token budget alone therefore does not bound a
step: under the DFlash recipe's rule (``min(512, valid positions)`` anchors per document) a 300-token document
brings ~300 blocks (~4,800 block tokens, 16 per token) while an 8,192-token document brings 512 (1 per token).
``sampler.max_block_tokens`` makes block tokens a second budget of every policy (``core.pack_in_order``,
``packed.best_fit_decreasing``); the counts come from here.

Anchor rules (the same as ``dflash_lab.model.objective.anchor_quota``, which draws the anchors at step time; a
test pins the two to each other):

    recipe   a(v) = min(anchors_per_doc, v)                                  (anchor_density null)
    density  a(v) = min(anchors_per_doc, v, max(1, ceil(density x v)))       (a fixed share of the positions)

with ``v`` the document's valid anchor positions (``t`` and ``t + 1`` supervised and in the document). Block
tokens = ``block_size x a(v)``. A step's anchors are therefore fixed per document by its own positions, never by
its step-mates: a short document gets the same supervision in a length-homogeneous batch as in a mixed one
(a per-step cap that thinned every document of a full step would take supervision away from whatever a step
holds many of). The step budget is met by closing batches earlier, not by thinning.

Where the loss masks are unknown (the planner on a length workload) ``v = l - 1``: every token but the last may
anchor, the conservative case (``valid_positions_from_lengths``).

Cost: O(N) numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def anchor_rule_name(anchor_density: float | None) -> str:
    """``recipe`` (anchors_per_doc per document, every position when fewer) or ``density``.

    Example:
        >>> anchor_rule_name(None), anchor_rule_name(0.0625)
        ('recipe', 'density')
    """
    return "recipe" if anchor_density is None else "density"


def anchors_per_sample(valid_positions: Any, anchors_per_doc: int | None, anchor_density: float | None) -> np.ndarray:
    """Anchors of each document under the rule (module docstring), from its valid anchor positions.

    Example:
        >>> anchors_per_sample([0, 10, 600], 512, None).tolist()
        [0, 10, 512]
        >>> anchors_per_sample([0, 10, 600], 64, 0.0625).tolist()
        [0, 1, 38]
    """
    valid = np.asarray(valid_positions, dtype=np.int64)
    if anchor_density is not None:
        if not 0 < float(anchor_density) <= 1:
            raise ValueError(f"model.anchor_density={anchor_density}: must be in (0, 1], or null for the recipe's "
                             f"min(anchors_per_doc, valid positions)")
        quota = np.maximum(np.ceil(valid * float(anchor_density)).astype(np.int64), 1)
        if anchors_per_doc is not None:
            quota = np.minimum(quota, int(anchors_per_doc))
    elif anchors_per_doc is not None:
        quota = np.full_like(valid, int(anchors_per_doc))
    else:
        raise ValueError("set model.anchors_per_doc or model.anchor_density (both are null)")
    return np.minimum(quota, valid)


def block_tokens_per_sample(valid_positions: Any, *, block_size: int, anchors_per_doc: int | None,
                            anchor_density: float | None) -> np.ndarray:
    """Block tokens (anchors x block size) of each document.

    Example:
        >>> block_tokens_per_sample([5, 1000], block_size=16, anchors_per_doc=512, anchor_density=None).tolist()
        [80, 8192]
    """
    return anchors_per_sample(valid_positions, anchors_per_doc, anchor_density) * int(block_size)


def valid_positions_from_lengths(lengths: Any) -> np.ndarray:
    """``l - 1`` per document: its valid anchor positions when every token is supervised (the conservative case).

    Example:
        >>> valid_positions_from_lengths([1, 300]).tolist()
        [0, 299]
    """
    return np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0)


def supervision_share(block_tokens: np.ndarray, lengths: np.ndarray, bands: list[int],
                      counts: np.ndarray | None = None) -> dict[str, float]:
    """Share of an epoch's block tokens that falls in each length band ``(bands[i], bands[i + 1]]``.

    Args:
        block_tokens, lengths: per sample.
        bands: band edges (first 0).
        counts: how often each sample appears in the epoch's plan (default once: the data's own share).

    Example:
        >>> supervision_share(np.array([16, 16, 32]), np.array([10, 20, 300]), [0, 100, 1000])
        {'0-100': 0.5, '100-1000': 0.5}
    """
    weights = block_tokens.astype(np.float64) * (np.ones(len(lengths)) if counts is None else counts)
    total = float(weights.sum())
    band = np.clip(np.searchsorted(np.asarray(bands[1:-1]), lengths, side="left"), 0, len(bands) - 2)
    shares = np.bincount(band, weights=weights, minlength=len(bands) - 1) / (total if total > 0 else 1.0)
    return {f"{lo}-{hi}": float(v) for lo, hi, v in zip(bands[:-1], bands[1:], shares)}
