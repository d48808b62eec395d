"""What a person reads: the printed tables' columns and legend, the lines under them (relative speed, target mode,
block budgets, cost model, anchor rule) and the one-line recommendation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from ..config_check import as_float, refuse_unknown_keys
from ..metrics.throughput import format_eta
from ..sampling.anchors import anchor_rule_name
from .cost import CostModel


# ---- what a person reads: the narrow table, its legend, the recommendation (plan.csv keeps every column) -----------
def _number(digits: int, scale: float = 1.0) -> Callable[[Any], str]:
    return lambda v: "?" if not np.isfinite(v) else f"{v * scale:,.{digits}f}"


def _gib(value: float) -> str:
    return "?" if not np.isfinite(value) else f"{value:.2f}" if value < 10 else f"{value:,.1f}"


@dataclass(frozen=True)
class Column:
    """One column of the printed plan: the plan-table column, its header (with unit), its format and legend."""

    name: str
    header: str
    fmt: Callable[[Any], str]
    legend: str = ""


# The printed plan is two narrow tables: what one rank's step holds and how fast the plan runs (the regime the
# prediction is for), then how diverse its batches are and whether its worst step fits in memory.
STEP_COLUMNS = (
    Column("pad_eff", "pad_eff %", _number(1, 100), "real / padded tokens of the epoch plan (100 = no padding)"),
    Column("steps_per_epoch", "steps/epoch", _number(0), "optimizer steps per epoch (every rank steps together)"),
    Column("mean_samples_per_batch", "docs", _number(1), "documents per rank and step (mean of the epoch plan)"),
    Column("real_tokens_per_step", "real tok", _number(0), "real (non-pad) tokens per rank and step (mean)"),
    Column("padded_tokens_per_step", "padded tok", _number(0),
           "padded tokens per rank and step (rows x longest row; a packed row: its used length; mean)"),
    Column("block_tokens", "blk slots", _number(0),
           "block slots per rank and step: block tokens (anchors x block size, the draft's work) with padding slots "
           "(mean; its bound, sampler.max_block_tokens, is in plan.csv)"),
    Column("pred_ktok_s", "Ktok/s", _number(1),
           "predicted real tokens per second over all ranks, in thousands: the epoch's real tokens over its summed "
           "step times (the rate the ETA implies, a run's tokens over its wall time)"),
    Column("pred_ktok_s_median", "med Ktok/s", _number(1),
           "the same on the median step (the trainer's summary ktok_s); above Ktok/s when a few steps are slow"),
    Column("pred_eta_s", "ETA", format_eta, "predicted wall time of the configured run (epochs x steps x step time)"),
)
DIVERSITY_COLUMNS = (
    Column("composition_repeat", "repeat", _number(2),
           "share of the next epoch's batches identical to one of this epoch's (1 = same batches every epoch)"),
    Column("within_batch_spread", "spread CV", _number(2),
           "within-batch length spread: mean coefficient of variation of lengths inside a batch "
           "(0 = every batch one length)"),
    Column("adjacent_length_corr", "order r", _number(2),
           "correlation of consecutive batches' mean lengths (near 1 = a sorted, drifting order)"),
    Column("pred_peak_mem_gb", "peak GiB", _gib, "predicted peak GPU memory per rank, worst step"),
    Column("pred_gpu_use", "GPU %", _number(0, 100), "the worst step's share of the GPU's memory (gpu_mem_gb; a plan "
           "may use 90%)"),
    Column("fits", "fits", str, "yes | ckpt (only with activation checkpointing) | no, against 90% of gpu_mem_gb"),
)
NARROW_COLUMNS = STEP_COLUMNS + DIVERSITY_COLUMNS
FULL_COLUMNS = (
    "bucket_by", "pad_eff", "budget_fill", "real_tokens_per_step", "padded_tokens_per_step", "steps_per_epoch",
    "mean_samples_per_batch", "max_samples_per_batch",
    "composition_repeat", "adjacent_length_corr", "bucket_run_length", "within_batch_spread",
    "dropped_overlong", "truncated", "repeated_remainder", "pred_ktok_s", "pred_ktok_s_median", "pred_eta_s",
    "pred_comm_s",
    "block_tokens", "block_tokens_max", "block_pad_eff", "block_per_token", "thinned", "max_block_tokens",
    "max_block_tokens_fit", "pred_mfu", "pred_target_flop_share", "pred_ktok_s_target_online",
    "pred_ktok_s_target_off",
    "pred_peak_mem_gb", "pred_gpu_use", "pred_peak_mem_gb_ckpt", "pred_tflop_per_step", "ckpt", "fits",
    "max_tokens_fit",
)


def _plain_cell(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def full_columns(table: pd.DataFrame) -> list[Column]:
    """Every FULL_COLUMNS column the table has, headed by its own name (ETA in human form, see format_eta).

    Example:
        >>> [c.header for c in full_columns(pd.DataFrame({"fits": ["yes"], "pad_eff": [0.9]}))]
        ['pad_eff', 'fits']
    """
    return [Column(name, name, format_eta if name == "pred_eta_s" else _plain_cell)
            for name in FULL_COLUMNS if name in table.columns]


def to_markdown(table: pd.DataFrame, columns: Sequence[Column]) -> str:
    """A markdown table of ``columns`` (those the table has), cells formatted and padded to line up in a terminal.

    Example:
        >>> table = pd.DataFrame({"pad_eff": [0.5], "pred_eta_s": [403200.0]}, index=["bucketed"])
        >>> print(to_markdown(table, NARROW_COLUMNS))
        | policy   | pad_eff % |    ETA |
        |:---------|----------:|-------:|
        | bucketed |      50.0 | 4d 16h |
    """
    shown = [c for c in columns if c.name in table.columns]
    grid = [["policy", *(c.header for c in shown)]]
    grid += [[str(name), *(c.fmt(table.at[name, c.name]) for c in shown)] for name in table.index]
    widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))]
    line = lambda cells: "| " + " | ".join(  # noqa: E731 - policy left-aligned, figures right-aligned
        cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))) + " |"
    rule = "|:" + "-" * (widths[0] + 1) + "|" + "|".join("-" * (w + 1) + ":" for w in widths[1:]) + "|"
    return "\n".join([line(grid[0]), rule, *(line(row) for row in grid[1:])])


def legend(table: pd.DataFrame, columns: Sequence[Column] = NARROW_COLUMNS) -> str:
    """One line per shown column: its header and what it measures.

    Example:
        >>> print(legend(pd.DataFrame({"pred_eta_s": [1.0]})))
        - ETA: predicted wall time of the configured run (epochs x steps x step time)
    """
    return "\n".join(f"- {c.header}: {c.legend}" for c in columns if c.name in table.columns and c.legend)


# the diversity floors of the recommendation: plan key -> (plan-table column, direction, short name)
FLOORS = {
    "min_within_batch_spread": ("within_batch_spread", ">=", "spread"),
    "max_composition_repeat": ("composition_repeat", "<=", "repeat"),
    "max_adjacent_length_corr": ("adjacent_length_corr", "<=", "order r"),
}


def recommend_floors(values: Mapping[str, Any] | None) -> dict[str, float | None]:
    """The ``recommend`` section checked: each floor a number (null: no floor), unknown keys refused.

    Example:
        >>> recommend_floors({"min_within_batch_spread": 0.1})
        {'min_within_batch_spread': 0.1, 'max_composition_repeat': None, 'max_adjacent_length_corr': None}
        >>> recommend_floors({"min_spread": 0.1})
        Traceback (most recent call last):
        ...
        ValueError: unknown recommend key(s) ['min_spread']; valid keys: max_adjacent_length_corr, ...
    """
    values = dict(values or {})
    refuse_unknown_keys("recommend", values, sorted(FLOORS))
    limits = {"min_within_batch_spread": (0.0, None), "max_composition_repeat": (0.0, 1.0),
              "max_adjacent_length_corr": (-1.0, 1.0)}
    return {key: as_float(f"recommend.{key}", values.get(key), minimum=limits[key][0], maximum=limits[key][1],
                          allow_none=True) for key in FLOORS}


def recommendation(table: pd.DataFrame, floors: Mapping[str, float | None],
                   activation_checkpointing: bool = False) -> dict[str, Any]:
    """The fastest policy (``pred_ktok_s``) that clears every diversity floor and, when memory is known, fits.

    A policy whose ``fits`` is ``ckpt`` qualifies and the line says it needs activation checkpointing (unless it
    is on). A missing (NaN) figure does not clear a floor.

    Returns:
        ``{"policy": name or None, "line": one readable sentence, "excluded": {policy: reasons}}``.

    Example:
        >>> table = pd.DataFrame({"pred_ktok_s": [140.0, 117.0, 68.0], "pred_eta_s": [3600.0, 4300.0, 7400.0],
        ...                       "within_batch_spread": [0.0, 0.17, 0.62]},
        ...                      index=["sorted_static", "bucketed", "full_random"])
        >>> print(recommendation(table, {"min_within_batch_spread": 0.1})["line"])
        recommended: bucketed, the fastest policy (117.0 Ktok/s, ETA 1h 11m) with spread >= 0.1; faster but
        excluded: sorted_static (spread 0.00)
    """
    active = {key: limit for key, limit in floors.items() if limit is not None}
    excluded = {str(name): reasons for name in table.index if (reasons := exclusion_reasons(table, name, active))}
    conditions = _conditions(active, fits_known="fits" in table.columns)
    qualifying = table.drop(index=list(excluded)).sort_values("pred_ktok_s", ascending=False)
    if qualifying.empty:
        reasons = "; ".join(f"{name} ({', '.join(why)})" for name, why in excluded.items())
        return {"policy": None, "excluded": excluded,
                "line": f"recommended: none; no policy qualifies ({conditions or 'a throughput prediction'}): "
                        f"{reasons}. Relax the recommend.* floors, or plan with more memory (gpu_mem_gb) or a smaller "
                        f"sampler.max_tokens"}
    best = qualifying.index[0]
    speed = float(qualifying.at[best, "pred_ktok_s"])
    faster = [n for n in excluded if np.isfinite(table.at[n, "pred_ktok_s"]) and table.at[n, "pred_ktok_s"] > speed]
    line = (f"recommended: {best}, the fastest policy ({speed:.1f} Ktok/s, ETA "
            f"{format_eta(qualifying.at[best, 'pred_eta_s'])})" + (f" with {conditions}" if conditions else ""))
    if "fits" in table.columns and table.at[best, "fits"] == "ckpt" and not activation_checkpointing:
        line += " (with activation checkpointing: activation_checkpointing=true)"
    if faster:
        line += "; faster but excluded: " + ", ".join(f"{n} ({', '.join(excluded[n])})" for n in faster)
    return {"policy": str(best), "excluded": excluded, "line": line}


def exclusion_reasons(table: pd.DataFrame, name: Any, floors: Mapping[str, float]) -> list[str]:
    """Why policy ``name`` does not qualify: each active floor it misses (a NaN figure misses), a plan that does not
    fit in memory, no throughput prediction; [] when it qualifies.

    Example:
        >>> table = pd.DataFrame({"pred_ktok_s": [140.0], "within_batch_spread": [0.0]}, index=["sorted_static"])
        >>> exclusion_reasons(table, "sorted_static", {"min_within_batch_spread": 0.1})
        ['spread 0.00']
    """
    reasons = []
    for key, limit in floors.items():
        column, direction, short = FLOORS[key]
        value = float(table.at[name, column]) if column in table.columns else float("nan")
        passes = value >= limit if direction == ">=" else value <= limit
        if not passes:  # NaN never passes
            reasons.append(f"{short} {value:.2f}")
    if "fits" in table.columns and table.at[name, "fits"] == "no":
        reasons.append(f"needs {table.at[name, 'pred_peak_mem_gb']:.0f} GiB")
    if not np.isfinite(table.at[name, "pred_ktok_s"]):
        reasons.append("no throughput prediction")
    return reasons


def _conditions(floors: Mapping[str, float], fits_known: bool) -> str:
    """What a recommended policy clears, in words: ``spread >= 0.1, repeat <= 0.1 and fitting in memory``."""
    conditions = [f"{FLOORS[k][2]} {FLOORS[k][1]} {v:g}" for k, v in floors.items()]
    conditions += ["fitting in memory"] if fits_known else []
    return ", ".join(conditions[:-1]) + " and " + conditions[-1] if len(conditions) > 1 else "".join(conditions)


def describe_block_budgets(table: pd.DataFrame) -> str:
    """One line naming each policy's block budget in force and the largest that fits (empty without them).

    Example:
        >>> t = pd.DataFrame({"max_block_tokens": [40721], "max_block_tokens_fit": [40721], "ckpt": ["off"]},
        ...                  index=["bucketed"])
        >>> print(describe_block_budgets(t).strip())
        block budget in force / largest that fits the GPU: bucketed 40,721 / 40,721 (checkpointing off)
    """
    if "max_block_tokens_fit" not in table.columns:
        return ""
    number = lambda v: "none" if v is None or v != v else f"{int(v):,}"  # noqa: E731
    parts = [f"{name} {number(row['max_block_tokens'])} / {number(row['max_block_tokens_fit'])}"
             + (f" (checkpointing {row['ckpt']})" if "ckpt" in row else "") for name, row in table.iterrows()]
    return "block budget in force / largest that fits the GPU: " + "; ".join(parts) + "\n\n"


def describe_bucket_keying(table: pd.DataFrame) -> str:
    """One line naming the policies planned with ``bucket_by=random`` (empty when none is).

    Example:
        >>> t = pd.DataFrame({"bucket_by": ["random", None]}, index=["bucket_sequential", "full_random"])
        >>> print(describe_bucket_keying(t).strip())  # doctest: +ELLIPSIS
        bucket_by=random (the negative control): bucket_sequential plan fixed random groups of the length ...
    """
    if "bucket_by" not in table.columns:
        return ""
    random_keyed = [str(name) for name in table.index if table.at[name, "bucket_by"] == "random"]
    if not random_keyed:
        return ""
    return (f"bucket_by=random (the negative control): {', '.join(random_keyed)} plan fixed random groups of the "
            f"length buckets' sizes, members independent of length (their bucket run length counts the groups)\n\n")


def describe_relative_speed(table: pd.DataFrame, baseline: str = "bucketed") -> str:
    """One line giving each policy's predicted Ktok/s as a share of ``baseline``'s, over time and on the median
    step (empty without the baseline or another policy).

    Example:
        >>> t = pd.DataFrame({"pred_ktok_s": [19.4, 25.7], "pred_ktok_s_median": [20.3, 32.0]},
        ...                  index=["full_random", "bucketed"])
        >>> print(describe_relative_speed(t).strip())
        Ktok/s relative to bucketed, over time (median step): full_random 0.755 (0.634)
    """
    if baseline not in table.index or len(table.index) < 2:
        return ""
    over_time, median = table.at[baseline, "pred_ktok_s"], table.at[baseline, "pred_ktok_s_median"]
    parts = [f"{name} {row['pred_ktok_s'] / over_time:.3f} ({row['pred_ktok_s_median'] / median:.3f})"
             for name, row in table.iterrows() if name != baseline]
    return f"Ktok/s relative to {baseline}, over time (median step): " + "; ".join(parts) + "\n\n"


def describe_target_mode(table: pd.DataFrame, cost: CostModel) -> str:
    """One line saying where the cost model runs the target's forward and what the other place would give
    (FLOPs form only: empty for the linear one, which is fitted with the target online).

    Example:
        >>> t = pd.DataFrame({"pred_target_flop_share": [0.35], "pred_ktok_s_target_online": [25.1],
        ...                   "pred_ktok_s_target_off": [39.6]}, index=["bucketed"])
        >>> print(describe_target_mode(t, CostModel(0.0, utilisation=0.3, peak_tflops=500)).strip())
        target online (cost.target): its forward runs on the trainer GPUs every step, on every padded token
        (bucketed 35% of the executed FLOPs). Off them (cost.target=offline or disaggregated: hidden states from disk
        or another server) Ktok/s would be bucketed 39.6
    """
    if cost.utilisation is None or "pred_ktok_s_target_off" not in table.columns:
        return ""
    shares = ", ".join(f"{name} {row['pred_target_flop_share']:.0%}" for name, row in table.iterrows())
    if cost.target == "online":
        other = ", ".join(f"{name} {row['pred_ktok_s_target_off']:.1f}" for name, row in table.iterrows())
        return (f"target online (cost.target): its forward runs on the trainer GPUs every step, on every padded "
                f"token ({shares} of the executed FLOPs). Off them (cost.target=offline or disaggregated: hidden "
                f"states from disk or another server) Ktok/s would be {other}\n\n")
    other = ", ".join(f"{name} {row['pred_ktok_s_target_online']:.1f}" for name, row in table.iterrows())
    return (f"target {cost.target} (cost.target): the trainer GPUs run no target forward (memory columns still hold "
            f"the target's weights and features). With it online (cost.target=online: {shares} of the executed "
            f"FLOPs) Ktok/s would be {other}\n\n")


def describe_cost(cost: CostModel) -> str:
    """One line naming the cost model's form and coefficients.

    Example:
        >>> describe_cost(CostModel(0.0, utilisation=0.2, peak_tflops=500))
        'cost model: step = executed FLOPs (target online) / (0.2 x 500 TFLOP/s) + 0 s'
    """
    if cost.utilisation is not None:
        return (f"cost model: step = executed FLOPs (target {cost.target}) / ({cost.utilisation:g} x "
                f"{cost.peak_tflops:g} TFLOP/s) + {cost.c0:g} s")
    return (f"cost model: step = {cost.c0:g} + {cost.c1:g} x padded + {cost.c2:g} x attention + {cost.c3:g} x "
            f"block slots + {cost.c4:g} x packed documents")


def describe_anchors(model_cfg: Mapping[str, Any] | None, block_tokens: np.ndarray | None) -> str:
    """One line naming the anchor rule the block-token columns use.

    Example:
        >>> describe_anchors({"block_size": 16, "anchors_per_doc": 512, "anchor_density": None}, np.array([16]))
        'anchor rule: recipe (min(512, valid positions) anchors per document, block size 16)'
    """
    if block_tokens is None or not model_cfg:
        return "anchor rule: unknown (no model config): no block-token columns"
    density = model_cfg.get("anchor_density")
    if anchor_rule_name(density) == "recipe":
        what = f"min({model_cfg.get('anchors_per_doc')}, valid positions) anchors per document"
    else:
        what = f"ceil({density:g} x valid positions) anchors per document, at most {model_cfg.get('anchors_per_doc')}"
    return f"anchor rule: {anchor_rule_name(density)} ({what}, block size {model_cfg['block_size']})"
