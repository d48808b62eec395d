"""Forgetting: the one definition of band forgetting, example forgetting events, interference and the loop score.

Inputs are the run-directory tables of docs/CONTRACTS.md: `probes.jsonl` rows (step, band, band_lo, band_hi, loss,
acc, tokens: one per eval and length band) and `presentations.parquet` rows (sample_index, epoch, step, length, band,
acc: one per presentation of a training example, accuracy from the same forward pass, before the update).

Formulas (METRICS.md, "Forgetting"):
    band forgetting      F_b = mean over evals t of max(0, max_(s<=t) acc_b(s) - acc_b(t))   (Chaudhry et al. 2018)
    final drop           drop_b = max_s acc_b(s) - acc_b(T)
    example forgetting   learned = acc >= theta (0.5); an event = learned -> not learned between two consecutive
                         presentations of the same example (Toneva et al. 2019). Over the examples presented at least
                         twice: events per example = mean event count, fraction ever forgotten = share with >= 1
                         event, never-learned fraction = share never reaching theta. Also split by length band.
    interference         intervals k = (eval_(k-1), eval_k] of training steps; x_a,k = fraction of the interval's real
                         training tokens from band a; y_b,k = loss_b(eval_k) - loss_b(eval_(k-1)).
                         I[a, b] = slope of y_b on x_a with the learning curve as a nuisance covariate:
                         the least-squares fit y_b ~ cubic(log s_k) + I[a, b] x_a (s_k = eval_k), computed as
                         cov(x~_a, y~_b) / var(x~_a) on the residuals x~, y~ of x_a and y_b after regressing each on
                         [1, log s, log^2 s, log^3 s] (Frisch-Waugh). Without it, the shrinking size of the loss
                         drops over training leaks into every slope whenever band shares drift in time.
                         I[a, b] > 0 for a != b: intervals richer in band a raise band b's probe loss.
    loop score           band-relative probe log-loss g_b(t) = log loss_b(t) - mean over bands of log loss_b'(t)
                         (removes the learning curve all bands share; one band alone: g_b = log loss_b), then
                         e_b(t) = g_b(t) - (least-squares fit of g_b on [1, log t, log^2 t, log^3 t]) (removes the
                         slow drift of a band's gap). loop_b = lag-L autocorrelation of e_b
                         (jumpiness.autocorrelation), with L = max(1, round(P / E)) evals, E = median eval
                         interval in steps, P = bucket-cycle period:
                         the lag >= 2 of the highest local maximum of the autocorrelation of the per-step batch
                         composition c_t = log mean_len_t (lags up to n/2 = m) that exceeds sqrt(2 ln(100 m) / n),
                         the bound white noise stays under at all m lags together about 99% of the time; if there
                         is none, P = steps per epoch (every epoch-structured plan repeats its cycle once per epoch).
                         Loop score = mean over bands of loop_b (NaN if L > n_evals / 2); near 0 when batches are
                         well mixed (white-noise residuals give about -1/n_evals).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from dflash_lab.metrics.jumpiness import autocorrelation, autocorrelation_function
from dflash_lab.sampling.boundaries import bucket_ids

LEARNED_THRESHOLD = 0.5


# ---------------------------------------------------------------------------------------------------------- bands
def band_forgetting(acc: np.ndarray | list[float] | pd.Series) -> float:
    """F = mean over evals t of max(0, max_(s<=t) acc(s) - acc(t)) for one band's accuracy series (eval order).

    Example:
        >>> round(band_forgetting([0.2, 0.6, 0.4, 0.6]), 6)  # gaps 0, 0, 0.2, 0
        0.05
    """
    values = np.asarray(acc, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan")
    return float(np.mean(np.maximum(0.0, np.maximum.accumulate(values) - values)))


def final_drop(acc: np.ndarray | list[float] | pd.Series) -> float:
    """drop = max_s acc(s) - acc(T): how far the last eval sits below the band's best.

    Example:
        >>> round(final_drop([0.2, 0.6, 0.4, 0.5]), 6)
        0.1
    """
    values = np.asarray(acc, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan")
    return float(values.max() - values[-1])


def band_forgetting_table(probes: pd.DataFrame) -> pd.DataFrame:
    """Per band: band_lo, band_hi, n_evals, final_acc, forgetting (F_b), final_drop (drop_b).

    Args:
        probes: probes.jsonl rows (step, band, acc; band_lo/band_hi optional).

    Returns:
        DataFrame indexed by band.

    Example:
        >>> probes = pd.DataFrame({"step": [10, 20, 10, 20], "band": [0, 0, 1, 1], "acc": [0.5, 0.4, 0.1, 0.3]})
        >>> band_forgetting_table(probes)["final_drop"].round(6).tolist()
        [0.1, 0.0]
    """
    ordered = probes.sort_values(["band", "step"])
    grouped = ordered.groupby("band", sort=True)
    table = pd.DataFrame(
        {
            "n_evals": grouped["acc"].size(),
            "final_acc": grouped["acc"].last(),
            "forgetting": grouped["acc"].agg(band_forgetting),
            "final_drop": grouped["acc"].agg(final_drop),
        }
    )
    for edge in ("band_lo", "band_hi"):
        if edge in ordered.columns:
            table.insert(0 if edge == "band_lo" else 1, edge, grouped[edge].first())
    return table


# -------------------------------------------------------------------------------------------- example forgetting
def example_forgetting_events(presentations: pd.DataFrame, theta: float = LEARNED_THRESHOLD) -> pd.DataFrame:
    """One row per training example: band, presentations, events (learned -> not learned), ever_learned.

    Args:
        presentations: presentations.parquet rows (sample_index, step, acc, band; epoch/length unused here).
        theta: accuracy at or above which an example counts as learned.

    Example:
        >>> rows = pd.DataFrame({"sample_index": [7, 7, 7], "step": [1, 5, 9], "acc": [0.6, 0.2, 0.7], "band": 0})
        >>> example_forgetting_events(rows)["events"].tolist()
        [1]
    """
    ordered = presentations.sort_values(["sample_index", "step"], kind="stable")
    sample = ordered["sample_index"].to_numpy()
    learned = ordered["acc"].to_numpy(dtype=np.float64) >= theta
    same_example = sample[1:] == sample[:-1]
    # an event sits on the later presentation of a consecutive pair of the same example
    event = np.r_[False, same_example & learned[:-1] & ~learned[1:]]
    frame = pd.DataFrame(
        {
            "sample_index": sample,
            "band": ordered["band"].to_numpy() if "band" in ordered.columns else -1,
            "event": event,
            "learned": learned,
        }
    )
    grouped = frame.groupby("sample_index", sort=True)
    return pd.DataFrame(
        {
            "band": grouped["band"].first(),
            "presentations": grouped.size(),
            "events": grouped["event"].sum().astype(np.int64),
            "ever_learned": grouped["learned"].any(),
        }
    )


@dataclass(frozen=True)
class ExampleForgetting:
    """Toneva-style summary over examples presented at least twice."""

    events_per_example: float
    frac_ever_forgotten: float
    frac_never_learned: float
    n_examples: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _summarise_examples(per_example: pd.DataFrame) -> ExampleForgetting:
    repeated = per_example[per_example["presentations"] >= 2]
    if repeated.empty:
        return ExampleForgetting(float("nan"), float("nan"), float("nan"), 0)
    return ExampleForgetting(
        events_per_example=float(repeated["events"].mean()),
        frac_ever_forgotten=float((repeated["events"] > 0).mean()),
        frac_never_learned=float((~repeated["ever_learned"]).mean()),
        n_examples=int(len(repeated)),
    )


def example_forgetting(presentations: pd.DataFrame, theta: float = LEARNED_THRESHOLD) -> ExampleForgetting:
    """Events per example, fraction ever forgotten, never-learned fraction (examples presented >= 2 times).

    Example:
        >>> rows = pd.DataFrame({"sample_index": [1, 1, 2, 2], "step": [0, 4, 1, 5], "acc": [0.9, 0.1, 0.1, 0.2],
        ...                      "band": [0, 0, 1, 1]})
        >>> example_forgetting(rows).as_dict()
        {'events_per_example': 0.5, 'frac_ever_forgotten': 0.5, 'frac_never_learned': 0.5, 'n_examples': 2}
    """
    return _summarise_examples(example_forgetting_events(presentations, theta))


def example_forgetting_by_band(presentations: pd.DataFrame, theta: float = LEARNED_THRESHOLD) -> pd.DataFrame:
    """`example_forgetting` split by length band (an example's band is that of its first presentation).

    Example:
        >>> rows = pd.DataFrame({"sample_index": [1, 1, 2, 2], "step": [0, 4, 1, 5], "acc": [0.9, 0.1, 0.1, 0.2],
        ...                      "band": [0, 0, 1, 1]})
        >>> example_forgetting_by_band(rows)["events_per_example"].tolist()
        [1.0, 0.0]
    """
    per_example = example_forgetting_events(presentations, theta)
    rows = {band: _summarise_examples(group).as_dict() for band, group in per_example.groupby("band", sort=True)}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("band")


# -------------------------------------------------------------------------------------------------- interference
def step_band_tokens_from_presentations(presentations: pd.DataFrame) -> pd.DataFrame:
    """Real training tokens per (step, band): the sum of presented examples' lengths. Wide: index step, one column
    per band.

    Example:
        >>> rows = pd.DataFrame({"step": [1, 1, 2], "band": [0, 1, 1], "length": [10, 30, 20]})
        >>> step_band_tokens_from_presentations(rows).to_numpy().tolist()
        [[10, 30], [0, 20]]
    """
    return presentations.pivot_table(index="step", columns="band", values="length", aggfunc="sum", fill_value=0)


def step_band_tokens_from_lengths(
    steps: np.ndarray, real_tokens: np.ndarray, mean_len: np.ndarray, band_edges: list[tuple[int, float]]
) -> pd.DataFrame:
    """Approximate tokens per (step, band) when no per-example record exists: a step's real tokens all go to the
    band that holds its mean length. Exact for single-bucket steps whose buckets are the bands; blurs mixed steps.

    Args:
        band_edges: (band_lo, band_hi) per band id 0..B-1; band b holds lengths in (lo, hi] (sampling.bucket_ids).

    Example:
        >>> step_band_tokens_from_lengths(np.array([1, 2]), np.array([100, 50]), np.array([20.0, 300.0]),
        ...                               [(0, 64), (64, 1024)]).to_numpy().tolist()
        [[100, 0], [0, 50]]
    """
    edges = [band_edges[0][0], *[hi for _, hi in band_edges]]
    band = bucket_ids(np.asarray(mean_len, dtype=np.float64), edges)
    inside = band >= 0
    frame = pd.DataFrame({"step": np.asarray(steps)[inside], "band": band[inside],
                          "length": np.asarray(real_tokens)[inside]})
    wide = step_band_tokens_from_presentations(frame)
    return wide.reindex(columns=range(len(band_edges)), fill_value=0)


def interval_band_fractions(step_band_tokens: pd.DataFrame, eval_steps: np.ndarray) -> pd.DataFrame:
    """x_a,k: fraction of real tokens from band a among training steps in (eval_(k-1), eval_k], k = 1..K-1.

    Example:
        >>> tokens = pd.DataFrame({0: [10, 0, 5], 1: [0, 10, 15]}, index=[1, 2, 3])
        >>> interval_band_fractions(tokens, np.array([0, 2, 3])).to_numpy().tolist()
        [[0.5, 0.5], [0.25, 0.75]]
    """
    evals = np.sort(np.asarray(eval_steps))
    interval = np.searchsorted(evals, step_band_tokens.index.to_numpy(), side="left")
    inside = (interval >= 1) & (interval < evals.size)
    summed = step_band_tokens[inside].groupby(interval[inside]).sum()
    summed = summed.reindex(range(1, evals.size), fill_value=0)
    totals = summed.sum(axis=1).replace(0, np.nan)
    fractions = summed.div(totals, axis=0)
    fractions.index = pd.Index(evals[1:], name="eval_step")
    return fractions


def learning_curve_basis(steps: np.ndarray) -> np.ndarray:
    """[1, log s, log^2 s, log^3 s]: the smooth learning-curve trend removed by interference and loop score.

    A cubic in log step follows both power-law and exponential-looking loss curves (and their per-interval drops)
    closely enough over a run; it is the one trend model of this module.

    Example:
        >>> learning_curve_basis(np.array([1, np.e])).round(3).tolist()
        [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    """
    log_steps = np.log(np.maximum(np.asarray(steps, dtype=np.float64), 1.0))
    return np.column_stack([np.ones_like(log_steps), log_steps, log_steps**2, log_steps**3])


def _residualise(values: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """Residuals of the least-squares fit of each column of `values` on `basis`."""
    coefficients, *_ = np.linalg.lstsq(basis, values, rcond=None)
    return values - basis @ coefficients


def interference_matrix(
    probe_loss: pd.DataFrame, band_fractions: pd.DataFrame, *, remove_learning_curve: bool = True
) -> pd.DataFrame:
    """I[a, b]: slope of band-b probe-loss change on band-a token share, the learning curve partialled out.

    Args:
        probe_loss: index eval step (sorted), one column per probe band b: loss_b at that eval.
        band_fractions: `interval_band_fractions` for the same eval steps (index = the later eval of each interval).
        remove_learning_curve: partial `learning_curve_basis` out of x and y first (False: plain slope with
            intercept).

    Returns:
        DataFrame, rows = training band a, columns = probe band b. NaN where x_a does not vary or there are too
        few intervals (fewer than 3 more than the nuisance columns).

    Example:
        >>> rng = np.random.default_rng(0)
        >>> x_long = rng.uniform(0, 1, 200)
        >>> fractions = pd.DataFrame({0: 1 - x_long, 1: x_long}, index=np.arange(1, 201))
        >>> short_loss = np.r_[3.0, 3.0 + np.cumsum(-0.01 + 0.05 * x_long)]
        >>> loss = pd.DataFrame({0: short_loss, 1: np.linspace(3, 2, 201)}, index=np.arange(201))
        >>> round(float(interference_matrix(loss, fractions).loc[1, 0]), 3)
        0.05
    """
    changes = probe_loss.sort_index().diff().iloc[1:]
    common = changes.index.intersection(band_fractions.index)
    x = band_fractions.loc[common].astype(np.float64)
    y = changes.loc[common].astype(np.float64)
    valid = x.notna().all(axis=1) & y.notna().all(axis=1)
    x, y = x[valid], y[valid]
    result = pd.DataFrame(np.nan, index=x.columns.rename("train_band"), columns=y.columns.rename("probe_band"))
    basis = learning_curve_basis(x.index.to_numpy()) if remove_learning_curve else np.ones((len(x), 1))
    if len(x) < basis.shape[1] + 3:
        return result
    x_resid = _residualise(x.to_numpy(), basis)
    y_resid = _residualise(y.to_numpy(), basis)
    variance = np.sum(x_resid**2, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        slopes = (x_resid.T @ y_resid) / variance[:, None]
    # a band whose share never changes (beyond the trend) carries no information about its effect
    slopes[variance <= 1e-12 * len(x), :] = np.nan
    result.loc[:, :] = slopes
    return result


def mean_cross_interference(matrix: pd.DataFrame) -> float:
    """Mean of the off-diagonal entries I[a, b], a != b (NaN entries ignored): one number per run.

    Example:
        >>> mean_cross_interference(pd.DataFrame([[0.0, 1.0], [3.0, 0.0]]))
        2.0
    """
    values = matrix.to_numpy(dtype=np.float64)
    rows, cols = np.indices(values.shape)
    labels_differ = matrix.index.to_numpy()[rows] != matrix.columns.to_numpy()[cols]
    off_diagonal = values[labels_differ]
    off_diagonal = off_diagonal[np.isfinite(off_diagonal)]
    return float(off_diagonal.mean()) if off_diagonal.size else float("nan")


# ---------------------------------------------------------------------------------------------------- loop score
@dataclass(frozen=True)
class CycleLag:
    """Estimated bucket-cycle period in steps and how it was found ("composition" or "epoch")."""

    steps: int
    source: str


def estimate_cycle_lag(composition: np.ndarray, steps_per_epoch: int | None = None) -> CycleLag:
    """Bucket-cycle period P of a per-step composition series (e.g. log mean length per step).

    P = the lag >= 2 of the highest local maximum of the autocorrelation (lags up to m = n/2) above
    sqrt(2 ln(100 m) / n), which white noise crosses at any of the m lags only about 1% of the time;
    otherwise steps_per_epoch (source "epoch"); otherwise 0 (source "none").

    Example:
        >>> cycle = np.tile(np.r_[np.full(4, 3.0), np.full(4, 5.0), np.full(4, 6.0)], 20)
        >>> estimate_cycle_lag(cycle)
        CycleLag(steps=12, source='composition')
    """
    series = np.asarray(composition, dtype=np.float64)
    series = series[np.isfinite(series)]
    if series.size >= 8:
        acf = autocorrelation_function(series, series.size // 2)
        if np.all(np.isfinite(acf)) and acf.size >= 4:
            inner = acf[1:-1]
            peaks = np.flatnonzero((inner > acf[:-2]) & (inner >= acf[2:])) + 1
            # a bound for the largest of m white-noise autocorrelations (each ~ N(0, 1/n)), not for one of them
            bound = np.sqrt(2.0 * np.log(100.0 * (acf.size - 1)) / series.size)
            peaks = peaks[(peaks >= 2) & (acf[peaks] > bound)]
            if peaks.size:
                return CycleLag(int(peaks[np.argmax(acf[peaks])]), "composition")
    if steps_per_epoch:
        return CycleLag(int(steps_per_epoch), "epoch")
    return CycleLag(0, "none")


def probe_loss_residuals(probe_loss: pd.DataFrame) -> pd.DataFrame:
    """e_b(t): band-relative log probe loss with its smooth drift removed (see the module docstring).

    Args:
        probe_loss: index eval step (sorted), one column per band; rows with a missing band are dropped.

    Returns:
        DataFrame of residuals, same shape; all NaN with fewer than 6 evals.

    Example:
        >>> steps = np.arange(1, 50) * 10
        >>> curve = 3 - 0.2 * np.log(steps)
        >>> frame = pd.DataFrame({0: curve, 1: 1.5 * curve}, index=steps)  # same shape, different level
        >>> bool(np.allclose(probe_loss_residuals(frame), 0))
        True
    """
    ordered = probe_loss.sort_index().dropna()
    log_loss = np.log(np.maximum(ordered.to_numpy(dtype=np.float64), 1e-12))
    if len(ordered) < 6:  # the trend takes 4 parameters; leave at least 2 degrees of freedom
        return pd.DataFrame(np.nan, index=ordered.index, columns=ordered.columns)
    if log_loss.shape[1] >= 2:
        # the learning curve every band shares is not a loop: keep each band's gap to the others
        log_loss = log_loss - log_loss.mean(axis=1, keepdims=True)
    residual = _residualise(log_loss, learning_curve_basis(ordered.index.to_numpy()))
    return pd.DataFrame(residual, index=ordered.index, columns=ordered.columns)


@dataclass(frozen=True)
class LoopScore:
    """Loop score (mean over bands), per-band values, and the lag used."""

    score: float
    per_band: dict
    lag_evals: int
    cycle: CycleLag


def loop_score(probe_loss: pd.DataFrame, cycle: CycleLag) -> LoopScore:
    """Mean over bands of the lag-L autocorrelation of probe-loss residuals, L = max(1, round(P / E)).

    Args:
        probe_loss: index eval step (sorted), one column per band.
        cycle: the bucket-cycle period from `estimate_cycle_lag`.

    Returns:
        LoopScore; score is NaN when the series is too short for the lag (L > n_evals / 2) or P is unknown.

    Example:
        >>> steps = np.arange(1, 41) * 10
        >>> trend = 2 - 0.1 * np.log(steps)
        >>> wave = 0.05 * np.sin(2 * np.pi * np.arange(40) / 5)
        >>> frame = pd.DataFrame({0: trend + wave, 1: trend - wave}, index=steps)  # bands take turns: a loop
        >>> result = loop_score(frame, CycleLag(50, "composition"))
        >>> result.lag_evals, result.score > 0.8
        (5, True)
    """
    residuals = probe_loss_residuals(probe_loss)
    steps = residuals.index.to_numpy(dtype=np.float64)
    if steps.size < 2 or cycle.steps <= 0:
        return LoopScore(float("nan"), {}, 0, cycle)
    eval_interval = float(np.median(np.diff(steps)))
    lag = max(1, int(round(cycle.steps / eval_interval))) if eval_interval > 0 else 1
    if lag > steps.size // 2:  # beyond half the series the estimate rests on too few pairs
        return LoopScore(float("nan"), {}, lag, cycle)
    scale = 1e-9 * (1.0 + float(np.nanmax(np.abs(np.log(np.maximum(probe_loss.to_numpy(dtype=float), 1e-12))))))
    # bands that only differ by a constant leave rounding noise, whose autocorrelation would be meaningless
    per_band = {
        band: autocorrelation(residuals[band].to_numpy(), lag) if residuals[band].std() > scale else float("nan")
        for band in residuals.columns
    }
    finite = [value for value in per_band.values() if np.isfinite(value)]
    return LoopScore(float(np.mean(finite)) if finite else float("nan"), per_band, lag, cycle)
