"""Per-slot cross-entropy and argmax through the target's frozen LM head, without S x V logits in memory.

Two implementations of ``(ce Float[S], predicted Long[S]) = CE(hidden W^T + b, labels), argmax(hidden W^T + b)``
for S supervised slots, hidden size H and a vocabulary of V words:

* ``fused`` (``head_ce_fused``, the default where it applies): torch's ``F.linear_cross_entropy`` with
  ``reduction="none"`` and a ``LinearCrossEntropyOptions`` chunk of ``chunk_elements // V`` rows. Its forward
  computes one chunk of logits at a time and keeps only the loss; it saves its inputs (the hidden slots, the head
  weight, the labels: no logits) and its backward recomputes each chunk's logits once to form the input gradient.
  The argmax comes from a separate no-grad pass over the same chunks (the fused op returns the loss only).
  Cost: 4 S H V multiply-adds (forward, argmax pass, backward recompute, input gradient); saved: the S x H
  hidden slots; transient: one chunk of logits (plus its softmax in place) in the accumulation dtype.
* ``chunked`` (``head_ce_chunked``, the reference and the fallback): logits, float32 CE and argmax from one matmul;
  when S x V > ``chunk_elements`` the rows run in chunks under activation checkpointing (recomputed in backward).
  Cost: 2 S H V multiply-adds unchunked (saved: the float32 log-probabilities, 4 S V bytes), 3 S H V chunked
  (saved: the hidden slots; transient: one chunk's logits, their float32 copy, log-probabilities and gradients).

* ``one_pass`` (``head_ce_one_pass``, the default when gradients are needed): the head is frozen, so the only
  gradient the loss needs from it is the input gradient, and CE's is known in the forward: per slot
  d CE / d hidden = (softmax(logits) - onehot(label)) W, whatever weight the loss later gives the slot. Each chunk's
  logits are computed once; CE, argmax and that gradient come from them, and only the gradient (S x H, the size of
  the hidden slots) is saved; backward scales it by each slot's incoming gradient. Cost: 2 S H V multiply-adds
  (forward and input gradient, no recomputation: the chunked reference does 3, the fused op 4); saved: S x H
  (written chunk by chunk into one tensor); transient: one chunk of float32 logits, the softmax taken in place
  (no ``logsumexp``, whose ``exp(x - max)`` would be a second chunk), beside, for a moment, the matmul's output
  in the compute dtype or the softmax's cast back: (c + f) bytes per logit under autocast, f in float32. The chunk
  is released before the next one (measured: the medium CPU check, docs/gpu.md).

``head_ce`` picks ``one_pass`` when gradients are needed (``fused``: torch's op instead, where it exists); without
gradients (fixed anchors, probes) one chunked no-grad pass gives both outputs from one matmul. If the fused op
raises for a dtype or device, the step falls back to ``one_pass`` (with a warning). The fused op runs outside
autocast on the head's dtype (the hidden slots are cast to it, as autocast would): on a bf16 target the per-slot
CE values come back in bf16 (their gradient accumulates in float32); the reference and the one-pass head return
float32 CE.

Measured (docs/model_speed.md, 2-core CPU, S 4096 x V 32768 x H 512, float32): fused 8.8 s and +580 MiB peak RSS
per forward + backward, reference 2.7 s and +1537 MiB (4.4 s and +472 MiB in 1024-row chunks): on CPU the fused
path trades speed for memory. GPU not measured; ``DFlashModel(fused_head_ce=False)`` selects the reference.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

FUSED_AVAILABLE = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def chunk_rows(vocab: int, chunk_elements: int) -> int:
    """Rows of one chunk: at most ``chunk_elements`` logits (at least one row)."""
    return max(1, chunk_elements // vocab)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # the target's nn.Linear head: hidden cast to its dtype outside autocast (under autocast the kernel casts)
    if not torch.is_autocast_enabled(hidden.device.type):
        hidden = hidden.to(weight.dtype)
    return F.linear(hidden, weight, bias)


def _logits_ce(hidden, weight, bias, labels):
    logits = _logits(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(dim=-1)


def head_ce_chunked(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                    chunk_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: float32 logits -> per-slot CE and argmax; checkpointed chunks when S x V > ``chunk_elements``."""
    vocab = weight.shape[0]
    if hidden.shape[0] * vocab <= chunk_elements:
        return _logits_ce(hidden, weight, bias, labels)
    rows = chunk_rows(vocab, chunk_elements)
    ces, preds = [], []
    for start in range(0, hidden.shape[0], rows):
        part = slice(start, start + rows)
        if torch.is_grad_enabled():
            ce, pred = checkpoint(_logits_ce, hidden[part], weight, bias, labels[part], use_reentrant=False)
        else:
            ce, pred = _logits_ce(hidden[part], weight, bias, labels[part])
        ces.append(ce)
        preds.append(pred)
    return torch.cat(ces), torch.cat(preds)


