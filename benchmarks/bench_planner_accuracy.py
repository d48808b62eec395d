"""Does the planner predict what the trainer measures? Fit the cost model on one policy's run, predict the others.

    python benchmarks/bench_planner_accuracy.py --steps 150 --fit-on full_random --out docs/planner_accuracy.md

For each policy this trains ``--steps`` steps of the default job (``python -m dflash_lab.train sampler=<policy>``,
same data, seed and budget, tau off) one after another in this process, then fits ``CostModel.from_run`` on the
``--fit-on`` run and predicts every policy's Ktok/s with ``plan.predict_throughput`` on the same data. Measured
and predicted Ktok/s use the one definition (``metrics.throughput.steady_state_ktok_s``: median over steps of real
tokens / step time). The table goes to stdout and, with ``--out``, to a markdown file with the command and the
machine's load.
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
    parser.add_argument("--fit-on", default="full_random", choices=POLICIES)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. trainer.num_threads=2)")
    args = parser.parse_args()

    from dflash_lab.checkpoint import load_run_checkpoint
    from dflash_lab.plan import CostModel, load_lengths, predict_throughput
    from dflash_lab.sampling import policy_from_config

    work = Path(tempfile.mkdtemp(prefix="planner_accuracy_"))
    load_before = os.getloadavg()
    started = time.time()
    summaries = {}
    for policy in args.policies:
        summaries[policy] = run_policy(policy, work / policy, args.steps, args.overrides)
        print(f"{policy}: measured {summaries[policy]['ktok_s']:.2f} Ktok/s", flush=True)
    cost = CostModel.from_run(work / args.fit_on)
    rows = []
    for policy in args.policies:
        run_cfg = load_run_checkpoint(work / policy)["config"]  # the resolved config the run used
        lengths = load_lengths(run_cfg["data"], run_cfg["model"])
        plan_policy = policy_from_config(run_cfg["sampler"], lengths, seed=run_cfg["seed"])
        predicted = predict_throughput(plan_policy, cost, epochs=1)["ktok_s"]
        measured = summaries[policy]["ktok_s"]
        rows.append((policy, measured, predicted, predicted / measured - 1.0))
    elapsed = time.time() - started
    command = ("python benchmarks/bench_planner_accuracy.py --steps {} --fit-on {} {}".format(
        args.steps, args.fit_on, " ".join(args.overrides))).strip()
    lines = [
        f"Cost model fitted on the `{args.fit_on}` run: step = {cost.c0:.4g} s + {cost.c1:.4g} s x padded + "
        f"{cost.c2:.4g} s x attention tokens",
        "",
        "| policy | measured Ktok/s | predicted Ktok/s | error |",
        "|---|---|---|---|",
        *[f"| {p} | {m:.2f} | {q:.2f} | {e:+.1%} |" for p, m, q, e in rows],
        "",
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
