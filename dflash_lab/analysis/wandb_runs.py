"""W&B runs -> `RunRecord`: the online public API (`wandb.Api`) and offline run directories, one mapping for both.

Mapping (what `dflash_lab.records.run_logger` sends to W&B):
    run.config                         -> RunRecord.config (nested dict; W&B's {"value": ...} wrappers removed);
                                          its `overrides` list (the Hydra task overrides), if logged -> overrides
    run.summary                        -> RunRecord.summary (contract summary keys; "_"-prefixed keys dropped;
                                          `final/<key>` read as <key> and preferred over a per-step <key>: so
                                          final/target_digest and final/data_digest, which compare checks)
    history rows with "loss" or "train/loss" -> steps (metrics.jsonl field names, a `train/` prefix removed;
                                          "step" else "_step")
    history keys probe/<band>/<loss|acc> or probe/<lo>-<hi>/<loss|acc> -> probes (one row per eval and band; a
                                          <lo>-<hi> name gives band_lo/band_hi and bands numbered by lo)
    run files presentations.parquet / probes.jsonl / metrics.jsonl, when uploaded, replace the history-derived tables
    run.group, run.name, run.id        -> group, name, run_id

Offline runs (`wandb.init(mode="offline")`) have no server to ask, so `OfflineRun` reads the run's `.wandb`
transaction log (LevelDB log framing around `wandb_internal_pb2.Record` protobufs) and exposes the same attributes
as a public-API Run: id, name, group, config, summary, history(), files().
"""

from __future__ import annotations

import json
import re
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dflash_lab.analysis.local import LoadReport, read_jsonl
from dflash_lab.analysis.schema import PRESENTATION_COLUMNS, PROBE_COLUMNS, STEP_COLUMNS, RunRecord, conform
from dflash_lab.records.record import RUN_FILES

PROBE_KEY = re.compile(r"^probe/(?P<band>[^/]+)/(?P<field>loss|acc)$")
BAND_RANGE = re.compile(r"^(?P<lo>\d+)-(?P<hi>\d+)$")
TRAIN_PREFIX = "train/"
FINAL_PREFIX = "final/"


# ---------------------------------------------------------------------------------------------------- mapping
def _unwrap_config(config: Any) -> dict[str, Any]:
    """W&B may store config values as {"value": v, "desc": ...}; return plain nested values, "_wandb" removed."""
    if not isinstance(config, dict):
        try:
            config = dict(config)
        except (TypeError, ValueError):
            return {}
    plain: dict[str, Any] = {}
    for key, value in config.items():
        if str(key).startswith("_wandb"):
            continue
        if isinstance(value, dict) and set(value) <= {"value", "desc"} and "value" in value:
            value = value["value"]
        plain[str(key)] = value
    return plain


def _summary_dict(summary: Any) -> dict[str, Any]:
    if summary is None:
        return {}
    raw = getattr(summary, "_json_dict", None)
    if isinstance(raw, dict):
        summary = raw
    try:
        items = dict(summary).items()
    except (TypeError, ValueError):
        return {}
    plain = {str(k): v for k, v in items if not str(k).startswith("_") and not str(k).startswith(FINAL_PREFIX)}
    # the trainer's end-of-run figures, kept apart from the last per-step values of the same name
    plain.update({str(k)[len(FINAL_PREFIX):]: v for k, v in items if str(k).startswith(FINAL_PREFIX)})
    return plain


def _history_frame(run: Any) -> pd.DataFrame:
    """Every history row: `scan_history()` (unsampled) when the run has it, else `history()`."""
    scan = getattr(run, "scan_history", None)
    if callable(scan):
        return pd.DataFrame(list(scan()))
    history = run.history(samples=1_000_000, pandas=True) if _accepts_samples(run) else run.history()
    return history if isinstance(history, pd.DataFrame) else pd.DataFrame(history)


