"""The epoch from a sample of its steps (benchmarks/gpu_check.py's ``gpu_check_epoch`` line): which steps to time,
the fit of step time on executed FLOPs, and the epoch's Ktok/s from that fit next to the planner's.

Sample (``stratified_steps``): the epoch plan's steps sorted by cost (executed FLOPs of the slowest rank, as the
memory/FLOP model counts them) and cut into k strata of equal count (the sorted order split into k runs whose sizes
differ by at most one); from each stratum the step at its middle, so one step per cost quantile band (k = 10: one per
decile). Every stratum is as large as the others, so the sample's plain means are unbiased for the epoch's means
where a sample of the plan's first steps is not: the first H200 run timed six such steps and the costliest of them
did not fit, so its sample carried 25.3 real Ktok per executed PFLOP against the epoch's 19.7. Steps given in
``exclude`` (the warm-up's) are not chosen: a stratum takes its nearest other step. O(S log S) for S steps.

Fit (``fit_step_time``): least squares of step seconds on executed FLOPs, ``seconds = a + b x FLOPs`` with
``a, b >= 0`` (non-negative least squares, as the planner's own fits: a step never takes less time for more work;
``a``: the step's fixed cost, launches and host work; ``1 / b``: the marginal FLOP rate). Needs two different FLOP
counts; ``rms_rel_residual`` says how well one line holds (the first H200 run: every clean step within 3% of
executed FLOPs / 430 TFLOP/s).

Epoch (``fitted_cost``): the fit is the FLOPs form of the planner's cost model (``dflash_lab.planning.cost.CostModel``
with ``c0 = a``, utilisation 1 and a "peak" of ``1 / b``; ``b = 0``: the constant ``c0 = a``), so ``predict_throughput`` prices every step of the epoch
plan with it: the epoch's Ktok/s over time and its median step, defined as the planner defines its own figure,
which stands beside it. The ratio of two policies' epoch Ktok/s is then the measured counterpart of the planner's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from dflash_lab.planning.cost import CostModel


def stratified_steps(cost: Sequence[float] | np.ndarray, strata: int, exclude: Iterable[int] = ()) -> list[int]:
    """One step per cost stratum (module docstring), in increasing cost.

    Args:
        cost: the cost of every step of the epoch plan (executed FLOPs of the slowest rank).
        strata: how many strata (and steps); at most the number of steps not excluded.
        exclude: steps not to choose (the warm-up's).

    Raises:
        ValueError: fewer steps to choose from than strata, or strata < 1.

    Example:
        >>> stratified_steps([5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 4.0], 3)   # strata {1, 2, 3}, {4, 5}, {7, 9}
        [5, 6, 4]
    """
    cost = np.asarray(cost, dtype=np.float64)
    excluded = {int(i) for i in exclude}
    candidates = np.array([i for i in range(cost.size) if i not in excluded], dtype=np.int64)
    if strata < 1 or candidates.size < strata:
        raise ValueError(f"{strata} strata need at least {max(strata, 1)} steps to choose from, the plan has "
                         f"{candidates.size}: raise --num-samples or lower --steps")
    order = candidates[np.argsort(cost[candidates], kind="stable")]
    return [int(run[(run.size - 1) // 2]) for run in np.array_split(order, strata)]


@dataclass(frozen=True)
class StepTimeFit:
    """``seconds = intercept_s + slope_s_per_flop x executed FLOPs``, fitted on ``points`` steps."""

    intercept_s: float
    slope_s_per_flop: float
    points: int
    rms_rel_residual: float   # root mean square of (measured - fitted) / measured over the points

    @property
    def marginal_tflops(self) -> float | None:
        """The rate of one more FLOP: 1 / slope, in TFLOP/s (None for a slope of 0: more work took no longer)."""
        return 1.0 / self.slope_s_per_flop / 1e12 if self.slope_s_per_flop > 0 else None

    def as_dict(self) -> dict:
        return {**asdict(self), "slope_s_per_pflop": self.slope_s_per_flop * 1e15,
                "marginal_tflops": self.marginal_tflops}


def fit_step_time(flops: Sequence[float] | np.ndarray, seconds: Sequence[float] | np.ndarray) -> StepTimeFit:
    """Least-squares line of step seconds on executed FLOPs with ``a, b >= 0`` (module docstring).

    Raises:
        ValueError: fewer than two steps, or every step the same FLOPs (the slope is not determined).

    Example:
        >>> fit = fit_step_time([1e15, 2e15, 4e15], [2.5, 4.5, 8.5])
        >>> round(fit.intercept_s, 6), round(fit.marginal_tflops, 3)
        (0.5, 500.0)
        >>> fit_step_time([1e15, 2e15, 4e15], [3.0, 2.0, 2.5]).slope_s_per_flop   # more work was not slower
        0.0
    """
    from scipy.optimize import nnls

    x = np.asarray(flops, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError(f"the step-time fit needs at least two steps of different executed FLOPs, got {x.size} "
                         f"step(s) of {np.unique(x).size} distinct FLOP count(s)")
    scale = x.max()   # FLOPs ~1e15: scaled so the solver sees comparable columns
    (a, b), _ = nnls(np.stack([np.ones_like(x), x / scale], axis=1), y)
    fitted = a + b * x / scale
    return StepTimeFit(float(a), float(b / scale), int(x.size), float(np.sqrt(np.mean(((y - fitted) / y) ** 2))))


def clean_step_records(lines: Iterable[Mapping], phases: Sequence[str] = ("timed",)) -> list[Mapping]:
    """The step records a fit may use: of the given phases, neither compiling nor out of memory."""
    return [r for r in lines if r.get("phase") in phases and not r.get("compiled") and not r.get("oom")]


def fit_step_records(lines: Iterable[Mapping], phases: Sequence[str] = ("timed",)) -> StepTimeFit:
    """``fit_step_time`` on gpu_check's step records (``seconds``, ``executed_tflop``) of the given phases,
    compiling and out-of-memory steps left out (``clean_step_records``)."""
    clean = clean_step_records(lines, phases)
    return fit_step_time([r["executed_tflop"] * 1e12 for r in clean], [r["seconds"] for r in clean])


def fitted_cost(fit: StepTimeFit) -> CostModel:
    """The fit as the planner's cost model: the FLOPs form ``c0 + FLOPs / (utilisation x peak)`` with utilisation
    1 and peak 1 / slope, so ``predict_throughput`` prices an epoch plan with the measured line; a slope of 0 (step
    time did not grow with FLOPs in the sample, e.g. a CPU step dominated by fixed costs) is the constant
    ``c0 = a`` of the linear form: every step at the same time."""
    if fit.slope_s_per_flop > 0:
        return CostModel(c0=fit.intercept_s, utilisation=1.0, peak_tflops=fit.marginal_tflops)
    return CostModel(c0=fit.intercept_s)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or not denominator > 0 or not np.isfinite(numerator):
        return None
    return float(numerator) / float(denominator)
