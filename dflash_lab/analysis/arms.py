"""Arms: the settings a sweep compares, the baseline arm, and the strata inside which arms are paired.

Swept keys. A run's setting is its sampler plus every key the sweep varied, read from the run's recorded Hydra
overrides (the run's `run_config.json`, else `.hydra/overrides.yaml` of a run recorded before it; a W&B run's config
key `overrides` when the trainer logged it). The seed is not a
key: seeds are the replicates an arm aggregates. `hydra.*` overrides are launch details, not settings. A key whose
value is the same in every run (e.g. `data.num_samples=160` given to the whole sweep) is not swept. A run's value of
a key is its resolved config value (so an arm that did not override `sampler.run_length` shows the default); for a
config group (`sampler=bucketed`) it is the option the run chose, else the group's `name`. When no run recorded
overrides (W&B runs of an older trainer), the
swept keys are the config keys whose values differ between runs (the same rule expands an override that selects a
`_global_` config file, such as a sweep's `+arm=...`, into the keys that file sets), leaving out keys of a config
group whose `name`
differs (a `sampler.*` key only counts among runs of the same sampler) and bookkeeping keys (run_dir, experiment,
logger, analysis, overrides, the W&B config's `resolved` facts).

Arm = the tuple of the run's swept values; its label reads `bucketed run_length=8 band_skills=aligned`.

Topology. Where the ranks ran (summary.json `topology`: nodes x ranks per node, `2x1`, `1x2`) is set by the launcher
(`hydra.launcher.*`, not a setting), yet runs on two layouts are two runs, not one run given twice: when the runs
record more than one topology it is a swept key (`topology`, last), so `bucketed topology=2x1` and `bucketed
topology=1x2` are separate arms (a stratum key unless the baseline selector names it) and never duplicates of one
seed. A run recorded before topologies were has none (its arm label lacks the key); a topology that only restates
another swept key adds nothing.

Baseline selector (`--baseline` / `analysis.baseline`): `first` (a grid sweep's first point: every swept value of
job 0, the run folder numbered `0_`), `full_random` (= `sampler=full_random`) or comma-separated `key=value` terms, e.g. `sampler=full_random,sampler.tokens_per_step=equal` (values as in the swept columns; a
list value keeps its commas inside brackets). The selector's keys, and the swept keys below them (`sampler.*` for
`sampler`), are the compared keys. Every other swept key is a stratum key: an arm is paired only with the baseline
arm of its own stratum, e.g. bucket_sequential on `data.band_skills=independent` with full_random on independent
data. Inside a stratum the baseline is the one arm matching every selector term; when several match (full_random
and full_random with an extra sampler option), the one that overrides the fewest compared keys wins, and a tie is
an error asking for a more specific selector. A stratum with no matching arm has no paired rows (a note says so).

Duplicates. Two runs of one arm with one seed are two separate runs (the same sweep launched twice, a rerun in
another folder, a run read both from its directory and from W&B), not two seeds: `drop_duplicate_runs` refuses them
by default, naming both runs, or keeps one (`--duplicates=latest|first`) and notes which.

Pooled launches. Runs of one arm from several launches (sweep folders of local runs, W&B groups) are pooled as seeds
of that arm (seeds added by a second launch are legitimate replicates), never silently: `pooled_launch_notes` names
each launch and its seeds.

Digests. Every run records what it trained against: `target_digest` (the target's weights) and `data_digest` (the
training data's content) in summary.json (W&B: `final/target_digest`, `final/data_digest`). A batching policy
changes neither, so runs that agree on every swept key outside the sampler (`sampler`, `sampler.*`) must agree on
both digests: they are the replicates an arm averages and the pairs a paired test matches by seed. A sweep that nests
its seeds within target-pretraining seeds (`target_seeds`, dflash_lab/replicates.py) trains one target per
`target_seed` (summary.json): target digests are checked among runs of one target seed, and runs of one seed share
it, so pairs stay pairs. Runs trained
against another target (a tiny target pretrained on another machine) or other data are not, and
`check_digests` refuses them by default, listing which runs hold which digest, or compares them anyway
(`--mixed-digests=allow`) and says so in their notes. A run without the fields (recorded before they existed, or
without a summary) is compared with a note that its digest is unknown. A swept `data.*` or `model.*` key changes
the digests legitimately: runs that differ in it are never checked against each other.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from dflash_lab.analysis.schema import RunRecord
from dflash_lab.records.record import CONFIG_FILE, RUN_CONFIG_FILE, read_run_config

SEED_KEY = "seed"
NOT_SETTINGS = ("hydra", "run_dir", "experiment", "logger", "analysis", "overrides", "resume", "resolved")
BUCKET_KEYS = ("sampler.boundaries", "sampler.num_buckets")
UNSET = "(unset)"
TOPOLOGY_KEY = "topology"   # summary.json's topology (training.dist.DistEnv.topology): part of a run's identity


# ------------------------------------------------------------------------------------------------- overrides
def read_overrides(run_dir: Path | str) -> list[str] | None:
    """The task overrides of the launch that trained a run: its `run_config.json`, else (a run recorded before it)
    `.hydra/overrides.yaml`; None when neither records them.

    Example:
        >>> read_overrides("/nonexistent") is None
        True
    """
    return read_run_config(run_dir).overrides


def recorded_overrides(record: RunRecord) -> list[str] | None:
    """record.overrides, else a local run's recorded overrides (`read_overrides`), else the config key
    `overrides`, else None."""
    if record.overrides is not None:
        return record.overrides
    if record.source == "local":
        found = read_overrides(record.location)
        if found is not None:
            return found
    logged = record.config.get("overrides")
    return [str(item) for item in logged] if isinstance(logged, (list, tuple)) else None


def override_key(text: str) -> tuple[str, str]:
    """("key", "value text") of one override; `+`, `++` and `~` prefixes removed.

    Example:
        >>> override_key("++sampler.boundaries=[0,96,1024]")
        ('sampler.boundaries', '[0,96,1024]')
    """
    key, _, value = text.lstrip("+~").partition("=")
    return key.strip(), value.strip()


def _is_setting(key: str) -> bool:
    return key != SEED_KEY and key.split(".")[0] not in NOT_SETTINGS


# ------------------------------------------------------------------------------------------------------ values
def format_value(value: Any) -> str:
    """One readable, comparable text per value: lists as `[0, 96, 1024]`, None as `null`, bools lower case.

    Example:
        >>> format_value([0, 96, 1024]), format_value(None), format_value(True), format_value(8.0)
        ('[0, 96, 1024]', 'null', 'true', '8')
    """
    if isinstance(value, dict) and "name" in value:
        return format_value(value["name"])
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def parse_value(text: str) -> str:
    """An override or selector value text in `format_value` form (YAML-parsed first: `[0,96]` == `[0, 96]`).

    Example:
        >>> parse_value("[0,96,1024]"), parse_value("aligned"), parse_value("False")
        ('[0, 96, 1024]', 'aligned', 'false')
    """
    try:
        return format_value(yaml.safe_load(text))
    except yaml.YAMLError:
        return text


def parse_list(text: str) -> list | None:
    """A list written as text (``"[0, 96, 1024]"``, how a W&B config holds the resolved boundaries), else None.

    Example:
        >>> parse_list("[0, 96, 1024]"), parse_list("None")
        ([0, 96, 1024], None)
    """
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return value if isinstance(value, list) else None


def config_value(config: dict, key: str) -> Any:
    """The value at a dotted key of a nested config; KeyError when absent.

    Example:
        >>> config_value({"sampler": {"name": "bucketed", "run_length": 8}}, "sampler.run_length")
        8
    """
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def config_values(records: list[RunRecord], key: str) -> set[str]:
    """The values (`format_value` text) the runs hold at a dotted config key; empty when no run has it.

    Example:
        >>> config_values([RunRecord("r", "local", "/r", config={"data": {"band_skills": "aligned"}})],
        ...               "data.band_skills")
        {'aligned'}
    """
    values = set()
    for record in records:
        try:
            values.add(format_value(config_value(record.config, key)))
        except KeyError:
            if key == "sampler" and record.sampler:
                values.add(record.sampler)
    return values


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> leaf value (lists are leaves).

    Example:
        >>> flatten({"a": {"b": 1, "c": [1, 2]}, "d": None})
        {'a.b': 1, 'a.c': [1, 2], 'd': None}
    """
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


