"""The parts of a training run, built from its checked settings, in the order in which one part sizes another:

1. the model (frozen target + trainable draft) and its tokenizer;
2. the data (:func:`split_data`): the training split and the held-out one, which tops up short probe bands;
3. the step's size (:func:`resolve_memory_plan`): the sampler's automatic values, the memory plan (block budget,
   checkpointing) from the model and the data's anchors, and on a GPU the preflight;
4. the batching (:func:`build_batching`): the policy under the plan's block budget, its DataLoader and the plan's
   step counts (token-budget packing differs between epochs);
5. AdamW, and the LR schedule over the run's end step, which the policy's batch counts give; the DDP wrapper.

What the data loader left out or cut is said once the parts stand (:func:`data_warnings`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflash_lab.training import dist
from dflash_lab.records import record
from dflash_lab.data import Collator, build_dataset
from dflash_lab.model import build_model, footprint
from dflash_lab.training.probes import resolve_bands
from dflash_lab.sampling import policy_from_config, resolve_auto_boundaries
from dflash_lab.sampling.boundaries import empty_bucket_warning
from dflash_lab.sampling.stats import lr_scale, resolve_matched_real_tokens
from dflash_lab.sampling.anchors import anchor_rule_name, block_tokens_per_sample
from dflash_lab.training.settings import ProbeSettings, RunSettings
from dflash_lab.training.step import LRSchedule


def pretrain_corpus_follows_data(model_cfg: Mapping, data_cfg: Mapping) -> dict[str, Any]:
    """The model section, with the tiny target pretrained on the run's own corpus when that is a skills corpus.

    A target that never saw the skill tables could not predict them, so with ``data=synthetic`` and
    ``data.band_skills`` other than ``none`` the tiny target's ``pretrain_data`` becomes the run's synthetic
    config (same seed: same tables; same held-out share: the target never trains on the run's stratified
    held-out samples; the few the probe split adds to short bands, it may have seen).
    Every other run keeps ``model.pretrain_data`` as configured, hence the same cached target.
    """
    model_cfg = dict(model_cfg)
    if (model_cfg["kind"] == "tiny" and data_cfg["kind"] == "synthetic"
            and data_cfg["band_skills"] != "none"):
        keys = ("kind", "num_samples", "seed", "min_length", "probe_fraction", "band_skills", "skill_bands")
        model_cfg["pretrain_data"] = {k: data_cfg[k] for k in keys if k in data_cfg}
    return model_cfg


def max_steps_note(max_steps: int | None, plan: record.PlanFacts, epochs: int) -> str | None:
    """What to say when ``trainer.max_steps`` lies beyond the configured epochs' steps, which cap it (the run ends
    with its last epoch); None when it does not.

    Example:
        >>> facts = record.PlanFacts(steps_per_epoch=(104, 103), batches_per_epoch=(104, 103), end_step=207)
        >>> print(max_steps_note(10**9, facts, epochs=2))
        trainer.max_steps=1000000000 is more than the 207 steps of trainer.epochs=2 ([104, 103] per epoch): the run ends at step 207, the end of its last epoch (a run never trains past its epochs); raise trainer.epochs for more steps, or set trainer.max_steps=null
        >>> max_steps_note(207, facts, epochs=2) is None
        True
    """
    if max_steps is None or max_steps <= plan.total_steps:
        return None
    return (f"trainer.max_steps={max_steps} is more than the {plan.total_steps} steps of trainer.epochs={epochs} "
            f"({list(plan.steps_per_epoch)} per epoch): the run ends at step {plan.end_step}, the end of its last "
            f"epoch (a run never trains past its epochs); raise trainer.epochs for more steps, or set "
            f"trainer.max_steps=null")


def plan_facts(policy, epochs: int, grad_accum: int, max_steps: int | None) -> record.PlanFacts:
    """Exact steps per epoch (token-budget packing differs between epochs) and the run's end step."""
    batches = tuple(len(policy.batches(e)) for e in range(epochs))
    steps_per_epoch = tuple(math.ceil(n / grad_accum) for n in batches)
    diagnostics = [policy.diagnostics(e) for e in range(epochs)]
    total = sum(steps_per_epoch)
    return record.PlanFacts(
        steps_per_epoch=steps_per_epoch,
        batches_per_epoch=batches,
        end_step=total if max_steps is None else min(total, max_steps),
        dropped_overlong=diagnostics[0]["dropped_overlong"],
        truncated=diagnostics[0]["truncated"],
        repeated_remainder=sum(d["repeated_remainder"] for d in diagnostics),
        dropped_remainder=sum(d["dropped_remainder"] for d in diagnostics),
    )


