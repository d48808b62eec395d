"""Batching-policy benchmark: plan-build time, padding and memory, against peers in the same run.

    python benchmarks/bench_sampling.py                       # seed workload, 800K samples, budget 32,768
    python benchmarks/bench_sampling.py --workload heavy_tailed --out docs/bench_heavy_tailed.md

Peers, measured in the same process on the same lengths:
- transformers' ``LengthGroupedSampler`` (megabatch sort, fixed batch size; time = producing one epoch's order);
- lhotse's ``DynamicBucketingSampler`` (6 buckets, ``max_duration`` = budget; timed on ``--lhotse-n`` samples
  because it iterates Python cut objects; its budget counts real tokens, so its batches may exceed the padded budget);
- random baselines: a fixed number of samples per batch (plain DistributedSampler, as SpecForge does) and
  random order under our token budget (that is ``full_random``).
Ours also include the forgetting-ablation orders: ``bucketed`` with ``run_length=8``, the ``bucket_sequential``
positive control, and ``full_random`` at equal real tokens per step (``real_tokens_per_step`` = the preset-boundary
``bucketed`` plan's mean real tokens per step, so padded tokens per step exceed the budget). Preset boundaries are
the seed's (``cpu``: the seed's / 8).

Timings are the median of ``--repeats`` runs of one epoch's plan (epochs 1..repeats, so nothing is cached).
Padding efficiency = sum(real) / sum(rows x longest) (``dflash_lab.metrics.throughput``). Memory: peak RSS of a
fresh process building one epoch's plan for ``--memory-n`` samples.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dflash_lab.data.lengths import reference_lengths
from dflash_lab.metrics.throughput import padding_efficiency
from dflash_lab.sampling import build_policy, fit_boundaries
from dflash_lab.sampling.stats import plan_padding, plan_stats

SEED_BOUNDS = [0, 770, 1216, 1728, 2432, 3296, 8192]
CPU_BOUNDS = [0, 96, 152, 216, 304, 412, 1024]  # the seed's / 8, for the CPU-scale workload


def timed(fn, repeats):
    times = []
    result = None
    for r in range(repeats):
        start = time.perf_counter()
        result = fn(r + 1)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def fixed_size_pad_eff(order: np.ndarray, lengths: np.ndarray, batch_size: int) -> float:
    n = order.size - order.size % batch_size
    rows = lengths[order[:n]].reshape(-1, batch_size)
    return padding_efficiency(rows.sum(), (rows.max(axis=1) * batch_size).sum())


def bench_ours(lengths, budget, repeats, preset):
    longest = int(lengths.max())
    preset_bounds = CPU_BOUNDS if preset == "cpu" else SEED_BOUNDS
    bounds = preset_bounds[:-1] + [max(preset_bounds[-1], longest)]
    configs = {
        "full_random": {},
        "sorted_static": {},
        f"bucketed ({preset} boundaries)": {"boundaries": bounds},
        "bucketed (6 quantile)": {"boundaries": fit_boundaries(lengths, 6, "quantile")},
        "bucketed (6 optimal)": {"boundaries": fit_boundaries(lengths, 6, "optimal")},
        f"bucketed_megabatch ({preset} boundaries)": {"boundaries": bounds},
        "packed": {},
        f"bucketed ({preset} boundaries, run_length=8)": {"boundaries": bounds, "run_length": 8},
        f"bucket_sequential ({preset} boundaries)": {"boundaries": bounds},
        "full_random (equal real tokens)": None,  # filled from the preset-boundary bucketed plan below
    }
    rows = []
    for label, params in configs.items():
        name = label.split(" ")[0]
        if params is None:
            bucketed = next(r for r in rows if r["batching"] == f"dflash_lab bucketed ({preset} boundaries)")
            params = {"real_tokens_per_step": int(round(bucketed["real_per_step"]))}
            label = f"{label[:-1]}: {params['real_tokens_per_step']:,})"
        start = time.perf_counter()
        policy = build_policy(name, lengths, max_tokens=budget, seed=0, **params)
        setup = time.perf_counter() - start
        seconds, _ = timed(policy.plan, repeats)
        stats = plan_stats(policy, epoch=1)
        rows.append(
            {
                "batching": f"dflash_lab {label}",
                "pad_eff": stats["pad_eff"],
                "row_fill": stats["budget_fill"],
                "real_per_step": stats["real_tokens_per_step"],
                "composition_repeat": stats["composition_repeat"],
                "setup_s": setup,
                "epoch_plan_s": seconds,
            }
        )
    return rows


def bench_transformers(lengths, repeats, batch_size):
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    as_list = lengths.tolist()

    def one_epoch(e):
        g = torch.Generator().manual_seed(e)
        return np.fromiter(iter(LengthGroupedSampler(batch_size, lengths=as_list, generator=g)), dtype=np.int64)

    seconds, order = timed(one_epoch, repeats)
    return {
        "batching": f"transformers LengthGroupedSampler ({batch_size} per batch)",
        "pad_eff": fixed_size_pad_eff(order, lengths, batch_size),
        "row_fill": float("nan"),
        "real_per_step": float("nan"),
        "composition_repeat": float("nan"),
        "setup_s": 0.0,
        "epoch_plan_s": seconds,
    }


def bench_lhotse(lengths, budget, n):
    from lhotse import CutSet, MonoCut
    from lhotse.dataset.sampling import DynamicBucketingSampler

    sub = lengths[:n]
    start = time.perf_counter()
    cuts = CutSet.from_cuts(MonoCut(id=str(i), start=0.0, duration=float(n), channel=0) for i, n in enumerate(sub))
    setup = time.perf_counter() - start
    sampler = DynamicBucketingSampler(cuts, max_duration=float(budget), num_buckets=6, shuffle=True, seed=0)
    start = time.perf_counter()
    batches = [np.array([int(c.id) for c in batch], dtype=np.int64) for batch in sampler]
    seconds = time.perf_counter() - start
    pad = plan_padding(batches, sub, packed=False)
    return {
        "batching": f"lhotse DynamicBucketingSampler (6 buckets; {n:,} samples)",
        "pad_eff": pad["pad_eff"],
        "row_fill": float("nan"),
        "real_per_step": pad["real_tokens"] / max(1, len(batches)),
        "composition_repeat": float("nan"),
        "setup_s": setup,
        "epoch_plan_s": seconds,
        "note": f"{seconds * 100_000 / n:.1f} s per 100K samples",
    }


MEMORY_SNIPPET = """
import resource, sys
from dflash_lab.data.lengths import reference_lengths
from dflash_lab.sampling import build_policy
name, n, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
lengths = reference_lengths("seed", n)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
params = {"boundaries": [0, 770, 1216, 1728, 2432, 3296, 8192]} if name.startswith("bucketed") else {}
p = build_policy(name, lengths, max_tokens=budget, **params)
p.global_plan(0)
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def bench_memory(n, budget):
    rows = []
    for name in ("full_random", "sorted_static", "bucketed", "bucketed_megabatch", "packed"):
        out = subprocess.run(
            [sys.executable, "-c", MEMORY_SNIPPET, name, str(n), str(budget)], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        base_kb, peak_kb = map(int, out.stdout.split())
        rows.append({"policy": name, "peak_rss_gb": peak_kb / 2**20, "plan_rss_gb": (peak_kb - base_kb) / 2**20})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="seed", choices=["seed", "cpu", "heavy_tailed", "bimodal"])
    parser.add_argument("--n", type=int, default=800_000)
    parser.add_argument("--budget", type=int, default=32_768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lhotse-n", type=int, default=100_000)
    parser.add_argument("--memory-n", type=int, default=10_000_000, help="0 skips the memory run")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    args = parser.parse_args()

    lengths = reference_lengths(args.workload, args.n)
    rows = bench_ours(lengths, args.budget, args.repeats, "cpu" if args.workload == "cpu" else "seed")
    baseline = rows[0]["epoch_plan_s"]
    rng = np.random.default_rng(0)
    rows.append(
        {
            "batching": "random order, fixed 7 per batch (DistributedSampler)",
            "pad_eff": fixed_size_pad_eff(rng.permutation(lengths.size), lengths, 7),
            "row_fill": float("nan"), "real_per_step": float("nan"), "composition_repeat": float("nan"),
            "setup_s": 0.0, "epoch_plan_s": float("nan"),
        }
    )
    hf = bench_transformers(lengths, args.repeats, 7)
    rows.append(hf)
    rows.append(bench_lhotse(lengths, args.budget, args.lhotse_n))

    lines = [
        f"# Sampling benchmark: {args.workload} workload, {args.n:,} samples, budget {args.budget:,}",
        "",
        f"Command: `python benchmarks/bench_sampling.py --workload {args.workload} --n {args.n} "
        f"--budget {args.budget} --memory-n {args.memory_n}" + (f" --out {args.out}" if args.out else "") + "`  ",
        f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, {__import__('os').cpu_count()} cores, "
        f"Python {platform.python_version()}, numpy {np.__version__}; median of {args.repeats} epochs.",
        "",
        "| batching | padding eff. | row fill | real tokens / step | composition repeat | setup s | epoch plan s "
        "| transformers time / this |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = hf["epoch_plan_s"] / r["epoch_plan_s"] if r["epoch_plan_s"] == r["epoch_plan_s"] else float("nan")
        lines.append(
            f"| {r['batching']} | {r['pad_eff']:.3f} | {r['row_fill']:.4f} | {r['real_per_step']:,.0f} | "
            f"{r['composition_repeat']:.3f} | "
            f"{r['setup_s']:.3f} | {r['epoch_plan_s']:.3f} | {'' if ratio != ratio else f'{ratio:.2f}x'} |"
            + (f" {r['note']}" if "note" in r else "")
        )
    lines.append("")
    lines.append("(`transformers time / this` > 1 means this plan is built faster than LengthGroupedSampler's epoch; "
                 f"row fill = real tokens / (batches x budget); full_random epoch plan {baseline:.3f} s.)")
    if args.memory_n:
        lines += ["", f"## Memory: one epoch plan for {args.memory_n:,} samples (peak RSS of a fresh process)", "",
                  "| policy | peak RSS GB | added by the plan GB |", "|---|---|---|"]
        for m in bench_memory(args.memory_n, args.budget):
            lines.append(f"| {m['policy']} | {m['peak_rss_gb']:.2f} | {m['plan_rss_gb']:.2f} |")
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
