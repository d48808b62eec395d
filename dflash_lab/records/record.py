"""The run record: one home for what a training run writes and how each fact in it is computed.

Everything that reads or writes a run directory imports its names from here: the trainer, the run logger, the
probes, the planner's cost fit and the analysis. Nothing here touches a Hydra config.

Run directory (names below are the only spelling of each file):

    metrics.jsonl           one row per optimizer step: STEP_FIELDS
    probes.jsonl            one row per (probe evaluation, length band): PROBE_FIELDS
    tau.jsonl               one row per acceptance-length measurement (trainer.tau_every steps, and the end):
                            TAU_FIELDS
    presentations.parquet   one row per presentation of a training example: PRESENTATION_COLUMNS
    summary.json            final (or current) figures: SUMMARY_FIELDS first, then details
    run_config.json         the run's own config record: the resolved config, the task overrides and Hydra's files
                            of the launch that last trained it (written by the run, under its lock, when a launch
                            starts training; a launch that trains nothing never writes it): what analysis reads
    .hydra/config.yaml      Hydra's record of the latest launch (put back to the run's when a launch trains nothing)
    checkpoints/            step_<N>.pt files and the `last.json` pointer (dflash_lab.records.checkpoint)
    train_rank<r>.log       one text log per rank
    wandb_run_id.txt        the W&B run id a continuation reuses

Step numbering (one rule for every file): a row carries ``step`` = the number of optimizer updates that had been
completed when the work it describes was finished. The metrics row of the s-th update has ``step = s`` (1, 2, ...);
the presentations scored in that update's forward pass (before the update is applied) carry the same ``s``; a
probe evaluation made after s updates carries ``s`` (0 = before training). A checkpoint taken after S updates
therefore covers exactly the rows with ``step <= S`` in every append-only file, and resuming from it keeps those
rows and nothing else (:func:`rows_through`).

Per-step statistics (:class:`StepStats`): named fields, one reduction rule each (sum over ranks, max over ranks,
or rank 0's value), gathered in ONE host sync per step. Token counts come from the single definitions in
``dflash_lab.metrics.throughput`` (real, padded and attention tokens per layout).

Example:
    >>> rows = [{"step": 1}, {"step": 2}, {"step": 3}]
    >>> [r["step"] for r in rows_through(rows, 2)]
    [1, 2]
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from dflash_lab.metrics import gradients, throughput

# ------------------------------------------------------------------------------------------------ file names
METRICS_FILE = "metrics.jsonl"
PROBES_FILE = "probes.jsonl"
TAU_FILE = "tau.jsonl"
PRESENTATIONS_FILE = "presentations.parquet"
SUMMARY_FILE = "summary.json"
RUN_CONFIG_FILE = "run_config.json"
CONFIG_FILE = ".hydra/config.yaml"       # Hydra's, per launch: read only for runs recorded before RUN_CONFIG_FILE
OVERRIDES_FILE = ".hydra/overrides.yaml"
CHECKPOINT_DIR = "checkpoints"
WANDB_ID_FILE = "wandb_run_id.txt"
WANDB_DIR = "wandb"
DATA_SKIPPED_FILE = "data_skipped.jsonl"   # data=jsonl: every skipped line {line, reason, message} (run_records.py)
RUN_FILES = (METRICS_FILE, PROBES_FILE, PRESENTATIONS_FILE, SUMMARY_FILE, TAU_FILE)
"""The files analysis reads (and that are attached to the W&B run at the end)."""
REWRITTEN_FILES = (*RUN_FILES, RUN_CONFIG_FILE, DATA_SKIPPED_FILE)
"""The run files rewritten whole through a temporary copy ``<name>.tmp`` renamed into place (a reader never sees half
a file; a kill between the two leaves the copy, which the next start removes: ``RunDirectory.remove_unfinished_writes``)."""


@dataclass(frozen=True)
class RecordedConfig:
    """The config a run trained with, as its directory records it.

    Attributes:
        config: the resolved config (nested dict; ``{}`` when not recorded or unreadable).
        overrides: the task overrides of the launch that trained it (None: not recorded).
        source: where it was read: ``RUN_CONFIG_FILE``, ``CONFIG_FILE`` (a run recorded before the run kept its own
            record) or ``""`` (neither).
        problem: why nothing could be read (a missing or damaged file), else None.
    """

    config: dict[str, Any]
    overrides: list[str] | None
    source: str
    problem: str | None = None


def read_run_config(run_dir: Path | str) -> RecordedConfig:
    """The run's own config record (``run_config.json``); for runs recorded before it existed, Hydra's per-launch
    ``.hydra/config.yaml`` and ``.hydra/overrides.yaml`` (which a later launch in the directory may have rewritten).
    Never raises: a damaged file becomes ``problem``.

    Example:
        >>> read_run_config("/nonexistent").problem
        'no run_config.json or .hydra/config.yaml'
    """
    run_dir = Path(run_dir)
    own = run_dir / RUN_CONFIG_FILE
    if own.is_file():
        try:
            data = json.loads(own.read_text())
        except (OSError, ValueError) as exc:
            return RecordedConfig({}, None, RUN_CONFIG_FILE, f"could not read {RUN_CONFIG_FILE} ({exc})")
        config = data.get("config") if isinstance(data, dict) else None
        if not isinstance(config, dict):
            return RecordedConfig({}, None, RUN_CONFIG_FILE, f"{RUN_CONFIG_FILE} holds no config object")
        overrides = data.get("overrides")
        return RecordedConfig(config, [str(o) for o in overrides] if isinstance(overrides, list) else None,
                              RUN_CONFIG_FILE)
    hydra_config = run_dir / CONFIG_FILE
    if not hydra_config.is_file():
        return RecordedConfig({}, None, "", f"no {RUN_CONFIG_FILE} or {CONFIG_FILE}")
    import yaml

    try:
        config = yaml.safe_load(hydra_config.read_text())
    except (OSError, yaml.YAMLError) as exc:
        return RecordedConfig({}, None, CONFIG_FILE, f"could not read {CONFIG_FILE} ({type(exc).__name__}: {exc})")
    overrides = None
    try:
        loaded = yaml.safe_load((run_dir / OVERRIDES_FILE).read_text())
        overrides = [str(item) for item in loaded] if isinstance(loaded, list) else None
    except (OSError, yaml.YAMLError):
        pass
    return RecordedConfig(config if isinstance(config, dict) else {}, overrides, CONFIG_FILE,
                          None if isinstance(config, dict) else f"{CONFIG_FILE} holds no mapping")


def rank_log_name(rank: int) -> str:
    """``train_rank<r>.log``: the text log of one rank."""
    return f"train_rank{int(rank)}.log"


# --------------------------------------------------------------------------------------------------- columns
STEP_FIELDS = (
    "step",           # optimizer updates completed (1-based: this row's update)
    "epoch",          # epoch the step's batches came from
    "loss",           # sum(w CE) / sum(w) over all ranks and micro-batches (None when non-finite)
    "acc",            # argmax-correct share of supervised block slots
    "lr",             # learning rate used by this update
    "grad_norm",      # global gradient norm before clipping
    "clipped",        # the update was clipped: grad_norm > trainer.grad_clip > 0 (metrics.gradients.clipped)
    "real_tokens",    # real (non-pad) tokens, all ranks
    "padded_tokens",  # padded tokens, all ranks (packed rows: their used length)
    "attn_tokens",    # attention cost, all ranks: rows x longest^2 padded, sum of squared documents packed
    "block_tokens",   # draft block tokens trained (anchors x block size), all ranks: the draft's work
    "block_slots",    # block tokens run, padding anchor slots of padded rows included (rows x most anchors x bs)
    "pad_eff",        # real / padded
    "batch_size",     # documents, all ranks
    "max_len",        # longest document of the step
    "mean_len",       # mean document length of the step
    "bucket",         # bucket of rank 0's batch by its longest document (bucket_by=random: its random group;
                      # -1: policy without buckets)
    "step_time_s",    # wall time of the step, loading and bookkeeping included
    "compute_time_s", # forward, backward, sync and optimizer time of the step
    "ktok_s",         # real tokens / step time / 1000
    "eta_s",          # remaining steps x EMA(step time)
)
PROBE_FIELDS = ("step", "band", "band_lo", "band_hi", "loss", "acc", "tokens")
TAU_FIELDS = (
    "step",           # optimizer updates done when tau was measured (the last one: the run's end)
    "tau",            # acceptance length over every tau prompt (dflash_lab.metrics.draft_quality)
    "tau_se",         # its prompt-bootstrap standard error (draft_quality.tau_bootstrap_se)
    "tau_prompts",    # the prompts measured
    "tau_band_min",   # the worst probe band's tau
    "tau_band_mean",  # mean of the bands' tau
    "tau_by_band",    # tau per probe band (null: a band without a tau prompt)
)
PRESENTATION_COLUMNS = ("sample_index", "epoch", "step", "length", "band", "acc")
SUMMARY_FIELDS = (
    "sampler", "seed", "steps", "epochs", "ktok_s", "pad_eff", "eta_s", "full_run_eta_s", "final_loss",
    "final_acc", "tau", "tau_baseline", "overhead_frac", "world_size", "status",
    "tau_se",         # prompt-bootstrap standard error of tau (dflash_lab.metrics.draft_quality.tau_bootstrap_se)
    "tau_prompts",    # held-out prompts tau was measured on (model.decode_num_prompts; null: all)
    "target_digest",  # the target's weights (dflash_lab.model.target: weights_digest, hf: checkpoint_digest)
    "data_digest",    # the training data's content (dflash_lab.data.datasets.content_digest)
    "target_seed",    # the tiny target's pretraining seed (seed mod target_seeds: dflash_lab.replicates); hf: null
)
STATUSES = ("running", "finished", "failed", "preempted")


# ------------------------------------------------------------------------------------------------ JSON rows
def json_safe(value: Any) -> Any:
    """A value strict JSON can hold: non-finite floats become null, numpy/torch scalars become Python numbers.

    Example:
        >>> json_safe(float("nan")), json_safe(np.float32(0.5))
        (None, 0.5)
    """
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def valid_step(value: Any) -> bool:
    """True for a usable step number: a non-negative integer (an integral float from JSON counts), nothing else.

    Example:
        >>> [valid_step(v) for v in (3, 3.0, -1, "3", 1e308, True, None)]
        [True, True, False, False, False, False, False]
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    number = float(value)
    return math.isfinite(number) and number >= 0 and number == math.floor(number) and number < 2**53