@torch.no_grad()
def head_argmax(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                chunk_elements: int) -> torch.Tensor:
    """Argmax of the head's logits, ``chunk_elements`` logits at a time (no float32 copy: argmax is exact)."""
    rows = chunk_rows(weight.shape[0], chunk_elements)
    return torch.cat([_logits(part, weight, bias).argmax(dim=-1) for part in hidden.split(rows)])


def head_ce_fused(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                  chunk_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.linear_cross_entropy`` (chunked, reduction none) for the CE, a no-grad chunked pass for the argmax.

    Raises whatever the fused op raises (``head_ce`` falls back to ``head_ce_chunked``).
    """
    slots, vocab = hidden.shape[0], weight.shape[0]
    # An explicit chunk: torch's "auto" chunking (tuned on A100) picks 32-row chunks for H 512 / V 32K, three
    # times slower on CPU than chunks of a few thousand rows; the same budget as the reference bounds memory.
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=min(slots, chunk_rows(vocab, chunk_elements)),
                                                 chunking_method=None)
    with torch.autocast(hidden.device.type, enabled=False):
        # the custom op has no autocast rule: feed it the head's dtype, as autocast would the nn.Linear head
        ce = F.linear_cross_entropy(hidden.to(weight.dtype), weight, labels, linear_bias=bias, reduction="none",
                                    options=options)
        predicted = head_argmax(hidden, weight, bias, chunk_elements)
    return ce, predicted


class _OnePassHeadCE(torch.autograd.Function):
    """CE and argmax of a frozen head's logits, the input gradient computed in the same pass (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows: int, dtype: torch.dtype):
        slots = hidden.shape[0]
        ce = hidden.new_empty(slots, dtype=torch.float32)
        predicted = labels.new_empty(slots)
        grad = torch.empty_like(hidden, memory_format=torch.contiguous_format)   # filled chunk by chunk (no cat)
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        for start in range(0, slots, rows):
            part = slice(start, start + rows)
            target = labels[part]
            # One chunk of float32 logits is the only chunk-sized tensor alive (with, for a moment, the matmul's
            # output in the compute dtype and, at the end, the softmax's cast back): the softmax is taken in place
            # (no logsumexp, whose ``exp(x - max)`` is a second chunk-sized temporary), and the chunk is released
            # before the next one is computed.
            logits = F.linear(hidden[part].to(dtype), weight, bias).float()
            predicted[part] = logits.argmax(dim=-1)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            top = logits.amax(dim=-1, keepdim=True)
            total = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)       # exp(logits - max), in place
            ce[part] = (total.log() + top).squeeze(1) - picked               # logsumexp - the label's logit
            probs = logits.div_(total)                                       # softmax, in place
            probs[torch.arange(len(target), device=probs.device), target] -= 1.0
            grad[part] = probs.to(dtype) @ weight
            del logits, probs
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(predicted)
        return ce, predicted

    @staticmethod
    def backward(ctx, grad_ce, _grad_pred):
        (grad_per_unit,) = ctx.saved_tensors
        return grad_per_unit * grad_ce[:, None].to(grad_per_unit.dtype), None, None, None, None, None


def head_ce_one_pass(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                     chunk_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CE Float[S], argmax Long[S] and (for backward) the input gradient, from one pass over chunks of at most
    ``chunk_elements`` logits. The head (``weight``, ``bias``) gets no gradient: it must be frozen.

    Logits are computed in the dtype autocast would give the head's matmul (the autocast dtype when it is on,
    else the head's own), then upcast to float32, as the reference path computes them.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("head_ce_one_pass computes no weight gradient: the LM head must be frozen")
    device_type = hidden.device.type
    dtype = weight.dtype
    if torch.is_autocast_enabled(device_type):
        dtype = (torch.get_autocast_dtype(device_type) if hasattr(torch, "get_autocast_dtype")
                 else torch.get_autocast_gpu_dtype() if device_type == "cuda" else torch.get_autocast_cpu_dtype())
    with torch.autocast(device_type, enabled=False):
        return _OnePassHeadCE.apply(hidden, weight, bias, labels, chunk_rows(weight.shape[0], chunk_elements), dtype)


def head_ce(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, *,
            chunk_elements: int, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot CE Float[S] and argmax Long[S] of ``hidden`` [S, H] through the head (``weight`` [V, H], ``bias``).

    With gradients: ``head_ce_one_pass``, or with ``fused`` torch's ``head_ce_fused`` where it exists; without,
    one chunked no-grad pass (see the module docstring).
    """
    needs_grad = torch.is_grad_enabled() and hidden.requires_grad
    if not needs_grad:
        return head_ce_chunked(hidden, weight, bias, labels, chunk_elements)
    if fused and FUSED_AVAILABLE and hidden.shape[0] > 0:   # (the op needs a positive chunk)
        try:
            return head_ce_fused(hidden, weight, bias, labels, chunk_elements)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
            warnings.warn(f"F.linear_cross_entropy failed on {hidden.dtype} {hidden.device.type} ({error}); "
                          f"the LM head runs the one-pass path", RuntimeWarning, stacklevel=2)
    return head_ce_one_pass(hidden, weight, bias, labels, chunk_elements)

