"""Paired comparison of arms with a baseline arm, seed by seed, or target by target where seeds nest in targets.

Runs with the same seed share the draft init and the data, so an arm is compared with its baseline (same stratum,
analysis.arms) through the per-seed differences x_arm(seed s) - x_baseline(seed s). The unit of analysis:

    seed              d_i = the seed's difference, i = 1..n seeds: the seeds are the independent replicates
    target            (rules version >= 5, `nested`, when the paired seeds span more than one target) seeds nest
                      within targets (`target_seeds: 3` pretrains one tiny target per seed mod 3; a run's target is
                      its `target_seed`, else its `target_digest`): seeds of one target share it, so they are not
                      independent replicates of the question "does this hold across targets". The unit is the
                      target: d_j = the mean over target j's seeds of their differences, j = 1..n targets, each
                      target weighing the same however many seeds it has. With one target (model=hf: the user's
                      one given target, or no target recorded) the unit is the seed, as before.
                      Why not a mixed model (target random effect, seeds within): with 2-3 targets its variance
                      component is barely estimable, its degrees of freedom need an approximation
                      (Satterthwaite / Kenward-Roger) that is poor at this size, and it would need a dependency; the
                      mean per target is the exact, balanced-design equivalent of its fixed-effect test and can be
                      recomputed by hand from comparison.csv (seed, target_seed, endpoint).

Every statistic below is computed over the units (n = number of units, ``n_pairs``; ``n_targets`` and ``n_seeds``
say what they rest on, ``unit`` which they are), MDD and ``seeds_needed`` included: ``seeds_needed`` counts units,
i.e. targets when unit = target (each with as many seeds as now). ``arm_mean`` and ``baseline_mean`` stay the
means over the paired seeds, so with unequal seeds per target diff need not equal their difference:

    effect            diff = mean(d)
    t interval        diff +- t_(1 - alpha/2, n - 1) sd(d) / sqrt(n)                       (ci_low, ci_high)
    bootstrap         percentiles alpha/2, 1 - alpha/2 of mean(d*) over 10,000 resamples of the seeds with replacement
                      (NaN below 5 pairs: the resampled means then take too few distinct values to form an interval)
    p_value           exact sign-flip permutation test: share of the 2^n sign patterns s with |mean(s d)| >= |mean(d)|
                      (random patterns beyond n = 16). The smallest attainable value is 2 / 2^n (p_min): 0.0625 at
                      5 seeds, so after Holm it can never reach 0.05 there.
    p_t               paired t test, two-sided: 2 P(T >= |mean(d)| / (sd(d) / sqrt(n))), T ~ t_(n-1)
    p_bca             BCa bootstrap test (the 10,000 resampled means of the bootstrap interval): the two-sided level at
                      which the bias-corrected and accelerated interval (Efron 1987; bias z0 from the share of
                      resampled means below mean(d), acceleration a from the jackknife) just reaches 0
    test              the test the verdict uses (``analysis.test``: t, the default, can reach significance at 5
                      seeds; sign_flip is exact but cannot below 6 seeds for one endpoint)
    p_holm            Holm's step-down adjustment of the verdict test's p over the endpoints of one arm (its family)
    mdd               minimum detectable difference at power 0.8: (t_(1 - alpha/2, n-1) + t_(0.8, n-1)) sd(d) / sqrt(n)
                      (two-sided, one endpoint, before Holm)
    seeds_needed      the fewest seed pairs whose mdd is at most the declared margin, with this sd(d) (NaN without a
                      margin)
    p_tost            two one-sided paired t-tests of |true diff| < margin: max(P(T >= (diff + m)/se),
                      P(T <= (diff - m)/se)), T ~ t_(n-1); p_tost_holm: Holm over the endpoints with a margin.
                      NaN when every pair differs by the same amount (sd(d) = 0: a zero-width interval): a
                      measurement that does not vary with the seed (e.g. tau identical on every seed) is no evidence
                      of equivalence, so it is never "equivalent" (a note names it)
    verdict           "equivalent" if a margin was declared and p_tost_holm < alpha (the difference is inside the
                      margin declared irrelevant before the runs); else "better" / "worse" if p_holm < alpha, by the
                      sign of diff and the endpoint's better direction (schema.BETTER); else "inconclusive"
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pandas as pd

from dflash_lab.analysis.schema import BETTER

PAIRED_COLUMNS = ("policy", "endpoint", "diff", "ci_low", "ci_high", "p_value", "p_holm", "verdict", "better",
                  "stratum", "baseline", "n_pairs", "boot_low", "boot_high", "margin", "p_tost", "p_tost_holm",
                  "p_min", "arm_mean", "baseline_mean", "seeds", "p_t", "p_bca", "test", "mdd", "seeds_needed",
                  "unit", "n_targets", "n_seeds")
UNITS = ("seed", "target")
def _stats():
    """scipy.stats, imported on first use: it costs a process ~1 s, and the training CLI, which imports this
    package for the protocol's names, never calls a test."""
    from scipy import stats

    return stats