def read_jsonl(path: Path | str, *, key: str = "step") -> tuple[list[dict[str, Any]], int]:
    """Rows of a run's JSON-lines file and the count of lines skipped as unusable.

    A line is skipped (and counted) when it is not JSON (a line torn by a kill), not an object (``123``), or its
    ``key`` is not a valid step number (``"abc"``, ``1e308``, negative). Missing file: ``([], 0)``. Which lines,
    and why: :func:`read_jsonl_lines`.

    Example:
        >>> import tempfile
        >>> file = Path(tempfile.mkdtemp()) / "m.jsonl"
        >>> _ = file.write_text('{"step": 1}\\n123\\n{"step": "abc"}\\n{"step": 2')
        >>> read_jsonl(file)
        ([{'step': 1}], 3)
    """
    rows, unusable = read_jsonl_lines(path, key=key)
    return rows, len(unusable)


def read_jsonl_lines(path: Path | str, *, key: str = "step") -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """Rows of a run's JSON-lines file and its unusable lines (the rule of :func:`read_jsonl`), each as (line
    number, counted from 1, why), so a refusal can name them. Missing file: ``([], [])``.

    Example:
        >>> import tempfile
        >>> file = Path(tempfile.mkdtemp()) / "m.jsonl"
        >>> _ = file.write_text('{"step": 1}\\n123\\n{"step": "2"}\\n{"step": 4')
        >>> for line, why in read_jsonl_lines(file)[1]:
        ...     print(line, why)
        2 not a JSON object
        3 its step "2" is not a step number (an integer >= 0)
        4 not JSON (e.g. a line torn by a kill)
    """
    path = Path(path)
    if not path.is_file():
        return [], []
    rows: list[dict[str, Any]] = []
    unusable: list[tuple[int, str]] = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                unusable.append((number, "not JSON (e.g. a line torn by a kill)"))
                continue
            if not isinstance(row, dict):
                unusable.append((number, "not a JSON object"))
            elif key not in row:
                unusable.append((number, f"it has no {key}"))
            elif not valid_step(row[key]):
                unusable.append((number, f"its {key} {shown_value(row[key])} is not a step number (an integer >= 0)"))
            else:
                rows.append(row)
    return rows, unusable


