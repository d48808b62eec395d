"""GPU check of the training step, built from the training config: Ktok/s, MFU and peak memory per policy.

    python benchmarks/gpu_check.py                                  # every local GPU (--nproc), Qwen3-8B shape
    python benchmarks/gpu_check.py --device cpu --shape tiny        # the same path on a CPU, tiny target
    python benchmarks/gpu_check.py --device cpu --shape medium      # CPU, hidden 512 / 32K vocabulary (~2 min)
    python benchmarks/gpu_check.py --device cpu --nproc 2 --shape tiny   # two gloo ranks under DDP
    bash scripts/gpu_check.sh OUT.jsonl                             # this + CUDA tests + a real training

What runs: the training config composed by Hydra (``conf/train.yaml`` with ``model=qwen3_8b`` and each
``conf/sampler/<policy>.yaml``; extra ``key=value`` arguments are Hydra overrides, e.g. ``gpu=h200``,
``sampler.max_block_tokens=65536``, ``trainer.activation_checkpointing=true``), so the draft and objective are
training's: 5 draft layers, block 16, the recipe's anchor rule (``min(512, valid positions)`` per document), the
seed's bucket boundaries. The target is the model config's shape (``--shape tiny``/``medium``: small Qwen3 shapes;
medium: hidden 512, 6 layers, 32,768 words, 2 draft layers) with random weights: no download, speed and memory
only. Documents: the seed workload (docs/workloads.md; lengths and boundaries divided by 32 for tiny, 2 for
medium; tiny scales anchors_per_doc by the same 32). Every token is supervised (random batches), so a
document's block tokens are ``sampling.anchors.block_tokens_per_sample`` on ``l - 1`` valid positions.

Budgets, as training resolves them (``dflash_lab.components.resolve_memory_plan``): the token budget stays the shape's
``sampler.max_tokens`` (32,768 at qwen3-8b, 4,096 tiny/medium; ``--budget N`` sets it), and each policy's block
budget (``sampler.max_block_tokens``, ``auto`` unless overridden) and draft activation checkpointing
(``--activation-checkpointing {auto,true,false}``, else a ``trainer.activation_checkpointing=`` override, else
auto) come from ``footprint.memory_plan`` against 90% of the memory figure: ``--gpu-mem-gb``, else ``--gpu``'s
preset (``conf/gpu/<name>.yaml``), else the device's own; on a CPU the shape's figure (tiny ~0.11 GiB, medium
5 GiB, so that the step is CPU-sized). Only when even the smallest objective-preserving block budget does not fit
is ``max_tokens`` lowered (the largest granule multiple that fits every policy); documents over a lowered budget
are truncated and counted (``truncated`` per policy), never silently. A policy no plan fits is skipped unless
``--force``; if the weights alone do not fit, the setup line's ``notes`` say the check needs fewer target layers.

Ranks: ``--nproc N`` (default: every visible GPU on CUDA, 1 on CPU) re-executes the command N times with
torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; under torchrun it is not needed); nccl on
GPU, gloo on CPU. Each rank times its own batch of the same step; the draft is DDP over the ranks with the
frozen target left out, as training wraps it. Each step is training's: bf16 autocast on GPU (fp32 on CPU), global
loss normalisation (backward of the weighted CE sum, gradients scaled by world size / global weight), gradient
clipping and AdamW.

Output (rank 0): one JSON line ``setup`` (device, world size, peak FLOP/s and its source, attention path, token
budget and its source, memory figure and its source, the checkpointing choice and its source, ``memory_plan``:
per policy the block budget, checkpointing and the plan's reason), then one line per policy: ``policy,
max_tokens, max_block_tokens, activation_checkpointing, truncated, ktok_s, mfu, peak_mem_gb, peak_reserved_gb,
pred_peak_mem_gb, pred_peak_mem_gb_ckpt, mem_ratio, step_time_s, pad_eff, tflop_per_step, block_tokens_per_step,
loss, finite, steps, compiled_steps`` (timed steps during which flex_attention compiled: left out, see
``run_policy``).

FLOPs used for MFU: ``dflash_lab.model.footprint.step_flops`` ``total`` on each timed batch (model FLOPs, padding
and recomputation excluded; see footprint's docstring). MFU = sum over ranks of the timed steps' FLOPs / (timed
seconds x world size x peak FLOP/s per device). Peak: ``--gpu``'s ``bf16_dense_tflops``, else the device's dense
bf16 datasheet figure (H100/H200 SXM 989, H100 PCIe 756, A100 312 TFLOP/s), else the measured matmul peak
(``matmul_tflops``, always reported: bf16 8192^3 on GPU, fp32 1024^3 on CPU with the process's threads).

Memory: GPU: ``peak_mem_gb`` = ``torch.cuda.max_memory_allocated``, ``peak_reserved_gb`` =
``torch.cuda.max_memory_reserved`` over each timed step, max over steps and ranks. CPU: the process re-executes
itself with ``MALLOC_MMAP_THRESHOLD_=65536`` (every allocation of 64 KiB or more is its own mapping, returned to
the system when freed, so resident memory follows live tensors); before each timed step it resets the kernel's
peak-RSS mark (``/proc/self/clear_refs``), and ``peak_mem_gb`` = bytes of the tensors alive before the step
(weights, optimizer state, DDP's gradient buckets) + (peak RSS during the step - RSS before it);
``peak_reserved_gb`` = the process's whole peak RSS (VmHWM: interpreter and libraries included).
``pred_peak_mem_gb`` is the footprint model's peak of the same batches (anchors from the plan's block tokens,
the checkpointing in force), for the draft attention path the step actually runs (``footprint.attention_path``:
flex on GPU, per-document SDPA ``segments`` on CPU); ``mem_ratio`` = predicted / measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_lab import dist  # noqa: E402
from dflash_lab.data import collate_packed, collate_padded  # noqa: E402
from dflash_lab.data.lengths import reference_lengths  # noqa: E402
from dflash_lab.metrics.throughput import ktok_per_s, padding_efficiency  # noqa: E402
from dflash_lab.model import footprint  # noqa: E402
from dflash_lab.model.attention import flex_compile_count  # noqa: E402
from dflash_lab.model.build import DRAFT_KEYS, target_config_only, wrap_target  # noqa: E402
from dflash_lab.sampling import SEED_BOUNDARIES, policy_from_config  # noqa: E402
from dflash_lab.sampling.anchors import block_tokens_per_sample, valid_positions_from_lengths  # noqa: E402

POLICIES = ("sorted_static", "full_random", "bucketed", "bucketed_megabatch", "packed")
# The only shapes not read from conf/model: Qwen3s small enough for a CPU. tiny: deep enough for 5 evenly spaced
# reads; medium: a CPU-sized step big enough that the memory model's large terms dominate (>= 512 hidden, 32K vocab).
TINY_TARGET = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 192, "vocab_size": 264,
               "max_position_embeddings": 4096, "tie_word_embeddings": True}
MEDIUM_TARGET = {"model_type": "qwen3", "hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8,
                 "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 32768,
                 "max_position_embeddings": 8192, "tie_word_embeddings": False}
TINY_MEM_GB = 0.1 / footprint.USABLE_FRACTION   # CPU: plan the tiny step for ~100 MiB (RSS tracks its tensors)
MEDIUM_MEM_GB = 5.0                              # CPU: plan the medium step for 90% of 5 GiB (~1 TFLOP a step)
# Per shape: the target (None: conf/model's), the seed workload's length divisor, the token budget (training's
# sampler.max_tokens at that shape), the granule of a shrunk budget, the memory figure on a CPU (the "GPU memory"
# the memory plan fits), Hydra overrides of the model config.
SHAPES = {"qwen3-8b": {"target": None, "length_scale": 1, "budget": 32768, "granule": 1024, "cpu_mem_gb": 80.0,
                       "overrides": []},
          "medium": {"target": MEDIUM_TARGET, "length_scale": 2, "budget": 4096, "granule": 256,
                     "cpu_mem_gb": MEDIUM_MEM_GB, "overrides": ["model.draft_layers=2"]},
          "tiny": {"target": TINY_TARGET, "length_scale": 32, "budget": 4096, "granule": 64, "cpu_mem_gb": TINY_MEM_GB,
                   "overrides": ["model.anchors_per_doc=16"]}}   # the recipe's 512 scaled with the lengths
DATASHEET_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
GPU_PRESETS = ("none", "rtx_pro_6000", "h100", "h200")
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--model", default="qwen3_8b", help="conf/model/<name>.yaml (draft and objective settings)")
    parser.add_argument("--budget", default="auto", help="sampler.max_tokens per rank and step, or auto (the "
                        "shape's: 32768 at qwen3-8b; lowered only when no block budget that keeps the objective "
                        "fits)")
    parser.add_argument("--activation-checkpointing", default=None, choices=["auto", "true", "false"],
                        help="draft activation checkpointing (default: trainer.activation_checkpointing when given "
                        "as an override, else auto: on only where the memory plan needs it)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks to start (default: every visible GPU on "
                        "CUDA, 1 on CPU; gloo on CPU); ignored under torchrun")
    parser.add_argument("--gpu", default=None, choices=GPU_PRESETS, help="conf/gpu/<name>.yaml: memory for the "
                        "memory plan and bf16_dense_tflops for MFU (default: the device's own)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per policy (default 6 GPU, 2 CPU)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--num-samples", type=int, default=20000, help="documents drawn from the seed workload")
    parser.add_argument("--gpu-mem-gb", type=float, default=None, help="memory per device for the memory plan "
                        "(default: --gpu's, else the device's; on CPU the shape's figure)")
    parser.add_argument("--force", action="store_true", help="also run policies no memory plan fits (smallest "
                        "objective-preserving block budget, checkpointing on)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the training config, e.g. "
                        "model.anchor_density=0.0625 sampler.max_block_tokens=65536 "
                        "trainer.activation_checkpointing=true gpu=h200")
    args = parser.parse_args(argv)
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be >= 1")
    return args


def compose_config(model: str, overrides: list[str]):
    """The training config (conf/train.yaml) with ``model=<model>`` and the overrides, as Hydra composes it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[f"model={model}", *overrides])


