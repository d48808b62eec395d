"""Compiled draft layers (``compile_layers``): same outputs and gradients as eager, a bounded number of graphs."""

import pytest
import torch

from dflash_lab.model.attention import dynamo_graph_count
from dflash_lab.model.draft import DFlashDraft, DraftConfig, layer_ops

torch.set_num_threads(1)
CFG = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
           target_layer_ids=[1, 2], target_hidden_size=24)


def _inputs(rows, context_len, block_len, seed):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, context_len, 2 * 24, generator=g)
    embeds = torch.randn(rows, block_len, 32, generator=g)   # the target's frozen embeddings: no grad
    context_positions = torch.arange(context_len).expand(rows, -1)
    block_positions = context_len + torch.arange(block_len).expand(rows, -1)
    return features, context_positions, embeds, block_positions


def _step(draft, inputs):
    features, context_positions, embeds, block_positions = inputs
    draft.zero_grad()
    out = draft(draft.project_context(features), context_positions, embeds, block_positions, None)
    (out.square() * torch.linspace(0, 1, out.shape[-1])).sum().backward()
    return out.detach(), [p.grad.clone() for p in draft.parameters()]


def test_compile_layers_setting():
    assert not layer_ops("auto", torch.device("cpu")).compiled and layer_ops("auto", torch.device("cuda")).compiled
    assert layer_ops(True, torch.device("cpu")).compiled and not layer_ops(False, torch.device("cuda")).compiled
    with pytest.raises(ValueError, match="compile_layers"):
        DFlashDraft(DraftConfig(**CFG), compile_layers="yes")


@pytest.mark.integration
def test_compiled_layers_match_eager_and_do_not_recompile_per_length():
    eager = DFlashDraft(DraftConfig(**CFG), init_seed=1, compile_layers=False)
    compiled = DFlashDraft(DraftConfig(**CFG), init_seed=1, compile_layers=True)
    for rows, context_len, block_len, seed in ((3, 20, 8, 0), (3, 37, 16, 1)):
        inputs = _inputs(rows, context_len, block_len, seed)
        before = dynamo_graph_count()
        out_eager, grads_eager = _step(eager, inputs)
        out_compiled, grads_compiled = _step(compiled, inputs)
        if seed == 1:   # another length: the token dimensions are dynamic from the first graph on
            assert dynamo_graph_count() - before <= 1
        torch.testing.assert_close(out_compiled, out_eager, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads_compiled, grads_eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