@dataclass
class StepSizing:
    """What sizes one step: the sampler config with its automatic values resolved, the memory plan (block budget,
    checkpointing), every sample's block tokens (None without a block budget) and the step's memory/FLOP model."""

    sampler_cfg: dict[str, Any]
    memory: footprint.MemoryPlan
    block_tokens: np.ndarray | None
    step_model: footprint.StepModel


def resolve_memory_plan(settings: RunSettings, model, dataset, device: torch.device, world_size: int,
                        log: logging.Logger) -> StepSizing:
    """Size the run's step. The sampler config with ``boundaries: auto`` (``sampling.resolve_auto_boundaries``),
    full_random's ``real_tokens_per_step: bucketed`` (``sampling.stats.resolve_matched_real_tokens``) and
    ``max_block_tokens`` resolved; the memory plan (``footprint.memory_plan``: ``auto`` block budget and
    checkpointing chosen from the memory model where the GPU's memory is known), which the model takes (fair
    thinning of any batch over the block budget, and checkpointing); on a GPU the preflight, which refuses a step
    that cannot fit, naming the fix, before step 1 rather than at it with an OOM; the block tokens of every sample
    under the model's anchor rule (``sampling.anchors``; None without a block budget: the pass over the loss mask
    is skipped when nothing reads it)."""
    trainer = settings.trainer
    builtin_corpus = settings.config["data"].get("kind") == "synthetic"
    sampler_cfg = resolve_auto_boundaries(settings.config["sampler"], builtin_corpus=builtin_corpus)
    sampler_cfg = resolve_matched_real_tokens(sampler_cfg, dataset.lengths, builtin_corpus=builtin_corpus,
                                              seed=settings.seed, world_size=world_size)
    requested = sampler_cfg.get("max_block_tokens")
    gpu_gb = settings.gpu_memory_gb(device)
    block_tokens = None
    if requested is not None and not (requested == "auto" and gpu_gb is None):
        block_tokens = block_tokens_per_sample(dataset.anchor_positions(), block_size=model.block_size,
                                               anchors_per_doc=model.anchors_per_doc,
                                               anchor_density=model.anchor_density)
    step_model = footprint.StepModel.from_model(model)   # the one memory/FLOP model of this run's step
    memory = footprint.memory_plan(
        step_model, dataset.lengths, sampler_cfg,
        footprint.Settings(precision=trainer.precision, world_size=world_size, grad_accum=trainer.grad_accum,
                           attention=footprint.attention_path(device.type, model.attention_backend),
                           allocator="cuda" if device.type == "cuda" else "cpu"),
        activation_checkpointing=trainer.activation_checkpointing, gpu_mem_gb=gpu_gb, seed=settings.seed,
        block_tokens=block_tokens)
    if memory.max_block_tokens is None:
        block_tokens = None
    sampler_cfg["max_block_tokens"] = model.max_block_tokens = memory.max_block_tokens
    model.draft.activation_checkpointing = memory.activation_checkpointing
    log.info(f"memory plan: {memory.reason} (anchor rule {anchor_rule_name(model.anchor_density)})")
    if device.type == "cuda":
        fit = footprint.preflight(
            step_model, dataset.lengths, sampler_cfg,
            footprint.Settings(precision=trainer.precision, activation_checkpointing=memory.activation_checkpointing,
                               world_size=world_size, grad_accum=trainer.grad_accum,
                               attention=footprint.attention_path(device.type, model.attention_backend),
                               allocator="cuda"),
            gpu_mem_gb=gpu_gb, seed=settings.seed, block_tokens=block_tokens)
        log.info(f"preflight: {footprint.gpu_use(fit['pred_peak_mem_gb'], fit['gpu_mem_gb'])}")
    if settings.config["sampler"].get("real_tokens_per_step") != sampler_cfg.get("real_tokens_per_step"):
        log.info(f"sampler.real_tokens_per_step={settings.config['sampler']['real_tokens_per_step']}: "
                 f"{sampler_cfg['real_tokens_per_step']} real tokens per rank and step (the "
                 f"{settings.config['sampler']['real_tokens_per_step']} plan's mean)")
    return StepSizing(sampler_cfg=sampler_cfg, memory=memory, block_tokens=block_tokens, step_model=step_model)


