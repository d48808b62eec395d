"""DFlashModel: frozen target, per-document target attention, train/decode parity, no NaN, decoding, metrics."""

import math

import pytest
import torch

from dflash_lab.data import ByteTokenizer, collate_packed, collate_padded
from dflash_lab.metrics.draft_quality import acceptance_length_tau, estimated_acceptance_length
from dflash_lab.model import default_target_layer_ids
from dflash_lab.model.decoding import greedy_generate, measure_acceptance, speculative_generate
from helpers import random_samples as _samples  # tests/ is on sys.path (pytest rootdir-relative import)
from helpers import tiny_dflash_model as _model

torch.set_num_threads(1)
TOK = ByteTokenizer()


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(4, 1) == [2]
    with pytest.raises(ValueError, match="target_layer_ids"):
        default_target_layer_ids(4, 3)


def test_only_the_draft_trains():
    model = _model()
    assert all(not p.requires_grad for p in model.target.parameters())
    draft_ids = {id(p) for p in model.draft.parameters()}
    assert {id(p) for p in model.trainable_parameters()} == draft_ids
    out = model(collate_padded(_samples([20, 12]), [0, 1], [20, 12], 0), torch.Generator().manual_seed(0))
    out.loss.backward()
    assert all(p.grad is None for p in model.target.parameters())
    assert all(p.grad is not None for p in model.draft.parameters())
    model.train()
    assert not model.target.training and model.draft.training


@pytest.mark.integration
def test_packed_row_gives_the_same_target_states_as_separate_documents():
    model = _model()
    samples = _samples([17, 9, 25])
    packed = collate_packed(samples, [0, 1, 2], [17, 9, 25], 0)
    together = model.target_features(packed["input_ids"], packed["position_ids"], packed["doc_ids"])[0]
    start = 0
    for s in samples:
        n = len(s["input_ids"])
        alone = model.target(input_ids=s["input_ids"][None], output_hidden_states=True).hidden_states
        expected = torch.cat([alone[i + 1][0] for i in model.target_layer_ids], dim=-1)
        torch.testing.assert_close(together[start:start + n], expected, atol=1e-5, rtol=1e-4)
        start += n
    padded = collate_padded(samples, [0, 1, 2], [17, 9, 25], 0)
    rows = model.target_features(padded["input_ids"], padded["position_ids"], padded["doc_ids"])
    torch.testing.assert_close(rows[1, :9], together[17:26], atol=1e-5, rtol=1e-4)


@pytest.mark.integration
def test_packed_and_padded_give_the_same_loss_with_every_anchor():
    # Density 1 makes every valid position an anchor: no randomness, so both layouts must agree exactly.
    model = _model(anchors_per_doc=1000, anchor_density=1.0)
    samples = _samples([23, 8, 31], seed=2)
    g = torch.Generator()
    a = model.evaluate(collate_padded(samples, [0, 1, 2], [23, 8, 31], 0), g)
    b = model.evaluate(collate_packed(samples, [0, 1, 2], [23, 8, 31], 0), g)
    torch.testing.assert_close(a.weighted_ce_sum, b.weighted_ce_sum, rtol=1e-5, atol=1e-4)
    assert a.weight_sum == b.weight_sum and a.correct == b.correct and a.count == b.count
    assert torch.equal(a.doc_count, b.doc_count) and torch.equal(a.per_pos_count, b.per_pos_count)


@pytest.mark.integration
def test_training_path_and_decoding_path_give_the_same_block_logits():
    model = _model(block_size=5, anchors_per_doc=1000, anchor_density=1.0)
    samples = _samples([19, 26], seed=4)
    batch = collate_packed(samples, [0, 1], [19, 26], 0)
    blocks, hidden = model.block_hidden(batch, torch.Generator())
    logits = model.lm_head(hidden).view(*blocks.labels.shape, -1)
    checked = 0
    for n in range(blocks.anchors.shape[1]):
        if not blocks.valid[0, n]:
            continue
        row_index = int(blocks.anchors[0, n])
        doc = int(blocks.anchor_doc[0, n])
        doc_start = 0 if doc == 0 else 19
        anchor_pos = row_index - doc_start
        context_ids = samples[doc]["input_ids"][:anchor_pos]
        if anchor_pos == 0:
            continue
        features = model.target_features(context_ids[None], torch.arange(anchor_pos)[None],
                                         torch.zeros(1, anchor_pos, dtype=torch.long))
        decode = model.draft_block_logits(features, int(samples[doc]["input_ids"][anchor_pos]), anchor_pos)
        torch.testing.assert_close(logits[0, n, 1:], decode, atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= 10


@pytest.mark.integration
def test_no_nan_when_blocks_or_rows_have_nothing_to_learn():
    model = _model()
    samples = _samples([20, 6, 14])
    samples[1]["loss_mask"][:] = False          # a document without any anchor
    batch = collate_padded(samples, [0, 1, 2], [20, 6, 14], 0)
    out = model(batch, torch.Generator().manual_seed(0))
    assert torch.isfinite(out.loss) and out.doc_count[1] == 0
    for s in samples:
        s["loss_mask"][:] = False               # a batch with no anchor at all
    out = model(collate_packed(samples, [0, 1, 2], [20, 6, 14], 0), torch.Generator().manual_seed(0))
    assert out.weight_sum == 0 and out.loss == 0 and out.count == 0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.draft.parameters() if p.grad is not None)


