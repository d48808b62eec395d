"""The warmup and the gradient scale: which updates are warmup updates, which were clipped, the extra probe
evaluations inside the warmup, and the gradient norm per bucket and phase (summary.json ``gradients``,
compare's gradients.csv). One definition each, read by the trainer and by the analysis of older runs alike.

Definitions (row ``step`` = s is the s-th optimizer update, ``dflash_lab.records.record``'s numbering):

- warmup steps W = round(warmup_frac x total_steps), at least 1 when warmup_frac > 0, else 0: the linear rise of
  ``training.step.LRSchedule``; the update s is a warmup update when s - 1 < W, i.e. s <= W (it used a warm-up LR).
- clipped: g > c > 0 for the update's global gradient norm g before clipping and ``trainer.grad_clip`` c
  (c = 0: no clipping, nothing is clipped; the norm is still logged). Each metrics row records it (``clipped``);
  rows of runs recorded before it are judged by the rule with the run's c.
- the update's group: its bucket (the bucket of its batch's longest document, ``policy.bucket_of``), or, for a
  policy without buckets (bucket -1), the probe band of the step's longest document (``bands.bucket_ids`` on
  ``max_len`` with the run's probe bands), so a shuffled order's steps are grouped by length too.
- per (group, phase): steps n, mean and median of g, clip_frac = clipped updates / n; updates whose g is not finite
  (a skipped update) are left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from dflash_lab.metrics.bands import bucket_ids

PHASES = ("warmup", "after")
GRADIENT_COLUMNS = ("bucket", "phase", "steps", "grad_norm_mean", "grad_norm_median", "clip_frac")


def warmup_steps(warmup_frac: float, total_steps: int) -> int:
    """W = round(warmup_frac x total_steps), at least 1 when warmup_frac > 0; 0 without warmup.

    Example:
        >>> warmup_steps(0.04, 390), warmup_steps(0.001, 100), warmup_steps(0.0, 100)
        (16, 1, 0)
    """
    return max(1, int(round(warmup_frac * total_steps))) if warmup_frac > 0 else 0


def clipped(grad_norm: float | None, grad_clip: float) -> bool:
    """The update was clipped: its pre-clip norm g > grad_clip > 0 (a non-finite or missing g: False).

    Example:
        >>> clipped(1.5, 1.0), clipped(0.9, 1.0), clipped(5.0, 0.0), clipped(None, 1.0)
        (True, False, False, False)
    """
    return (grad_clip > 0 and grad_norm is not None and math.isfinite(grad_norm)
            and float(grad_norm) > float(grad_clip))


def warmup_probe_steps(warmup: int, evals: int) -> list[int]:
    """The extra probe evaluations inside the warmup: ceil(k x W / n) for k = 1..n, distinct (fewer when W < n);
    the last one is W, the end of the warmup (the first update at peak LR follows it).

    Example:
        >>> warmup_probe_steps(16, 4), warmup_probe_steps(2, 4), warmup_probe_steps(0, 4), warmup_probe_steps(16, 0)
        ([4, 8, 12, 16], [1, 2], [], [])
    """
    return sorted({-(-k * warmup // evals) for k in range(1, evals + 1)}) if warmup > 0 and evals > 0 else []


def step_groups(buckets: Sequence[float], max_lens: Sequence[float], bands: Sequence[int] | None) -> np.ndarray:
    """Each update's group: its bucket, or for bucket -1 (no buckets) the probe band of its max_len (-1 when no
    bands are known or the length lies outside them).

    Example:
        >>> step_groups([2, -1, -1], [50, 50, 500], [0, 96, 1024]).tolist()
        [2, 0, 1]
    """
    groups = np.asarray(buckets, dtype=np.float64)
    groups = np.where(np.isfinite(groups), groups, -1).astype(np.int64)
    if bands is not None and len(bands) >= 2:
        by_band = bucket_ids(np.asarray(max_lens, dtype=np.float64), list(bands))
        groups = np.where(groups < 0, by_band, groups)
    return groups


def grouped_by(has_buckets: bool) -> str:
    """What the groups of a run are: ``bucket`` for a policy with buckets, else ``probe_band`` (of max_len).

    Example:
        >>> grouped_by(True), grouped_by(False)
        ('bucket', 'probe_band')
    """
    return "bucket" if has_buckets else "probe_band"


def gradient_stats(rows: Iterable[Mapping[str, Any]], *, warmup: int, grad_clip: float,
                   bands: Sequence[int] | None) -> list[dict[str, Any]]:
    """The gradient norm per (group, phase) of a run's metrics rows (the module docstring's definitions).

    Args:
        rows: metrics.jsonl rows (step, grad_norm, bucket, max_len; clipped where recorded).
        warmup: the warmup step count W (:func:`warmup_steps`).
        grad_clip: ``trainer.grad_clip`` (0: no clipping).
        bands: the run's probe bands, for the steps of a policy without buckets.

    Returns:
        One dict per (group, phase) with GRADIENT_COLUMNS, groups ascending, warmup before after.

    Example:
        >>> rows = [{"step": 1, "grad_norm": 2.0, "bucket": 0, "max_len": 9},
        ...         {"step": 2, "grad_norm": 0.5, "bucket": 0, "max_len": 9},
        ...         {"step": 3, "grad_norm": 3.0, "bucket": 0, "max_len": 9}]
        >>> [(r["phase"], r["steps"], r["clip_frac"]) for r in gradient_stats(rows, warmup=2, grad_clip=1.0,
        ...                                                                     bands=None)]
        [('warmup', 2, 0.5), ('after', 1, 1.0)]
    """
    kept = [row for row in rows if row.get("grad_norm") is not None and math.isfinite(float(row["grad_norm"]))]
    if not kept:
        return []
    norms = np.asarray([float(row["grad_norm"]) for row in kept])
    groups = step_groups([np.nan if row.get("bucket") is None else row["bucket"] for row in kept],
                         [np.nan if row.get("max_len") is None else row["max_len"] for row in kept], bands)
    phases = np.where(np.asarray([int(row["step"]) for row in kept]) <= warmup, PHASES[0], PHASES[1])
    # the row's own record where it has one (a resumed run may have changed trainer.grad_clip), else the rule
    is_clipped = np.asarray([bool(row["clipped"]) if row.get("clipped") is not None else clipped(norm, grad_clip)
                             for row, norm in zip(kept, norms)])
    table = []
    for group in sorted(set(groups.tolist())):
        for phase in PHASES:
            chosen = (groups == group) & (phases == phase)
            if chosen.any():
                table.append({"bucket": int(group), "phase": phase, "steps": int(chosen.sum()),
                              "grad_norm_mean": float(norms[chosen].mean()),
                              "grad_norm_median": float(np.median(norms[chosen])),
                              "clip_frac": float(is_clipped[chosen].mean())})
    return table
