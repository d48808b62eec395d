"""Memory and FLOP model of one DFlash training step on one rank, and the preflight that refuses a config too big.

The model is a pure function of shapes: the target's HF config (no weights), the draft's shape, the objective
(block size, anchor rule, fixed anchors), the batch layout (rows, row length, document lengths) and the run
settings (precision, draft activation checkpointing, attention path, world size). Attention paths
(``Settings.attention``; ``attention_path`` maps a device and ``DFlashModel.attention_backend`` to one), as
``dflash_lab.model.attention.attend`` runs them:

* ``flex`` (training on GPU): flex_attention under block masks for the draft and for packed target rows: no mask
  tensor, keys/values at the kv head count; flex saves its (flattened) q, k, v, output and log-sum-exp.
* ``segments`` (training on CPU): the draft runs one SDPA per run of blocks sharing a context start (per document
  of a packed row; the block at a document's first position, which has no context, is its own run) on that run's
  keys only; rows holding one document run one SDPA on the row. SDPA saves a float copy (c bytes) of each mask;
  runs save their concatenated keys/values, and a packed row's output concatenated from runs is copied once more.
  The boolean run masks (1 byte per element) are built once per step. The target runs as on GPU.
* ``dense`` (the oracle backend): one Q x K mask per row and draft layer, a dense T x T document mask in the target.

Symbols (per rank and step). Shapes: target hidden Ht, layers read Lr (deepest read layer + 1), n read layers,
MLP width It, vocabulary V, heads ht / kv heads gt of width d; draft hidden H, layers L, heads h, kv heads g,
MLP width I; block size bs. Batch: R rows of T tokens (padded layout: one document per row, T = longest;
packed: one row, T = its used length), documents of length l. Anchors of a document:
a(l) = anchor_quota(l - 1) (``dflash_lab.model.objective``: every token but the last may anchor when the whole
document is supervised, the conservative case). N = anchor slots per row (padded: the row maximum; packed: the
row's sum), Q = N bs block tokens, K = T + Q keys of the draft, S = supervised slots,
S = sum_docs a(l) m(l) with m(l) = mean over anchor positions of min(bs - 1, tokens after the anchor).
Segments, per document of a packed row (expectations under the uniform anchor draw): p0 = a / (l - 1) (first
position anchored), q_run = bs (a - p0) queries on k_run = a l / (a + 1) - 1 + q_run keys (context up to the last
anchor, then the run's blocks); M = sum_docs (p0 bs^2 + q_run k_run) mask elements, Kc = sum_docs k_run copied
keys, Qc = Q, and w = 1 - prod_docs (1 - p0) the chance that some run attends to a view of the layer's whole keys
and values (keeping them: the 2 c K g d term); a row of one document: M = Q K, Kc = Qc = 0, w = 1.

Bytes: c = element size of the compute dtype (2 under bf16 autocast, 4 in fp32), f = 4 (float32 statistics and
the float32 upcasts inside RMSNorm). RMSNorm returns the compute dtype, so every projection's input is already in
it (autocast makes no activation copies). e = the float32 copy of its input an eager RMSNorm saves: f with eager
pieces, 0 when the draft's RMSNorm/rope/MLP are compiled (``StepModel.compiled_layers``, decided by the rule the
draft uses, ``dflash_lab.model.draft.compiles_layers``: ``compile_layers: auto`` compiles on CUDA); m = the
SwiGLU's saved Q x I tensors: 4 eager (gate, silu, up, product), 3 compiled.

    static    = P_target ct + P_draft (4 weights + 8 AdamW moments) [+ 4 P_draft DDP buckets when W > 1]
    draft     = 2 (L P_layer + P_fc) autocast weight casts (bf16; saved by their matmuls)
              + R T n Ht c                                   features (saved by fc)
              + R T (Ht (e + c) + f)                         context norm
              + 2 R (Q + K) d c                              rotary tables
              + 29 R Q + 25 R T                              block ids/positions/labels/weights; the batch
              + (R [Q (2(e+c) + 2c) H + m c Q I + (e + 3c) Q h d + 2f Q h + 2f Q
                   + c K H + (e + c) K g d + f K g + 2 c K g d] + extra) x L - R Q H e [+ f R Q compiled]
                                                             saved, per draft layer (the first layer's input, the
                                                             frozen embeddings, needs no grad)
                extra: flex 0; segments c (M + 2 Kc g d + Qc h d) - (1 - w) 2 c R K g d; dense c R Q K
              + max(head moment, layer moment)               (autograd frees a node's saved tensors once it ran)
                head moment (up to the head's backward):
                  R Q (H (e + c) + f)                        final norm
                  + head: S H c (one-pass: the input gradient per unit loss; fused: the hidden slots)
                  + max(head transient, segments: the M boolean run masks of the forward)
                  head transient: one chunk of s = min(S, CE_CHUNK_ELEMENTS / V) rows: one-pass s V (c + f)
                  (float32 logits, softmax in place, beside the matmul's output or the cast back; fp32: s V f)
                  + S H c (its input, the gathered hidden slots, alive while it runs), fused s V f
                  [+ 4 P_draft gradients of earlier micro-batches when grad_accum > 1]
                layer moment (the last draft layer's backward; the head's and final norm's tensors freed):
                  4 P_layer: that layer's gradients (no other layer has any yet)
                  + [checkpointing: the layer's saved tensors, recomputed]
                  + max(MLP stage, attention stage): its MLP's backward transient, then (the MLP's saved tensors
                  freed) its attention's: R K (H + 2 g d) c
                  MLP transient, eager: R Q (2 I + 2 H) c (the product's and its factors' grads with the product
                  released) + H I c (one weight's bf16 grad before it is accumulated);
                  compiled: R Q (3 I + H) c, checkpointed R Q (2 I + H) c (one backward graph: its node holds the
                  saved product to the end unless checkpointing handed the graph the only reference)
                  + 3 H I c (the graph's three bf16 weight grads)
    checkpointed draft layers save only their input (R Q H c each) and recompute one layer in backward.
    optimizer = 8 P_draft: the gradients and AdamW's foreach temporaries (the activations are gone)
    Checked against the CPU allocator's peak of real fp32 steps, eager and compiled, with and without checkpointing
    (tests/test_footprint.py::test_predicted_peak_is_within_10_percent_of_the_allocators), the bytes autograd
    saves (::test_saved_activations_match_autograd, within 3%), and an H200's bf16 steps at the Qwen3-8B shape
    (tests/test_gpu_repredict.py: 0.99-1.02 of the measured peak without checkpointing, 1.02-1.09 with it).
    target    = 2 R T n Ht c (captured features + their concatenation) + one layer's no-grad transient
                R T (Ht (2c + f) + 2 (h + 2g) d c + 3 It c) [dense: + R T T (1 + c) document mask]
    peak      = static + max(target, draft, optimizer)
    reserved  = peak + FRAGMENTATION_FRACTION (peak - static)    the CUDA caching allocator's fragments (measured:
                                                                 docs/gpu.md "Fragmentation and expandable segments")
    planned   = max(peak, USABLE_FRACTION (reserved + CUDA_CONTEXT_GIB))   on CUDA (the peak on a CPU): what every
                fit compares with USABLE_FRACTION of the GPU: the peak within 90%, the reserved memory and the
                context within all of it
The fixed-anchor pass (``fixed_anchors`` = k blocks per document, no grad) runs after the training forward, while
its saved tensors are alive; its transient (one layer over the context keys and k bs block tokens per document,
the LM head on its few slots) is smaller than the backward transient of the training blocks, so it adds no term.

FLOPs (model FLOPs: the real work of a step, no padding, no recomputation; one multiply-add = 2 FLOPs):

    target    = Lr [2 P_layer sum_docs l + 4 ht d sum_docs l (l + 1) / 2]         forward only, no grad
    draft     = 3 L [2 A bs (2 H h d + 2 H g d + 3 H I) + 4 H g d sum_docs l
                     + 4 h d (bs sum_anchors p + A bs^2)]                         forward + backward
              + 2 x 2 n Ht H sum_docs l                                           fc: forward + weight grad
              + 2 x 2 H V S                                                       LM head: forward + input grad
                (the one-pass head runs exactly these; the fused op's argmax pass and backward recompute,
                2 H V S more, are recomputation)
    fixed     = L [the draft layer term with Af, pf] + 2 H V Sf                   fixed anchors: forward only
with A valid anchors, p an anchor's position in its document (visible context keys, mean (l - 2) / 2); Af =
sum_docs min(k, l - 1) fixed anchors, pf their positions, Sf their supervised slots (the fixed pass reuses the
projected context; its keys/values are recomputed). ``attention`` reports the query-key-pair part of the total.
MFU = step FLOPs / (step time x peak FLOP/s).

Cost: O(number of batches) numpy; no tensors are built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from dflash_lab.model.head import FUSED_AVAILABLE

GIB = float(2**30)
USABLE_FRACTION = 0.9   # of a GPU's memory a step's allocated peak may take (the rest: workspaces, the model's error)
# The CUDA caching allocator's fragments per byte of a step's activations (its peak less the weights and optimizer
# state, allocated once before any step): the largest ratio in the first H200 run's six out-of-memory lines
# (benchmarks/data/h200-2026-12-04/seed.jsonl, no expandable segments: "reserved by PyTorch but unallocated"
# 1.48-8.73 GiB, 2.2-14.6% of the activations allocated when the step failed; the largest, packed step 0: 8.73 GiB
# of 59.98). tests/test_gpu_repredict.py re-derives it from those lines.
FRAGMENTATION_FRACTION = 0.146
# Memory a CUDA process holds outside the caching allocator (its context, loaded kernels): the same six lines'
# "this process has X GiB memory in use" less what PyTorch reserved, 0.74 GiB in each (H200, torch 2.11, CUDA 13).
CUDA_CONTEXT_GIB = 0.74
ALLOCATORS = ("cuda", "cpu")
PRECISIONS = ("bf16", "fp32")
HEAD_PATHS = ("one_pass", "fused", "reference")   # StepModel.head_ce
ATTENTION_PATHS = ("flex", "segments", "dense")


def gpu_use(peak_gb: float, gpu_mem_gb: float) -> str:
    """How much of the GPU the worst step uses, in words (the planner's and the trainer's preflight line).

    Example:
        >>> print(gpu_use(124.2, 139.8))
        worst step 124.2 GiB of the GPU's 139.8 (89%; the plan may use 90%, 125.8)
    """
    return (f"worst step {peak_gb:.1f} GiB of the GPU's {gpu_mem_gb:.1f} ({peak_gb / gpu_mem_gb:.0%}; the plan may "
            f"use {USABLE_FRACTION:.0%}, {USABLE_FRACTION * gpu_mem_gb:.1f})")


class PreflightError(ValueError):
    """A training config whose predicted peak memory exceeds the GPU's; the message names the fix."""


