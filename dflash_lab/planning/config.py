"""The planner's inputs: its config groups and keys, the policies compared with one shared budget, the data's
lengths and anchor positions (``python -m dflash_lab.plan``; ``dflash_lab.plan`` re-exports every name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..config_check import as_choice, as_int, refuse_unknown_keys
from ..sampling import POLICIES, policy_keys, validate_lengths
from ..sampling.anchors import block_tokens_per_sample, valid_positions_from_lengths

PACKAGE_DIR = Path(__file__).resolve().parent.parent
CONF_DIR = PACKAGE_DIR / "conf"  # package data (dflash_lab.conf), in a checkout and a wheel
PLAN_CONF_DIR = PACKAGE_DIR / "conf_plan"  # groups only the planner uses (cost, data=lengths)
# Keys that describe the budget rather than the policy: the chosen sampler's values apply to every policy compared.
SHARED_KEYS = ("max_tokens", "max_samples", "quadratic_length", "max_block_tokens", "drop_last", "overlong")
# Keys that define the buckets (which boundaries, and what decides membership: bucket_by=random is the negative
# control): the chosen sampler's values apply to every bucketed policy compared.
BUCKET_KEYS = ("boundaries", "num_buckets", "fit_method", "bucket_by")
MAX_SWEEP_K = 256  # more buckets than this is no longer bucketing


def policy_names(policies: Any) -> list[str]:
    """The ``policies`` key as a list of policy names: ``all``, one name, or a list of names.

    Example:
        >>> policy_names(["bucketed", "full_random"])
        ['bucketed', 'full_random']
    """
    if policies is None or policies == "all":
        return list(POLICIES)
    names = [policies] if isinstance(policies, str) else policies
    if not isinstance(names, Sequence) or len(names) == 0:
        raise ValueError(f"policies={policies!r}: give all or a list of policies, e.g. policies=[bucketed,full_random]")
    unknown = [n for n in names if not isinstance(n, str) or n not in POLICIES]
    if unknown:
        raise ValueError(
            f"policies={list(names)}: unknown {unknown}; choose from {', '.join(POLICIES)} or all "
            f"(e.g. policies=[bucketed,full_random])"
        )
    return list(dict.fromkeys(names))


def sampler_configs(chosen: Mapping[str, Any], policies: Any) -> dict[str, dict[str, Any]]:
    """The sampler config of each compared policy: its own conf/sampler file, with the chosen budget keys applied.

    The chosen sampler (``sampler=...``) is used as composed; the others take their file's policy-specific keys
    and the chosen sampler's budget keys (and bucket keys, ``BUCKET_KEYS``, for bucketed policies) so all share one
    budget and one bucketing: ``sampler.bucket_by=random`` plans every bucketed policy compared as its negative
    control.
    Every config's keys are checked against its policy (``sampling.policy_keys``) before anything is built.
    """
    from ..presets import preset

    as_choice("sampler.name", chosen.get("name"), POLICIES)
    out = {}
    for name in policy_names(policies):
        if name == chosen["name"]:
            out[name] = dict(chosen)
            continue
        own = preset("sampler", name)
        for key in SHARED_KEYS + BUCKET_KEYS:
            if key in chosen and key in own:
                own[key] = chosen[key]
        out[name] = own
    for name, sampler_cfg in out.items():
        refuse_unknown_keys(f"{name} sampler", sampler_cfg, ["name", "max_tokens", *policy_keys(name)])
    return out


def sweep_range(value: Any) -> tuple[int, int]:
    """``sweep_k`` as ``(k_min, k_max)``: two positive integers, k_min <= k_max <= MAX_SWEEP_K.

    Example:
        >>> sweep_range([2, 16])
        (2, 16)
        >>> sweep_range([8, 2])
        Traceback (most recent call last):
        ...
        ValueError: sweep_k=[8, 2]: k_min 8 is above k_max 2; write sweep_k=[2,8]
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"sweep_k={value!r}: must be two bucket counts [k_min, k_max], e.g. sweep_k=[2,16]")
    k_min = as_int("sweep_k[0] (k_min)", value[0], minimum=1, maximum=MAX_SWEEP_K)
    k_max = as_int("sweep_k[1] (k_max)", value[1], minimum=1, maximum=MAX_SWEEP_K)
    if k_min > k_max:
        raise ValueError(
            f"sweep_k={list(value)}: k_min {k_min} is above k_max {k_max}; write sweep_k=[{k_max},{k_min}]"
        )
    return k_min, k_max


def conf_keys(group: str) -> dict[Any, list[str]]:
    """Keys of every ``conf/<group>/*.yaml`` and ``conf_plan/<group>/*.yaml`` file, by the file's ``kind`` (or its
    name when it has none)."""
    from omegaconf import OmegaConf

    files = {}
    for path in sorted([*(CONF_DIR / group).glob("*.yaml"), *(PLAN_CONF_DIR / group).glob("*.yaml")]):
        keys = OmegaConf.to_container(OmegaConf.load(path))
        files[keys.get("kind", path.stem)] = list(keys)
    return files


def data_keys(kind: Any) -> list[str]:
    """The keys data kind ``kind`` uses: those of its ``conf/data/*.yaml`` file (config groups mirror code)."""
    files = conf_keys("data")
    as_choice("data.kind", kind, files)
    return files[kind]


