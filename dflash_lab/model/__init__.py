"""Frozen target, DFlash draft, block objective and speculative decoding.

API (stable; the training loop is written against it):

    from dflash_lab.model import build_model, DFlashModel, StepOutput, measure_acceptance

    model, tokenizer = build_model(**model_cfg, activation_checkpointing=False)   # a whole model section:
    # every key of conf/model/<preset>.yaml (dflash_lab.presets.preset("model", "tiny") reads one); a missing or
    # unknown key is refused; activation_checkpointing=True recomputes draft layers in backward.
    # kind "tiny" pretrains (or loads from cache) a small Qwen3 target on the built-in corpus; "hf" loads a local dir.
    model.to(device)                               # target frozen (requires_grad False); draft trainable
    params = model.trainable_parameters()          # the draft's parameters only: give these to the optimizer
    g = torch.Generator().manual_seed(seed)        # CPU generator: anchor sampling is reproducible / resumable
    out: StepOutput = model(batch, g)              # batch: CONTRACTS.md collated dict (any device)
    out.loss.backward()                            # = weighted_ce_sum / weight_sum (local normalisation)
    # global normalisation: all-reduce out.weight_sum (and sum over accumulation steps), then
    # (out.weighted_ce_sum / global_weight_sum * world_size).backward()
    out.correct, out.count                         # block accuracy counts (Long scalars)
    out.per_pos_correct, out.per_pos_count         # Long[block_size - 1], slot k=1..bs-1
    out.doc_correct, out.doc_count                 # Long[D], per document in batch["sample_index"] order, on the
                                                   # fixed anchors (model.fixed_anchors > 0; same pass, pre-update)
    model(batch, g, score_fixed=False)             # skip the fixed-anchor pass (doc counts: training anchors)
    ev = model.evaluate(batch)                     # no grad, fixed anchors only (probes); g used when they are off
    model.draft_state_dict(); model.load_draft_state_dict(sd)    # checkpoint the draft only

    from dflash_lab.model import heldout_prompts
    prompts = heldout_prompts(heldout_ds, num_prompts=16, max_prompt_tokens=128)
    res = measure_acceptance(model, prompts, max_new_tokens=64)          # real tau, greedy speculative decoding
    base = measure_acceptance(model.baseline_model(), prompts, max_new_tokens=64)   # untrained draft
    res["tau"], res["verify_steps"], res["new_tokens"]       # stops at model.stop_token_ids (from the tokenizer)
    cont = TargetContinuations.build(model, prompts, max_new_tokens=64)   # the target's greedy continuations, once
    res = replay_acceptance(model, cont)                    # the same accepted lists, draft forwards only

Metric formulas live once in dflash_lab.metrics.draft_quality: per_position_accuracy(correct, count),
estimated_acceptance_length(acc_k) = 1 + sum_k prod_(i<=k) acc_i, acceptance_length_tau(accepted per step).

Notes for the loop: the step is deterministic given (batch, generator state), so saving ``g.get_state()`` in the
checkpoint resumes the exact anchors. On GPU run the step under bf16 autocast (draft weights stay float32). On a
shared CPU, torch with more threads than free cores slows these small ops by 10x or more: prefer 1 thread/rank.
"""

from dflash_lab.model.build import build_model
from dflash_lab.model.decoding import (
    TargetContinuations, heldout_prompts, measure_acceptance, replay_acceptance, speculative_generate,
)
from dflash_lab.model.dflash import DFlashModel, StepOutput
from dflash_lab.model.draft import DFlashDraft, DraftConfig, default_target_layer_ids

__all__ = [
    "DFlashDraft",
    "DFlashModel",
    "DraftConfig",
    "StepOutput",
    "TargetContinuations",
    "build_model",
    "default_target_layer_ids",
    "heldout_prompts",
    "measure_acceptance",
    "replay_acceptance",
    "speculative_generate",
]