@pytest.mark.integration
def test_step_output_counts():
    model = _model(block_size=4)   # fixed_anchors=0: doc counts come from the training anchors
    batch = collate_packed(_samples([30, 40]), [7, 3], [30, 40], 0)
    out = model(batch, torch.Generator().manual_seed(1))
    assert out.per_pos_count.shape == (3,) and out.doc_count.shape == (2,)
    assert out.per_pos_count.sum() == out.count == out.doc_count.sum()
    assert out.per_pos_correct.sum() == out.correct == out.doc_correct.sum()
    torch.testing.assert_close(out.loss, out.weighted_ce_sum / out.weight_sum)
    assert out.weighted_ce_sum.requires_grad and not out.weight_sum.requires_grad


def test_speculative_decoding_reproduces_target_greedy_output():
    model = _model(block_size=4)
    prompt = torch.tensor([1, 5] + TOK.encode("tell me") + [7, 6])
    tokens, accepted = speculative_generate(model, prompt, max_new_tokens=20, stop_token_ids=[])
    assert tokens == greedy_generate(model, prompt, 20, stop_token_ids=[])
    assert len(tokens) == 20 and all(0 <= a <= 3 for a in accepted)
    assert 1 + sum(a + 1 for a in accepted) == 20   # the first token comes from the prefill
    result = measure_acceptance(model, [prompt, prompt[:4]], max_new_tokens=12)
    assert result["tau"] >= 1.0 and result["prompts"] == 2


def test_an_oracle_draft_is_always_fully_accepted():
    # A draft that proposes the target's own greedy continuation must be accepted in full at every step.
    model = _model(block_size=4)
    prompt = torch.tensor([1, 5, 60, 61])
    reference = prompt.tolist() + greedy_generate(model, prompt, 40, stop_token_ids=[])

    def oracle(context_features, anchor_token, anchor_position, block_size=None):
        assert reference[anchor_position] == anchor_token and context_features.shape[1] == anchor_position
        logits = torch.zeros(3, TOK.vocab_size)
        logits[torch.arange(3), torch.tensor(reference[anchor_position + 1: anchor_position + 4])] = 1.0
        return logits

    model.draft_block_logits = oracle
    tokens, accepted = speculative_generate(model, prompt, 25, stop_token_ids=[])
    assert tokens == reference[4:29]
    assert accepted == [3] * 6   # 1 prefill token + 6 steps x 4 tokens = 25
    assert measure_acceptance(model, [prompt], 25, stop_token_ids=[])["tau"] == 4.0


