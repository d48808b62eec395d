"""Analysis: load runs (local run directories, W&B, offline W&B) into one schema, compare arms, plot.

    records = load_runs(["multirun/ablation_policies"]).runs      # or wandb="entity/project", group="..."
    comparison = compare_records(records, protocol=resolve_protocol(records, baseline="full_random"))
    print(markdown_tables(comparison))                              # comparison.runs / .groups / .paired / .bands
"""

from __future__ import annotations

from pathlib import Path

from dflash_lab.analysis.local import LoadReport, find_run_dirs, load_local_paths, load_local_run
from dflash_lab.analysis.protocol import Protocol, resolve_protocol
from dflash_lab.analysis.schema import RUN_COLUMNS, RunRecord
from dflash_lab.analysis.summarize import Comparison, analyse_run, compare_records, markdown_tables
from dflash_lab.analysis.wandb_runs import OfflineRun, load_offline_runs, load_wandb_runs, wandb_run_to_record


OFFLINE_WANDB_HINT = ("read them with --offline-wandb (compare; the notebook reads them unless DFLASH_OFFLINE_WANDB=0): that parses "
                      "W&B's own .wandb transaction log, an undocumented format read for wandb >=0.19.10,<0.32 "
                      "(pyproject.toml pins that range); or `wandb sync` them and load them from W&B "
                      "(--wandb ENTITY/PROJECT)")


def load_runs(paths: list[str | Path] = (), wandb: str | None = None, group: str | None = None,
              api=None, offline_wandb: bool = False) -> LoadReport:
    """Load local paths (run dirs, multirun dirs, or with ``offline_wandb`` offline W&B run dirs) and, optionally,
    W&B runs.

    The run directories' own files are the record. A local path holding no run directory but offline W&B runs is
    read from the runs' ``.wandb`` logs only when asked (``offline_wandb=True``: W&B's undocumented binary format,
    parsed by ``wandb_runs.read_wandb_records`` for the pinned wandb range), else reported as a problem that says
    how. Never raises for bad input: see `LoadReport.problems`.

    Example:
        >>> load_runs(["/nonexistent"]).problems
        ['/nonexistent: does not exist']
    """
    report = LoadReport()
    for path in paths:
        local = load_local_paths([path])
        if not local.runs and Path(path).is_dir() and OfflineRun.find(path):
            if offline_wandb:
                local = load_offline_runs(path)
            else:
                local = LoadReport(problems=[f"{path}: holds offline W&B runs and no run directory; "
                                             f"{OFFLINE_WANDB_HINT}"])
        report.runs += local.runs
        report.problems += local.problems
    if wandb:
        online = load_wandb_runs(wandb, group, api=api)
        report.runs += online.runs
        report.problems += online.problems
    return report


__all__ = [
    "OFFLINE_WANDB_HINT", "RUN_COLUMNS", "Comparison", "LoadReport", "OfflineRun", "Protocol", "RunRecord", "analyse_run",
    "compare_records", "find_run_dirs", "load_local_paths", "load_local_run", "load_offline_runs", "load_runs",
    "load_wandb_runs", "markdown_tables", "resolve_protocol", "wandb_run_to_record",
]