def all_overrides(args) -> list[str]:
    """The shape's model overrides, ``--gpu`` as ``gpu=<name>``, then the command line's (which win)."""
    gpu = [f"gpu={args.gpu}"] if args.gpu else []
    return [*SHAPES[args.shape]["overrides"], *gpu, *args.overrides]


def checkpointing_choice(args, trainer_cfg) -> tuple[str | bool, str]:
    """Draft activation checkpointing (True, False or ``auto``) and where it came from: ``--activation-
    checkpointing``, else a ``trainer.activation_checkpointing=`` override, else auto."""
    override = any(o.lstrip("+").startswith("trainer.activation_checkpointing=") for o in args.overrides)
    if args.activation_checkpointing is not None:
        value, source = args.activation_checkpointing, "--activation-checkpointing"
        if override and str(trainer_cfg.get("activation_checkpointing")).lower() != value:
            raise SystemExit(f"--activation-checkpointing={value} contradicts the override trainer."
                             f"activation_checkpointing={trainer_cfg.get('activation_checkpointing')}: give one")
    elif override:
        value, source = trainer_cfg.get("activation_checkpointing"), "trainer.activation_checkpointing override"
    else:
        value, source = "auto", "default"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if value not in (True, False, "auto"):
        raise SystemExit(f"activation checkpointing {value!r}: use true, false or auto")
    return value, source