# ------------------------------------------------------------------------------------------------- swept keys
@dataclass
class Sweep:
    """The swept keys of a set of runs and each run's values.

    Attributes:
        keys: swept keys: "sampler", its options (sampler.*), then the others, each in order of first appearance.
        values: index run_id, one column per key (format_value text; UNSET when a run has no such key).
        overridden: run_id -> the swept keys its overrides set explicitly.
        source: "overrides" or "config" (how the keys were found).
    """

    keys: list[str]
    values: pd.DataFrame
    overridden: dict[str, set[str]] = field(default_factory=dict)
    source: str = "overrides"


def _config_keys(records: list[RunRecord]) -> list[str]:
    """Keys whose config values differ between runs (the fallback when no run recorded its overrides)."""
    flat = {r.run_id: {k: format_value(v) for k, v in flatten(r.config).items() if _is_setting(k)} for r in records}
    frame = pd.DataFrame.from_dict(flat, orient="index")
    keys = [k for k in frame.columns if frame[k].fillna(UNSET).nunique() > 1]
    # a key of a group whose name differs (sampler.boundaries of bucketed vs full_random) is part of that group's
    # choice; it counts only if it differs between runs of the same group name
    chosen = []
    for key in keys:
        group = key.rsplit(".", 1)[0] + ".name" if "." in key else None
        if group in frame.columns and key != group:
            if not (frame.groupby(frame[group].fillna(UNSET))[key].nunique(dropna=False) > 1).any():
                continue
        chosen.append(key.removesuffix(".name") if key.endswith(".name") else key)
    return chosen


