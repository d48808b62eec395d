"""DFlashModel: frozen target + trainable draft + block objective, the one object the training loop calls.

Step (``forward(batch, generator)``):
    1. target (no grad) on the batch with per-document causal attention (packed rows: documents never see each
       other; positions restart per document) -> hidden states at ``target_layer_ids``, concatenated. Rows holding
       one document run the target's own attention (plain causal); packed rows run flex_attention under a
       document BlockMask (dflash_lab.model.attention), never a T x T mask;
    2. anchors per document from the generator, blocks [anchor, MASK...] (dflash_lab.model.objective);
    3. draft on the blocks: queries = block tokens, keys/values = [projected context ; block], each block token
       seeing its document's context before the anchor and its own block;
    4. target LM head on the supervised slots only; weighted CE, accuracy, per-slot and per-document counts. The
       head + CE run as torch's fused ``F.linear_cross_entropy`` (no S x V logits kept; argmax from a chunked
       no-grad pass), or as the chunked reference (dflash_lab.model.head).
    5. with ``fixed_anchors`` = k > 0: the draft (no grad, same weights, before the update) also scores k blocks
       per document at anchors drawn once from the example id (``objective.fixed_anchors``);
       ``StepOutput.doc_correct / doc_count`` count those blocks only, so an example's accuracy is measured on the
       same blocks at every presentation. They run as a separate no-grad pass: the loss and the gradients are
       exactly those of the training blocks alone.
Returns a StepOutput with the loss and the raw weighted CE sum / weight sum, so the loop can normalise by the
global weight across ranks and accumulation steps. ``evaluate`` (probes) scores the fixed anchors only.

Cost: one target forward (no grad, up to the deepest layer read) over R x T tokens; a draft forward/backward
over N x bs block tokens per row (N anchors); the LM head only on supervised slots (fused: 4 S H V multiply-adds,
reference: 2, 3 when chunked); fixed anchors: one no-grad
draft pass over k x bs tokens per document (its context keys/values are recomputed).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_lab.model.attention import (
    BACKENDS, TRANSFORMERS_NAME, causal_document_intervals, document_starts, register_with_transformers,
)
from dflash_lab.model.draft import DFlashDraft
from dflash_lab.model.head import head_ce
from dflash_lab.model.objective import build_blocks, default_gamma, draft_key_intervals, fixed_anchors, sample_anchors


@dataclass
class StepOutput:
    """Results of one training/eval forward. Counts are Long tensors on the batch device (no host sync)."""

    loss: torch.Tensor              # weighted_ce_sum / max(weight_sum, eps): local normalisation
    weighted_ce_sum: torch.Tensor   # sum(w * CE), carries the gradient
    weight_sum: torch.Tensor        # sum(w), no gradient
    correct: torch.Tensor           # argmax-correct supervised slots (k >= 1)
    count: torch.Tensor             # supervised slots
    per_pos_correct: torch.Tensor   # Long[bs - 1], slot k = 1..bs-1
    per_pos_count: torch.Tensor     # Long[bs - 1]
    doc_correct: torch.Tensor       # Long[D], documents in batch["sample_index"] order (fixed anchors when on)
    doc_count: torch.Tensor         # Long[D]
    num_blocks: torch.Tensor        # valid anchors (blocks) in the batch
    num_slots: int = 0              # anchor slots run (rows x the row maximum; padding slots included)

    @property
    def acc(self) -> torch.Tensor:
        """Block accuracy (0 when nothing was supervised)."""
        return self.correct.float() / self.count.clamp(min=1).float()


class _StopTarget(Exception):
    """Raised by a forward hook once the deepest needed target layer has run (later layers are skipped)."""


def capture_target_features(target, layer_ids: list[int], *, stop_early: bool, **forward_kwargs):
    """Run the target and return (outputs of decoder layers ``layer_ids`` concatenated [R, T, n*H], model output).

    Forward hooks on the chosen decoder layers record their outputs (layer i's output = HF's hidden_states[i + 1]).
    With ``stop_early`` the base model runs only up to the deepest chosen layer (the training step needs no
    logits: this skips the last layers of the target) and the model output is None. Training and decoding
    both read features through this function, so they see identical target states.
    """
    layers = getattr(target.base_model, "layers", None)
    if layers is None:  # unusual architecture: fall back to HF's hidden_states tuple
        out = (target.base_model if stop_early else target)(output_hidden_states=True, **forward_kwargs)
        return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1), (None if stop_early else out)
    captured: dict[int, torch.Tensor] = {}
    deepest = max(layer_ids)

    def hook_for(index: int):
        def hook(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
            if stop_early and index == deepest:
                raise _StopTarget
        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in sorted(set(layer_ids))]
    out = None
    try:
        out = (target.base_model if stop_early else target)(**forward_kwargs)
    except _StopTarget:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1), out


def document_attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Bool[R, 1, T, T]: causal, same document only; a padding token sees itself (no empty softmax row).

    The dense form of the target's mask: the tests' oracle and the tiny target's pretraining (256-token windows,
    with gradients: flex_attention has no CPU backward). Training steps never build it.
    """
    length = doc_ids.shape[1]
    index = torch.arange(length, device=doc_ids.device)
    causal = index[None, :] <= index[:, None]
    same_doc = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] >= 0)
    diagonal = torch.eye(length, dtype=torch.bool, device=doc_ids.device)
    return ((same_doc & causal) | diagonal)[:, None]


