"""``build_model(kind, activation_checkpointing=..., **model_cfg) -> (DFlashModel, tokenizer)``: the model config's
plain keys -> a ready model, through one builder per target kind, each taking only its own keys.

The defaults live in the presets (conf/model/*.yaml, read by ``dflash_lab.presets.preset``): every builder keyword
is required, and ``build_model`` refuses a section that lacks a key or holds one its kind does not take, naming it.

``kind=tiny`` (``build_tiny_model``): ByteTokenizer + the cached, self-pretrained tiny Qwen3 target
(dflash_lab.model.target); its keys: the tiny target's shape, pretraining and cache.
``kind=hf`` (``build_hf_model``): a local HF causal LM + its tokenizer (HFTokenizerAdapter), frozen, bf16 on GPU;
its keys: where the target is and how it loads (a directory marked ``random_weights.json`` instead of weights:
random weights from its config, dflash_lab.model.random_target).
Both then call ``wrap_target``: a DFlashDraft shaped like the target (same hidden size and heads, ``draft_layers``
layers) reading the target layers ``target_layer_ids`` (default spacing rule:
dflash_lab.model.draft.default_target_layer_ids), with the DFlash objective's keys (``DRAFT_KEYS``, shared by every
kind). The ``decode_*`` keys (``DECODE_KEYS``) belong to every kind's section too; the trainer reads them.
``target_config_only`` and ``draft_config_for_target`` give the same shapes without weights (planner, export).
``model.target_digest`` names the target's weights (tiny: ``weights_digest`` of the weights themselves, checked
against the cache's record; hf: ``checkpoint_digest`` of the checkpoint files); runs record it in summary.json.
MASK id (hf): the tokenizer's mask token, else an id added past its vocabulary, as the DFlash reference does.

Cost: tiny: the first call pretrains (~1 min on 2 cores), later calls load in < 1 s; hf: the weights' load time.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dflash_lab.config_check import as_bool, as_choice, as_int
from dflash_lab.data.tokenizer import ByteTokenizer, HFTokenizerAdapter
from dflash_lab.model.dflash import DFlashModel
from dflash_lab.model.draft import DFlashDraft, DraftConfig, check_compile_layers, default_target_layer_ids
from dflash_lab.model.random_target import load_random_hf_target, random_target_digest, random_weights_seed
from dflash_lab.model.target import checkpoint_digest, load_hf_target, load_or_build_tiny_target

log = logging.getLogger(__name__)
DECODE_KEYS = ("decode_num_prompts", "decode_max_new_tokens", "decode_max_prompt_tokens",  # read by the trainer
               "tau_method")
# Accepted and unused: ``model.cache_dir`` (the tiny target's cache) stays in conf/model/hf.yaml so that command
# lines written before the builders were split per kind (``model=hf model.cache_dir=...``) still compose.
IGNORED_KEYS = {"tiny": (), "hf": ("cache_dir",)}


def build_tiny_model(*, cache_dir: str | None, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                     intermediate_size: int, max_position_embeddings: int, pretrain_steps: int,
                     pretrain_tokens_per_step: int, pretrain_lr: float, pretrain_window: int, pretrain_seed: int,
                     pretrain_max_seconds: float | None, pretrain_data: Mapping[str, Any],
                     **draft: Any) -> tuple[DFlashModel, ByteTokenizer]:
    """The tiny target (pretrained by our own code once, then loaded from the cache) and its draft.

    Args:
        cache_dir: cache root of the tiny target (None: ``$DFLASH_LAB_CACHE`` or ``~/.cache/dflash_lab``).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings: its shape.
        pretrain_steps, pretrain_tokens_per_step, pretrain_lr, pretrain_window, pretrain_seed,
            pretrain_max_seconds: its pretraining (dflash_lab.model.target.pretrain_tiny_target).
        pretrain_data: its corpus (``build_dataset`` keys).
        **draft: ``wrap_target``'s keys (``DRAFT_KEYS`` and ``activation_checkpointing``).
    """
    tokenizer = ByteTokenizer()
    arch, pretrain = tiny_target_spec(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        pretrain_steps=pretrain_steps, pretrain_tokens_per_step=pretrain_tokens_per_step, pretrain_lr=pretrain_lr,
        pretrain_window=pretrain_window, pretrain_seed=pretrain_seed, pretrain_max_seconds=pretrain_max_seconds)
    target, meta = load_or_build_tiny_target(tokenizer=tokenizer, arch=arch, pretrain=pretrain,
                                             corpus=dict(pretrain_data), cache_dir=cache_dir)
    log.info("tiny target: %s (%s; pretrain loss %.3f, weights digest %s)", meta["path"], meta["source"],
             meta["pretrain_stats"]["loss"], meta["target_digest"])
    target.dflash_meta = meta
    model = wrap_target(target, mask_token_id=tokenizer.mask_token_id, **draft)
    model.stop_token_ids = list(tokenizer.stop_token_ids)
    model.target_digest = meta["target_digest"]
    return model, tokenizer


def tiny_target_spec(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                     intermediate_size: int, max_position_embeddings: int, pretrain_steps: int,
                     pretrain_tokens_per_step: int, pretrain_lr: float, pretrain_window: int, pretrain_seed: int,
                     pretrain_max_seconds: float | None) -> tuple[dict, dict]:
    """The tiny target's shape and pretraining from the model section's keys, typed as the cache key and the
    shipped targets' manifest record them (``load_or_build_tiny_target``'s ``arch`` and ``pretrain``)."""
    arch = {"hidden_size": int(hidden_size), "num_layers": int(num_layers), "num_heads": int(num_heads),
            "num_kv_heads": int(num_kv_heads), "intermediate_size": int(intermediate_size),
            "max_position_embeddings": int(max_position_embeddings)}
    pretrain = {"steps": int(pretrain_steps), "tokens_per_step": int(pretrain_tokens_per_step),
                "lr": float(pretrain_lr), "window": int(pretrain_window), "seed": int(pretrain_seed),
                "max_seconds": pretrain_max_seconds}
    return arch, pretrain


def build_hf_model(*, target_path: str | None, target_config: str | Mapping | None, dtype: str, device: str | None,
                   attn_implementation: str, mask_token_id: int | None,
                   **draft: Any) -> tuple[DFlashModel, HFTokenizerAdapter]:
    """A local Hugging Face causal LM (frozen) with its tokenizer, and its draft.

    Args:
        target_path: local directory with config.json, weights and tokenizer (required to train).
        target_config: a config.json (path or fields) giving the target's shape without weights: the planner's
            (``target_config_only``); refused here without ``target_path``.
        dtype, device, attn_implementation: how the target loads (``load_hf_target``).
        mask_token_id: MASK id (None: the tokenizer's mask token, else an id added past its vocabulary, as the
            DFlash reference does; see ``resolve_mask_token_id``).
        **draft: ``wrap_target``'s keys (``DRAFT_KEYS`` and ``activation_checkpointing``).
    """
    if not target_path:
        if target_config:
            raise ValueError("model.target_config gives a target's shape for the planner only; training needs its "
                             "weights: set model.target_path=/path/to/hf/model")
        raise ValueError("model.target_path is not set: set model.target_path=/path/to/hf/model (a local directory "
                         "with config.json, weights and tokenizer)")
    seed = random_weights_seed(target_path)   # a directory with random_weights.json: see random_target.py
    if seed is None:
        target, hf_tokenizer = load_hf_target(target_path, dtype=dtype, device=device,
                                              attn_implementation=attn_implementation)
    else:
        target, hf_tokenizer = load_random_hf_target(target_path, seed, dtype=dtype, device=device,
                                                     attn_implementation=attn_implementation)
    rows = target.get_input_embeddings().weight.shape[0]
    mask_id = resolve_mask_token_id(hf_tokenizer, mask_token_id, rows)
    tokenizer = HFTokenizerAdapter(hf_tokenizer, mask_token_id=mask_id)
    model = wrap_target(target, mask_token_id=mask_id, **draft)
    model.stop_token_ids = list(tokenizer.stop_token_ids)
    # the files, not 16 GB of weights (target.py); random weights: their config and seed
    model.target_digest = (checkpoint_digest(target_path) if seed is None else random_target_digest(target_path, seed))
    return model, tokenizer


MODEL_BUILDERS: dict[str, Callable[..., tuple[DFlashModel, Any]]] = {"tiny": build_tiny_model, "hf": build_hf_model}


def _own_keys(builder: Callable) -> list[str]:
    """A builder's own keys: its keyword-only parameters (the draft's come through ``**draft``)."""
    return [p.name for p in inspect.signature(builder).parameters.values() if p.kind is p.KEYWORD_ONLY]


def model_keys(kind: str) -> list[str]:
    """Every key the model section of ``kind`` holds (each required): its builder's own, ``DRAFT_KEYS``,
    ``DECODE_KEYS`` and ``kind``.

    Example:
        >>> [k for k in model_keys("hf") if k not in DRAFT_KEYS + DECODE_KEYS]
        ['attn_implementation', 'cache_dir', 'device', 'dtype', 'kind', 'mask_token_id', 'target_config', 'target_path']
    """
    builder = MODEL_BUILDERS[as_choice("model.kind", kind, list(MODEL_BUILDERS))]
    return sorted({"kind", *_own_keys(builder), *DRAFT_KEYS, *DECODE_KEYS, *IGNORED_KEYS[kind]})


def check_model_section(model_cfg: Mapping[str, Any]) -> str:
    """The section's ``kind`` once it holds exactly that kind's keys; ValueError naming the missing or unknown ones.

    Example:
        >>> from dflash_lab.presets import preset
        >>> check_model_section(preset("model", "qwen3_8b"))
        'hf'
        >>> check_model_section({**preset("model", "tiny"), "target_path": "/m"})
        Traceback (most recent call last):
        ...
        ValueError: unknown model key(s) ['target_path'] for model.kind=tiny; valid keys: ...
    """
    if "kind" not in model_cfg:
        raise ValueError("the model section lacks model.kind: choose a preset (model=tiny | hf | hf_cpu | qwen3_8b)")
    kind = as_choice("model.kind", model_cfg["kind"], list(MODEL_BUILDERS))
    valid = model_keys(kind)
    unknown = sorted(set(model_cfg) - set(valid))
    if unknown:
        raise ValueError(f"unknown model key(s) {unknown} for model.kind={kind}; valid keys: {', '.join(valid)}")
    missing = [k for k in valid if k not in model_cfg]
    if missing:
        raise ValueError(f"model.kind={kind} lacks {', '.join('model.' + k for k in missing)}: the presets "
                         f"(conf/model/*.yaml) give every key; compose one (model=<preset>) or complete the section "
                         f"with dflash_lab.presets.preset('model', '<preset>', ...)")
    return kind


def build_model(kind: str, *, activation_checkpointing: bool, **model_cfg: Any):
    """Build the DFlash model and the target's tokenizer from a whole model section (``conf/model/<preset>.yaml``).

    Args:
        kind: ``tiny`` or ``hf``: selects the builder (``MODEL_BUILDERS``).
        activation_checkpointing: recompute draft layers in the backward pass (``trainer.activation_checkpointing``).
        **model_cfg: the section's other keys, every one required (``model_keys(kind)``).

    Returns:
        (DFlashModel, tokenizer) with ``tokenizer`` a ByteTokenizer or HFTokenizerAdapter; ``model.target_digest``
        names the target's weights (module docstring).

    Raises:
        ValueError: a missing or unknown key, or a bad value (the message names the key).

    Example:
        >>> from dflash_lab.presets import preset
        >>> model, tok = build_model(**preset("model", "tiny"), activation_checkpointing=False)   # doctest: +SKIP
    """
    kind = check_model_section({"kind": kind, **model_cfg})
    builder = MODEL_BUILDERS[kind]
    return builder(**{k: model_cfg[k] for k in (*_own_keys(builder), *DRAFT_KEYS)},
                   activation_checkpointing=activation_checkpointing)


def wrap_target(target, *, mask_token_id: int, block_size: int, loss_gamma: float | None,
                anchors_per_doc: int | None, anchor_density: float | None, draft_layers: int,
                target_layer_ids: list[int] | None, draft_intermediate_size: int | None,
                draft_init_seed: int, draft_init_std: float | None, fixed_anchors: int,
                compile_layers: bool | str, activation_checkpointing: bool) -> DFlashModel:
    """A DFlashModel around an already built (frozen) HF causal-LM target: a draft shaped like the target.

    Every model kind's builder ends here; ``benchmarks/gpu_check.py`` uses it on a randomly initialised
    real-size target.

    Args:
        target: the frozen HF causal LM.
        mask_token_id: the MASK id (a row of the target's embedding).
        block_size: tokens per draft block (16 on GPU as in DFlash, 8 on CPU).
        loss_gamma: slot-weight decay constant (None: 7 for bs 16, 5 for 10, 4 for 8).
        anchors_per_doc: anchors per document (cap when anchor_density is set).
        anchor_density: anchors per valid anchor position (None: exactly anchors_per_doc per document).
        draft_layers: number of draft decoder layers (also the number of target layers read, by default).
        target_layer_ids: target layers read (None: the spacing rule).
        draft_intermediate_size: MLP width of the draft (None: the target's).
        draft_init_seed: seed of the draft initialisation.
        draft_init_std: std of the draft's linear weights (None: hidden_size ** -0.5, see DFlashDraft).
        fixed_anchors: blocks per document scored at anchors drawn once from the example id (per-example
            accuracy and probes; 0: off). See DFlashModel.
        compile_layers: torch.compile the draft layers' RMSNorm, rope and MLP: true, false or ``auto`` (on CUDA,
            off on CPU where each graph takes ~20 s to compile). See dflash_lab.model.draft.
        activation_checkpointing: recompute draft layers in the backward pass (``trainer.activation_checkpointing``).
    """
    fixed_anchors = as_int("model.fixed_anchors", fixed_anchors, minimum=0, example=4)
    activation_checkpointing = as_bool("trainer.activation_checkpointing", activation_checkpointing)
    compile_layers = check_compile_layers(compile_layers)
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


# The draft's and objective's keys, shared by every model kind (``wrap_target``'s, less what the builders supply).
DRAFT_KEYS = tuple(p.name for p in inspect.signature(wrap_target).parameters.values()
                   if p.kind is p.KEYWORD_ONLY and p.name not in ("mask_token_id", "activation_checkpointing"))


def draft_config_for_target(config, *, draft_layers: int, target_layer_ids: list[int] | None,
                            draft_intermediate_size: int | None) -> DraftConfig:
    """The draft's shape for a target HF config: same hidden size, heads, norm eps and RoPE base as the target.

    Example:
        >>> from transformers import Qwen3Config
        >>> cfg = draft_config_for_target(Qwen3Config(num_hidden_layers=36), draft_layers=5, target_layer_ids=None,
        ...                               draft_intermediate_size=None)
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


def tiny_target_config(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                       intermediate_size: int, max_position_embeddings: int):
    """The tiny target's HF config (its shape keys; the ByteTokenizer's vocabulary and special ids)."""
    from dflash_lab.model.target import tiny_qwen3_config

    tokenizer = ByteTokenizer()
    return tiny_qwen3_config(tokenizer.vocab_size, hidden_size=int(hidden_size), num_layers=int(num_layers),
                             num_heads=int(num_heads), num_kv_heads=int(num_kv_heads),
                             intermediate_size=int(intermediate_size),
                             max_position_embeddings=int(max_position_embeddings),
                             pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)


def hf_target_config(*, target_config: str | Mapping | None, target_path: str | None):
    """An HF target's config: ``target_config`` (a config.json path, or its fields inline as in the ``qwen3_8b``
    preset), else ``target_path``/config.json.

    Raises:
        ValueError: neither key set, inline fields without ``model_type``, or a path without a config.json.
    """
    from transformers import AutoConfig

    if isinstance(target_config, Mapping):
        fields = dict(target_config)
        if "model_type" not in fields:
            raise ValueError("model.target_config lacks model_type: add it (e.g. model.target_config.model_type=qwen3,"
                             " as in config.json)")
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    source = target_config or target_path
    if not source:
        raise ValueError("model=hf needs the target's shape: set model.target_config=/path/to/config.json "
                         "(or use model=qwen3_8b) or model.target_path=/path/to/hf/model")
    path = Path(source).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"model.target_config={source!r}: no config.json there; point it at a HF config.json")
    return AutoConfig.from_pretrained(path)


TARGET_SHAPES: dict[str, Callable[..., Any]] = {"tiny": tiny_target_config, "hf": hf_target_config}


def target_config_only(kind: str | None = None, **model_cfg: Any):
    """The target's HF config without its weights (planning, export), from the shape keys of a model section
    (``tiny_target_config``'s or ``hf_target_config``'s, by ``kind``; the section's other keys are not read).

    Raises:
        ValueError: an unknown kind, a shape key missing (named), or the reader's own errors.

    Example:
        >>> target_config_only("hf", target_config={"model_type": "qwen3", "hidden_size": 128},
        ...                    target_path=None).hidden_size
        128
    """
    if kind is None:
        raise ValueError("the model section lacks model.kind: choose a preset (model=tiny | hf | hf_cpu | qwen3_8b)")
    reader = TARGET_SHAPES[as_choice("model.kind", kind, list(TARGET_SHAPES))]
    missing = [k for k in _own_keys(reader) if k not in model_cfg]
    if missing:
        raise ValueError(f"model.kind={kind} lacks {', '.join('model.' + k for k in missing)}: the presets "
                         f"(conf/model/*.yaml) give every key")
    return reader(**{k: model_cfg[k] for k in _own_keys(reader)})


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
