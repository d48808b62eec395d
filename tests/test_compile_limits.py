"""No call sequence of a real run reaches dynamo's recompile limit (``model.compile_layers``).

The first GPU run died at its first tau: every RMSNorm call site shared one compiled function, and training (bf16
autocast, float32 embeddings at layer 0, hidden-size and head-dim norms, an input without grad), the no-grad
passes and the float32 decode needed a 9th graph of it. This test runs that whole sequence on a CPU with every
``torch.compile`` forced to the ``eager`` backend: dynamo traces and guards exactly as it does for inductor (same
guards, same recompile limit, no kernels compiled), so it takes seconds. Then it runs new lengths under
``torch.compiler.set_stance("fail_on_recompile")``: a run compiles once and never again per step.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_lab.data import collate_packed, collate_padded
from dflash_lab.model import attention, decoding, draft
from dflash_lab.model.build import wrap_target

LIMIT_HEADROOM = 4   # graphs per compiled role at most: half of dynamo's default recompile limit (8)


def _clear_compiled_wrappers() -> None:
    for module in (draft, attention):
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
    getattr(draft, "_EAGER_AFTER_LIMIT", set()).clear()
    torch._dynamo.reset()


@pytest.fixture
def eager_compile(monkeypatch):
    """Every torch.compile on the eager backend (guards and limits as with inductor, nothing compiled)."""
    real = torch.compile

    def on_eager(fn=None, **options):
        options = {**options, "backend": "eager"}
        return real(fn, **options) if fn is not None else (lambda f: real(f, **options))

    monkeypatch.setattr(torch, "compile", on_eager)
    _clear_compiled_wrappers()
    yield
    _clear_compiled_wrappers()


def _model():
    # a float32 target (as the tiny target is) read by a 2-layer draft: the first layer's input is the frozen
    # embedding (no grad), q and k norms have other head counts, packed rows run the target under flex
    config = Qwen3Config(hidden_size=48, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=96, vocab_size=264, max_position_embeddings=512,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = wrap_target(Qwen3ForCausalLM(config).eval(), mask_token_id=3, block_size=8, loss_gamma=None,
                        anchors_per_doc=16, anchor_density=None, draft_layers=2, target_layer_ids=None,
                        draft_intermediate_size=64, draft_init_seed=0, draft_init_std=None, fixed_anchors=4,
                        compile_layers=True, activation_checkpointing=False)
    model.stop_token_ids = []
    return model


def _batch(lengths, packed: bool, seed: int):
    generator = torch.Generator().manual_seed(seed)
    samples = [{"input_ids": torch.randint(8, 260, (n,), generator=generator),
                "loss_mask": torch.ones(n, dtype=torch.bool)} for n in lengths]
    return (collate_packed if packed else collate_padded)(samples, list(range(len(lengths))), list(lengths), 0)


def _train_and_evaluate(model, batches) -> None:
    """bf16 autocast training steps (with the fixed-anchor pass) and no-grad probes under autocast."""
    model.train()
    for seed, (lengths, packed) in enumerate(batches):
        batch = _batch(lengths, packed, seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(batch, torch.Generator().manual_seed(seed))
        out.weighted_ce_sum.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.evaluate(batch)


def _tau(model, prompt_lengths) -> None:
    """Tau by decoding and by replay, float32 and without autocast, as evaluation runs them."""
    model.eval()
    prompts = [torch.randint(8, 260, (n,), generator=torch.Generator().manual_seed(n)) for n in prompt_lengths]
    for prompt in prompts:
        decoding.speculative_generate(model, prompt, max_new_tokens=12)
    decoding.replay_acceptance(model, decoding.TargetContinuations.build(model, prompts, max_new_tokens=12))


def test_training_probes_and_tau_stay_within_the_recompile_limit_and_never_recompile_per_length(eager_compile):
    model = _model()
    _train_and_evaluate(model, [([30, 20, 12], False), ([40, 33, 9, 7], False), ([30, 20, 12], True),
                                ([50, 41, 22, 5], True), ([17], False), ([25], True)])
    _tau(model, [10, 17])
    with torch.compiler.set_stance("fail_on_recompile"):   # new lengths, rows, documents: no graph is added
        _train_and_evaluate(model, [([37, 28, 3], False), ([45, 31, 19, 11], True), ([29], False), ([33], True)])
        _tau(model, [13, 23])
    assert not draft._EAGER_AFTER_LIMIT, "a compiled piece fell back to eager at the recompile limit"
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    roles = (draft._hidden_norm, draft._qk_norm_rope, draft._mlp, attention._flex_with_grad,
             attention._flex_no_grad)
    graphs = {role.__name__: len(_debug_get_cache_entry_list(role.__code__)) for role in roles}
    assert graphs["_hidden_norm"] >= 1 and graphs["_mlp"] >= 1, graphs   # the training path did compile
    assert max(graphs.values()) <= LIMIT_HEADROOM, graphs


def test_a_piece_at_the_recompile_limit_runs_eager_with_a_warning(eager_compile):
    """The safety net: a role dynamo refuses to compile again runs eager for the rest of the process."""
    ops = draft.LayerOps(compiled=True)
    weight = torch.ones(8, requires_grad=True)
    x = torch.randn(5, 8)
    # torch's own patch, not monkeypatch: pytest >= 9.2 undoes a module attribute it did not find in the module's
    # __dict__ by deleting it, which hides a torch config entry for the rest of the process
    with torch._dynamo.config.patch(recompile_limit=1):
        ops.rms_norm(torch.randn(5, 8, requires_grad=True), weight, 1e-6)
        with pytest.warns(RuntimeWarning, match="recompile limit"):
            out = ops.rms_norm(x, weight, 1e-6)   # an input without grad: a second graph, over the limit of 1
    assert torch._dynamo.config.recompile_limit == 8
    assert "_hidden_norm" in draft._EAGER_AFTER_LIMIT
    torch.testing.assert_close(out, draft.rms_norm(x, weight, 1e-6))


@pytest.mark.integration
def test_the_cli_trains_probes_and_measures_tau_with_compiled_layers(tmp_path):
    """The real entry point with the draft's pieces compiled by inductor on a CPU: training, probes in between,
    tau during and after training, and no recompile-limit warning (``compile_layers: auto`` compiles on CUDA)."""
    import json

    from helpers import SMALL, train_cli

    result = train_cli(*SMALL, "model.compile_layers=true", "logger=none", f"hydra.run.dir={tmp_path}",
                       "trainer.max_steps=12", "probes.every=6", "trainer.tau_every=6", "trainer.measure_tau=true")
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["tau"] is not None
    assert [json.loads(line)["step"] for line in (tmp_path / "tau.jsonl").read_text().splitlines()] == [6, 12]
    assert len((tmp_path / "probes.jsonl").read_text().splitlines()) > 0
    log = result.stderr + result.stdout + (tmp_path / "train_rank0.log").read_text()
    assert "recompile" not in log.lower(), log[-4000:]