def _accepts_samples(run: Any) -> bool:
    import inspect

    try:
        parameters = inspect.signature(run.history).parameters
    except (TypeError, ValueError):
        return False
    return "samples" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def steps_from_history(history: pd.DataFrame) -> pd.DataFrame:
    """Training-step rows of a W&B history (rows that carry "loss"), in metrics.jsonl columns.

    Example:
        >>> history = pd.DataFrame({"_step": [0, 1, 2], "step": [1, 1, 2], "loss": [2.0, None, 1.5],
        ...                         "probe/0/acc": [None, 0.3, None]})
        >>> steps_from_history(history)[["step", "loss"]].to_numpy().tolist()
        [[1.0, 2.0], [2.0, 1.5]]
        >>> steps_from_history(pd.DataFrame({"step": [1], "train/loss": [2.0]}))["loss"].tolist()
        [2.0]
    """
    prefixed = {c: c[len(TRAIN_PREFIX):] for c in history.columns if str(c).startswith(TRAIN_PREFIX)}
    if prefixed:
        history = history.drop(columns=[c for c in prefixed.values() if c in history.columns and c != "step"])
        history = history.rename(columns=prefixed)
    if history.empty or "loss" not in history.columns:
        return conform(None, STEP_COLUMNS)[0]
    rows = history[history["loss"].notna()].copy()
    if "step" not in rows.columns or rows["step"].isna().all():
        rows["step"] = rows.get("_step", pd.Series(np.arange(len(rows)), index=rows.index))
    rows = rows[[c for c in rows.columns if not str(c).startswith("_") and not PROBE_KEY.match(str(c))]]
    steps, _ = conform(rows, STEP_COLUMNS)
    return steps.sort_values("step", kind="stable").drop_duplicates("step", keep="last").reset_index(drop=True)


def probes_from_history(history: pd.DataFrame) -> pd.DataFrame:
    """probe/<band>/<loss|acc> (or probe/<lo>-<hi>/...) history keys -> probes.jsonl rows (one per eval and band).

    Example:
        >>> history = pd.DataFrame({"step": [5, 5], "probe/0/loss": [2.0, None], "probe/0/acc": [0.3, None],
        ...                         "probe/1/loss": [2.5, None], "probe/1/acc": [0.1, None]})
        >>> probes = probes_from_history(history)
        >>> probes["band"].tolist(), probes["loss"].tolist(), probes["acc"].tolist()
        ([0, 1], [2.0, 2.5], [0.3, 0.1])
        >>> named = pd.DataFrame({"step": [5], "probe/96-152/loss": [2.0], "probe/0-96/loss": [1.5]})
        >>> probes = probes_from_history(named)
        >>> probes["band"].tolist(), probes["band_hi"].tolist(), probes["loss"].tolist()
        ([0, 1], [96, 152], [1.5, 2.0])
    """
    probe_columns = {c: PROBE_KEY.match(str(c)) for c in history.columns}
    probe_columns = {c: m for c, m in probe_columns.items() if m}
    if history.empty or not probe_columns:
        return conform(None, PROBE_COLUMNS)[0]
    step = history["step"] if "step" in history.columns else history.get("_step")
    ranges = {m["band"]: BAND_RANGE.match(m["band"]) for m in probe_columns.values()}
    by_lo = sorted({(int(r["lo"]), int(r["hi"])) for r in ranges.values() if r})
    long = []
    for column, match in probe_columns.items():
        values = pd.DataFrame({"step": step, "value": history[column]}).dropna()
        band, edges = match["band"], ranges[match["band"]]
        if edges:  # probe/<lo>-<hi>/...: bands numbered by their lower edge
            lo, hi = int(edges["lo"]), int(edges["hi"])
            values["band"], values["band_lo"], values["band_hi"] = by_lo.index((lo, hi)), lo, hi
        else:
            values["band"] = int(band) if band.lstrip("-").isdigit() else band
            values["band_lo"] = values["band_hi"] = np.nan
        values["field"] = match["field"]
        long.append(values)
    stacked = pd.concat(long, ignore_index=True)
    wide = stacked.pivot_table(index=["step", "band"], columns="field", values="value", aggfunc="last").reset_index()
    edges = stacked.groupby("band")[["band_lo", "band_hi"]].first()
    wide = wide.join(edges, on="band")
    wide.columns.name = None
    wide["step"] = wide["step"].astype(np.int64)
    probes, _ = conform(wide, PROBE_COLUMNS)
    return probes.sort_values(["step", "band"]).reset_index(drop=True)


