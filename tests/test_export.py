"""Draft export: the reference layout (names, config fields), a round trip that reproduces the draft's logits
through an independent implementation of the reference draft's forward, and the MASK id rule."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from dflash_lab.records.checkpoint import CheckpointManager
from dflash_lab.export import export_draft, main
from dflash_lab.model.build import draft_config_for_target, resolve_mask_token_id, target_config_only
from dflash_lab.model.draft import DFlashDraft

torch.set_num_threads(1)
MODEL_CFG = {"kind": "tiny", "hidden_size": 32, "num_layers": 6, "num_heads": 4, "num_kv_heads": 2,
             "intermediate_size": 48, "max_position_embeddings": 2048, "block_size": 4, "draft_layers": 2,
             "target_layer_ids": None, "draft_intermediate_size": 40, "draft_init_seed": "${seed}"}


@pytest.fixture
def run_dir(tmp_path):
    """A run directory as training leaves it: .hydra/config.yaml and a checkpoint of a (perturbed) draft."""
    target_config = target_config_only(**MODEL_CFG)
    draft = DFlashDraft(draft_config_for_target(target_config, draft_layers=2, target_layer_ids=None,
                                                draft_intermediate_size=40),
                        init_seed=3)
    with torch.no_grad():  # norms away from 1 so that a misplaced norm weight shows in the logits
        for name, param in draft.named_parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create({"seed": 5, "model": MODEL_CFG, "run_dir": "${hydra:runtime.output_dir}"}),
                   tmp_path / ".hydra" / "config.yaml")
    CheckpointManager(tmp_path / "checkpoints").save({"model": draft.state_dict(), "step": 7}, step=7)
    return tmp_path, draft


class ReferenceDraft(nn.Module):
    """The reference draft's forward written from its description (Qwen3 decoder layers whose keys/values are
    [projected context ; block], queries from the block, no mask at inference), with the reference's module names."""

    def __init__(self, config):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

        super().__init__()
        self.config = config
        d = config.head_dim

        def layer():
            module = nn.Module()
            attn = nn.Module()
            attn.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * d, bias=False)
            attn.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=False)
            attn.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=False)
            attn.o_proj = nn.Linear(config.num_attention_heads * d, config.hidden_size, bias=False)
            attn.q_norm, attn.k_norm = Qwen3RMSNorm(d, config.rms_norm_eps), Qwen3RMSNorm(d, config.rms_norm_eps)
            module.self_attn, module.mlp = attn, Qwen3MLP(config)
            module.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
            module.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
            return module

        self.layers = nn.ModuleList(layer() for _ in range(config.num_hidden_layers))
        ids = config.dflash_config["target_layer_ids"]
        self.fc = nn.Linear(len(ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)

    def forward(self, target_hidden, noise_embedding, position_ids):
        from transformers.models.qwen3.modeling_qwen3 import rotate_half

        d, x = self.config.head_dim, noise_embedding
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(x, position_ids)
        q_len, rows = x.shape[1], x.shape[0]
        for layer in self.layers:
            attn, h = layer.self_attn, layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(rows, q_len, -1, d)).transpose(1, 2)
            kv_heads = attn.k_proj.out_features // d
            k = torch.cat([attn.k_proj(context), attn.k_proj(h)], 1).view(rows, -1, kv_heads, d)
            k = attn.k_norm(k).transpose(1, 2)
            v = torch.cat([attn.v_proj(context), attn.v_proj(h)], 1).view(rows, -1, kv_heads, d).transpose(1, 2)
            q = q * cos[:, None, -q_len:] + rotate_half(q) * sin[:, None, -q_len:]
            k = k * cos[:, None] + rotate_half(k) * sin[:, None]
            out = F.scaled_dot_product_attention(q, k, v, scale=d**-0.5, enable_gqa=True)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(rows, q_len, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def test_export_round_trip_reproduces_the_draft_logits(run_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    run, draft = run_dir
    out = export_draft(run, tmp_path / "export", dtype="float32")
    config = Qwen3Config.from_pretrained(out)
    assert config.architectures == ["DFlashDraftModel"] and config.block_size == 4
    assert config.dflash_config == {"mask_token_id": 3, "target_layer_ids": [1, 3]}   # tiny: the <mask> id
    assert (config.num_hidden_layers, config.num_target_layers, config.intermediate_size) == (2, 6, 40)
    reference = ReferenceDraft(config)
    reference.load_state_dict(load_file(out / "model.safetensors"))   # strict: every name and shape matches

    gen = torch.Generator().manual_seed(0)
    context_len, bs, hidden, vocab = 9, 4, 32, 50
    features = torch.randn(1, context_len, 2 * hidden, generator=gen)
    block = torch.randn(1, bs, hidden, generator=gen)
    head = torch.randn(vocab, hidden, generator=gen)
    positions = torch.arange(context_len + bs)[None]
    ours = draft(draft.project_context(features), positions[:, :context_len], block, positions[:, context_len:], None)
    theirs = reference(features, block, positions)
    torch.testing.assert_close(theirs @ head.T, ours @ head.T, rtol=1e-4, atol=1e-4)


def test_export_cli_bf16_and_missing_checkpoint(run_dir, tmp_path, capsys):
    run, draft = run_dir
    main([str(run), str(tmp_path / "bf16")])
    assert "model.safetensors" in capsys.readouterr().out
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["block_size"] == 4
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "bf16" / "model.safetensors")
    assert weights["layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["fc.weight"], draft.fc.weight.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="holds no checkpoint"):
        export_draft(tmp_path / "bf16", tmp_path / "nothing")


# ---- issue 31: what export says, its file mode, and its refusals (defect 3: one line each, naming what is wrong) ---
def test_export_names_the_checkpoint_step_and_the_run_status(run_dir, tmp_path, capsys):
    run, _ = run_dir
    (run / "summary.json").write_text(json.dumps({"status": "running", "steps": 9}))
    main([str(run), str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {tmp_path / 'out' / 'model.safetensors'} and ")
    assert ("the draft of step 7 (step_7.pt); the run's status: running at step 9 (an unfinished run: these are "
            "not its final weights)") in printed
    (run / "summary.json").write_text(json.dumps({"status": "finished", "steps": 12}))
    main([str(run), str(tmp_path / "out")])
    assert "status: finished at step 12 (this checkpoint is 5 steps before its end)" in capsys.readouterr().out


def test_the_weights_file_mode_follows_the_umask(run_dir, tmp_path):
    import os

    run, _ = run_dir
    previous = os.umask(0o022)
    try:
        out = export_draft(run, tmp_path / "out")
    finally:
        os.umask(previous)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (out / "config.json").stat().st_mode & 0o777 == 0o644


def test_export_help_names_the_run_config_record(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "run_config.json" in text and ".hydra/config.yaml" not in text


@pytest.mark.parametrize("case", ["missing directory", "no checkpoints", "not a run directory"])
def test_export_refusals_are_one_line(run_dir, tmp_path, capsys, monkeypatch, case):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    run, _ = run_dir
    if case == "missing directory":
        target, expected = tmp_path / "nowhere", f"{tmp_path / 'nowhere'}: no such directory"
    elif case == "no checkpoints":
        import shutil

        shutil.rmtree(run / "checkpoints")
        (run / "summary.json").write_text(json.dumps({"status": "failed", "steps": 0}))
        target, expected = run, f"{run} is a run directory without checkpoints: {run / 'checkpoints'} holds no"
    else:
        target = tmp_path / "empty"
        target.mkdir()
        expected = f"{target} is not a run directory (no checkpoints/, summary.json or run_config.json)"
    with pytest.raises(SystemExit) as stopped:
        main([str(target), str(tmp_path / "out")])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("dflash_lab.export: error: ") and expected in lines[0], lines
    assert lines[1] == "(HYDRA_FULL_ERROR=1 shows the traceback)"
    assert not (tmp_path / "out").exists()


def test_mask_token_id_is_added_past_the_vocabulary():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "a": 2, "b": 3}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                        pad_token="<pad>", unk_token="<unk>")
    assert resolve_mask_token_id(tokenizer, None, embedding_rows=8) == 4          # len(tokenizer), a padded row
    assert resolve_mask_token_id(tokenizer, 0, embedding_rows=4) == 0             # configured otherwise
    with pytest.raises(ValueError, match="model.mask_token_id"):
        resolve_mask_token_id(tokenizer, None, embedding_rows=4)                  # no row for an added id
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    assert resolve_mask_token_id(tokenizer, None, embedding_rows=5) == 4          # the tokenizer's own mask token


# ---- issue 43: an OUT_DIR a file stands in (defect 3), a --checkpoint that is not one (defect 4): one line each ----
def _refusal(capsys, argv) -> str:
    """The one line ``main(argv)`` refuses with (exit code 2, no traceback)."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("dflash_lab.export: error: "), lines
    assert lines[1] == "(HYDRA_FULL_ERROR=1 shows the traceback)"
    return lines[0]


def test_an_out_dir_that_is_a_file_is_one_line_naming_it_and_left_as_it_was(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    run, _ = run_dir
    taken = tmp_path / "notes.txt"
    taken.write_text("keep me\n")
    line = _refusal(capsys, [str(run), str(taken)])
    assert f"OUT_DIR {taken} is an existing file, not a directory: model.safetensors and config.json go into a " \
           f"directory" in line
    line = _refusal(capsys, [str(run), str(taken / "export")])
    assert f"OUT_DIR {taken / 'export'}: its parent {taken} is an existing file, not a directory" in line
    assert taken.read_text() == "keep me\n"


@pytest.mark.parametrize("damage", ["truncated", "not torch's format", "empty", "zeros", "no draft weights"])
def test_a_checkpoint_that_cannot_be_read_is_one_line_naming_the_newest_intact_one(run_dir, tmp_path, capsys,
                                                                                  monkeypatch, damage):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    run, _ = run_dir
    good = run / "checkpoints" / "step_7.pt"
    bad = run / "checkpoints" / "step_9.pt"   # the run's newest file, torn: step 7 is its newest intact one
    bad.write_bytes({"truncated": good.read_bytes()[: good.stat().st_size // 2], "not torch's format": b"garbage\n",
                     "empty": b"", "zeros": bytes(5000)}.get(damage, b""))
    if damage == "no draft weights":
        torch.save({"step": 9}, bad)
    line = _refusal(capsys, [str(run), str(tmp_path / "out"), "--checkpoint", str(bad)])
    assert line.startswith(f"dflash_lab.export: error: --checkpoint {bad} is not a readable checkpoint (")
    assert line.endswith(f"): the newest intact one is {good} (step 7): pass --checkpoint {good}, or leave out "
                         f"--checkpoint to export it")
    if damage == "no draft weights":
        assert "(it holds no draft weights)" in line
    assert not (tmp_path / "out").exists()
    good.write_bytes(b"")   # nothing intact left to name
    line = _refusal(capsys, [str(run), str(tmp_path / "out"), "--checkpoint", str(bad)])
    assert line.endswith(f"{run / 'checkpoints'} holds no intact checkpoint either; restore the file, or train the "
                         f"run again")


def test_the_export_of_an_untrained_draft_says_it_is_untrained(run_dir, tmp_path, capsys):
    """A run with trainer.max_steps=0 saves its initial draft as the checkpoint of step 0 and a finished summary of
    step 0: its export says the draft is untrained and how to train it."""
    run, draft = run_dir
    manager = CheckpointManager(run / "checkpoints")
    for _, path in manager.step_files():
        path.unlink()
    manager.save({"model": draft.state_dict(), "step": 0}, step=0)
    (run / "summary.json").write_text(json.dumps({"status": "finished", "steps": 0}))
    main([str(run), str(tmp_path / "out")])
    assert capsys.readouterr().out == (
        f"wrote {tmp_path / 'out' / 'model.safetensors'} and {tmp_path / 'out' / 'config.json'}: the draft of step 0 "
        f"(step_0.pt), UNTRAINED: its initial weights, no optimizer step ran (trainer.max_steps=0 trains none); train "
        f"the run (trainer.max_steps=N or null, same hydra.run.dir) and export it again; the run's status: finished "
        f"at step 0\n")