def _has_key(config: dict, key: str) -> bool:
    try:
        config_value(config, key)
    except KeyError:
        return False
    return True


def _value(record: RunRecord, key: str, override_text: str | None) -> str:
    try:
        value = config_value(record.config, key)
    except KeyError:
        value = record.sampler if key == "sampler" and record.sampler else None
        if value is None:
            return parse_value(override_text) if override_text is not None else UNSET
    if isinstance(value, dict) and override_text is not None:
        return parse_value(override_text)  # a config group: the option chosen (two options may share a name)
    return format_value(value)


def sweep_of(records: list[RunRecord]) -> Sweep:
    """Swept keys and per-run values of a set of runs (rules in the module docstring).

    Example:
        >>> runs = [RunRecord(f"r{i}", "wandb", "x", config={"sampler": {"name": s}, "seed": i},
        ...                   overrides=[f"sampler={s}", f"seed={i}", "data.num_samples=160"])
        ...         for i, s in enumerate(["bucketed", "full_random"])]
        >>> sweep = sweep_of(runs)
        >>> sweep.keys, sweep.values["sampler"].tolist()
        (['sampler'], ['bucketed', 'full_random'])
    """
    overrides = {r.run_id: recorded_overrides(r) for r in records}
    parsed = {run_id: dict(override_key(o) for o in items) if items is not None else None
              for run_id, items in overrides.items()}
    source, candidates = _candidate_keys(records, parsed)
    rows = {}
    for record in records:
        given = parsed[record.run_id] or {}
        rows[record.run_id] = {key: _value(record, key, given.get(key)) for key in ["sampler", *candidates]}
    values = pd.DataFrame.from_dict(rows, orient="index", columns=list(dict.fromkeys(["sampler", *candidates])))
    values = values.fillna(UNSET)
    seeds = pd.Series({r.run_id: format_value(r.config.get(SEED_KEY)) for r in records})
    varied = _varied_keys(values, seeds)
    # the sampler's own options read next to it: "bucketed run_length=8 band_skills=aligned"
    keys = ["sampler"] + sorted(varied, key=lambda k: not k.startswith("sampler."))
    values = values[keys]
    topology = pd.Series({r.run_id: str(r.summary.get(TOPOLOGY_KEY) or UNSET) for r in records}).reindex(values.index)
    if topology[topology != UNSET].nunique() > 1 and not any(_same_partition(topology, values[k]) for k in keys):
        values = values.assign(**{TOPOLOGY_KEY: topology})
        keys.append(TOPOLOGY_KEY)
    overridden = {run_id: {k for k in (items or {}) if k in keys} for run_id, items in parsed.items()}
    return Sweep(keys=keys, values=values, overridden=overridden, source=source)


def _candidate_keys(records: list[RunRecord], parsed: dict[str, dict | None]) -> tuple[str, list[str]]:
    """Where the candidate keys come from ("overrides", "overrides+config" or "config") and the keys."""
    if not any(items is not None for items in parsed.values()):
        return "config", _config_keys(records)
    candidates = list(dict.fromkeys(k for items in parsed.values() if items for k in items if _is_setting(k)))
    # an override that selects a `_global_` config file (e.g. `+arm=aligned_bucketed` of a sweep's arm group)
    # names no config key: it stands for the keys that file sets, found as the config differences
    opaque = [k for k in candidates if k != "sampler" and not any(_has_key(r.config, k) for r in records)]
    if not opaque:
        return "overrides", candidates
    candidates = [k for k in candidates if k not in opaque]
    return "overrides+config", candidates + [k for k in _config_keys(records) if k not in candidates]


