"""LM head + CE (dflash_lab.model.head): the one-pass head and the fused F.linear_cross_entropy path against the
chunked reference."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from dflash_lab.model import head
from dflash_lab.model.head import head_ce, head_ce_chunked, head_ce_fused, head_ce_one_pass

torch.set_num_threads(1)
WHOLE = 1 << 40   # chunk budget that never chunks

needs_fused = pytest.mark.skipif(not head.FUSED_AVAILABLE, reason="torch has no F.linear_cross_entropy")


def _problem(slots, vocab, hidden, seed=0, dtype=torch.float32, bias=False):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5 * 3).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype) if bias else None
    x = torch.randn(slots, hidden, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (slots,), generator=g)
    slot_weights = torch.rand(slots, generator=g)
    return x, weight, b, labels, slot_weights


def _run(fn, x, weight, bias, labels, slot_weights, chunk_elements):
    x = x.clone().requires_grad_()
    ce, predicted = fn(x, weight, bias, labels, chunk_elements)
    loss = (ce * slot_weights).sum()
    loss.backward()
    return ce.detach(), predicted, loss.detach(), x.grad


def _relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@needs_fused
@pytest.mark.parametrize("slots,vocab,hidden,chunk_elements,bias", [
    (50, 264, 32, WHOLE, False),            # small vocabulary: the reference keeps the whole logits
    (700, 5000, 48, 5000 * 128, False),     # large enough to chunk: 128-row chunks, a partial last one
    (300, 3000, 40, 3000 * 64, True),       # a head with a bias
])
def test_fused_head_matches_the_reference_loss_gradients_and_argmax(slots, vocab, hidden, chunk_elements, bias):
    problem = _problem(slots, vocab, hidden, bias=bias)
    assert (slots * vocab > chunk_elements) == (chunk_elements != WHOLE)
    ref_ce, ref_pred, ref_loss, ref_grad = _run(head_ce_chunked, *problem, chunk_elements)
    whole_ce, _, _, whole_grad = _run(head_ce_chunked, *problem, WHOLE)
    ce, pred, loss, grad = _run(head_ce_fused, *problem, chunk_elements)
    torch.testing.assert_close(ref_ce, whole_ce, rtol=0, atol=0)      # the chunked reference is exact
    torch.testing.assert_close(ref_grad, whole_grad, rtol=0, atol=0)
    assert ce.dtype == torch.float32 and ce.shape == (slots,)
    torch.testing.assert_close(ce, ref_ce, rtol=1e-6, atol=0)
    assert abs(float(loss / ref_loss) - 1) < 1e-6
    assert _relative(grad, ref_grad) < 1e-6
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6 * float(ref_grad.abs().max()))
    assert torch.equal(pred, ref_pred)


@needs_fused
def test_fused_head_saves_no_logits():
    x, weight, bias, labels, slot_weights = _problem(64, 4096, 32)
    x.requires_grad_()
    saved = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr():
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        ce, _ = head_ce_fused(x, weight, bias, labels, WHOLE)
        (ce * slot_weights).sum()
    # the hidden slots, the labels and the slot weights: no S x V tensor
    assert sum(saved.values()) == x.nbytes + labels.nbytes + slot_weights.nbytes


@pytest.mark.parametrize("slots,vocab,hidden,chunk_elements,bias", [
    (50, 264, 32, WHOLE, False),            # one chunk
    (700, 5000, 48, 5000 * 128, False),     # 128-row chunks, a partial last one
    (300, 3000, 40, 3000 * 64, True),       # a head with a bias
])
def test_one_pass_head_matches_the_reference_loss_gradients_and_argmax(slots, vocab, hidden, chunk_elements, bias):
    """The input gradient computed in the forward, scaled by each slot's loss weight in backward, is the
    reference's backward (float64 inputs: both paths compute the logits' softmax in float32)."""
    problem = _problem(slots, vocab, hidden, bias=bias, dtype=torch.float64)
    ref_ce, ref_pred, ref_loss, ref_grad = _run(head_ce_chunked, *problem, WHOLE)
    ce, pred, loss, grad = _run(head_ce_one_pass, *problem, chunk_elements)
    assert ce.dtype == torch.float32 and ce.shape == (slots,) and grad.dtype == torch.float64
    torch.testing.assert_close(ce, ref_ce, rtol=1e-6, atol=1e-6)
    assert _relative(grad, ref_grad) < 1e-6 and torch.equal(pred, ref_pred)


def test_one_pass_head_saves_only_the_input_gradient_and_refuses_a_trainable_head():
    x, weight, bias, labels, slot_weights = _problem(64, 4096, 32)
    x.requires_grad_()
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        ce, _ = head_ce_one_pass(x, weight, bias, labels, WHOLE)
        (ce * slot_weights).sum()
    assert sum(saved.values()) == x.nbytes + slot_weights.nbytes   # S x H (the gradient) and the slot weights
    with pytest.raises(ValueError, match="frozen"):
        head_ce_one_pass(x, weight.requires_grad_(), bias, labels, WHOLE)


@pytest.mark.parametrize("under_autocast", [False, True], ids=["bf16-head", "bf16-autocast"])
def test_bf16_head_runs_one_pass_close_to_the_reference(under_autocast):
    """The default with gradients: the one-pass head, no fused op, no warning; within bf16 rounding of the
    reference, and computing its logits in the dtype autocast gives the head's matmul."""
    x, weight, bias, labels, slot_weights = _problem(256, 2048, 64, dtype=torch.bfloat16)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
        warnings.simplefilter("error")
        args = (x.float() if under_autocast else x, weight.float() if under_autocast else weight, bias, labels,
                slot_weights, 2048 * 64)
        ce, pred, loss, grad = _run(_head_ce_default, *args)
        ref_ce, ref_pred, ref_loss, ref_grad = _run(head_ce_chunked, *args[:5], WHOLE)
    assert grad.dtype == (torch.float32 if under_autocast else torch.bfloat16)
    torch.testing.assert_close(ce.float(), ref_ce, rtol=1e-2, atol=1e-2)
    assert _relative(grad.float(), ref_grad.float()) < 1e-2 and float((pred != ref_pred).float().mean()) < 0.02