def cpu_matmul_flops(size: int = 512, seconds: float = 0.2) -> float:
    """This CPU's measured fp32 matmul rate (FLOP/s), over about ``seconds`` of square ``size`` matmuls."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)   # warm-up
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds or done == 0:
        torch.mm(a, b)
        done += 1
    return done * 2.0 * size**3 / (time.perf_counter() - started)


def predicted_cpu_step_s(step_model: footprint.StepModel, policy, grad_accum: int, flops_per_s: float) -> float:
    """A floor on the median step time on this CPU: the step's executed FLOPs (``footprint.step_flops``, with
    each document's anchors) at the measured matmul rate. Real steps are slower (attention, softmax, the
    optimizer), so the warning it feeds understates, never overstates."""
    batches = policy.global_plan(0).batches[:256]   # a sample is enough for the median
    shapes = footprint.batch_shapes(batches, policy.lengths, packed=policy.packed, model=step_model,
                                    anchors=footprint.policy_anchors(policy, step_model))
    executed = footprint.step_flops(step_model, shapes)["executed"]
    return float(np.median(executed)) * grad_accum / flops_per_s


def warn_if_slow_on_cpu(model, step_model: footprint.StepModel, policy, plan: record.PlanFacts, grad_accum: int,
                        threshold_s: float, log: logging.Logger) -> None:
    """A large target on the CPU with the GPU recipe looks hung (minutes per step): say so before step 1, with the
    predicted step time and the CPU-sized preset. Warns when the predicted step exceeds ``trainer.cpu_step_warn_s``
    or the objective is the GPU recipe's (its anchors); otherwise one info line with the prediction."""
    rate = cpu_matmul_flops()
    step_s = predicted_cpu_step_s(step_model, policy, grad_accum, rate)
    recipe = model.anchor_density is None   # the GPU recipe's anchors (up to 512 per document), not a CPU preset
    if step_s < threshold_s and not recipe:
        log.info(f"CPU run of a large target: predicted >= {step_s:.3g} s per step (the step's FLOPs at this CPU's "
                 f"measured {rate / 1e9:.0f} GFLOP/s)")
        return
    log.warning(f"CPU run of a large target: predicted >= {step_s:.3g} s per step, >= "
                f"{step_s * plan.end_step / 3600:.1f} h for {plan.end_step} steps (the step's FLOPs at this CPU's "
                f"measured {rate / 1e9:.0f} GFLOP/s; block {model.block_size}, "
                f"{anchor_rule_name(model.anchor_density)} anchors, {len(model.draft.layers)} draft layer(s)). "
                f"For a smoke run use model=hf_cpu (block 8, anchor density 1/16, 1 draft layer, 4 tau prompts) "
                f"and trainer.max_steps=<a few>; train the recipe with trainer=gpu on a GPU")


@dataclass
class Components:
    """Everything a run trains with (see the module docstring)."""

    model: Any                 # DFlashModel: frozen target + trainable draft
    train_model: Any           # the model, DDP-wrapped when distributed
    tokenizer: Any
    train_ds: Any
    heldout_ds: Any
    policy: Any                # the batching policy (a batch sampler; state_dict holds its position)
    loader: torch.utils.data.DataLoader
    plan: record.PlanFacts
    memory: footprint.MemoryPlan
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    autocast: Any              # bf16 autocast on GPU, else a null context
    probes: ProbeSettings      # the probe settings with ``bands`` resolved (``auto``: see probes.resolve_bands)
    # the anchors' RNG, reseeded for every batch (step.anchor_seed); its state is checkpointed all the same
    anchor_generator: torch.Generator = field(default_factory=lambda: torch.Generator(device="cpu"))

    def identity(self, settings: RunSettings, world_size: int) -> dict[str, Any]:
        """What this run is, for ``summary.json`` (and so for compare): its settings, and the digests of the data
        (``data_digest``) and the target weights (``target_digest``) it trained with, which compare checks before
        it treats two runs as replicates or pairs."""
        return {"sampler": self.policy.name, "seed": settings.seed, "epochs": settings.trainer.epochs,
                "world_size": world_size, "boundaries": self.policy.boundaries,
                "anchor_rule": anchor_rule_name(self.model.anchor_density),
                "max_block_tokens": self.memory.max_block_tokens,
                "activation_checkpointing": self.memory.activation_checkpointing,
                "data_digest": self.train_ds.content_digest, "probe_bands": list(self.probes.bands),
                "target_digest": self.model.target_digest, "target_seed": target_seed_of(settings.config),
                "peak_lr": self.schedule.peak_lr}

    def data_counts(self) -> dict[str, Any]:
        """Lines the data loader skipped (by reason), samples it cut to ``data.max_length`` and, for data=jsonl,
        what the chat template left out of kept lines (``data_notes``, e.g. ``reasoning_not_rendered`` turns)."""
        stats = self.train_ds.stats
        counts = {"data_skipped": dict(stats.get("skipped", {})),
                  "data_truncated": int(stats.get("truncated", 0) or 0)}
        if "notes" in stats:
            counts["data_notes"] = dict(stats["notes"])
        return counts