def _varied_keys(values: pd.DataFrame, seeds: pd.Series) -> list[str]:
    """The keys (sampler aside) whose values differ between runs, less those that only restate an earlier one
    (model.pretrain_data.band_skills follows data.band_skills: the same partition of the runs adds no setting) and
    those that follow the seed (``model.draft_init_seed: ${seed}``, ``model.pretrain_seed`` = seed mod
    target_seeds: one value per seed, as a resolved config records them), when seeds repeat across runs."""
    seeds = seeds.reindex(values.index)
    seeds_repeat = seeds.duplicated().any()
    varied: list[str] = []
    for key in (k for k in values.columns if k != "sampler" and values[k].nunique() > 1):
        if seeds_repeat and (values[key].groupby(seeds).nunique() <= 1).all():
            continue   # a function of the seed: the pairs' own key, not a setting
        if not any(_same_partition(values[key], values[earlier]) for earlier in varied):
            varied.append(key)
    return varied


def _same_partition(a: pd.Series, b: pd.Series) -> bool:
    """True when two columns group the runs identically (each value of one maps to one value of the other)."""
    pairs = pd.DataFrame({"a": a, "b": b}).drop_duplicates()
    return pairs["a"].is_unique and pairs["b"].is_unique


def bucket_columns(records: list[RunRecord], sweep: Sweep) -> pd.DataFrame:
    """`boundaries` (readable list) and `K` per run when the sweep varies bucket boundaries or their number.

    Boundaries are the resolved ones (summary.json `boundaries`, else a W&B run config's `resolved.boundaries`,
    both holding fitted ones, else the config list); K = number of buckets (len - 1, else sampler.num_buckets).
    Empty frame when not swept.

    Example:
        >>> run = RunRecord("r", "local", "/r", config={"sampler": {"name": "bucketed", "boundaries": [0, 96, 1024]}})
        >>> sweep = Sweep(["sampler", "sampler.boundaries"], pd.DataFrame({"sampler": ["bucketed"],
        ...               "sampler.boundaries": ["[0, 96, 1024]"]}, index=["r"]))
        >>> bucket_columns([run], sweep).to_dict("records")
        [{'boundaries': '[0, 96, 1024]', 'K': 2}]
    """
    if not any(key in sweep.keys for key in BUCKET_KEYS):
        return pd.DataFrame(index=sweep.values.index)
    rows = {}
    for record in records:
        boundaries = record.summary.get("boundaries")
        if not isinstance(boundaries, (list, tuple)):  # a W&B run: the trainer's resolved list in the run config
            resolved = record.config.get("resolved")
            text = resolved.get("boundaries") if isinstance(resolved, dict) else None
            boundaries = parse_list(text) if isinstance(text, str) else None
        if not isinstance(boundaries, (list, tuple)):
            try:
                boundaries = config_value(record.config, "sampler.boundaries")
            except KeyError:
                boundaries = None
        if isinstance(boundaries, (list, tuple)):
            count = len(boundaries) - 1
        else:
            try:
                count = config_value(record.config, "sampler.num_buckets")
            except KeyError:
                count = None
        rows[record.run_id] = {"boundaries": format_value(boundaries) if boundaries is not None else "",
                               "K": int(count) if isinstance(count, (int, float)) else pd.NA}
    return pd.DataFrame.from_dict(rows, orient="index", columns=["boundaries", "K"]).reindex(sweep.values.index)


def arm_label(values: pd.Series) -> str:
    """`sampler key=value ...`, keys shortened to their last part unless ambiguous; keys the arm lacks left out.

    Example:
        >>> arm_label(pd.Series({"sampler": "bucketed", "sampler.run_length": "8", "data.band_skills": "aligned"}))
        'bucketed run_length=8 band_skills=aligned'
    """
    others = [k for k in values.index if k != "sampler" and values[k] != UNSET]  # a key this arm's config lacks
    short = {k: k.rsplit(".", 1)[-1] for k in others}
    counts = pd.Series(list(short.values())).value_counts()
    parts = [str(values.get("sampler", UNSET))]
    parts += [f"{short[k] if counts[short[k]] == 1 else k}={values[k]}" for k in others]
    return " ".join(parts)


# --------------------------------------------------------------------------------------------- baseline, strata
_TERM = re.compile(r"([^,=\[\]]+)=((?:\[[^\]]*\]|[^,])*)")


def parse_selector(text: str) -> dict[str, str]:
    """Selector terms key -> value (format_value text); a bare name selects a sampler.

    Example:
        >>> parse_selector("full_random")
        {'sampler': 'full_random'}
        >>> parse_selector("sampler=bucketed,sampler.boundaries=[0,96,1024]")
        {'sampler': 'bucketed', 'sampler.boundaries': '[0, 96, 1024]'}
    """
    text = text.strip()
    if "=" not in text:
        return {"sampler": text}
    terms = {m.group(1).strip(): parse_value(m.group(2).strip()) for m in _TERM.finditer(text)}
    rebuilt = ",".join(f"{m.group(0)}" for m in _TERM.finditer(text))
    if not terms or rebuilt.replace(" ", "") != text.replace(" ", ""):
        raise ValueError(f"--baseline / analysis.baseline={text!r}: write a sampler name (full_random) or "
                         "key=value terms separated by commas (sampler=full_random,data.band_skills=aligned)")
    return terms


