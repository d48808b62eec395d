"""Targets: a tiny Qwen3 pretrained by our own code on the built-in corpus (cached), or a local HF model.

Tiny target: ``transformers.Qwen3Config`` / ``Qwen3ForCausalLM`` (the real HF classes) with a small shape,
trained from scratch with AdamW (warm-up then cosine) on whole documents of the corpus's training split
(padded batches of ``pretrain_tokens_per_step`` tokens, document-relative positions, loss on every real next
token). The result (config.json + model.safetensors) is saved under ``<cache>/targets/tiny-<hash>``; the hash covers the
shape, the pretraining settings, the corpus config, the tokenizer and the source of the code involved, so a
change to any of them trains a new target. The cache is built under a file lock and renamed into place
(dflash_lab.data.cache.build_once): DDP ranks starting together train it once.

Pretraining is deterministic on one machine and torch version: a seeded initialisation and document order, one
thread and deterministic algorithms while it runs (restored afterwards), and the caller's RNG state left as it
was. Another CPU or torch version still rounds differently (AVX-512 and AVX2 kernels give other weights), so the
cache names its weights by a digest (``weights_digest``: sha256 over the state dict, every parameter and
persistent buffer) recorded in meta.json and checked on every load; runs record it as ``target_digest`` and
compare refuses to pair runs trained against different targets.

Reference targets (shipped). The default tiny target and the forgetting protocol's five (pretrain seeds 0-4 of the
default shape and pretraining) are pretrained once by ``scripts/make_reference_targets.py`` and shipped with the
package (``dflash_lab/model/targets/``: one ``.safetensors`` file each and ``manifest.json`` with its pretraining
settings, the digest of the corpus it was pretrained on and its weights digest). A tiny target whose settings
(shape, pretraining, corpus config, tokenizer) equal a manifest entry's is loaded from that file, and its weights
digest and the corpus digest are checked against the manifest: the same weights, hence the same
``target_digest``, on every machine, so runs from any x86-64 machine pair with the committed ones. Any other
setting pretrains locally as before, with a warning that its digest depends on the machine's CPU kernels. A
``manifest.json`` missing beside the shipped files is a warning naming it (every tiny target is then pretrained
here, with another digest); a torn one is refused in one line naming it; both say to reinstall.

Target digests. ``kind=tiny``: ``weights_digest`` of the loaded weights (cheap at this size). ``kind=hf``:
``checkpoint_digest`` of the checkpoint files (names, sizes and the first and last MiB of each ``*.safetensors`` /
``*.bin`` file, plus config.json's text): hashing 16 GB of an 8B model at every start would take minutes, and a
checkpoint whose files agree in name, size, both ends and config is taken to be the same checkpoint.

HF target: ``AutoModelForCausalLM.from_pretrained(target_path)`` (bf16 on GPU, float32 on CPU) and its tokenizer.

Cost: tiny pretraining (default shape, 400 steps x 2048 tokens) measured 76 s on one thread of a shared 2-core
machine, 106 s when the machine was busier (meta.json records each build's time and loss); loading: < 1 s (a
shipped target: the file's ~0.9 MB, plus building its pretraining corpus once to check its digest).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dflash_lab.data import cache as cache_module
from dflash_lab.data import datasets as datasets_module
from dflash_lab.data import synthetic as synthetic_module
from dflash_lab.data import tokenizer as tokenizer_module
from dflash_lab.data.cache import build_once, config_hash, default_cache_dir, source_hash
from dflash_lab.refusal import DamagedCache

log = logging.getLogger(__name__)


DIGEST_CHARS = 16            # hex digits kept of a sha256: collisions are no concern among a lab's targets
SHIPPED_DIR = Path(__file__).resolve().parent / "targets"   # the reference targets (package data)
MANIFEST = "manifest.json"
PRETRAIN_THREADS = 1         # matmul reductions split differently with more threads: one thread, one result
_EDGE_BYTES = 1 << 20        # checkpoint_digest hashes this much of each weight file's start and end


def weights_digest(module_or_state_dict) -> str:
    """Digest of a model's weights: sha256 over every tensor's name, shape, dtype and bytes, in sorted name order.

    Args:
        module_or_state_dict: a ``torch.nn.Module`` (its state dict: parameters and persistent buffers, tied ones
            under each of their names; not the non-persistent buffers such as rotary frequencies, which each load
            recomputes from the config) or a mapping name -> tensor.

    Returns:
        16 hex digits. Equal weights give equal digests on any machine and device; one changed bit changes it.

    Cost: one pass over the weights (the tiny target: milliseconds; not meant for multi-GB models, see
    ``checkpoint_digest``).

    Example:
        >>> a = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
        >>> weights_digest(a) == weights_digest({"b": torch.zeros(2), "w": torch.ones(2, 2)})
        True
        >>> weights_digest(a) == weights_digest({**a, "b": torch.tensor([0.0, 1e-9])})
        False
    """
    if isinstance(module_or_state_dict, torch.nn.Module):
        tensors = dict(module_or_state_dict.state_dict(keep_vars=False))
    elif isinstance(module_or_state_dict, Mapping):
        tensors = dict(module_or_state_dict)
    else:
        raise TypeError(f"weights_digest needs a torch.nn.Module or a name -> tensor mapping, got "
                        f"{type(module_or_state_dict).__name__}")
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:DIGEST_CHARS]


def checkpoint_digest(directory: str | Path) -> str:
    """Digest of a Hugging Face checkpoint directory without reading all its weights.

    Covers config.json's full text and, for every ``*.safetensors`` and ``*.bin`` file (sorted by name), its name,
    its size and a sha256 of its first and last MiB. Cheap for an 8B model (a few MiB read), and different for any
    re-saved, re-sharded, converted or fine-tuned checkpoint in practice; an edit in the middle of a shard that
    keeps its size is not seen (``weights_digest`` hashes everything, for small models).

    Raises:
        ValueError: the directory has no config.json or no weight file (names the path and the fix).

    Returns:
        16 hex digits.
    """
    path = Path(directory).expanduser()
    config = path / "config.json"
    weights = sorted(p for pattern in ("*.safetensors", "*.bin") for p in path.glob(pattern) if p.is_file())
    if not config.is_file() or not weights:
        raise ValueError(f"model.target_path={str(directory)!r} has no config.json or no *.safetensors / *.bin "
                         "weights: point it at a local HF model directory")
    digest = hashlib.sha256()
    digest.update(b"config.json|" + config.read_bytes())
    for weight in weights:
        size = weight.stat().st_size
        digest.update(f"|{weight.name}|{size}|".encode())
        with open(weight, "rb") as handle:
            digest.update(handle.read(_EDGE_BYTES))
            handle.seek(max(0, size - _EDGE_BYTES))
            digest.update(handle.read(_EDGE_BYTES))
    return digest.hexdigest()[:DIGEST_CHARS]


@contextlib.contextmanager
def deterministic_cpu_training(threads: int = PRETRAIN_THREADS):
    """Within the block: ``threads`` intra-op threads and deterministic algorithms; the caller's settings and its
    torch and numpy global RNG states come back afterwards (pretraining a missing cache must not change the
    rest of the run)."""
    previous_threads = torch.get_num_threads()
    previous_deterministic = torch.are_deterministic_algorithms_enabled()
    previous_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    numpy_state = np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(previous_deterministic, warn_only=previous_warn_only)
            torch.set_num_threads(previous_threads)
            np.random.set_state(numpy_state)


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

    Deterministic: the same model, dataset and arguments give bitwise the same weights on one machine and torch
    version, whatever the caller's thread count (one thread and deterministic algorithms while it runs,
    ``deterministic_cpu_training``) and without touching the caller's RNG state.
    """
    with deterministic_cpu_training():
        return _pretrain(model, dataset, steps=steps, tokens_per_step=tokens_per_step, lr=lr, seed=seed,
                         window=window, max_seconds=max_seconds)