@dataclass(frozen=True)
class TargetDims:
    """Shape of the frozen target (from its HF config.json)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> "TargetDims":
        """From a ``transformers`` config object or a config.json dict.

        Example:
            >>> TargetDims.from_hf_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            ...                            "intermediate_size": 128, "vocab_size": 100}).head_dim
            16
        """
        get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
        heads = int(get("num_attention_heads"))
        return cls(hidden=int(get("hidden_size")), layers=int(get("num_hidden_layers")), heads=heads,
                   kv_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
                   intermediate=int(get("intermediate_size")), vocab=int(get("vocab_size")),
                   tied=bool(get("tie_word_embeddings", False)))

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matrix multiplies (q, k, v, o, gate, up, down)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        """All parameters (embedding, layers with their norms, final norm, LM head unless tied)."""
        layer = self.layer_matmul_params + 2 * self.hidden + 2 * self.head_dim
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * layer + self.hidden + head


@dataclass(frozen=True)
class DraftDims:
    """Shape of the DFlash draft (dflash_lab.model.draft.DraftConfig)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    target_layer_ids: tuple[int, ...]
    target_hidden: int

    @classmethod
    def from_draft_config(cls, cfg: Any) -> "DraftDims":
        return cls(hidden=cfg.hidden_size, layers=cfg.num_layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, intermediate=cfg.intermediate_size,
                   target_layer_ids=tuple(cfg.target_layer_ids),
                   target_hidden=cfg.target_hidden_size or cfg.hidden_size)

    @property
    def layer_matmul_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate

    @property
    def fc_params(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden * self.hidden

    @property
    def params(self) -> int:
        """fc, hidden norm, layers (with q/k norms and two RMSNorms), final norm."""
        layer = self.layer_matmul_params + 2 * self.hidden + 2 * self.head_dim
        return self.fc_params + self.hidden + self.layers * layer + self.hidden


@dataclass(frozen=True)
class StepModel:
    """Everything the footprint needs about the model: target and draft shapes and the block objective."""

    target: TargetDims
    draft: DraftDims
    block_size: int
    anchors_per_doc: int | None
    anchor_density: float | None
    fixed_anchors: int = 0      # blocks per document of the no-grad fixed-anchor pass (0: no such pass)
    head_ce: str = "one_pass"   # how the LM head + CE run with gradients (dflash_lab.model.head): one_pass (what
    #                             training runs unless ``fused_head_ce=True``), fused (torch's linear_cross_entropy)
    #                             or reference (checkpointed chunks: what runs before the one-pass head existed)
    compiled_layers: bool = True   # the draft's RMSNorm/rope/MLP compiled (``compile_layers``; auto: on CUDA, which
    #                                the planner's default prices): they save less for backward (module docstring)

    def __post_init__(self) -> None:
        if self.head_ce not in HEAD_PATHS:
            raise ValueError(f"head_ce={self.head_ce!r}: choose one of {', '.join(HEAD_PATHS)}")

    @property
    def layers_read(self) -> int:
        """Target layers a training step runs (up to the deepest one the draft reads)."""
        return max(self.draft.target_layer_ids) + 1

    @classmethod
    def from_model_config(cls, model_cfg: Mapping[str, Any], device_type: str = "cuda") -> "StepModel":
        """From the plain keys of ``conf/model/<name>.yaml``; the target needs only its config (no weights).
        ``device_type``: where the step runs (``model.compile_layers: auto`` compiles the draft's pieces on CUDA).

        Example:
            >>> from dflash_lab.presets import preset
            >>> m = StepModel.from_model_config(preset("model", "tiny"))
            >>> m.target.hidden, m.draft.layers, m.draft.target_layer_ids
            (64, 1, (2,))
        """
        from dflash_lab.model.build import draft_config_for_target, target_config_only
        from dflash_lab.model.draft import compiles_layers

        config = target_config_only(**dict(model_cfg))
        draft_cfg = draft_config_for_target(
            config, draft_layers=int(model_cfg["draft_layers"]), target_layer_ids=model_cfg["target_layer_ids"],
            draft_intermediate_size=model_cfg["draft_intermediate_size"])
        return cls(TargetDims.from_hf_config(config), DraftDims.from_draft_config(draft_cfg),
                   block_size=int(model_cfg["block_size"]),
                   anchors_per_doc=_optional_int(model_cfg["anchors_per_doc"]),
                   anchor_density=_optional_float(model_cfg["anchor_density"]),
                   fixed_anchors=int(model_cfg["fixed_anchors"]),
                   compiled_layers=compiles_layers(model_cfg["compile_layers"], device_type))

    @classmethod
    def from_model(cls, model: Any) -> "StepModel":
        """From a built ``DFlashModel`` (what the trainer holds before step 1)."""
        from dflash_lab.model.draft import compiles_layers

        device_type = next(model.draft.parameters()).device.type
        return cls(TargetDims.from_hf_config(model.target.config), DraftDims.from_draft_config(model.draft.cfg),
                   block_size=model.block_size, anchors_per_doc=model.anchors_per_doc,
                   anchor_density=model.anchor_density, fixed_anchors=model.fixed_anchors,
                   head_ce="fused" if model.uses_fused_head() and FUSED_AVAILABLE else "one_pass",
                   compiled_layers=compiles_layers(model.draft.compile_layers, device_type))


@dataclass(frozen=True)
class Settings:
    """How the step runs: ``precision`` bf16 (autocast, bf16 target) or fp32; draft activation checkpointing;
    ``attention``: the draft's attention path (``attention_path``): flex (GPU), segments (CPU training) or dense
    (the oracle backend); ``world_size`` > 1 adds DDP's gradient buckets; ``allocator``: whose memory the step
    uses, ``cuda`` (the caching allocator: the plan reserves its fragmentation margin and the CUDA context beside
    the peak, ``step_memory``'s ``planned``) or ``cpu`` (the peak alone)."""

    precision: str = "bf16"
    activation_checkpointing: bool = False
    attention: str = "flex"
    world_size: int = 1
    grad_accum: int = 1     # micro-batches per optimizer step: above 1, earlier micro-batches' gradients are alive
    allocator: str = "cuda"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator={self.allocator!r}: choose one of {', '.join(ALLOCATORS)}")
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention={self.attention!r}: choose one of {', '.join(ATTENTION_PATHS)}")


def attention_path(device_type: str, backend: str = "auto") -> str:
    """The ``Settings.attention`` of a training step on ``device_type`` with ``DFlashModel.attention_backend``.

    ``auto`` (training) runs the draft under flex_attention on CUDA and per-document SDPA on CPU (``segments``;
    one dense SDPA for rows that hold one document), as ``dflash_lab.model.attention.attend`` chooses.

    Example:
        >>> attention_path("cuda"), attention_path("cpu"), attention_path("cpu", "dense")
        ('flex', 'segments', 'dense')
    """
    if backend == "auto":
        return "flex" if device_type == "cuda" else "segments"
    if backend not in ATTENTION_PATHS:
        raise ValueError(f"attention backend {backend!r}: choose one of auto, {', '.join(ATTENTION_PATHS)}")
    return backend


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


# ----------------------------------------------------------------------------------------------- batch shapes


def batch_shapes(batches: Sequence[np.ndarray], lengths: np.ndarray, *, packed: bool,
                 model: StepModel, anchors: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per batch: the layout numbers the formulas read (arrays of one value per batch).

    Args:
        batches: dataset indices of each batch (a policy's plan).
        lengths: effective document lengths (``policy.lengths``).
        packed: True when a batch is one packed row.
        model: the step model (block size and anchor rule).
        anchors: anchors of each sample (indexed like ``lengths``; ``policy_anchors``: the plan's block tokens /
            block size, i.e. the rule on the data's own valid positions under the block budget). None: the rule
            on ``l - 1`` valid positions (every token supervised, the conservative case).

    Returns:
        ``rows`` R, ``row_len`` T, ``slots`` N, ``anchors`` A, ``supervised`` S, ``real`` (tokens),
        ``sq_half`` (sum l (l + 1) / 2, causal target attention pairs), ``context_pairs`` (sum over anchors of
        the context keys they see, times bs); the fixed-anchor pass's ``fixed_anchors`` Af, ``fixed_supervised``
        Sf and ``fixed_context_pairs``; the CPU draft attention's (``segments``) mask elements per layer
        ``segment_pairs`` and keys copied per layer ``segment_keys``.

    Example:
        >>> from dflash_lab.presets import preset
        >>> m = StepModel.from_model_config(preset("model", "tiny", block_size=4, anchors_per_doc=2,
        ...                                        anchor_density=None))
        >>> s = batch_shapes([np.array([0, 1])], np.array([10, 3]), packed=False, model=m)
        >>> int(s["rows"][0]), int(s["row_len"][0]), int(s["slots"][0]), int(s["anchors"][0])
        (2, 10, 2, 4)
    """
    from dflash_lab.metrics.throughput import batch_sizes, flat_token_counts
    from dflash_lab.model.objective import anchor_quota

    sizes = batch_sizes(batches)
    order = np.concatenate(batches) if len(batches) else np.zeros(0, np.int64)   # once: the plan's bulk cost
    flat = np.asarray(lengths)[order].astype(np.int64)
    counts = flat_token_counts(flat, sizes, packed=packed)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    bs = model.block_size
    valid = np.maximum(flat - 1, 0)
    if anchors is None:
        quota = anchor_quota(torch.from_numpy(valid), model.anchors_per_doc, model.anchor_density).numpy()
        quota = quota.astype(np.int64)
    else:
        quota = np.asarray(anchors, dtype=np.int64)[order]
    targets = _mean_targets_per_anchor(flat, bs)
    context = quota * np.maximum(flat - 2, 0) / 2.0
    fixed = np.minimum(valid, model.fixed_anchors)
    anchors = np.add.reduceat(quota, starts)
    rows = np.ones_like(sizes) if packed else sizes
    slots = np.maximum(anchors if packed else np.maximum.reduceat(quota, starts), 1)
    row_len = counts.padded // rows
    # CPU draft attention (``segments``): rows of one document run one SDPA on the row's Q x K mask; a packed row
    # of several documents runs one SDPA per run of blocks sharing a context start: the block at a document's
    # first position (no context: its own block only) and the document's other blocks, whose keys are the context
    # up to the last anchor and their own blocks (copied into one tensor). Expected sizes under a uniform draw.
    first = np.where(valid > 0, quota / np.maximum(valid, 1), 0.0)           # P(first position anchored)
    last_anchor = np.where(quota > 0, quota * flat / (quota + 1.0) - 1.0, 0.0)   # E[max anchor] (doc-relative)
    run_queries = bs * (quota - first)
    run_keys = np.where(run_queries > 0, last_anchor + run_queries, 0.0)
    single = sizes == 1 if packed else np.ones_like(sizes, dtype=bool)
    q_len = slots * bs
    dense_pairs = rows * q_len * (row_len + q_len)
    segment_pairs = np.where(single, dense_pairs, np.add.reduceat(first * bs * bs + run_queries * run_keys, starts))
    segment_keys = np.where(single, 0.0, np.add.reduceat(run_keys, starts))
    segment_queries = np.where(single, 0.0, rows * q_len)   # queries whose output is concatenated from runs
    # A run on one key piece (a first-position block: its own block only) attends to a view of the layer's keys and
    # values, which keeps them whole; other runs attend to copies. P(some document's first position anchored):
    segment_whole_kv = np.where(single, 1.0, 1.0 - np.multiply.reduceat(1.0 - first, starts))
    return {"rows": rows, "row_len": row_len, "slots": slots, "anchors": anchors,
            "supervised": np.add.reduceat(quota * targets, starts), "real": counts.real,
            "sq_half": np.add.reduceat(flat * (flat + 1) / 2.0, starts),
            "context_pairs": bs * np.add.reduceat(context, starts),
            "fixed_anchors": np.add.reduceat(fixed, starts),
            "fixed_supervised": np.add.reduceat(fixed * targets, starts),
            "fixed_context_pairs": bs * np.add.reduceat(fixed * np.maximum(flat - 2, 0) / 2.0, starts),
            "segment_pairs": segment_pairs, "segment_keys": segment_keys, "segment_queries": segment_queries,
            "segment_whole_kv": segment_whole_kv}


def _mean_targets_per_anchor(lengths: np.ndarray, block_size: int) -> np.ndarray:
    """Mean over anchor positions t = 0..l-2 of min(bs - 1, l - 1 - t): labelled slots of a random anchor."""
    m, n = block_size - 1, np.maximum(lengths - 1, 1).astype(np.float64)
    total = np.where(n <= m, n * (n + 1) / 2, m * (m + 1) / 2 + m * (n - m))
    return total / n


# --------------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class _Sizes:
    """The symbols of the module docstring for a set of batches (arrays) and the step's byte sizes."""

    R: np.ndarray
    T: np.ndarray
    Q: np.ndarray
    K: np.ndarray
    S: np.ndarray
    c: float        # compute dtype bytes
    f: float        # float32 bytes
    copy: float     # the float32 copy an eager RMSNorm saves of its input (0 when the pieces are compiled)

    @classmethod
    def of(cls, model: StepModel, shapes: Mapping[str, np.ndarray], settings: Settings) -> "_Sizes":
        autocast = settings.precision == "bf16"
        c, f = (2.0, 4.0) if autocast else (4.0, 4.0)
        R = shapes["rows"].astype(np.float64)
        T = shapes["row_len"].astype(np.float64)
        Q = shapes["slots"].astype(np.float64) * model.block_size
        return cls(R, T, Q, T + Q, shapes["supervised"].astype(np.float64), c, f,
                   0.0 if model.compiled_layers else f)


def _target_phase(model: StepModel, z: _Sizes, dense: bool) -> tuple[np.ndarray, np.ndarray]:
    """(captured features, the target phase: features + their concatenation + one layer's no-grad transient)."""
    t, c, f = model.target, z.c, z.f
    features = z.R * z.T * len(model.draft.target_layer_ids) * t.hidden * c
    transient = z.R * z.T * (t.hidden * (2 * c + f) + 2 * (t.heads + 2 * t.kv_heads) * t.head_dim * c
                             + 3 * t.intermediate * c)
    if dense:
        transient = transient + z.R * z.T * z.T * (1 + c)
    return features, 2 * features + transient


def _attention_saved(model: StepModel, z: _Sizes, shapes: Mapping[str, np.ndarray], attention: str):
    """(the layer's whole keys and values as attention saves them, the path's extra saved bytes) per layer.

    Beyond the q/k/v/output/log-sum-exp every path keeps: flex nothing more; dense the float copy of the Q x K
    mask SDPA makes; segments that copy of each run's mask, each run's concatenated keys and values, and (rows of
    several documents) the output concatenated from the runs, copied again into o_proj's input layout. The whole
    keys and values (2 c K g d) are saved by flex and dense, by segments only while some run attends to a view of
    them (``segment_whole_kv``, the expected share)."""
    d, c = model.draft, z.c
    hd, gd = d.heads * d.head_dim, d.kv_heads * d.head_dim
    whole_kv = 2 * c * z.K * gd
    if attention == "dense":
        return whole_kv, z.R * c * z.Q * z.K
    if attention == "segments":
        return whole_kv * shapes["segment_whole_kv"], c * (shapes["segment_pairs"] + 2 * shapes["segment_keys"] * gd
                                                           + shapes["segment_queries"] * hd)
    return whole_kv, 0.0


def _layer_saved(model: StepModel, z: _Sizes, shapes: Mapping[str, np.ndarray], attention: str):
    """(what one draft layer saves for backward, of which its MLP half) per the module docstring.

    Eager pieces save each RMSNorm's float32 copy of its input (``copy``) and the SwiGLU's four Q x I tensors;
    compiled pieces (AOTAutograd's partition) save the norm's input and its per-token statistics instead, and
    three of the MLP's (measured: tests/test_footprint.py)."""
    d, c, f, copy = model.draft, z.c, z.f, z.copy
    H, I, hd, gd = d.hidden, d.intermediate, d.heads * d.head_dim, d.kv_heads * d.head_dim
    mlp_units = 3 * c if model.compiled_layers else 4 * c
    whole_kv, extra = _attention_saved(model, z, shapes, attention)
    mlp = z.R * z.Q * (H * (copy + c) + mlp_units * I + f)    # post-attention norm + SwiGLU
    rest = z.R * (z.Q * H * (copy + c + 2 * c) + (copy + 3 * c) * z.Q * hd + 2 * f * z.Q * d.heads + f * z.Q
                  + c * z.K * H + (copy + c) * z.K * gd + f * z.K * d.kv_heads + whole_kv) + extra
    return mlp + rest, mlp


def _layer_backward(model: StepModel, z: _Sizes, dense: bool, checkpointed: bool):
    """(MLP, attention) transients of a layer's backward: its MLP runs first, then its attention (the grads of the
    keys/values and of [context ; block]).

    MLP, eager: the grads of the SwiGLU product and of its two factors (3 Q I) while down_proj's backward has
    released the product it saved (- Q I), and the block hidden states' grads (2 Q H). Compiled: one backward graph,
    the product's grad with the factors' (3 Q I) and the incoming grad (Q H); the saved product is released within
    the graph only under checkpointing (- Q I: the graph then holds the only reference to the recomputed tensors;
    otherwise its autograd node holds them to the end). Under autocast the weights' bf16 grads are alive until they
    are accumulated into the float32 ``.grad``: one matrix at a time eager, the MLP's three (graph outputs)
    compiled."""
    d, c, f = model.draft, z.c, z.f
    H, I = d.hidden, d.intermediate
    if model.compiled_layers:
        mlp = z.R * z.Q * ((2 if checkpointed else 3) * I + H) * c + (3 * H * I * c if c < f else 0.0)
    else:
        mlp = z.R * z.Q * (2 * I + 2 * H) * c + (H * I * c if c < f else 0.0)
    attention = z.R * z.K * (d.hidden + 2 * d.kv_heads * d.head_dim) * c
    if dense:
        attention = attention + z.R * z.Q * z.K * c
    return mlp, attention


def _head_terms(model: StepModel, z: _Sizes) -> tuple[np.ndarray, np.ndarray]:
    """(what the LM head saves, its transient) for the step's supervised slots."""
    from dflash_lab.model.dflash import DFlashModel

    vocab, H, c, f = model.target.vocab, model.draft.hidden, z.c, z.f
    chunk = max(1, DFlashModel.CE_CHUNK_ELEMENTS // vocab)
    if model.head_ce == "fused":
        # F.linear_cross_entropy saves its inputs only (hidden slots, head weight, labels) and recomputes one
        # chunk of logits at a time in backward (accumulation dtype f); the argmax pass needs no more.
        return z.S * H * c, np.minimum(z.S, chunk) * vocab * f
    if model.head_ce == "reference":
        chunked = z.S * vocab > DFlashModel.CE_CHUNK_ELEMENTS
        # Logits of one chunk: recomputed (logits, float32 copy under autocast, log-probabilities) and their
        # grads. fp32: ``.float()`` is the logits themselves and nothing saves them: log-probabilities, their grad
        # and the logits' grad, 3 f (measured: benchmarks/gpu_check.py --shape medium).
        per_logit = 2 * c + 4 * f if c < f else 3 * f
        saved = z.S * H * c + np.where(chunked, 0.0, 4.0 * z.S * vocab)
        return saved, np.where(chunked, np.minimum(z.S, chunk) * vocab * per_logit, z.S * vocab * (per_logit - f))
    # The one-pass head saves the input gradient per unit loss (S x H); one chunk of float32 logits is alive in the
    # forward (the softmax in place), beside either the matmul's output in the compute dtype (before ``.float()``)
    # or the softmax's cast back (before the gradient matmul), never both (fp32: the one tensor); and the hidden
    # slots gathered for the head (S x H, its input: not saved, alive while it runs).
    per_logit = c + f if c < f else f
    return z.S * H * c, np.minimum(z.S, chunk) * vocab * per_logit + z.S * H * c


def step_memory(model: StepModel, shapes: Mapping[str, np.ndarray], settings: Settings) -> dict[str, np.ndarray]:
    """Bytes per term of the module docstring, and ``peak``, for each batch in ``shapes``.

    Example:
        >>> from dflash_lab.presets import preset
        >>> m = StepModel.from_model_config(preset("model", "tiny"))
        >>> s = batch_shapes([np.arange(4)], np.full(4, 100), packed=True, model=m)
        >>> mem = step_memory(m, s, Settings(precision="fp32"))
        >>> bool(mem["peak"][0] > mem["static"][0] > 0)
        True
    """
    t, d = model.target, model.draft
    z = _Sizes.of(model, shapes, settings)
    c, f, R, Q, T, H = z.c, z.f, z.R, z.Q, z.T, d.hidden
    dense = settings.attention == "dense"
    ckpt = settings.activation_checkpointing

    terms: dict[str, Any] = {}
    terms["target_weights"] = t.params * c
    terms["draft_weights_optimizer"] = d.params * 12.0
    terms["ddp_buckets"] = d.params * 4.0 if settings.world_size > 1 else 0.0
    static = terms["target_weights"] + terms["draft_weights_optimizer"] + terms["ddp_buckets"]
    features, terms["target_phase"] = _target_phase(model, z, dense)

    layer_saved, mlp_saved = _layer_saved(model, z, shapes, settings.attention)
    # the first layer's input (the frozen embeddings) needs no grad: its norm saves no float32 copy; compiled, it
    # saves the input's per-token statistics
    first_layer = -R * Q * H * z.copy + (f * R * Q if model.compiled_layers else 0.0)
    # checkpointed layers save only their input; one layer's tensors are recomputed at its backward (layer moment)
    layers = d.layers * R * Q * H * c if ckpt else d.layers * layer_saved + first_layer
    head_saved, head_transient = _head_terms(model, z)
    mlp_backward, attention_backward = _layer_backward(model, z, dense, ckpt)
    layer_params = d.layer_matmul_params + 2 * d.hidden + 2 * d.head_dim
    # Gradients exist from the backward on, as autograd makes them: none at the head's backward (zero_grad frees
    # them; with grad_accum > 1 the earlier micro-batches' are there), one layer's at the first layer's backward
    # (the last layer's, which holds the layer moment), all of them (with AdamW's foreach temporaries, one more
    # copy) at the optimizer step. Under autocast the bf16 casts of the weights are saved by their matmuls.
    accumulated = d.params * 4.0 if settings.grad_accum > 1 else 0.0
    terms["weight_casts"] = 2.0 * (d.layers * d.layer_matmul_params + d.fc_params) if c < f else 0.0
    terms["features"] = features
    terms["context_and_rope"] = R * T * (H * (z.copy + c) + f) + 2 * R * (Q + z.K) * d.head_dim * c
    terms["objective"] = R * Q * 29.0 + R * T * 25.0   # block ids/positions/labels/weights; batch tensors
    # segments: the boolean run masks, built once per step and shared by every layer (dense rows: one per layer);
    # they live during the draft forward only (freed with the key intervals before the backward's transients)
    terms["attention_masks"] = shapes["segment_pairs"] * 1.0 if settings.attention == "segments" else 0.0
    terms["draft_layers"] = layers
    terms["final_norm_and_head"] = R * Q * (H * (z.copy + c) + f) + head_saved
    terms["backward_transient"] = np.maximum(head_transient, np.maximum(mlp_backward, attention_backward))
    # The draft's peak is at one of two moments. Up to the head's backward: every layer's saved tensors
    # (checkpointed: their inputs), the final norm's and head's, and the larger of the forward's run masks and
    # the head's transient. At the last layer's backward the head and final norm have freed theirs (autograd
    # frees a node's saved tensors once it ran); the layer's own saved tensors are there (checkpointed: recomputed
    # for it) with its MLP's backward transient, then (its MLP's tensors freed) its attention's.
    terms["head_moment"] = (accumulated + terms["final_norm_and_head"]
                            + np.maximum(terms["attention_masks"], head_transient))
    own = layer_saved if ckpt else 0.0
    terms["layer_moment"] = max(accumulated, 4.0 * layer_params) + np.maximum(
        own + mlp_backward, own - mlp_saved + attention_backward)
    draft_phase = (terms["weight_casts"] + features + terms["context_and_rope"] + terms["objective"] + layers
                   + np.maximum(terms["head_moment"], terms["layer_moment"]))
    terms["optimizer_moment"] = 8.0 * d.params   # gradients + AdamW's foreach temporaries
    terms["static"] = static
    terms["draft_phase"] = draft_phase
    terms["peak"] = static + np.maximum(np.maximum(terms["target_phase"], draft_phase), terms["optimizer_moment"])
    # What the plan fits (``planned``, against USABLE_FRACTION of the GPU): the allocated peak, and beside it the
    # memory the CUDA caching allocator reserves (``reserved``: the peak + its fragments, FRAGMENTATION_FRACTION of
    # the activations) with the CUDA context, which must fit the whole GPU (scaled here to the usable fraction).
    cuda = settings.allocator == "cuda"
    terms["fragmentation"] = FRAGMENTATION_FRACTION * (terms["peak"] - static) if cuda else 0.0
    terms["reserved"] = terms["peak"] + terms["fragmentation"]
    terms["planned"] = (np.maximum(terms["peak"], USABLE_FRACTION * (terms["reserved"] + CUDA_CONTEXT_GIB * GIB))
                        if cuda else terms["peak"])
    shape = np.shape(R)
    return {name: np.broadcast_to(np.asarray(value, dtype=np.float64), shape) for name, value in terms.items()}


# ---------------------------------------------------------------------------------------------------- FLOPs


def step_flops(model: StepModel, shapes: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Model FLOPs per term of the module docstring (``target``, ``draft``, ``fc``, ``head``, ``fixed``), their
    ``total``, ``attention``: the part of the total that is attention (query-key pairs), for reference, and
    ``executed``: the FLOPs the hardware runs, padding tokens and padding anchor slots of padded batches included
    (equal to ``total`` for packed rows; the step-time model prices these, MFU counts ``total``), and its parts
    ``executed_draft`` (draft layers, forward + backward) and ``executed_target`` (the target's forward over the
    layers the draft reads: what a target run off the trainer GPUs, offline or disaggregated, takes away).

    Example:
        >>> from dflash_lab.presets import preset
        >>> m = StepModel.from_model_config(preset("model", "tiny"))
        >>> s = batch_shapes([np.arange(4)], np.full(4, 100), packed=True, model=m)
        >>> fl = step_flops(m, s)
        >>> bool(fl["total"][0] == sum(fl[k][0] for k in ("target", "draft", "fc", "head", "fixed")))
        True
    """
    t, d, bs = model.target, model.draft, model.block_size
    real = shapes["real"].astype(np.float64)
    A = shapes["anchors"].astype(np.float64)
    Af = shapes["fixed_anchors"].astype(np.float64)
    target_attention = 4.0 * t.heads * t.head_dim * shapes["sq_half"]
    target = model.layers_read * (2.0 * t.layer_matmul_params * real + target_attention)

    def draft_layer(anchors, context_pairs):
        """One draft layer's forward over ``anchors`` blocks: (all FLOPs, attention FLOPs)."""
        attention = 4.0 * d.heads * d.head_dim * (context_pairs + anchors * bs * bs)
        return (2.0 * anchors * bs * d.layer_matmul_params + 4.0 * d.hidden * d.kv_heads * d.head_dim * real
                + attention), attention

    per_layer, layer_attention = draft_layer(A, shapes["context_pairs"])
    fixed_layer, fixed_attention = draft_layer(Af, shapes["fixed_context_pairs"])
    # The fixed-anchor pass: forward only (no grad), the context projection reused, its keys/values recomputed.
    runs_fixed = 1.0 if model.fixed_anchors else 0.0
    fixed_head = 2.0 * d.hidden * t.vocab * shapes["fixed_supervised"].astype(np.float64)
    out = {"target": target, "draft": 3.0 * d.layers * per_layer, "fc": 2.0 * 2.0 * d.fc_params * real,
           "head": 2.0 * 2.0 * d.hidden * t.vocab * shapes["supervised"].astype(np.float64),
           "fixed": runs_fixed * (d.layers * fixed_layer + fixed_head)}
    out["total"] = out["target"] + out["draft"] + out["fc"] + out["head"] + out["fixed"]
    # What the hardware runs: a padded batch also computes its padding tokens (target, fc, context keys/values)
    # and its padding anchor slots (rows x the row maximum; a padding slot attends to its own block only).
    padded = (shapes["rows"] * shapes["row_len"]).astype(np.float64)
    slots = (shapes["rows"] * shapes["slots"]).astype(np.float64)
    padded_pairs = np.where(padded > real, shapes["rows"] * shapes["row_len"] * (shapes["row_len"] + 1) / 2.0,
                            shapes["sq_half"])
    executed_target = model.layers_read * (2.0 * t.layer_matmul_params * padded
                                           + 4.0 * t.heads * t.head_dim * padded_pairs)
    executed_layer = (2.0 * slots * bs * d.layer_matmul_params + 4.0 * d.hidden * d.kv_heads * d.head_dim * padded
                      + 4.0 * d.heads * d.head_dim * (shapes["context_pairs"] + slots * bs * bs))
    out["executed_draft"] = 3.0 * d.layers * executed_layer   # forward + backward; checkpointing reruns 1 of 3
    out["executed_target"] = executed_target   # the target's forward: none on the trainer GPUs when it runs off them
    out["executed"] = (executed_target + out["executed_draft"] + 2.0 * 2.0 * d.fc_params * padded
                       + out["head"] + out["fixed"])
    out["attention"] = (model.layers_read * target_attention + 3.0 * d.layers * layer_attention
                        + runs_fixed * d.layers * fixed_attention)
    return {name: np.broadcast_to(np.asarray(value, dtype=np.float64), np.shape(real)) for name, value in out.items()}


# -------------------------------------------------------------------------------------------- plans and fits


def policy_anchors(policy: Any, model: StepModel) -> np.ndarray | None:
    """Anchors per sample of a policy built with block tokens (``Admission.block_tokens`` / block size), else None.

    Example:
        >>> from dflash_lab.sampling import build_policy
        >>> from dflash_lab.presets import preset
        >>> m = StepModel.from_model_config(preset("model", "tiny"))
        >>> p = build_policy("packed", np.array([50, 60]), max_tokens=128, block_tokens=np.array([16, 400]))
        >>> policy_anchors(p, m).tolist()
        [2, 50]
    """
    blocks = getattr(policy.admission, "block_tokens", None)
    return None if blocks is None else blocks // model.block_size


def plan_footprint(policy: Any, model: StepModel, settings: Settings, *, gpu_mem_gb: float,
                   epoch: int = 0) -> dict[str, Any]:
    """Predicted memory and FLOPs of a policy's epoch plan (all ranks' batches).

    Returns:
        ``pred_peak_mem_gb`` (the worst step, with ``settings``' checkpointing), ``pred_peak_mem_gb_ckpt`` (with
        draft activation checkpointing), ``pred_tflop_per_step`` (mean model TFLOPs per rank and step) and
        ``fits``: ``yes`` (fits without checkpointing), ``ckpt`` (only with it) or ``no``: the worst step's
        ``planned`` bytes (``step_memory``: the peak, and the reserved memory with the CUDA context) against
        ``USABLE_FRACTION x gpu_mem_gb`` GiB.

    Example:
        >>> from dflash_lab.sampling import build_policy
        >>> from dflash_lab.presets import preset
        >>> m = StepModel.from_model_config(preset("model", "tiny"))
        >>> plan_footprint(build_policy("packed", np.full(64, 100), max_tokens=1024), m, Settings(),
        ...                gpu_mem_gb=80)["fits"]
        'yes'
    """
    plan = policy.global_plan(epoch)
    shapes = batch_shapes(plan.batches, policy.lengths, packed=policy.packed, model=model,
                          anchors=policy_anchors(policy, model))
    plain = step_memory(model, shapes, replace(settings, activation_checkpointing=False))
    ckpt = step_memory(model, shapes, replace(settings, activation_checkpointing=True))
    budget = USABLE_FRACTION * gpu_mem_gb * GIB
    peak = ckpt if settings.activation_checkpointing else plain
    return {"pred_peak_mem_gb": float(peak["peak"].max()) / GIB, "pred_peak_mem_gb_ckpt": float(ckpt["peak"].max()) / GIB,
            "pred_tflop_per_step": float(step_flops(model, shapes)["total"].mean()) / 1e12,
            "fits": ("yes" if plain["planned"].max() <= budget else
                     ("ckpt" if ckpt["planned"].max() <= budget else "no"))}


def plan_peak_bytes(lengths: np.ndarray, sampler_cfg: Mapping[str, Any], model: StepModel, settings: Settings, *,
                    seed: int, world_size: int, epoch: int = 0, block_tokens: np.ndarray | None = None,
                    term: str = "planned") -> float:
    """The worst step's predicted bytes (bytes) of the plan ``sampler_cfg`` builds over ``lengths``: ``term``
    ``planned`` (what every fit compares with ``USABLE_FRACTION`` of the GPU, ``step_memory``), ``peak`` (the
    allocated peak) or ``reserved``.

    Example:
        >>> from dflash_lab.presets import preset
        >>> m = StepModel.from_model_config(preset("model", "tiny"))
        >>> peak = plan_peak_bytes(np.full(64, 100), {"name": "packed", "max_tokens": 1024}, m, Settings(), seed=0,
        ...                        world_size=1)
        >>> 0 < peak / GIB < 1
        True
    """
    return float(_plan_memory(lengths, sampler_cfg, model, settings, seed=seed, world_size=world_size, epoch=epoch,
                              block_tokens=block_tokens)[term].max())


def _plan_memory(lengths, sampler_cfg, model, settings, *, seed, world_size, epoch=0, block_tokens=None):
    """``step_memory`` of every step of the plan ``sampler_cfg`` builds over ``lengths``."""
    from dflash_lab.sampling import policy_from_config

    policy = policy_from_config(dict(sampler_cfg), lengths, seed=seed, world_size=world_size, rank=0,
                                block_tokens=block_tokens)
    plan = policy.global_plan(epoch)
    shapes = batch_shapes(plan.batches, policy.lengths, packed=policy.packed, model=model,
                          anchors=policy_anchors(policy, model))
    return step_memory(model, shapes, settings)


def largest_fitting_max_tokens(lengths: np.ndarray, sampler_cfg: Mapping[str, Any], model: StepModel,
                               settings: Settings, *, budget_gb: float, seed: int, world_size: int,
                               granularity: int = 512, block_tokens: np.ndarray | None = None) -> int | None:
    """The largest ``sampler.max_tokens`` (a multiple of ``granularity``, at most the configured one) whose plan's
    predicted peak is at most ``budget_gb`` GiB; None when even the smallest legal budget is over.

    The smallest legal budget holds the longest document (``overlong=error``) or one granule (truncate/drop).
    Bisection over budgets: each probe re-plans the epoch (peak memory grows with the budget).

    Example:
        >>> from dflash_lab.presets import preset
        >>> m = StepModel.from_model_config(preset("model", "tiny"))
        >>> largest_fitting_max_tokens(np.full(500, 100), {"name": "packed", "max_tokens": 4096}, m, Settings(),
        ...                            budget_gb=80, seed=0, world_size=1)
        4096
    """
    budget = budget_gb * GIB
    configured = int(sampler_cfg["max_tokens"])
    longest = int(np.max(lengths)) if sampler_cfg.get("overlong", "error") == "error" else 1
    lo = math.ceil(longest / granularity)            # in granules
    hi = configured // granularity
    if lo > hi:
        return None

    def fits(granules: int) -> bool:
        cfg = {**dict(sampler_cfg), "max_tokens": granules * granularity}
        return plan_peak_bytes(lengths, cfg, model, settings, seed=seed, world_size=world_size,
                               block_tokens=block_tokens) <= budget

    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * granularity


BLOCK_GRANULARITY = 1024   # block budgets are searched in steps of this many block tokens


def largest_fitting_block_tokens(lengths: np.ndarray, sampler_cfg: Mapping[str, Any], model: StepModel,
                                 settings: Settings, *, budget_gb: float, seed: int, world_size: int,
                                 block_tokens: np.ndarray) -> int | None:
    """The largest ``sampler.max_block_tokens`` whose plan's predicted peak is at most ``budget_gb`` GiB, at the
    configured ``sampler.max_tokens``; None when even the smallest budget that keeps the objective is over.

    The smallest budget that keeps the objective holds the document with the most block tokens (a smaller one
    would thin that document's anchors, ``cap_block_tokens``). The largest one worth searching is what the token
    budget can bring (its rows' block tokens without a block budget); a plan that fits there is returned as
    ``None``-free: the token budget binds first. Bisection in BLOCK_GRANULARITY steps; each probe re-plans.

    Example:
        >>> from dflash_lab.presets import preset
        >>> m = StepModel.from_model_config(preset("model", "tiny", anchor_density=None))
        >>> blocks = np.full(500, 8 * 64)
        >>> largest_fitting_block_tokens(np.full(500, 100), {"name": "packed", "max_tokens": 4096}, m, Settings(),
        ...                              budget_gb=80, seed=0, world_size=1, block_tokens=blocks)
        20480
    """
    budget = budget_gb * GIB
    smallest = int(np.max(block_tokens))
    from dflash_lab.sampling import policy_from_config

    unbounded = policy_from_config({**dict(sampler_cfg), "max_block_tokens": None}, lengths, seed=seed,
                                   world_size=world_size, rank=0, block_tokens=block_tokens)
    largest = max(smallest, int(max(block_tokens[b].sum() for b in unbounded.global_plan(0).batches)))

    def fits(value: int) -> bool:
        probe = {**dict(sampler_cfg), "max_block_tokens": int(value)}
        return plan_peak_bytes(lengths, probe, model, settings, seed=seed, world_size=world_size,
                               block_tokens=block_tokens) <= budget

    if not fits(smallest):
        return None
    if fits(largest):
        return largest
    lo, hi = smallest, largest   # fits(lo), not fits(hi)
    while hi - lo > BLOCK_GRANULARITY:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def preflight(model: StepModel, lengths: np.ndarray, sampler_cfg: Mapping[str, Any], settings: Settings, *,
              gpu_mem_gb: float, seed: int, epoch: int = 0,
              block_tokens: np.ndarray | None = None) -> dict[str, float]:
    """Check before step 1 that the configured run fits on the GPU; raise PreflightError naming the fix if not.

    Args:
        model: ``StepModel.from_model(dflash_model)``.
        lengths: the training split's document lengths (before the sampler's truncation).
        sampler_cfg: the run's ``sampler`` config as a plain dict (``name``, ``max_tokens``, ...).
        settings: precision, ``trainer.activation_checkpointing``, attention path, world size.
        gpu_mem_gb: memory of one GPU in GiB (the device's total when the config leaves it unset).
        seed, epoch: the plan to check (epoch 0: the shapes of later epochs follow the same distribution).
        block_tokens: per-sample block tokens (``sampling.anchors``); needed with ``sampler.max_block_tokens``.

    Returns:
        ``{"pred_peak_mem_gb": ..., "budget_gb": ...}`` when it fits.

    Raises:
        PreflightError: the message gives the predicted peak, the largest legal ``sampler.max_tokens`` and, when
            checkpointing is off and would fit, ``trainer.activation_checkpointing=true``.

    Example:
        >>> from dflash_lab.presets import preset
        >>> m = StepModel.from_model_config(preset("model", "tiny"))
        >>> cfg = {"name": "packed", "max_tokens": 1024}
        >>> round(preflight(m, np.full(64, 100), cfg, Settings(), gpu_mem_gb=80, seed=0)["budget_gb"])
        72
    """
    memory = _plan_memory(lengths, sampler_cfg, model, settings, seed=seed, world_size=settings.world_size,
                          epoch=epoch, block_tokens=block_tokens)
    peak, planned = float(memory["peak"].max()), float(memory["planned"].max())
    budget = USABLE_FRACTION * gpu_mem_gb * GIB
    if planned <= budget:
        return {"pred_peak_mem_gb": peak / GIB, "pred_reserved_mem_gb": float(memory["reserved"].max()) / GIB,
                "budget_gb": budget / GIB, "gpu_mem_gb": float(gpu_mem_gb)}
    fixes = []
    if block_tokens is not None:
        best_blocks = largest_fitting_block_tokens(lengths, sampler_cfg, model, settings, budget_gb=budget / GIB,
                                                   seed=seed, world_size=settings.world_size,
                                                   block_tokens=block_tokens)
        if best_blocks is not None:
            fixes.append(f"set sampler.max_block_tokens={best_blocks} (or auto: the largest block budget that fits)")
    best = largest_fitting_max_tokens(lengths, sampler_cfg, model, settings, budget_gb=budget / GIB, seed=seed,
                                      world_size=settings.world_size, block_tokens=block_tokens)
    if best is not None:
        fixes.append(f"set sampler.max_tokens={best} (the largest token budget that fits)")
    if not settings.activation_checkpointing:
        ckpt_settings = replace(settings, activation_checkpointing=True)
        ckpt_memory = _plan_memory(lengths, sampler_cfg, model, ckpt_settings, seed=seed,
                                   world_size=settings.world_size, epoch=epoch, block_tokens=block_tokens)
        if ckpt_memory["planned"].max() <= budget:
            fixes.append(f"or set trainer.activation_checkpointing=true (predicted "
                         f"{ckpt_memory['peak'].max() / GIB:.1f} GiB)")
        elif best is None:
            ckpt_best = largest_fitting_max_tokens(lengths, sampler_cfg, model, ckpt_settings,
                                                   budget_gb=budget / GIB, seed=seed, world_size=settings.world_size,
                                                   block_tokens=block_tokens)
            if ckpt_best is not None:
                fixes.append(f"set trainer.activation_checkpointing=true and sampler.max_tokens={ckpt_best}")
    if not fixes:
        fixes.append("no sampler.max_tokens fits: lower model.anchors_per_doc / model.anchor_density, set "
                     "sampler.max_block_tokens, or use a GPU with more memory")
    if peak > budget:
        over = (f"predicted peak GPU memory {peak / GIB:.1f} GiB per rank exceeds {budget / GIB:.1f} GiB "
                f"({USABLE_FRACTION:.0%} of gpu_mem_gb={gpu_mem_gb:g})")
    else:   # the peak fits 90%; the allocator's fragments and the CUDA context do not fit beside it
        worst = int(np.argmax(memory["planned"]))
        over = (f"predicted peak GPU memory {memory['peak'][worst] / GIB:.1f} GiB per rank + "
                f"{memory['fragmentation'][worst] / GIB:.1f} GiB fragmentation margin "
                f"({FRAGMENTATION_FRACTION:.1%} of the activations) + {CUDA_CONTEXT_GIB:g} GiB CUDA context exceeds "
                f"gpu_mem_gb={gpu_mem_gb:g}")
    raise PreflightError(f"{over} for sampler={sampler_cfg['name']} max_tokens={sampler_cfg['max_tokens']}: "
                         + "; ".join(fixes))


# ----------------------------------------------------------------------------------------------- memory plan
AUTO = "auto"


@dataclass(frozen=True)
class MemoryPlan:
    """What a run uses after ``auto`` is resolved: the block budget, draft activation checkpointing, and why."""

    max_block_tokens: int | None
    activation_checkpointing: bool
    reason: str


def _check_auto(key: str, value: Any, kind: str) -> Any:
    if value is None or value == AUTO:
        return value
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key}={value!r}: use true, false or auto")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{key}={value!r}: use a positive number of block tokens (anchors x block size, e.g. "
                         f"65536), auto (the largest that fits the GPU) or null (no block budget)")
    return int(value)


def memory_plan(model: StepModel, lengths: np.ndarray, sampler_cfg: Mapping[str, Any], settings: Settings, *,
                activation_checkpointing: Any, gpu_mem_gb: float | None, seed: int,
                block_tokens: np.ndarray | None) -> MemoryPlan:
    """Resolve ``sampler.max_block_tokens`` and ``activation_checkpointing`` (each a value or ``auto``).

    Rules (the trainer's preflight, the planner and gpu_check share them):

    * no GPU memory known (CPU training): ``auto`` block budget = none, ``auto`` checkpointing = off;
    * ``max_block_tokens: auto``: the largest block budget whose plan's predicted peak is at most 90% of the GPU
      (``largest_fitting_block_tokens``) with the checkpointing in force;
    * ``activation_checkpointing: auto``: off when the step fits without it; with an ``auto`` block budget, off
      when the budget that fits without it is at least ``RECIPE_BLOCK_TOKENS`` (a step as large as the DFlash
      reference's per GPU) or half the one that fits with it, else on. Recomputing every draft layer costs a third
      more draft FLOPs on every step; a larger step beyond the recipe's only means fewer optimizer updates per
      epoch, which no cost model counts as a gain (the H200 plans: checkpointing on cost bucketed 2.8 days of a
      6-epoch run against 2.4 off).

    Raises:
        PreflightError: nothing fits; the message names the settings tried.

    Example:
        >>> from dflash_lab.presets import preset
        >>> m = StepModel.from_model_config(preset("model", "tiny", anchor_density=None))
        >>> blocks = np.full(64, 8 * 64)
        >>> plan = memory_plan(m, np.full(64, 100), {"name": "packed", "max_tokens": 1024, "max_block_tokens": "auto"},
        ...                    Settings(), activation_checkpointing="auto", gpu_mem_gb=80, seed=0, block_tokens=blocks)
        >>> plan.max_block_tokens, plan.activation_checkpointing
        (5120, False)
    """
    value = _check_auto("sampler.max_block_tokens", sampler_cfg.get("max_block_tokens"), "int")
    ckpt = _check_auto("activation_checkpointing", activation_checkpointing, "bool")
    if value != AUTO and ckpt != AUTO:   # nothing to choose: ``preflight`` checks the fit and names the fixes
        return MemoryPlan(value, bool(ckpt), "as configured")
    if gpu_mem_gb is None:
        return MemoryPlan(None if value == AUTO else value, bool(ckpt is True),
                          "no GPU memory known: no automatic block budget, checkpointing as configured")
    if value is not None and block_tokens is None:
        raise ValueError("sampler.max_block_tokens needs per-sample block tokens (sampling.anchors)")
    budget_gb = USABLE_FRACTION * gpu_mem_gb
    candidates = [False, True] if ckpt == AUTO or ckpt is None else [bool(ckpt)]
    found: dict[bool, int | None] = {}   # the block budget each checkpointing choice fits with (absent: none)
    for choice in candidates:
        fitted = _block_budget_that_fits(value, model, lengths, sampler_cfg,
                                         replace(settings, activation_checkpointing=choice), budget_gb=budget_gb,
                                         seed=seed, block_tokens=block_tokens)
        if fitted is not _NO_FIT:
            found[choice] = fitted
        if choice is False and False in found and value != AUTO:
            break   # fits without checkpointing: never pay for recomputation
    if not found:
        tried = ", ".join(f"checkpointing {'on' if c else 'off'}" for c in candidates)
        raise PreflightError(
            f"no block budget keeps the objective within {budget_gb:.1f} GiB ({USABLE_FRACTION:.0%} of "
            f"{gpu_mem_gb:g}) for sampler={sampler_cfg['name']} max_tokens={sampler_cfg['max_tokens']} ({tried}): "
            f"lower sampler.max_tokens, set trainer.activation_checkpointing=true, use model.anchor_density, or a "
            f"GPU with more memory")
    choose, why = _choose_checkpointing(found, auto_budget=value == AUTO)
    blocks = found[choose]
    return MemoryPlan(blocks, choose, f"block budget {blocks if blocks is not None else 'none'}; {why}")


_NO_FIT = object()


def _block_budget_that_fits(value: Any, model: StepModel, lengths: np.ndarray, sampler_cfg: Mapping[str, Any],
                            settings: Settings, *, budget_gb: float, seed: int, block_tokens: np.ndarray | None):
    """With ``settings``' checkpointing: the largest block budget that fits (``value`` auto), or ``value`` itself
    if its plan fits; ``_NO_FIT`` when nothing does."""
    if value == AUTO:
        fitted = largest_fitting_block_tokens(lengths, sampler_cfg, model, settings, budget_gb=budget_gb, seed=seed,
                                              world_size=settings.world_size, block_tokens=block_tokens)
        return _NO_FIT if fitted is None else fitted
    cfg = {**dict(sampler_cfg), "max_block_tokens": value}
    peak = plan_peak_bytes(lengths, cfg, model, settings, seed=seed, world_size=settings.world_size,
                           block_tokens=block_tokens)
    return value if peak <= budget_gb * GIB else _NO_FIT


# SpecForge's Qwen3-8B DFlash recipe (examples/run_qwen3_8b_dflash_online.sh): 4 rows x 512 anchors x 16 block
# tokens per GPU step. A block budget at least this large without checkpointing is never traded for recomputation.
RECIPE_BLOCK_TOKENS = 4 * 512 * 16


def _choose_checkpointing(found: dict[bool, int | None], *, auto_budget: bool) -> tuple[bool, str]:
    """Checkpointing on or off among the choices that fit (``found``), and why (``memory_plan``'s rule)."""
    if auto_budget and len(found) == 2:
        choose = not (found[False] >= min(RECIPE_BLOCK_TOKENS, found[True] / 2))
        return choose, (f"checkpointing {'on' if choose else 'off'}: block budget {found[False]:,} without it, "
                        f"{found[True]:,} with it")
    if False in found:
        return False, "fits without draft activation checkpointing"
    return True, "draft activation checkpointing on: the step does not fit without it"