def sampler_config(policy: str, model: str, overrides: list[str], budget: int, length_scale: int,
                   longest: int) -> dict:
    """conf/sampler/<policy>.yaml as training composes it, with the benchmark's token budget and the seed
    boundaries. Documents longer than the budget are truncated (``overlong=truncate``, counted in the output)
    only when the budget is below the longest document; otherwise the configured rule stands."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose_config(model, [f"sampler={policy}", *overrides]).sampler, resolve=True)
    cfg["max_tokens"] = int(budget)
    if budget < longest:
        cfg["overlong"] = "truncate"
    if "boundaries" in cfg:
        cfg["boundaries"] = sorted({int(round(b / length_scale)) for b in SEED_BOUNDARIES})
    return cfg


def benchmark_block_tokens(lengths: np.ndarray, budget: int, step_model: footprint.StepModel) -> np.ndarray:
    """Block tokens per sample under the model's anchor rule, every token supervised (random benchmark batches:
    ``valid_positions_from_lengths`` of the lengths after any truncation to the budget)."""
    return block_tokens_per_sample(valid_positions_from_lengths(np.minimum(lengths, budget)),
                                   block_size=step_model.block_size, anchors_per_doc=step_model.anchors_per_doc,
                                   anchor_density=step_model.anchor_density)


def plan_memory(cfg: dict, lengths, step_model, settings, ckpt, mem_gb, world_size) -> footprint.MemoryPlan:
    return footprint.memory_plan(step_model, lengths, cfg, settings, activation_checkpointing=ckpt,
                                 gpu_mem_gb=mem_gb, seed=0,
                                 block_tokens=benchmark_block_tokens(lengths, int(cfg["max_tokens"]), step_model))


def resolve_plans(args, lengths, step_model, settings, ckpt, mem_gb, world_size) -> tuple[int, str, dict]:
    """The token budget and each policy's memory plan (block budget, checkpointing, reason).

    ``--budget auto`` keeps the shape's token budget; it is lowered (largest multiple of the shape's granule, the
    same for every policy) only when some policy has no objective-preserving block budget that fits at it.
    A policy that fits at no budget gets ``{"error": ...}`` (run anyway with ``--force``)."""
    shape = SHAPES[args.shape]
    longest = int(np.max(lengths))
    overrides = all_overrides(args)

    def plans_at(budget: int) -> dict:
        out = {}
        for name in args.policies.split(","):
            cfg = sampler_config(name, args.model, overrides, budget, shape["length_scale"], longest)
            try:
                out[name] = plan_memory(cfg, lengths, step_model, settings, ckpt, mem_gb, world_size)
            except footprint.PreflightError as exc:
                out[name] = {"error": str(exc)}
        return out

    if args.budget not in (None, "auto"):
        return int(args.budget), "--budget", plans_at(int(args.budget))
    budget = shape["budget"]
    plans = plans_at(budget)
    if all(isinstance(p, footprint.MemoryPlan) for p in plans.values()):
        return budget, "the shape's sampler.max_tokens", plans
    lo, hi = 1, budget // shape["granule"] - 1            # granules; the full budget failed
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if all(isinstance(p, footprint.MemoryPlan) for p in plans_at(mid * shape["granule"]).values()):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best is None:
        return budget, "nothing fits at any token budget", plans
    budget = best * shape["granule"]
    return budget, f"lowered from {shape['budget']}: no block budget keeps the objective at it", plans_at(budget)


def build_benchmark_model(model_cfg: dict, shape: str, device: torch.device, on_gpu: bool):
    """Random-weight target of the configured (or tiny/medium) shape wrapped with the configured draft."""
    from transformers import AutoModelForCausalLM

    target_cfg = SHAPES[shape]["target"]
    config = (target_config_only("hf", target_config=target_cfg, target_path=None) if target_cfg is not None
              else target_config_only(**model_cfg))
    config._attn_implementation = model_cfg.get("attn_implementation") or "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if on_gpu else torch.float32)
    target.eval()
    mask_id = model_cfg.get("mask_token_id")
    mask_id = config.vocab_size - 1 if mask_id is None else int(mask_id)  # a row past any tokenizer's vocabulary
    draft = {k: model_cfg[k] for k in DRAFT_KEYS}
    return wrap_target(target, mask_token_id=mask_id, **{**draft, "draft_init_seed": 0},
                       activation_checkpointing=False)


def matmul_tflops(device: torch.device) -> float:
    """Measured dense matmul peak: bf16 8192^3 on GPU, fp32 1024^3 on CPU; best of several runs."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def datasheet_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in DATASHEET_BF16_TFLOPS if key in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _proc_status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


