"""GPU check of the training step, built from the training config: Ktok/s, FLOPs, utilisation and peak memory per
policy, in the memory plan's regime or in the seed run's regime.

    python benchmarks/gpu_check.py                                  # every local GPU (--nproc), Qwen3-8B shape
    python benchmarks/gpu_check.py --regime seed --quick            # the seed's regime, one GPU, <= ~3 min
    python benchmarks/gpu_check.py --regime seed,plan --policies full_random,bucketed,packed --policies bucketed,packed
                                                                    # both regimes in one process (gpu_check.sh)
    python benchmarks/gpu_check.py --device cpu --shape tiny        # the same path on a CPU, tiny target
    python benchmarks/gpu_check.py --device cpu --shape tiny --regime seed --quick   # the seed regime on a CPU
    python benchmarks/gpu_check.py --device cpu --shape medium      # CPU, hidden 512 / 32K vocabulary (~2 min)
    python benchmarks/gpu_check.py --device cpu --nproc 2 --shape tiny   # two gloo ranks under DDP
    bash scripts/gpu_check.sh [--quick] OUT.jsonl                   # this + CUDA tests + a real training

Regimes (``--regime``):

* ``plan`` (default): the budgets training resolves (below): the memory plan's block budget and checkpointing
  against the GPU's memory (or ``--gpu``'s), every policy unless ``--policies``.
* ``seed``: the seed run's regime, the one its 25.1 Ktok/s and full_random/bucketed = 0.478 are about: one
  rank (``--nproc 1`` unless given), memory capped at the seed's RTX PRO 6000 (``--mem-cap-gb``, default 96 GiB:
  ``torch.cuda.set_per_process_memory_fraction``; the CUDA context is outside the cap), no block budget
  (``sampler.max_block_tokens=null``), the shape's token budget (32,768 at qwen3-8b), the model config's anchors
  (qwen3_8b: the recipe's ``min(512, valid positions)``), policies full_random, bucketed and packed. Draft
  activation checkpointing only on the steps the memory model says do not fit 90% of the cap without it (on a
  CPU, with no cap, the shape's stand-in figure, ``SHAPES``); a step that still runs out of memory is recorded
  (``oom_steps``: its predicted peak) and the next one runs (one rank only: under DDP an out-of-memory rank would
  stall the others). Per policy ``pred_fit_frac``: the share of the epoch plan's steps that fit without it. After
  the policies, one step again with checkpointing on (``--ckpt-step``, on by default in this regime): the first
  timed batch that ran out of memory, else of those run without checkpointing the one with the largest predicted
  peak, to measure checkpointing's time and peak on the same batch.
* several, comma-separated (``--regime seed,plan``, what scripts/gpu_check.sh runs): each regime in turn in one
  process, on one model, so the start (imports, random weights, AdamW's moments, the matmul peak) and the compiled
  graphs are paid once; each regime has its own setup line, memory cap (the seed's 96 GiB, then the whole device),
  plans, steps, epoch, checkpointing step and profile, and every line names its ``regime``. One rank (the seed
  regime's). ``--policies`` and ``--deadline-s`` given once hold for every regime, given once per regime go in
  order (``--deadline-s`` counts from the start in each: the seed regime stops starting steps in time for the
  plan's); ``--profile-trace PATH`` writes ``PATH``'s stem + ``_<regime>`` per regime.

After the policies (both regimes), the ``epoch`` line (benchmarks/gpu_epoch.py): per policy a least-squares fit of
its clean timed steps' seconds on their executed FLOPs (``seconds = a + b x FLOPs``, a, b >= 0), and the epoch's
Ktok/s (over time, and the median step's) with every step of its epoch plan priced by that fit through the
planner's ``predict_throughput``, next to the planner's own (``planner_prediction``: conf_plan/cost/seed.yaml and
the rtx_pro_6000 preset, the FLOPs form, whose ratios do not depend on the utilisation); ``ratio`` /
``planner_ratio``: full_random / bucketed Ktok/s over the epoch, measured and planned, and ``ratios`` every figure
for full_random / bucketed and packed / bucketed (``sample``: the timed steps' own Ktok/s). The epoch is priced as
the memory plan runs it (no checkpointing in the seed regime, as the planner assumes; a checkpointed sample step
enters the fit with its recomputed FLOPs). Then the ``profile`` line (``--profile``, on by default;
benchmarks/gpu_profile.py): bucketed's clean timed step of median executed FLOPs (on a CPU its cheapest) once
more under ``torch.profiler``: device time (CPU operator time on a CPU) by kernel class, by range of the step
(target, draft forward, head, fixed anchors, the rest of the forward, backward, optimizer) and the top kernels;
``--profile-trace PATH`` also writes its Chrome trace.

Modes: ``--quick``: fewer documents to plan from (8,000), two warm-up steps per policy and five timed ones on GPU
(one and two on CPU); the default: 20,000 documents, two warm-up and eight timed steps on GPU (two and three on
CPU). Warm-up steps run each policy's cheapest batches (fewest executed FLOPs; two different shapes, so that
flex_attention compiles its static and its dynamic graph there: "everything compiled once"). Timed steps
(``--sample``): ``stratified`` (default) one step from each of ``--steps`` equal-count cost strata of the epoch
plan (``gpu_epoch.stratified_steps``: one per decile at 10), so that the sample stands for the epoch; ``first``
the plan's first batches in order (what the first H200 run timed: its six steps carried 25.3 real Ktok per
executed PFLOP where the epoch carries 19.7). AdamW's moments exist before the first step is measured
(``create_optimizer_state``: that run's first warm-up step measured its peak 7.9 GiB low without them).
``--deadline-s S``: no step starts that could not end S seconds from the start (as long as the longest step so
far); what has been measured is still reported (a policy cut short says so in ``stopped``).

What runs: the training config composed by Hydra (``conf/train.yaml`` with ``model=qwen3_8b`` and each
``conf/sampler/<policy>.yaml``; extra ``key=value`` arguments are Hydra overrides, e.g. ``gpu=h200``,
``sampler.max_block_tokens=65536``, ``trainer.activation_checkpointing=true``), so the draft and objective are
training's: 5 draft layers, block 16, the recipe's anchor rule (``min(512, valid positions)`` per document), the
seed's bucket boundaries. The target is the model config's shape (``--shape tiny``/``medium``: small Qwen3 shapes;
medium: hidden 512, 6 layers, 32,768 words, 2 draft layers) with random weights: no download, speed and memory
only. Documents: the seed workload (docs/workloads.md; lengths and boundaries divided by 32 for tiny, 2 for
medium; tiny scales anchors_per_doc by the same 32). Every token is supervised (random batches), so a
document's block tokens are ``sampling.anchors.block_tokens_per_sample`` on ``l - 1`` valid positions.

Budgets in the plan regime, as training resolves them (``dflash_lab.training.components.resolve_memory_plan``): the token
budget stays the shape's ``sampler.max_tokens`` (32,768 at qwen3-8b, 4,096 tiny/medium; ``--budget N`` sets it),
and each policy's block budget (``sampler.max_block_tokens``, ``auto`` unless overridden) and draft activation
checkpointing (``--activation-checkpointing {auto,true,false}``, else a ``trainer.activation_checkpointing=``
override, else auto) come from ``footprint.memory_plan`` against 90% of the memory figure: ``--gpu-mem-gb``, else
``--gpu``'s preset (``conf/gpu/<name>.yaml``), else the device's own; on a CPU the shape's figure (tiny ~0.11 GiB,
medium 5 GiB, so that the step is CPU-sized). Only when even the smallest objective-preserving block budget does
not fit is ``max_tokens`` lowered (the largest granule multiple that fits every policy); documents over a lowered
budget are truncated and counted (``truncated`` per policy), never silently. A policy no plan fits is skipped
unless ``--force``; if the weights alone do not fit, the setup line's ``notes`` say the check needs fewer target
layers.

Ranks: ``--nproc N`` (default: every visible GPU on CUDA in the plan regime, else 1) re-executes the command N
times with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; under torchrun it is not needed);
nccl on GPU, gloo on CPU. Each rank times its own batch of the same step; the draft is DDP over the ranks with
the frozen target left out, as training wraps it. Each step is training's: bf16 autocast on GPU (fp32 on CPU),
global loss normalisation (backward of the weighted CE sum, gradients scaled by world size / global weight),
gradient clipping and AdamW.

Output (rank 0), one JSON object per line, each with its ``regime``: ``setup`` (device, world size, regime(s),
peak FLOP/s and its source, attention path, token budget and its source, memory figure and cap, the checkpointing
choice and its source, ``memory_plan``: per policy the block budget, checkpointing and the plan's reason); one
``step`` line per step as it ends (policy, phase warmup/timed/ckpt, seconds, real/padded tokens, block slots, its
checkpointing, executed TFLOP, predicted and measured peak, predicted reserved memory ``pred_reserved_gb`` and
measured fragments ``frag_gb``, compiled, oom); one line per policy: ``policy, max_tokens, max_block_tokens,
activation_checkpointing, truncated, sample, ktok_s, ktok_s_median_step, mfu, hfu, tflop_per_step,
executed_tflop_per_step, executed_tflops, peak_mem_gb, peak_reserved_gb, pred_peak_mem_gb, pred_peak_mem_gb_ckpt,
mem_ratio, step_time_s, pad_eff, block_tokens_per_step, real_tokens_per_step, docs_per_step, ckpt_steps, loss,
finite, steps, compiled_steps, oom_steps, flex_graphs`` (+ in the seed regime ``epoch_steps, pred_fit_frac,
mem_cap_gb``); the ``epoch`` line; the ``ckpt_step`` line (``--ckpt-step``); the ``profile`` line (``--profile``).

Definitions. Ktok/s (``ktok_s``): real tokens of the timed steps over their summed wall time (all ranks' tokens;
the slowest rank sets each step's time), as a multi-day run's tokens / wall time; ``ktok_s_median_step`` the
median step's (the trainer's steady-state figure). FLOPs (``dflash_lab.model.footprint.step_flops``) on each
timed batch: ``tflop_per_step`` model FLOPs (padding and recomputation excluded), ``executed_tflop_per_step``
what the hardware runs (padded tokens and padding anchor slots included, + the recomputed draft forward under
checkpointing). MFU = model FLOPs / (timed seconds x world size x peak FLOP/s); hardware FLOP utilisation ``hfu``
= executed FLOPs / the same; ``executed_tflops`` = executed TFLOP/s per rank. Peak: ``--gpu``'s
``bf16_dense_tflops``, else the device's dense bf16 datasheet figure (H100/H200 SXM 989, H100 PCIe 756, A100
312 TFLOP/s), else the measured matmul peak (``matmul_tflops``, always reported: bf16 8192^3 on GPU, fp32 1024^3
on CPU with the process's threads). Steps during which flex_attention compiled a graph
(``attention.flex_compile_count``: flex graphs only) or that ran out of memory are left out of every number
(all of them only when every timed step compiled).

Memory: GPU: ``peak_mem_gb`` = ``torch.cuda.max_memory_allocated``, ``peak_reserved_gb`` =
``torch.cuda.max_memory_reserved`` over each timed step, max over steps and ranks; per step ``frag_gb``: the
allocator's ``inactive_split_bytes`` peak (free memory in split blocks it cannot release). The CUDA caching
allocator runs with expandable segments unless the user set ``PYTORCH_CUDA_ALLOC_CONF`` (the setup line's
``cuda_alloc_conf`` and its source; dflash_lab/training/allocator.py). CPU: the process re-executes itself with
``MALLOC_MMAP_THRESHOLD_=65536`` (every allocation of 64 KiB or more is its own mapping, returned to the system
when freed); ``peak_mem_gb`` = bytes of the tensors alive before the step (weights, optimizer state, DDP's
gradient buckets) + the CPU allocator's peak growth during it (torch.profiler's memory events, ``Total
Allocated``: every tensor, small ones included; ``PeakMemory``); ``peak_reserved_gb`` = the process's whole peak
RSS over the step (VmHWM after ``/proc/self/clear_refs``: interpreter and libraries included).
``pred_peak_mem_gb`` is the footprint model's peak of the same batches (anchors from the plan's block tokens,
the checkpointing in force), for the draft attention path the step actually runs (``footprint.attention_path``:
flex on GPU, per-document SDPA ``segments`` on CPU); ``mem_ratio`` = predicted / measured; ``pred_reserved_gb``
(GPU) adds the fragmentation margin the memory plan reserves (``footprint.FRAGMENTATION_FRACTION``).
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))   # gpu_epoch, gpu_profile (also when loaded from its path)

from dflash_lab.training import dist  # noqa: E402
from dflash_lab.training.allocator import configure_cuda_allocator  # noqa: E402
from dflash_lab.data import collate_packed, collate_padded  # noqa: E402
from dflash_lab.data.lengths import reference_lengths  # noqa: E402
from dflash_lab.metrics.throughput import ktok_per_s, padding_efficiency  # noqa: E402
from dflash_lab.model import footprint  # noqa: E402
from dflash_lab.model.attention import flex_compile_count  # noqa: E402
from dflash_lab.model.build import DRAFT_KEYS, target_config_only, wrap_target  # noqa: E402
from dflash_lab.sampling import SEED_BOUNDARIES, policy_from_config  # noqa: E402
from dflash_lab.sampling.anchors import block_tokens_per_sample, valid_positions_from_lengths  # noqa: E402
import gpu_epoch  # noqa: E402
import gpu_profile  # noqa: E402

POLICIES = ("sorted_static", "full_random", "bucketed", "bucketed_megabatch", "packed")
REGIMES = ("plan", "seed")
SEED_POLICIES = ("full_random", "bucketed", "packed")
SEED_MEM_CAP_GB = 96.0   # the seed's RTX PRO 6000 (conf/gpu/rtx_pro_6000.yaml memory_gb, read as GiB as the planner does)
SEED_COST = ROOT / "conf_plan" / "cost" / "seed.yaml"
SEED_GPU = ROOT / "conf" / "gpu" / "rtx_pro_6000.yaml"
# (warm-up steps, timed steps = cost strata, documents to plan from) per mode and device. The H200 ran a timed
# Qwen3-8B step in 1.3-3.6 s (2.1 s median), so full mode's 8 strata x 3 policies fit its stage limit with the
# warm-up's compiling (scripts/gpu_check_stages.py, TIMEOUTS)
MODES = {("quick", "cuda"): (2, 5, 8000), ("quick", "cpu"): (1, 2, 8000),
         ("full", "cuda"): (2, 8, 20000), ("full", "cpu"): (2, 3, 20000)}
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
# the memory plan fits) and the seed regime's stand-in for its 96 GiB cap on a CPU (which steps run with
# checkpointing; tiny: 0.28 GiB, so that about as many steps fit as fit 96 GiB at the Qwen3-8B shape: full_random
# ~60%, bucketed ~35%, packed ~5%), Hydra overrides of the model config.
SHAPES = {"qwen3-8b": {"target": None, "length_scale": 1, "budget": 32768, "granule": 1024, "cpu_mem_gb": 80.0,
                       "seed_cpu_mem_gb": SEED_MEM_CAP_GB, "overrides": []},
          "medium": {"target": MEDIUM_TARGET, "length_scale": 2, "budget": 4096, "granule": 256,
                     "cpu_mem_gb": MEDIUM_MEM_GB, "seed_cpu_mem_gb": MEDIUM_MEM_GB,
                     "overrides": ["model.draft_layers=2"]},
          "tiny": {"target": TINY_TARGET, "length_scale": 32, "budget": 4096, "granule": 64, "cpu_mem_gb": TINY_MEM_GB,
                   "seed_cpu_mem_gb": 0.28,
                   "overrides": ["model.anchors_per_doc=16"]}}   # the recipe's 512 scaled with the lengths
DATASHEET_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
GPU_PRESETS = ("none", "rtx_pro_6000", "h100", "h200")
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


START = time.perf_counter()   # --deadline-s counts from here


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--regime", default="plan", type=regime_list, help="plan: the memory plan's block budget "
                        "and checkpointing (default); seed: the seed run's regime (96 GiB cap, no checkpointing, no "
                        "block budget, 32K-token steps, full_random/bucketed/packed, the planner's ratio beside); "
                        "several, comma-separated (seed,plan): one after the other in one process on one model")
    parser.add_argument("--quick", action="store_true", help="quick mode: 8,000 documents, 2 warm-up + 3 timed "
                        "steps per policy on GPU (1 + 1 on CPU); default: 20,000, 2 + 6 (2 + 2 on CPU)")
    parser.add_argument("--model", default="qwen3_8b", help="conf/model/<name>.yaml (draft and objective settings)")
    parser.add_argument("--budget", default="auto", help="sampler.max_tokens per rank and step, or auto (the "
                        "shape's: 32768 at qwen3-8b; in the plan regime lowered only when no block budget that keeps "
                        "the objective fits)")
    parser.add_argument("--activation-checkpointing", default=None, choices=["auto", "true", "false"],
                        help="draft activation checkpointing (default: trainer.activation_checkpointing when given "
                        "as an override, else auto: on only where the memory plan needs it; the seed regime: off)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks to start (default: every visible GPU on "
                        "CUDA in the plan regime, else 1; gloo on CPU); ignored under torchrun")
    parser.add_argument("--gpu", default=None, choices=GPU_PRESETS, help="conf/gpu/<name>.yaml: memory for the "
                        "memory plan and bf16_dense_tflops for MFU (default: the device's own)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per policy (default: the mode's); "
                        "with --sample stratified the number of cost strata, one step from each")
    parser.add_argument("--sample", default="stratified", choices=["stratified", "first"], help="which steps to "
                        "time: one per cost stratum of the epoch plan (default), or the plan's first steps")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True, help="after the "
                        "policies, one bucketed step under torch.profiler: the gpu_check_profile line (default: on)")
    parser.add_argument("--profile-trace", default=None, help="also write the profiled step's Chrome trace here")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first, on the policy's cheapest "
                        "batches (compilation, allocator; default 2, 1 in quick mode on CPU)")
    parser.add_argument("--policies", dest="policies_given", action="append", default=None,
                        help="comma-separated (default: every policy; the seed regime: "
                        f"{','.join(SEED_POLICIES)}); with several regimes once for all, or once per regime in order")
    parser.add_argument("--num-samples", type=int, default=None, help="documents drawn from the seed workload "
                        "(default 20,000; 8,000 in quick mode)")
    parser.add_argument("--gpu-mem-gb", type=float, default=None, help="memory per device for the memory plan "
                        "(default: --gpu's, else the device's; on CPU the shape's figure)")
    parser.add_argument("--mem-cap-gb", type=float, default=None, help="seed regime: cap the CUDA allocator at this "
                        f"many GiB (default {SEED_MEM_CAP_GB:g}, the seed's RTX PRO 6000)")
    parser.add_argument("--ckpt-step", action=argparse.BooleanOptionalAction, default=None,
                        help="after the policies, one step with draft activation checkpointing on (default: on in "
                        "the seed regime)")
    parser.add_argument("--deadline-s", dest="deadline_s_given", type=float, action="append", default=None,
                        help="start no step that could not end this many seconds from the start; report what was "
                        "measured; with several regimes once for all, or once per regime in order (each regime's "
                        "own, counted from the start)")
    parser.add_argument("--force", action="store_true", help="also run policies no memory plan fits (smallest "
                        "objective-preserving block budget, checkpointing on)")
    parser.add_argument("--repredict", metavar="FILE.jsonl", default=None, help="re-predict every step of a "
                        "recorded check with today's memory model (benchmarks/gpu_repredict.py); runs nothing")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the training config, e.g. "
                        "model.anchor_density=0.0625 sampler.max_block_tokens=65536 "
                        "trainer.activation_checkpointing=true gpu=h200")
    args = parser.parse_args(argv)
    args.regimes, args.ckpt_step_given, args.profile_trace_given = args.regime, args.ckpt_step, args.profile_trace
    resolve_mode(parser, args)
    return regime_view(args, 0)


def regime_list(text: str) -> list[str]:
    """``--regime``: one regime or several, comma-separated, each once."""
    regimes = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in regimes if r not in REGIMES]
    if not regimes or unknown or len(set(regimes)) < len(regimes):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(REGIMES)}, comma-separated, "
                                         "each once (e.g. seed,plan)")
    return regimes


# Options that may differ by regime: given once they hold for every regime, given once per regime they go in order.
PER_REGIME = ("policies", "deadline_s")


def regime_view(args, index: int) -> argparse.Namespace:
    """The arguments as regime ``index`` of the run sees them: ``regime`` one name, ``policies`` and
    ``deadline_s`` its own, ``ckpt_step`` on by default in the seed regime only, ``profile_trace`` named after the
    regime when the run has several (the other fields are the run's)."""
    view = argparse.Namespace(**vars(args))
    view.regime = args.regimes[index]
    for name in PER_REGIME:
        given = getattr(args, f"{name}_given")
        setattr(view, name, None if not given else given[index if len(given) > 1 else 0])
    seed = view.regime == "seed"
    view.policies = view.policies or ",".join(SEED_POLICIES if seed else POLICIES)
    view.ckpt_step = seed if args.ckpt_step_given is None else args.ckpt_step_given
    if args.profile_trace_given and len(args.regimes) > 1:
        trace = Path(args.profile_trace_given)
        view.profile_trace = str(trace.with_name(f"{trace.stem}_{view.regime}{trace.suffix}"))
    return view


def resolve_mode(parser, args) -> None:
    """Fill the defaults that depend on the mode and the device; refuse contradictions (in any regime's view)."""
    warmup, steps, samples = MODES[("quick" if args.quick else "full", args.device)]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.steps = steps if args.steps is None else args.steps
    args.num_samples = samples if args.num_samples is None else args.num_samples
    for name in PER_REGIME:
        given = getattr(args, f"{name}_given")
        if given and len(given) not in (1, len(args.regimes)):
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} given {len(given)} times for {len(args.regimes)} regimes ({','.join(args.regimes)}):"
                         f" give it once for all, or once per regime in order")
    problem = next(filter(None, (argument_problem(regime_view(args, i)) for i in range(len(args.regimes)))), None)
    if problem:
        parser.error(problem)


