"""Targets: a tiny Qwen3 pretrained by our own code on the built-in corpus (cached), or a local HF model.

Tiny target: ``transformers.Qwen3Config`` / ``Qwen3ForCausalLM`` (the real HF classes) with a small shape,
trained from scratch with AdamW (warm-up then cosine) on whole documents of the corpus's training split
(padded batches of ``pretrain_tokens_per_step`` tokens, document-relative positions, loss on every real next
token). The result (config.json + model.safetensors) is saved under ``<cache>/targets/tiny-<hash>``; the hash covers the
shape, the pretraining settings, the corpus config, the tokenizer and the source of the code involved, so a
change to any of them trains a new target. The cache is built under a file lock and renamed into place
(dflash_lab.data.cache.build_once): DDP ranks starting together train it once.

HF target: ``AutoModelForCausalLM.from_pretrained(target_path)`` (bf16 on GPU, float32 on CPU) and its tokenizer.

Cost: tiny pretraining (default shape, 400 steps x 2048 tokens) measured 76 s on one thread of a shared 2-core
machine, 106 s when the machine was busier (meta.json records each build's time and loss); loading: < 1 s.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dflash_lab.data import cache as cache_module
from dflash_lab.data import datasets as datasets_module
from dflash_lab.data import synthetic as synthetic_module
from dflash_lab.data import tokenizer as tokenizer_module
from dflash_lab.data.cache import build_once, config_hash, default_cache_dir, source_hash

log = logging.getLogger(__name__)


def tiny_qwen3_config(vocab_size: int, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                      intermediate_size: int, max_position_embeddings: int, pad_token_id: int,
                      bos_token_id: int | None, eos_token_id: int | None):
    """A small Qwen3Config (sdpa attention, tied embeddings)."""
    from transformers import Qwen3Config

    if hidden_size % num_heads:
        raise ValueError(f"model.hidden_size={hidden_size} must be divisible by model.num_heads={num_heads}")
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    return config


def _pretrain_stream(dataset, rows: int, window: int, rng: np.random.Generator):
    """Endless [rows, window] batches cut from a shuffled stream of whole documents.

    Documents are concatenated in random order (each with its own positions 0..L-1 and a document number) and
    the stream is cut into rows of ``window`` tokens: no padding, and attention costs window^2 per row however
    long the documents are. A document cut at a row boundary keeps its true positions in the next row.
    """
    ids_buf: list[np.ndarray] = []
    pos_buf: list[np.ndarray] = []
    doc_buf: list[np.ndarray] = []
    buffered = 0
    doc_number = 0
    need = rows * window
    while True:
        for index in rng.permutation(len(dataset)):
            ids = dataset[int(index)]["input_ids"].numpy()
            ids_buf.append(ids)
            pos_buf.append(np.arange(len(ids)))
            doc_buf.append(np.full(len(ids), doc_number))
            doc_number += 1
            buffered += len(ids)
            if buffered >= need:
                ids_all, pos_all, doc_all = (np.concatenate(b) for b in (ids_buf, pos_buf, doc_buf))
                ids_buf, pos_buf, doc_buf = [ids_all[need:]], [pos_all[need:]], [doc_all[need:]]
                buffered -= need
                shape = (rows, window)
                doc = torch.from_numpy(doc_all[:need].reshape(shape))
                yield (torch.from_numpy(ids_all[:need].reshape(shape)).long(),
                       torch.from_numpy(pos_all[:need].reshape(shape)).long(),
                       doc - doc[:, :1])  # small per-row document numbers


def pretrain_tiny_target(model, dataset, *, steps: int, tokens_per_step: int, lr: float, seed: int,
                         window: int = 256, max_seconds: float | None = None) -> dict:
    """Train ``model`` (in place) as a causal LM on ``dataset``; returns {loss, steps, seconds, tokens}.

    Args:
        model: a Qwen3ForCausalLM.
        dataset: a TokenizedDataset (its training split).
        steps: optimizer steps (warm-up 5%, cosine to 10% of lr).
        tokens_per_step: tokens per batch (rows = tokens_per_step // window).
        lr: peak learning rate.
        seed: seed of the document order.
        window: row length of the packed stream (per-document attention inside a row).
        max_seconds: optional wall-clock cap (stops early; the recorded steps say so). Off by default: a
            time cap would make the cached target depend on the machine's speed.
    """
    from dflash_lab.model.dflash import document_attention_mask

    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    stream = _pretrain_stream(dataset, max(1, tokens_per_step // window), window, rng)
    model.train()
    start = time.perf_counter()
    ema = None
    tokens = 0
    done = 0
    for step in range(steps):
        input_ids, position_ids, doc_ids = next(stream)
        out = model(input_ids=input_ids, attention_mask=document_attention_mask(doc_ids),
                    position_ids=position_ids, use_cache=False)
        logits = out.logits[:, :-1].float()
        # Predict token t+1 from t only inside one document.
        targets = input_ids[:, 1:].masked_fill(doc_ids[:, 1:] != doc_ids[:, :-1], -100)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = float(loss.detach())
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        tokens += input_ids.numel()
        done = step + 1
        if done % 50 == 0:
            log.info("tiny target pretraining: step %d/%d loss %.3f", done, steps, ema)
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    model.eval()
    return {"loss": ema, "steps": done, "seconds": time.perf_counter() - start, "tokens": tokens}


def save_target(model, directory: Path) -> None:
    """Write config.json + model.safetensors of a freshly trained target, on whichever rank builds the cache.

    Not ``save_pretrained``: under an initialised process group, transformers writes weights only on global rank
    0, and the cache builder is whichever rank takes the file lock first. A cache entry without weights would
    break every later run, so this writes the files itself and checks them.
    """
    from safetensors.torch import save_model

    model.config.save_pretrained(directory)
    save_model(model, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
    if not (Path(directory) / "model.safetensors").is_file() or not (Path(directory) / "config.json").is_file():
        raise RuntimeError(f"the tiny target's files were not written to {directory}")


def load_or_build_tiny_target(*, tokenizer, arch: dict, pretrain: dict, corpus: dict, cache_dir: str | None):
    """The pretrained tiny target from the cache, training it first when absent.

    Args:
        tokenizer: the ByteTokenizer (ids of PAD/BOS/EOS, vocab size).
        arch: hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings.
        pretrain: steps, tokens_per_step, lr, seed, max_seconds.
        corpus: data config of the pretraining corpus (``build_dataset`` keys, e.g. kind=synthetic).
        cache_dir: cache root.

    Returns:
        (Qwen3ForCausalLM in eval mode, meta dict with the pretraining loss and time).
    """
    from transformers import Qwen3ForCausalLM

    key = {
        "arch": arch,
        "pretrain": pretrain,
        "corpus": corpus,
        "tokenizer": tokenizer.fingerprint,
        "code": source_hash(sys.modules[__name__], synthetic_module, tokenizer_module, datasets_module, cache_module),
    }
    directory = default_cache_dir(cache_dir) / "targets" / f"tiny-{config_hash(key)}"

    def build(tmp: Path) -> None:
        config = tiny_qwen3_config(tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id,
                                   bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **arch)
        torch.manual_seed(int(pretrain["seed"]))
        model = Qwen3ForCausalLM(config)
        corpus_args = dict(corpus)
        dataset = datasets_module.build_dataset(tokenizer=tokenizer, cache_dir=cache_dir, **corpus_args)
        train_split, _ = dataset.split()
        log.info("pretraining the tiny target (%s) on %d documents; cached in %s", arch, len(train_split), directory)
        stats = pretrain_tiny_target(model, train_split, steps=int(pretrain["steps"]),
                                     tokens_per_step=int(pretrain["tokens_per_step"]), lr=float(pretrain["lr"]),
                                     seed=int(pretrain["seed"]), window=int(pretrain["window"]),
                                     max_seconds=pretrain.get("max_seconds"))
        save_target(model, tmp)
        (tmp / "meta.json").write_text(json.dumps({"key": key, "pretrain_stats": stats}, indent=1, default=str))
        log.info("tiny target pretrained: loss %.3f in %.1f s", stats["loss"], stats["seconds"])

    build_once(directory, build)
    model = Qwen3ForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    model.eval()
    meta = json.loads((directory / "meta.json").read_text())
    meta["path"] = str(directory)
    return model, meta


def load_hf_target(target_path: str, *, dtype: str = "auto", device: str | None = None,
                   attn_implementation: str = "sdpa"):
    """A local Hugging Face causal LM and its tokenizer, frozen.

    Args:
        target_path: directory with config.json, weights and tokenizer files.
        dtype: ``auto`` (bf16 on GPU, float32 on CPU), ``bfloat16``, ``float16`` or ``float32``.
        device: where to load (default: cuda when available, else cpu).
        attn_implementation: ``sdpa`` (per-document masks) or ``eager``.

    Raises:
        ValueError: target_path missing or not a model directory.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not target_path:
        raise ValueError("model.target_path is not set: model=hf needs model.target_path=/path/to/hf/model")
    path = Path(target_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model.target_path={target_path!r} has no config.json: point it at a local HF model dir")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn_implementation)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