def _download_run_files(run: Any, messages: list[str]) -> dict[str, Path]:
    """Run files named in RUN_FILES, downloaded (or, offline, located) on this machine."""
    files_method = getattr(run, "files", None)
    if not callable(files_method):
        return {}
    found: dict[str, Path] = {}
    try:
        files = list(files_method())
    except Exception as exc:  # noqa: BLE001 - the server may refuse; history is enough
        messages.append(f"could not list W&B run files ({type(exc).__name__}): using history only")
        return {}
    target = Path(tempfile.mkdtemp(prefix="dflash_wandb_"))
    for handle in files:
        name = Path(getattr(handle, "name", "")).name
        if name not in RUN_FILES:
            continue
        local = getattr(handle, "local_path", None)
        try:
            if local is not None:
                found[name] = Path(local)
            else:
                handle.download(root=str(target), replace=True)
                found[name] = target / handle.name
        except Exception as exc:  # noqa: BLE001
            messages.append(f"could not download {name} ({type(exc).__name__}): using history")
    return found


def wandb_run_to_record(run: Any, source: str = "wandb", location: str | None = None) -> RunRecord:
    """Map a W&B public-API Run (or an `OfflineRun`) onto the common schema.

    Args:
        run: object with id, name, group, config (dict), summary (dict-like), history() -> DataFrame and,
            optionally, scan_history() and files().
        source: "wandb" or "wandb_offline".
        location: where it came from (default: run.path joined by "/", else the id).

    Returns:
        RunRecord; steps and probes from history (or the uploaded run files when present).

    Example:
        >>> class Run:  # the shape of wandb.apis.public.Run
        ...     id, name, group = "abc123", "bucketed_s0", "ablation"
        ...     config = {"sampler": {"name": "bucketed"}, "seed": 0}
        ...     summary = {"ktok_s": 3.0, "status": "finished", "_runtime": 9}
        ...     def history(self):
        ...         return pd.DataFrame({"step": [1, 2], "loss": [2.0, 1.8]})
        >>> record = wandb_run_to_record(Run())
        >>> record.sampler, record.seed, record.summary, record.steps["loss"].tolist()
        ('bucketed', 0, {'ktok_s': 3.0, 'status': 'finished'}, [2.0, 1.8])
    """
    messages: list[str] = []
    if getattr(run, "complete", True) is False:
        messages.append("offline W&B log has no exit record yet (still being written, or the run crashed)")
    record = _identity(run, source, location)
    try:
        history = _history_frame(run)
    except Exception as exc:  # noqa: BLE001 - a run whose history cannot be read is still listed
        messages.append(f"could not read W&B history ({type(exc).__name__}: {exc})")
        history = pd.DataFrame()
    record.steps = steps_from_history(history)
    record.probes = probes_from_history(history)
    _read_run_files(record, _download_run_files(run, messages), messages)
    _settle_summary(record, messages)
    if record.steps.empty:
        messages.append("W&B history has no training steps")
    if record.probes.empty:
        messages.append("W&B history has no probe/<band>/* keys: band forgetting and probe dynamics NaN")
    if record.presentations.empty:
        messages.append("no presentations.parquet among the W&B run files: example forgetting events NaN")
    record.messages = messages
    return record


def _identity(run: Any, source: str, location: str | None) -> RunRecord:
    """The run's record before its data: id, where it came from, name, group, config, summary and overrides."""
    run_id = str(getattr(run, "id", None) or getattr(run, "name", "wandb-run"))
    path = getattr(run, "path", None)
    if location is None:
        location = "/".join(map(str, path)) if isinstance(path, (list, tuple)) else str(path or run_id)
    record = RunRecord(
        run_id=run_id,
        source=source,
        location=location,
        name=str(getattr(run, "name", "") or run_id),
        group=getattr(run, "group", None),
        config=_unwrap_config(getattr(run, "config", {}) or {}),
        summary=_summary_dict(getattr(run, "summary", {})),
    )
    logged_overrides = record.config.get("overrides")
    if isinstance(logged_overrides, (list, tuple)):
        record.overrides = [str(item) for item in logged_overrides]
    return record


