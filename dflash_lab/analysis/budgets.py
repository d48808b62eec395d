"""Quality at equal compute: a run's probe loss read at a given optimizer step, number of real tokens, or modelled
GPU time: policies are compared at equal compute, never only at equal epochs.

Axes, from metrics.jsonl (one row per logged step; a row stands for the steps since the previous logged row, which
is exact when every step is logged):
    steps           the optimizer step counter
    real_tokens     cumulative real (non-pad) training tokens, all ranks
    modelled_time_s cumulative modelled step time, plan.CostModel(c0, c1, c2).step_time(padded / W, attention / W):
                    the planner's per-rank cost model on the per-rank share of the step's padded and attention
                    tokens (W = world size; ranks run in parallel). attention = attn_tokens.
Curve: the mean over bands of the probe loss at each eval where every band was scored (`mean_probe_loss`).
Reading a curve at a budget: linear interpolation between the two evals around it on that axis; NaN past the run's
last eval (the run never got there) and before its first: never extrapolated.
Common budget of a comparison: the smallest last-eval position over its finished runs, so each of them reaches it.

Time to target and the early window, on a run's probe curve (evals in step order, y = mean probe loss):
    time to target L  x_L = x_(i-1) + w (x_i - x_(i-1)), w = (y_(i-1) - L) / (y_(i-1) - y_i), with i the first eval
                      where y_i <= L (the first crossing counts, even if a later eval rises above L again); x_0 if
                      the first eval already is at or below L; NaN if no eval reaches L (never extrapolated). The
                      same w on every axis: steps_to_target, tokens_to_target, time_to_target (time_to_target)
    early window      mean probe loss over [x_first, E] = (area under the linearly interpolated curve from x_first
                      to E) / (E - x_first), trapezoid rule, so unevenly spaced evals weigh by the span they stand
                      for; x_first: the first eval (step 0: the trainer evaluates before training); E = EARLY_SHARE
                      (0.25) x the common step budget: probe_loss_early (mean_probe_loss_until)
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dflash_lab.plan import CostModel

AXES = ("steps", "real_tokens", "modelled_time_s")
ENDPOINT_OF_AXIS = {"steps": "probe_loss_at_steps", "real_tokens": "probe_loss_at_tokens",
                    "modelled_time_s": "probe_loss_at_time"}
TARGET_ENDPOINT_OF_AXIS = {"steps": "steps_to_target", "real_tokens": "tokens_to_target",
                           "modelled_time_s": "time_to_target"}
# The early window: the first quarter of the common step budget, where orders that learn the easy (short) examples
# first or last differ most before every arm has seen the whole data once
EARLY_SHARE = 0.25


def _numeric(steps: pd.DataFrame, name: str) -> np.ndarray | None:
    if name not in steps.columns:
        return None
    values = pd.to_numeric(steps[name], errors="coerce").to_numpy(dtype=np.float64)
    return None if np.isnan(values).all() else values


def compute_axes(steps: pd.DataFrame, cost: tuple[float, float, float] | None = None,
                 world_size: int = 1) -> pd.DataFrame:
    """Cumulative real tokens and modelled time at every logged step, with a step-0 row of zeros.

    Args:
        steps: metrics.jsonl rows (step, real_tokens, padded_tokens, attn_tokens).
        cost: (c0, c1, c2) of the step-time model; None: modelled_time_s is NaN.
        world_size: ranks the logged token counts are summed over.

    Example:
        >>> rows = pd.DataFrame({"step": [1, 2, 4], "real_tokens": [10, 20, 30], "padded_tokens": [20, 20, 40],
        ...                      "attn_tokens": [0, 0, 0]})
        >>> axes = compute_axes(rows, cost=(1.0, 0.5, 0.0))  # the row of step 4 stands for steps 3 and 4
        >>> axes["real_tokens"].tolist(), axes["modelled_time_s"].tolist()
        ([0.0, 10.0, 30.0, 90.0], [0.0, 11.0, 22.0, 64.0])
    """
    step = _numeric(steps, "step")
    if step is None:
        return pd.DataFrame(columns=list(AXES), dtype=np.float64)
    order = np.argsort(step, kind="stable")
    step = step[order]
    keep = np.isfinite(step)
    step = step[keep]
    # the steps each logged row stands for: a run logging every k steps reports one step's counts per k steps
    span = np.diff(np.r_[0.0, step])
    real = _numeric(steps, "real_tokens")
    real_cum = np.cumsum(np.nan_to_num(real[order][keep]) * span) if real is not None else np.full(step.size, np.nan)
    padded = _numeric(steps, "padded_tokens")
    attention = _numeric(steps, "attn_tokens")
    if cost is not None and padded is not None:
        attention = np.zeros_like(padded) if attention is None else np.nan_to_num(attention)
        per_step = CostModel(*cost).step_time(padded[order][keep] / world_size, attention[order][keep] / world_size)
        time_cum = np.cumsum(per_step * span)
    else:
        time_cum = np.full(step.size, np.nan)
    axes = pd.DataFrame({"steps": step, "real_tokens": real_cum, "modelled_time_s": time_cum})
    start = pd.DataFrame({"steps": [0.0], "real_tokens": [0.0], "modelled_time_s": [0.0 if cost else np.nan]})
    return pd.concat([start, axes[axes["steps"] > 0]], ignore_index=True)


def mean_probe_loss(probes: pd.DataFrame) -> pd.Series:
    """Mean over bands of the probe loss per eval step (evals where a band is missing are dropped).

    Example:
        >>> probes = pd.DataFrame({"step": [0, 0, 10, 10, 20], "band": [0, 1, 0, 1, 0], "loss": [4, 6, 3, 5, 2]})
        >>> mean_probe_loss(probes).to_dict()
        {0: 5.0, 10: 4.0}
    """
    rows = probes.dropna(subset=["step", "band", "loss"])
    if rows.empty:
        return pd.Series(dtype=np.float64, name="probe_loss")
    wide = rows.pivot_table(index="step", columns="band", values="loss", aggfunc="last").dropna()
    return wide.mean(axis=1).rename("probe_loss").rename_axis("step")


def probe_curve(probes: pd.DataFrame, axes: pd.DataFrame) -> pd.DataFrame:
    """The mean probe loss at each eval with its position on every axis (interpolated between logged steps).

    Example:
        >>> axes = pd.DataFrame({"steps": [0.0, 10.0, 20.0], "real_tokens": [0.0, 100.0, 300.0],
        ...                      "modelled_time_s": [0.0, 1.0, 2.0]})
        >>> probes = pd.DataFrame({"step": [0, 10, 20], "band": 0, "loss": [4.0, 3.0, 2.0]})
        >>> probe_curve(probes, axes)["real_tokens"].tolist()
        [0.0, 100.0, 300.0]
    """
    curve = mean_probe_loss(probes)
    frame = pd.DataFrame({"probe_loss": curve.to_numpy(), "steps": curve.index.to_numpy(dtype=np.float64)})
    for axis in AXES[1:]:
        known = axes.dropna(subset=[axis])
        frame[axis] = (np.interp(frame["steps"], known["steps"], known[axis], left=np.nan, right=np.nan)
                       if len(known) else np.nan)
    return frame


def value_at(x: np.ndarray, y: np.ndarray, at: float) -> float:
    """y interpolated linearly at x = at; NaN outside [min x, max x] or when at is not finite.

    Example:
        >>> value_at(np.array([0.0, 10.0]), np.array([4.0, 2.0]), 5.0)
        3.0
        >>> value_at(np.array([0.0, 10.0]), np.array([4.0, 2.0]), 12.0)  # past the last eval: never extrapolated
        nan
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if not np.isfinite(at) or x.size == 0 or at < x.min() or at > x.max():
        return float("nan")
    order = np.argsort(x, kind="stable")
    return float(np.interp(at, x[order], y[order]))