def target_seed_of(config: Mapping) -> int | None:
    """The tiny target's pretraining seed (``model.pretrain_seed``, nested in the run seed by ``target_seeds``:
    dflash_lab/replicates.py); None for a given target (model=hf)."""
    model = config.get("model") or {}
    return int(model["pretrain_seed"]) if model.get("kind") == "tiny" and "pretrain_seed" in model else None


def split_data(settings: RunSettings, tokenizer, log: logging.Logger) -> tuple[Any, Any, ProbeSettings]:
    """The run's data split in two: the training split and the held-out one (probe sets and tau prompts), with the
    probe settings' bands resolved (``probes.bands: auto``, ``probes.resolve_bands``). Probes need
    ``probes.per_band`` held-out samples in every band: the split tops up short bands."""
    data_cfg, probes = settings.config["data"], settings.probes
    dataset = build_dataset(tokenizer=tokenizer, **data_cfg)
    builtin_corpus = data_cfg.get("kind") == "synthetic"
    bands = resolve_bands(probes.bands, dataset.lengths, builtin_corpus=builtin_corpus)
    if probes.bands == "auto" and not builtin_corpus:
        log.info(f"probes.bands=auto: {bands} (the data's length quantiles)")
    probes = dataclasses.replace(probes, bands=bands)
    train_ds, heldout_ds = dataset.split(bands=bands if probes.every > 0 else None, per_band=probes.per_band)
    return train_ds, heldout_ds, probes


def build_batching(settings: RunSettings, sizing: StepSizing, train_ds, pad_id: int, probes: ProbeSettings,
                   env: dist.DistEnv, device: torch.device,
                   log: logging.Logger) -> tuple[Any, torch.utils.data.DataLoader, record.PlanFacts]:
    """The batching policy over the training split, its DataLoader and the plan's step counts; refuses probe bands
    that end below the longest training sample and says what the overlong rule dropped or cut, which buckets hold
    no sample (``sampling.boundaries.empty_bucket_warning``) and a ``trainer.max_steps`` the epochs cap."""
    trainer = settings.trainer
    policy = policy_from_config(sizing.sampler_cfg, train_ds.lengths, seed=settings.seed, world_size=env.world_size,
                                rank=env.rank, block_tokens=sizing.block_tokens)
    longest = int(policy.lengths.max())
    if (probes.every or probes.presentations) and longest > probes.bands[-1]:
        raise ValueError(f"probes.bands={probes.bands} end at {probes.bands[-1]} but training samples reach "
                         f"{longest} tokens: extend probes.bands (e.g. append {longest})")
    loader = torch.utils.data.DataLoader(
        train_ds, batch_sampler=policy, num_workers=trainer.num_workers, pin_memory=device.type == "cuda",
        collate_fn=Collator(pad_id=pad_id, packed=policy.packed, effective_lengths=policy.lengths),
    )
    plan = plan_facts(policy, trainer.epochs, trainer.grad_accum, trainer.max_steps)
    empty = (empty_bucket_warning(policy.boundaries, policy.lengths[policy.admission.kept])
             if policy.boundaries is not None else None)
    if empty:   # e.g. boundaries past the longest document: said before step 1, not found in the bucket column later
        log.warning(empty)
    capped = max_steps_note(trainer.max_steps, plan, trainer.epochs)
    if capped:
        log.warning(capped)
    if plan.dropped_overlong or plan.truncated:
        log.warning(f"sampler.overlong={sizing.sampler_cfg.get('overlong')}: {plan.dropped_overlong} sample(s) "
                    f"dropped, {plan.truncated} truncated to fit sampler.max_tokens (summary.json 'samples')")
    return policy, loader, plan


