"""Export a trained draft for the public DFlash inference code: ``python -m dflash_lab.export RUN_DIR OUT_DIR``.

Writes ``OUT_DIR/model.safetensors`` and ``OUT_DIR/config.json`` in the layout of the reference's
``DFlashDraftModel`` (a ``Qwen3PreTrainedModel``), so ``DFlashDraftModel.from_pretrained(OUT_DIR)`` loads it:

    config.json        a Qwen3 config of the draft: hidden size, heads, head_dim, RMSNorm eps and RoPE base of the
                       target, ``num_hidden_layers`` = draft layers, ``intermediate_size`` of the draft, the target's
                       ``vocab_size`` and ``max_position_embeddings``; plus ``architectures: [DFlashDraftModel]``,
                       ``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``
                       (the reference reads both from ``dflash_config``; ``block_size`` also at the top level).
    model.safetensors  fc.weight, hidden_norm.weight, norm.weight and per layer i
                       layers.i.{input_layernorm,post_attention_layernorm}.weight,
                       layers.i.self_attn.{q,k,v,o}_proj.weight, layers.i.self_attn.{q,k}_norm.weight,
                       layers.i.mlp.{gate,up,down}_proj.weight (our layers hold the MLP projections directly).

The draft has no embedding and no LM head: at inference the reference reads the target's embedding rows (the
MASK id included: an id past the tokenizer's vocabulary that has a row in the target's padded embedding, see
``dflash_lab.model.build.resolve_mask_token_id``) and the target's LM head, as training does.

Sources: the newest checkpoint of ``RUN_DIR/checkpoints`` (``CheckpointManager.load_latest`` of
``dflash_lab.records.checkpoint``; ``--checkpoint PATH`` for another one) and the model config of
the checkpoint's own config (else the run's ``run_config.json``, or ``.hydra/config.yaml`` of an older run; the
target's shape from its config.json or the tiny keys: no target weights).

Cost: one checkpoint load and one safetensors write (the draft's size).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Mapping

import torch

from dflash_lab.model.draft import DFlashDraft, DraftConfig

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_MLP = ("gate_proj", "up_proj", "down_proj")


def reference_state_dict(draft_state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict:
    """Our draft's state dict under the reference's parameter names, contiguous, in ``dtype``.

    Example:
        >>> sd = {"layers.0.gate_proj.weight": torch.ones(2, 2), "fc.weight": torch.ones(2, 4)}
        >>> sorted(reference_state_dict(sd))
        ['fc.weight', 'layers.0.mlp.gate_proj.weight']
    """
    out = {}
    for name, tensor in draft_state.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "layers" and parts[2] in _MLP:
            name = ".".join([*parts[:2], "mlp", *parts[2:]])
        out[name] = tensor.detach().to(dtype=dtype).contiguous()
    return out


def reference_config(draft_cfg: DraftConfig, target_config: Any, *, block_size: int, mask_token_id: int,
                     dtype: str = "bfloat16") -> dict:
    """config.json of the draft for the reference's ``DFlashDraftModel`` (module docstring).

    Example:
        >>> from transformers import Qwen3Config
        >>> draft = DraftConfig(64, 1, 4, 2, 16, 128, target_layer_ids=[2])
        >>> reference_config(draft, Qwen3Config(hidden_size=64), block_size=16, mask_token_id=3)["dflash_config"]
        {'mask_token_id': 3, 'target_layer_ids': [2]}
    """
    from transformers import Qwen3Config

    target_hidden = draft_cfg.target_hidden_size or draft_cfg.hidden_size
    if target_hidden != draft_cfg.hidden_size:
        raise ValueError(f"the reference's fc reads len(target_layer_ids) x hidden_size features: a target hidden "
                         f"size {target_hidden} != draft hidden size {draft_cfg.hidden_size} cannot be exported")
    config = Qwen3Config(
        hidden_size=draft_cfg.hidden_size,
        intermediate_size=draft_cfg.intermediate_size,
        num_hidden_layers=draft_cfg.num_layers,
        num_attention_heads=draft_cfg.num_heads,
        num_key_value_heads=draft_cfg.num_kv_heads,
        head_dim=draft_cfg.head_dim,
        rms_norm_eps=draft_cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": draft_cfg.rope_theta},
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
        attention_bias=False,
        tie_word_embeddings=False,
        architectures=["DFlashDraftModel"],
        block_size=int(block_size),
        num_target_layers=int(target_config.num_hidden_layers),
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": list(draft_cfg.target_layer_ids)},
        dtype=dtype,
    )
    return config.to_dict()


def run_model_config(run_dir: Path, checkpoint: Mapping[str, Any]) -> dict:
    """The run's ``model`` config: the checkpoint's own (the config its weights were trained with), else the run's
    config record (``run_config.json``; ``.hydra/config.yaml`` for a run recorded before it)."""
    from omegaconf import OmegaConf

    from dflash_lab.records.record import read_run_config

    if "model" in (checkpoint.get("config") or {}):
        return dict(checkpoint["config"]["model"])
    recorded = read_run_config(run_dir)
    if "model" in recorded.config:
        return OmegaConf.to_container(OmegaConf.create(recorded.config).model, resolve=True)
    raise ValueError(f"{run_dir}: neither a config in the checkpoint nor a model section in run_config.json or "
                     f".hydra/config.yaml: not a run directory")


def run_mask_token_id(model_cfg: Mapping[str, Any], target_config: Any) -> int:
    """The MASK id the run trained with (``dflash_lab.model.build``'s rule), from the tokenizer files alone.

    Example:
        >>> run_mask_token_id({"kind": "tiny"}, None)   # the byte tokenizer's <mask>
        3
    """
    from dflash_lab.data.tokenizer import ByteTokenizer
    from dflash_lab.model.build import resolve_mask_token_id

    if model_cfg["kind"] == "tiny":
        return ByteTokenizer.mask_token_id
    configured = model_cfg.get("mask_token_id")
    if configured is None and not model_cfg.get("target_path"):
        raise ValueError("model.mask_token_id is null and the run has no model.target_path to read the tokenizer "
                         "from: pass --mask-token-id")
    tokenizer = None
    if configured is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_cfg["target_path"])
    return resolve_mask_token_id(tokenizer, configured, int(target_config.vocab_size))


def export_draft(run_dir: str | Path, out_dir: str | Path, *, checkpoint: str | Path | None = None,
                 dtype: str = "bfloat16", mask_token_id: int | None = None) -> Path:
    """Write OUT_DIR/model.safetensors + config.json from a run directory (module docstring).

    Args:
        run_dir: a training run directory (``checkpoints/`` and ``.hydra/config.yaml``).
        out_dir: created if missing; existing files of the same names are replaced.
        checkpoint: a checkpoint file to export instead of the newest one.
        dtype: ``bfloat16`` (as the published drafts) or ``float32``.
        mask_token_id: overrides the run's MASK id (needed only when the tokenizer is not available).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: no checkpoint, no config, or a draft the reference layout cannot hold.
    """
    from safetensors.torch import save_file

    from dflash_lab.records.checkpoint import CheckpointManager, load_checkpoint
    from dflash_lab.model.build import draft_config_for_target, target_config_only

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    state = (load_checkpoint(checkpoint) if checkpoint
             else CheckpointManager(run_dir / "checkpoints").load_latest(map_location="cpu"))
    if state is None:
        raise ValueError(f"{run_dir / 'checkpoints'} holds no checkpoint: train first, or pass --checkpoint PATH")
    model_cfg = run_model_config(run_dir, state)
    target_config = target_config_only(**model_cfg)
    draft_cfg = draft_config_for_target(target_config, draft_layers=int(model_cfg["draft_layers"]),
                                        target_layer_ids=model_cfg["target_layer_ids"],
                                        draft_intermediate_size=model_cfg["draft_intermediate_size"])
    draft = DFlashDraft(draft_cfg)
    draft.load_state_dict(state["model"])   # strict: the checkpoint must be this config's draft
    mask_id = int(mask_token_id) if mask_token_id is not None else run_mask_token_id(model_cfg, target_config)
    config = reference_config(draft_cfg, target_config, block_size=int(model_cfg["block_size"]),
                              mask_token_id=mask_id, dtype=dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(reference_state_dict(draft.state_dict(), DTYPES[dtype]), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a trained DFlash draft (model.safetensors + config.json) "
                                                 "for the DFlash inference code.")
    parser.add_argument("run_dir", help="training run directory (checkpoints/ and .hydra/config.yaml)")
    parser.add_argument("out_dir", help="output directory")
    parser.add_argument("--checkpoint", default=None, help="checkpoint file (default: the run's newest)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--mask-token-id", type=int, default=None, help="override the run's MASK id")
    args = parser.parse_args(argv)
    out = export_draft(args.run_dir, args.out_dir, checkpoint=args.checkpoint, dtype=args.dtype,
                       mask_token_id=args.mask_token_id)
    print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}")


if __name__ == "__main__":
    main()