def compared_keys(selector: dict[str, str], keys: list[str]) -> list[str]:
    """The selector's keys plus the swept keys below them (`sampler.run_length` below `sampler`).

    Example:
        >>> compared_keys({"sampler": "full_random"}, ["sampler", "sampler.run_length", "data.band_skills"])
        ['sampler', 'sampler.run_length']
    """
    return [k for k in keys if any(k == s or k.startswith(s + ".") for s in selector)]


@dataclass
class Pairing:
    """Arms with their stratum and baseline arm (None: no baseline in the stratum)."""

    arms: pd.DataFrame  # index arm label: the swept values, "stratum", "baseline"
    notes: list[str]


FIRST_POINT = "first"   # the baseline selector of a grid sweep's first point


def first_point_selector(sweep: Sweep, arm_of_run: pd.Series) -> str:
    """The selector of a grid sweep's first point: every swept value of the run with the lowest job number (its
    folder's ``<n>_`` prefix, Hydra's job number; else the first run given).

    Example:
        >>> values = pd.DataFrame({"sampler": ["bucketed"] * 2, "sampler.boundaries": ["[0, 96, 1024]", "[0, 1024]"]},
        ...                       index=["1_bucketed_b0-96-1024_s0", "0_bucketed_b0-1024_s0"])
        >>> first_point_selector(Sweep(["sampler", "sampler.boundaries"], values), values.apply(arm_label, axis=1))
        'sampler=bucketed,sampler.boundaries=[0, 1024]'
    """
    def job_number(run_id: Any) -> float:
        match = re.match(r"(\d+)_", str(run_id))
        return int(match.group(1)) if match else math.inf

    first = min(range(len(arm_of_run)), key=lambda i: (job_number(arm_of_run.index[i]), i))
    row = sweep.values.loc[arm_of_run.index[first]]
    return ",".join(f"{key}={row[key]}" for key in sweep.keys if row[key] != UNSET)


def pair_arms(sweep: Sweep, arm_of_run: pd.Series, selector_text: str) -> Pairing:
    """Stratum and baseline arm of every arm (rules in the module docstring).

    Args:
        sweep: `sweep_of` the runs.
        arm_of_run: run_id -> arm label.
        selector_text: the baseline selector.

    Raises:
        ValueError: a selector key that is not swept, or several equally plain matching arms in a stratum.

    Example:
        >>> values = pd.DataFrame({"sampler": ["bucketed", "full_random", "bucketed", "full_random"],
        ...                        "data.band_skills": ["aligned", "aligned", "independent", "independent"]},
        ...                       index=["a", "b", "c", "d"])
        >>> sweep = Sweep(["sampler", "data.band_skills"], values)
        >>> labels = values.apply(arm_label, axis=1)
        >>> pair_arms(sweep, labels, "full_random").arms["baseline"].tolist()
        ['full_random band_skills=aligned', 'full_random band_skills=aligned', \
'full_random band_skills=independent', 'full_random band_skills=independent']
    """
    first_point = selector_text.strip() == FIRST_POINT and len(arm_of_run) > 0
    if first_point:
        selector_text = first_point_selector(sweep, arm_of_run)
    selector = parse_selector(selector_text)
    unknown = [k for k in selector if k not in sweep.keys]
    if unknown:
        raise ValueError(f"--baseline / analysis.baseline={selector_text!r}: {unknown} is not a swept key of these "
                         f"runs; swept keys: {', '.join(sweep.keys)}")
    compared = compared_keys(selector, sweep.keys)
    strata_keys = [k for k in sweep.keys if k not in compared]
    table = sweep.values.assign(arm=arm_of_run).drop_duplicates("arm").set_index("arm")
    table["stratum"] = table[strata_keys].apply(
        lambda row: " ".join(f"{k.rsplit('.', 1)[-1]}={row[k]}" for k in strata_keys), axis=1
    ) if strata_keys else ""
    explicit = {}
    for run_id, arm in arm_of_run.items():
        explicit[arm] = min(explicit.get(arm, 10**6), len(sweep.overridden.get(run_id, set()) & set(compared)))
    table["baseline"] = None
    notes = [f"baseline: the sweep's first point ({selector_text})"] if first_point else []
    for stratum, arms in table.groupby("stratum", sort=False):
        matching = arms[(arms[list(selector)] == pd.Series(selector)).all(axis=1)]
        if matching.empty:
            notes.append(f"stratum '{stratum or 'all runs'}': no arm matches baseline {selector_text!r}; its arms "
                         "are not compared")
            continue
        plainness = matching.index.map(lambda arm: explicit.get(arm, 0))
        plainest = matching.index[plainness == plainness.min()]
        if len(plainest) > 1:
            raise ValueError(f"--baseline / analysis.baseline={selector_text!r} matches {list(plainest)} in stratum "
                             f"'{stratum or 'all runs'}': add key=value terms to pick one")
        table.loc[arms.index, "baseline"] = plainest[0]
    return Pairing(arms=table, notes=notes)