def load_plan_data(data_cfg: Mapping[str, Any],
                   model_cfg: Mapping[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sample lengths and valid anchor positions for planning (``load_plan_inputs`` without the data's counts)."""
    lengths, valid, _counts = load_plan_inputs(data_cfg, model_cfg)
    return lengths, valid


def check_data_keys(data_cfg: Mapping[str, Any]) -> Any:
    """Refuse a ``data`` key its kind does not use (valid keys listed); return the kind."""
    kind = data_cfg.get("kind")
    refuse_unknown_keys(f"data (kind={kind})", dict(data_cfg), data_keys(kind))
    return kind


def load_plan_inputs(data_cfg: Mapping[str, Any], model_cfg: Mapping[str, Any] | None = None
                     ) -> tuple[np.ndarray, np.ndarray, dict[str, Any] | None]:
    """Sample lengths and valid anchor positions for planning: a reference workload (``kind: lengths``: every
    token supervised, ``sampling.anchors.valid_positions_from_lengths``) or a dataset's cached arrays (its own
    loss masks, ``TokenizedDataset.anchor_positions``); and a dataset's counts (:func:`data_counts`; None for a
    reference workload).

    Raises:
        ValueError: an unknown data kind, a key the kind does not use (e.g. ``data.path`` with ``kind: lengths``),
            a bad value, or lengths that fail ``sampling.validate_lengths``.
    """
    data_cfg = dict(data_cfg)
    kind = check_data_keys(data_cfg)
    del data_cfg["kind"]
    if kind == "lengths":
        from ..data.lengths import WORKLOADS, reference_lengths

        workload = as_choice("data.workload", data_cfg["workload"], WORKLOADS)
        num_samples = as_int("data.num_samples", data_cfg["num_samples"], minimum=1, example=800000)
        seed = as_int("data.seed", data_cfg["seed"], minimum=0)
        lengths = validate_lengths(reference_lengths(workload, num_samples, seed=seed))
        return lengths, valid_positions_from_lengths(lengths), None
    from ..data import build_dataset
    from ..data.tokenizer import ByteTokenizer, HFTokenizerAdapter

    model_cfg = dict(model_cfg or {})
    if model_cfg.get("kind") == "hf":
        # Lengths only need the target's tokenizer, not its weights.
        from transformers import AutoTokenizer

        tokenizer = HFTokenizerAdapter(AutoTokenizer.from_pretrained(model_cfg["target_path"]))
    else:
        tokenizer = ByteTokenizer()
    # the plan trains on nothing: the store's digest (seconds per GB) is left to the runs, which check it
    dataset = build_dataset(kind, tokenizer=tokenizer, check_digest=False, **data_cfg)
    train, _ = dataset.split()
    return validate_lengths(train.lengths), train.anchor_positions(), data_counts(dataset, data_cfg)


def data_counts(dataset, data_cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the data loader kept, skipped and cut, for the plan (``plan.json`` meta ``data``; the printed
    plan's ``data:`` line): kept samples, skipped lines per reason (nonzero ones), samples cut to
    ``data.max_length``, and where the skipped lines are listed. None for data that skips and cuts nothing
    (the synthetic corpus)."""
    stats = dataset.stats
    if "kept" not in stats:
        return None
    counts = {"kept": int(stats["kept"]), "total_lines": stats.get("total_lines"),
              "skipped": {reason: int(n) for reason, n in stats.get("skipped", {}).items() if n},
              "truncated": int(stats.get("truncated") or 0), "max_length": data_cfg.get("max_length"),
              "length_keeping_99pct": stats.get("length_keeping_99pct")}
    if counts["skipped"] and dataset.meta.get("directory"):
        from ..data.datasets import SKIPPED_LINES_FILE

        counts["skipped_lines_file"] = str(Path(dataset.meta["directory"]) / SKIPPED_LINES_FILE)
    return counts


def describe_data_counts(counts: dict[str, Any] | None) -> str:
    """The plan's ``data:`` line: kept, skipped (by reason, and where every line is listed), cut ("" for none).

    Example:
        >>> print(describe_data_counts({"kept": 57, "total_lines": 60, "skipped": {"too_long": 3}, "truncated": 2,
        ...                             "max_length": 1024, "length_keeping_99pct": 2900}))
        data: 57 of 60 lines kept; skipped: too_long 3; 2 cut to data.max_length=1024 (data.max_length=2900 keeps 99% of the lines whole)
    """
    if counts is None:
        return ""
    total = counts.get("total_lines")
    line = f"data: {counts['kept']:,} of {total:,} lines kept" if total else f"data: {counts['kept']:,} samples"
    if counts["skipped"]:
        line += "; skipped: " + ", ".join(f"{reason} {n:,}" for reason, n in counts["skipped"].items())
        if counts.get("skipped_lines_file"):
            line += f" (every skipped line: {counts['skipped_lines_file']})"
    else:
        line += "; none skipped"
    if counts["truncated"]:
        line += f"; {counts['truncated']:,} cut to data.max_length={counts['max_length']}"
        keeping = counts.get("length_keeping_99pct")
        if keeping and counts.get("max_length") and keeping > counts["max_length"]:
            line += f" (data.max_length={keeping} keeps 99% of the lines whole)"
    return line


def plan_keys() -> list[str]:
    """Top-level keys of ``conf/plan.yaml``: its own keys and its config groups."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "plan.yaml"))
    groups = [next(iter(entry)) for entry in raw["defaults"] if isinstance(entry, dict)]
    return [k for k in raw if k not in ("defaults", "hydra")] + groups


def plan_block_tokens(valid: np.ndarray, model_cfg: Mapping[str, Any] | None) -> np.ndarray | None:
    """Block tokens per sample under the model config's anchor rule (``sampling.anchors``); None without one."""
    if not model_cfg or "block_size" not in model_cfg:
        return None
    return block_tokens_per_sample(valid, block_size=as_int("model.block_size", model_cfg["block_size"], minimum=2),
                                   anchors_per_doc=model_cfg.get("anchors_per_doc"),
                                   anchor_density=model_cfg.get("anchor_density"))