def _head_ce_default(*args):
    return head_ce(*args[:4], chunk_elements=args[4])


def _head_ce_fused(*args):
    return head_ce(*args[:4], chunk_elements=args[4], fused=True)


@needs_fused
def test_head_ce_falls_back_to_one_pass_when_the_fused_op_fails(monkeypatch):
    problem = _problem(120, 1000, 24)
    one_pass = _run(head_ce_one_pass, *problem, 1000 * 32)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setattr(F, "linear_cross_entropy", broken)
    with pytest.warns(RuntimeWarning, match="one-pass path"):
        fallback = _run(_head_ce_fused, *problem, 1000 * 32)
    assert all(torch.equal(a, b) for a, b in zip(fallback, one_pass))


def test_head_ce_runs_one_pass_silently_when_torch_has_no_fused_op(monkeypatch):
    """torch < 2.13 (e.g. the GPU image's 2.11) has no F.linear_cross_entropy: the one-pass head, no warning."""
    problem = _problem(120, 1000, 24)
    one_pass = _run(head_ce_one_pass, *problem, 1000 * 32)
    monkeypatch.setattr(head, "FUSED_AVAILABLE", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        missing = _run(_head_ce_fused, *problem, 1000 * 32)
    assert all(torch.equal(a, b) for a, b in zip(missing, one_pass))


def test_without_gradients_one_chunked_pass_gives_both_outputs(monkeypatch):
    x, weight, bias, labels, _ = _problem(90, 700, 16)

    def must_not_run(*args, **kwargs):
        raise AssertionError("the fused op runs only when gradients are needed")

    monkeypatch.setattr(head, "FUSED_AVAILABLE", True)   # (as on torch 2.13+, where the op exists)
    monkeypatch.setattr(F, "linear_cross_entropy", must_not_run, raising=False)
    with torch.no_grad():
        ce, pred = head_ce(x, weight, bias, labels, chunk_elements=700 * 16)
    ref_ce, ref_pred = head_ce_chunked(x, weight, bias, labels, WHOLE)
    assert torch.equal(ce, ref_ce) and torch.equal(pred, ref_pred)


@pytest.mark.parametrize("chunk_elements", [WHOLE, 8192 * 96], ids=["whole", "checkpointed-chunks"])
@pytest.mark.parametrize("under_autocast", [False, True], ids=["bf16-inputs", "bf16-autocast"])
def test_chunked_bf16_head_is_within_bf16_rounding_of_float32(chunk_elements, under_autocast):
    """The chunked head is the only path on torch < 2.13 (no ``F.linear_cross_entropy``: the lent GPU image's
    torch 2.11), where the target and the hidden slots are bf16 (or the draft runs under bf16 autocast). Against
    the same values in float32: each logit is rounded once to bf16 (relative error <= 2^-9), and log-softmax is
    1-Lipschitz in the max norm, so a slot's CE moves by at most 2 x 2^-9 x max |logit|; the input gradient
    goes through two bf16 roundings (the logits' gradient, the product) and stays within 1% in norm; an argmax may
    differ only between logits closer than that bound."""
    slots, vocab, hidden = 512, 8192, 256
    x, weight, bias, labels, slot_weights = _problem(slots, vocab, hidden, seed=3, dtype=torch.bfloat16)
    logits = x.double() @ weight.double().T
    bound = 2 * 2.0 ** -9 * float(logits.abs().max())
    ref_ce, ref_pred, ref_loss, ref_grad = _run(head_ce_chunked, x.float(), weight.float(), None, labels,
                                                slot_weights, chunk_elements)
    if under_autocast:   # the draft's float32 hidden states under bf16 autocast, the bf16 target head
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ce, pred, loss, grad = _run(head_ce_chunked, x.float(), weight, None, labels, slot_weights,
                                        chunk_elements)
    else:
        ce, pred, loss, grad = _run(head_ce_chunked, x, weight, None, labels, slot_weights, chunk_elements)
    assert ce.dtype == torch.float32 and grad.dtype == (torch.float32 if under_autocast else torch.bfloat16)
    assert float((ce - ref_ce).abs().max()) <= bound, (float((ce - ref_ce).abs().max()), bound)
    assert abs(float(loss - ref_loss)) <= bound * float(slot_weights.sum())
    assert _relative(grad.float(), ref_grad) < 1e-2
    top2 = logits.topk(2, dim=-1).values
    differs = pred != ref_pred
    assert differs.float().mean() < 0.05 and bool(((top2[:, 0] - top2[:, 1])[differs] <= bound).all())


# (device, slots, words, hidden, logits per chunk): CUDA at Qwen3-8B's head in the model's chunk of
# CE_CHUNK_ELEMENTS logits (scripts/gpu_check.sh runs it); the same path on a CPU at a CPU size, the chunk set to
# 2^22 logits (139 rows: three chunks and a part)
HEAD_SHAPES = {"cpu": ("cpu", 512, 30_000, 256, 1 << 22), "cuda-qwen3-8b": ("cuda", 4096, 151_936, 4096, None)}


@pytest.mark.parametrize("shape", [
    "cpu", pytest.param("cuda-qwen3-8b", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_one_pass_head_under_bf16_autocast_matches_float32_and_the_memory_model(shape, monkeypatch):
    """The head training runs (the one-pass path under bf16 autocast, bf16 head and slots) on CUDA at Qwen3-8B's
    head (hidden 4096, 151,936 words, 4,096 slots) and on a CPU at a small shape: CE, argmax and input gradient
    within bf16 rounding of the float32 reference on the same values, and the memory its forward adds within 10% of
    the memory model's head terms (``footprint._head_terms``: the saved S x H gradient and one chunk's logits,
    c + f bytes each; the input slots are allocated before the measurement)."""
    from types import SimpleNamespace

    import numpy as np

    from dflash_lab.model import footprint
    from dflash_lab.model.dflash import DFlashModel

    device_type, slots, vocab, hidden, chunk = HEAD_SHAPES[shape]
    if chunk:   # the model's chunk, as the memory model reads it, at the CPU size (two chunks and a part)
        monkeypatch.setattr(DFlashModel, "CE_CHUNK_ELEMENTS", chunk)
    device, chunk = torch.device(device_type), DFlashModel.CE_CHUNK_ELEMENTS
    g = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=g, device=device) * hidden ** -0.5 * 3).to(torch.bfloat16)
    x = torch.randn(slots, hidden, generator=g, device=device).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (slots,), generator=g, device=device)
    slot_weights = torch.rand(slots, generator=g, device=device)

    def forward(leaf):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return head_ce(leaf, weight, None, labels, chunk_elements=chunk)

    leaf = x.detach().clone().requires_grad_()
    if device_type == "cuda":
        forward(x.detach().clone().requires_grad_())   # cuBLAS's workspace and first blocks, outside the measurement
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ce, predicted = forward(leaf)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    else:
        from helpers import allocated_peak_bytes

        outputs = []
        measured = allocated_peak_bytes(lambda: outputs.extend(forward(leaf)))
        ce, predicted = outputs
    (ce * slot_weights).sum().backward()

    model = SimpleNamespace(target=SimpleNamespace(vocab=vocab), draft=SimpleNamespace(hidden=hidden),
                            head_ce="one_pass")
    saved, transient = footprint._head_terms(model, SimpleNamespace(S=np.array([float(slots)]), c=2.0, f=4.0))
    predicted_bytes = float(saved[0] + transient[0]) - slots * hidden * 2   # (the input slots: allocated before)
    assert 0.9 <= predicted_bytes / measured <= 1.1, (predicted_bytes / 2**20, measured / 2**20)

    ref_ce, ref_pred, _, ref_grad = _run(head_ce_chunked, x.float(), weight.float(), None, labels, slot_weights,
                                         chunk)
    assert ce.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ce.detach(), ref_ce, rtol=1e-2, atol=1e-2)
    assert _relative(leaf.grad.float(), ref_grad) < 1e-2
    # bf16 logits reorder near-ties among many words: each chosen word's float32 logit must be within two bf16
    # roundings (2 x 2^-8 of the row's largest magnitude) of the row's best
    logits = x.float() @ weight.float().T
    chosen, best = logits.gather(1, predicted[:, None]).squeeze(1), logits.max(dim=1).values
    assert bool((chosen >= best - 2 * 2 ** -8 * logits.abs().max(dim=1).values).all())
    assert float((predicted != ref_pred).float().mean()) < 0.1