def _read_run_files(record: RunRecord, files: dict[str, Path], messages: list[str]) -> None:
    """The uploaded run files, where the run has them: they replace what the history holds (the trainer's own
    records), and give the summary when W&B's is empty."""
    if "metrics.jsonl" in files:
        frame, _ = read_jsonl(files["metrics.jsonl"])
        record.steps = conform(frame, STEP_COLUMNS)[0].sort_values("step").reset_index(drop=True)
    if "probes.jsonl" in files:
        record.probes = conform(read_jsonl(files["probes.jsonl"])[0], PROBE_COLUMNS)[0]
    if "presentations.parquet" in files:
        try:
            record.presentations = conform(pd.read_parquet(files["presentations.parquet"]), PRESENTATION_COLUMNS)[0]
        except Exception as exc:  # noqa: BLE001
            messages.append(f"could not read presentations.parquet ({type(exc).__name__})")
    if "summary.json" in files and not record.summary:
        try:
            record.summary = json.loads(files["summary.json"].read_text())
        except (OSError, json.JSONDecodeError):
            messages.append("summary.json in run files is unreadable")


def _settle_summary(record: RunRecord, messages: list[str]) -> None:
    """A summary without the trainer's status: a finished run's when it holds the final figures, else none (a
    partial run). A W&B summary always holds the last logged values; only the trainer's summary carries a status."""
    if record.summary and "status" in record.summary:
        return
    if not any(key in record.summary for key in ("final_loss", "tau", "steps")):
        messages.append("W&B summary lacks the run's final figures (crashed or running): partial run")
        record.summary = {}
    else:
        record.summary = {**record.summary, "status": record.summary.get("status", "finished")}


def load_wandb_runs(entity_project: str, group: str | None = None, api: Any = None) -> LoadReport:
    """All runs of entity/project (optionally one group) through `wandb.Api`, mapped to RunRecords.

    Example:
        >>> class Api:
        ...     def runs(self, path, filters=None):
        ...         return []
        >>> load_wandb_runs("me/dflash", "ablation", api=Api()).problems
        ["W&B me/dflash group 'ablation': no runs"]
    """
    report = LoadReport()
    try:
        if api is None:
            import wandb

            api = wandb.Api()
        runs = list(api.runs(entity_project, filters={"group": group} if group else None))
    except Exception as exc:  # noqa: BLE001 - no network, no key, wrong project: say so, do not crash
        report.problems.append(f"W&B {entity_project}: cannot list runs ({type(exc).__name__}: {exc})")
        return report
    if not runs:
        report.problems.append(f"W&B {entity_project} group {group!r}: no runs")
    for run in runs:
        report.runs.append(wandb_run_to_record(run, "wandb"))
    return report


# ------------------------------------------------------------------------------------------------ offline runs
WANDB_LOG_HEADER = b":W&B"
_LOG_BLOCK = 32768
_LOG_HEADER_SIZE = 7  # ":W&B" + 2-byte magic + 1-byte version
_RECORD_HEADER_SIZE = 7  # crc32 (4) + length (2) + type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_wandb_records(path: Path | str) -> list[bytes]:
    """Raw protobuf payloads of a `.wandb` transaction log (LevelDB log framing, 32 KiB blocks).

    A torn tail (a run killed mid-write) ends the scan instead of raising.
    """
    data = Path(path).read_bytes()
    if not data.startswith(WANDB_LOG_HEADER):
        raise ValueError(f"{path}: not a W&B transaction log (missing :W&B header)")
    payloads: list[bytes] = []
    pending = b""
    position = _LOG_HEADER_SIZE
    while position + _RECORD_HEADER_SIZE <= len(data):
        left_in_block = _LOG_BLOCK - position % _LOG_BLOCK
        if left_in_block < _RECORD_HEADER_SIZE:
            position += left_in_block  # block trailer padding
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _RECORD_HEADER_SIZE])
        position += _RECORD_HEADER_SIZE
        chunk = data[position : position + length]
        position += length
        if len(chunk) < length:
            break
        if kind == _FULL:
            payloads.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            payloads.append(pending + chunk)
            pending = b""
    return payloads


def _item_key(item: Any) -> tuple[str, ...]:
    return (item.key,) if item.key else tuple(item.nested_key)


def _set_nested(target: dict, key: tuple[str, ...], value: Any) -> None:
    for part in key[:-1]:
        target = target.setdefault(part, {})
    target[key[-1]] = value