def curve_end(curve: pd.DataFrame, axis: str) -> float:
    """How far a run's probe curve reaches on an axis (its last eval's position; NaN without one).

    Example:
        >>> curve_end(pd.DataFrame({"steps": [0.0, 50.0], "probe_loss": [3.0, 2.0]}), "steps")
        50.0
    """
    if axis not in curve.columns:
        return float("nan")
    positions = curve.dropna(subset=["probe_loss"])[axis].dropna()
    return float(positions.max()) if len(positions) else float("nan")


def common_budgets(curves: list[pd.DataFrame]) -> dict[str, float]:
    """Per axis: the smallest `curve_end` over the given runs (NaN if any run cannot be placed on that axis).

    Example:
        >>> a = pd.DataFrame({"steps": [0.0, 50.0], "real_tokens": [0.0, 900.0], "probe_loss": [3.0, 2.0]})
        >>> b = pd.DataFrame({"steps": [0.0, 80.0], "real_tokens": [0.0, 700.0], "probe_loss": [3.0, 2.5]})
        >>> common_budgets([a, b])
        {'steps': 50.0, 'real_tokens': 700.0, 'modelled_time_s': nan}
    """
    budgets = {}
    for axis in AXES:
        ends = [curve_end(curve, axis) for curve in curves]
        budgets[axis] = float(min(ends)) if ends and all(np.isfinite(ends)) else float("nan")
    return budgets