def shown_value(value: Any, limit: int = 40) -> str:
    """A value of a JSON row as it reads in the file, cut after ``limit`` characters (for messages).

    Example:
        >>> shown_value("2"), shown_value(list(range(30)))
        ('"2"', '[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1...')
    """
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def is_number(value: Any) -> bool:
    """A JSON number (an int or a float; true and false are not).

    Example:
        >>> is_number(3), is_number(0.5), is_number(True), is_number("3")
        (True, True, False, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool)


NUMBER_OR_NULL: tuple[str, Callable[[Any], bool]] = ("a number or null",
                                                      lambda value: value is None or is_number(value))
"""What every column of the JSON-lines files holds, but those of :data:`COLUMN_TYPES` (a non-finite figure is written
as null: :func:`json_safe`): what it is called in messages, and its test."""
COLUMN_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "clipped": ("true, false or null", lambda value: value is None or isinstance(value, bool)),
    "tau_by_band": ("a list of numbers and nulls",
                    lambda value: isinstance(value, list) and all(v is None or is_number(v) for v in value)),
}


def column_type(name: str) -> str:
    """What column ``name`` of a run's JSON-lines files holds, as the trainer writes it (for messages)."""
    return COLUMN_TYPES.get(name, NUMBER_OR_NULL)[0]