def argument_problem(args) -> str | None:
    """The first contradiction among one regime's resolved arguments, as the one-line error, or None."""
    seed = args.regime == "seed"
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    checks = (
        (bool(unknown), f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}"),
        (args.nproc is not None and args.nproc < 1, "--nproc must be >= 1"),
        (args.steps < 1 or args.warmup < 0, "--steps must be >= 1 and --warmup >= 0"),
        (seed and args.activation_checkpointing not in (None, "false"),
         "--regime seed runs without checkpointing where a step fits (its checkpointing is per step, and "
         "--ckpt-step); drop --activation-checkpointing or use --regime plan"),
        (seed and args.nproc not in (None, 1), "--regime seed runs one rank (a step that runs out of memory is "
                                               "recorded, which DDP cannot do); drop --nproc"),
        (args.mem_cap_gb is not None and "seed" not in args.regimes,
         "--mem-cap-gb caps memory in the seed regime; in the plan regime use --gpu-mem-gb or --gpu"),
    )
    return next((message for failed, message in checks if failed), None)


def compose_config(model: str, overrides: list[str]):
    """The training config (conf/train.yaml) with ``model=<model>`` and the overrides, as Hydra composes it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[f"model={model}", *overrides])


def all_overrides(args) -> list[str]:
    """The shape's model overrides, ``--gpu`` as ``gpu=<name>``, the seed regime's (no block budget), then the
    command line's (which win)."""
    gpu = [f"gpu={args.gpu}"] if args.gpu else []
    regime = ["sampler.max_block_tokens=null"] if getattr(args, "regime", "plan") == "seed" else []
    return [*SHAPES[args.shape]["overrides"], *gpu, *regime, *args.overrides]