def _pretrain(model, dataset, *, steps: int, tokens_per_step: int, lr: float, seed: int, window: int,
              max_seconds: float | None) -> dict:
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


def load_or_build_tiny_target(*, tokenizer, arch: dict, pretrain: dict, corpus: dict, cache_dir: str | None,
                              shipped: bool = True):
    """The pretrained tiny target: a shipped reference target whose settings match (:func:`shipped_target`),
    else from the cache, training it first when absent.

    Args:
        tokenizer: the ByteTokenizer (ids of PAD/BOS/EOS, vocab size).
        arch: hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings.
        pretrain: steps, tokens_per_step, lr, seed, max_seconds.
        corpus: data config of the pretraining corpus (``build_dataset`` keys, e.g. kind=synthetic).
        cache_dir: cache root.
        shipped: look for a shipped reference target first (False: pretrain here; what
            ``scripts/make_reference_targets.py`` does to make them).

    Returns:
        (Qwen3ForCausalLM in eval mode, meta dict with the pretraining loss and time, ``target_digest`` (the
        ``weights_digest`` of the weights loaded), ``path`` and ``source``: ``shipped`` or ``pretrained here``).

    Raises:
        RuntimeError: a damaged cache entry or shipped file (files missing, or weights whose digest is not the one
            recorded when it was built): the message names what to delete or reinstall.
    """
    from transformers import Qwen3ForCausalLM

    if shipped:
        entry = shipped_target(tokenizer, arch, pretrain, corpus)
        if entry is not None:
            return load_shipped_target(entry, tokenizer, corpus, cache_dir)
    key = {
        "arch": arch,
        "pretrain": pretrain,
        "corpus": corpus,
        "tokenizer": tokenizer.fingerprint,
        "code": source_hash(sys.modules[__name__], synthetic_module, tokenizer_module, datasets_module, cache_module),
    }
    directory = default_cache_dir(cache_dir) / "targets" / f"tiny-{config_hash(key)}"
    if shipped and (SHIPPED_DIR / MANIFEST).is_file() and not (directory / "meta.json").is_file():
        log.warning("no shipped reference target has these pretraining settings (shape, pretraining, corpus): "
                    "pretraining the tiny target on this machine; its weights digest depends on this machine's CPU "
                    "kernels and torch version, so runs against it pair only with runs against the same weights "
                    "(compare refuses mixed target digests)")

    def build(tmp: Path) -> None:
        # the run's RNG state must not depend on whether this process built the cache: nothing here draws from it
        with torch.random.fork_rng(devices=[]):
            build_and_record(tmp)

    def build_and_record(tmp: Path) -> None:
        config = tiny_qwen3_config(tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id,
                                   bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **arch)
        train_split = pretraining_corpus(tokenizer, corpus, cache_dir)
        torch.manual_seed(int(pretrain["seed"]))
        model = Qwen3ForCausalLM(config)
        log.info("pretraining the tiny target (%s) on %d documents; cached in %s", arch, len(train_split), directory)
        stats = pretrain_tiny_target(model, train_split, steps=int(pretrain["steps"]),
                                     tokens_per_step=int(pretrain["tokens_per_step"]), lr=float(pretrain["lr"]),
                                     seed=int(pretrain["seed"]), window=int(pretrain["window"]),
                                     max_seconds=pretrain.get("max_seconds"))
        save_target(model, tmp)
        # the digest of the weights as saved and loaded back: what every later load must find
        saved = Qwen3ForCausalLM.from_pretrained(tmp, attn_implementation="sdpa")
        meta = {"key": key, "pretrain_stats": stats, "target_digest": weights_digest(saved),
                "corpus_digest": corpus_digest(train_split), "torch": torch.__version__,
                "cpu_capability": torch.backends.cpu.get_cpu_capability(), "pretrain_threads": PRETRAIN_THREADS}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        log.info("tiny target pretrained: loss %.3f in %.1f s, weights digest %s", stats["loss"], stats["seconds"],
                 meta["target_digest"])

    build_once(directory, build)
    model, meta = load_cached_tiny_target(directory)
    return model, {**meta, "source": "pretrained here"}


