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

The command prints what it wrote and from what: the checkpoint's file and step, and the run's status from its
``summary.json`` (an unfinished run's weights are not its final ones; the draft of step 0, which a run with
``trainer.max_steps=0`` saves, is said to be untrained). A missing directory, a run without
checkpoints, an ``OUT_DIR`` where a file stands, a ``--checkpoint`` that is not a readable checkpoint (the message
names the run's newest intact one) or a bad option is one line (``dflash_lab.export: error: ...``, exit code 2;
``HYDRA_FULL_ERROR=1`` shows the traceback), checked before anything is written. ``model.safetensors`` gets the mode the umask gives new files, like ``config.json``.

Cost: one checkpoint load and one safetensors write (the draft's size).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from dflash_lab.model.draft import DFlashDraft, DraftConfig
from dflash_lab.refusal import Refused, output_directory_problem

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
REFUSED_EXIT_CODE = 2   # a missing directory, no checkpoint, a bad option: one line naming it (as train and plan)
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


class ExportRefused(ValueError):
    """The export cannot run (no such directory, no checkpoint, a bad option): one line naming what is wrong."""


def check_out_dir(out_dir: str | Path) -> None:
    """Refuse an ``OUT_DIR`` that cannot be a directory (a file stands there, or in place of one of its parents),
    before anything is loaded or written.

    Raises:
        ExportRefused: naming the path and the fix.
    """
    blocked = output_directory_problem(out_dir)
    if blocked:
        raise ExportRefused(f"OUT_DIR {blocked}: model.safetensors and config.json go into a directory; pass a new "
                            f"or existing directory as OUT_DIR")


def load_export_state(run_dir: str | Path, checkpoint: str | Path | None = None) -> dict[str, Any]:
    """The checkpoint to export: ``checkpoint``, else the newest intact one of ``RUN_DIR/checkpoints``
    (``state["_path"]`` names its file).

    Raises:
        ExportRefused: ``run_dir`` (or ``checkpoint``) does not exist, ``checkpoint`` is not a readable checkpoint
            (the message names the run's newest intact one), or the run holds no checkpoint.
    """
    from dflash_lab.records.checkpoint import CheckpointManager, load_checkpoint, unreadable_reason

    run_dir = Path(run_dir)
    if checkpoint is not None:
        if not Path(checkpoint).is_file():
            raise ExportRefused(f"--checkpoint {checkpoint}: no such file (the run's are in {run_dir / 'checkpoints'})")
        try:
            state = load_checkpoint(checkpoint)
            why = None if isinstance(state, dict) and "model" in state else "it holds no draft weights"
        except Exception as exc:  # noqa: BLE001 - torn, truncated, not torch's format: each fails its own way
            why = unreadable_reason(exc)
        if why is not None:
            raise ExportRefused(f"--checkpoint {checkpoint} is not a readable checkpoint ({why}): "
                                f"{newest_intact_checkpoint(run_dir, but=checkpoint)}")
        return {**state, "_path": str(checkpoint)}
    if not run_dir.is_dir():
        raise ExportRefused(f"{run_dir}: no such directory: pass a training run directory (runs/<experiment>/<time>_"
                            f"<sampler>_s<seed>/, or a job folder of a multirun)")
    state = CheckpointManager(run_dir / "checkpoints").load_latest(map_location="cpu")
    if state is None:
        what = ("a run directory without checkpoints" if (run_dir / "summary.json").is_file()
                or (run_dir / "run_config.json").is_file() else "not a run directory (no checkpoints/, summary.json "
                "or run_config.json)")
        raise ExportRefused(f"{run_dir} is {what}: {run_dir / 'checkpoints'} holds no checkpoint to export; train the "
                            f"run (it saves one every trainer.ckpt_every steps and at its end), or pass --checkpoint "
                            f"PATH")
    return state


def newest_intact_checkpoint(run_dir: Path, but: str | Path | None = None) -> str:
    """Which checkpoint to export instead of a damaged one, in words: the newest intact file of
    ``RUN_DIR/checkpoints`` other than ``but``, with the command line that exports it."""
    from dflash_lab.records.checkpoint import CheckpointManager

    directory = Path(run_dir) / "checkpoints"
    found = CheckpointManager(directory).newest_intact(skip=but)
    if found is None:
        return f"{directory} holds no intact checkpoint either; restore the file, or train the run again"
    step, path, _ = found
    return (f"the newest intact one is {path} (step {step}): pass --checkpoint {path}, or leave out --checkpoint "
            f"to export it")


def describe_source(run_dir: str | Path, state: Mapping[str, Any]) -> str:
    """Which weights were exported: the checkpoint's file and step, and the run's status from its ``summary.json``
    (an unfinished or failed run, a checkpoint older than the run's last step, and an untrained draft, said in
    words).

    Example:
        >>> describe_source("/nowhere", {"step": 7, "_path": "/nowhere/checkpoints/step_7.pt"})
        'the draft of step 7 (step_7.pt); the run has no readable summary.json (status unknown)'
        >>> describe_source("/nowhere", {"step": 0, "_path": "/nowhere/checkpoints/step_0.pt"})  # doctest: +ELLIPSIS
        'the draft of step 0 (step_0.pt), UNTRAINED: its initial weights, no optimizer step ran (...); ...'
    """
    step = state.get("step")
    text = f"the draft of step {step} ({Path(state.get('_path') or '?').name})"
    if step is not None and int(step) == 0:   # a launch with trainer.max_steps=0 saves the initial draft
        text += (", UNTRAINED: its initial weights, no optimizer step ran (trainer.max_steps=0 trains none); train "
                 "the run (trainer.max_steps=N or null, same hydra.run.dir) and export it again")
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict):
        return f"{text}; the run has no readable summary.json (status unknown)"
    status, steps = summary.get("status"), summary.get("steps")
    text += f"; the run's status: {status} at step {steps}"
    if status != "finished":
        text += " (an unfinished run: these are not its final weights)"
    elif steps is not None and step is not None and int(step) < int(steps):
        text += f" (this checkpoint is {int(steps) - int(step)} steps before its end)"
    return text


