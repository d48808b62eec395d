"""Compare training runs across batching policies: `python -m dflash_lab.compare PATH... [--wandb E/P --group G]`.

    python -m dflash_lab.compare multirun/ablation_policies --out docs/ablation
    python -m dflash_lab.compare --wandb my-entity/dflash_lab --group ablation_policies --out /tmp/cmp

PATH may be a run directory, a multirun directory (expanded to every run below it) or a folder of offline W&B runs.
Writes to --out (default ./comparison): comparison.csv (one row per run, every column of
dflash_lab.analysis.schema.RUN_COLUMNS), comparison_policies.csv (per-policy mean/std over seeds), comparison.md
(the tables, printed too), bands.csv (per-band forgetting, loop and example-forgetting figures), interference.csv
(I[a, b] per run) and PNG plots. Bad inputs are reported and skipped; the exit code is 1 only if no run loaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_lab.analysis import compare_records, load_runs, markdown_tables
from dflash_lab.analysis.plots import write_all_plots
from dflash_lab.analysis.summarize import Comparison
from dflash_lab.metrics.forgetting import LEARNED_THRESHOLD


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dflash_lab.compare", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", help="run directories, multirun directories or offline W&B run folders")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also load runs from this W&B project")
    parser.add_argument("--group", help="W&B group (experiment name) to restrict --wandb to")
    parser.add_argument("--out", default="comparison", help="output directory (default: ./comparison)")
    parser.add_argument("--theta", type=float, default=LEARNED_THRESHOLD,
                        help="block accuracy at which a training example counts as learned, for forgetting events "
                             f"(default {LEARNED_THRESHOLD}, METRICS.md)")
    parser.add_argument("--no-plots", action="store_true", help="write the tables only")
    args = parser.parse_args(argv)
    if not args.paths and not args.wandb:
        parser.error("give at least one PATH or --wandb ENTITY/PROJECT")
    return args


def write_outputs(comparison: Comparison, out: Path) -> list[Path]:
    """The comparison's CSV and markdown files in `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "comparison.csv", out / "comparison_policies.csv", out / "comparison.md"]
    comparison.runs.to_csv(written[0], index=False)
    comparison.policies.to_csv(written[1])
    written[2].write_text(markdown_tables(comparison) + "\n")
    for name, table in (("bands.csv", comparison.bands), ("interference.csv", comparison.interference)):
        if not table.empty:
            table.to_csv(out / name, index=False)
            written.append(out / name)
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = load_runs(args.paths, wandb=args.wandb, group=args.group)
    for problem in report.problems:
        print(f"skipped: {problem}", file=sys.stderr)
    if not report.runs:
        print("no runs loaded; nothing to compare", file=sys.stderr)
        return 1
    comparison = compare_records(report.runs, theta=args.theta)
    out = Path(args.out)
    written = write_outputs(comparison, out)
    if not args.no_plots:
        written += write_all_plots(report.runs, comparison, out)
    partial = int(comparison.runs["partial"].sum())
    print(markdown_tables(comparison))
    print(f"\n{len(report.runs)} run(s) ({partial} partial); wrote {', '.join(str(p) for p in written)}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