# ------------------------------------------------------------------------------------------------- duplicates
DUPLICATE_POLICIES = ("error", "latest", "first")


def written_at(record: RunRecord) -> float:
    """When a run last wrote its files: a local run's newest summary.json / metrics.jsonl / probes.jsonl /
    run_config.json modification time (`.hydra/config.yaml` for a run recorded before run_config.json: Hydra
    rewrites it at every launch, even one that trains nothing), a W&B run's summary `_timestamp`; NaN when
    unknown.

    Example:
        >>> written_at(RunRecord("r", "wandb", "x", summary={"_timestamp": 1700000000.5}))
        1700000000.5
        >>> written_at(RunRecord("r", "local", "/nonexistent"))
        nan
    """
    if record.source == "local":
        config_file = RUN_CONFIG_FILE if (Path(record.location) / RUN_CONFIG_FILE).is_file() else CONFIG_FILE
        times = [path.stat().st_mtime for name in ("summary.json", "metrics.jsonl", "probes.jsonl", config_file)
                 if (path := Path(record.location) / name).is_file()]
        return max(times) if times else float("nan")
    stamp = record.summary.get("_timestamp")
    return float(stamp) if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) else float("nan")


def drop_duplicate_runs(records: list[RunRecord], labels: pd.Series,
                        policy: str = "error") -> tuple[list[RunRecord], list[str]]:
    """Keep one run per (arm, seed): two runs of one setting and one seed are two separate runs (the same sweep
    launched twice, a rerun in another folder, a run read both from its directory and from W&B), not two seeds.

    Seeds are the replicates an arm aggregates and pairs by; counting such a pair as two seeds would fake replication
    (and `paired` would average them into one seed silently). Runs without a seed are left alone.

    Args:
        records: the runs, in the order they were given (PATH order, then sorted run directories).
        labels: run_id -> arm label (`arm_label` of `sweep_of(records)`).
        policy: "error" (default): refuse, naming every run directory of each duplicate and the fix; "latest": keep
            the run that wrote its files last (`written_at`; ties and unknown times: the later one given);
            "first": keep the first one given. A kept run is noted in the returned notes.

    Returns:
        (the kept records in their original order, one note per dropped group).

    Raises:
        ValueError: policy "error" and some (arm, seed) has more than one run, or an unknown policy.

    Example:
        >>> runs = [RunRecord(f"r{i}", "wandb", f"w/r{i}", config={"seed": seed}) for i, seed in enumerate([0, 0, 1])]
        >>> labels = pd.Series(["bucketed"] * 3, index=["r0", "r1", "r2"])
        >>> kept, notes = drop_duplicate_runs(runs, labels, "first")
        >>> [r.run_id for r in kept], notes
        (['r0', 'r2'], ["arm 'bucketed' seed 0: 2 runs (w/r0, w/r1); kept w/r0, left out w/r1 (--duplicates=first)"])
        >>> drop_duplicate_runs(runs, labels)
        Traceback (most recent call last):
        ...
        ValueError: 2 runs share arm 'bucketed' and seed 0: w/r0 and w/r1. They are separate runs (the same sweep \
launched twice, or a rerun), not two seeds: pass only one of them, give reruns different seeds, or keep one with \
--duplicates=latest or --duplicates=first (compare_records(duplicates=...))
    """
    if policy not in DUPLICATE_POLICIES:
        raise ValueError(f"--duplicates={policy!r}: choose one of {', '.join(DUPLICATE_POLICIES)}")
    groups: dict[tuple[str, int], list[int]] = {}
    for index, record in enumerate(records):
        if record.seed is not None:
            groups.setdefault((str(labels.get(record.run_id)), record.seed), []).append(index)
    repeated = {key: indices for key, indices in groups.items() if len(indices) > 1}
    if not repeated:
        return list(records), []
    if policy == "error":
        problems = []
        for (arm, seed), indices in repeated.items():
            where = [records[i].location for i in indices]
            problems.append(f"{len(where)} runs share arm '{arm}' and seed {seed}: "
                            f"{', '.join(where[:-1])} and {where[-1]}")
        raise ValueError("; ".join(problems) + ". They are separate runs (the same sweep launched twice, or a "
                         "rerun), not two seeds: pass only one of them, give reruns different seeds, or keep one "
                         "with --duplicates=latest or --duplicates=first (compare_records(duplicates=...))")
    dropped, notes = set(), []
    for (arm, seed), indices in repeated.items():
        if policy == "first":
            keep = indices[0]
        else:  # latest: the newest writes; unknown times count as oldest, ties go to the later one given
            keep = max(indices, key=lambda i: (-math.inf if math.isnan(t := written_at(records[i])) else t, i))
        left_out = [records[i].location for i in indices if i != keep]
        dropped.update(i for i in indices if i != keep)
        notes.append(f"arm '{arm}' seed {seed}: {len(indices)} runs "
                     f"({', '.join(records[i].location for i in indices)}); kept {records[keep].location}, "
                     f"left out {', '.join(left_out)} (--duplicates={policy})")
    return [record for index, record in enumerate(records) if index not in dropped], notes


