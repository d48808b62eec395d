"""Reference length distributions (docs/workloads.md), generated deterministically, no downloads.

- ``seed``: the production run's shape. log-length split-normal around median 1728 (sigma 0.83 below, 0.70 above),
  rounded, clipped to [16, 8192]; mean about 2,140 tokens.
- ``cpu``: the same shape divided by 8 (median 216, clipped to [2, 1024]) for runs on 2 cores.
- ``heavy_tailed``: many short samples and a long Pareto tail (like real code files): hard for fixed buckets.
- ``bimodal``: a chat mix of short replies and long reasoning traces.
"""

from __future__ import annotations

import numpy as np

WORKLOADS = ("seed", "cpu", "heavy_tailed", "bimodal")


def split_normal_log_lengths(
    n: int, *, median: float, sigma_below: float, sigma_above: float, lo: int, hi: int, seed: int
) -> np.ndarray:
    """Lengths whose log follows a split normal around log(median), rounded and clipped to [lo, hi]."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(n)
    sigma = np.where(z < 0, sigma_below, sigma_above)
    lengths = np.rint(median * np.exp(z * sigma))
    return np.clip(lengths, lo, hi).astype(np.int64)


def reference_lengths(workload: str, n: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Sample `n` lengths of a named workload.

    Args:
        workload: one of ``seed``, ``cpu``, ``heavy_tailed``, ``bimodal``.
        n: number of samples.
        seed: RNG seed; the same arguments always give the same array.
        scale: divide every length by this (``seed`` with scale 8 is ``cpu``).

    Example:
        >>> reference_lengths("seed", 5, seed=1).dtype
        dtype('int64')
    """
    if n <= 0:
        raise ValueError(f"n={n}: the number of samples must be positive")
    if workload == "seed":
        out = split_normal_log_lengths(n, median=1728, sigma_below=0.83, sigma_above=0.70, lo=16, hi=8192, seed=seed)
    elif workload == "cpu":
        out = split_normal_log_lengths(n, median=216, sigma_below=0.83, sigma_above=0.70, lo=2, hi=1024, seed=seed)
    elif workload == "heavy_tailed":
        rng = np.random.default_rng(seed)
        body = np.exp(rng.normal(np.log(180), 0.9, n))          # most files are short
        tail = 300 * (1 + rng.pareto(1.1, n))                    # a long, heavy tail
        out = np.clip(np.rint(np.where(rng.random(n) < 0.8, body, tail)), 16, 8192).astype(np.int64)
    elif workload == "bimodal":
        rng = np.random.default_rng(seed)
        short = np.exp(rng.normal(np.log(350), 0.5, n))          # short chat turns
        long = np.exp(rng.normal(np.log(4200), 0.35, n))         # long reasoning traces
        out = np.clip(np.rint(np.where(rng.random(n) < 0.65, short, long)), 16, 8192).astype(np.int64)
    else:
        raise ValueError(f"unknown workload {workload!r}: choose one of {', '.join(WORKLOADS)}")
    if scale != 1.0:
        out = np.maximum(np.rint(out / scale), 1).astype(np.int64)
    return out


def workload_table(n: int = 800_000, seed: int = 0) -> str:
    """Length statistics of every workload as a markdown table (docs/workloads.md holds its output for the defaults).

    Columns: min, 10th percentile, median, mean, 90th and 99th percentile, max, and the equal-count sextiles (the
    five lengths that cut the samples into six equal-count buckets).

    Example:
        >>> print(workload_table(n=1000).splitlines()[2].split("|")[1:4])
        [' seed ', ' 68 ', ' 609 ']
    """
    lines = ["| workload | min | p10 | median | mean | p90 | p99 | max | equal-count sextiles |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for workload in WORKLOADS:
        lengths = reference_lengths(workload, n, seed=seed)
        p10, median, p90, p99 = np.percentile(lengths, [10, 50, 90, 99])
        sextiles = np.quantile(lengths, np.arange(1, 6) / 6).round().astype(np.int64).tolist()
        lines.append(f"| {workload} | {lengths.min():,} | {p10:,.0f} | {median:,.0f} | {lengths.mean():,.0f} | "
                     f"{p90:,.0f} | {p99:,.0f} | {lengths.max():,} | {sextiles} |")
    return "\n".join(lines)