class PeakMemory:
    """Peak memory of one step. GPU: the CUDA allocator's peaks (allocated; reserved). CPU: live tensor bytes +
    the RSS growth during the step (allocated); the process's peak resident set (reserved: everything it holds)."""

    def __init__(self, device: torch.device, static_bytes):
        self.device = device
        self.static_bytes = static_bytes

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.static = self.static_bytes()
            Path("/proc/self/clear_refs").write_text("5")   # resets VmHWM to the current RSS
            self.rss_before = _proc_status_kib("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.reserved = torch.cuda.max_memory_reserved(self.device)
        else:
            hwm = _proc_status_kib("VmHWM")
            self.peak = self.static + 1024 * (hwm - self.rss_before)
            self.reserved = 1024 * hwm
        return False


def random_batch(indices: np.ndarray, lengths: np.ndarray, packed: bool, vocab: int, generator: torch.Generator):
    samples = [{"input_ids": torch.randint(4, vocab - 1, (int(lengths[j]),), generator=generator),
                "loss_mask": torch.ones(int(lengths[j]), dtype=torch.bool)} for j in indices]
    collate = collate_packed if packed else collate_padded
    return collate(samples, indices.tolist(), lengths[indices].tolist(), 0)


def run_policy(name, memory, model, train_model, optimizer, autocast, env, device, args, budget, lengths, step_model,
               settings, gpu_mem_gb, peak_flops, static_bytes) -> dict:
    scale = SHAPES[args.shape]["length_scale"]
    cfg = sampler_config(name, args.model, all_overrides(args), budget, scale, int(np.max(lengths)))
    out = {"policy": name, "max_tokens": budget}
    if not isinstance(memory, footprint.MemoryPlan):
        if not args.force:
            return {**out, "skipped": memory["error"] + " (pass --force to run it anyway)"}
        blocks = benchmark_block_tokens(lengths, budget, step_model)
        memory = footprint.MemoryPlan(int(blocks.max()), True, "forced: the smallest block budget that keeps the "
                                                               "objective, checkpointing on")
    cfg["max_block_tokens"] = memory.max_block_tokens
    block_tokens = benchmark_block_tokens(lengths, budget, step_model)
    policy = policy_from_config(cfg, lengths, seed=0, world_size=env.world_size, rank=env.rank,
                                block_tokens=block_tokens if memory.max_block_tokens is not None else None)
    model.max_block_tokens = memory.max_block_tokens
    model.draft.activation_checkpointing = memory.activation_checkpointing
    settings = replace(settings, activation_checkpointing=memory.activation_checkpointing)
    out.update({"max_block_tokens": memory.max_block_tokens, "activation_checkpointing":
                memory.activation_checkpointing, "truncated": int(policy.admission.truncated),
                "overlong": cfg.get("overlong")})
    plan = policy.global_plan(0)
    total = args.warmup + args.steps
    if plan.steps < total:
        raise ValueError(f"{name}: the plan has {plan.steps} steps, fewer than --warmup + --steps = {total}; "
                         f"raise --num-samples")
    global_batches = plan.batches[: total * env.world_size]
    anchors_of = footprint.policy_anchors(policy, step_model)
    shapes_all = footprint.batch_shapes(global_batches, policy.lengths, packed=policy.packed, model=step_model,
                                        anchors=anchors_of)
    timed = slice(args.warmup * env.world_size, total * env.world_size)
    generator = torch.Generator().manual_seed(1)
    params = model.trainable_parameters()
    times, peaks, reserved, real, padded, compiled, blocks = [], [], [], [], [], [], []
    for step in range(total):
        batch = random_batch(global_batches[step * env.world_size + env.rank], policy.lengths, policy.packed,
                             step_model.target.vocab, generator)
        batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
        anchors = torch.Generator().manual_seed(1000 * step + env.rank)
        graphs = flex_compile_count()
        _sync(device)
        with PeakMemory(device, static_bytes) as memory_step:
            start = time.perf_counter()
            with autocast:
                result = train_model(batch, anchors)
            result.weighted_ce_sum.backward()
            # Global loss normalisation, as training does: d(global CE sum / global weight) on every rank.
            global_weight = dist.all_reduce_sum(result.weight_sum.detach().clone().double())
            scale_grads = (env.world_size / global_weight.clamp_min(1e-12)).float()
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale_grads)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)   # a sync point on purpose: the step time must include the device's work
            seconds = time.perf_counter() - start
        if step >= args.warmup:
            times.append(seconds)
            peaks.append(memory_step.peak)
            reserved.append(memory_step.reserved)
            real.append(int(batch["real_tokens"]))
            padded.append(int(batch["padded_tokens"]))
            compiled.append(float(flex_compile_count() > graphs))
            index = global_batches[step * env.world_size + env.rank]
            blocks.append(float(anchors_of[index].sum() * step_model.block_size) if anchors_of is not None
                          else float("nan"))
    local = torch.tensor([*times, *peaks, *reserved, *real, *padded, *compiled, float(result.loss.detach())],
                         dtype=torch.float64, device=device)
    gathered = dist.all_gather_rows(local).cpu().numpy()
    per_step = gathered[:, :-1].reshape(env.world_size, 6, args.steps)
    loss = float(gathered[0, -1])
    step_times, step_peaks, step_reserved, step_real, step_padded, step_compiled = per_step.transpose(1, 0, 2)
    # A timed step during which some rank compiled flex_attention (a batch shape or layout no warm-up step had,
    # e.g. the first packed row of several documents) measures the compiler, not the step: such steps are left out
    # of every number below (all of them only when every timed step compiled; ``compiled_steps`` says how many).
    clean = ~step_compiled.any(axis=0)
    if not clean.any():
        clean[:] = True
    kept = int(clean.sum())
    elapsed = float(step_times[:, clean].max(axis=0).sum())      # the slowest rank sets each step's time
    total_real, total_padded = step_real[:, clean].sum(), step_padded[:, clean].sum()
    measured = float(step_peaks[:, clean].max())
    kept_batches = np.repeat(clean, env.world_size)              # timed batches are step-major, rank-minor
    kept_shapes = {k: v[timed][kept_batches] for k, v in shapes_all.items()}
    pred = {ckpt: float(footprint.step_memory(step_model, kept_shapes,
                                              replace(settings, activation_checkpointing=ckpt))["peak"].max())
            for ckpt in (False, True)}
    predicted = pred[settings.activation_checkpointing]
    flops = footprint.step_flops(step_model, kept_shapes)["total"]
    mfu = float(flops.sum()) / (elapsed * env.world_size * peak_flops)
    return {**out, "pred_peak_mem_gb": predicted / footprint.GIB, "pred_peak_mem_gb_ckpt": pred[True] / footprint.GIB,
            "ktok_s": ktok_per_s(total_real, elapsed), "mfu": mfu, "peak_mem_gb": measured / footprint.GIB,
            "peak_reserved_gb": float(step_reserved[:, clean].max()) / footprint.GIB,
            "step_time_s": elapsed / kept, "pad_eff": padding_efficiency(total_real, total_padded),
            "mem_ratio": predicted / measured, "tflop_per_step": float(flops.sum()) / kept / env.world_size / 1e12,
            "block_tokens_per_step": float(np.nanmean(blocks)) if blocks else None,
            "loss": loss, "finite": bool(np.isfinite(loss)), "steps": kept,
            "compiled_steps": int(step_compiled.any(axis=0).sum())}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_ranks(nproc: int) -> int:
    """Start ``nproc`` copies of this command as ranks 0..nproc-1 (torchrun's environment variables, one node);
    a rank that fails stops the others. Returns the worst exit code."""
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, *sys.argv], env=env))
    codes = [None] * nproc
    while any(c is None for c in codes):
        for i, proc in enumerate(procs):
            if codes[i] is None:
                codes[i] = proc.poll()
        if any(c not in (None, 0) for c in codes):
            for i, proc in enumerate(procs):
                if codes[i] is None:
                    proc.terminate()
                    codes[i] = proc.wait()
            break
        time.sleep(0.2)
    return max(abs(int(c)) for c in codes)


