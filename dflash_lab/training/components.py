"""The parts of a training run, built from its checked settings: the model (frozen target + trainable draft), the
data and its held-out split, the memory plan, the batching policy and its DataLoader, the plan's step counts,
AdamW and the LR schedule, and the DDP wrapper.

Order matters where one part sizes another: the held-out split tops up short probe bands, the memory plan (block
budget, checkpointing) needs the model and the data's anchors, the policy needs the plan's block budget, and the
LR schedule spans the run's end step, which the policy's batch counts give.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_lab.training import dist
from dflash_lab.records import record
from dflash_lab.analysis.protocol import PROTOCOL_FILE
from dflash_lab.analysis.schema import DEFAULT_ENDPOINTS
from dflash_lab.analysis.sizing import verdict_probe_warning
from dflash_lab.data import Collator, build_dataset
from dflash_lab.model import build_model, footprint
from dflash_lab.training.probes import resolve_bands
from dflash_lab.sampling import policy_from_config, resolve_auto_boundaries
from dflash_lab.sampling.stats import resolve_matched_real_tokens
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


def resolve_memory_plan(settings: RunSettings, model, step_model: footprint.StepModel, dataset, device: torch.device,
                        world_size: int) -> tuple[dict[str, Any], footprint.MemoryPlan, np.ndarray | None]:
    """The sampler config with ``boundaries: auto`` (``sampling.resolve_auto_boundaries``), full_random's
    ``real_tokens_per_step: bucketed`` (``sampling.stats.resolve_matched_real_tokens``) and ``max_block_tokens``
    resolved, the memory plan (``footprint.memory_plan``: ``auto``
    block budget and checkpointing chosen from the memory model where the GPU's memory is known) and the block
    tokens of every sample under the model's anchor rule (``sampling.anchors``; None without a block budget: the
    pass over the loss mask is skipped when nothing reads it). The model takes the plan's block budget (fair
    thinning of any batch over it) and checkpointing."""
    trainer = settings.trainer
    builtin_corpus = settings.config["data"].get("kind") == "synthetic"
    sampler_cfg = resolve_auto_boundaries(settings.config["sampler"], builtin_corpus=builtin_corpus)
    sampler_cfg = resolve_matched_real_tokens(sampler_cfg, dataset.lengths, builtin_corpus=builtin_corpus,
                                              seed=settings.seed, world_size=world_size)
    requested = sampler_cfg.get("max_block_tokens")
    gpu_gb = settings.gpu_memory_gb(device)
    needs_blocks = requested is not None and not (requested == "auto" and gpu_gb is None)
    block_tokens = None
    if needs_blocks:
        block_tokens = block_tokens_per_sample(dataset.anchor_positions(), block_size=model.block_size,
                                               anchors_per_doc=model.anchors_per_doc,
                                               anchor_density=model.anchor_density)
    memory = footprint.memory_plan(
        step_model, dataset.lengths, sampler_cfg,
        footprint.Settings(precision=trainer.precision, world_size=world_size,
                           attention=footprint.attention_path(device.type, model.attention_backend)),
        activation_checkpointing=trainer.activation_checkpointing, gpu_mem_gb=gpu_gb, seed=settings.seed,
        block_tokens=block_tokens)
    sampler_cfg["max_block_tokens"] = memory.max_block_tokens
    model.max_block_tokens = memory.max_block_tokens
    model.draft.activation_checkpointing = memory.activation_checkpointing
    return sampler_cfg, memory, (block_tokens if memory.max_block_tokens is not None else None)


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
                "target_digest": self.model.target_digest, "target_seed": target_seed_of(settings.config)}

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


def build_components(settings: RunSettings, env: dist.DistEnv, device: torch.device,
                     log: logging.Logger) -> Components:
    """Build the run's parts (see the module docstring); refuses, naming the key, what cannot run."""
    config, trainer, probes = settings.config, settings.trainer, settings.probes
    model, tokenizer = build_model(**pretrain_corpus_follows_data(config["model"], config["data"]),
                                   activation_checkpointing=trainer.activation_checkpointing is True)
    model.to(device)
    dataset = build_dataset(tokenizer=tokenizer, **config["data"])
    bands = resolve_bands(probes.bands, dataset.lengths, builtin_corpus=config["data"].get("kind") == "synthetic")
    if probes.bands == "auto" and config["data"].get("kind") != "synthetic":
        log.info(f"probes.bands=auto: {bands} (the data's length quantiles)")
    probes = dataclasses.replace(probes, bands=bands)
    # probes need probes.per_band held-out samples in every band: the split tops up short bands
    train_ds, heldout_ds = dataset.split(bands=bands if probes.every > 0 else None, per_band=probes.per_band)
    step_model = footprint.StepModel.from_model(model)   # the one memory/FLOP model of this run's step
    sampler_cfg, memory, block_tokens = resolve_memory_plan(settings, model, step_model, train_ds, device,
                                                            env.world_size)
    log.info(f"memory plan: {memory.reason} (anchor rule {anchor_rule_name(model.anchor_density)})")
    if config["sampler"].get("real_tokens_per_step") != sampler_cfg.get("real_tokens_per_step"):
        log.info(f"sampler.real_tokens_per_step={config['sampler']['real_tokens_per_step']}: "
                 f"{sampler_cfg['real_tokens_per_step']} real tokens per rank and step (the bucketed plan's mean)")
    policy = policy_from_config(sampler_cfg, train_ds.lengths, seed=settings.seed, world_size=env.world_size,
                                rank=env.rank, block_tokens=block_tokens)
    longest = int(policy.lengths.max())
    if (probes.every or probes.presentations) and longest > probes.bands[-1]:
        raise ValueError(f"probes.bands={probes.bands} end at {probes.bands[-1]} but training samples reach "
                         f"{longest} tokens: extend probes.bands (e.g. append {longest})")
    loader = torch.utils.data.DataLoader(
        train_ds, batch_sampler=policy, num_workers=trainer.num_workers, pin_memory=device.type == "cuda",
        collate_fn=Collator(pad_id=tokenizer.pad_token_id, packed=policy.packed, effective_lengths=policy.lengths),
    )
    plan = plan_facts(policy, trainer.epochs, trainer.grad_accum, trainer.max_steps)
    if device.type == "cuda":  # a config that cannot fit stops here, naming the fix, not at step 1 with an OOM
        fit = footprint.preflight(
            step_model, train_ds.lengths, sampler_cfg,
            footprint.Settings(precision=trainer.precision, activation_checkpointing=memory.activation_checkpointing,
                               world_size=env.world_size), gpu_mem_gb=settings.gpu_memory_gb(device),
            seed=settings.seed, block_tokens=block_tokens)
        log.info(f"preflight: predicted peak {fit['pred_peak_mem_gb']:.1f} GiB of {fit['budget_gb']:.1f} usable")
    if plan.dropped_overlong or plan.truncated:
        log.warning(f"sampler.overlong={sampler_cfg.get('overlong')}: {plan.dropped_overlong} sample(s) dropped, "
                    f"{plan.truncated} truncated to fit sampler.max_tokens (summary.json 'samples')")
    if device.type == "cpu" and config["model"]["kind"] != "tiny":
        warn_if_slow_on_cpu(model, step_model, policy, plan, trainer.grad_accum, trainer.cpu_step_warn_s, log)
    optimizer = torch.optim.AdamW(list(model.trainable_parameters()), lr=trainer.lr, betas=trainer.betas,
                                  weight_decay=trainer.weight_decay)
    components = Components(
        model=model, train_model=dist.wrap_ddp(model, env), tokenizer=tokenizer, train_ds=train_ds,
        heldout_ds=heldout_ds, policy=policy, loader=loader, plan=plan, memory=memory, optimizer=optimizer,
        schedule=LRSchedule(trainer.lr, plan.end_step, trainer.warmup_frac, trainer.min_lr_ratio),
        autocast=(torch.autocast(device_type="cuda", dtype=torch.bfloat16) if trainer.precision == "bf16"
                  else contextlib.nullcontext()), probes=probes)
    # a sweep's run (its folder's protocol.json, frozen at launch) is compared on the forgetting endpoints by default
    in_sweep = (Path(settings.run_dir).parent / PROTOCOL_FILE).is_file()
    short = verdict_probe_warning(config.get("analysis"), end_step=plan.end_step, probes_every=probes.every,
                                  n_bands=len(probes.bands) - 1, undeclared=DEFAULT_ENDPOINTS if in_sweep else ())
    if short:   # before step 1: a verdict that cannot be computed is said now, not after the runs
        log.warning(short)
    counts = components.data_counts()
    keeping, max_length = train_ds.stats.get("length_keeping_99pct"), config["data"].get("max_length")
    if any(counts["data_skipped"].values()):
        skipped = {reason: n for reason, n in counts["data_skipped"].items() if n}
        log.warning(f"data: skipped lines by reason {skipped} (summary.json 'data_skipped')"
                    + (f"; data.max_length={keeping} keeps 99% of the lines whole (now {max_length})"
                       if skipped.get("too_long") and keeping and max_length and keeping > max_length else ""))
    if counts["data_truncated"]:
        log.warning(f"data: {counts['data_truncated']} of {train_ds.stats.get('kept', '?')} samples were cut to "
                    f"data.max_length={max_length} tokens (summary.json 'data_truncated'); raise data.max_length to "
                    f"keep them whole" + (f" (data.max_length={keeping} keeps 99% of the lines whole)"
                                          if keeping and max_length and keeping > max_length else ""))
    if counts.get("data_notes", {}).get("reasoning_not_rendered"):
        log.warning(f"data: the chat template leaves out the reasoning_content of "
                    f"{counts['data_notes']['reasoning_not_rendered']} assistant turn(s) of kept lines (Qwen3's writes "
                    f"reasoning only after the last user turn, as at inference): they train without it "
                    f"(summary.json 'data_notes')")
    return components