def rows_mistyped(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> dict[int, dict[str, Any]]:
    """The steps whose rows hold, in some of ``columns``, a value of another type than the trainer writes there
    (:func:`column_type`), each with those columns and their values; rows whose values all fit are left out, and a
    column a row lacks is :func:`rows_lacking`'s. Such a row is JSON with a valid step, so it is kept, not
    repaired: the resume check refuses it by name (the summary and the analysis would compute with it).

    Example:
        >>> rows_mistyped([{"step": 1, "loss": 2.0}, {"step": 2, "loss": [2.0]}, {"step": 3, "loss": None},
        ...                {"step": 4, "loss": "nan", "clipped": 1}], ("step", "loss", "clipped"))
        {2: {'loss': [2.0]}, 4: {'loss': 'nan', 'clipped': 1}}
    """
    mistyped: dict[int, dict[str, Any]] = {}
    for row in rows:
        wrong = {name: row[name] for name in columns
                 if name in row and not COLUMN_TYPES.get(name, NUMBER_OR_NULL)[1](row[name])}
        if wrong:
            mistyped.setdefault(int(row["step"]), {}).update(wrong)
    return mistyped


def rows_lacking(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> dict[int, list[str]]:
    """The steps whose rows lack some of ``columns`` (a file's columns: ``STEP_FIELDS``, ``PROBE_FIELDS``,
    ``TAU_FIELDS``), each with the columns missing, in column order; rows that hold every column are left out.
    Such a row is JSON with a valid step, so it is kept, not repaired: the resume check refuses it by name.

    Example:
        >>> rows_lacking([{"step": 1, "loss": 2.0}, {"step": 2}, {"step": 3, "loss": None}], ("step", "loss"))
        {2: ['loss']}
    """
    lacking: dict[int, list[str]] = {}
    for row in rows:
        missing = [name for name in columns if name not in row]
        if missing:
            step = int(row["step"])
            lacking[step] = [name for name in columns if name in missing or name in lacking.get(step, ())]
    return lacking


def rows_through(rows: Iterable[Mapping[str, Any]], last_step: int | None) -> list[Mapping[str, Any]]:
    """The one resume rule: keep rows with ``step <= last_step``; ``None`` (a fresh start) keeps nothing."""
    if last_step is None:
        return []
    return [row for row in rows if row["step"] <= last_step]


# ------------------------------------------------------------------------------------------------ step stats
_SUM, _MAX, _FIRST = "sum", "max", "first"


@dataclass(frozen=True)
class StepStats:
    """Everything one optimizer step reports, reduced over ranks (each field names its rule).

    Built by :func:`gather_step_stats` from every rank's local values in one host sync.
    """

    ce_sum: float          # sum: weighted cross-entropy sum
    weight_sum: float      # sum: slot weights (the loss normaliser)
    correct: float         # sum: argmax-correct supervised slots
    count: float           # sum: supervised slots
    real_tokens: float     # sum
    padded_tokens: float   # sum
    attn_tokens: float     # sum
    block_tokens: float    # sum: anchors x block size of the training blocks
    block_slots: float     # sum: block tokens run (padding anchor slots included)
    documents: float       # sum
    max_len: float         # max
    grad_norm: float       # first: the pre-clip global norm is the same on every rank after DDP's all-reduce
    stop_requested: float  # max: any rank asked for a checkpoint (preemption signal)

    @property
    def loss(self) -> float:
        return self.ce_sum / self.weight_sum if self.weight_sum > 0 else math.nan

    @property
    def acc(self) -> float:
        return self.correct / self.count if self.count > 0 else math.nan

    @property
    def finite(self) -> bool:
        """The update may be applied: finite loss and gradient norm, and something was supervised."""
        return math.isfinite(self.ce_sum) and math.isfinite(self.grad_norm) and self.weight_sum > 0


STEP_STAT_RULES = {
    f.name: (_MAX if f.name in ("max_len", "stop_requested") else _FIRST if f.name == "grad_norm" else _SUM)
    for f in fields(StepStats)
}


def local_batch_stats(doc_lengths: Sequence[np.ndarray], *, packed: bool) -> dict[str, float]:
    """Host-side token statistics of one rank's micro-batches (effective document lengths per micro-batch).

    Example:
        >>> stats = local_batch_stats([np.array([3, 5]), np.array([4])], packed=False)
        >>> stats["real_tokens"], stats["padded_tokens"], stats["attn_tokens"], stats["max_len"]
        (12.0, 14.0, 66.0, 5.0)
    """
    real = padded = attention = 0
    for lengths in doc_lengths:
        r, p, a = throughput.token_counts(lengths, packed=packed)
        real, padded, attention = real + r, padded + p, attention + a
    every = np.concatenate([np.asarray(x, dtype=np.int64) for x in doc_lengths]) if doc_lengths else np.zeros(0)
    return {
        "real_tokens": float(real),
        "padded_tokens": float(padded),
        "attn_tokens": float(attention),
        "documents": float(every.size),
        "max_len": float(every.max()) if every.size else 0.0,
    }


def reduce_step_stats(per_rank: np.ndarray) -> StepStats:
    """Apply each field's rule to a [world_size, n_fields] array (field order = StepStats fields).

    Example:
        >>> names = [f.name for f in fields(StepStats)]
        >>> a = np.array([[1.0] * len(names), [2.0] * len(names)])
        >>> s = reduce_step_stats(a)
        >>> s.real_tokens, s.max_len, s.grad_norm
        (3.0, 2.0, 1.0)
    """
    values = {}
    for column, (name, rule) in enumerate(STEP_STAT_RULES.items()):
        series = per_rank[:, column]
        values[name] = float(series.sum() if rule == _SUM else series.max() if rule == _MAX else series[0])
    return StepStats(**values)


def gather_step_stats(local: Mapping[str, Any], all_gather_rows, device) -> StepStats:
    """One host sync per step: every rank's named statistics stacked, gathered and reduced.

    Args:
        local: this rank's value for every StepStats field; device tensors (no sync yet) or host numbers.
        all_gather_rows: ``dist.all_gather_rows`` (a [1, n] stack for one process).
        device: where to build the vector (the device of the model's outputs).

    Returns:
        The reduced StepStats (plain floats).
    """
    import torch

    missing = set(STEP_STAT_RULES) - set(local)
    if missing:
        raise KeyError(f"step statistics lack {sorted(missing)}")
    parts = [torch.as_tensor(local[name], dtype=torch.float64, device=device).reshape(()) for name in STEP_STAT_RULES]
    gathered = all_gather_rows(torch.stack(parts))
    return reduce_step_stats(gathered.cpu().numpy())  # <- the CPU-GPU sync point of the step


def step_row(
    *, step: int, epoch: int, stats: StepStats, lr: float, grad_clip: float, bucket: int, step_time_s: float,
    compute_time_s: float, eta_s: float,
) -> dict[str, Any]:
    """The metrics.jsonl row of one step, exactly STEP_FIELDS in order.

    Example:
        >>> names = [f.name for f in fields(StepStats)]
        >>> s = StepStats(**{n: 1.0 for n in names})
        >>> row = step_row(step=1, epoch=0, stats=s, lr=1e-3, grad_clip=0.5, bucket=2, step_time_s=0.5,
        ...                compute_time_s=0.4, eta_s=10.0)
        >>> tuple(row) == STEP_FIELDS, row["ktok_s"], row["clipped"]
        (True, 0.002, True)
    """
    row = {
        "step": int(step),
        "epoch": int(epoch),
        "loss": stats.loss,
        "acc": stats.acc,
        "lr": float(lr),
        "grad_norm": stats.grad_norm,
        "clipped": gradients.clipped(stats.grad_norm, grad_clip),
        "real_tokens": int(stats.real_tokens),
        "padded_tokens": int(stats.padded_tokens),
        "attn_tokens": int(stats.attn_tokens),
        "block_tokens": int(stats.block_tokens),
        "block_slots": int(stats.block_slots),
        "pad_eff": throughput.padding_efficiency(stats.real_tokens, stats.padded_tokens),
        "batch_size": int(stats.documents),
        "max_len": int(stats.max_len),
        "mean_len": stats.real_tokens / max(stats.documents, 1.0),
        "bucket": int(bucket),
        "step_time_s": float(step_time_s),
        "compute_time_s": float(compute_time_s),
        "ktok_s": throughput.ktok_per_s(stats.real_tokens, step_time_s),
        "eta_s": float(eta_s),
    }
    return {name: json_safe(row[name]) for name in STEP_FIELDS}


# ---------------------------------------------------------------------------------------------------- summary
@dataclass
class RunTotals:
    """Cumulative bookkeeping of a run across all its segments (saved in every checkpoint, restored on resume).

    Times are the parts of ``metrics.throughput``'s wall-time split; ``TimeLedger`` measures them. Each part is
    timed on its own, ``other`` is what is left of the wall time, so the parts add up to it.
    """

    wall_time_s: float = 0.0        # the run's wall time up to the last save (every segment)
    setup_time_s: float = 0.0       # building model, data, plan; resuming
    compute_time_s: float = 0.0     # forward/backward/optimizer time of completed steps
    data_wait_time_s: float = 0.0   # waiting for the next micro-batches (sampler, dataset, collate)
    eval_time_s: float = 0.0        # scheduled evaluation: probes and tau
    checkpoint_time_s: float = 0.0  # writing checkpoints (and gathering what they hold)
    probe_time_s: float = 0.0       # probe evaluations (part of eval_time_s)
    tau_time_s: float = 0.0         # acceptance-length measurements (part of eval_time_s)
    skipped_steps: int = 0          # updates skipped (non-finite or nothing supervised)
    segments: int = 0               # how many times the run was started or continued

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> RunTotals:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (state or {}).items() if k in known})