def test_baseline_model_is_the_untrained_draft():
    model = _model()
    with torch.no_grad():
        for p in model.draft.parameters():
            p.add_(1.0)
    base = model.baseline_model()
    fresh = _model().draft
    for a, b in zip(base.draft.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert base.target is model.target


def test_draft_quality_formulas():
    assert estimated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert math.isclose(estimated_acceptance_length([0.5, 0.5, 0.0]), 1.75)
    assert acceptance_length_tau([0, 0]) == 1.0 and math.isnan(acceptance_length_tau([]))


@pytest.mark.integration
def test_chunked_lm_head_gives_the_same_loss_and_gradients():
    batch = collate_packed(_samples([40, 30]), [0, 1], [40, 30], 0)
    whole, chunked = _model(), _model()
    chunked.CE_CHUNK_ELEMENTS = TOK.vocab_size * 7   # 7 slots per chunk
    a = whole(batch, torch.Generator().manual_seed(3))
    b = chunked(batch, torch.Generator().manual_seed(3))
    a.loss.backward()
    b.loss.backward()
    torch.testing.assert_close(a.loss, b.loss)
    assert a.correct == b.correct and torch.equal(a.doc_correct, b.doc_correct)
    for p, q in zip(whole.draft.parameters(), chunked.draft.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4)


def _grads(model):
    return [p.grad.clone() for p in model.draft.parameters()]


@pytest.mark.integration
@pytest.mark.parametrize("chunk_slots", [None, 7])
def test_fused_lm_head_gives_the_reference_loss_and_draft_gradients(chunk_slots):
    # None: the reference keeps the whole logits; 7: both paths chunk (7 slots per chunk)
    batch = collate_packed(_samples([40, 30]), [0, 1], [40, 30], 0)
    outs = []
    for fused in (False, True):
        model = _model()
        model.fused_head_ce = fused
        if chunk_slots:
            model.CE_CHUNK_ELEMENTS = TOK.vocab_size * chunk_slots
        out = model(batch, torch.Generator().manual_seed(3))
        out.loss.backward()
        outs.append((out, _grads(model)))
    (ref, ref_grads), (fused, fused_grads) = outs
    torch.testing.assert_close(fused.loss, ref.loss, rtol=1e-6, atol=0)
    assert fused.correct == ref.correct and torch.equal(fused.per_pos_correct, ref.per_pos_correct)
    for x, y in zip(fused_grads, ref_grads):
        assert float((x - y).norm() / y.norm()) < 1e-5   # fp32 summation order differs between the paths


@pytest.mark.integration
@pytest.mark.parametrize("packed", [False, True])
def test_fast_attention_matches_the_dense_mask_oracle_forward_and_gradients(packed):
    # auto: the target runs flex_attention (packed) or its own causal attention (padded); the draft runs exact
    # per-document attention (CPU training). dense: the full [Q, KV] masks. Same loss, same gradients.
    samples = _samples([37, 9, 52, 20], seed=6)
    collate = collate_packed if packed else collate_padded
    batch = collate(samples, [0, 1, 2, 3], [37, 9, 52, 20], 0)
    outs = []
    for backend in ("dense", "auto"):
        model = _model(anchors_per_doc=6, backend=backend)
        out = model(batch, torch.Generator().manual_seed(4))
        out.loss.backward()
        outs.append((out, _grads(model)))
    (a, grads_a), (b, grads_b) = outs
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    assert a.correct == b.correct and a.count == b.count
    for x, y in zip(grads_a, grads_b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.integration
def test_fixed_anchor_blocks_leave_the_loss_and_gradients_bit_identical():
    batch = collate_packed(_samples([40, 25, 33], seed=8), [11, 4, 9], [40, 25, 33], 0)
    outs = []
    for k in (0, 8):
        model = _model(fixed_anchors=k)
        out = model(batch, torch.Generator().manual_seed(2))
        out.loss.backward()
        outs.append((out, _grads(model)))
    (plain, grads_plain), (fixed, grads_fixed) = outs
    assert torch.equal(plain.loss, fixed.loss) and torch.equal(plain.weighted_ce_sum, fixed.weighted_ce_sum)
    assert all(torch.equal(x, y) for x, y in zip(grads_plain, grads_fixed))
    assert plain.count == fixed.count and torch.equal(plain.per_pos_count, fixed.per_pos_count)
    assert not torch.equal(plain.doc_count, fixed.doc_count)     # doc counts now come from the fixed anchors


@pytest.mark.integration
def test_fixed_anchors_score_each_example_the_same_way_in_any_batch():
    model = _model(fixed_anchors=5)
    samples = _samples([40, 25, 33, 18], seed=9)
    alone = model(collate_padded(samples[1:2], [21], [25], 0), torch.Generator().manual_seed(0))
    packed = model(collate_packed(samples, [20, 21, 22, 23], [40, 25, 33, 18], 0), torch.Generator().manual_seed(7))
    padded = model(collate_padded(samples, [20, 21, 22, 23], [40, 25, 33, 18], 0), torch.Generator().manual_seed(8))
    assert packed.doc_count[1] == padded.doc_count[1] == alone.doc_count[0] >= 5 * 2   # 5 blocks x up to 3 slots
    assert torch.equal(packed.doc_count, padded.doc_count) and torch.equal(packed.doc_correct, padded.doc_correct)
    assert packed.doc_correct[1] == alone.doc_correct[0]
    # evaluate (probes) scores the same fixed blocks, whatever the generator
    ev = model.evaluate(collate_packed(samples, [20, 21, 22, 23], [40, 25, 33, 18], 0), torch.Generator())
    assert torch.equal(ev.doc_count, packed.doc_count) and ev.count == packed.doc_count.sum()
    assert torch.equal(ev.doc_correct, packed.doc_correct) and ev.correct == packed.doc_correct.sum()


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    batch = collate_padded(_samples([30, 22]), [0, 1], [30, 22], 0)
    outs = []
    for checkpointing in (False, True):
        model = _model(checkpointing=checkpointing)
        out = model(batch, torch.Generator().manual_seed(5))
        out.loss.backward()
        outs.append((out.loss, _grads(model)))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(x, y) for x, y in zip(outs[0][1], outs[1][1]))


def test_rms_norm_returns_the_input_dtype():
    from dflash_lab.model.draft import RMSNorm

    norm = RMSNorm(8, 1e-6)
    x = torch.randn(3, 8)
    assert norm(x.bfloat16()).dtype == torch.bfloat16 and norm.weight.dtype == torch.float32
    torch.testing.assert_close(norm(x.bfloat16()).float(), norm(x), atol=2e-2, rtol=2e-2)


def test_documents_must_be_contiguous():
    batch = collate_packed(_samples([10, 12]), [0, 1], [10, 12], 0)
    batch["doc_ids"][0, 3] = 1                                   # document 1 now has two runs
    with pytest.raises(ValueError, match="contiguous"):
        _model()(batch, torch.Generator())


@pytest.mark.integration
def test_the_fixed_anchor_pass_can_be_skipped():
    model = _model(fixed_anchors=4)
    batch = collate_packed(_samples([40, 25]), [0, 1], [40, 25], 0)
    skipped = model(batch, torch.Generator().manual_seed(1), score_fixed=False)
    plain = _model()(batch, torch.Generator().manual_seed(1))
    assert torch.equal(skipped.doc_count, plain.doc_count) and torch.equal(skipped.loss, plain.loss)


@pytest.mark.integration
@pytest.mark.parametrize("packed", [False, True])
def test_the_flex_draft_path_of_the_gpu_matches_the_oracle(packed):
    # on CUDA the draft runs flex_attention; on CPU it can run it without gradients: same scores as the oracle
    samples = _samples([37, 9, 52], seed=3)
    batch = (collate_packed if packed else collate_padded)(samples, [5, 6, 7], [37, 9, 52], 0)
    with torch.no_grad():
        flex = _model(backend="flex", fixed_anchors=3)(batch, torch.Generator().manual_seed(1))
        dense = _model(backend="dense", fixed_anchors=3)(batch, torch.Generator().manual_seed(1))
    torch.testing.assert_close(flex.loss, dense.loss, rtol=1e-5, atol=1e-6)
    assert flex.correct == dense.correct and torch.equal(flex.doc_correct, dense.doc_correct)


# ops that need a value on the host to run on CUDA (the output size or a Python number): each is a host sync
HOST_SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.bincount", "aten.masked_select")


def test_scoring_counts_equal_bincount_and_sync_the_host_only_for_the_supervised_slots():
    """The scores' per-position and per-document counts by scatter-add equal ``torch.bincount`` on the same slots,
    and scoring a step's blocks syncs the host once: the supervised slots' ``nonzero`` (their number sizes the LM
    head's input), where the bincounts and boolean-mask indexing it replaced made six more syncs per call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class SyncOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            bool_index = str(func) == "aten.index.Tensor" and any(
                i is not None and i.dtype == torch.bool for i in args[1])
            if bool_index or str(func).rsplit(".", 1)[0] in HOST_SYNC_OPS:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    model = _model(block_size=4)
    batch = collate_packed(_samples([30, 40, 25]), [7, 3, 5], [30, 40, 25], 0)
    with torch.no_grad():
        blocks, hidden = model.block_hidden(batch, torch.Generator().manual_seed(1))
        with SyncOps() as syncs:
            out = model._score(hidden, blocks, 3)
    assert syncs.ops == ["aten.nonzero.default"], syncs.ops
    row_i, slot_i, k_i = blocks.label_ok.nonzero(as_tuple=True)
    docs = blocks.anchor_doc[row_i, slot_i]
    with torch.no_grad():
        hidden4 = hidden.view(*blocks.labels.shape, -1)
        _, predicted = model._head_ce(hidden4[row_i, slot_i, k_i], blocks.labels[row_i, slot_i, k_i])
    correct = predicted == blocks.labels[row_i, slot_i, k_i]
    assert len(correct) > 0
    assert torch.equal(out.per_pos_count, torch.bincount(k_i - 1, minlength=3))
    assert torch.equal(out.per_pos_correct, torch.bincount(k_i[correct] - 1, minlength=3))
    assert torch.equal(out.doc_count, torch.bincount(docs, minlength=3))
    assert torch.equal(out.doc_correct, torch.bincount(docs[correct], minlength=3))
    # the masked counts on data where the mask matters (an untrained draft is rarely correct)
    from dflash_lab.model.dflash import _counts

    gen = torch.Generator().manual_seed(0)
    index, where = torch.randint(0, 7, (500,), generator=gen), torch.rand(500, generator=gen) < 0.3
    assert torch.equal(_counts(index, 9, where), torch.bincount(index[where], minlength=9))
    assert torch.equal(_counts(index, 9), torch.bincount(index, minlength=9))