class OfflineFile:
    """A run file of an offline run (shaped like the public API's File: name, download, plus local_path)."""

    def __init__(self, path: Path):
        self.name = path.name
        self.local_path = path

    def download(self, root: str = ".", replace: bool = False) -> Path:
        target = Path(root) / self.name
        if replace or not target.exists():
            target.write_bytes(self.local_path.read_bytes())
        return target


class OfflineRun:
    """An offline W&B run directory read back with the attributes of `wandb.apis.public.Run`.

    Args:
        run_dir: `.../wandb/offline-run-<time>-<id>` (or `run-...`), holding `run-<id>.wandb`.

    Example:
        >>> OfflineRun.find("/nonexistent")
        []
    """

    def __init__(self, run_dir: Path | str):
        from wandb.proto import wandb_internal_pb2

        self.run_dir = Path(run_dir)
        logs = sorted(self.run_dir.glob("*.wandb"))
        if not logs:
            raise FileNotFoundError(f"{self.run_dir}: no .wandb transaction log")
        self.id = self.run_dir.name.rsplit("-", 1)[-1]
        self.name = self.id
        self.group: str | None = None
        self.job_type: str | None = None
        self.project: str | None = None
        self.config: dict[str, Any] = {}
        self.summary: dict[str, Any] = {}
        self._history: list[dict[str, Any]] = []
        # True once the log holds the run's exit record. wandb.finish() can return before the last block of an
        # offline log is flushed, and a crashed run never writes one: either way the run is incomplete.
        self.complete = False
        for payload in read_wandb_records(logs[0]):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(payload)
            except Exception:  # noqa: BLE001 - one damaged record does not spoil the rest
                continue
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self._read_run(record.run)
            elif kind == "config":
                self._apply(self.config, record.config.update, record.config.remove)
            elif kind == "summary":
                self._apply(self.summary, record.summary.update, record.summary.remove)
            elif kind == "exit":
                self.complete = True
            elif kind == "history":
                row: dict[str, Any] = {}
                for item in record.history.item:
                    row["/".join(_item_key(item))] = json.loads(item.value_json)
                self._history.append(row)
        self.path = [self.project or "offline", self.id]

    def _read_run(self, run: Any) -> None:
        self.id = run.run_id or self.id
        self.name = run.display_name or self.id
        self.group = run.run_group or None
        self.job_type = run.job_type or None
        self.project = run.project or None
        self._apply(self.config, run.config.update, [])

    @staticmethod
    def _apply(target: dict, updates: Any, removes: Any) -> None:
        for item in updates:
            _set_nested(target, _item_key(item), json.loads(item.value_json))
        for item in removes:
            key = _item_key(item)
            container = target
            for part in key[:-1]:
                container = container.get(part, {})
            container.pop(key[-1], None)

    def history(self, **_: Any) -> pd.DataFrame:
        """All logged rows (offline logs are never sampled)."""
        return pd.DataFrame(self._history)

    def files(self) -> list[OfflineFile]:
        """Files saved with wandb.save (copied into the run's files/ folder)."""
        folder = self.run_dir / "files"
        return [OfflineFile(p) for p in sorted(folder.iterdir()) if p.is_file()] if folder.is_dir() else []

    @staticmethod
    def find(path: Path | str) -> list[Path]:
        """Offline run directories at or below `path`: folders holding a `*.wandb` log."""
        root = Path(path)
        if not root.is_dir():
            return []
        if any(root.glob("*.wandb")):
            return [root]
        return sorted({log.parent for log in root.rglob("*.wandb")})


def load_offline_runs(path: Path | str) -> LoadReport:
    """Every offline W&B run at or below `path` as RunRecords (source "wandb_offline")."""
    report = LoadReport()
    for run_dir in OfflineRun.find(path):
        try:
            run = OfflineRun(run_dir)
        except Exception as exc:  # noqa: BLE001
            report.problems.append(f"{run_dir}: unreadable offline W&B run ({type(exc).__name__}: {exc})")
            continue
        report.runs.append(wandb_run_to_record(run, "wandb_offline", location=str(run_dir)))
    if not report.runs and not report.problems:
        report.problems.append(f"{path}: no offline W&B runs (no *.wandb file)")
    return report
