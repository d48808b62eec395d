"""Key intervals, flex BlockMasks and the per-document path against the dense-mask oracle (dflash_lab.model.attention).

Layouts are random (hypothesis): rows of several documents with padding (packed) or one document per row
(padded), random supervision and anchors, GQA (4 query heads on 2 key/value heads).
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from dflash_lab.data import collate_packed
from dflash_lab.model.attention import (
    KeyIntervals, causal_document_intervals, dense_attend, flex_attend, flex_compile_count, flex_supported,
    segments_attend,
)
from dflash_lab.model.dflash import document_attention_mask
from dflash_lab.model.objective import build_blocks, draft_key_intervals, sample_anchors

torch.set_num_threads(1)
HEADS, KV_HEADS, DIM = 4, 2, 8
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw):
    """(doc_ids [R, T], loss_mask [R, T], number of documents, anchor seed, block size)."""
    packed = draw(st.booleans())
    rows = draw(st.integers(1, 3))
    row_docs = [draw(st.lists(st.integers(1, 90), min_size=1, max_size=5 if packed else 1)) for _ in range(rows)]
    pads = [draw(st.integers(0, 40)) for _ in range(rows)]
    width = max(sum(docs) + pad for docs, pad in zip(row_docs, pads))
    doc_ids = torch.full((rows, width), -1, dtype=torch.long)
    doc = 0
    for r, docs in enumerate(row_docs):
        start = 0
        for length in docs:
            doc_ids[r, start:start + length] = doc
            start, doc = start + length, doc + 1
    seed = draw(st.integers(0, 2**16))
    loss_mask = (torch.rand(doc_ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.8) & (doc_ids >= 0)
    return doc_ids, loss_mask, doc, seed, draw(st.sampled_from([2, 4, 8]))


def _draft_intervals(doc_ids, loss_mask, num_docs, seed, bs):
    anchors, valid, anchor_doc = sample_anchors(loss_mask, doc_ids, torch.Generator().manual_seed(seed), 6, None,
                                                num_docs)
    positions = torch.zeros_like(doc_ids)
    blocks = build_blocks(doc_ids.clamp(min=0), loss_mask, positions, doc_ids, anchors, valid, anchor_doc,
                          block_size=bs, mask_token_id=1, gamma=None)
    return draft_key_intervals(blocks, doc_ids.shape[1]), anchors, valid, anchor_doc


def _old_draft_mask(doc_ids, anchors, valid, anchor_doc, bs):
    """The draft mask as first written (dense, from document ids): the independent oracle."""
    length, slots = doc_ids.shape[1], anchors.shape[1]
    key = torch.arange(length)
    context = (doc_ids[:, None, :] == anchor_doc[:, :, None]) & (key < anchors[:, :, None]) & valid[:, :, None]
    block_of = torch.arange(slots * bs) // bs
    own = (block_of[:, None] == block_of[None, :]).expand(doc_ids.shape[0], -1, -1)
    return torch.cat([context.repeat_interleave(bs, dim=1), own], dim=2)[:, None]


def _qkv(rows, q_len, kv_len, seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    tensors = (torch.randn(rows, HEADS, q_len, DIM, generator=g), torch.randn(rows, KV_HEADS, kv_len, DIM, generator=g),
               torch.randn(rows, KV_HEADS, kv_len, DIM, generator=g))
    return tuple(t.requires_grad_(grad) for t in tensors)


def _tile_grid(block_mask, full: bool):
    num = block_mask.full_kv_num_blocks if full else block_mask.kv_num_blocks
    idx = block_mask.full_kv_indices if full else block_mask.kv_indices
    q_tiles, kv_tiles = idx.shape[-2], idx.shape[-1]
    grid = torch.zeros(q_tiles, kv_tiles, dtype=torch.bool)
    for i in range(q_tiles):
        grid[i, idx[0, 0, i, : num[0, 0, i]].long()] = True
    return grid


def _flat_dense(intervals: KeyIntervals, q_pad: int, kv_pad: int) -> torch.Tensor:
    """The oracle on the rows laid end to end (what the BlockMask encodes)."""
    rows, q_len, kv_len = intervals.rows, intervals.q_len, intervals.kv_len
    flat = torch.zeros(q_pad, kv_pad, dtype=torch.bool)
    dense = intervals.dense()[:, 0]
    for r in range(rows):
        flat[r * q_len:(r + 1) * q_len, r * kv_len:(r + 1) * kv_len] = dense[r]
    return flat


@SETTINGS
@given(layouts())
def test_intervals_equal_the_dense_document_masks(layout):
    doc_ids, loss_mask, num_docs, seed, bs = layout
    assert torch.equal(causal_document_intervals(doc_ids).dense(), document_attention_mask(doc_ids))
    intervals, anchors, valid, anchor_doc = _draft_intervals(doc_ids, loss_mask, num_docs, seed, bs)
    assert torch.equal(intervals.dense(), _old_draft_mask(doc_ids, anchors, valid, anchor_doc, bs))


@SETTINGS
@given(layouts())
def test_block_mask_tiles_are_exact(layout):
    # a tile is listed iff some query sees some key in it; "full" iff every real query sees every key in it
    doc_ids, loss_mask, num_docs, seed, bs = layout
    for intervals in (causal_document_intervals(doc_ids), _draft_intervals(doc_ids, loss_mask, num_docs, seed, bs)[0]):
        block_mask = intervals.block_mask()
        q_pad, kv_pad = block_mask.seq_lengths
        tile = block_mask.BLOCK_SIZE[0]
        assert q_pad % tile == 0 and kv_pad % tile == 0 and min(q_pad, kv_pad) >= 2 * tile
        dense = _flat_dense(intervals, q_pad, kv_pad)
        tiles = dense.view(q_pad // tile, tile, kv_pad // tile, tile)
        real = (torch.arange(q_pad) < intervals.rows * intervals.q_len).view(-1, tile)
        partial, full = _tile_grid(block_mask, False), _tile_grid(block_mask, True)
        assert not (partial & full).any()
        assert torch.equal(partial | full, tiles.any(dim=(1, 3)))
        every = (tiles | ~real[:, :, None, None]).all(dim=(1, 3)) & real.any(dim=1)[:, None]
        assert torch.equal(full, every)


@pytest.mark.integration
@SETTINGS
@given(layouts())
def test_flex_attention_equals_the_dense_oracle(layout):
    doc_ids, loss_mask, num_docs, seed, bs = layout
    for intervals in (causal_document_intervals(doc_ids), _draft_intervals(doc_ids, loss_mask, num_docs, seed, bs)[0]):
        q, k, v = _qkv(intervals.rows, intervals.q_len, intervals.kv_len, seed)
        expected = dense_attend(q, k, v, intervals.dense(), 0.3)
        torch.testing.assert_close(flex_attend(q, k, v, intervals.block_mask(), 0.3), expected, atol=2e-5, rtol=1e-4)


@SETTINGS
@given(layouts())
def test_per_document_attention_equals_the_dense_oracle_forward_and_gradients(layout):
    doc_ids, loss_mask, num_docs, seed, bs = layout
    intervals = _draft_intervals(doc_ids, loss_mask, num_docs, seed, bs)[0]
    outputs, grads = [], []
    for attend_with in (lambda q, k, v: dense_attend(q, k, v, intervals.dense(), 0.3),
                        lambda q, k, v: segments_attend(q, k, v, intervals, 0.3)):
        q, k, v = _qkv(intervals.rows, intervals.q_len, intervals.kv_len, seed, grad=True)
        out = attend_with(q, k, v)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        outputs.append(out.detach())
        grads.append([q.grad, k.grad, v.grad])
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-5, rtol=1e-4)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def _qkv_shaped(rows, q_len, kv_len, heads, kv_heads, dim, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shapes = ((rows, heads, q_len, dim), (rows, kv_heads, kv_len, dim), (rows, kv_heads, kv_len, dim))
    return tuple(torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for shape in shapes)


def _attend_with_grads(attend, q, k, v):
    """Output and q/k/v gradients of ``attend`` under a fixed non-uniform loss."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    weights = torch.linspace(-1, 1, out.shape[-1], device=out.device, dtype=torch.float32)
    (out.float() * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _relative_error(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


# The draft's real shape class (Qwen3-8B's heads): 32 query heads on 8 key/value heads of width 128, bf16.
REAL_HEADS, REAL_KV_HEADS, REAL_DIM = 32, 8, 128


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention has a backward on CUDA only")
def test_flex_gradients_equal_the_dense_oracle_on_cuda():
    """The compiled CUDA flex kernel, forward and backward, at the draft's shape class (head dim 128, bf16, 32 query
    / 8 KV heads; CUDA flex needs head dim >= 16), on a packed row of three documents with padding and on a padded
    batch of two rows. Reference: the dense-mask SDPA in float32 on the same bf16 values (float32 leaves, so its
    gradients are not rounded). bf16 tolerance, as torch's own flex tests judge a compiled kernel: flex's relative
    error (norm) against the reference at most twice the bf16 dense SDPA's own for the output and four times for
    the gradients (long bf16 reductions over queries), plus 1e-3, and never above 2%."""
    packed = torch.tensor([[0] * 150 + [1] * 90 + [2] * 200 + [-1] * 30])
    padded = torch.tensor([[0] * 300 + [-1] * 20, [1] * 320])
    for doc_ids, num_docs in ((packed, 3), (padded, 2)):
        intervals = _draft_intervals(doc_ids, doc_ids >= 0, num_docs, 0, 16)[0]
        cuda = KeyIntervals(*(t.cuda() for t in (intervals.lo, intervals.hi, intervals.own_lo, intervals.own_hi)),
                            kv_len=intervals.kv_len)
        scale = REAL_DIM ** -0.5
        q, k, v = _qkv_shaped(intervals.rows, intervals.q_len, intervals.kv_len, REAL_HEADS, REAL_KV_HEADS, REAL_DIM,
                              torch.bfloat16, 1, "cuda")
        reference = _attend_with_grads(lambda *x, c=cuda, s=scale: dense_attend(*x, c.dense(), s), q.float(), k.float(),
                                       v.float())
        dense_bf16 = _attend_with_grads(lambda *x, c=cuda, s=scale: dense_attend(*x, c.dense(), s), q, k, v)
        flex = _attend_with_grads(lambda *x, c=cuda, s=scale: flex_attend(*x, c.block_mask(), s), q, k, v)
        for name, factor, got, bf16, want in zip(("out", "dq", "dk", "dv"), (2, 4, 4, 4), flex, dense_bf16,
                                                 reference):
            assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
            error, bf16_error = _relative_error(got, want), _relative_error(bf16, want)
            assert error <= min(factor * bf16_error + 1e-3, 2e-2), (name, error, bf16_error)


def test_block_mask_gradients_equal_the_dense_oracle_through_the_flex_operator_on_cpu(monkeypatch):
    """The project's flex path (``flex_attend``: rows laid end to end, padding to whole tiles, native GQA, the
    BlockMask's ``mask_mod`` over the flattened bounds, the output cut back to rows) with gradients, on a CPU.

    torch's ``flex_attention`` has no CPU backward when compiled; its higher-order operator, called directly (not
    compiled), runs the eager reference implementation with autograd, in float64 here. So this test proves that the
    BlockMask's ``mask_mod`` and the layout around it give the dense oracle's output and q/k/v gradients (packed rows
    with padding, padded batches, GQA). It does not prove the tile lists (``kv_indices``, ``full_kv_indices``: the
    eager operator evaluates ``mask_mod`` on every query-key pair and ignores them; test_block_mask_tiles_are_exact
    checks them), nor the compiled kernel's numerics (test_flex_gradients_equal_the_dense_oracle_on_cuda)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_operator
    from torch.nn.attention import flex_attention as flex_module

    from dflash_lab.model import attention

    def eager_flex(query, key, value, block_mask, scale, enable_gqa):
        assert enable_gqa == (query.shape[1] != key.shape[1])
        options = flex_module._apply_kernel_options(query, key, value, False, None)
        return flex_operator(query, key, value, flex_module._identity, block_mask.as_tuple(), scale, options)[0]

    monkeypatch.setattr(attention, "_compiled_flex", lambda with_grad: eager_flex)
    layouts_checked = 0
    for doc_ids, num_docs, bs in ((torch.tensor([[0] * 150 + [1] * 90 + [2] * 200 + [-1] * 30]), 3, 8),
                                  (torch.tensor([[0] * 60 + [-1] * 25, [1] * 85, [2] * 10 + [-1] * 75]), 3, 4)):
        for intervals in (causal_document_intervals(doc_ids),
                          _draft_intervals(doc_ids, doc_ids >= 0, num_docs, 5, bs)[0]):
            q, k, v = _qkv_shaped(intervals.rows, intervals.q_len, intervals.kv_len, HEADS, KV_HEADS, 16,
                                  torch.float64, 2)
            want = _attend_with_grads(lambda *x, i=intervals: dense_attend(*x, i.dense(), 0.3), q, k, v)
            got = _attend_with_grads(lambda *x, i=intervals: flex_attend(*x, i.block_mask(), 0.3), q, k, v)
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)
            layouts_checked += 1
    assert layouts_checked == 4


def test_flex_compile_count_counts_flex_graphs_only():
    """Other compiled code (here a tiny function on the eager backend) leaves the flex count unchanged."""
    from dflash_lab.model.attention import dynamo_graph_count

    flex_before, all_before = flex_compile_count(), dynamo_graph_count()
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    assert dynamo_graph_count() > all_before and flex_compile_count() == flex_before


def test_flex_runs_on_cpu_only_without_gradients():
    x = torch.zeros(1, requires_grad=True)
    assert not flex_supported(x)
    with torch.no_grad():
        assert flex_supported(x)


@pytest.mark.integration
def test_varying_shapes_compile_at_most_two_graphs():
    # batch 1 and whole tiles: one static graph, then one with dynamic lengths, then no recompilation
    before = None
    for length in (300, 700, 1000, 129, 2000, 450):
        doc_ids = (torch.arange(length) // 97)[None]
        intervals = causal_document_intervals(doc_ids)
        q, k, v = _qkv(1, length, length, length)
        flex_attend(q, k, v, intervals.block_mask(), 0.3)
        if before is None:
            before = flex_compile_count()
    assert flex_compile_count() - before <= 1


def _largest_allocation(step) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return max(e.cpu_memory_usage for e in prof.events())


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["auto", "dense"])
def test_a_packed_training_step_allocates_nothing_of_size_t_by_t(backend):
    # the dense oracle does allocate T x T (the control); the default path allocates far less
    from helpers import random_samples as _samples
    from helpers import tiny_dflash_model as _model

    lengths = [128] * 16
    batch = collate_packed(_samples(lengths), list(range(16)), lengths, 0)
    length = batch["input_ids"].shape[1]
    model = _model(block_size=4, anchors_per_doc=16, fixed_anchors=4, backend=backend)
    model(batch, torch.Generator().manual_seed(0)).loss.backward()   # compile outside the profiler

    def step():
        model(batch, torch.Generator().manual_seed(0)).loss.backward()

    largest = _largest_allocation(step)
    if backend == "auto":
        assert largest < length * length // 4, largest     # a bool T x T mask would be length ** 2 bytes
    else:
        assert largest >= length * length