def pretraining_corpus(tokenizer, corpus: dict, cache_dir: str | None):
    """The training split of the tiny target's pretraining corpus (built, or loaded from the data cache)."""
    dataset = datasets_module.build_dataset(tokenizer=tokenizer, cache_dir=cache_dir, **dict(corpus))
    return dataset.split()[0]


def corpus_digest(train_split) -> str:
    """Digest of what a target was pretrained on: the corpus's content digest and the training split's indices."""
    digest = hashlib.sha256(str(train_split.content_digest).encode())
    digest.update(np.asarray(train_split.source_indices, dtype=np.int64).tobytes())
    return digest.hexdigest()[:DIGEST_CHARS]


def target_settings(tokenizer, arch: dict, pretrain: dict, corpus: dict) -> dict:
    """What makes a tiny target, as a shipped target's manifest records it: its shape, its pretraining, its
    corpus config and the tokenizer's fingerprint, each in plain JSON types (numbers as the presets give them)."""
    return json.loads(json.dumps({"arch": arch, "pretrain": pretrain, "corpus": dict(corpus),
                                  "tokenizer": tokenizer.fingerprint}, sort_keys=True, default=str))


REINSTALL = "reinstall dflash_lab (pip install --force-reinstall), or restore the file from the repository"


def shipped_targets(directory: Path = SHIPPED_DIR) -> list[dict]:
    """The shipped reference targets: ``manifest.json``'s entries (each with ``file``, ``settings``,
    ``target_digest``, ``corpus_digest``); [] when there is no manifest (the package ships none, or a new
    ``--out`` folder of scripts/make_reference_targets.py).

    Raises:
        refusal.DamagedCache: a manifest that cannot be read (torn, not JSON, no ``targets`` list): it names the file,
            that no target is loaded from the package until it is restored, and how.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text())["targets"]
        if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
            raise TypeError("'targets' is not a list of entries")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DamagedCache(f"the shipped targets' manifest {path} cannot be read ({type(error).__name__}: {error}): "
                           f"no tiny target can be matched to its shipped file until it is restored; "
                           f"{REINSTALL}") from error
    return entries


def shipped_target(tokenizer, arch: dict, pretrain: dict, corpus: dict, directory: Path = SHIPPED_DIR) -> dict | None:
    """The manifest entry whose settings equal these (:func:`target_settings`), or None. A manifest missing beside
    shipped target files (a damaged installation) is said in a warning naming it and what happens: the target is
    pretrained on this machine instead, with another weights digest. A torn one is refused
    (:func:`shipped_targets`)."""
    path = Path(directory) / MANIFEST
    files = sorted(Path(directory).glob("*.safetensors")) if not path.is_file() else []
    if files:
        log.warning("the shipped targets' manifest %s is missing: the %d shipped tiny target files beside it cannot "
                    "be matched to a run's settings, so this tiny target is pretrained on this machine instead (about "
                    "a minute; its weights digest depends on this machine and differs from the shipped one, so its "
                    "runs pair with no run against the shipped target); %s", path, len(files), REINSTALL)
        return None
    wanted = target_settings(tokenizer, arch, pretrain, corpus)
    return next((entry for entry in shipped_targets(directory) if entry["settings"] == wanted), None)


def load_shipped_target(entry: dict, tokenizer, corpus: dict, cache_dir: str | None,
                        directory: Path = SHIPPED_DIR):
    """(model in eval mode, meta) of a shipped reference target, checked twice against its manifest entry: the
    corpus this code builds from the entry's corpus config has the digest the target was pretrained on (else the
    corpus generator changed since it was shipped, and the target is pretrained here instead), and the loaded
    weights have the manifest's weights digest.

    Raises:
        refusal.DamagedCache: a shipped file that is missing, unreadable or holds other weights (reinstall).
    """
    from safetensors.torch import load_model
    from transformers import Qwen3ForCausalLM

    path = Path(directory) / entry["file"]
    fix = REINSTALL
    settings = entry["settings"]
    built = corpus_digest(pretraining_corpus(tokenizer, corpus, cache_dir))
    if built != entry["corpus_digest"]:
        log.warning("the shipped reference target %s was pretrained on a corpus with digest %s, but this code builds "
                    "%s from the same config (the corpus generator changed): pretraining the tiny target here "
                    "instead; its digest depends on this machine", entry["file"], entry["corpus_digest"], built)
        return load_or_build_tiny_target(tokenizer=tokenizer, arch=settings["arch"], pretrain=settings["pretrain"],
                                         corpus=corpus, cache_dir=cache_dir, shipped=False)
    config = tiny_qwen3_config(tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               **settings["arch"])
    model = Qwen3ForCausalLM(config)
    try:
        load_model(model, str(path), strict=True)
    except Exception as error:   # a missing or torn file: name it and the fix
        raise DamagedCache(f"the shipped tiny target {path} cannot be read ({type(error).__name__}: {error}): "
                           f"{fix}") from error
    model.eval()
    digest = weights_digest(model)
    if digest != entry["target_digest"]:
        raise DamagedCache(f"the shipped tiny target {path} has weights digest {digest}, but the manifest records "
                           f"{entry['target_digest']}: {fix}")
    return model, {"path": str(path), "target_digest": digest, "source": "shipped",
                   "pretrain_stats": entry["pretrain_stats"], "corpus_digest": built}


def load_cached_tiny_target(directory: Path):
    """(model in eval mode, meta with ``path`` and ``target_digest``) of a built cache entry, its weights checked
    against the digest recorded when it was built.

    Raises:
        refusal.DamagedCache (a RuntimeError): files missing or unreadable, or weights whose digest differs from meta.json's (a damaged or
            edited cache): the message names the directory to delete so the next run pretrains it again.
    """
    fix = f"delete {directory} (rm -rf '{directory}') and run again to pretrain the tiny target afresh"
    missing = [name for name in ("config.json", "model.safetensors", "meta.json") if not (directory / name).is_file()]
    if missing:
        raise DamagedCache(f"the cached tiny target {directory} lacks {', '.join(missing)}: {fix}")
    from transformers import Qwen3ForCausalLM
    try:
        meta = json.loads((directory / "meta.json").read_text())
        model = Qwen3ForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    except Exception as error:   # a torn or foreign file: say which cache to rebuild, not only what failed inside
        raise DamagedCache(f"the cached tiny target {directory} cannot be read ({type(error).__name__}: {error}): "
                           f"{fix}") from error
    model.eval()
    digest = weights_digest(model)
    recorded = meta.get("target_digest")
    if recorded != digest:
        raise DamagedCache(f"the cached tiny target {directory} has weights digest {digest}, but its meta.json "
                           f"records {recorded} (the weights were changed or damaged after it was built): {fix}")
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