def data_warnings(counts: Mapping[str, Any], stats: Mapping[str, Any], max_length: int | None) -> list[str]:
    """What the data loader left out or cut (``Components.data_counts``), in words, with the ``data.max_length``
    that keeps 99% of the lines whole where a larger one would (``stats``: the training split's loader statistics).

    Example:
        >>> data_warnings({"data_skipped": {"too_long": 0}, "data_truncated": 0}, {}, 1024)
        []
    """
    keeping = stats.get("length_keeping_99pct")
    longer = f"data.max_length={keeping} keeps 99% of the lines whole" if keeping and max_length and keeping > max_length else ""
    warnings = []
    skipped = {reason: n for reason, n in counts["data_skipped"].items() if n}
    if skipped:
        warnings.append(f"data: skipped lines by reason {skipped} (summary.json 'data_skipped')"
                        + (f"; {longer} (now {max_length})" if skipped.get("too_long") and longer else ""))
    if counts["data_truncated"]:
        warnings.append(f"data: {counts['data_truncated']} of {stats.get('kept', '?')} samples were cut to "
                        f"data.max_length={max_length} tokens (summary.json 'data_truncated'); raise data.max_length "
                        f"to keep them whole" + (f" ({longer})" if longer else ""))
    if counts.get("data_notes", {}).get("reasoning_not_rendered"):
        warnings.append(f"data: the chat template leaves out the reasoning_content of "
                        f"{counts['data_notes']['reasoning_not_rendered']} assistant turn(s) of kept lines (Qwen3's "
                        f"writes reasoning only after the last user turn, as at inference): they train without it "
                        f"(summary.json 'data_notes')")
    return warnings


def build_components(settings: RunSettings, env: dist.DistEnv, device: torch.device,
                     log: logging.Logger) -> Components:
    """Build the run's parts (see the module docstring); refuses, naming the key, what cannot run."""
    config, trainer = settings.config, settings.trainer
    model, tokenizer = build_model(**pretrain_corpus_follows_data(config["model"], config["data"]),
                                   activation_checkpointing=trainer.activation_checkpointing is True)
    model.to(device)
    train_ds, heldout_ds, probes = split_data(settings, tokenizer, log)
    sizing = resolve_memory_plan(settings, model, train_ds, device, env.world_size, log)
    policy, loader, plan = build_batching(settings, sizing, train_ds, tokenizer.pad_token_id, probes, env, device,
                                          log)
    if device.type == "cpu" and config["model"]["kind"] != "tiny":
        warn_if_slow_on_cpu(model, sizing.step_model, policy, plan, trainer.grad_accum, trainer.cpu_step_warn_s, log)
    scale = lr_scale(trainer.lr_scaling, sizing.sampler_cfg, train_ds.lengths, seed=settings.seed,
                     world_size=env.world_size, builtin_corpus=config["data"].get("kind") == "synthetic")
    peak_lr = trainer.lr * scale["factor"]
    if scale["rule"] is not None:
        log.info(f"trainer.lr_scaling={scale['rule']}: peak LR {peak_lr:.4g} = {trainer.lr:g} x ({scale['real_tokens']}"
                 f" / {scale['reference_real_tokens']} real tokens per step, full_random's) ** "
                 f"{'0.5' if scale['rule'] == 'sqrt' else '1'}")
    optimizer = torch.optim.AdamW(list(model.trainable_parameters()), lr=peak_lr, betas=trainer.betas,
                                  weight_decay=trainer.weight_decay)
    components = Components(
        model=model, train_model=dist.wrap_ddp(model, env), tokenizer=tokenizer, train_ds=train_ds,
        heldout_ds=heldout_ds, policy=policy, loader=loader, plan=plan, memory=sizing.memory, optimizer=optimizer,
        schedule=LRSchedule(peak_lr, plan.end_step, trainer.warmup_frac, trainer.min_lr_ratio),
        autocast=(torch.autocast(device_type="cuda", dtype=torch.bfloat16) if trainer.precision == "bf16"
                  else contextlib.nullcontext()), probes=probes)
    for warning in data_warnings(components.data_counts(), train_ds.stats, config["data"].get("max_length")):
        log.warning(warning)
    return components