# ------------------------------------------------------------------------------------------ pooled launches
def launch_of(record: RunRecord) -> str:
    """The launch a run came from: a local run's parent folder (its sweep folder), a W&B run's group.

    Example:
        >>> launch_of(RunRecord("r", "local", "/m/sweep_a/0_bucketed_s0"))
        '/m/sweep_a'
    """
    if record.source == "local":
        return str(Path(record.location).parent)
    return str(record.group or record.source)


def pooled_launch_notes(records: list[RunRecord], labels: pd.Series) -> list[str]:
    """One note per arm whose runs come from more than one launch (two sweep folders, two W&B groups): their seeds
    are pooled as replicates of one arm. That is allowed (seeds added by a second launch, a rerun of the failed
    ones), so it is not refused, but it is never silent: the note names each launch and its seeds.

    Example:
        >>> runs = [RunRecord(f"r{i}", "local", f"/m/{folder}/run{i}", config={"seed": i})
        ...         for i, folder in enumerate(["a", "a", "b"])]
        >>> pooled_launch_notes(runs, pd.Series(["bucketed"] * 3, index=["r0", "r1", "r2"]))
        ["arm 'bucketed' pools the runs of 2 launches (/m/a: seeds 0 1; /m/b: seed 2) as seeds of one arm: \
compare them apart if the launches differ in something the runs do not record (code version, machine)"]
    """
    by_arm: dict[str, dict[str, list[str]]] = {}
    for record in records:
        seed = "?" if record.seed is None else str(record.seed)
        by_arm.setdefault(str(labels.get(record.run_id)), {}).setdefault(launch_of(record), []).append(seed)
    notes = []
    for arm, launches in by_arm.items():
        if len(launches) < 2:
            continue
        listing = "; ".join(f"{launch}: seed{'s' if len(seeds) > 1 else ''} {' '.join(seeds)}"
                            for launch, seeds in launches.items())
        notes.append(f"arm '{arm}' pools the runs of {len(launches)} launches ({listing}) as seeds of one arm: "
                     "compare them apart if the launches differ in something the runs do not record (code version, "
                     "machine)")
    return notes


# --------------------------------------------------------------------------------------------------- digests
MIXED_DIGEST_POLICIES = ("error", "allow")
DIGEST_FIELDS = ("target_digest", "data_digest")
_DIGEST_WHAT = {"target_digest": "target weights", "data_digest": "training data"}


def recorded_digest(record: RunRecord, name: str) -> str | None:
    """The run's summary value of digest `name` (`DIGEST_FIELDS`), None when it recorded none.

    Example:
        >>> recorded_digest(RunRecord("r", "local", "/r", summary={"target_digest": "ab12"}), "target_digest")
        'ab12'
        >>> recorded_digest(RunRecord("r", "local", "/r"), "data_digest") is None
        True
    """
    value = record.summary.get(name)
    return str(value) if isinstance(value, str) and value else None


def _non_sampler_setting(values: pd.Series) -> str:
    # the topology, like the sampler, changes neither digest: runs on other layouts are checked against each other
    keys = [k for k in values.index if k not in ("sampler", TOPOLOGY_KEY) and not k.startswith("sampler.")]
    return " ".join(f"{k}={values[k]}" for k in keys) or "all runs"


def _target_seed_label(record: RunRecord) -> str:
    seed = record.summary.get("target_seed")
    return "" if seed is None else f" target_seed={seed}"


