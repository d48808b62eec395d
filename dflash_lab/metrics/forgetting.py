"""Forgetting: the one definition of every forgetting figure, from probe bands and example presentations.

Inputs are the run-directory tables (docs/CONTRACTS.md): `probes.jsonl` rows (step, band, band_lo, band_hi, loss,
acc, tokens: one per eval and length band, each probe example scored on fixed anchors), `presentations.parquet` rows
(sample_index, epoch, step, length, band, acc: one per presentation of a training example, scored on its fixed
anchors in the training forward pass, before the update), and real training tokens per (step, band).

Formulas (L_b(t): probe loss of band b at eval step t; B bands; logs are natural):
    band forgetting    F_b = mean over evals t of max(0, max_(s<=t) acc_b(s) - acc_b(t))  (Chaudhry et al. 2018)
    final drop         drop_b = max_s acc_b(s) - acc_b(T)
    window             the probe dynamics below use the evals at or after the steady-state start of the training
                       loss (jumpiness.steady_state_start): before it, learning moves every band at once
    trend basis        T(t) = [1, log t, log^2 t]: the smooth part of a curve, a low-order fit in log step
    band-relative      g_b(t) = log L_b(t) - mean over bands of log L_b'(t) (the learning curve all bands share
                       removed; one band: g = log L), e_b(t) = g_b(t) - least-squares fit of g_b on T(t)
    residual amplitude A = mean over bands of sqrt(sum_t e_b(t)^2 / (n - 3)) (n evals, 3 trend columns). A recency
                       drift between bands (each band's loss falls while it is trained and rises while others are)
                       inflates A; a well-mixed order leaves only evaluation and SGD noise.
    intervals          k = (t_(k-1), t_k] between consecutive evals; s_b,k = share of the interval's real training
                       tokens from band b; y_b,k = log L_b(t_k) - log L_b(t_(k-1))
    own-share slope    beta_b = coefficient of s_b in the least-squares fit y_b ~ T(t_k) + beta_b s_b,k (T absorbs
                       the learning curve's shrinking drops), se_b its OLS standard error;
                       beta = sum_b w_b beta_b / sum_b w_b, w_b = band b's training tokens in the window;
                       se(beta) = sqrt(sum_b w_b^2 se_b^2) / sum_b w_b (bands treated as independent).
                       beta < 0: a band's loss falls with its own recent share, i.e. the model moves toward what it
                       saw recently (the loop mechanism).
    cross-band effect  shares sum to 1, so a fit on all shares is not identifiable (its off-diagonal slopes average
                       positive whenever the diagonal is negative). For each probe band b: reference band r(b) =
                       b - 1 (band 1 for band 0), fit y_b ~ T(t_k) + s_b,k + sum over c not in {b, r(b)} of
                       C[c, b] s_c,k. In a model y_b = sum_c M[c, b] s_c + trend, C[a, b] = M[a, b] - M[r(b), b]:
                       the change of band b's loss when training tokens move from its neighbour r(b) to band a at a
                       fixed own share (s_b held out of the contrast). A planted zero cross effect reads zero; an
                       equal effect of all other bands on b is not identifiable from shares (beta absorbs it).
                       cross-band effect = mean of C[a, b] over pairs a not in {b, r(b)} (needs >= 3 bands).
                       > 0: training on bands farther than the neighbour raises b's loss more (interference).
    minimum evals      n = window evals (n - 1 intervals). A and beta: n >= 8 (MIN_EVALS). Cross-band effect:
                       n >= max(8, B + 5) (cross_band_min_evals; each fit has B + 2 columns and keeps 2 residual
                       degrees of freedom), 11 for 6 bands. Below it the figure is NaN and the run's notes say why.
    loop score         only for periodic orders (PERIODIC_ORDERS, period P = steps per epoch): mean over bands of
                       the lag-L autocorrelation of e_b (jumpiness.autocorrelation), L = round(P / E) evals,
                       E = median eval interval; NaN for shuffled orders (no period to look at; A and beta apply)
                       and when L > n_evals / 2.
    example forgetting learned = acc >= theta (0.5); event = learned -> not learned between two consecutive
                       presentations of an example (Toneva et al. 2019). Over the examples presented >= 3 times:
                       events per example (mean count), fraction ever forgotten (>= 1 event), fraction never
                       learned. NaN when no example was presented 3 times (one event needs a learn and a loss).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from dflash_lab.metrics.jumpiness import autocorrelation
from dflash_lab.metrics.bands import bucket_ids

LEARNED_THRESHOLD = 0.5
MIN_PRESENTATIONS = 3
PERIODIC_ORDERS = frozenset({"bucket_sequential"})
TREND_COLUMNS = 3  # [1, log t, log^2 t]
MIN_EVALS = 8  # evals in the window for A, beta and the cross effect: the fits keep a few degrees of freedom


def cross_band_min_evals(n_bands: int) -> int:
    """Fewest window evals for the cross-band effect with `n_bands` probe bands: the fit of each band has
    TREND_COLUMNS + 1 + (n_bands - 2) columns and keeps 2 residual degrees of freedom on the n - 1 intervals, so
    n >= TREND_COLUMNS + n_bands + 2, never below MIN_EVALS. The one place this rule lives (`cross_band_effects`,
    analysis.summarize's notes).

    Example:
        >>> cross_band_min_evals(3), cross_band_min_evals(4), cross_band_min_evals(6)
        (8, 9, 11)
    """
    return max(MIN_EVALS, TREND_COLUMNS + int(n_bands) + 2)


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
    """Toneva-style summary over the examples presented at least MIN_PRESENTATIONS times."""

    events_per_example: float
    frac_ever_forgotten: float
    frac_never_learned: float
    n_examples: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _summarise_examples(per_example: pd.DataFrame) -> ExampleForgetting:
    repeated = per_example[per_example["presentations"] >= MIN_PRESENTATIONS]
    if repeated.empty:
        return ExampleForgetting(float("nan"), float("nan"), float("nan"), 0)
    return ExampleForgetting(
        events_per_example=float(repeated["events"].mean()),
        frac_ever_forgotten=float((repeated["events"] > 0).mean()),
        frac_never_learned=float((~repeated["ever_learned"]).mean()),
        n_examples=int(len(repeated)),
    )


def example_forgetting(presentations: pd.DataFrame, theta: float = LEARNED_THRESHOLD) -> ExampleForgetting:
    """Events per example, fraction ever forgotten, never-learned fraction (examples presented >= 3 times).

    Example:
        >>> rows = pd.DataFrame({"sample_index": [1, 1, 1, 2, 2, 2], "step": [0, 4, 8, 1, 5, 9],
        ...                      "acc": [0.9, 0.1, 0.8, 0.1, 0.2, 0.1], "band": [0, 0, 0, 1, 1, 1]})
        >>> example_forgetting(rows).as_dict()
        {'events_per_example': 0.5, 'frac_ever_forgotten': 0.5, 'frac_never_learned': 0.5, 'n_examples': 2}
        >>> example_forgetting(rows[rows["step"] < 8]).n_examples  # two presentations each: no verdict
        0
    """
    return _summarise_examples(example_forgetting_events(presentations, theta))


def example_forgetting_by_band(presentations: pd.DataFrame, theta: float = LEARNED_THRESHOLD) -> pd.DataFrame:
    """`example_forgetting` split by length band (an example's band is that of its first presentation).

    Example:
        >>> rows = pd.DataFrame({"sample_index": [1, 1, 1, 2, 2, 2], "step": [0, 4, 8, 1, 5, 9],
        ...                      "acc": [0.9, 0.1, 0.8, 0.1, 0.2, 0.1], "band": [0, 0, 0, 1, 1, 1]})
        >>> example_forgetting_by_band(rows)["events_per_example"].tolist()
        [1.0, 0.0]
    """
    per_example = example_forgetting_events(presentations, theta)
    rows = {band: _summarise_examples(group).as_dict() for band, group in per_example.groupby("band", sort=True)}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("band")


# ----------------------------------------------------------------------------------------- band token shares
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


def interval_band_tokens(step_band_tokens: pd.DataFrame, eval_steps: np.ndarray) -> pd.DataFrame:
    """Real training tokens per band in each interval (eval_(k-1), eval_k], k = 1..K-1; index = eval_k.

    Example:
        >>> tokens = pd.DataFrame({0: [10, 0, 5], 1: [0, 10, 15]}, index=[1, 2, 3])
        >>> interval_band_tokens(tokens, np.array([0, 2, 3])).to_numpy().tolist()
        [[10, 10], [5, 15]]
    """
    evals = np.sort(np.asarray(eval_steps))
    interval = np.searchsorted(evals, step_band_tokens.index.to_numpy(), side="left")
    inside = (interval >= 1) & (interval < evals.size)
    summed = step_band_tokens[inside].groupby(interval[inside]).sum()
    summed = summed.reindex(range(1, evals.size), fill_value=0)
    summed.index = pd.Index(evals[1:], name="eval_step")
    return summed


# ------------------------------------------------------------------------------------------------ probe dynamics
def trend_basis(steps: np.ndarray) -> np.ndarray:
    """T(t) = [1, log t, log^2 t]: the one smooth-trend model of this module (log of steps below 1 taken at 1).

    Example:
        >>> trend_basis(np.array([1, np.e])).round(3).tolist()
        [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    """
    log_steps = np.log(np.maximum(np.asarray(steps, dtype=np.float64), 1.0))
    return np.column_stack([np.ones_like(log_steps), log_steps, log_steps**2])


def _log_loss(probe_loss: pd.DataFrame) -> pd.DataFrame:
    ordered = probe_loss.sort_index().dropna()
    return np.log(np.maximum(ordered.astype(np.float64), 1e-12))


def band_residuals(probe_loss: pd.DataFrame) -> pd.DataFrame:
    """e_b(t): band-relative log probe loss minus its least-squares trend T(t) (module docstring).

    Args:
        probe_loss: index eval step, one column per band; evals with a missing band are dropped.

    Returns:
        DataFrame of residuals; all NaN with fewer than TREND_COLUMNS + 2 evals.

    Example:
        >>> steps = np.arange(1, 50) * 10
        >>> curve = 3 - 0.2 * np.log(steps)
        >>> frame = pd.DataFrame({0: curve, 1: 1.5 * curve}, index=steps)  # same shape, different level
        >>> bool(np.allclose(band_residuals(frame), 0))
        True
    """
    log_loss = _log_loss(probe_loss)
    if len(log_loss) < TREND_COLUMNS + 2:
        return pd.DataFrame(np.nan, index=log_loss.index, columns=log_loss.columns)
    values = log_loss.to_numpy()
    if values.shape[1] >= 2:
        values = values - values.mean(axis=1, keepdims=True)  # the learning curve every band shares
    basis = trend_basis(log_loss.index.to_numpy())
    coefficients, *_ = np.linalg.lstsq(basis, values, rcond=None)
    return pd.DataFrame(values - basis @ coefficients, index=log_loss.index, columns=log_loss.columns)


def residual_amplitude(probe_loss: pd.DataFrame) -> float:
    """A = mean over bands of sqrt(sum_t e_b(t)^2 / (n - 3)); NaN with fewer than MIN_EVALS evals.

    Example:
        >>> steps = np.arange(1, 41) * 10
        >>> trend = 2 - 0.1 * np.log(steps)
        >>> swing = 0.05 * np.sign(np.sin(2 * np.pi * np.arange(40) / 8))  # bands take turns, +-0.05 in log loss
        >>> frame = pd.DataFrame({0: np.exp(trend + swing), 1: np.exp(trend - swing)}, index=steps)
        >>> round(residual_amplitude(frame), 3)  # band-relative: g = +-0.05
        0.051
    """
    residuals = band_residuals(probe_loss)
    if len(residuals) < MIN_EVALS:
        return float("nan")
    per_band = np.sqrt((residuals**2).sum(axis=0) / (len(residuals) - TREND_COLUMNS))
    return float(per_band.mean())


@dataclass(frozen=True)
class Fit:
    """Least-squares coefficients and their OLS standard errors (NaN when the design is rank-deficient)."""

    coef: np.ndarray
    se: np.ndarray


def least_squares(design: np.ndarray, y: np.ndarray) -> Fit:
    """OLS fit y ~ design with standard errors sqrt(diag(sigma^2 (X'X)^-1)), sigma^2 = RSS / (n - p).

    Example:
        >>> x = np.arange(10.0)
        >>> fit = least_squares(np.column_stack([np.ones(10), x]), 1 + 2 * x)
        >>> fit.coef.round(6).tolist(), fit.se.round(6).tolist()
        ([1.0, 2.0], [0.0, 0.0])
    """
    n, p = design.shape
    nan = Fit(np.full(p, np.nan), np.full(p, np.nan))
    if n <= p:
        return nan
    # scale columns so that log^2 step and shares in [0, 1] are equally well conditioned
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = design / scale
    coefficients, _, rank, singular = np.linalg.lstsq(scaled, y, rcond=None)
    if rank < p or singular[-1] <= 1e-9 * singular[0]:
        return nan
    residual = y - scaled @ coefficients
    sigma2 = float(residual @ residual) / (n - p)
    covariance = sigma2 * np.linalg.inv(scaled.T @ scaled)
    return Fit(coefficients / scale, np.sqrt(np.maximum(np.diag(covariance), 0.0)) / scale)


def _aligned_changes(probe_loss: pd.DataFrame, interval_tokens: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """y_b,k and s_b,k on the intervals both tables cover (intervals without training tokens dropped)."""
    changes = _log_loss(probe_loss).diff().iloc[1:]
    tokens = interval_tokens.reindex(columns=changes.columns, fill_value=0)
    common = changes.index.intersection(tokens.index)
    tokens = tokens.loc[common].astype(np.float64)
    total = tokens.sum(axis=1)
    keep = total > 0
    return changes.loc[common][keep], tokens[keep]


@dataclass(frozen=True)
class OwnShareSlope:
    """beta (token-weighted over bands), its standard error, and the per-band slopes."""

    beta: float
    se: float
    per_band: dict = field(default_factory=dict)
    n_intervals: int = 0


def own_share_slope(probe_loss: pd.DataFrame, interval_tokens: pd.DataFrame) -> OwnShareSlope:
    """beta: slope of band b's interval change of log probe loss on its own token share, trend as nuisance.

    Args:
        probe_loss: index eval step (the window's evals), one column per band.
        interval_tokens: `interval_band_tokens` for those evals (index = later eval of each interval).

    Returns:
        OwnShareSlope; NaN with fewer than MIN_EVALS - 1 intervals.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> steps = np.arange(0, 401) * 10 + 10
        >>> own = rng.uniform(0, 1, 400)  # band 0's share per interval; band 1 gets the rest
        >>> tokens = pd.DataFrame({0: 1000 * own, 1: 1000 * (1 - own)}, index=steps[1:])
        >>> drift = np.r_[0, np.cumsum(-0.3 * (own - 0.5))]  # each band's log loss falls with its own share
        >>> loss = pd.DataFrame({0: np.exp(drift - 0.1 * np.log(steps)), 1: np.exp(-drift)}, index=steps)
        >>> round(own_share_slope(loss, tokens).beta, 3)
        -0.3
    """
    changes, tokens = _aligned_changes(probe_loss, interval_tokens)
    if len(changes) < MIN_EVALS - 1:
        return OwnShareSlope(float("nan"), float("nan"), {}, len(changes))
    shares = tokens.div(tokens.sum(axis=1), axis=0)
    basis = trend_basis(changes.index.to_numpy())
    per_band, weights, errors = {}, [], []
    for band in changes.columns:
        fit = least_squares(np.column_stack([basis, shares[band].to_numpy()]), changes[band].to_numpy())
        per_band[band] = float(fit.coef[-1])
        if np.isfinite(fit.coef[-1]):
            weights.append(float(tokens[band].sum()))
            errors.append((float(fit.coef[-1]), float(fit.se[-1])))
    total = float(np.sum(weights))
    if total <= 0:
        return OwnShareSlope(float("nan"), float("nan"), per_band, len(changes))
    w = np.asarray(weights) / total
    slopes, ses = np.asarray(errors).T
    return OwnShareSlope(float(w @ slopes), float(np.sqrt(np.sum((w * ses) ** 2))), per_band, len(changes))


def reference_band(band, bands: list) -> object:
    """r(b): the band before `band` in sorted order (the shorter neighbour); the second band for the first one.

    Example:
        >>> reference_band(0, [0, 1, 2]), reference_band(2, [0, 1, 2])
        (1, 1)
    """
    ordered = sorted(bands)
    position = ordered.index(band)
    return ordered[position - 1] if position > 0 else ordered[1]


@dataclass(frozen=True)
class CrossBandEffect:
    """Mean over pairs of C[a, b], the matrix (rows: training band a, columns: probe band b), references r(b)."""

    mean: float
    matrix: pd.DataFrame
    reference: dict


def cross_band_effects(probe_loss: pd.DataFrame, interval_tokens: pd.DataFrame) -> CrossBandEffect:
    """C[a, b]: identifiable cross-band slopes against the reference band r(b), own share held (module docstring).

    Args:
        probe_loss: index eval step (the window's evals), one column per band (>= 3 bands).
        interval_tokens: `interval_band_tokens` for those evals.

    Returns:
        CrossBandEffect; C is NaN on the diagonal, at a = r(b), and where a fit is rank-deficient; all NaN with
        fewer than `cross_band_min_evals` evals (counted as intervals with training tokens + 1).

    Example:
        >>> rng = np.random.default_rng(1)
        >>> shares = rng.dirichlet(np.ones(3), 300)
        >>> effect = np.array([[-0.2, 0.0, 0.0], [0.0, -0.2, 0.0], [0.1, 0.0, -0.2]])  # band 2 hurts band 0
        >>> changes = shares @ effect + 0.001 * rng.standard_normal((300, 3))
        >>> steps = np.arange(301) * 10 + 10
        >>> loss = pd.DataFrame(np.exp(np.r_[np.zeros((1, 3)), np.cumsum(changes, axis=0)]), index=steps)
        >>> result = cross_band_effects(loss, pd.DataFrame(shares, index=steps[1:]))
        >>> round(float(result.matrix.loc[2, 0]), 2), bool(abs(result.matrix.loc[0, 2]) < 0.01), result.reference[0]
        (0.1, True, 1)
    """
    changes, tokens = _aligned_changes(probe_loss, interval_tokens)
    bands = list(changes.columns)
    matrix = pd.DataFrame(np.nan, index=pd.Index(bands, name="train_band"), columns=pd.Index(bands, name="probe_band"))
    if len(bands) < 3:
        return CrossBandEffect(float("nan"), matrix, {})
    reference = {band: reference_band(band, bands) for band in bands}
    if len(changes) + 1 < cross_band_min_evals(len(bands)):
        return CrossBandEffect(float("nan"), matrix, reference)
    shares = tokens.div(tokens.sum(axis=1), axis=0)
    basis = trend_basis(changes.index.to_numpy())
    for band in bands:
        others = [a for a in bands if a not in (band, reference[band])]
        design = np.column_stack([basis, shares[band].to_numpy(), shares[others].to_numpy()])
        fit = least_squares(design, changes[band].to_numpy())
        matrix.loc[others, band] = fit.coef[-len(others):]
    values = matrix.to_numpy(dtype=np.float64)
    finite = values[np.isfinite(values)]
    return CrossBandEffect(float(finite.mean()) if finite.size else float("nan"), matrix, reference)


# ---------------------------------------------------------------------------------------------------- loop score
def order_period_steps(sampler: str | None, steps_per_epoch: int | None) -> int | None:
    """Steps after which a policy's batch order repeats: steps per epoch for PERIODIC_ORDERS, else None.

    Shuffled orders (sorted_static, full_random, bucketed with or without run_length, bucketed_megabatch, packed)
    reshuffle every epoch, so their composition has no period and the loop score does not apply.

    Example:
        >>> order_period_steps("bucket_sequential", 120), order_period_steps("bucketed", 120)
        (120, None)
    """
    if sampler in PERIODIC_ORDERS and steps_per_epoch:
        return int(steps_per_epoch)
    return None


@dataclass(frozen=True)
class LoopScore:
    """Loop score (mean over bands), per-band values, and the lag used (in evals; 0 when not applicable)."""

    score: float
    per_band: dict
    lag_evals: int


def loop_score(probe_loss: pd.DataFrame, period_steps: int | None) -> LoopScore:
    """Mean over bands of the lag-L autocorrelation of e_b, L = round(P / E) evals; NaN without a period.

    Args:
        probe_loss: index eval step (the window's evals), one column per band.
        period_steps: P from `order_period_steps` (None for shuffled orders).

    Example:
        >>> steps = np.arange(1, 41) * 10
        >>> trend = 2 - 0.1 * np.log(steps)
        >>> wave = 0.05 * np.sin(2 * np.pi * np.arange(40) / 5)
        >>> frame = pd.DataFrame({0: trend + wave, 1: trend - wave}, index=steps)  # bands take turns: a loop
        >>> result = loop_score(frame, 50)
        >>> result.lag_evals, result.score > 0.8
        (5, True)
        >>> bool(np.isnan(loop_score(frame, None).score))
        True
    """
    residuals = band_residuals(probe_loss)
    steps = residuals.index.to_numpy(dtype=np.float64)
    if not period_steps or steps.size < 2:
        return LoopScore(float("nan"), {}, 0)
    eval_interval = float(np.median(np.diff(steps)))
    lag = max(1, int(round(period_steps / eval_interval)))
    if lag > steps.size // 2:  # beyond half the series the estimate rests on too few pairs
        return LoopScore(float("nan"), {}, lag)
    # bands that differ only by a constant leave rounding noise, whose autocorrelation would be meaningless
    tiny = 1e-9 * (1.0 + float(np.nanmax(np.abs(_log_loss(probe_loss).to_numpy()))))
    per_band = {
        band: autocorrelation(residuals[band].to_numpy(), lag) if residuals[band].std() > tiny else float("nan")
        for band in residuals.columns
    }
    finite = [value for value in per_band.values() if np.isfinite(value)]
    return LoopScore(float(np.mean(finite)) if finite else float("nan"), per_band, lag)


# ------------------------------------------------------------------------------------------------ one report
@dataclass(frozen=True)
class ProbeDynamics:
    """Every probe-dynamics figure of one run, on the evals of its window."""

    residual_amplitude: float
    own_share_slope: float
    own_share_slope_se: float
    cross_band_effect: float
    loop_score: float
    loop_lag_evals: int
    window_start_step: float
    window_evals: int
    per_band: pd.DataFrame
    cross_matrix: pd.DataFrame
    n_bands: int = 0  # bands with probe losses in the window
    share_intervals: int = 0  # intervals with training tokens that beta and the cross effect fit on


def probe_dynamics(
    probe_loss: pd.DataFrame,
    step_band_tokens: pd.DataFrame | None,
    *,
    start_step: float = 0,
    period_steps: int | None = None,
) -> ProbeDynamics:
    """A, beta (+ se), the cross-band effect and the loop score on the evals at steps >= start_step.

    Args:
        probe_loss: index eval step, one column per band (probe loss).
        step_band_tokens: real training tokens per (step, band) (None: beta and the cross effect are NaN).
        start_step: first step of the window (the training loss's steady-state start).
        period_steps: the order's period (`order_period_steps`), None for shuffled orders.

    Example:
        >>> steps = np.arange(1, 41) * 10
        >>> frame = pd.DataFrame({0: 2 - 0.1 * np.log(steps), 1: 2.5 - 0.1 * np.log(steps)}, index=steps)
        >>> report = probe_dynamics(frame, None, start_step=100)
        >>> report.window_evals, round(report.residual_amplitude, 4), bool(np.isnan(report.own_share_slope))
        (31, 0.0, True)
    """
    window = probe_loss.sort_index()
    window = window[window.index >= start_step].dropna(axis=1, how="all")
    amplitude = residual_amplitude(window)
    loop = loop_score(window, period_steps)
    per_band = pd.DataFrame(index=pd.Index(window.columns, name="band"))
    residuals = band_residuals(window)
    if len(residuals) >= MIN_EVALS:
        per_band["residual_amplitude"] = np.sqrt((residuals**2).sum(axis=0) / (len(residuals) - TREND_COLUMNS))
    per_band["loop"] = pd.Series(loop.per_band, dtype=np.float64)
    own = OwnShareSlope(float("nan"), float("nan"))
    cross = CrossBandEffect(float("nan"), pd.DataFrame(), {})
    if step_band_tokens is not None and len(window) >= 2:
        tokens = interval_band_tokens(step_band_tokens, window.index.to_numpy())
        own = own_share_slope(window, tokens)
        cross = cross_band_effects(window, tokens)
        per_band["own_share_slope"] = pd.Series(own.per_band, dtype=np.float64)
    return ProbeDynamics(
        residual_amplitude=amplitude,
        own_share_slope=own.beta,
        own_share_slope_se=own.se,
        cross_band_effect=cross.mean,
        loop_score=loop.score,
        loop_lag_evals=loop.lag_evals,
        window_start_step=float(window.index[0]) if len(window) else float("nan"),
        window_evals=int(len(window.dropna())),
        per_band=per_band,
        cross_matrix=cross.matrix,
        n_bands=int(window.shape[1]),
        share_intervals=int(own.n_intervals),
    )
