"""Does the planner predict what the trainer measures? Fit the cost model on one policy's run, predict the others.

    python benchmarks/bench_planner_accuracy.py --steps 150 --fit-on full_random packed --rules density recipe \
        --out docs/planner_accuracy.md

For each anchor rule and policy this trains ``--steps`` steps of the default job (``python -m dflash_lab.train
sampler=<policy>``, same data, seed and budget, tau off) one after another in this process, then fits
``CostModel.from_runs`` (step time on padded tokens, attention tokens, block slots and packed documents) on the
``--fit-on`` runs of that rule (default: full_random and packed; the CPU draft's per-document attention in packed
rows shows only in a packed run) and predicts every policy's Ktok/s with ``plan.predict_throughput`` on the same data. Rules (``RULES``):
``density`` is the tiny model's default (one anchor per 16 valid positions, at most 64 per document); ``recipe``
is the DFlash recipe's per-document rule (min(64, valid positions) anchors, every position of a short document)
under a block budget of 4,096 block tokens per step, which binds. Measured and predicted Ktok/s use the one
definition (``metrics.throughput.steady_state_ktok_s``: median over steps of real tokens / step time; the
planner's ``ktok_s_median``, not its headline Ktok/s over time). The table
goes to stdout and, with ``--out``, to a markdown file with the command and the machine's load.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("sorted_static", "full_random", "bucketed", "bucketed_megabatch", "packed")
RULES = {
    "density": [],
    "recipe": ["model.anchor_density=null", "model.anchors_per_doc=64", "sampler.max_block_tokens=4096"],
}


def run_policy(policy: str, run_dir: Path, steps: int, extra: list[str]) -> dict:
    from dflash_lab.train import train

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            f"run_dir={run_dir}", f"sampler={policy}", f"trainer.max_steps={steps}", "trainer.measure_tau=false",
            "trainer.progress=false", *extra])
    return train(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--fit-on", nargs="+", default=["full_random", "packed"], choices=POLICIES,
                        help="the runs the cost model is fitted on together (default: a padded and a packed one)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. trainer.num_threads=2)")
    args = parser.parse_args()

    from dflash_lab.records.checkpoint import load_run_checkpoint
    from dflash_lab.plan import CostModel, load_plan_data, plan_block_tokens, predict_throughput
    from dflash_lab.sampling import policy_from_config, resolve_auto_boundaries

    work = Path(tempfile.mkdtemp(prefix="planner_accuracy_"))
    load_before = os.getloadavg()
    started = time.time()
    sections = []
    for rule in args.rules:
        summaries = {}
        for policy in args.policies:
            summaries[policy] = run_policy(policy, work / rule / policy, args.steps, [*RULES[rule], *args.overrides])
            print(f"{rule} {policy}: measured {summaries[policy]['ktok_s']:.2f} Ktok/s", flush=True)
        cost = CostModel.from_runs([work / rule / policy for policy in args.fit_on])
        rows = []
        for policy in args.policies:
            run_cfg = load_run_checkpoint(work / rule / policy)["config"]  # the resolved config the run used
            lengths, valid = load_plan_data(run_cfg["data"], run_cfg["model"])
            sampler_cfg = resolve_auto_boundaries({**run_cfg["sampler"],
                                                   "max_block_tokens": summaries[policy].get("max_block_tokens")},
                                                  builtin_corpus=run_cfg["data"].get("kind") == "synthetic")
            plan_policy = policy_from_config(sampler_cfg, lengths, seed=run_cfg["seed"],
                                             block_tokens=plan_block_tokens(valid, run_cfg["model"]))
            predicted = predict_throughput(plan_policy, cost, epochs=1)["ktok_s_median"]
            measured = summaries[policy]["ktok_s"]
            rows.append((policy, measured, predicted, predicted / measured - 1.0))
        sections += [
            f"### Anchor rule `{rule}` ({' '.join(RULES[rule]) or 'the default job'})",
            "",
            f"Cost model fitted on the {' + '.join(f'`{p}`' for p in args.fit_on)} runs: step = {cost.c0:.4g} s + "
            f"{cost.c1:.4g} s x padded + {cost.c2:.4g} s x attention tokens + {cost.c3:.4g} s x block slots + "
            f"{cost.c4:.4g} s x packed documents",
            "",
                "| policy | measured Ktok/s | predicted Ktok/s | error | in the fit |",
            "|---|---|---|---|---|",
            *[f"| {p} | {m:.2f} | {q:.2f} | {e:+.1%} | {'yes' if p in args.fit_on else 'no'} |"
              for p, m, q, e in rows],
            "",
        ]
    elapsed = time.time() - started
    command = ("python benchmarks/bench_planner_accuracy.py --steps {} --fit-on {} --rules {} {}".format(
        args.steps, " ".join(args.fit_on), " ".join(args.rules), " ".join(args.overrides))).strip()
    lines = [
        *sections,
        f"Command: `{command}` ({args.steps} steps per policy, default job otherwise; {elapsed:.0f} s in all; "
        f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; {platform.processor() or 'cpu'}, "
        f"{os.cpu_count()} cores).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