TIME_PARTS = ("setup", "compute", "data_wait", "eval", "checkpoint")   # + other, the remainder


class TimeLedger:
    """The wall-time split of one run (``metrics.throughput``: setup, compute, data wait, scheduled evaluation,
    checkpointing, other) over all its segments: ``part(name)`` times a part into ``RunTotals``; ``wall()`` is the
    totals' wall at the last save plus this segment's time so far; ``split()`` gives every part and ``other``.

    Example:
        >>> ledger = TimeLedger(RunTotals(), start=0.0, clock=iter([1.0, 3.0, 10.0, 10.0]).__next__)
        >>> with ledger.part("compute"):
        ...     pass
        >>> split = ledger.split()
        >>> split["wall_time_s"], split["compute_time_s"], split["other_time_s"]
        (10.0, 2.0, 8.0)
    """

    def __init__(self, totals: RunTotals, start: float, clock: Callable[[], float] = time.perf_counter):
        self.totals, self.clock = totals, clock
        self.segment_start, self.wall_before = start, totals.wall_time_s

    def add(self, name: str, seconds: float) -> None:
        if name not in TIME_PARTS:
            raise KeyError(f"unknown time part {name!r}; parts: {TIME_PARTS}")
        attribute = f"{name}_time_s"
        setattr(self.totals, attribute, getattr(self.totals, attribute) + float(seconds))

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.add(name, self.clock() - start)

    @contextmanager
    def evaluation(self, kind: str) -> Iterator[None]:
        """Time scheduled evaluation of ``kind`` (``probe`` or ``tau``): into the ``eval`` part and
        ``RunTotals.<kind>_time_s``, one measurement for both."""
        start = self.clock()
        try:
            yield
        finally:
            elapsed = self.clock() - start
            self.add("eval", elapsed)
            attribute = f"{kind}_time_s"
            setattr(self.totals, attribute, getattr(self.totals, attribute) + elapsed)

    def wall(self) -> float:
        return self.wall_before + (self.clock() - self.segment_start)

    def save(self) -> None:
        """Bring the totals' wall time up to now (before they go into a checkpoint or the summary)."""
        self.totals.wall_time_s = self.wall()

    def split(self) -> dict[str, float]:
        """``time_split`` of the totals brought up to now."""
        self.save()
        return time_split(self.totals)