def gpu_preset(cfg) -> dict:
    from omegaconf import OmegaConf

    preset = OmegaConf.to_container(cfg.gpu, resolve=True) if "gpu" in cfg and cfg.gpu is not None else {}
    return preset or {}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cpu" and os.environ.get(MMAP_ENV) is None:
        # Re-execute with a fixed mmap threshold before any allocation (see the module docstring).
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, MMAP_ENV: "65536"})
    nproc = args.nproc or (max(1, torch.cuda.device_count()) if args.device == "cuda" else 1)
    if "RANK" not in os.environ and nproc > 1:
        sys.exit(launch_ranks(nproc))
    args.steps = args.steps or (6 if args.device == "cuda" else 2)
    from omegaconf import OmegaConf

    env = dist.init_distributed(backend="gloo" if args.device == "cpu" else None)
    device = torch.device(f"cuda:{env.local_rank}" if args.device == "cuda" else "cpu")
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    elif env.distributed:   # the CPUs shared by the ranks (OMP_NUM_THREADS, when set, caps each rank)
        cap = int(os.environ.get("OMP_NUM_THREADS") or 1 << 20)
        torch.set_num_threads(max(1, min(cap, len(os.sched_getaffinity(0)) // env.world_size)))
    cfg = compose_config(args.model, all_overrides(args))
    ckpt, ckpt_source = checkpointing_choice(args, OmegaConf.to_container(cfg.trainer, resolve=True))
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model = build_benchmark_model(model_cfg, args.shape, device, on_gpu)
    step_model = footprint.StepModel.from_model(model)
    preset = gpu_preset(cfg)
    if args.gpu_mem_gb:
        gpu_mem_gb, mem_source = args.gpu_mem_gb, "--gpu-mem-gb"
    elif preset.get("memory_gb"):
        gpu_mem_gb, mem_source = float(preset["memory_gb"]), f"gpu={preset.get('name')}"
    elif on_gpu:
        gpu_mem_gb, mem_source = torch.cuda.get_device_properties(device).total_memory / footprint.GIB, "device"
    else:
        gpu_mem_gb, mem_source = SHAPES[args.shape]["cpu_mem_gb"], f"--shape {args.shape} on CPU"
    scale = SHAPES[args.shape]["length_scale"]
    lengths = reference_lengths("seed", args.num_samples, seed=0, scale=scale)
    settings = footprint.Settings(precision="bf16" if on_gpu else "fp32", world_size=env.world_size)
    # the draft's attention path as training picks it: flex_attention on GPU, per-document SDPA on CPU
    settings = replace(settings, attention=footprint.attention_path(device.type, model.attention_backend))
    budget, budget_source, plans = resolve_plans(args, lengths, step_model, settings, ckpt, gpu_mem_gb,
                                                 env.world_size)

    train_model = model
    if env.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        DDP._set_params_and_buffers_to_ignore_for_model(model, frozen)
        train_model = DDP(model, device_ids=[env.local_rank] if on_gpu else None)
    model.train()
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=6e-4)   # as training builds it
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)
    # DDP's gradient buckets (one copy of the trainable parameters) are allocated outside the step, like weights
    buckets = (sum(p.numel() * p.element_size() for p in model.trainable_parameters())
               if env.distributed else 0)

    def static_bytes() -> int:
        tensors = [*model.parameters(), *model.buffers()]
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if torch.is_tensor(v))
        return buckets + sum(t.numel() * t.element_size() for t in tensors)

    measured_peak = matmul_tflops(device)
    sheet = datasheet_tflops(device)
    if preset.get("bf16_dense_tflops"):
        peak_tflops, peak_source = float(preset["bf16_dense_tflops"]), f"gpu={preset.get('name')}"
    elif sheet:
        peak_tflops, peak_source = sheet, "datasheet"
    else:
        peak_tflops, peak_source = measured_peak, "matmul"
    static_gb = float(footprint.step_memory(step_model, footprint.batch_shapes(
        [np.arange(1)], np.array([2]), packed=True, model=step_model), settings)["static"][0]) / footprint.GIB
    notes = []
    if static_gb > footprint.USABLE_FRACTION * gpu_mem_gb:
        notes.append(f"weights and optimizer alone ({static_gb:.1f} GiB) exceed {footprint.USABLE_FRACTION:.0%} of "
                     f"{gpu_mem_gb:g} GiB: the check needs fewer target layers (model.target_config.num_hidden_layers)")
    elif not any(isinstance(p, footprint.MemoryPlan) for p in plans.values()):
        notes.append("no token budget fits: the check needs fewer target layers or a smaller shape")
    if env.is_main:
        print(json.dumps({"setup": {
            "shape": args.shape, "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
            "world_size": env.world_size, "threads": torch.get_num_threads(), "precision": settings.precision,
            "attention": settings.attention, "budget": budget, "budget_source": budget_source,
            "gpu_mem_gb": gpu_mem_gb, "gpu_mem_source": mem_source,
            "peak_tflops": peak_tflops, "peak_source": peak_source,
            "matmul_tflops": measured_peak, "target_params_b": step_model.target.params / 1e9,
            "draft_params_m": step_model.draft.params / 1e6, "static_gb": static_gb,
            "activation_checkpointing": ckpt, "activation_checkpointing_source": ckpt_source,
            "memory_plan": {name: ({"max_block_tokens": p.max_block_tokens,
                                    "activation_checkpointing": p.activation_checkpointing, "reason": p.reason}
                                   if isinstance(p, footprint.MemoryPlan) else p) for name, p in plans.items()},
            "model": {k: model_cfg.get(k) for k in ("block_size", "draft_layers", "anchors_per_doc",
                                                    "anchor_density", "fixed_anchors")},
            "notes": notes, "overrides": all_overrides(args)}}), flush=True)
    for name in args.policies.split(","):
        try:
            row = run_policy(name, plans[name], model, train_model, optimizer, autocast, env, device, args, budget,
                             lengths, step_model, settings, gpu_mem_gb, peak_tflops * 1e12, static_bytes)
        except torch.cuda.OutOfMemoryError as exc:   # single process only: under DDP the memory plan prevents it
            row = {"policy": name, "error": f"out of memory: {str(exc).splitlines()[0]}"}
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        if env.is_main:
            print(json.dumps(row), flush=True)
    dist.cleanup()


if __name__ == "__main__":
    main()