def checkpointing_choice(args, trainer_cfg) -> tuple[str | bool, str]:
    """Draft activation checkpointing (True, False or ``auto``) and where it came from: the seed regime (off),
    ``--activation-checkpointing``, else a ``trainer.activation_checkpointing=`` override, else auto."""
    if getattr(args, "regime", "plan") == "seed":
        return False, "--regime seed"
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
    A policy that fits at no budget gets ``{"error": ...}`` (run anyway with ``--force``). The seed regime has no
    memory plan: the shape's budget (or ``--budget``), no block budget, no checkpointing."""
    shape = SHAPES[args.shape]
    if getattr(args, "regime", "plan") == "seed":
        budget = shape["budget"] if args.budget in (None, "auto") else int(args.budget)
        plan = footprint.MemoryPlan(None, False, "the seed regime: no block budget, no checkpointing")
        return budget, "--budget" if args.budget not in (None, "auto") else "the shape's sampler.max_tokens", {
            name: plan for name in args.policies.split(",")}
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


def _proc_status_kib(field_name: str) -> int:
    return int(re.search(rf"^{field_name}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


class PeakMemory:
    """Peak memory of one step. GPU: the CUDA allocator's peaks (allocated; reserved). CPU: live tensor bytes before
    the step + the CPU allocator's peak growth during it (allocated: torch.profiler's memory events, ``Total
    Allocated``, which count every tensor, the small ones malloc serves from resident heap pages included, where the
    growth of the resident set misses them); the process's peak resident set (reserved: everything it holds).
    The profiler slows the CPU step: CPU rows check memory, not speed."""

    def __init__(self, device: torch.device, static_bytes):
        self.device = device
        self.static_bytes = static_bytes
        self.fragments = None   # CUDA only

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self.static = self.static_bytes()
            Path("/proc/self/clear_refs").write_text("5")   # resets VmHWM to the current RSS
            self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.reserved = torch.cuda.max_memory_reserved(self.device)
            # the allocator's fragments: free memory in split blocks it cannot release (peak over the step)
            self.fragments = torch.cuda.memory_stats(self.device).get("inactive_split_bytes.all.peak")
        else:
            self.profiler.__exit__(*exc)
            self.peak = self.static + allocator_growth(self.profiler)
            self.reserved = 1024 * _proc_status_kib("VmHWM")
        return False


def allocator_growth(profiler) -> int:
    """The largest rise of the CPU allocator's ``Total Allocated`` over a profiled span (bytes)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        profiler.export_chrome_trace(f"{folder}/trace.json")
        events = json.loads(Path(f"{folder}/trace.json").read_text())["traceEvents"]
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not memory:
        return 0
    before = memory[0]["Total Allocated"] - memory[0].get("Bytes", 0)   # what the allocator held when the span began
    return int(max(m["Total Allocated"] for m in memory) - before)


def random_batch(indices: np.ndarray, lengths: np.ndarray, packed: bool, vocab: int, generator: torch.Generator):
    samples = [{"input_ids": torch.randint(4, vocab - 1, (int(lengths[j]),), generator=generator),
                "loss_mask": torch.ones(int(lengths[j]), dtype=torch.bool)} for j in indices]
    collate = collate_packed if packed else collate_padded
    return collate(samples, indices.tolist(), lengths[indices].tolist(), 0)


# ------------------------------------------------------------------------------------------------ the steps


def with_regime(line: dict, regime: str) -> dict:
    """``regime`` inside a keyed line (``{"step": {...}}``), else beside the policy row's fields."""
    if len(line) == 1:
        key, value = next(iter(line.items()))
        if isinstance(value, dict):
            return {key: {"regime": regime, **value}}
    return {"regime": regime, **line}


@dataclass
class Bench:
    """What every step needs: the process, the model and its optimizer, the step model and the figures."""

    args: Any
    env: Any
    device: torch.device
    model: Any
    train_model: Any
    optimizer: Any
    autocast: Any
    step_model: footprint.StepModel
    settings: footprint.Settings
    lengths: np.ndarray
    budget: int
    gpu_mem_gb: float
    peak_flops: float
    static_bytes: Callable[[], int]
    memory_cap_gb: float | None = None
    longest_step_s: float = 0.0   # the longest step so far: a step is not started unless it could end in time

    def emit(self, obj: dict) -> None:
        """Print one output line on rank 0, with the regime it belongs to (a run may have several)."""
        if self.env.is_main:
            print(json.dumps(with_regime(obj, self.args.regime)), flush=True)

    def past_deadline(self) -> bool:
        """True (on every rank alike) when a step as long as the longest so far would end after ``--deadline-s``."""
        late = (self.args.deadline_s is not None
                and time.perf_counter() - START + self.longest_step_s > self.args.deadline_s)
        if self.env.distributed:
            late = float(dist.all_reduce_sum(torch.tensor([float(late)], device=self.device)).item()) > 0
        return late


@dataclass
class StepResult:
    seconds: float
    peak: float
    reserved: float
    loss: float
    oom: str | None = None
    fragments: float | None = None   # CUDA: the allocator's inactive split bytes, peak over the step


def _range(name: str):
    """A profiler range of the step (gpu_profile: backward, optimizer, the forward's own work)."""
    return torch.autograd.profiler.record_function(gpu_profile.RANGE_PREFIX + name)


def step_body(bench: Bench, batch: dict, anchors: torch.Generator) -> float:
    """Forward, backward and update of one training step as training runs it; its loss (a host sync)."""
    params = bench.model.trainable_parameters()
    with _range("forward_other"), bench.autocast:
        result = bench.train_model(batch, anchors)
    with _range("backward"):
        result.weighted_ce_sum.backward()
    with _range("optimizer"):
        # Global loss normalisation, as training does: d(global CE sum / global weight) on every rank.
        global_weight = dist.all_reduce_sum(result.weight_sum.detach().clone().double())
        scale_grads = (bench.env.world_size / global_weight.clamp_min(1e-12)).float()
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale_grads)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        bench.optimizer.step()
        bench.optimizer.zero_grad(set_to_none=True)
    return float(result.loss.detach())


def train_step(bench: Bench, batch: dict, anchors: torch.Generator) -> StepResult:
    """One training step (``step_body``), timed with a device sync, and its peak memory. On one rank, an
    out-of-memory step is caught (``oom``: the error's first line) and its memory released."""
    oom = None
    _sync(bench.device)
    with PeakMemory(bench.device, bench.static_bytes) as memory:
        start = time.perf_counter()
        try:
            loss = step_body(bench, batch, anchors)
        except torch.cuda.OutOfMemoryError as exc:
            if bench.env.distributed:   # the other ranks wait in a collective: stop them all
                raise
            oom = str(exc).splitlines()[0]
            loss = float("nan")
        bench.optimizer.zero_grad(set_to_none=True)   # (an out-of-memory step's partial gradients)
        _sync(bench.device)   # a sync point on purpose: the step time must include the device's work
        seconds = time.perf_counter() - start
    if oom is not None and bench.device.type == "cuda":
        torch.cuda.empty_cache()
    return StepResult(seconds, float(memory.peak), float(memory.reserved), loss, oom,
                      None if memory.fragments is None else float(memory.fragments))


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's moments before the first measured step: one update at learning rate 0 on zero gradients (the
    weights stay as they are; only the optimizer's step count moves). A step that creates them peaks without them,
    8 bytes per draft parameter low: 7.9 GiB at the Qwen3-8B shape in the first H200 run's first warm-up step."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate


@dataclass
class PolicyPlan:
    """A policy built as training builds it, its plan's batches, and the footprint model on every batch."""

    name: str
    policy: Any
    batches: list
    shapes: dict
    flops: dict
    pred_peak: np.ndarray          # bytes per batch, with the checkpointing it runs with (step_ckpt)
    pred_peak_ckpt: np.ndarray     # bytes per batch, checkpointing on
    pred_peak_plain: np.ndarray    # bytes per batch, checkpointing off
    anchors: np.ndarray            # per sample (the plan's block tokens / block size, else the anchor rule)
    ckpt: bool                     # the memory plan's checkpointing (seed regime: off)
    step_ckpt: np.ndarray          # per batch, whether it runs with checkpointing
    pred_reserved: np.ndarray      # bytes per batch the CUDA allocator is predicted to reserve (peak + fragments)
    out: dict = field(default_factory=dict)

    def executed(self, ckpt: bool | None = None) -> np.ndarray:
        """Executed FLOPs per batch (+ the recomputed draft forward where it runs with checkpointing; ``ckpt``:
        on or off for every batch)."""
        recompute = self.step_ckpt if ckpt is None else np.full(len(self.batches), ckpt)
        return self.flops["executed"] + self.flops["executed_draft"] / 3.0 * recompute


def step_checkpointing(plan_ckpt: bool, planned_plain: np.ndarray, bench: Bench) -> np.ndarray:
    """Per batch, whether it runs with draft checkpointing: the memory plan's choice; in the seed regime (no
    checkpointing) only the batches the memory model says do not fit the cap without it (``planned_plain``:
    ``step_memory``'s ``planned`` bytes without checkpointing, against 90% of the cap, as every plan fits)."""
    if bench.args.regime != "seed":
        return np.full(planned_plain.shape, bool(plan_ckpt))
    cap = bench.memory_cap_gb or bench.gpu_mem_gb
    return planned_plain > footprint.USABLE_FRACTION * cap * footprint.GIB


def build_policy_plan(name: str, memory, bench: Bench) -> PolicyPlan | dict:
    """The policy's sampler config and memory plan applied to the model; its epoch plan and the footprint model
    on every batch. A dict (``skipped``) when no memory plan fits and ``--force`` is not given."""
    args, step_model = bench.args, bench.step_model
    scale = SHAPES[args.shape]["length_scale"]
    cfg = sampler_config(name, args.model, all_overrides(args), bench.budget, scale, int(np.max(bench.lengths)))
    out = {"policy": name, "max_tokens": bench.budget}
    if not isinstance(memory, footprint.MemoryPlan):
        if not args.force:
            return {**out, "skipped": memory["error"] + " (pass --force to run it anyway)"}
        blocks = benchmark_block_tokens(bench.lengths, bench.budget, step_model)
        memory = footprint.MemoryPlan(int(blocks.max()), True, "forced: the smallest block budget that keeps the "
                                                               "objective, checkpointing on")
    cfg["max_block_tokens"] = memory.max_block_tokens
    block_tokens = benchmark_block_tokens(bench.lengths, bench.budget, step_model)
    policy = policy_from_config(cfg, bench.lengths, seed=0, world_size=bench.env.world_size, rank=bench.env.rank,
                                block_tokens=block_tokens if memory.max_block_tokens is not None else None)
    bench.model.max_block_tokens = memory.max_block_tokens
    bench.model.draft.activation_checkpointing = memory.activation_checkpointing
    out.update({"max_block_tokens": memory.max_block_tokens, "activation_checkpointing":
                memory.activation_checkpointing, "truncated": int(policy.admission.truncated),
                "overlong": cfg.get("overlong")})
    batches = policy.global_plan(0).batches
    anchors = footprint.policy_anchors(policy, step_model)
    if anchors is None:   # no block budget: the anchor rule on every valid position (as batch_shapes assumes)
        anchors = benchmark_block_tokens(policy.lengths, bench.budget, step_model) // step_model.block_size
    shapes = footprint.batch_shapes(batches, policy.lengths, packed=policy.packed, model=step_model, anchors=anchors)
    memories = {ckpt: footprint.step_memory(step_model, shapes, replace(bench.settings, activation_checkpointing=ckpt))
                for ckpt in (False, True)}
    peaks = {ckpt: m["peak"] for ckpt, m in memories.items()}
    step_ckpt = step_checkpointing(memory.activation_checkpointing, memories[False]["planned"], bench)
    return PolicyPlan(name, policy, batches, shapes, footprint.step_flops(step_model, shapes),
                      np.where(step_ckpt, peaks[True], peaks[False]), peaks[True], peaks[False], anchors,
                      memory.activation_checkpointing, step_ckpt,
                      np.where(step_ckpt, memories[True]["reserved"], memories[False]["reserved"]), out)


def choose_steps(plan: PolicyPlan, world_size: int, warmup: int, steps: int,
                 sample: str = "stratified") -> tuple[list[int], list[int]]:
    """Global steps to warm up on and to time. Warm-up: the cheapest steps (fewest executed FLOPs on the slowest
    rank), the first two of different padded shapes, so that both of flex_attention's graphs (static, then
    dynamic lengths) compile there. Timed: one step per cost stratum of the epoch plan (``sample="stratified"``,
    ``gpu_epoch.stratified_steps``: ``steps`` strata), or the plan's first steps in order (``"first"``); warm-up
    steps left out."""
    total = len(plan.batches) // world_size
    if total < warmup + steps:
        raise ValueError(f"{plan.name}: the plan has {total} steps, fewer than --warmup + --steps = "
                         f"{warmup + steps}; raise --num-samples")
    cost = plan.executed().reshape(total, world_size).max(axis=1)
    shape = (plan.shapes["rows"] * 100_003 + plan.shapes["row_len"]).reshape(total, world_size)[:, 0]
    order = [int(i) for i in np.argsort(cost, kind="stable")]
    chosen: list[int] = []
    for i in order:
        if len(chosen) >= warmup:
            break
        if len(chosen) == 1 and shape[i] == shape[chosen[0]] and len(set(shape.tolist())) > 1:
            continue
        chosen.append(i)
    if sample == "stratified":
        return chosen, gpu_epoch.stratified_steps(cost, steps, exclude=chosen)
    return chosen, [i for i in range(total) if i not in chosen][:steps]


def run_steps(plan: PolicyPlan, global_steps: list[int], phase: str, bench: Bench) -> list[dict]:
    """Run ``global_steps`` of the plan on this rank, each with its checkpointing (``plan.step_ckpt``); one record
    per step (and a ``step`` line on rank 0)."""
    env = bench.env
    generator = torch.Generator().manual_seed(1)
    records = []
    for step in global_steps:
        if bench.past_deadline():
            break
        index = step * env.world_size + env.rank
        batch = step_batch(plan, index, generator, bench)
        bench.model.draft.activation_checkpointing = bool(plan.step_ckpt[index])
        graphs = flex_compile_count()
        result = train_step(bench, batch, torch.Generator().manual_seed(1000 * step + env.rank))
        bench.longest_step_s = max(bench.longest_step_s, result.seconds)
        record = step_record(plan, step, index, batch, result, phase, bench)
        record["compiled"] = flex_compile_count() > graphs
        records.append(record)
        bench.emit({"step": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()}})
    bench.model.draft.activation_checkpointing = plan.ckpt
    return records