def time_split(totals: RunTotals) -> dict[str, float]:
    """``wall_time_s``, one ``<part>_time_s`` per part and ``other_time_s`` (the remainder; never negative).

    Example:
        >>> time_split(RunTotals(wall_time_s=10.0, compute_time_s=6.0, eval_time_s=1.0))["other_time_s"]
        3.0
    """
    parts = {f"{name}_time_s": float(getattr(totals, f"{name}_time_s")) for name in TIME_PARTS}
    wall = float(totals.wall_time_s)
    return {"wall_time_s": wall, **parts, "other_time_s": max(wall - sum(parts.values()), 0.0)}


@dataclass(frozen=True)
class PlanFacts:
    """What the trainer knows exactly from the policy's plan (never guessed from logs).

    Attributes:
        steps_per_epoch: optimizer steps of each configured epoch.
        batches_per_epoch: batches one rank consumes in each epoch (steps x grad_accum, the last step may be short).
        end_step: the step this run stops at (all epochs, or trainer.max_steps).
        dropped_overlong, truncated: samples the overlong rule removed / cut (once, for the dataset).
        repeated_remainder, dropped_remainder: samples repeated / dropped by the DDP remainder rule, summed over
            the configured epochs.
    """

    steps_per_epoch: tuple[int, ...]
    batches_per_epoch: tuple[int, ...]
    end_step: int
    dropped_overlong: int = 0
    truncated: int = 0
    repeated_remainder: int = 0
    dropped_remainder: int = 0

    @property
    def total_steps(self) -> int:
        return int(sum(self.steps_per_epoch))