def check_digests(records: list[RunRecord], sweep: Sweep, policy: str = "error") -> dict[str, list[str]]:
    """Refuse (or note) runs of one setting that trained against different targets or data (module docstring).

    Args:
        records: the runs to compare (duplicates already left out).
        sweep: `sweep_of(records)`: runs agreeing on every non-sampler swept key are checked against each other.
        policy: "error" (default): refuse a setting whose runs hold several values of a digest; "allow": compare
            them anyway, noting the difference in each such run's notes.

    Returns:
        run_id -> notes for that run's `notes` column (an unknown digest; with "allow", a digest that differs).

    Raises:
        ValueError: policy "error" and some setting's runs hold different target or data digests (every run is
            named with its digest, and the fixes), or an unknown policy.

    Example:
        >>> runs = [RunRecord(f"r{i}", "wandb", f"w/r{i}", config={"sampler": {"name": s}, "seed": 0},
        ...                   summary={"status": "finished", "target_digest": t, "data_digest": "d0"})
        ...         for i, (s, t) in enumerate([("bucketed", "aaaa"), ("full_random", "bbbb")])]
        >>> check_digests(runs, sweep_of(runs))
        Traceback (most recent call last):
        ...
        ValueError: runs trained against different target weights are not replicates or pairs: all runs: \
target_digest aaaa in w/r0; bbbb in w/r1. Rerun them against one target (the same model.target_path, or the tiny \
target of one cache: copy its folder targets/tiny-<hash> of the cache root, default ~/.cache/dflash_lab, between \
machines), compare them apart, or compare them anyway with --mixed-digests=allow \
(compare_records(mixed_digests='allow'))
        >>> check_digests(runs, sweep_of(runs), "allow")["r0"]
        ['target_digest aaaa differs from other runs of its setting (bbbb in w/r1): compared anyway \
(--mixed-digests=allow)']
    """
    if policy not in MIXED_DIGEST_POLICIES:
        raise ValueError(f"--mixed-digests={policy!r}: choose one of {', '.join(MIXED_DIGEST_POLICIES)}")
    notes: dict[str, list[str]] = {record.run_id: [] for record in records}
    by_id = {record.run_id: record for record in records}
    settings = sweep.values.apply(_non_sampler_setting, axis=1)
    problems: dict[str, list[str]] = {}
    for name in DIGEST_FIELDS:
        for record in records:
            if recorded_digest(record, name) is None:
                notes[record.run_id].append(f"{name} unknown (not in the run's summary: recorded before digests "
                                            f"were, or no summary.json); its {_DIGEST_WHAT[name]} were not "
                                            "checked against the other runs'")
        groups = settings
        if name == "target_digest":   # nested targets: one target per target_seed (dflash_lab/replicates.py)
            groups = settings + [_target_seed_label(by_id[run_id]) for run_id in settings.index]
        for setting, run_ids in groups.groupby(groups, sort=False).groups.items():
            holders = _digest_holders([by_id[run_id] for run_id in run_ids], name)
            if len(holders) > 1:
                problems.setdefault(name, []).append(f"{setting}: {name} {_held_by(holders)}")
                for digest, held in holders.items():
                    others = _held_by({other: runs for other, runs in holders.items() if other != digest})
                    for record in held:
                        notes[record.run_id].append(f"{name} {digest} differs from other runs of its setting "
                                                    f"({others}): compared anyway (--mixed-digests=allow)")
    if problems and policy == "error":
        raise ValueError(_mixed_digests_refusal(problems))
    return notes


def _digest_holders(records: list[RunRecord], name: str) -> dict[str, list[RunRecord]]:
    """The runs that recorded each value of digest ``name`` (runs without it left out)."""
    holders: dict[str, list[RunRecord]] = {}
    for record in records:
        digest = recorded_digest(record, name)
        if digest is not None:
            holders.setdefault(digest, []).append(record)
    return holders


def _held_by(holders: dict[str, list[RunRecord]]) -> str:
    return "; ".join(f"{digest} in {', '.join(record.location for record in held)}" for digest, held in holders.items())


def _mixed_digests_refusal(problems: dict[str, list[str]]) -> str:
    """The message refusing settings whose runs trained against other targets or data, with the fixes."""
    parts = []
    if "target_digest" in problems:
        parts.append("runs trained against different target weights are not replicates or pairs: "
                     + "; ".join(problems["target_digest"]) + ". Rerun them against one target (the same "
                     "model.target_path, or the tiny target of one cache: copy its folder targets/tiny-<hash> of "
                     "the cache root, default ~/.cache/dflash_lab, between machines), compare them apart")
    if "data_digest" in problems:
        parts.append("runs trained on different data are not replicates or pairs: "
                     + "; ".join(problems["data_digest"]) + ". Rerun them on the same data (same data.* "
                     "settings and files), compare them apart")
    return (". ".join(parts) + ", or compare them anyway with --mixed-digests=allow "
            "(compare_records(mixed_digests='allow'))")
