"""Load local run directories (docs/CONTRACTS.md layout) into `RunRecord`s.

A path is a run directory when it holds `metrics.jsonl`, `run_config.json` or `.hydra/config.yaml`. A run's config is
its own record, `run_config.json` (written by the run when a launch trains it); Hydra's per-launch
`.hydra/config.yaml` (which a later launch that trained nothing may have rewritten) is read only for runs recorded
before that file existed. Any other directory is searched
for run directories below it (a multirun folder expands to its runs; the search does not descend into a run).
Nothing here raises on bad input: problems become `RunRecord.messages` or `LoadReport.problems`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from dflash_lab.records import record
from dflash_lab.analysis.schema import (
    PRESENTATION_COLUMNS,
    PROBE_COLUMNS,
    STATUS_SUMMARY_UNREADABLE,
    STEP_COLUMNS,
    RunRecord,
    conform,
)

RUN_MARKERS = ("metrics.jsonl", record.RUN_CONFIG_FILE, ".hydra/config.yaml")


@dataclass
class LoadReport:
    """Runs loaded from some paths, and one message per path that held no run or could not be read."""

    runs: list[RunRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def is_run_dir(path: Path) -> bool:
    """True when `path` holds metrics.jsonl, run_config.json or .hydra/config.yaml.

    Example:
        >>> is_run_dir(Path("/nonexistent"))
        False
    """
    return path.is_dir() and any((path / marker).is_file() for marker in RUN_MARKERS)


def _is_wandb_dir(path: Path) -> bool:
    """A W&B folder (`wandb/`, or an offline run holding a `.wandb` log): its files/ copies are not runs."""
    return path.name == "wandb" or any(path.glob("*.wandb"))


def find_run_dirs(path: Path | str) -> list[Path]:
    """`path` itself if it is a run directory, else every run directory below it (sorted; hidden dirs skipped).
    Symbolic links to folders are followed (a folder of links to runs kept elsewhere), each folder once.

    W&B folders are not searched: an offline run's files/ holds copies of metrics.jsonl (read those through
    `wandb_runs.load_offline_runs` instead).

    Example:
        >>> find_run_dirs("/nonexistent")
        []
    """
    root = Path(path)
    if is_run_dir(root):
        return [root]
    found: list[Path] = []
    if not root.is_dir() or _is_wandb_dir(root):
        return found
    visited: set[str] = set()
    for directory, subdirs, _ in os.walk(root, followlinks=True):
        current = Path(directory)
        real = os.path.realpath(current)
        if real in visited:   # a link back up the tree, or two links to one folder
            subdirs[:] = []
            continue
        visited.add(real)
        if is_run_dir(current):
            found.append(current)
            subdirs[:] = []  # checkpoints/, wandb/ ... of a run are not runs
            continue
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and not _is_wandb_dir(current / d))
    return sorted(found)


def read_jsonl(path: Path) -> tuple[pd.DataFrame, int]:
    """Rows of a run's JSON-lines file as a DataFrame, and the count of lines skipped as unusable.

    The rule is the record's (``dflash_lab.records.record.read_jsonl``): a line that is not JSON, not an object, or whose
    ``step`` is not a valid step number (``"abc"``, ``1e308``, negative) is skipped and counted.

    Example:
        >>> import tempfile
        >>> file = Path(tempfile.mkdtemp()) / "m.jsonl"
        >>> _ = file.write_text('{"step": 1}\\n{"step": "abc"}\\n{"step": 2')
        >>> frame, bad = read_jsonl(file)
        >>> len(frame), bad
        (1, 2)
    """
    rows, bad = record.read_jsonl(path)
    return pd.DataFrame(rows), bad


def _numeric_problems(frame: pd.DataFrame, label: str) -> str | None:
    """Count values of numeric contract columns that are not numbers (they are treated as missing)."""
    bad = {}
    for column in frame.columns:
        if column in ("sampler",) or frame[column].dtype != object:
            continue
        values = frame[column]
        coerced = pd.to_numeric(values, errors="coerce")
        count = int((coerced.isna() & values.notna()).sum())
        if count:
            bad[column] = count
            frame[column] = coerced
    if not bad:
        return None
    return f"{label}: non-numeric values treated as missing ({', '.join(f'{k}: {v}' for k, v in bad.items())})"


def read_config(run_dir: Path) -> tuple[dict, str | None]:
    """The resolved config of a run as a plain dict: its own `run_config.json`, else (runs recorded before it
    existed) `.hydra/config.yaml`; ({} and a message if missing or unreadable)."""
    recorded = record.read_run_config(run_dir)
    if recorded.problem:
        if not recorded.source:
            return {}, "no run_config.json or .hydra/config.yaml: sampler and seed come from summary.json only"
        return {}, recorded.problem
    return recorded.config, None


# Step columns that runs of earlier versions lack and no comparison figure needs: not worth a note.
OPTIONAL_STEP_COLUMNS = ("block_tokens", "block_slots", "clipped")


def _steps_table(frame: pd.DataFrame, messages: list[str], label: str) -> pd.DataFrame:
    steps, missing = conform(frame, STEP_COLUMNS)
    missing = [name for name in missing if name not in OPTIONAL_STEP_COLUMNS]
    if missing and len(frame):
        messages.append(f"{label} lacks {', '.join(missing)}: figures that need them are NaN")
    if len(steps):
        steps = steps.sort_values("step", kind="stable").drop_duplicates("step", keep="last").reset_index(drop=True)
    return steps


def load_local_run(run_dir: Path | str) -> RunRecord:
    """Read one run directory into a RunRecord; never raises for missing or damaged files.

    Args:
        run_dir: a directory holding metrics.jsonl and/or its config record (see `is_run_dir`).

    Returns:
        RunRecord with source "local"; `messages` lists what was missing (summary.json, probes, ...).

    Example:
        >>> record = load_local_run("/nonexistent")
        >>> record.status, any(m.startswith("no summary.json") for m in record.messages)
        ('no_summary', True)
    """
    path = Path(run_dir)
    messages: list[str] = []
    record = RunRecord(run_id=path.name, source="local", location=str(path), name=path.name)

    record.config, config_message = read_config(path)
    if config_message:
        messages.append(config_message)
    experiment = record.config.get("experiment")
    record.group = str(experiment) if experiment else path.parent.name

    summary_path = path / "summary.json"
    if summary_path.is_file():
        try:
            loaded = json.loads(summary_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            loaded = f"not valid JSON ({exc})"
        if isinstance(loaded, dict):
            record.summary = loaded
        else:   # truncated or damaged: said as such (its status), never as a run without a summary
            problem = loaded if isinstance(loaded, str) else f"not a JSON object ({type(loaded).__name__})"
            record.summary = {"status": STATUS_SUMMARY_UNREADABLE, "error": f"summary.json is {problem}"}
            messages.append(f"summary.json is {problem} (truncated or damaged): treated as a partial run")
    else:
        messages.append("no summary.json (crashed or still running): partial run, figures from metrics.jsonl")

    metrics_path = path / "metrics.jsonl"
    if metrics_path.is_file():
        frame, bad = read_jsonl(metrics_path)
        if bad:
            messages.append(f"metrics.jsonl: skipped {bad} unusable line(s)")
        problem = _numeric_problems(frame, "metrics.jsonl")
        if problem:
            messages.append(problem)
        record.steps = _steps_table(frame, messages, "metrics.jsonl")
    else:
        messages.append("no metrics.jsonl: no per-step figures")
    if record.steps.empty:
        messages.append("no logged steps")

    probes_path = path / "probes.jsonl"
    if probes_path.is_file():
        frame, bad = read_jsonl(probes_path)
        if bad:
            messages.append(f"probes.jsonl: skipped {bad} unusable line(s)")
        problem = _numeric_problems(frame, "probes.jsonl")
        if problem:
            messages.append(problem)
        record.probes, missing = conform(frame, PROBE_COLUMNS)
        if missing and len(frame):
            messages.append(f"probes.jsonl lacks {', '.join(missing)}")
    else:
        messages.append("no probes.jsonl: band forgetting, interference and loop score are NaN")

    presentations_path = path / "presentations.parquet"
    if presentations_path.is_file():
        try:
            record.presentations, missing = conform(pd.read_parquet(presentations_path), PRESENTATION_COLUMNS)
            if missing:
                messages.append(f"presentations.parquet lacks {', '.join(missing)}")
        except Exception as exc:  # noqa: BLE001 - a half-written parquet file from a crash
            messages.append(f"could not read presentations.parquet ({type(exc).__name__}): example forgetting NaN")
    else:
        messages.append("no presentations.parquet: example forgetting events are NaN")

    record.messages = messages
    return record


def describe_no_runs(path: Path, shown: int = 5) -> str:
    """Why ``path`` yields no run, and what it holds instead (its first entries, links whose target is missing),
    so the fix is plain.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> (folder / "notes.txt").write_text("x") and None
        >>> (folder / "run_a").symlink_to(folder / "gone")
        >>> print(describe_no_runs(folder))  # doctest: +ELLIPSIS
        not a run directory (...) and holds no run directory nor offline W&B run; it holds 2 entries (notes.txt, run_a); 1 symbolic link(s) to a missing target (run_a -> .../gone): ...
    """
    entries = sorted(Path(path).iterdir()) if Path(path).is_dir() else []
    broken = [entry for entry in entries if entry.is_symlink() and not entry.exists()]
    text = ("not a run directory (no metrics.jsonl, run_config.json or .hydra/config.yaml) and holds no run directory "
            "nor offline W&B run")
    if not entries:
        return text + "; it is empty: point at a multirun folder (multirun/<experiment>/<time>) or a run directory"
    names = ", ".join(entry.name for entry in entries[:shown]) + (f", ... ({len(entries) - shown} more)"
                                                                 if len(entries) > shown else "")
    text += f"; it holds {len(entries)} entries ({names})"
    if broken:
        links = ", ".join(f"{entry.name} -> {os.readlink(entry)}" for entry in broken[:shown])
        text += (f"; {len(broken)} symbolic link(s) to a missing target ({links}): link to the run directories as "
                 f"they are now (absolute paths, or paths relative to the link's folder)")
    else:
        text += ": point at a multirun folder (multirun/<experiment>/<time>), a run directory, or a folder of them"
    return text


def load_local_paths(paths: list[Path | str]) -> LoadReport:
    """Expand each path to its run directories and load them; paths holding no run become problems.

    Example:
        >>> load_local_paths(["/nonexistent"]).problems
        ['/nonexistent: does not exist']
    """
    report = LoadReport()
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            report.problems.append(f"{raw}: does not exist")
            continue
        run_dirs = find_run_dirs(path)
        if not run_dirs:
            report.problems.append(f"{raw}: {describe_no_runs(path)}")
            continue
        for run_dir in run_dirs:
            resolved = run_dir.resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            report.runs.append(load_local_run(run_dir))
    return report