def probe_loss_at(curve: pd.DataFrame, axis: str, budget: float) -> float:
    """The run's mean probe loss at `budget` on `axis` (see `value_at`).

    Example:
        >>> curve = pd.DataFrame({"steps": [0.0, 10.0], "probe_loss": [4.0, 2.0]})
        >>> probe_loss_at(curve, "steps", 5.0)
        3.0
    """
    if axis not in curve.columns:
        return float("nan")
    return value_at(curve[axis].to_numpy(), curve["probe_loss"].to_numpy(), budget)


def _in_eval_order(curve: pd.DataFrame, axis: str) -> tuple[np.ndarray, np.ndarray]:
    """(positions on `axis`, probe losses) of the evals with a probe loss, in eval (step) order."""
    rows = curve.dropna(subset=["probe_loss"])
    rows = rows.sort_values("steps" if "steps" in rows.columns else axis, kind="stable")
    return rows[axis].to_numpy(dtype=np.float64), rows["probe_loss"].to_numpy(dtype=np.float64)


def time_to_target(curve: pd.DataFrame, axis: str, target: float) -> float:
    """Where on `axis` the run's probe curve first reaches probe loss `target`: between the first eval i at or
    below it and the eval before, x_(i-1) + (y_(i-1) - target) / (y_(i-1) - y_i) (x_i - x_(i-1)); x_0 if the first
    eval already is; NaN if no eval reaches it (never extrapolated) or the axis is unknown.

    Example:
        >>> curve = pd.DataFrame({"steps": [0.0, 10.0, 20.0, 30.0], "real_tokens": [0.0, 100.0, 300.0, 600.0],
        ...                       "probe_loss": [4.0, 3.0, 2.0, 2.5]})
        >>> time_to_target(curve, "steps", 2.5), time_to_target(curve, "real_tokens", 2.5)   # w = 0.5 on both
        (15.0, 200.0)
        >>> time_to_target(curve, "steps", 1.9)   # never reached within the run
        nan
    """
    if axis not in curve.columns or not np.isfinite(target):
        return float("nan")
    position, loss = _in_eval_order(curve, axis)
    reached = np.flatnonzero(loss <= target)
    if not reached.size:
        return float("nan")
    first = int(reached[0])
    if first == 0:
        return float(position[0])
    share = (loss[first - 1] - target) / (loss[first - 1] - loss[first])   # y_(i-1) > target >= y_i: no 0 / 0
    return float(position[first - 1] + share * (position[first] - position[first - 1]))


def mean_probe_loss_until(curve: pd.DataFrame, axis: str, end: float) -> float:
    """The curve's mean probe loss over [first eval, `end`] on `axis`: the trapezoid area under the linearly
    interpolated curve divided by the width; NaN when the run's evals do not reach `end` or `end` is not finite.

    Example:
        >>> curve = pd.DataFrame({"steps": [0.0, 10.0, 40.0], "probe_loss": [4.0, 2.0, 2.0]})
        >>> mean_probe_loss_until(curve, "steps", 20.0)   # (10 x 3 + 10 x 2) / 20; a plain mean of evals: 3.0
        2.5
        >>> mean_probe_loss_until(curve, "steps", 50.0)
        nan
    """
    if axis not in curve.columns or not np.isfinite(end):
        return float("nan")
    position, loss = _in_eval_order(curve, axis)
    keep = np.isfinite(position)
    position, loss = position[keep], loss[keep]
    if not position.size or end < position[0] or end > position.max():
        return float("nan")
    if end == position[0]:
        return float(loss[0])
    inside = position < end
    xs = np.r_[position[inside], end]
    ys = np.r_[loss[inside], value_at(position, loss, end)]
    area = float(np.sum((ys[1:] + ys[:-1]) / 2.0 * np.diff(xs)))
    return area / float(end - position[0])