TESTS = ("t", "sign_flip")
POWER = 0.8
EXACT_UP_TO = 16
BOOTSTRAP_RESAMPLES = 10_000
MIN_BOOTSTRAP_PAIRS = 5


def _clean(diffs) -> np.ndarray:
    values = np.asarray(diffs, dtype=np.float64)
    return values[np.isfinite(values)]


def t_interval(diffs, alpha: float = 0.05) -> tuple[float, float]:
    """mean(d) +- t_(1 - alpha/2, n - 1) sd(d) / sqrt(n); NaN with fewer than 2 differences.

    Example:
        >>> [round(x, 3) for x in t_interval([1.0, 2.0, 3.0])]  # 2 +- 4.303 x 1 / sqrt(3)
        [-0.484, 4.484]
    """
    d = _clean(diffs)
    if d.size < 2:
        return float("nan"), float("nan")
    half = _stats().t.ppf(1 - alpha / 2, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
    return float(d.mean() - half), float(d.mean() + half)


def bootstrap_interval(diffs, alpha: float = 0.05, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(d), resampling the seeds with replacement (seeded: reproducible).

    Example:
        >>> low, high = bootstrap_interval([1.0, 2.0, 3.0, 4.0, 5.0])
        >>> 1.0 <= low < 3.0 < high <= 5.0
        True
        >>> bootstrap_interval([1.0, 2.0])  # two seeds: no interval
        (nan, nan)
    """
    d = _clean(diffs)
    if d.size < MIN_BOOTSTRAP_PAIRS:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def sign_flip_p_value(diffs, seed: int = 0) -> float:
    """Two-sided sign-flip permutation p-value of mean(d) = 0: exact over all 2^n patterns for n <= 16.

    Example:
        >>> sign_flip_p_value([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # only all-plus and all-minus are as extreme: 2/64
        0.03125
        >>> sign_flip_p_value([1.0, -1.0])
        1.0
    """
    d = _clean(diffs)
    if d.size == 0:
        return float("nan")
    observed = abs(d.mean())
    if d.size <= EXACT_UP_TO:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))
        flipped = np.abs(signs @ d) / d.size
        return float(np.mean(flipped >= observed - 1e-12 * max(observed, 1.0)))
    rng = np.random.default_rng(seed)
    signs = rng.choice((1.0, -1.0), size=(2**16, d.size))
    flipped = np.abs(signs @ d) / d.size
    return float((1 + np.sum(flipped >= observed - 1e-12 * max(observed, 1.0))) / (1 + signs.shape[0]))


def paired_t_p_value(diffs) -> float:
    """Two-sided paired t test of mean(d) = 0; NaN with fewer than 2 differences.

    Example:
        >>> round(paired_t_p_value([1.0, 2.0, 3.0, 4.0, 5.0]), 4)   # t = 3 / (1.581 / sqrt(5)) = 4.243, 4 df
        0.0132
        >>> paired_t_p_value([0.2, 0.2, 0.2])   # no spread: any non-zero mean is certain
        0.0
    """
    d = _clean(diffs)
    if d.size < 2:
        return float("nan")
    se = d.std(ddof=1) / np.sqrt(d.size)
    if se <= 1e-12 * abs(d.mean()) or se == 0:   # no spread (up to rounding): a non-zero mean is certain
        return 0.0 if d.mean() != 0 else 1.0
    return float(2.0 * _stats().t.sf(abs(d.mean()) / se, d.size - 1))


def bca_p_value(diffs, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> float:
    """Two-sided BCa bootstrap p-value of mean(d) = 0 (module docstring); NaN below 5 pairs.

    Inverting the BCa interval: with G the resampled means' distribution, w = Phi^-1(G(0)) - z0, the interval's
    one-sided level at 0 is beta = Phi(w / (1 + a w) - z0) and p = 2 min(beta, 1 - beta).

    Example:
        >>> bca_p_value([1.0, 2.0, 3.0, 4.0, 5.0]) < 0.01
        True
        >>> bca_p_value([1.0, -1.2, 0.5, -0.4, 0.2]) > 0.5
        True
    """
    d = _clean(diffs)
    if d.size < MIN_BOOTSTRAP_PAIRS:
        return float("nan")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    observed = d.mean()
    share_below = np.clip(np.mean(means < observed), 1.0 / resamples, 1.0 - 1.0 / resamples)
    z0 = _stats().norm.ppf(share_below)
    jackknife = np.array([np.delete(d, i).mean() for i in range(d.size)])
    spread = jackknife.mean() - jackknife
    denominator = 6.0 * np.sum(spread**2) ** 1.5
    a = float(np.sum(spread**3) / denominator) if denominator > 0 else 0.0
    g0 = np.clip(np.mean(means < 0.0), 0.5 / resamples, 1.0 - 0.5 / resamples)   # 0 beyond every mean: p < 1/B
    w = _stats().norm.ppf(g0) - z0
    beta = _stats().norm.cdf(w / (1.0 + a * w) - z0)
    return float(min(1.0, 2.0 * min(beta, 1.0 - beta)))


def minimum_detectable_difference(diffs, alpha: float = 0.05, power: float = POWER) -> float:
    """The smallest true mean difference a paired two-sided t test at ``alpha`` detects with ``power``, given this
    sd(d) and n: (t_(1 - alpha/2, n-1) + t_(power, n-1)) sd(d) / sqrt(n); NaN below 2 pairs.

    Example:
        >>> round(minimum_detectable_difference([1.0, 2.0, 3.0, 4.0, 5.0]), 3)   # (2.776 + 0.941) x 1.581 / sqrt(5)
        2.629
    """
    d = _clean(diffs)
    if d.size < 2:
        return float("nan")
    df = d.size - 1
    return float((_stats().t.ppf(1 - alpha / 2, df) + _stats().t.ppf(power, df)) * d.std(ddof=1) / np.sqrt(d.size))


def seeds_needed(diffs, effect: float, alpha: float = 0.05, power: float = POWER, most: int = 1000) -> float:
    """The fewest seed pairs whose minimum detectable difference is at most ``effect``, with this sd(d); NaN
    without an effect or below 2 pairs; ``most + 1`` means more than ``most``.

    Example:
        >>> int(seeds_needed([1.0, 2.0, 3.0, 4.0, 5.0], effect=1.0))   # sd 1.581: n with (t + t) 1.581 / sqrt(n) <= 1
        22
    """
    d = _clean(diffs)
    if d.size < 2 or not np.isfinite(effect) or effect <= 0:
        return float("nan")
    sd = d.std(ddof=1)
    for n in range(2, most + 1):
        if (_stats().t.ppf(1 - alpha / 2, n - 1) + _stats().t.ppf(power, n - 1)) * sd / np.sqrt(n) <= effect:
            return float(n)
    return float(most + 1)


def holm(p_values) -> np.ndarray:
    """Holm's step-down adjusted p-values (NaN entries stay NaN and do not count in the family).

    Example:
        >>> holm([0.01, 0.04, np.nan, 0.03]).round(3).tolist()
        [0.03, 0.06, nan, 0.06]
    """
    p = np.asarray(p_values, dtype=np.float64)
    adjusted = np.full(p.shape, np.nan)
    finite = np.flatnonzero(np.isfinite(p))
    order = finite[np.argsort(p[finite], kind="stable")]
    m = order.size
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[index]))
        adjusted[index] = running
    return adjusted


def zero_spread(diffs) -> bool:
    """Every difference equal up to rounding (sd(d) = 0): a zero-width interval.

    Example:
        >>> zero_spread([0.2, 0.2, 0.2]), zero_spread([0.2, 0.3])
        (True, False)
    """
    d = _clean(diffs)
    return d.size >= 2 and float(np.ptp(d)) <= 1e-12 * max(float(np.abs(d).max()), 1.0)


def tost_p_value(diffs, margin: float) -> float:
    """Paired TOST p-value of |true mean difference| < margin (t-based); NaN with fewer than 2 differences, and
    when the differences do not vary (zero variance is no evidence of equivalence: the measurement does not
    resolve the seeds).

    Example:
        >>> round(tost_p_value([0.01, -0.02, 0.0, 0.01, 0.02], margin=0.1), 6) < 0.001
        True
        >>> tost_p_value([0.5, 0.6, 0.7], margin=0.1) > 0.5
        True
        >>> tost_p_value([0.0, 0.0, 0.0, 0.0, 0.0], margin=0.1)   # identical on every seed: no test
        nan
    """
    d = _clean(diffs)
    if d.size < 2 or not np.isfinite(margin) or zero_spread(d):
        return float("nan")
    se = d.std(ddof=1) / np.sqrt(d.size)
    mean = d.mean()
    df = d.size - 1
    p_lower = _stats().t.sf((mean + margin) / se, df)  # H0: diff <= -margin
    p_upper = _stats().t.cdf((mean - margin) / se, df)  # H0: diff >= +margin
    return float(max(p_lower, p_upper))


def verdict(diff: float, p_holm: float, p_tost_holm: float, better: str, alpha: float = 0.05) -> str:
    """"equivalent", "better", "worse" or "inconclusive" (rule in the module docstring).

    Example:
        >>> verdict(-0.3, 0.01, float("nan"), better="lower"), verdict(-0.3, 0.01, float("nan"), better="higher")
        ('better', 'worse')
        >>> verdict(0.001, 0.5, 0.01, better="lower"), verdict(0.2, 0.2, 0.3, better="lower")
        ('equivalent', 'inconclusive')
    """
    if np.isfinite(p_tost_holm) and p_tost_holm < alpha:
        return "equivalent"
    if np.isfinite(p_holm) and p_holm < alpha and diff != 0:
        return "better" if (diff > 0) == (better == "higher") else "worse"
    return "inconclusive"


def per_seed_values(runs: pd.DataFrame, arm: str, endpoint: str) -> pd.Series:
    """One arm's endpoint per seed (the mean where a seed ran more than once)."""
    rows = runs[(runs["arm"] == arm) & runs["seed"].notna()]
    return pd.to_numeric(rows[endpoint], errors="coerce").groupby(rows["seed"].astype(int)).mean()


def seed_targets(runs: pd.DataFrame) -> pd.Series:
    """seed -> the target its runs trained against: ``target_seed`` where the runs record one, else
    ``target_digest``; empty when neither column holds a value (the label of a seed's first run where runs of one
    seed disagree, which `arms.check_digests` refuses by default).

    Example:
        >>> runs = pd.DataFrame({"seed": [0, 1, 2, 3, 0], "target_seed": [0, 1, 2, 0, 0]})
        >>> seed_targets(runs).to_dict()
        {0: '0', 1: '1', 2: '2', 3: '0'}
    """
    rows = runs[runs["seed"].notna()] if "seed" in runs.columns else runs.iloc[:0]
    for column in ("target_seed", "target_digest"):
        if column in rows.columns and rows[column].notna().any():
            labelled = rows[rows[column].notna()]
            labels = labelled[column].map(lambda v: str(int(v)) if isinstance(v, (int, float, np.number)) else str(v))
            return labels.groupby(labelled["seed"].astype(int)).first()
    return pd.Series(dtype=object)


def analysis_units(seed_diffs: pd.Series, targets: pd.Series | None, nested: bool) -> tuple[pd.Series, str, int]:
    """The differences the statistics use (module docstring): per target, the mean of its seeds' differences
    when ``nested`` and the seeds span more than one target (every seed's target known); else the seed
    differences. Returns (differences by unit, unit name, number of targets the seeds span; 0: none recorded).

    Example:
        >>> diffs = pd.Series([1.0, 3.0, 2.0, 6.0], index=[0, 1, 2, 3])
        >>> units, unit, n_targets = analysis_units(diffs, pd.Series(["a", "b", "a", "b"], index=[0, 1, 2, 3]), True)
        >>> units.to_dict(), unit, n_targets
        ({'a': 1.5, 'b': 4.5}, 'target', 2)
        >>> analysis_units(diffs, pd.Series(["a"] * 4, index=[0, 1, 2, 3]), True)[1:]
        ('seed', 1)
    """
    labels = (targets if targets is not None else pd.Series(dtype=object)).reindex(seed_diffs.index)
    n_targets = int(labels.nunique(dropna=True))
    if nested and n_targets > 1 and labels.notna().all():
        return seed_diffs.groupby(labels).mean(), "target", n_targets
    return seed_diffs, "seed", n_targets


def unit_differences(runs: pd.DataFrame, arm: str, baseline: str, endpoint: str, nested: bool,
                     targets: pd.Series | None = None) -> tuple[pd.Series, str, int, pd.DataFrame]:
    """arm - baseline per analysis unit on ``endpoint`` (:func:`analysis_units`), the unit, the number of
    targets, and the per-seed pairs (columns arm, baseline; index seed) they come from."""
    pairs = pd.concat([per_seed_values(runs, arm, endpoint), per_seed_values(runs, baseline, endpoint)],
                      axis=1, keys=["arm", "baseline"], join="inner").dropna()
    targets = seed_targets(runs) if targets is None else targets
    units, unit, n_targets = analysis_units(pairs["arm"] - pairs["baseline"], targets, nested)
    return units, unit, n_targets, pairs


def _paired_row(arm: str, setting: pd.Series, endpoint: str, units: pd.Series, unit: str, n_targets: int,
                pairs: pd.DataFrame, margin: float, alpha: float, test: str, notes: list[str]) -> dict[str, Any]:
    """One arm against its baseline on one endpoint (a PAIRED_COLUMNS row before its family's Holm adjustment):
    the mean difference per analysis unit, its intervals and tests."""
    diffs = units.to_numpy()
    if np.isfinite(margin) and zero_spread(diffs):
        notes.append(f"{arm}, {endpoint}: every one of the {diffs.size} {unit} pairs differs by exactly "
                     f"{float(diffs[0]):+.4g} (zero variance): no spread is no evidence of equivalence, so "
                     f"the margin {margin:g} is not tested (the endpoint does not vary with the seed)")
    ci_low, ci_high = t_interval(diffs, alpha)
    boot_low, boot_high = bootstrap_interval(diffs, alpha)
    return {
        "policy": arm, "endpoint": endpoint, "diff": float(diffs.mean()), "ci_low": ci_low,
        "ci_high": ci_high, "p_value": sign_flip_p_value(diffs), "better": BETTER[endpoint],
        "stratum": setting["stratum"], "baseline": setting["baseline"], "n_pairs": int(diffs.size),
        "boot_low": boot_low, "boot_high": boot_high, "margin": margin,
        "p_tost": tost_p_value(diffs, margin), "p_min": 2.0 / 2**diffs.size if diffs.size else np.nan,
        "arm_mean": float(pairs["arm"].mean()), "baseline_mean": float(pairs["baseline"].mean()),
        "seeds": " ".join(str(s) for s in pairs.index), "p_t": paired_t_p_value(diffs),
        "p_bca": bca_p_value(diffs), "test": test, "mdd": minimum_detectable_difference(diffs, alpha),
        "seeds_needed": seeds_needed(diffs, margin, alpha), "unit": unit, "n_targets": n_targets,
        "n_seeds": int(len(pairs)),
    }


def _judge_family(arm: str, family: list[dict[str, Any]], alpha: float, test: str) -> list[str]:
    """Holm over an arm's endpoints (the verdict's test, and TOST), each row's verdict; returns a note when the
    sign-flip test cannot reach significance with this many pairs."""
    p_holm = holm([row["p_t" if test == "t" else "p_value"] for row in family])
    p_tost_holm = holm([row["p_tost"] for row in family])
    for row, adjusted, tost_adjusted in zip(family, p_holm, p_tost_holm):
        row["p_holm"], row["p_tost_holm"] = float(adjusted), float(tost_adjusted)
        row["verdict"] = verdict(row["diff"], adjusted, tost_adjusted, row["better"], alpha)
    if test != "sign_flip" or max(row["p_min"] for row in family) * len(family) < alpha:
        return []
    n, unit = max(row["n_pairs"] for row in family), family[0]["unit"]
    needed = int(np.floor(np.log2(2 * len(family) / alpha))) + 1  # 2/2^n x k < alpha
    return [f"{arm}: with {n} {unit} pairs the sign-flip test cannot reach p_holm < {alpha:g} over "
            f"{len(family)} endpoints (smallest p = 2/2^{n}); 'better'/'worse' need >= {needed} {unit}s"]


def paired_table(runs: pd.DataFrame, arms: pd.DataFrame, endpoints: tuple[str, ...], margins: dict[str, float],
                 alpha: float = 0.05, test: str = "t", nested: bool = False) -> tuple[pd.DataFrame, list[str]]:
    """Every arm against its stratum's baseline, per endpoint (PAIRED_COLUMNS), and notes on what was left out.

    Args:
        runs: one row per run with columns arm, seed and the endpoints.
        arms: `arms.pair_arms(...).arms`: index arm label, columns stratum and baseline.
        endpoints: columns to compare (schema.BETTER keys); all-NaN endpoints of an arm are skipped.
        margins: endpoint -> TOST margin.
        alpha: test level; intervals have confidence 1 - alpha.
        test: the test the verdict uses, ``t`` (paired t) or ``sign_flip`` (exact); both are reported.
        nested: the target is the unit where the seeds span several targets (rules version >= 5; module
            docstring); False: the seed is the unit (``n_targets`` is still reported).

    Example:
        >>> runs = pd.DataFrame({"arm": ["a"] * 6 + ["b"] * 6, "seed": list(range(6)) * 2,
        ...                      "jumpiness": [0.2, 0.3, 0.25, 0.2, 0.3, 0.25, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]})
        >>> arms = pd.DataFrame({"stratum": ["", ""], "baseline": ["b", "b"]}, index=["a", "b"])
        >>> table, notes = paired_table(runs, arms, ("jumpiness",), {})
        >>> table[["policy", "diff", "p_value", "p_t", "verdict"]].round(4).values.tolist()
        [['a', 0.15, 0.0312, 0.0004, 'worse']]
    """
    if test not in TESTS:
        raise ValueError(f"analysis.test={test!r}: choose one of {', '.join(TESTS)}")
    rows, notes = [], []
    targets = seed_targets(runs)
    repeated = runs.dropna(subset=["seed"]).groupby(["arm", "seed"]).size()
    for (arm, seed), count in repeated[repeated > 1].items():
        notes.append(f"{arm}: {count} runs with seed {int(seed)}, their mean is used")
    for arm, setting in arms.iterrows():
        baseline = setting["baseline"]
        if baseline is None or pd.isna(baseline) or arm == baseline:
            continue
        family = []
        for endpoint in endpoints:
            if endpoint not in runs.columns:
                notes.append(f"endpoint {endpoint}: not a column of the runs table")
                continue
            units, unit, n_targets, pairs = unit_differences(runs, arm, baseline, endpoint, nested, targets)
            if not pairs.empty:   # empty: e.g. loop_score of a shuffled order, NaN by definition
                family.append(_paired_row(arm, setting, endpoint, units, unit, n_targets, pairs,
                                          margins.get(endpoint, float("nan")), alpha, test, notes))
        if not family:
            notes.append(f"{arm}: no seed in common with its baseline {baseline}")
            continue
        notes += _judge_family(arm, family, alpha, test)
        rows += family
    table = pd.DataFrame(rows, columns=list(PAIRED_COLUMNS))
    return table, notes
