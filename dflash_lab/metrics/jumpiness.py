"""Loss jumpiness: the one definition of how "jumpy" a per-step training loss is.

All functions take the per-step training loss L_t (1-D, consumption order) and are vectorized numpy/pandas.

Formulas:
    steady state          starts at the first step t where the loss EMA has covered 90% of its descent from its
                          first to its final value, EMA_0 - EMA_t >= 0.9 (EMA_0 - EMA_(n-1)), and never before
                          ceil(0.1 n); no descent (EMA_(n-1) >= EMA_0): at ceil(0.1 n). At least `min_keep` steps
                          (or all, if fewer) stay in it. Before it, learning itself moves the loss from step to
                          step, so a statistic there measures the learning curve (and run length), not the policy.
    d_t                   = log L_t - log L_(t-1)
    jumpiness             = std(d_t)                                  (population std, ddof = 0)
    robust jumpiness      = 1.4826 x median(|d_t - median(d)|)        (MAD scaled to the std of a normal)
    EMA_t                 = EMA_(t-1) + alpha x (L_t - EMA_(t-1)), EMA_0 = L_0
                            (the same recurrence as `throughput.ema_update`, vectorized)
    residual r_t          = L_t - EMA_t
    lag-k autocorrelation = sum_t (x_t - m)(x_(t+k) - m) / sum_t (x_t - m)^2          (m = mean(x))
                            lag-1 of r_t: negative = step-to-step noise, positive = slow oscillation
    spike score           = fraction of steps t with L_t > mean(W_t) + 6 std(W_t), W_t = the previous 128 losses
                            (OLMo-core StabilityMonitor). Until 128 losses exist, W_t is all previous losses,
                            and steps with fewer than `min_history` previous losses are not scored.
    length confound R^2   = 1 - SS(e) / SS(r - mean r), e = residuals of the least-squares fit
                            r_t ~ 1 + log mean_len_t + log max_len_t + one_hot(bucket_t)
    residual jumpiness    = jumpiness of L'_t = EMA_t + e_t, the loss with the length-explained part of r_t removed
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

ArrayLike = Sequence[float] | np.ndarray | pd.Series

MAD_TO_STD = 1.4826
DEFAULT_EMA_ALPHA = 0.1
SPIKE_WINDOW = 128
SPIKE_SIGMAS = 6.0
SPIKE_MIN_HISTORY = 32   # previous losses a step needs to be scored (spike_score: at least 33 logged losses)
STEADY_DESCENT_FRAC = 0.9
STEADY_MIN_FRAC = 0.1


def _as_float_array(values: ArrayLike) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).reshape(-1)


def steady_state_start(
    loss: ArrayLike,
    *,
    alpha: float = DEFAULT_EMA_ALPHA,
    descent_frac: float = STEADY_DESCENT_FRAC,
    min_frac: float = STEADY_MIN_FRAC,
    min_keep: int = 8,
) -> int:
    """Index of the first steady-state step of a per-step loss series (rule in the module docstring).

    Args:
        loss: per-step training loss L_t in consumption order (non-finite values are skipped by the EMA).
        alpha: EMA smoothing factor.
        descent_frac: share of the EMA's first-to-final descent that must be covered (0.9).
        min_frac: the steady state never starts before ceil(min_frac x n) (0.1).
        min_keep: the steady state keeps at least this many steps (all of them when the series is shorter).

    Example:
        >>> loss = np.r_[np.linspace(5.0, 2.0, 300), np.full(700, 2.0)]  # 90% of the descent at step 270
        >>> steady_state_start(loss)  # the EMA lags the loss by about (1 - alpha) / alpha = 9 steps
        279
        >>> steady_state_start(np.full(1000, 2.0))  # no descent: the 10% floor
        100
    """
    values = _as_float_array(loss)
    n = values.size
    start = int(math.ceil(min_frac * n))
    smooth = ema(np.where(np.isfinite(values), values, np.nan), alpha)
    finite = np.flatnonzero(np.isfinite(smooth))
    if finite.size >= 2:
        first, final = smooth[finite[0]], smooth[finite[-1]]
        descent = first - final
        if descent > 0:
            covered = np.flatnonzero(np.isfinite(smooth) & (first - smooth >= descent_frac * descent))
            start = max(start, int(covered[0]))
    return int(min(start, max(n - min_keep, 0)))


def steady_state(values: ArrayLike, **kwargs) -> np.ndarray:
    """The steady-state part of a per-step loss series (see `steady_state_start` for the rule and its arguments).

    Example:
        >>> steady_state(np.full(100, 2.0)).size
        90
    """
    array = _as_float_array(values)
    return array[steady_state_start(array, **kwargs):]


def log_loss_diffs(loss: ArrayLike) -> np.ndarray:
    """d_t = log L_t - log L_(t-1); non-positive or non-finite losses are dropped first (log is undefined there).

    Example:
        >>> np.round(log_loss_diffs([1.0, np.e, 1.0]), 6).tolist()
        [1.0, -1.0]
    """
    values = _as_float_array(loss)
    values = values[np.isfinite(values) & (values > 0)]
    return np.diff(np.log(values))


def jumpiness(loss: ArrayLike) -> float:
    """std(d_t) of the log-loss differences; NaN with fewer than 2 differences.

    Example:
        >>> round(jumpiness([1.0, 2.0, 1.0, 2.0, 1.0]), 4)  # d = +-log 2, std = log 2
        0.6931
    """
    diffs = log_loss_diffs(loss)
    return float(np.std(diffs)) if diffs.size >= 2 else float("nan")


def robust_jumpiness(loss: ArrayLike) -> float:
    """1.4826 x median(|d_t - median(d)|): insensitive to a few spikes; equals std(d) for normal d.

    Example:
        >>> round(robust_jumpiness([1.0, 2.0, 1.0, 2.0, 1.0]), 4)
        1.0277
    """
    diffs = log_loss_diffs(loss)
    if diffs.size < 2:
        return float("nan")
    return float(MAD_TO_STD * np.median(np.abs(diffs - np.median(diffs))))


def ema(values: ArrayLike, alpha: float = DEFAULT_EMA_ALPHA) -> np.ndarray:
    """EMA_t = EMA_(t-1) + alpha (x_t - EMA_(t-1)), EMA_0 = x_0 (vectorized `throughput.ema_update`).

    Example:
        >>> ema([0.0, 10.0, 10.0], alpha=0.5).tolist()
        [0.0, 5.0, 7.5]
    """
    return pd.Series(_as_float_array(values)).ewm(alpha=alpha, adjust=False).mean().to_numpy()


def ema_residuals(loss: ArrayLike, alpha: float = DEFAULT_EMA_ALPHA) -> np.ndarray:
    """r_t = L_t - EMA_t: the part of the loss its recent trend does not explain.

    Example:
        >>> ema_residuals([1.0, 3.0], alpha=0.5).tolist()
        [0.0, 1.0]
    """
    values = _as_float_array(loss)
    return values - ema(values, alpha)


def autocorrelation(values: ArrayLike, lag: int = 1) -> float:
    """sum (x_t - m)(x_(t+lag) - m) / sum (x_t - m)^2; NaN if the series is constant or shorter than lag + 2.

    Example:
        >>> round(autocorrelation(np.sin(2 * np.pi * np.arange(400) / 20), lag=1), 2)  # ~ cos(2 pi / 20)
        0.95
    """
    x = _as_float_array(values)
    x = x[np.isfinite(x)]
    if lag < 0 or x.size < lag + 2:
        return float("nan")
    centred = x - x.mean()
    denominator = float(np.dot(centred, centred))
    if denominator <= 0:
        return float("nan")
    return float(np.dot(centred[: x.size - lag], centred[lag:]) / denominator)


def residual_autocorrelation(loss: ArrayLike, lag: int = 1, alpha: float = DEFAULT_EMA_ALPHA) -> float:
    """Lag-`lag` autocorrelation of the EMA residuals r_t = L_t - EMA_t.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> residual_autocorrelation(2 + 0.1 * rng.standard_normal(5000)) < 0  # white noise: step-to-step noise
        True
    """
    return autocorrelation(ema_residuals(loss, alpha), lag)


def spike_flags(
    loss: ArrayLike, window: int = SPIKE_WINDOW, n_sigma: float = SPIKE_SIGMAS, min_history: int = SPIKE_MIN_HISTORY
) -> np.ndarray:
    """Per-step spike flag: L_t > mean(W_t) + n_sigma std(W_t), W_t = up to `window` previous losses.

    Returns a float array: 1.0 spike, 0.0 no spike, NaN where fewer than `min_history` previous losses exist.

    Example:
        >>> series = np.r_[np.ones(40) + 0.01 * np.sin(np.arange(40)), 5.0]
        >>> float(spike_flags(series)[-1])
        1.0
    """
    values = pd.Series(_as_float_array(loss))
    history = values.rolling(window, min_periods=max(int(min_history), 2))
    # shift(1): the window holds the losses *before* step t, never L_t itself
    mean = history.mean().shift(1)
    std = history.std(ddof=0).shift(1)
    flags = (values > mean + n_sigma * std).astype(np.float64)
    flags[mean.isna() | values.isna()] = np.nan
    return flags.to_numpy()


def spike_score(
    loss: ArrayLike, window: int = SPIKE_WINDOW, n_sigma: float = SPIKE_SIGMAS, min_history: int = SPIKE_MIN_HISTORY
) -> float:
    """Fraction of scored steps that are spikes (see `spike_flags`); NaN if no step can be scored.

    Example:
        >>> series = np.r_[np.ones(99) + 0.01 * np.sin(np.arange(99)), 5.0]
        >>> round(spike_score(series), 4)  # 1 spike among the 68 steps with >= 32 previous losses
        0.0147
    """
    flags = spike_flags(loss, window, n_sigma, min_history)
    scored = flags[np.isfinite(flags)]
    return float(scored.mean()) if scored.size else float("nan")


def length_design_matrix(
    mean_len: ArrayLike | None = None, max_len: ArrayLike | None = None, bucket: ArrayLike | None = None
) -> np.ndarray | None:
    """Batch-feature matrix for the length-confound fit: [1, log mean_len, log max_len, one_hot(bucket)].

    Missing features are left out. The one-hot drops the first bucket level, which the intercept absorbs;
    a single bucket level (unbucketed policies log -1 everywhere) contributes no column.
    Returns None when no feature is given.

    Example:
        >>> length_design_matrix([10, 20], None, [0, 1]).round(3).tolist()
        [[1.0, 2.303, 0.0], [1.0, 2.996, 1.0]]
    """
    columns: list[np.ndarray] = []
    size = None
    for feature in (mean_len, max_len):
        if feature is not None:
            values = _as_float_array(feature)
            columns.append(np.log(np.maximum(values, 1.0)))
            size = values.size
    if bucket is not None:
        bucket_ids = np.asarray(bucket).reshape(-1)
        levels = np.unique(bucket_ids)
        columns.extend((bucket_ids == level).astype(np.float64) for level in levels[1:])
        size = bucket_ids.size
    if size is None:
        return None
    return np.column_stack([np.ones(size), *columns])


@dataclass(frozen=True)
class LengthConfound:
    """Result of the length-confound fit: R^2 of r_t on batch features and the jumpiness left after removing it."""

    r2: float
    residual_jumpiness: float
    n_features: int


def length_confound(
    loss: ArrayLike,
    mean_len: ArrayLike | None = None,
    max_len: ArrayLike | None = None,
    bucket: ArrayLike | None = None,
    *,
    alpha: float = DEFAULT_EMA_ALPHA,
    steady: slice | None = None,
) -> LengthConfound:
    """Share of var(r_t) explained by batch length features, and the residual jumpiness.

    r_t = L_t - EMA_t is computed on the whole series (so the EMA is warmed up), then the fit uses the steps in
    `steady` (default: all). R^2 = 1 - SS(e)/SS(r - mean r); residual jumpiness = jumpiness(EMA_t + e_t).

    Example:
        >>> rng = np.random.default_rng(0)
        >>> lengths = rng.integers(16, 1024, 2000).astype(float)
        >>> loss = 2.0 + 0.2 * np.log(lengths) + 0.01 * rng.standard_normal(2000)
        >>> length_confound(loss, mean_len=lengths).r2 > 0.9
        True
    """
    values = _as_float_array(loss)
    design = length_design_matrix(mean_len, max_len, bucket)
    window = steady if steady is not None else slice(None)
    if design is None or design.shape[1] < 2:
        return LengthConfound(float("nan"), float("nan"), 0)
    trend = ema(values, alpha)
    residual = values - trend
    y, x, trend = residual[window], design[window], trend[window]
    keep = np.isfinite(y) & np.all(np.isfinite(x), axis=1)
    y, x, trend = y[keep], x[keep], trend[keep]
    if y.size <= x.shape[1]:
        return LengthConfound(float("nan"), float("nan"), x.shape[1] - 1)
    coefficients, *_ = np.linalg.lstsq(x, y, rcond=None)
    fit_residual = y - x @ coefficients
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(fit_residual**2)) / total if total > 0 else float("nan")
    # the adjusted loss must stay positive for the log in jumpiness; clip at a tiny fraction of the trend
    adjusted = np.maximum(trend + fit_residual, 1e-6 * np.maximum(trend, 1e-12))
    return LengthConfound(r2, jumpiness(adjusted), x.shape[1] - 1)


@dataclass(frozen=True)
class JumpinessReport:
    """All jumpiness figures of one run's steady state."""

    jumpiness: float
    robust_jumpiness: float
    resid_lag1_acf: float
    spike_score: float
    length_r2: float
    residual_jumpiness: float
    steady_start: int
    steady_steps: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def jumpiness_report(
    loss: ArrayLike,
    mean_len: ArrayLike | None = None,
    max_len: ArrayLike | None = None,
    bucket: ArrayLike | None = None,
    *,
    alpha: float = DEFAULT_EMA_ALPHA,
    steady_start: int | None = None,
) -> JumpinessReport:
    """Every jumpiness metric on the steady state of one run's per-step loss (and its batch features).

    The EMA residuals and the spike windows use the whole series (so they are warmed up); statistics count only
    steady-state steps.

    Args:
        steady_start: index of the first steady-state step; default `steady_state_start(loss, alpha=alpha)`.

    Example:
        >>> rng = np.random.default_rng(1)
        >>> report = jumpiness_report(2.0 + 0.05 * rng.standard_normal(500))
        >>> report.steady_start, report.steady_steps
        (50, 450)
    """
    values = _as_float_array(loss)
    start = steady_state_start(values, alpha=alpha) if steady_start is None else int(steady_start)
    steady_loss = values[start:]
    residual = ema_residuals(values, alpha)[start:]
    flags = spike_flags(values)[start:]
    scored = flags[np.isfinite(flags)]
    confound = length_confound(values, mean_len, max_len, bucket, alpha=alpha, steady=slice(start, None))
    return JumpinessReport(
        jumpiness=jumpiness(steady_loss),
        robust_jumpiness=robust_jumpiness(steady_loss),
        resid_lag1_acf=autocorrelation(residual, 1),
        spike_score=float(scored.mean()) if scored.size else float("nan"),
        length_r2=confound.r2,
        residual_jumpiness=confound.residual_jumpiness,
        steady_start=start,
        steady_steps=int(steady_loss.size),
    )