def _counts(index: torch.Tensor, size: int, where: torch.Tensor | None = None) -> torch.Tensor:
    """Long[size]: how many entries of ``index`` (each in [0, size)) hold each value, only those where ``where`` is
    true when given; ``torch.bincount(index[where], minlength=size)`` without a host sync.

    Example:
        >>> _counts(torch.tensor([0, 2, 2, 1]), 4, torch.tensor([True, True, False, True])).tolist()
        [1, 1, 1, 0]
    """
    ones = torch.ones_like(index) if where is None else where.to(index.dtype)
    return torch.zeros(size, dtype=torch.long, device=index.device).scatter_add_(0, index, ones)


def _single_document_rows(starts: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """Bool scalar: every row's tokens belong to one document starting at index 0 (padding after it)."""
    return ((starts == 0) | (doc_ids < 0)).all()


@contextlib.contextmanager
def _attention_implementation(target: nn.Module, name: str):
    """Run the target with attention implementation ``name`` (its config's own one is restored afterwards)."""
    config = target.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


@dataclass
class _Encoded:
    """A batch on the device with its target context: what both the training and the fixed-anchor pass use."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    sample_index: torch.Tensor
    num_docs: int
    single_document_rows: bool
    context: torch.Tensor          # the draft's projected context [R, T, H] (with grad in training)


class DFlashModel(nn.Module):
    """Frozen target + DFlash draft.

    Args:
        target: a Hugging Face causal LM (frozen here: eval mode, requires_grad False).
        draft: the DFlashDraft (its cfg.target_layer_ids name the target layers it reads).
        mask_token_id: id of the MASK token in the target vocabulary.
        block_size: tokens per block (anchor + bs - 1 predictions).
        loss_gamma: decay constant of the slot weights (None: DFlash's value for the block size).
        anchors_per_doc: anchors per document (cap when anchor_density is set).
        anchor_density: anchors per valid anchor position of a document (None: fixed anchors_per_doc).
        draft_init_seed: seed of the draft initialisation (the untrained baseline reuses it).
        fixed_anchors: blocks per document scored at fixed anchors (0: off; doc counts then come from the training
            anchors and ``evaluate`` draws anchors from its generator).
        attention_backend: ``auto`` (flex where supported, see dflash_lab.model.attention) or ``flex`` /
            ``segments`` / ``dense`` (tests and benchmarks; ``dense`` is the oracle and also gives the target
            the dense document mask).
        max_block_tokens: the step's block budget (``sampler.max_block_tokens``); a batch whose anchors exceed
            it is thinned proportionally (``objective.thin_quota``). None: no budget.
        fused_head_ce: with gradients, the LM head + CE run as torch's fused ``F.linear_cross_entropy`` (true,
            where torch has it) or in one pass (false or auto: logits computed once per chunk, CE, argmax and the
            input gradient from them; half the fused op's head FLOPs, two thirds of the checkpointed chunks', the
            same saved bytes; dflash_lab.model.head).
    """

    CE_CHUNK_ELEMENTS = 1 << 27   # logits elements the LM head holds at once (chunks above it; fused: chunk size)

    def __init__(self, target: nn.Module, draft: DFlashDraft, *, mask_token_id: int, block_size: int,
                 loss_gamma: float | None, anchors_per_doc: int | None, anchor_density: float | None,
                 draft_init_seed: int, fixed_anchors: int, attention_backend: str = "auto",
                 max_block_tokens: int | None = None, fused_head_ce: bool | str = "auto"):
        super().__init__()
        if block_size < 2:
            raise ValueError(f"model.block_size={block_size}: a block needs the anchor and at least one prediction")
        self.target = target
        self.draft = draft
        self.mask_token_id = int(mask_token_id)
        self.block_size = int(block_size)
        self.loss_gamma = float(loss_gamma) if loss_gamma is not None else default_gamma(block_size)
        self.anchors_per_doc = anchors_per_doc
        self.anchor_density = anchor_density
        if max_block_tokens is not None and int(max_block_tokens) < self.block_size:
            raise ValueError(f"sampler.max_block_tokens={max_block_tokens}: below one block ({self.block_size} "
                             f"tokens); raise it (the recipe's 512 anchors x 16 = 8192 per document)")
        # The step's block budget (the sampler's second budget): a batch over it is thinned (objective.thin_quota).
        self.max_block_tokens = None if max_block_tokens is None else int(max_block_tokens)
        self.draft_init_seed = int(draft_init_seed)
        if int(fixed_anchors) < 0:
            raise ValueError(f"model.fixed_anchors={fixed_anchors}: use 0 (off) or a number of blocks per document")
        self.fixed_anchors = int(fixed_anchors)
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend={attention_backend!r}: choose one of {', '.join(BACKENDS)}")
        self.attention_backend = attention_backend
        if fused_head_ce not in (True, False, "auto"):
            raise ValueError(f"fused_head_ce={fused_head_ce!r}: use true (torch's fused op), false or auto (the "
                             f"one-pass head)")
        self.fused_head_ce = fused_head_ce
        register_with_transformers()
        self.target_layer_ids = list(draft.cfg.target_layer_ids)
        self.stop_token_ids: list[int] = []   # set by build_model from the tokenizer; ends decoding
        # which target weights this model wraps (set by build_model: target.weights_digest / checkpoint_digest);
        # recorded in summary.json so compare never pairs runs trained against different targets
        self.target_digest: str | None = None
        num_target_layers = target.config.num_hidden_layers
        if max(self.target_layer_ids) >= num_target_layers or min(self.target_layer_ids) < 0:
            raise ValueError(f"model.target_layer_ids={self.target_layer_ids} outside the target's "
                             f"{num_target_layers} layers")
        self.target.requires_grad_(False)
        self.target.eval()

    # -- frozen target ------------------------------------------------------------------------------------
    def train(self, mode: bool = True):
        """Only the draft switches mode; the target stays in eval mode."""
        super().train(mode)
        self.target.eval()
        return self

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The draft's parameters (give these, and only these, to the optimizer)."""
        return [p for p in self.draft.parameters() if p.requires_grad]

    def draft_state_dict(self) -> dict:
        """State of the draft alone (the target is frozen and rebuilt from its config)."""
        return self.draft.state_dict()

    def load_draft_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`draft_state_dict`."""
        self.draft.load_state_dict(state)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the target's frozen input-embedding matrix, read raw (no embedding scale), as the DFlash
        inference code reads them; the MASK id may be a row past the tokenizer's vocabulary (model.build)."""
        return F.embedding(ids, self.target.get_input_embeddings().weight)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's frozen LM head (hidden cast to its dtype outside autocast)."""
        head = self.target.get_output_embeddings()
        if not torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(head.weight.dtype)
        return head(hidden)

    @torch.no_grad()
    def target_features(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor,
                        single_document_rows: bool | None = None) -> torch.Tensor:
        """Concatenated target hidden states at the draft's layer ids, per-document attention: [R, T, n*H].

        Rows of one document (padded batches) run the target's own causal attention with positions 0..T-1 (equal
        to the document's on its tokens; padding outputs are never read). Other rows run flex_attention under the
        document BlockMask with the documents' own positions.
        """
        if self.attention_backend == "dense":
            return self._target_features_dense(input_ids, position_ids, doc_ids)
        if single_document_rows is None:
            single_document_rows = bool(_single_document_rows(document_starts(doc_ids), doc_ids))
        if single_document_rows:
            features, _ = capture_target_features(self.target, self.target_layer_ids, stop_early=True,
                                                  input_ids=input_ids, use_cache=False)
            return features
        block_mask = causal_document_intervals(doc_ids).block_mask()
        with _attention_implementation(self.target, TRANSFORMERS_NAME):
            features, _ = capture_target_features(self.target, self.target_layer_ids, stop_early=True,
                                                  input_ids=input_ids, attention_mask=block_mask,
                                                  position_ids=position_ids, use_cache=False)
        return features

    def _target_features_dense(self, input_ids, position_ids, doc_ids) -> torch.Tensor:
        mask = document_attention_mask(doc_ids)
        if getattr(self.target.config, "_attn_implementation", "sdpa") not in ("sdpa", "flex_attention"):
            dtype = self.target.get_input_embeddings().weight.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        features, _ = capture_target_features(self.target, self.target_layer_ids, stop_early=True,
                                              input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                              use_cache=False)
        return features

    # -- training step ------------------------------------------------------------------------------------
    def forward(self, batch: dict, generator: torch.Generator | None = None, *, score_fixed: bool = True) -> StepOutput:
        """One DFlash step on a collated batch (docs/CONTRACTS.md). Gradients flow into the draft only.

        ``score_fixed=False`` skips the fixed-anchor pass (when nothing records per-example accuracy); the doc
        counts then come from the training anchors.
        """
        inputs = self._encode(batch)
        blocks = self._random_blocks(inputs, generator)
        out = self._score(self._draft_blocks(inputs, blocks, inputs.context), blocks, inputs.num_docs)
        if self.fixed_anchors and score_fixed:
            with torch.no_grad():   # same weights, before the update; the training graph is untouched
                fixed = self._fixed_output(inputs)
            out.doc_correct, out.doc_count = fixed.doc_correct, fixed.doc_count
        return out

    def block_hidden(self, batch: dict, generator: torch.Generator | None = None):
        """Training path up to the draft output: (Blocks, hidden [R, N * bs, H]); shared by forward and tests."""
        inputs = self._encode(batch)
        blocks = self._random_blocks(inputs, generator)
        return blocks, self._draft_blocks(inputs, blocks, inputs.context)

    @torch.no_grad()
    def evaluate(self, batch: dict, generator: torch.Generator | None = None) -> StepOutput:
        """Scores without gradients (probes): on the fixed anchors when ``fixed_anchors`` > 0 (``generator`` is
        then unused), else like :meth:`forward`. The draft's train/eval mode is left unchanged."""
        if not self.fixed_anchors:
            return self.forward(batch, generator)
        return self._fixed_output(self._encode(batch))

    def _encode(self, batch: dict) -> _Encoded:
        device = self.target.get_input_embeddings().weight.device
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        loss_mask = batch["loss_mask"].to(device, non_blocking=True)
        position_ids = batch["position_ids"].to(device, non_blocking=True)
        doc_ids = batch["doc_ids"].to(device, non_blocking=True)
        sample_index = batch["sample_index"].to(device, non_blocking=True)
        num_docs = int(sample_index.numel())
        starts = document_starts(doc_ids)
        runs = ((starts == torch.arange(doc_ids.shape[1], device=device)) & (doc_ids >= 0)).sum()
        # one host sync for both checks: contiguous documents, and whether every row holds a single document
        runs, single = torch.stack([runs, _single_document_rows(starts, doc_ids).long()]).tolist()
        if runs != num_docs:
            raise ValueError(f"batch has {runs} document runs for {num_docs} documents: each document must be one "
                             f"contiguous run of a row (docs/CONTRACTS.md, collated batch)")
        features = self.target_features(input_ids, position_ids, doc_ids, single_document_rows=bool(single))
        return _Encoded(input_ids, loss_mask, position_ids, doc_ids, sample_index, num_docs, bool(single),
                        self.draft.project_context(features))

    def _random_blocks(self, inputs: _Encoded, generator: torch.Generator | None):
        max_anchors = None if self.max_block_tokens is None else self.max_block_tokens // self.block_size
        anchors, valid, anchor_doc = sample_anchors(inputs.loss_mask, inputs.doc_ids, generator, self.anchors_per_doc,
                                                    self.anchor_density, inputs.num_docs, max_anchors)
        return self._blocks(inputs, anchors, valid, anchor_doc)

    def _blocks(self, inputs: _Encoded, anchors, valid, anchor_doc):
        return build_blocks(inputs.input_ids, inputs.loss_mask, inputs.position_ids, inputs.doc_ids, anchors, valid,
                            anchor_doc, block_size=self.block_size, mask_token_id=self.mask_token_id,
                            gamma=self.loss_gamma)

    def _draft_blocks(self, inputs: _Encoded, blocks, context: torch.Tensor) -> torch.Tensor:
        attention = draft_key_intervals(blocks, inputs.input_ids.shape[1], backend=self.attention_backend,
                                        single_document_rows=inputs.single_document_rows)
        return self.draft(context, inputs.position_ids, self.embed(blocks.block_ids), blocks.block_positions,
                          attention)

    def _fixed_output(self, inputs: _Encoded) -> StepOutput:
        """Scores of the fixed anchors (call under no_grad)."""
        anchors, valid, anchor_doc = fixed_anchors(inputs.loss_mask, inputs.doc_ids, inputs.position_ids,
                                                   inputs.sample_index, self.fixed_anchors)
        blocks = self._blocks(inputs, anchors, valid, anchor_doc)
        return self._score(self._draft_blocks(inputs, blocks, inputs.context.detach()), blocks, inputs.num_docs)

    def _score(self, hidden: torch.Tensor, blocks, num_docs: int) -> StepOutput:
        rows, slots, bs = blocks.labels.shape
        hidden = hidden.view(rows, slots, bs, -1)
        row_i, slot_i, k_i = blocks.label_ok.nonzero(as_tuple=True)
        # The LM head runs on supervised slots only: slot 0 and invalid slots never need logits.
        labels = blocks.labels[row_i, slot_i, k_i]
        weights = blocks.weights[row_i, slot_i, k_i]
        ce, predicted = self._head_ce(hidden[row_i, slot_i, k_i], labels)
        weighted_ce_sum = (ce * weights).sum()
        weight_sum = weights.sum().detach()
        with torch.no_grad():
            # Counts by scatter-add into tensors of known size: no host sync (on CUDA ``torch.bincount`` reads its
            # input's maximum on the host, and a boolean-mask index its true count: six syncs per call)
            correct = predicted == labels
            position, docs = k_i - 1, blocks.anchor_doc[row_i, slot_i]
            per_pos_correct = _counts(position, bs - 1, correct)
            per_pos_count = _counts(position, bs - 1)
            doc_correct = _counts(docs, num_docs, correct)
            doc_count = _counts(docs, num_docs)
        return StepOutput(
            loss=weighted_ce_sum / weight_sum.clamp(min=1e-6),
            weighted_ce_sum=weighted_ce_sum,
            weight_sum=weight_sum,
            correct=correct.sum(),
            count=torch.as_tensor(labels.numel(), device=labels.device),
            per_pos_correct=per_pos_correct,
            per_pos_count=per_pos_count,
            doc_correct=doc_correct,
            doc_count=doc_count,
            num_blocks=blocks.valid.sum(),
            num_slots=int(blocks.valid.numel()),
        )

    def _head_ce(self, hidden: torch.Tensor, labels: torch.Tensor):
        """Per-slot CE and argmax through the frozen LM head (dflash_lab.model.head): torch's fused
        linear_cross_entropy when gradients are needed (``fused_head_ce``), else the chunked reference.

        Logits of S slots x V words in float32 would dominate memory on a real target (32K slots x 152K words
        = 20 GB): no path holds more than ``CE_CHUNK_ELEMENTS`` logits at once (the reference's whole-batch path
        only below that).
        """
        head = self.target.get_output_embeddings()   # an nn.Linear in every HF causal LM
        return head_ce(hidden, head.weight, head.bias, labels, chunk_elements=self.CE_CHUNK_ELEMENTS,
                       fused=self.uses_fused_head(hidden.device))

    def uses_fused_head(self, device: torch.device | str | None = None) -> bool:
        """Whether the LM head runs torch's fused op (``fused_head_ce`` true; auto runs the one-pass head on every
        device: it does half the fused op's head work for the same saved bytes, docs/model_speed.md)."""
        return self.fused_head_ce is True

    # -- decoding helpers ----------------------------------------------------------------------------------
    @torch.no_grad()
    def draft_block_logits(self, context_features: torch.Tensor, anchor_token: int, anchor_position: int,
                           block_size: int | None = None) -> torch.Tensor:
        """Draft logits for one block at inference: [block_size - 1, V] for slots 1..bs-1.

        Args:
            context_features: [1, P, n*H] target features of positions 0..P-1 (P = anchor_position).
            anchor_token: the token at ``anchor_position`` (the last accepted / bonus token).
            anchor_position: position of the anchor (= number of context tokens).
            block_size: default: the training block size.
        """
        bs = block_size or self.block_size
        device = context_features.device
        ids = torch.full((1, bs), self.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = int(anchor_token)
        context_positions = torch.arange(context_features.shape[1], device=device)[None]
        block_positions = anchor_position + torch.arange(bs, device=device)[None]
        hidden = self.draft(self.draft.project_context(context_features), context_positions, self.embed(ids),
                            block_positions, None)
        return self.lm_head(hidden[0, 1:]).float()

    def baseline_model(self) -> DFlashModel:
        """A DFlashModel sharing this target with a freshly initialised (untrained) draft: the tau baseline."""
        fresh = DFlashDraft(copy.deepcopy(self.draft.cfg), init_seed=self.draft_init_seed, init_std=self.draft.init_std,
                            compile_layers=self.draft.compile_layers)
        param = next(self.draft.parameters())
        fresh.to(device=param.device, dtype=param.dtype)
        baseline = DFlashModel(self.target, fresh, mask_token_id=self.mask_token_id, block_size=self.block_size,
                               loss_gamma=self.loss_gamma, anchors_per_doc=self.anchors_per_doc,
                               anchor_density=self.anchor_density, draft_init_seed=self.draft_init_seed,
                               fixed_anchors=self.fixed_anchors, attention_backend=self.attention_backend,
                               fused_head_ce=self.fused_head_ce)
        baseline.stop_token_ids = list(self.stop_token_ids)
        return baseline
