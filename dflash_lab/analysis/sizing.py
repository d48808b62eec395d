"""What a run's size lets its analysis measure, said before the run trains (``dflash_lab/train.py`` asks, once the
run's parts are built; the run's own modules, ``dflash_lab/training/``, import nothing of the analysis).

A run declared for a verdict (``analysis.verdict``, e.g. the forgetting protocol) whose probe-dynamics endpoint
(``residual_amplitude``, ``own_share_slope``, ``cross_band_effect``) cannot be computed from the probes it will
take would train for hours and end with a NaN verdict. The probe evaluations inside the analysis window are known
at launch: probes run at every multiple of ``probes.every`` and at the end step; the window starts after
``analysis.window`` x the end step (``steady``: each run's own loss steady state, which never starts before 10% of
the steps, ``metrics.jumpiness.STEADY_MIN_FRAC``). :func:`verdict_probe_warning` counts them against the minimum of
each declared endpoint (``metrics.forgetting.MIN_EVALS``, ``cross_band_min_evals``) and names ``probes.every``
that would reach it. A sweep's runs (and the sweep at launch, when ``trainer.max_steps`` fixes their length) are
checked against the forgetting endpoints its comparison reports by default (``schema.DEFAULT_ENDPOINTS``) when
they declare none: a short grid sweep otherwise compares n/a forgetting figures.

Cost: a few integer operations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from dflash_lab.metrics.forgetting import MIN_EVALS, cross_band_min_evals
from dflash_lab.metrics.jumpiness import STEADY_MIN_FRAC


def min_window_evals(endpoint: str, n_bands: int) -> int | None:
    """Probe evaluations an endpoint needs inside the analysis window (None: it does not rest on probe dynamics).

    Example:
        >>> [min_window_evals(name, 6) for name in ("residual_amplitude", "cross_band_effect", "ktok_s")]
        [8, 11, None]
    """
    if endpoint in ("residual_amplitude", "own_share_slope"):
        return MIN_EVALS
    if endpoint == "cross_band_effect":
        return cross_band_min_evals(n_bands)
    return None


def window_start_step(end_step: int, window: float | str | None) -> int:
    """The first step inside the analysis window: after ``window`` x ``end_step`` (the first logged step past it,
    as ``analysis.summarize`` finds it); ``steady`` gives the earliest a steady state may start; None the rules'
    default.

    Example:
        >>> window_start_step(40, 0.25), window_start_step(40, "steady")
        (11, 4)
    """
    if window is None:
        from dflash_lab.analysis.protocol import RULES, RULES_VERSION

        window = RULES[RULES_VERSION]["window"]
    if window == "steady":
        return max(1, math.ceil(STEADY_MIN_FRAC * end_step))
    return math.floor(float(window) * end_step) + 1


def window_probe_evals(end_step: int, every: int, start_step: int) -> int:
    """Probe evaluations at steps ``start_step..end_step``: every multiple of ``every``, and the end step.

    Example:
        >>> window_probe_evals(40, 15, 11)   # steps 15, 30 and the end, 40
        3
    """
    if every <= 0 or end_step < start_step:
        return 0
    multiples = end_step // every - (start_step - 1) // every
    return multiples + (1 if end_step % every else 0)


def verdict_probe_warning(analysis: Mapping[str, Any] | None, *, end_step: int, probes_every: int,
                          n_bands: int, undeclared: Sequence[str] = (), who: str = "this run") -> str | None:
    """A warning when a run declared for a verdict cannot compute its declared probe-dynamics endpoints (the
    verdict's endpoint and ``analysis.endpoints``; ``undeclared``, e.g. the default endpoints of a sweep's
    comparison, when ``analysis.endpoints`` is null), naming the probes.every that would; None when it can, or when
    nothing is declared. ``who`` names the runs in the message (a sweep warns at launch for all of its runs).

    Example:
        >>> section = {"verdict": {"endpoint": "residual_amplitude"}, "window": 0.25}
        >>> print(verdict_probe_warning(section, end_step=40, probes_every=15, n_bands=6))  # doctest: +ELLIPSIS
        analysis: this run probes 3 time(s) in the analysis window (steps 11..40 of 40, probes.every=15): ...
        >>> verdict_probe_warning(section, end_step=390, probes_every=15, n_bands=6) is None
        True
    """
    analysis = analysis or {}
    verdict = analysis.get("verdict") or {}
    declared = [verdict.get("endpoint")] if verdict.get("endpoint") else []
    declared += [name for name in (analysis.get("endpoints") or undeclared or []) if name not in declared]
    needs = {name: need for name in declared if (need := min_window_evals(name, n_bands)) is not None}
    if not needs:
        return None
    start = window_start_step(end_step, analysis.get("window"))
    evals = window_probe_evals(end_step, probes_every, start)
    short = {name: need for name, need in needs.items() if evals < need}
    if not short:
        return None
    need = max(short.values())
    every = next((e for e in range(max(probes_every, 1), 0, -1) if window_probe_evals(end_step, e, start) >= need),
                 None)
    role = (f", and the verdict with it ({verdict['endpoint']} is its endpoint)" if verdict.get("endpoint") in short
            else "")
    fix = (f"set probes.every={every} or less (or train more steps)" if every is not None else
           f"the run is too short for {need} probes after step {start - 1}: train more steps (trainer.max_steps, "
           f"trainer.epochs)")
    return (f"analysis: {who} probes {evals} time(s) in the analysis window (steps {start}..{end_step} of "
            f"{end_step}, probes.every={probes_every}): "
            + ", ".join(f"{name} needs {n}" for name, n in short.items())
            + f"; compare will report NaN for {'it' if len(short) == 1 else 'them'}{role}: {fix}")
