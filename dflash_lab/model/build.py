"""``build_model(**model_cfg) -> (DFlashModel, tokenizer)``: the model config's plain keys -> a ready model.

``kind=tiny``: ByteTokenizer + the cached, self-pretrained tiny Qwen3 target (dflash_lab.model.target).
``kind=hf``: a local HF causal LM + its tokenizer (HFTokenizerAdapter), frozen, bf16 on GPU.
Then a DFlashDraft shaped like the target (same hidden size and heads, ``draft_layers`` layers) reading the
target layers ``target_layer_ids`` (default spacing rule: dflash_lab.model.draft.default_target_layer_ids).
``target_config_only`` and ``draft_config_for_target`` give the same shapes without weights (planner, export).
``model.target_digest`` names the target's weights (tiny: ``weights_digest`` of the weights themselves, checked
against the cache's record; hf: ``checkpoint_digest`` of the checkpoint files); runs record it in summary.json.
MASK id (hf): the tokenizer's mask token, else an id added past its vocabulary, as the DFlash reference does.

Cost: tiny: the first call pretrains (~1 min on 2 cores), later calls load in < 1 s; hf: the weights' load time.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from pathlib import Path

from dflash_lab.config_check import as_bool, as_int, refuse_unknown_keys
from dflash_lab.data.tokenizer import ByteTokenizer, HFTokenizerAdapter
from dflash_lab.model.dflash import DFlashModel
from dflash_lab.model.draft import DFlashDraft, DraftConfig, check_compile_layers, default_target_layer_ids
from dflash_lab.model.target import checkpoint_digest, load_hf_target, load_or_build_tiny_target

log = logging.getLogger(__name__)
KINDS = ("tiny", "hf")
DECODE_KEYS = ("decode_num_prompts", "decode_max_new_tokens", "decode_max_prompt_tokens")  # read by the trainer

_TINY_PRETRAIN_CORPUS = {"kind": "synthetic", "num_samples": 3000, "seed": 0}


def build_model(kind: str = "tiny", *, block_size: int = 8, loss_gamma: float | None = None,
                anchors_per_doc: int | None = 64, anchor_density: float | None = 0.0625, draft_layers: int = 1,
                target_layer_ids: list[int] | None = None, draft_intermediate_size: int | None = None,
                draft_init_seed: int = 0, draft_init_std: float | None = None, cache_dir: str | None = None,
                hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 192, max_position_embeddings: int = 2048,
                pretrain_steps: int = 400, pretrain_tokens_per_step: int = 2048, pretrain_lr: float = 1e-2,
                pretrain_window: int = 256, pretrain_seed: int = 0, pretrain_max_seconds: float | None = None,
                pretrain_data: dict | None = None,
                target_path: str | None = None, target_config: str | dict | None = None, dtype: str = "auto",
                device: str | None = None, attn_implementation: str = "sdpa", mask_token_id: int | None = None,
                fixed_anchors: int = 8, activation_checkpointing: bool = False, compile_layers: bool | str = "auto",
                **other):
    """Build the DFlash model and the target's tokenizer from plain config values.

    Args:
        kind: ``tiny`` or ``hf``.
        block_size: tokens per draft block (16 on GPU as in DFlash, 8 on CPU).
        loss_gamma: slot-weight decay constant (None: 7 for bs 16, 5 for 10, 4 for 8).
        anchors_per_doc: anchors per document (cap when anchor_density is set).
        anchor_density: anchors per valid anchor position (None: exactly anchors_per_doc per document).
        draft_layers: number of draft decoder layers (also the number of target layers read, by default).
        target_layer_ids: target layers read (None: the spacing rule).
        draft_intermediate_size: MLP width of the draft (None: the target's).
        draft_init_seed: seed of the draft initialisation.
        draft_init_std: std of the draft's linear weights (None: hidden_size ** -0.5, see DFlashDraft).
        cache_dir: cache root for the tiny target and its corpus.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings: tiny shape.
        pretrain_steps, pretrain_tokens_per_step, pretrain_lr, pretrain_window, pretrain_seed,
            pretrain_max_seconds: tiny pretraining (dflash_lab.model.target.pretrain_tiny_target).
        pretrain_data: corpus of the tiny target (``build_dataset`` keys; default synthetic, 3000 samples).
        target_path, dtype, device, attn_implementation: hf target loading.
        mask_token_id: hf: MASK id (None: the tokenizer's mask token, else an id added past its vocabulary,
            as the DFlash reference does; see ``resolve_mask_token_id``).
        target_config: hf: a config.json (path or dict) giving the target's shape without weights; read by the
            planner's memory model (``target_config_only``), not used to build a trainable model.
        fixed_anchors: blocks per document scored at anchors drawn once from the example id (per-example
            accuracy and probes; 0: off). See DFlashModel.
        activation_checkpointing: recompute draft layers in the backward pass (``trainer.activation_checkpointing``).
        compile_layers: torch.compile the draft layers' RMSNorm, rope and MLP: true, false or ``auto`` (the default
            when the key is absent: on CUDA, off on CPU where each graph takes ~20 s to compile). See
            dflash_lab.model.draft.
        **other: the model config's ``decode_*`` keys (read by the trainer); any other key is refused.

    Returns:
        (DFlashModel, tokenizer) with ``tokenizer`` a ByteTokenizer or HFTokenizerAdapter; ``model.target_digest``
        names the target's weights (module docstring).

    Raises:
        ValueError: an unknown key (the message lists the valid ones) or a bad value.

    Example:
        >>> model, tok = build_model("tiny", block_size=8)   # doctest: +SKIP
    """
    refuse_unknown_keys("model", other, valid_model_keys())
    fixed_anchors = as_int("model.fixed_anchors", fixed_anchors, minimum=0, example=8)
    activation_checkpointing = as_bool("trainer.activation_checkpointing", activation_checkpointing)
    compile_layers = check_compile_layers(compile_layers)
    if kind == "tiny":
        tokenizer = ByteTokenizer()
        arch = {"hidden_size": int(hidden_size), "num_layers": int(num_layers), "num_heads": int(num_heads),
                "num_kv_heads": int(num_kv_heads), "intermediate_size": int(intermediate_size),
                "max_position_embeddings": int(max_position_embeddings)}
        pretrain = {"steps": int(pretrain_steps), "tokens_per_step": int(pretrain_tokens_per_step),
                    "lr": float(pretrain_lr), "window": int(pretrain_window), "seed": int(pretrain_seed),
                    "max_seconds": pretrain_max_seconds}
        corpus = dict(pretrain_data) if pretrain_data else dict(_TINY_PRETRAIN_CORPUS)
        target, meta = load_or_build_tiny_target(tokenizer=tokenizer, arch=arch, pretrain=pretrain, corpus=corpus,
                                                 cache_dir=cache_dir)
        log.info("tiny target: %s (pretrain loss %.3f, weights digest %s)", meta["path"],
                 meta["pretrain_stats"]["loss"], meta["target_digest"])
        target.dflash_meta = meta
        target_digest = meta["target_digest"]
        mask_id = tokenizer.mask_token_id
    elif kind == "hf":
        if not target_path and target_config:
            raise ValueError("model.target_config gives a target's shape for the planner only; training needs its "
                             "weights: set model.target_path=/path/to/hf/model")
        target, hf_tokenizer = load_hf_target(target_path, dtype=dtype, device=device,
                                              attn_implementation=attn_implementation)
        target_digest = checkpoint_digest(target_path)   # the files, not 16 GB of weights: see target.py
        rows = target.get_input_embeddings().weight.shape[0]
        mask_id = resolve_mask_token_id(hf_tokenizer, mask_token_id, rows)
        tokenizer = HFTokenizerAdapter(hf_tokenizer, mask_token_id=mask_id)
    else:
        raise ValueError(f"model.kind={kind!r}: choose one of {', '.join(KINDS)}")

    model = wrap_target(target, mask_token_id=mask_id, block_size=block_size, loss_gamma=loss_gamma,
                        anchors_per_doc=anchors_per_doc, anchor_density=anchor_density, draft_layers=draft_layers,
                        target_layer_ids=target_layer_ids, draft_intermediate_size=draft_intermediate_size,
                        draft_init_seed=draft_init_seed, draft_init_std=draft_init_std, fixed_anchors=fixed_anchors,
                        activation_checkpointing=activation_checkpointing, compile_layers=compile_layers)
    model.stop_token_ids = list(tokenizer.stop_token_ids)
    model.target_digest = target_digest
    return model, tokenizer


def valid_model_keys() -> list[str]:
    """Keys a model config section may hold: ``build_model``'s keyword arguments and the trainer's decode keys."""
    params = inspect.signature(build_model).parameters.values()
    return [p.name for p in params if p.kind is not p.VAR_KEYWORD] + list(DECODE_KEYS)


def wrap_target(target, *, mask_token_id: int, block_size: int = 8, loss_gamma: float | None = None,
                anchors_per_doc: int | None = 64, anchor_density: float | None = 0.0625, draft_layers: int = 1,
                target_layer_ids: list[int] | None = None, draft_intermediate_size: int | None = None,
                draft_init_seed: int = 0, draft_init_std: float | None = None, fixed_anchors: int = 8,
                activation_checkpointing: bool = False, compile_layers: bool | str = "auto") -> DFlashModel:
    """A DFlashModel around an already built (frozen) HF causal-LM target: a draft shaped like the target.

    ``build_model`` uses it for both kinds; ``benchmarks/gpu_check.py`` uses it on a randomly initialised
    real-size target. Arguments as in ``build_model``.
    """
    target.requires_grad_(False)
    rows = target.get_input_embeddings().weight.shape[0]
    if not 0 <= int(mask_token_id) < rows:
        raise ValueError(f"model.mask_token_id={mask_token_id} is outside the target's {rows} embedding rows: "
                         f"set model.mask_token_id to an id below {rows}")
    draft_cfg = draft_config_for_target(target.config, draft_layers=draft_layers, target_layer_ids=target_layer_ids,
                                        draft_intermediate_size=draft_intermediate_size)
    draft = DFlashDraft(draft_cfg, init_seed=int(draft_init_seed), init_std=draft_init_std,
                        activation_checkpointing=activation_checkpointing, compile_layers=compile_layers)
    weight = target.get_input_embeddings().weight
    draft.to(device=weight.device)  # draft master weights stay float32; autocast handles bf16 on GPU
    model = DFlashModel(target, draft, mask_token_id=mask_token_id, block_size=int(block_size), loss_gamma=loss_gamma,
                        anchors_per_doc=anchors_per_doc, anchor_density=anchor_density,
                        draft_init_seed=int(draft_init_seed), fixed_anchors=int(fixed_anchors))
    return model


def draft_config_for_target(config, *, draft_layers: int = 1, target_layer_ids: list[int] | None = None,
                            draft_intermediate_size: int | None = None) -> DraftConfig:
    """The draft's shape for a target HF config: same hidden size, heads, norm eps and RoPE base as the target.

    Example:
        >>> from transformers import Qwen3Config
        >>> cfg = draft_config_for_target(Qwen3Config(num_hidden_layers=36), draft_layers=5)
        >>> cfg.target_layer_ids
        [1, 9, 17, 25, 33]
    """
    layers = config.num_hidden_layers
    layer_ids = list(target_layer_ids) if target_layer_ids else default_target_layer_ids(layers, int(draft_layers))
    return DraftConfig(
        hidden_size=config.hidden_size,
        num_layers=int(draft_layers),
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        intermediate_size=int(draft_intermediate_size or config.intermediate_size),
        target_layer_ids=layer_ids,
        target_hidden_size=config.hidden_size,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        rope_theta=float(_rope_theta(config)),
    )


def target_config_only(kind: str = "tiny", *, target_config: str | dict | None = None, target_path: str | None = None,
                       hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                       intermediate_size: int = 192, max_position_embeddings: int = 2048, **unused):
    """The target's HF config without its weights (planning, export): from the model config's plain keys.

    ``kind=hf``: ``target_config`` (a config.json path or its fields inline, e.g. the ``qwen3_8b`` preset), else
    ``target_path``/config.json. ``kind=tiny``: the tiny shape keys.

    Raises:
        ValueError: ``kind=hf`` with neither key set, or a path without a config.json.

    Example:
        >>> target_config_only("hf", target_config={"model_type": "qwen3", "hidden_size": 128}).hidden_size
        128
    """
    del unused
    if kind == "tiny":
        from dflash_lab.model.target import tiny_qwen3_config

        tokenizer = ByteTokenizer()
        return tiny_qwen3_config(tokenizer.vocab_size, hidden_size=int(hidden_size), num_layers=int(num_layers),
                                 num_heads=int(num_heads), num_kv_heads=int(num_kv_heads),
                                 intermediate_size=int(intermediate_size),
                                 max_position_embeddings=int(max_position_embeddings),
                                 pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
    if kind != "hf":
        raise ValueError(f"model.kind={kind!r}: choose one of {', '.join(KINDS)}")
    from transformers import AutoConfig

    if isinstance(target_config, Mapping):
        fields = dict(target_config)
        return AutoConfig.for_model(fields.pop("model_type", "qwen3"), **fields)
    source = target_config or target_path
    if not source:
        raise ValueError("model=hf needs the target's shape: set model.target_config=/path/to/config.json "
                         "(or use model=qwen3_8b) or model.target_path=/path/to/hf/model")
    path = Path(source).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"model.target_config={source!r}: no config.json there; point it at a HF config.json")
    return AutoConfig.from_pretrained(path)


def resolve_mask_token_id(hf_tokenizer, configured: int | None, embedding_rows: int) -> int:
    """MASK id of a HF target: ``configured``, else the tokenizer's mask token, else the id the DFlash reference
    adds past the tokenizer's vocabulary (``len(tokenizer)``, the row ``add_special_tokens({"mask_token": ...})``
    would take). The id indexes the target's own embedding row, as the reference's inference code does, so it
    must be below the embedding's row count (Qwen3: 151,669 < 151,936 padded rows).

    Raises:
        ValueError: the id has no embedding row (names ``model.mask_token_id`` and the fix).
    """
    if configured is not None:
        mask_id = int(configured)
    elif hf_tokenizer.mask_token_id is not None:
        mask_id = int(hf_tokenizer.mask_token_id)
    else:
        mask_id = len(hf_tokenizer)
        if mask_id >= embedding_rows:
            raise ValueError(
                f"model.mask_token_id=null adds a MASK id past the tokenizer's {mask_id} tokens, but the target's "
                f"embedding has only {embedding_rows} rows: set model.mask_token_id to an unused existing id "
                f"(e.g. the pad id {hf_tokenizer.pad_token_id})")
    return mask_id


def _rope_theta(config) -> float:
    """RoPE base of an HF config across transformers versions (rope_theta or rope_parameters)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"]
    return getattr(config, "rope_theta", 10_000.0)