def step_batch(plan: PolicyPlan, index: int, generator: torch.Generator, bench: Bench) -> dict:
    """Batch ``index`` of the plan with random tokens, on the device."""
    batch = random_batch(plan.batches[index], plan.policy.lengths, plan.policy.packed,
                         bench.step_model.target.vocab, generator)
    return {k: (v.to(bench.device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def step_record(plan: PolicyPlan, step: int, index: int, batch: dict, result: StepResult, phase: str,
                bench: Bench) -> dict:
    """What one step measured next to what the memory/FLOP model says of its batch."""
    indices, block_size = plan.batches[index], bench.step_model.block_size
    return {"policy": plan.name, "phase": phase, "step": int(step), "seconds": result.seconds,
            "real": int(batch["real_tokens"]), "padded": int(batch["padded_tokens"]), "docs": int(len(indices)),
            "block_tokens": float(plan.anchors[indices].sum() * block_size),
            "block_slots": int(plan.shapes["rows"][index] * plan.shapes["slots"][index] * block_size),
            "activation_checkpointing": bool(plan.step_ckpt[index]),
            "executed_tflop": float(plan.executed()[index]) / 1e12, "tflop": float(plan.flops["total"][index]) / 1e12,
            "pred_peak_gb": float(plan.pred_peak[index]) / footprint.GIB, "peak_gb": result.peak / footprint.GIB,
            "pred_reserved_gb": float(plan.pred_reserved[index]) / footprint.GIB,
            "frag_gb": None if result.fragments is None else result.fragments / footprint.GIB,
            "reserved_gb": result.reserved / footprint.GIB, "loss": result.loss, "compiled": False,
            "oom": result.oom, "index": int(index)}


def step_grid(records: list[dict]) -> list[list[dict]]:
    """Every rank's records of the same steps, [step][rank] (as many steps as the rank that ran fewest)."""
    per_rank = dist.all_gather_objects(records)
    return [[rank[i] for rank in per_rank] for i in range(min(len(r) for r in per_rank))]


def kept_steps(grid: list[list[dict]], out: dict) -> list[list[dict]]:
    """The steps the figures count: none compiled a flex graph or ran out of memory (all that did not run out of
    memory when every step compiled). Counts the others in ``out`` (``compiled_steps``, ``oom_steps``, ``oom``)."""
    compiled = np.array([any(r["compiled"] for r in step) for step in grid])
    oom = np.array([any(r["oom"] for r in step) for step in grid])
    out["compiled_steps"], out["oom_steps"] = int(compiled.sum()), int(oom.sum())
    if oom.any():
        out["oom"] = [{"step": step[0]["step"], "pred_peak_gb": round(max(r["pred_peak_gb"] for r in step), 2),
                       "error": next(r["oom"] for r in step if r["oom"])[:200]} for step, o in zip(grid, oom) if o]
    clean = ~compiled & ~oom
    if not clean.any():
        clean = ~oom
    return [step for step, keep in zip(grid, clean) if keep]


def step_figures(plan: PolicyPlan, kept: list[list[dict]], bench: Bench) -> dict:
    """Speed, utilisation, memory and batch figures of the kept steps (the slowest rank sets a step's time)."""
    world = bench.env.world_size
    times = np.array([max(r["seconds"] for r in step) for step in kept])
    real = np.array([sum(r["real"] for r in step) for step in kept], dtype=np.float64)
    padded = sum(r["padded"] for step in kept for r in step)
    every = [r for step in kept for r in step]
    tflop, executed = sum(r["tflop"] for r in every), sum(r["executed_tflop"] for r in every)
    elapsed = float(times.sum())
    measured = max(r["peak_gb"] for r in every)
    indices = [r["index"] for r in every]
    denominator = elapsed * world * bench.peak_flops
    loss = kept[-1][0]["loss"]
    return {
        "ktok_s": ktok_per_s(real.sum(), elapsed), "ktok_s_median_step": float(np.median(real / times)) / 1e3,
        "mfu": tflop * 1e12 / denominator, "hfu": executed * 1e12 / denominator,
        "tflop_per_step": tflop / len(every), "executed_tflop_per_step": executed / len(every),
        "executed_tflops": executed / elapsed / world, "peak_mem_gb": measured,
        "peak_reserved_gb": max(r["reserved_gb"] for r in every),
        "pred_peak_mem_gb": float(plan.pred_peak[indices].max()) / footprint.GIB,
        "pred_peak_mem_gb_ckpt": float(plan.pred_peak_ckpt[indices].max()) / footprint.GIB,
        "mem_ratio": float(plan.pred_peak[indices].max()) / footprint.GIB / measured,
        "step_time_s": elapsed / len(kept), "pad_eff": padding_efficiency(real.sum(), padded),
        "block_tokens_per_step": float(np.mean([r["block_tokens"] for r in every])),
        "block_slots_per_step": float(np.mean([r["block_slots"] for r in every])),
        "real_tokens_per_step": float(real.sum()) / len(every), "docs_per_step": float(np.mean([r["docs"] for r in every])),
        "ckpt_steps": int(sum(r["activation_checkpointing"] for r in every)),
        "loss": loss, "finite": bool(np.isfinite(loss)), "steps": len(kept)}


def summarize(plan: PolicyPlan, records: list[dict], bench: Bench) -> dict:
    """The policy's row from every rank's timed steps."""
    grid = step_grid(records)
    out = {**plan.out, "sample": bench.args.sample, "steps_run": len(grid), "flex_graphs": flex_compile_count()}
    if len(grid) < bench.args.steps:
        out["stopped"] = f"--deadline-s {bench.args.deadline_s:g} passed after {len(grid)} of {bench.args.steps} steps"
    if not grid:
        return {**out, "error": "no timed step ran (deadline)", "finite": False}
    kept = kept_steps(grid, out)
    if not kept:
        return {**out, "error": "every timed step ran out of memory", "finite": False, "steps": 0}
    return {**out, **step_figures(plan, kept, bench)}


def seed_fit_figures(plan: PolicyPlan, bench: Bench) -> dict:
    """Seed regime, from the whole epoch plan: the share of steps predicted to fit 90% of the cap without
    checkpointing (the others run with it)."""
    world = bench.env.world_size
    total = len(plan.batches) // world
    fits = ~plan.step_ckpt.reshape(total, world).any(axis=1)
    return {"epoch_steps": total, "pred_fit_frac": float(fits.mean()),
            "mem_cap_gb": bench.memory_cap_gb or bench.gpu_mem_gb}


def planner_prediction(policy, bench: Bench, recompute: bool = False) -> dict:
    """The planner's prediction for this policy's plan: ``cost_from_config`` (conf_plan/cost/seed.yaml, the
    rtx_pro_6000 preset's peak) and ``predict_throughput`` (one epoch; ``recompute``: draft checkpointing on):
    Ktok/s over time and the median step's. Its Ktok/s are RTX PRO 6000 figures; its ratios compare."""
    from omegaconf import OmegaConf

    from dflash_lab.plan import cost_from_config, predict_throughput

    cost_cfg = OmegaConf.to_container(OmegaConf.load(SEED_COST), resolve=True)
    gpu_cfg = OmegaConf.to_container(OmegaConf.load(SEED_GPU), resolve=True)
    cost = cost_from_config(cost_cfg, None, bench.budget, 0, gpu_cfg)
    predicted = predict_throughput(policy, cost, 1.0, step_model=bench.step_model, recompute=recompute)
    return {"planner_ktok_s": predicted["ktok_s"], "planner_ktok_s_median_step": predicted["ktok_s_median"]}


def epoch_policy(plan: PolicyPlan, grid: list[list[dict]], row: dict, bench: Bench) -> dict:
    """One policy's part of the epoch line: the step-time fit on its clean timed steps (the slowest rank's time
    and executed FLOPs per step), the epoch's Ktok/s priced by the fit, the planner's beside it."""
    from dflash_lab.plan import predict_throughput

    steps = [{"phase": step[0]["phase"], "seconds": max(r["seconds"] for r in step),   # the slowest rank's
              "executed_tflop": max(r["executed_tflop"] for r in step),
              "compiled": any(r["compiled"] for r in step), "oom": next((r["oom"] for r in step if r["oom"]), None)}
             for step in grid]
    entry = {"sampled_steps": len(grid), "fit_steps": len(gpu_epoch.clean_step_records(steps)),
             "ktok_s_sample": row.get("ktok_s"), **planner_prediction(plan.policy, bench, recompute=plan.ckpt)}
    try:
        fit = gpu_epoch.fit_step_records(steps)
        cost = gpu_epoch.fitted_cost(fit)
    except ValueError as exc:
        return {**entry, "error": str(exc)}
    predicted = predict_throughput(plan.policy, cost, 1.0, step_model=bench.step_model, recompute=plan.ckpt)
    return {**entry, "fit": fit.as_dict(), "ktok_s": predicted["ktok_s"],
            "ktok_s_median_step": predicted["ktok_s_median"], "epoch_hours": predicted["epoch_hours"]}


RATIO_FIGURES = {"epoch": "ktok_s", "planner": "planner_ktok_s", "median_step": "ktok_s_median_step",
                 "planner_median_step": "planner_ktok_s_median_step", "sample": "ktok_s_sample"}


def epoch_line(plans: dict[str, PolicyPlan], records: dict[str, list[dict]], rows: dict[str, dict],
               bench: Bench) -> dict:
    """The ``epoch`` line (module docstring): per policy its fit and epoch figures, and full_random / bucketed
    and packed / bucketed for each figure; ``ratio`` / ``planner_ratio``: full_random / bucketed over the epoch."""
    policies = {name: epoch_policy(plan, step_grid(records[name]), rows[name], bench) for name, plan in plans.items()}
    bucketed = policies.get("bucketed", {})
    ratios = {f"{name}_over_bucketed": {label: gpu_epoch.ratio(policies[name].get(key), bucketed.get(key))
                                        for label, key in RATIO_FIGURES.items()}
              for name in ("full_random", "packed") if name in policies}
    headline = ratios.get("full_random_over_bucketed", {})
    return {"epoch": {"regime": bench.args.regime, "sample": bench.args.sample,
                      "ratio": headline.get("epoch"), "planner_ratio": headline.get("planner"),
                      "ratio_median_step": headline.get("median_step"),
                      "planner_ratio_median_step": headline.get("planner_median_step"), "ratios": ratios,
                      "policies": policies, "recompute": "the epoch priced as the memory plan runs it (seed "
                      "regime: no checkpointing, as the planner assumes)",
                      "planner_cost": "conf_plan/cost/seed.yaml, gpu=rtx_pro_6000 (RTX PRO 6000 Ktok/s; ratios "
                                      "compare)"}}


def checkpointing_step(plans: dict[str, PolicyPlan], records: dict[str, list[dict]], bench: Bench) -> dict:
    """One step with draft activation checkpointing on: the first timed batch that ran out of memory (bucketed's
    first), else, of the timed batches run without checkpointing, the one with the largest predicted peak."""
    candidates = [(name, r) for name in sorted(records, key=lambda n: n != "bucketed") for r in records[name]
                  if r["phase"] == "timed" and not r["activation_checkpointing"]]
    if not candidates:
        return {"ckpt_step": {"error": "no timed step ran without checkpointing"}}
    failed = [c for c in candidates if c[1]["oom"]]
    name, record = failed[0] if failed else max(candidates, key=lambda c: plans[c[0]].pred_peak_plain[c[1]["index"]])
    plan = plans[name]
    every = np.ones(len(plan.batches), dtype=bool)
    (result,) = run_steps(replace(plan, step_ckpt=every, pred_peak=plan.pred_peak_ckpt), [record["step"]], "ckpt",
                          bench) or [None]
    if result is None:
        return {"ckpt_step": {"error": "deadline passed before the checkpointing step"}}
    index = record["index"]
    row = {"policy": name, "step": record["step"], "why": "ran out of memory without" if failed else
           "the largest predicted peak of the timed steps without checkpointing", "seconds": result["seconds"],
           "seconds_without": None if record["oom"] else record["seconds"],
           "executed_tflop": result["executed_tflop"], "hfu": result["executed_tflop"] * 1e12 /
           (result["seconds"] * bench.peak_flops), "peak_mem_gb": result["peak_gb"],
           "pred_peak_mem_gb_ckpt": float(plan.pred_peak_ckpt[index]) / footprint.GIB,
           "pred_peak_mem_gb_plain": float(plan.pred_peak_plain[index]) / footprint.GIB,
           "peak_mem_gb_without": None if record["oom"] else record["peak_gb"],
           "compiled": result["compiled"], "oom": result["oom"]}
    if not result["oom"]:
        row["mem_ratio"] = row["pred_peak_mem_gb_ckpt"] / result["peak_gb"]
    return {"ckpt_step": row}


def profile_line(plans: dict[str, PolicyPlan], records: dict[str, list[dict]], bench: Bench) -> dict:
    """The ``profile`` line: one step under torch.profiler (``gpu_profile.profile_step``), bucketed's (else the
    first policy's) clean timed step of median executed FLOPs (on a CPU the cheapest: there the path is checked,
    and a profiled CPU step is slow), run again with its checkpointing; time by kernel class, by range and the top
    kernels."""
    name = "bucketed" if "bucketed" in plans else next(iter(plans))
    kept = sorted(kept_steps(step_grid(records[name]), {}), key=lambda step: max(r["executed_tflop"] for r in step))
    if not kept:
        return {"profile": {"policy": name, "error": "no clean timed step to profile"}}
    if bench.past_deadline():
        return {"profile": {"policy": name, "error": "deadline passed before the profiled step"}}
    record = kept[(len(kept) - 1) // 2 if bench.device.type == "cuda" else 0][bench.env.rank]
    plan, index = plans[name], record["index"]
    batch = step_batch(plan, index, torch.Generator().manual_seed(1), bench)
    anchors = torch.Generator().manual_seed(1000 * record["step"] + bench.env.rank)
    bench.model.draft.activation_checkpointing = bool(plan.step_ckpt[index])
    try:
        summary = gpu_profile.profile_step(lambda: step_body(bench, batch, anchors), bench.model, bench.device,
                                           bench.args.profile_trace)
    finally:
        bench.model.draft.activation_checkpointing = plan.ckpt
    return {"profile": {"policy": name, "step": record["step"], "device": bench.device.type,
                        "executed_tflop": record["executed_tflop"], "seconds_unprofiled": record["seconds"],
                        "activation_checkpointing": bool(plan.step_ckpt[index]), **summary}}


# ------------------------------------------------------------------------------------------------ the setup


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


def start_process(args):
    """Re-execute for the CPU memory measurement, set the CUDA allocator (expandable segments unless the user set
    it), start the ranks, join the process group; (env, device, the allocator setting and its source)."""
    if args.device == "cpu" and os.environ.get(MMAP_ENV) is None:
        # Re-execute with a fixed mmap threshold before any allocation (see the module docstring).
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, MMAP_ENV: "65536"})
    allocator = configure_cuda_allocator(args.device)   # before CUDA's first use (the ranks inherit it)
    every_gpu = args.device == "cuda" and args.regimes == ["plan"]   # the seed regime runs one rank
    default_nproc = max(1, torch.cuda.device_count()) if every_gpu else 1
    nproc = args.nproc or default_nproc
    if "RANK" not in os.environ and nproc > 1:
        sys.exit(launch_ranks(nproc))
    env = dist.init_distributed(backend="gloo" if args.device == "cpu" else None)
    device = torch.device(f"cuda:{env.local_rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif env.distributed:   # the CPUs shared by the ranks (OMP_NUM_THREADS, when set, caps each rank)
        cap = int(os.environ.get("OMP_NUM_THREADS") or 1 << 20)
        torch.set_num_threads(max(1, min(cap, len(os.sched_getaffinity(0)) // env.world_size)))
    return env, device, allocator


def memory_figure(args, preset: dict, device: torch.device) -> tuple[float, str]:
    """The memory the plan fits (GiB) and where it came from."""
    if args.regime == "seed":
        if device.type == "cuda":
            return args.mem_cap_gb or SEED_MEM_CAP_GB, "--mem-cap-gb" if args.mem_cap_gb else "the seed's 96 GiB"
        return SHAPES[args.shape]["seed_cpu_mem_gb"], f"--shape {args.shape} on CPU: the 96 GiB cap's stand-in (no cap)"
    if args.gpu_mem_gb:
        return args.gpu_mem_gb, "--gpu-mem-gb"
    if preset.get("memory_gb"):
        return float(preset["memory_gb"]), f"gpu={preset.get('name')}"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / footprint.GIB, "device"
    return SHAPES[args.shape]["cpu_mem_gb"], f"--shape {args.shape} on CPU"


def cap_memory(cap_gb: float | None, device: torch.device) -> float:
    """Cap the CUDA caching allocator at ``cap_gb`` GiB (``set_per_process_memory_fraction``; None: the whole
    device, as a regime after the seed's needs); the fraction set. Cached blocks are released first, so that a
    lower cap holds from the next allocation."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = 1.0 if cap_gb is None else min(1.0, cap_gb * footprint.GIB / total)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def peak_figure(preset: dict, device: torch.device) -> tuple[float, str, float]:
    """Peak dense bf16 TFLOP/s per device, its source, and the measured matmul peak."""
    measured = matmul_tflops(device)
    sheet = datasheet_tflops(device)
    if preset.get("bf16_dense_tflops"):
        return float(preset["bf16_dense_tflops"]), f"gpu={preset.get('name')}", measured
    if sheet:
        return sheet, "datasheet", measured
    return measured, "matmul", measured


@dataclass
class Trainable:
    """What every regime of a run shares: the model (one set of compiled graphs), its optimizer with its moments,
    the step model, and the device's peak."""

    model: Any
    train_model: Any
    optimizer: Any
    autocast: Any
    step_model: footprint.StepModel
    model_cfg: dict
    static_bytes: Callable[[], int]
    peak: tuple[float, str, float]   # peak_figure's


def build_trainable(args, env, device) -> Trainable:
    """Compose the config, build the model (random weights), wrap it for the ranks, create AdamW's moments."""
    from omegaconf import OmegaConf

    on_gpu = device.type == "cuda"
    cfg = compose_config(args.model, all_overrides(args))
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model = build_benchmark_model(model_cfg, args.shape, device, on_gpu)
    train_model = model
    if env.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        DDP._set_params_and_buffers_to_ignore_for_model(model, frozen)
        train_model = DDP(model, device_ids=[env.local_rank] if on_gpu else None)
    model.train()
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=6e-4)   # as training builds it
    create_optimizer_state(optimizer)   # before any step is measured
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)
    # DDP's gradient buckets (one copy of the trainable parameters) are allocated outside the step, like weights
    buckets = sum(p.numel() * p.element_size() for p in model.trainable_parameters()) if env.distributed else 0

    def static_bytes() -> int:
        tensors = [*model.parameters(), *model.buffers()]
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if torch.is_tensor(v))
        return buckets + sum(t.numel() * t.element_size() for t in tensors)

    return Trainable(model, train_model, optimizer, autocast, footprint.StepModel.from_model(model), model_cfg,
                     static_bytes, peak_figure(gpu_preset(cfg), device))


def build_bench(args, env, device, trainable: Trainable):
    """One regime on the shared model: its config, memory figure and cap, lengths and budgets; (Bench, the setup
    line's fields, the plans)."""
    from omegaconf import OmegaConf

    on_gpu = device.type == "cuda"
    cfg = compose_config(args.model, all_overrides(args))
    ckpt, ckpt_source = checkpointing_choice(args, OmegaConf.to_container(cfg.trainer, resolve=True))
    model, step_model, model_cfg = trainable.model, trainable.step_model, trainable.model_cfg
    gpu_mem_gb, mem_source = memory_figure(args, gpu_preset(cfg), device)
    cap = gpu_mem_gb if args.regime == "seed" and on_gpu else None
    if on_gpu:
        cap_memory(cap, device)
    lengths = reference_lengths("seed", args.num_samples, seed=0, scale=SHAPES[args.shape]["length_scale"])
    # the draft's attention path as training picks it: flex_attention on GPU, per-document SDPA on CPU
    settings = footprint.Settings(precision="bf16" if on_gpu else "fp32", world_size=env.world_size,
                                  allocator="cuda" if on_gpu else "cpu",
                                  attention=footprint.attention_path(device.type, model.attention_backend))
    budget, budget_source, plans = resolve_plans(args, lengths, step_model, settings, ckpt, gpu_mem_gb,
                                                 env.world_size)
    peak_tflops, peak_source, measured_peak = trainable.peak
    bench = Bench(args, env, device, model, trainable.train_model, trainable.optimizer, trainable.autocast,
                  step_model, settings, lengths, budget, gpu_mem_gb, peak_tflops * 1e12, trainable.static_bytes, cap)
    setup = {"regime": args.regime, "regimes": args.regimes, "mode": "quick" if args.quick else "full",
             "shape": args.shape, "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
             "torch": torch.__version__, "world_size": env.world_size, "threads": torch.get_num_threads(),
             "precision": settings.precision, "attention": settings.attention, "head_ce": step_model.head_ce,
             "budget": budget, "budget_source": budget_source, "gpu_mem_gb": gpu_mem_gb, "gpu_mem_source": mem_source,
             "mem_cap_gb": cap, "peak_tflops": peak_tflops, "peak_source": peak_source,
             "matmul_tflops": measured_peak, "target_params_b": step_model.target.params / 1e9,
             "draft_params_m": step_model.draft.params / 1e6, "activation_checkpointing": ckpt,
             "fragmentation_fraction": footprint.FRAGMENTATION_FRACTION if on_gpu else None,
             "activation_checkpointing_source": ckpt_source, "num_samples": args.num_samples,
             "warmup": args.warmup, "steps": args.steps, "deadline_s": args.deadline_s,
             "model": {k: model_cfg.get(k) for k in ("block_size", "draft_layers", "anchors_per_doc",
                                                     "anchor_density", "fixed_anchors")},
             "overrides": all_overrides(args)}
    return bench, setup, plans


def setup_notes(bench: Bench, plans: dict) -> list[str]:
    static_gb = float(footprint.step_memory(bench.step_model, footprint.batch_shapes(
        [np.arange(1)], np.array([2]), packed=True, model=bench.step_model), bench.settings)["static"][0]) / footprint.GIB
    if static_gb > footprint.USABLE_FRACTION * bench.gpu_mem_gb:
        return [(f"weights and optimizer alone ({static_gb:.1f} GiB) exceed {footprint.USABLE_FRACTION:.0%} "
                 f"of {bench.gpu_mem_gb:g} GiB: the check needs fewer target layers "
                 f"(model.target_config.num_hidden_layers)")]
    if not any(isinstance(p, footprint.MemoryPlan) for p in plans.values()):
        return ["no token budget fits: the check needs fewer target layers or a smaller shape"]
    return []


def run_policy(name: str, memory, bench: Bench) -> tuple[dict, PolicyPlan | None, list[dict]]:
    """Warm up, time, and summarise one policy: (its row, its plan, this rank's timed records)."""
    plan = build_policy_plan(name, memory, bench)
    if isinstance(plan, dict):
        return plan, None, []
    warm, timed = choose_steps(plan, bench.env.world_size, bench.args.warmup, bench.args.steps, bench.args.sample)
    run_steps(plan, warm, "warmup", bench)
    records = run_steps(plan, timed, "timed", bench)
    row = summarize(plan, records, bench)
    if bench.args.regime == "seed":
        row.update(seed_fit_figures(plan, bench))
    return row, plan, records


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.repredict:
        import gpu_repredict

        raise SystemExit(gpu_repredict.main(args.repredict, args.model))
    env, device, allocator = start_process(args)
    trainable = build_trainable(args, env, device)
    for index in range(len(args.regimes)):   # one after the other on the same model and compiled graphs
        run_regime(regime_view(args, index), env, device, trainable, allocator)
    dist.cleanup()


def run_regime(args, env, device, trainable: Trainable, allocator: dict) -> None:
    """One regime's lines: setup, the policies (each's steps), epoch, checkpointing step, profile."""
    bench, setup, plans = build_bench(args, env, device, trainable)
    bench.emit({"setup": {**setup, **allocator, "notes": setup_notes(bench, plans), "memory_plan": {
        name: ({"max_block_tokens": p.max_block_tokens, "activation_checkpointing": p.activation_checkpointing,
                "reason": p.reason} if isinstance(p, footprint.MemoryPlan) else p) for name, p in plans.items()}}})
    rows, policy_plans, records = {}, {}, {}
    for name in args.policies.split(","):
        try:
            row, plan, timed = run_policy(name, plans[name], bench)
        except torch.cuda.OutOfMemoryError as exc:   # under DDP (one rank catches its own): the policy is lost
            row, plan, timed = {"policy": name, "error": f"out of memory: {str(exc).splitlines()[0]}"}, None, []
            bench.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        rows[name] = row
        if plan is not None:
            policy_plans[name], records[name] = plan, timed
        bench.emit(row)
    if policy_plans:
        bench.emit(epoch_line(policy_plans, records, rows, bench))
    if args.ckpt_step and policy_plans:
        bench.emit(checkpointing_step(policy_plans, records, bench))
    if args.profile and policy_plans:
        bench.emit(profile_line(policy_plans, records, bench))


if __name__ == "__main__":
    main()