def last_finite(rows: Sequence[Mapping[str, Any]], key: str) -> float:
    """The last finite value of ``key`` in rows (NaN when there is none): "final loss" of a run.

    Example:
        >>> last_finite([{"loss": 2.0}, {"loss": None}], "loss")
        2.0
    """
    for row in reversed(rows):
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return math.nan


def build_summary(
    history: Sequence[Mapping[str, Any]], plan: PlanFacts, totals: RunTotals, *, identity: Mapping[str, Any],
    status: str, steps: int | None = None, steady_warmup_steps: int = 10, extra: Mapping[str, Any] | None = None,
    times: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """summary.json from the whole metrics history (every segment), the plan facts and the run totals.

    Args:
        history: metrics.jsonl rows of the whole run, step order.
        plan: exact plan facts (steps per epoch, end step, sample counts).
        totals: cumulative times and counts over all segments.
        identity: sampler, seed, epochs, world_size, target_digest, data_digest (``Components.identity``).
        status: one of STATUSES.
        steps: optimizer steps completed (default: the last row's; ranks > 0 keep no history but know it).
        steady_warmup_steps: steps left out of the steady-state Ktok/s and step time.
        extra: more fields (tau, tau_baseline, error, data_skipped ...).
        times: the wall-time split (``TimeLedger.split``; default: ``time_split(totals)``).

    Returns:
        SUMMARY_FIELDS first, then the details.
    """
    if status not in STATUSES:
        raise ValueError(f"summary status {status!r} is not one of {STATUSES}")
    if steps is None:
        steps = int(history[-1]["step"]) if history else 0
    step_times = np.asarray([r["step_time_s"] for r in history], dtype=np.float64)
    steady = step_times[steady_warmup_steps:] if step_times.size > steady_warmup_steps else step_times
    step_time = float(np.median(steady)) if steady.size else math.nan
    mean_steps_per_epoch = plan.total_steps / max(len(plan.steps_per_epoch), 1)
    times = dict(times or time_split(totals))
    summary = {
        **identity,
        "steps": steps,
        "ktok_s": throughput.steady_state_ktok_s([r["ktok_s"] for r in history], steady_warmup_steps),
        "pad_eff": throughput.padding_efficiency([r["real_tokens"] for r in history],
                                                 [r["padded_tokens"] for r in history]),
        "eta_s": throughput.eta_seconds(plan.end_step - steps, step_time),
        "full_run_eta_s": throughput.full_run_eta_seconds(len(plan.steps_per_epoch), mean_steps_per_epoch, step_time),
        "final_loss": last_finite(history, "loss"),
        "final_acc": last_finite(history, "acc"),
        "tau": math.nan,
        "tau_baseline": math.nan,
        "tau_se": math.nan,
        "tau_prompts": 0,
        # no step trained (trainer.max_steps=0): the loop has no overhead to speak of, not 100%
        "overhead_frac": throughput.overhead_fraction(times["compute_time_s"],
                                                      times["data_wait_time_s"] + times["other_time_s"])
        if history else math.nan,
        "status": status,
        "total_steps": plan.total_steps,
        "end_step": plan.end_step,
        "steps_per_epoch": list(plan.steps_per_epoch),
        "step_time_s": step_time,
        "tokens_seen": int(sum(r["real_tokens"] for r in history)),
        **times,
        "eval_frac": throughput.evaluation_fraction(times["eval_time_s"], times["wall_time_s"]),
        "probe_time_s": totals.probe_time_s,
        "tau_time_s": totals.tau_time_s,
        "skipped_steps": totals.skipped_steps,
        "segments": totals.segments,
        "samples": {"dropped_overlong": plan.dropped_overlong, "truncated": plan.truncated,
                    "repeated_remainder": plan.repeated_remainder, "dropped_remainder": plan.dropped_remainder},
    }
    summary.update(extra or {})
    ordered = {name: summary.get(name) for name in SUMMARY_FIELDS}
    ordered.update({k: v for k, v in summary.items() if k not in ordered})
    return ordered
