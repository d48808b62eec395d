"""What the GPU check's gpu_check stages will run, priced by the first H200 run: the basis of their time limits.

    python benchmarks/gpu_stage_budget.py [--quick] [--regime seed|plan|seed,plan] [--steps N] [--policies P ...]

Runs nothing on a GPU and builds no model: the stage's own plans (benchmarks/gpu_check.py's ``resolve_plans`` and
``build_policy_plan`` at the Qwen3-8B shape, its memory figure: the seed regime's 96 GiB cap, the plan regime's
H200), the steps it picks (``choose_steps``: warm-up and one step per cost stratum), the checkpointing step and
the profiled step, each step's executed FLOPs (``footprint.step_flops``, the recomputed draft forward where it
runs with checkpointing), priced by the first H200 run's step-time fit (``H200_FIT``: seconds = intercept +
executed FLOPs / rate, docs/gpu.md "The epoch line"; the run's timed steps ran within 3% of executed FLOPs at
~430-470 TFLOP/s). Measured by that run and added as they were: the stage's time outside the steps (start,
random 8B weights, plans, lines: ``H200_OUTSIDE_S``) and its warm-up (two steps per policy, the first one
compiling: ``H200_WARMUP_S``).

``--regime seed,plan`` prices gpu_check.py's two regimes in one process (scripts/gpu_check.sh's ``gpu_check``
stage): the first regime as above; the plan regime after it pays no start and no first compile (one model, its
graphs built), so its warm-up steps are priced by the fit like the others, plus ``LATER_POLICY_EXTRA_S`` per
policy (the first run's later policies' first warm-up step over their second: packed 5.39 s against 1.95 s), and
its outside time is its plans' CPU seconds as measured here. Every regime's profiled step (gpu_check profiles in
each) is priced; the checkpointing step in the seed regime only (its default).

Output: one JSON line: per regime and policy the timed steps (their executed TFLOP, how many run with
checkpointing, their predicted seconds), each regime's priced parts; the stage's predicted seconds and the limit at
1.2x; the CPU seconds this machine took to build the plans.

Cost: the plans of 20,000 (8,000 quick) documents for each policy: about a minute on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
from dflash_lab.data.lengths import reference_lengths  # noqa: E402
from dflash_lab.model import footprint  # noqa: E402

# The first H200 run (benchmarks/data/h200-2026-12-04/seed.jsonl, gpu_epoch.fit_step_records per policy): seconds =
# intercept + executed FLOPs / rate (full_random 0.18 s + / 469 TFLOP/s, bucketed 0.12 s + / 459; packed, with two
# clean steps, takes bucketed's)
H200_FIT = {"full_random": (0.18, 469e12), "bucketed": (0.12, 459e12), "packed": (0.12, 459e12)}
H200_OUTSIDE_S = 42.0   # the seed stage's time outside its steps (start, imports, random weights, plans, lines)
H200_WARMUP_S = 57.0    # its warm-up: 2 steps x 3 policies, the first compiling for 38 s (cold kernel cache)
PROFILE_FACTOR = 3.0    # the profiled step: the step again under torch.profiler, its events exported (~3 steps)
LATER_POLICY_EXTRA_S = 3.5   # a later policy's first warm-up step over its second (packed: 5.39 - 1.95 s)


def stage_steps(regime: str, quick: bool, steps: int | None, policies: str | None,
                num_samples: int | None = None) -> tuple[list[dict], float]:
    """Per policy the steps the stage runs and their executed FLOPs; the CPU seconds its plans took here.
    Documents: ``num_samples``, else the mode's in the seed regime and 8,000 in the plan regime (what the stages
    give each regime alone)."""
    argv = ["--device", "cpu", "--shape", "qwen3-8b", "--regime", regime, *(["--quick"] if quick else []),
            *(["--steps", str(steps)] if steps else []), *(["--policies", policies] if policies else [])]
    args = gpu_check.parse_args(argv)
    warm, timed, samples = gpu_check.MODES[("quick" if quick else "full", "cuda")]
    args.warmup, args.steps = warm, steps or timed
    args.num_samples = num_samples or (samples if regime == "seed" else 8000)
    from omegaconf import OmegaConf

    started = time.process_time()   # this process's CPU time: a busy machine does not inflate it
    cfg = gpu_check.compose_config(args.model, gpu_check.all_overrides(args))
    step_model = footprint.StepModel.from_model_config(OmegaConf.to_container(cfg.model, resolve=True), "cuda")
    settings = footprint.Settings(precision="bf16", attention="flex", allocator="cuda")
    mem_gb = gpu_check.SEED_MEM_CAP_GB if regime == "seed" else 139.8   # the seed cap; the H200's own memory
    lengths = reference_lengths("seed", args.num_samples, seed=0, scale=1)
    ckpt = False if regime == "seed" else "auto"
    budget, _, plans = gpu_check.resolve_plans(args, lengths, step_model, settings, ckpt, mem_gb, 1)
    model = SimpleNamespace(max_block_tokens=None, draft=SimpleNamespace(activation_checkpointing=False))
    bench = SimpleNamespace(args=args, step_model=step_model, settings=settings, budget=budget, lengths=lengths,
                            env=SimpleNamespace(world_size=1, rank=0), model=model, gpu_mem_gb=mem_gb,
                            memory_cap_gb=mem_gb if regime == "seed" else None)
    rows = []
    for name in args.policies.split(","):
        plan = gpu_check.build_policy_plan(name, plans[name], bench)
        warm_steps, timed_steps = gpu_check.choose_steps(plan, 1, args.warmup, args.steps, args.sample)
        executed = plan.executed()
        rows.append({"policy": name, "warmup": warm_steps, "timed": timed_steps,
                     "warmup_tflop": [float(executed[i]) / 1e12 for i in warm_steps],
                     "timed_tflop": [float(executed[i]) / 1e12 for i in timed_steps],
                     "ckpt_steps": int(plan.step_ckpt[timed_steps].sum()),
                     "_plan": plan})
    return rows, time.process_time() - started


def _seconds(policy: str, flop: float) -> float:
    intercept, rate = H200_FIT.get(policy, H200_FIT["bucketed"])
    return intercept + flop / rate


def price(rows: list[dict], regime: str, first: bool = True, plans_cpu_s: float = 0.0) -> dict:
    """Predicted seconds of one regime's part of a stage: its timed steps by the H200 fit, the checkpointing step
    (the seed regime's, as gpu_check runs it by default) and the profiled step; the first regime of a process adds the
    measured start and compiling warm-up, a later one its warm-up steps by the fit and its plans' CPU time."""
    out, total = [], 0.0
    for row in rows:
        seconds = [_seconds(row["policy"], t * 1e12) for t in row["timed_tflop"]]
        out.append({"policy": row["policy"], "steps": len(seconds), "ckpt_steps": row["ckpt_steps"],
                    "timed_tflop": [round(t, 1) for t in row["timed_tflop"]], "seconds": round(sum(seconds), 1)})
        total += sum(seconds)
    extra = 0.0
    profiled = next((r for r in rows if r["policy"] == "bucketed"), rows[0])
    plan = profiled["_plan"]
    if regime == "seed":   # the largest timed step again, checkpointed
        largest = max(profiled["timed"], key=lambda i: plan.pred_peak_plain[i])
        extra += _seconds("bucketed", float(plan.executed(True)[largest]))
    median = sorted(profiled["timed"], key=lambda i: plan.executed()[i])[len(profiled["timed"]) // 2]
    extra += PROFILE_FACTOR * _seconds(profiled["policy"], float(plan.executed()[median]))
    if first:
        outside, warmup = H200_OUTSIDE_S, H200_WARMUP_S
    else:
        outside = plans_cpu_s
        warmup = sum(sum(_seconds(r["policy"], t * 1e12) for t in r["warmup_tflop"])
                     + (LATER_POLICY_EXTRA_S if r["warmup_tflop"] else 0.0) for r in rows)
    steps_s = total + extra
    stage = outside + warmup + steps_s
    return {"regime": regime, "policies": out, "timed_and_extra_steps_s": round(steps_s, 1),
            "outside_s": round(outside, 1), "warmup_s": round(warmup, 1), "stage_s": round(stage, 1)}


def price_stage(regimes: list[str], quick: bool, steps: int | None, policies: list[str | None]) -> dict:
    """The stage's regimes in one process, each priced after the one before; the stage's seconds and limit."""
    parts, cpu_total = [], 0.0
    samples = gpu_check.MODES[("quick" if quick else "full", "cuda")][2] if len(regimes) > 1 else None
    for index, regime in enumerate(regimes):   # in one process every regime plans the run's documents
        rows, cpu_s = stage_steps(regime, quick, steps, policies[index if len(policies) > 1 else 0], samples)
        parts.append(price(rows, regime, first=index == 0, plans_cpu_s=cpu_s))
        cpu_total += cpu_s
    stage = sum(part["stage_s"] for part in parts)
    return {"regimes": parts, "stage_s": round(stage, 1), "limit_s_at_1_2x": round(1.2 * stage),
            "plans_cpu_s_here": round(cpu_total, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--regime", default="seed", type=gpu_check.regime_list, help="seed, plan or seed,plan")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (cost strata) per policy")
    parser.add_argument("--policies", action="append", default=None, help="once for every regime, or once per "
                        "regime in order")
    args = parser.parse_args(argv)
    result = price_stage(args.regime, args.quick, args.steps, args.policies or [None])
    print(json.dumps({"regime": ",".join(args.regime), "mode": "quick" if args.quick else "full", **result}))


if __name__ == "__main__":
    main()