def export_draft(run_dir: str | Path, out_dir: str | Path, *, checkpoint: str | Path | None = None,
                 dtype: str = "bfloat16", mask_token_id: int | None = None,
                 state: Mapping[str, Any] | None = None) -> Path:
    """Write OUT_DIR/model.safetensors + config.json from a run directory (module docstring).

    Args:
        run_dir: a training run directory (``checkpoints/`` and ``run_config.json``).
        out_dir: created if missing; existing files of the same names are replaced. The files get the mode the
            umask gives a new file (as ``config.json`` does), never safetensors' private 0600.
        checkpoint: a checkpoint file to export instead of the newest one.
        dtype: ``bfloat16`` (as the published drafts) or ``float32``.
        mask_token_id: overrides the run's MASK id (needed only when the tokenizer is not available).
        state: the checkpoint, already loaded (:func:`load_export_state`).

    Returns:
        ``out_dir``.

    Raises:
        ExportRefused: no such directory, no checkpoint, an ``out_dir`` a file stands in; ValueError: no config,
            or a draft the reference layout cannot hold.
    """
    from safetensors.torch import save_file

    from dflash_lab.model.build import draft_config_for_target, target_config_only

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise ExportRefused(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    check_out_dir(out_dir)
    state = state if state is not None else load_export_state(run_dir, checkpoint)
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
    weights = out_dir / "model.safetensors"
    save_file(reference_state_dict(draft.state_dict(), DTYPES[dtype]), str(weights), metadata={"format": "pt"})
    os.chmod(weights, 0o666 & ~current_umask())   # safetensors creates its file 0600
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a trained DFlash draft (model.safetensors + config.json) "
                                                 "for the DFlash inference code.")
    parser.add_argument("run_dir", help="training run directory (its checkpoints/ and run_config.json)")
    parser.add_argument("out_dir", help="output directory")
    parser.add_argument("--checkpoint", default=None, help="checkpoint file (default: the run's newest)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--mask-token-id", type=int, default=None, help="override the run's MASK id")
    args = parser.parse_args(argv)
    try:
        check_out_dir(args.out_dir)
        state = load_export_state(args.run_dir, args.checkpoint)
        out = export_draft(args.run_dir, args.out_dir, dtype=args.dtype, mask_token_id=args.mask_token_id,
                           state=state)
    except (ValueError, FileNotFoundError, Refused) as exc:   # bad input: one line, as the other commands
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"dflash_lab.export: error: {exc}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(REFUSED_EXIT_CODE) from None
    print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}: {describe_source(args.run_dir, state)}")


if __name__ == "__main__":
    main()
