"""The ablation's answer: controls that validate the instruments, then the question, as one `verdict.json`.

A sweep declares, before its runs, which arms play which role (`analysis.verdict`, checked by
analysis.protocol.check_verdict):

    analysis:
      verdict:
        endpoint: residual_amplitude         # the primary forgetting endpoint (schema.BETTER says which way is worse)
        positive_control: sampler=bucket_sequential,data.band_skills=aligned
        negative_control: sampler=bucket_sequential,data.band_skills=independent
        question: sampler=bucketed,sampler.run_length=1,data.band_skills=aligned

Each role is an arm selector (analysis.arms.parse_selector) that must match exactly one arm; its rows come from the
paired table (paired.PAIRED_COLUMNS: arm minus its stratum's baseline, seed by seed), which holds finished runs
only: a failed, killed or still running run is never a seed (`left_out` names each, with why).

Rules (alpha from the protocol, intervals are the paired t intervals):
    detected (positive control)   the interval of the primary endpoint excludes 0 on the worse side: the planted
                                  forgetting curriculum shows the signature the instrument is meant to see
    detected (negative control)   the interval excludes 0 on either side: the instrument reacts to length order when
                                  skills do not depend on length (a confound, e.g. length itself)
    valid                         positive detected and negative not detected; otherwise the answer is
                                  "inconclusive" and says which control failed
    answer                        valid: "small" if the question arm's primary interval excludes 0 on the worse side
                                  and its TOST verdict is equivalent (real but inside the declared margin), "yes"
                                  if it excludes 0 on the worse side only, "equivalent" if TOST only, else "no
                                  detectable effect" (with the share of the positive control's effect it could
                                  hide); each with the effect as a share of the positive control's
    throughput_ratio              question arm's mean Ktok/s / its baseline's (the same seeds), from the ktok_s row
    share_of_positive_control     question effect / positive control effect on the primary endpoint (both against
                                  their baselines), with a percentile bootstrap interval that resamples the seeds
                                  the four arms share (10,000 resamples; NaN interval below 5 seeds)
    co_primary                    what the user pays or gains, question arm minus its baseline, for each of
                                  CO_PRIMARY the sweep declared as an endpoint: tau of the worst length band and mean
                                  tau (acceptance length, the real verify loop), probe loss at equal optimizer steps,
                                  at equal epochs (real tokens; from rules version 5 named "at equal real tokens") and at equal
                                  modelled GPU time. Rules version >= 4:
                                  the answer states each of them with its interval and verdict
    instruments                   per forgetting endpoint (FORGETTING_ENDPOINTS declared): whether the positive
                                  control shows it on the worse side and whether the negative control reacts;
                                  `failed_positive_control` lists the endpoints the positive control did not move,
                                  instruments that cannot see planted forgetting
    amplitude_in_tau              what residual amplitude costs in tau: the least-squares slope of tau_band_min on
                                  residual_amplitude over every run (all arms, seeds), its correlation r, and the
                                  residual-amplitude margin the declared tau_band_min margin implies
                                  (margin_tau / |slope|), to set against the declared amplitude margin
    Rules version >= 5 (the protocol's RULES flags, passed as build_verdict's nested / controls_by_equivalence):
    units (nested)                the paired table's unit is the target where the seeds nest in several targets
                                  (paired.analysis_units); `units` gives unit, units, targets, seeds and the answer
                                  says "it rests on N targets and M seeds"; the share of the positive control is
                                  computed over the same units
    reacted (negative control,    with a declared margin for the endpoint: detected and not equivalent (its own
     controls_by_equivalence)     unadjusted TOST p >= alpha; negative_control_reaction says why unadjusted); a
                                  detected difference shown inside the margin is no reaction. Without a margin:
                                  detected, and the answer says the control was judged by detection.
                                  valid = positive detected and negative not reacted
    question_net_of_matched_control
                                  per seed (q - qb) - (m - mb), per unit as the paired table, with its t interval:
                                  m is `analysis.verdict.matched_control` where declared (the question's sampler on
                                  data where length carries no signal), else the negative control (`matched_by`)
    instruments (tau)             tau_band_min and tau join the instruments: a tau the positive control does not
                                  move on the worse side is in `failed_positive_control`, and the answer's tau
                                  statements say "tau did not detect the positive control" instead of a verdict
    throughput_from               padding-efficiency ratio, modelled-cost ratio (modelled time per real token) and
                                  the measured Ktok/s ratio; the answer claims the modelled one (else padding) and
                                  quotes the measured one as time-confounded unless arms interleave (arms run in
                                  blocks: the negative control, whose padding equals full_random's,
                                  measured +2.7 Ktok/s on the natural-data sweep)
    left_out, missing             the runs left out (not finished: run, arm, seed, status, why) and the seeds the
                                  roles' pairs lack, each named with its arm and cause (`missing_seeds`)
    missing arm                   a role whose selector matches no loaded run: "inconclusive", naming the missing
                                  arm (a selector matching several arms, or a key no run has, is refused)
    too few pairs                 a role with fewer than 2 finished seed pairs has no interval: "inconclusive: too
                                  few finished seed pairs", naming the role, never an interval of NaN
    time_to_target                rules version >= 5 with analysis.target declared (`add_time_to_target`): the
                                  level and how it was fixed, the question arm's and its baseline's mean steps,
                                  real tokens and modelled time to reach it (analysis.budgets.time_to_target), the
                                  paired diffs with intervals, the ratios question / baseline (steps_ratio,
                                  time_ratio) and the runs that never reached it; the answer adds "trade: <r>x the
                                  throughput (Ktok/s), <t>x the modelled GPU time to reach probe loss L (<s>x the
                                  steps: diff [interval] steps, n pairs, verdict)"
    early_window                  rules version >= 5, when probe_loss_early is paired: the paired probe-loss gap
                                  over the first 25% of the common step budget, stated in the answer too
    seeds                         the seeds the answer rests on: those of the question's primary paired row
                                  (n_seeds; 0 without that row), the number compare prints next to the verdict
    Rules version >= 6 (`finish_verdict`, the protocol's RULES flag recommendation):
    trade                         each ratio to the target (modelled GPU time, steps, real tokens) stated with its
                                  own paired interval, verdict and Holm p (`_trade_with_outcomes`)
    recommendation, composition   what to do and the update-count / composition split
                                  (analysis.recommendation); the answer adds the forgetting effect at most against
                                  its margin and the composition costs

Cost: a few table lookups.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from dflash_lab.analysis.arms import parse_selector
from dflash_lab.analysis.budgets import EARLY_SHARE
from dflash_lab.analysis.paired import (MIN_BOOTSTRAP_PAIRS, analysis_units, paired_t_p_value, per_seed_values,
                                        seed_targets, t_interval)
from dflash_lab.analysis.recommendation import build_recommendation, composition_phrase, forgetting_phrase
from dflash_lab.analysis.schema import BETTER

ROLES = ("positive_control", "negative_control", "question")
CO_PRIMARY = (("tau_band_min", "tau of the worst band"), ("tau", "mean tau"),
              ("probe_loss_at_steps", "probe loss at equal steps"),
              ("probe_loss_at_tokens", "probe loss at equal epochs (real tokens)"),
              ("probe_loss_at_time", "probe loss at equal modelled GPU time"))
EQUAL_TOKENS_LABEL = {"probe_loss_at_tokens": "probe loss at equal real tokens"}   # rules >= 5
FORGETTING_ENDPOINTS = ("residual_amplitude", "band_forgetting", "own_share_slope", "jumpiness")
TAU_ENDPOINTS = ("tau_band_min", "tau")


class MissingArm(ValueError):
    """No loaded run belongs to the arm a role names: the arm is missing (not launched, not finished, its folder
    not given), or its selector names no arm."""


def _matching_arm(runs: pd.DataFrame, role: str, selector_text: str,
                  config_values: Callable[[str], set[str]] | None = None) -> str:
    """The one arm a role's selector matches among the loaded runs.

    Raises:
        MissingArm: no loaded run matches (a term's key does not vary among the runs, which hold another value).
        ValueError: several arms match, or a key no loaded run has at all (misspelt).
    """
    selector = parse_selector(selector_text)
    arms_present = ", ".join(sorted(runs["arm"].dropna().unique()))
    chosen = runs
    for key, value in selector.items():
        if key not in runs.columns:   # not swept: every run holds one value of it, or none has the key
            held = config_values(key) if config_values is not None else set()
            if not held:
                swept = ", ".join(c for c in runs.columns if c == "sampler" or "." in c)
                raise ValueError(f"analysis.verdict.{role}={selector_text!r}: {[key]} is not a swept key of these "
                                 f"runs; swept keys: {swept}")
            if value not in held:
                raise MissingArm(f"the {role.replace('_', ' ')} arm ({selector_text}) is missing: no loaded run has "
                                 f"{key}={value} (they hold {', '.join(sorted(held))}); arms present: "
                                 f"{arms_present}")
            continue
        chosen = chosen[chosen[key].astype(str) == value]
    arms = sorted(chosen["arm"].dropna().unique())
    if not arms:
        raise MissingArm(f"the {role.replace('_', ' ')} arm ({selector_text}) is missing: no loaded run matches it "
                         f"(not launched, or its folder not given; check analysis.verdict.{role} if it should "
                         f"match one of the arms present: {arms_present})")
    if len(arms) > 1:
        raise ValueError(f"analysis.verdict.{role}={selector_text!r} matches {len(arms)} arms ({', '.join(arms)}): "
                         f"give key=value terms that select exactly one arm; arms: {arms_present}")
    return arms[0]


def _seed_set(runs: pd.DataFrame, arm: str | None, finished_only: bool) -> set[int]:
    if arm is None or "seed" not in runs.columns:
        return set()
    rows = runs[(runs["arm"] == arm) & runs["seed"].notna()]
    if finished_only and "status" in runs.columns:
        rows = rows[rows["status"] == "finished"]
    return {int(seed) for seed in rows["seed"]}


def missing_seeds(runs: pd.DataFrame, arms: dict[str, str | None], baselines: dict[str, str | None],
                  left_out: list[dict] | None = None) -> list[str]:
    """Which seeds the roles' pairs lack, and why: a seed any role arm or baseline ran (finished or not) that is
    not a finished pair of a role arm and its baseline, named with the run that is missing or left out.

    Example:
        >>> runs = pd.DataFrame({"arm": ["q", "q", "b", "b"], "seed": [0, 1, 0, 1],
        ...                      "status": ["finished", "failed", "finished", "finished"]})
        >>> missing_seeds(runs, {"question": "q"}, {"question": "b"},
        ...               [{"arm": "q", "seed": 1, "reason": "failed: loss is nan"}])
        ['seed 1 of q (question): failed: loss is nan']
    """
    if "seed" not in runs.columns:
        return []
    reasons = {(entry.get("arm"), entry.get("seed")): entry.get("reason") for entry in left_out or []}
    involved = [a for role in arms for a in (arms[role], baselines.get(role)) if a is not None]
    expected = set().union(*(_seed_set(runs, arm, False) for arm in involved)) if involved else set()
    lines: list[str] = []
    for role, arm in arms.items():
        if arm is None:
            continue
        baseline, name = baselines.get(role), role.replace("_", " ")
        for seed in sorted(expected):
            for which, label in ((arm, name), (baseline, f"baseline of the {name}")):
                if which is None or seed in _seed_set(runs, which, True):
                    continue
                why = reasons.get((which, seed)) or ("left out" if seed in _seed_set(runs, which, False)
                                                     else "no run")
                line = f"seed {seed} of {which} ({label}): {why}"
                if line.split(" (")[0] not in {existing.split(" (")[0] for existing in lines}:
                    lines.append(line)
    return lines


def _excludes_zero(row: pd.Series, side: str) -> bool:
    """The interval lies entirely on `side` ("worse", "better" or "either") of 0 for this endpoint."""
    low, high = float(row["ci_low"]), float(row["ci_high"])
    if not (math.isfinite(low) and math.isfinite(high)):
        return False
    above, below = low > 0, high < 0
    if side == "either":
        return above or below
    worse_is_higher = row["better"] == "lower"
    return (above if worse_is_higher else below) if side == "worse" else (below if worse_is_higher else above)


def _number(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _control(paired: pd.DataFrame, arm: str, endpoint: str, side: str) -> dict:
    rows = paired[(paired["policy"] == arm) & (paired["endpoint"] == endpoint)]
    if rows.empty:
        return {"arm": arm, "endpoint": endpoint, "diff": None, "ci_low": None, "ci_high": None, "p_value": None,
                "n_pairs": 0, "detected": False}
    row = rows.iloc[0]
    return {"arm": arm, "baseline": row["baseline"], "endpoint": endpoint, "diff": _number(row["diff"]),
            "ci_low": _number(row["ci_low"]), "ci_high": _number(row["ci_high"]),
            "p_value": _number(row["p_value"]), "n_pairs": int(row["n_pairs"]),
            "detected": _excludes_zero(row, side)}


def _fmt(value: float | None) -> str:
    return "nan" if value is None else f"{value:+.3g}"


def build_verdict(runs: pd.DataFrame, paired: pd.DataFrame, roles: dict[str, str], small_answer: bool = True,
                  state_costs: bool = True, left_out: list[dict] | None = None,
                  baselines: dict[str, str | None] | None = None,
                  config_values: Callable[[str], set[str]] | None = None, nested: bool = False,
                  controls_by_equivalence: bool = False, alpha: float = 0.05) -> dict:
    """verdict.json's content from the comparison's runs and paired tables (rules in the module docstring).

    Args:
        runs: Comparison.runs (columns arm, seed and the swept keys).
        paired: Comparison.paired.
        roles: analysis.verdict: endpoint plus a selector per role (ROLES).
        small_answer: the rules have the "small" answer (protocol rules version >= 2; before, "yes").
        state_costs: the answer states the co-primary endpoints (rules version >= 4).
        left_out: the runs the paired table left out (not finished): {run, arm, seed, status, reason} each.
        baselines: arm -> its stratum's baseline arm (`arms.pair_arms`), to name the seeds a role's baseline lacks.
        config_values: key -> the values the loaded runs hold at that config key (tells a missing arm from a
            misspelt selector key).
        nested: the paired table's unit is the target where seeds nest in several targets (rules version >= 5):
            `units` and the answer say how many targets and seeds the answer rests on, and the share of the
            positive control is computed over the same units.
        controls_by_equivalence: the rules of version >= 5 for controls (module docstring): the negative control
            reacts only when it fails equivalence, the question net of its matched control, tau instruments need
            the positive control, throughput claimed from padding and the modelled cost.
        alpha: the protocol's test level (the negative control's TOST under `controls_by_equivalence`).

    Raises:
        ValueError: a role selector that matches several arms or names a key no run has (naming
            analysis.verdict.<role>). A role whose arm has no loaded run is no error: the verdict is inconclusive
            and names the missing arm.

    Example:
        >>> runs = pd.DataFrame({"arm": ["seq", "bkt", "seqi", "fr"], "sampler": ["s", "b", "s", "f"],
        ...                      "data.band_skills": ["aligned", "aligned", "independent", "aligned"]})
        >>> def row(arm, endpoint, diff, low, high):
        ...     return {"policy": arm, "endpoint": endpoint, "diff": diff, "ci_low": low, "ci_high": high,
        ...             "p_value": 0.06, "p_holm": 0.2, "verdict": "inconclusive", "better": BETTER[endpoint],
        ...             "baseline": "fr", "n_pairs": 5, "arm_mean": 2.0, "baseline_mean": 1.0}
        >>> paired = pd.DataFrame([row("seq", "residual_amplitude", 0.05, 0.03, 0.07),
        ...                        row("seqi", "residual_amplitude", 0.001, -0.004, 0.006),
        ...                        row("bkt", "residual_amplitude", 0.002, -0.003, 0.007),
        ...                        row("bkt", "ktok_s", 9.0, 8.0, 10.0)])
        >>> v = build_verdict(runs, paired, {"endpoint": "residual_amplitude", "positive_control": "sampler=s,"
        ...                   "data.band_skills=aligned", "negative_control": "sampler=s,data.band_skills=independent",
        ...                   "question": "sampler=b"})
        >>> v["valid"], v["positive_control"]["detected"], v["negative_control"]["detected"], v["throughput_ratio"]
        (True, True, False, 2.0)
        >>> v["answer"].split(":")[0]
        'no detectable effect'
    """
    endpoint = roles["endpoint"]
    arms, missing_arms = role_arms(runs, roles, config_values)
    role_baselines = {role: (baselines or {}).get(arm) for role, arm in arms.items() if arm is not None}
    missing = missing_arms + missing_seeds(runs, arms, role_baselines, left_out)
    positive = _control(paired, arms["positive_control"], endpoint, "worse")
    negative = _control(paired, arms["negative_control"], endpoint, "either")
    question = paired[paired["policy"] == arms["question"]]
    rows = question_rows(question)
    ratio = ktok_ratio(question)
    verdict = {"seeds": answer_seeds(question, endpoint), "endpoint": endpoint, "better": BETTER[endpoint],
               "arms": arms, "positive_control": positive, "negative_control": negative,
               "bucketed_vs_full_random": rows, "throughput_ratio": ratio, "left_out": list(left_out or []),
               "missing": missing}
    verdict["share_of_positive_control"] = share_of_positive_control(
        runs, endpoint, arms["question"], question_baseline=rows_baseline(rows, endpoint),
        positive=arms["positive_control"], positive_baseline=positive.get("baseline"), nested=nested)
    verdict["co_primary"] = {name: row for name, _ in CO_PRIMARY for row in rows if row["endpoint"] == name}
    verdict["instruments"] = instruments(paired, arms["positive_control"], arms["negative_control"],
                                         FORGETTING_ENDPOINTS + (TAU_ENDPOINTS if controls_by_equivalence else ()),
                                         alpha if controls_by_equivalence else None)
    verdict["failed_positive_control"] = [name for name, seen in verdict["instruments"].items()
                                          if not seen["positive_control_detected"]]
    verdict["amplitude_in_tau"] = amplitude_in_tau(runs, paired)
    if nested:
        verdict["units"] = analysis_basis(question, endpoint)
    if controls_by_equivalence:
        add_controls_by_equivalence(verdict, runs, paired, roles, config_values, nested, alpha)
    reacted = negative["reacted"] if controls_by_equivalence else negative["detected"]
    short = _too_few_pairs(verdict, question, endpoint)
    verdict["valid"] = bool(not missing_arms and not short and positive["detected"] and not reacted)
    verdict["answer"] = _headline(verdict, question, endpoint, missing_arms, short, small_answer)
    verdict["answer"] += _qualifiers(verdict, missing_arms, missing, state_costs, controls_by_equivalence)
    return verdict


def role_arms(runs: pd.DataFrame, roles: dict[str, str],
              config_values: Callable[[str], set[str]] | None = None) -> tuple[dict[str, str | None], list[str]]:
    """The arm each role of ``ROLES`` names (None where it matches no loaded run), and why each missing one is
    missing (:class:`MissingArm`'s message)."""
    arms: dict[str, str | None] = {}
    missing_arms: list[str] = []
    for role in ROLES:
        try:
            arms[role] = _matching_arm(runs, role, roles[role], config_values)
        except MissingArm as error:
            arms[role] = None
            missing_arms.append(str(error))
    return arms, missing_arms


def question_rows(question: pd.DataFrame) -> list[dict]:
    """The question arm's paired rows as verdict.json states them (one per endpoint)."""
    return [{"endpoint": r["endpoint"], "diff": _number(r["diff"]), "ci_low": _number(r["ci_low"]),
             "ci_high": _number(r["ci_high"]), "p_holm": _number(r["p_holm"]), "verdict": r["verdict"],
             "baseline": r["baseline"], "n_pairs": int(r["n_pairs"]),
             "arm_mean": _number(r["arm_mean"]), "baseline_mean": _number(r["baseline_mean"]),
             "margin": _number(r["margin"]) if "margin" in r else None} for _, r in question.iterrows()]


def ktok_ratio(question: pd.DataFrame) -> float | None:
    """The question's mean measured Ktok/s over its baseline's (the ktok_s row's means); None without that row."""
    ktok = question[question["endpoint"] == "ktok_s"]
    if ktok.empty or not float(ktok.iloc[0]["baseline_mean"]) > 0:
        return None
    return _number(ktok.iloc[0]["arm_mean"] / ktok.iloc[0]["baseline_mean"])


def answer_seeds(question: pd.DataFrame, endpoint: str) -> int:
    """The seeds the answer rests on: those of the question's primary paired row (``n_seeds``, the seeds behind
    its units; ``n_pairs`` where the table has no such column), 0 without that row. The answer's "N seeds" and
    compare's printed count read this one number (before, the fewest pairs of any role's row: a missing control
    arm made it 0 while the answer said 2 seeds).

    Example:
        >>> answer_seeds(pd.DataFrame({"endpoint": ["x"], "n_pairs": [3], "n_seeds": [5]}), "x")
        5
    """
    rows = question[question["endpoint"] == endpoint]
    if rows.empty:
        return 0
    row = rows.iloc[0]
    seeds = row.get("n_seeds", row["n_pairs"])
    return int(seeds) if pd.notna(seeds) else int(row["n_pairs"])


def add_controls_by_equivalence(verdict: dict, runs: pd.DataFrame, paired: pd.DataFrame, roles: dict[str, str],
                                config_values: Callable[[str], set[str]] | None, nested: bool, alpha: float) -> None:
    """Rules version >= 5: the negative control's reaction by equivalence, the question net of its matched
    control, and where the claimed throughput comes from (module docstring)."""
    arms, endpoint = verdict["arms"], verdict["endpoint"]
    verdict["negative_control"].update(negative_control_reaction(paired, arms["negative_control"], endpoint, alpha))
    verdict["question_net_of_matched_control"] = net_of_matched_control(
        runs, paired, endpoint, arms["question"], matched_control_arm(runs, roles, arms, config_values), nested,
        alpha)
    verdict["throughput_from"] = throughput_from(runs, arms["question"], question_baseline(verdict),
                                                 verdict["throughput_ratio"])


def _headline(verdict: dict, question: pd.DataFrame, endpoint: str, missing_arms: list[str], short: str,
              small_answer: bool) -> str:
    """The answer's first clause: inconclusive for a missing arm or too few pairs, else the rule's answer."""
    if missing_arms:
        return "inconclusive: " + "; ".join(missing_arms)
    if short:
        return "inconclusive: too few finished seed pairs for an interval (at least 2): " + short
    return _answer(verdict, question, endpoint, small_answer)


def _qualifiers(verdict: dict, missing_arms: list[str], missing: list[str], state_costs: bool,
                controls_by_equivalence: bool) -> str:
    """What follows the headline: the controls (rules >= 5), the units, the seeds missing from the pairs and the
    co-primary endpoints at equal compute (rules >= 4)."""
    text = ""
    if controls_by_equivalence and not missing_arms:
        text += _controls_phrase(verdict)
    if "units" in verdict:
        text += "; " + _basis_phrase(verdict["units"])
    if missing and not missing_arms:
        text += f"; missing from the pairs: {'; '.join(missing)}"
    if state_costs and verdict["co_primary"]:
        blind = set(verdict["failed_positive_control"]) if controls_by_equivalence else set()
        # From rules version 5 the real-tokens reading is named for what it is: at equal steps it reads the arm
        # with more tokens per step mid-schedule against the baseline's annealed end, not an equal-epochs design.
        labels = {**dict(CO_PRIMARY), **(EQUAL_TOKENS_LABEL if controls_by_equivalence else {})}
        text += "; at equal compute, " + "; ".join(
            _cost_phrase(labels[name], verdict["co_primary"][name], name in blind) for name, _ in CO_PRIMARY
            if name in verdict["co_primary"])
    return text


def _too_few_pairs(verdict: dict, question: pd.DataFrame, endpoint: str) -> str:
    """Which roles have fewer than 2 finished seed pairs on the primary endpoint ("" when none): their interval
    would be NaN, which is no evidence either way."""
    rows = question[question["endpoint"] == endpoint]
    counts = {"positive control": verdict["positive_control"]["n_pairs"],
              "negative control": verdict["negative_control"]["n_pairs"],
              "question": int(rows.iloc[0]["n_pairs"]) if not rows.empty else 0}
    return ", ".join(f"the {role} ({verdict['arms'][key]}) has {count}"
                     for (role, count), key in zip(counts.items(), ROLES) if count < 2)


def _cost_phrase(label: str, row: dict, blind: bool = False) -> str:
    """One co-primary endpoint with its interval and verdict; ``blind``: an instrument that did not detect the
    positive control (rules version >= 5), whose difference is no verdict either way."""
    judged = f"{row['endpoint'].split('_')[0]} did not detect the positive control" if blind else row["verdict"]
    return (f"{label} {_fmt(row['diff'])} [{_fmt(row['ci_low'])}, {_fmt(row['ci_high'])}] ({judged}, "
            f"{_plain(row['baseline_mean'])} -> {_plain(row['arm_mean'])})")


def _plain(value: float | None) -> str:
    return "nan" if value is None else f"{value:.3g}"


def instruments(paired: pd.DataFrame, positive: str, negative: str,
                endpoints: tuple[str, ...] = FORGETTING_ENDPOINTS,
                alpha: float | None = None) -> dict[str, dict[str, bool]]:
    """Per declared endpoint of ``endpoints``: does the positive control move it on the worse side, and does the
    negative control move it at all (the rules of the primary endpoint, applied to each). With ``alpha`` (rules
    version >= 5, where ``endpoints`` also holds TAU_ENDPOINTS) each also says whether the negative control
    reacted by :func:`negative_control_reaction`.

    Example:
        >>> paired = pd.DataFrame({"policy": ["p", "n"], "endpoint": ["tau", "tau"], "ci_low": [-0.2, -0.01],
        ...                        "ci_high": [0.18, 0.02], "better": ["higher", "higher"], "margin": [0.05, 0.05],
        ...                        "p_tost": [0.3, 0.001]})
        >>> instruments(paired, "p", "n", ("tau",), alpha=0.05)["tau"]
        {'positive_control_detected': False, 'negative_control_detected': False, 'negative_control_reacted': False}
    """
    seen: dict[str, dict[str, bool]] = {}
    for name in endpoints:
        rows = {arm: paired[(paired["policy"] == arm) & (paired["endpoint"] == name)] for arm in (positive, negative)}
        if rows[positive].empty:
            continue
        seen[name] = {"positive_control_detected": _excludes_zero(rows[positive].iloc[0], "worse"),
                      "negative_control_detected": (not rows[negative].empty
                                                    and _excludes_zero(rows[negative].iloc[0], "either"))}
        if alpha is not None:
            seen[name]["negative_control_reacted"] = bool(
                negative_control_reaction(paired, negative, name, alpha)["reacted"])
    return seen


def amplitude_in_tau(runs: pd.DataFrame, paired: pd.DataFrame) -> dict:
    """What residual amplitude costs in tau (module docstring): slope of tau_band_min on residual_amplitude over
    every run, r, n, and the amplitude margin implied by the declared tau_band_min margin (None where either
    endpoint is missing, fewer than 3 runs, or no tau margin was declared).

    Example:
        >>> runs = pd.DataFrame({"residual_amplitude": [0.01, 0.02, 0.03, 0.04],
        ...                      "tau_band_min": [1.50, 1.45, 1.40, 1.35]})
        >>> paired = pd.DataFrame({"endpoint": ["tau_band_min"], "margin": [0.05]})
        >>> a = amplitude_in_tau(runs, paired)
        >>> round(a["slope"], 2), round(a["r"], 2), a["runs"], round(a["implied_margin"], 3)
        (-5.0, -1.0, 4, 0.01)
    """
    empty = {"slope": None, "r": None, "runs": 0, "tau_margin": None, "implied_margin": None}
    if not {"residual_amplitude", "tau_band_min"} <= set(runs.columns):
        return empty
    pairs = runs[["residual_amplitude", "tau_band_min"]].apply(pd.to_numeric, errors="coerce").dropna()
    x, y = pairs["residual_amplitude"].to_numpy(float), pairs["tau_band_min"].to_numpy(float)
    if len(x) < 3 or np.ptp(x) == 0:
        return {**empty, "runs": int(len(x))}
    slope = float(np.polyfit(x, y, 1)[0])
    r = float(np.corrcoef(x, y)[0, 1]) if np.ptp(y) > 0 else 0.0
    margins = paired.loc[paired["endpoint"] == "tau_band_min", "margin"] if "margin" in paired else pd.Series()
    tau_margin = _number(margins.iloc[0]) if len(margins) else None
    implied = tau_margin / abs(slope) if tau_margin is not None and slope != 0 else None
    return {"slope": slope, "r": r, "runs": int(len(x)), "tau_margin": tau_margin, "implied_margin": implied}


def question_baseline(verdict: dict) -> str | None:
    """The question arm's baseline: that of its primary endpoint's row, else of any of its rows (a run too short
    for the primary endpoint still has a baseline to compare throughput and time to target with)."""
    rows = verdict.get("bucketed_vs_full_random") or []
    return rows_baseline(rows, verdict.get("endpoint")) or next((row["baseline"] for row in rows), None)


def rows_baseline(rows: list[dict], endpoint: str | None) -> str | None:
    """The baseline arm of the question's row for ``endpoint`` (None: no such row)."""
    return next((r["baseline"] for r in rows if r["endpoint"] == endpoint), None)


def share_of_positive_control(runs: pd.DataFrame, endpoint: str, question: str, question_baseline: str | None,
                              positive: str, positive_baseline: str | None, resamples: int = 10_000,
                              seed: int = 0, alpha: float = 0.05, nested: bool = False) -> dict:
    """The question's effect as a share of the positive control's: mean(q_i - qb_i) / mean(p_i - pb_i) over the
    seeds i all four arms share, with a percentile bootstrap interval over those seeds (resampled together, so
    the pairing is kept). ``nested`` (rules version >= 5): over the paired table's units instead, i.e. per target
    the mean of its seeds' differences where the seeds span several targets (paired.analysis_units), the
    bootstrap resampling targets (``seeds`` then counts targets).

    Example:
        >>> runs = pd.DataFrame({"arm": ["q"] * 5 + ["b"] * 5 + ["p"] * 5, "seed": list(range(5)) * 3,
        ...                      "x": [1.2, 1.1, 1.3, 1.2, 1.2] + [1.0] * 5 + [2.0, 2.1, 1.9, 2.0, 2.0]})
        >>> share = share_of_positive_control(runs, "x", "q", "b", "p", "b")
        >>> round(share["value"], 2), share["ci_low"] < 0.2 < share["ci_high"], share["seeds"]
        (0.2, True, 5)
    """
    empty = {"value": None, "ci_low": None, "ci_high": None, "seeds": 0}
    if endpoint not in runs.columns or question_baseline is None or positive_baseline is None:
        return empty
    per_seed = pd.concat([per_seed_values(runs, arm, endpoint) for arm in (question, question_baseline, positive,
                                                                      positive_baseline)],
                         axis=1, keys=["q", "qb", "p", "pb"], join="inner").dropna()
    if per_seed.empty:
        return empty
    targets = seed_targets(runs)
    q = analysis_units(per_seed["q"] - per_seed["qb"], targets, nested)[0].to_numpy()
    p = analysis_units(per_seed["p"] - per_seed["pb"], targets, nested)[0].to_numpy()
    value = float(q.mean() / p.mean()) if p.mean() != 0 else float("nan")
    low = high = float("nan")
    if q.size >= MIN_BOOTSTRAP_PAIRS:
        picks = np.random.default_rng(seed).integers(0, q.size, size=(resamples, q.size))
        denominators = p[picks].mean(axis=1)
        ratios = q[picks].mean(axis=1)[denominators != 0] / denominators[denominators != 0]
        if ratios.size:
            low, high = (float(x) for x in np.quantile(ratios, [alpha / 2, 1 - alpha / 2]))
    return {"value": _number(value), "ci_low": _number(low), "ci_high": _number(high), "seeds": int(q.size)}


def _answer(verdict: dict, question: pd.DataFrame, endpoint: str, small_answer: bool = True) -> str:
    positive, negative = verdict["positive_control"], verdict["negative_control"]
    if not verdict["valid"]:
        reasons = []
        if not positive["detected"]:
            reasons.append(f"the positive control ({positive['arm']}) did not show the signature on {endpoint} "
                           f"(diff {_fmt(positive['diff'])}, 95% CI [{_fmt(positive['ci_low'])}, "
                           f"{_fmt(positive['ci_high'])}])")
        if negative.get("reacted", negative["detected"]):
            reasons.append(f"the negative control ({negative['arm']}) reacted (diff {_fmt(negative['diff'])}, 95% CI "
                           f"[{_fmt(negative['ci_low'])}, {_fmt(negative['ci_high'])}])")
        return "inconclusive: " + "; ".join(reasons)
    rows = question[question["endpoint"] == endpoint]
    if rows.empty:
        return f"inconclusive: no paired {endpoint} for {verdict['arms']['question']}"
    row = rows.iloc[0]
    interval = f"{endpoint} diff {_fmt(_number(row['diff']))}, 95% CI [{_fmt(_number(row['ci_low']))}, " \
               f"{_fmt(_number(row['ci_high']))}]"
    speed = "" if verdict["throughput_ratio"] is None else f", at {verdict['throughput_ratio']:.2f}x the throughput"
    if "throughput_from" in verdict:
        speed = _speed_phrase(verdict["throughput_from"])
    share = float(row["diff"]) / abs(positive["diff"]) if positive["diff"] else float("nan")
    detected, equivalent = _excludes_zero(row, "worse"), row["verdict"] == "equivalent"
    ratio = verdict.get("share_of_positive_control") or {}
    ratio_ci = (f", 95% CI [{ratio['ci_low']:.0%}, {ratio['ci_high']:.0%}]"
                if ratio.get("ci_low") is not None and ratio.get("ci_high") is not None else "")
    of_control = f"{share:.0%}{ratio_ci} of the positive control's {_fmt(positive['diff'])}"
    if detected and equivalent and small_answer:
        return (f"small: {verdict['arms']['question']} shows a detectable forgetting signature ({interval}; "
                f"{of_control}) that stays inside the margin {row['margin']:g} declared irrelevant before the "
                f"runs{speed}")
    if detected:
        return f"yes: {verdict['arms']['question']} shows the forgetting signature ({interval}; {of_control}){speed}"
    if equivalent:
        return f"equivalent: no forgetting beyond the declared margin {row['margin']:g} ({interval}){speed}"
    worst = float(row["ci_high"] if row["better"] == "lower" else -row["ci_low"])
    bound = worst / abs(positive["diff"]) if positive["diff"] else float("nan")
    return (f"no detectable effect: {interval}; at most {bound:.0%} of the positive control's effect "
            f"({_fmt(positive['diff'])}){speed}")


# ------------------------------------------------------------------------------ rules version >= 5 (controls)
def _finished(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["status"] == "finished"] if "status" in runs.columns else runs


def _row(paired: pd.DataFrame, arm: str | None, endpoint: str) -> pd.Series | None:
    rows = paired[(paired["policy"] == arm) & (paired["endpoint"] == endpoint)] if arm is not None else paired[:0]
    return rows.iloc[0] if not rows.empty else None


def negative_control_reaction(paired: pd.DataFrame, arm: str | None, endpoint: str, alpha: float) -> dict:
    """Whether the negative control reacts on ``endpoint`` (rules version >= 5, `controls_by_equivalence`).

    With a declared margin m: reacted = detected (its t interval excludes 0) and not equivalent (its own TOST of
    |diff| < m, unadjusted p_tost >= alpha). A difference shown to lie inside the margin declared irrelevant is
    no reaction even when detected: at many seeds every confound, however small, is detected, and a rule by
    detection alone would void almost surely while the question is judged by the same margin. The TOST is
    unadjusted: validity rests on this one endpoint of this one arm, a family of one (the paired table's
    p_tost_holm adjusts over the arm's endpoints, which validity does not use). Without a margin: reacted =
    detected (the rule of version <= 4), and ``rule`` says so.

    Example:
        >>> paired = pd.DataFrame({"policy": ["n"], "endpoint": ["x"], "ci_low": [0.002], "ci_high": [0.004],
        ...                        "better": ["lower"], "margin": [0.01], "p_tost": [0.0001]})
        >>> negative_control_reaction(paired, "n", "x", 0.05)["reacted"]   # detected, but inside the margin
        False
        >>> negative_control_reaction(paired.assign(margin=float("nan")), "n", "x", 0.05)["rule"]
        'detection: no margin declared for x'
    """
    row = _row(paired, arm, endpoint)
    if row is None:
        return {"margin": None, "p_tost": None, "equivalent": False, "reacted": False, "rule": "no paired row"}
    detected = _excludes_zero(row, "either")
    margin = _number(row["margin"]) if "margin" in row else None
    if margin is None:
        return {"margin": None, "p_tost": None, "equivalent": False, "reacted": detected,
                "rule": f"detection: no margin declared for {endpoint}"}
    p_tost = _number(row["p_tost"]) if "p_tost" in row else None
    equivalent = p_tost is not None and p_tost < alpha
    return {"margin": margin, "p_tost": p_tost, "equivalent": bool(equivalent),
            "reacted": bool(detected and not equivalent),
            "rule": f"equivalence: reacts when detected and not equivalent within {margin:g} (TOST p < {alpha:g})"}


def matched_control_arm(runs: pd.DataFrame, roles: dict[str, str], arms: dict[str, str | None],
                        config_values: Callable[[str], set[str]] | None = None) -> tuple[str | None, str]:
    """The question's matched control (the question's sampler on data where length carries no signal) and how it
    was found: the declared `analysis.verdict.matched_control`, else the negative control (the natural-data
    protocol's control for order: same bucket sizes and visiting order, membership independent of length).

    Example:
        >>> runs = pd.DataFrame({"arm": ["q", "qi"], "data.band_skills": ["aligned", "independent"]})
        >>> matched_control_arm(runs, {"matched_control": "data.band_skills=independent"}, {})
        ('qi', 'declared (analysis.verdict.matched_control)')
        >>> matched_control_arm(runs, {}, {"negative_control": "n"})
        ('n', 'the negative control (no analysis.verdict.matched_control declared)')
    """
    if roles.get("matched_control"):
        try:
            return (_matching_arm(runs, "matched_control", roles["matched_control"], config_values),
                    "declared (analysis.verdict.matched_control)")
        except MissingArm as error:
            return None, str(error)
    return arms.get("negative_control"), "the negative control (no analysis.verdict.matched_control declared)"


def net_of_matched_control(runs: pd.DataFrame, paired: pd.DataFrame, endpoint: str, question: str | None,
                           matched: tuple[str | None, str], nested: bool, alpha: float = 0.05) -> dict:
    """The question's effect net of its matched control: per seed s, (q_s - qb_s) - (m_s - mb_s) (each arm minus
    its own baseline, the seeds all four share), then per unit as in the paired table (per target the mean of its
    seeds where ``nested`` and they span several targets), its mean, t interval and paired t p-value over the
    units. What remains is what length order adds beyond what the sampler does without a length signal.

    Example:
        >>> runs = pd.DataFrame({"arm": ["q"] * 4 + ["m"] * 4 + ["b"] * 4, "seed": [0, 1, 2, 3] * 3,
        ...                      "x": [1.3, 1.2, 1.3, 1.2, 1.1, 1.0, 1.1, 1.0, 1.0, 0.9, 1.0, 0.9]})
        >>> paired = pd.DataFrame({"policy": ["q", "m"], "endpoint": ["x", "x"], "baseline": ["b", "b"]})
        >>> net = net_of_matched_control(runs, paired, "x", "q", ("m", "declared"), nested=False)
        >>> round(net["diff"], 3), net["n_pairs"], net["unit"]
        (0.2, 4, 'seed')
    """
    arm, matched_by = matched
    empty = {"arm": question, "matched_control": arm, "matched_by": matched_by, "endpoint": endpoint, "diff": None,
             "ci_low": None, "ci_high": None, "p_t": None, "n_pairs": 0, "unit": "seed", "n_targets": 0,
             "n_seeds": 0}
    question_row, matched_row = _row(paired, question, endpoint), _row(paired, arm, endpoint)
    if (question_row is None or matched_row is None or arm == question
            or not {"seed", endpoint} <= set(runs.columns)):
        return empty
    finished = _finished(runs)
    per_seed = pd.concat([per_seed_values(finished, name, endpoint) for name in
                          (question, question_row["baseline"], arm, matched_row["baseline"])],
                         axis=1, keys=["q", "qb", "m", "mb"], join="inner").dropna()
    net = (per_seed["q"] - per_seed["qb"]) - (per_seed["m"] - per_seed["mb"])
    units, unit, n_targets = analysis_units(net, seed_targets(finished), nested)
    if units.size < 2:
        return {**empty, "n_pairs": int(units.size), "n_seeds": int(net.size)}
    low, high = t_interval(units.to_numpy(), alpha)
    return {**empty, "diff": _number(units.mean()), "ci_low": _number(low), "ci_high": _number(high),
            "p_t": _number(paired_t_p_value(units.to_numpy())), "n_pairs": int(units.size), "unit": unit,
            "n_targets": n_targets, "n_seeds": int(net.size)}


def throughput_from(runs: pd.DataFrame, question: str | None, baseline: str | None,
                    measured: float | None) -> dict:
    """Where the question's throughput ratio over its baseline comes from (finished runs, the seeds both share;
    each a ratio of the arms' means, > 1: the question is faster):

        padding_efficiency   mean pad_eff (real / padded tokens) of the question / of its baseline
        modelled_cost        baseline's mean modelled time per real token (modelled_time_s / real_tokens_total,
                             the declared cost model) / the question's: NaN without a cost model
        measured_ktok_s      the measured Ktok/s ratio (`throughput_ratio`): confounded with when each arm ran
                             (arms run in blocks share a machine with different neighbours), unless arms interleave
        claim                the ratio the answer states: modelled_cost, else padding_efficiency, else
                             measured_ktok_s

    Example:
        >>> runs = pd.DataFrame({"arm": ["q", "q", "b", "b"], "seed": [0, 1, 0, 1], "pad_eff": [0.8, 0.8, 0.4, 0.4],
        ...                      "modelled_time_s": [1.0, 1.0, 2.0, 2.0], "real_tokens_total": [10.0] * 4})
        >>> t = throughput_from(runs, "q", "b", 2.5)
        >>> t["padding_efficiency"], t["modelled_cost"], t["claim"], t["seeds"]
        (2.0, 2.0, 'modelled_cost', 2)
    """
    empty = {"padding_efficiency": None, "modelled_cost": None, "measured_ktok_s": measured, "claim": None,
             "seeds": 0}
    if question is None or baseline is None or "pad_eff" not in runs.columns:
        return empty
    finished = _finished(runs).copy()
    if {"modelled_time_s", "real_tokens_total"} <= set(finished.columns):
        tokens = pd.to_numeric(finished["real_tokens_total"], errors="coerce")
        finished["time_per_token"] = pd.to_numeric(finished["modelled_time_s"], errors="coerce") / tokens.where(
            tokens > 0)
    else:
        finished["time_per_token"] = np.nan
    ratios = {}
    for column, key, faster_is_higher in (("pad_eff", "padding_efficiency", True),
                                          ("time_per_token", "modelled_cost", False)):
        pairs = pd.concat([per_seed_values(finished, question, column), per_seed_values(finished, baseline, column)],
                          axis=1, keys=["q", "b"], join="inner").dropna()
        q, b = float(pairs["q"].mean()) if len(pairs) else np.nan, float(pairs["b"].mean()) if len(pairs) else np.nan
        ratio = (q / b if faster_is_higher else b / q) if len(pairs) and q > 0 and b > 0 else float("nan")
        ratios[key] = (_number(ratio), len(pairs))
    claim = next((key for key in ("modelled_cost", "padding_efficiency") if ratios[key][0] is not None),
                 "measured_ktok_s" if measured is not None else None)
    return {"padding_efficiency": ratios["padding_efficiency"][0], "modelled_cost": ratios["modelled_cost"][0],
            "measured_ktok_s": measured, "claim": claim, "seeds": int(ratios["padding_efficiency"][1])}


def _speed_phrase(source: dict) -> str:
    """The answer's throughput statement, saying where the ratio comes from (:func:`throughput_from`)."""
    measured = source["measured_ktok_s"]
    caveat = (f"; measured Ktok/s {measured:.2f}x, time-confounded unless arms interleave"
              if measured is not None else "")
    if source["claim"] == "modelled_cost":
        return (f", at {source['modelled_cost']:.2f}x the throughput by padding and the modelled cost (padding "
                f"efficiency {_times(source['padding_efficiency'])}, modelled time per real token "
                f"{source['modelled_cost']:.2f}x){caveat}")
    if source["claim"] == "padding_efficiency":
        return (f", at {source['padding_efficiency']:.2f}x the throughput by padding efficiency (no cost model "
                f"declared){caveat}")
    if source["claim"] == "measured_ktok_s":
        return f", at {measured:.2f}x the measured Ktok/s (time-confounded unless arms interleave; no padding record)"
    return ""


def _times(value: float | None) -> str:
    return "nan" if value is None else f"{value:.2f}x"


def analysis_basis(question: pd.DataFrame, endpoint: str) -> dict:
    """What the question's primary row rests on: its unit (seed or target), the number of units, targets and seeds.

    Example:
        >>> analysis_basis(pd.DataFrame({"endpoint": ["x"], "unit": ["target"], "n_pairs": [3], "n_targets": [3],
        ...                              "n_seeds": [5]}), "x")
        {'unit': 'target', 'units': 3, 'targets': 3, 'seeds': 5}
    """
    rows = question[question["endpoint"] == endpoint]
    if rows.empty:
        return {"unit": "seed", "units": 0, "targets": 0, "seeds": 0}
    row = rows.iloc[0]
    return {"unit": str(row.get("unit", "seed")), "units": int(row["n_pairs"]),
            "targets": int(row.get("n_targets", 0)), "seeds": int(row.get("n_seeds", row["n_pairs"]))}


def _basis_phrase(units: dict) -> str:
    seeds = f"{units['seeds']} seed{'s' if units['seeds'] != 1 else ''}"
    if not units["units"]:
        return f"it rests on {seeds} (no paired primary endpoint)"
    if not units["targets"]:
        return f"it rests on {seeds} (no target recorded; the seed is the unit)"
    targets = f"{units['targets']} target{'s' if units['targets'] != 1 else ''}"
    return f"it rests on {targets} and {seeds} (the {units['unit']} is the unit of analysis)"


def _controls_phrase(verdict: dict) -> str:
    """The negative control's rule and the question net of its matched control, for the answer (version >= 5)."""
    negative, parts = verdict["negative_control"], []
    if negative.get("margin") is None:
        parts.append(f"the negative control is judged by detection (no margin declared for {negative['endpoint']})")
    else:
        shown = "equivalent" if negative["equivalent"] else "not shown equivalent"
        parts.append(f"the negative control {_fmt(negative['diff'])} [{_fmt(negative['ci_low'])}, "
                     f"{_fmt(negative['ci_high'])}] is {shown} within its margin {negative['margin']:g} (TOST p "
                     f"{_plain(negative['p_tost'])}){': it reacted' if negative['reacted'] else ''}")
    net = verdict["question_net_of_matched_control"]
    if net["diff"] is not None:
        parts.append(f"net of its matched control ({net['matched_control']}, {net['matched_by']}) the question's "
                     f"{net['endpoint']} is {_fmt(net['diff'])} [{_fmt(net['ci_low'])}, {_fmt(net['ci_high'])}]")
    return "; " + "; ".join(parts)


# ------------------------------------------------------------------------------------- time to target (rules >= 5)
TARGET_ENDPOINTS = (("steps_to_target", "steps"), ("tokens_to_target", "real tokens"),
                    ("time_to_target", "modelled GPU time"))


def _target_row(paired: pd.DataFrame, arm: str, endpoint: str) -> dict | None:
    rows = paired[(paired["policy"] == arm) & (paired["endpoint"] == endpoint)]
    if rows.empty:
        return None
    row = rows.iloc[0]
    ratio = (float(row["arm_mean"]) / float(row["baseline_mean"])
             if math.isfinite(float(row["baseline_mean"])) and float(row["baseline_mean"]) > 0 else float("nan"))
    return {"baseline": row["baseline"], "baseline_mean": _number(row["baseline_mean"]),
            "question_mean": _number(row["arm_mean"]), "diff": _number(row["diff"]),
            "ci_low": _number(row["ci_low"]), "ci_high": _number(row["ci_high"]), "verdict": row["verdict"],
            "p_holm": _number(row["p_holm"]) if "p_holm" in row else None,
            "margin": _number(row["margin"]), "n_pairs": int(row["n_pairs"]), "ratio": _number(ratio)}


def _trade_throughput(verdict: dict) -> list[str]:
    """The trade's throughput: the ratio the answer claims (``throughput_from``: the modelled cost, else padding
    efficiency, which arms running at different times cannot confound), else the measured Ktok/s ratio.

    Example:
        >>> _trade_throughput({"throughput_ratio": 2.24, "throughput_from": {"claim": "modelled_cost",
        ...                    "modelled_cost": 1.646, "padding_efficiency": 1.646, "measured_ktok_s": 2.24}})
        ['1.65x the throughput (modelled cost)']
    """
    source = verdict.get("throughput_from") or {}
    claim = source.get("claim")
    if claim in ("modelled_cost", "padding_efficiency") and source.get(claim) is not None:
        return [f"{source[claim]:.2f}x the throughput ({claim.replace('_', ' ')})"]
    if verdict.get("throughput_ratio") is None:
        return []
    return [f"{verdict['throughput_ratio']:.2f}x the throughput (Ktok/s)"]


def add_time_to_target(verdict: dict, paired: pd.DataFrame, target: dict | None, early_step: float,
                       state_outcome: bool = False) -> None:
    """Rules version >= 5: state the trade of the question arm in verdict.json and its answer.

    Adds ``time_to_target`` (with a declared analysis.target): the level and how it was fixed, per endpoint
    (steps, real tokens, modelled time to target) the baseline's and the question's mean over the seed pairs both
    reached it, the paired diff [t interval], verdict, Holm p, pairs and the ratio question / baseline, and the
    runs that never reached it; and ``early_window``: the paired probe_loss_early row (mean probe loss over the
    first EARLY_SHARE of the common step budget). The answer gains one sentence: "trade: <throughput>x the
    throughput (Ktok/s), <time ratio>x the modelled GPU time to reach probe loss L (<steps ratio>x the steps: diff
    [interval] steps, n pairs)", and the early-window gap. ``state_outcome`` (rules version >= 6): each ratio
    carries its own test's outcome instead (:func:`_trade_with_outcomes`).

    Example:
        >>> def row(endpoint, arm_mean, diff):
        ...     return {"policy": "q", "endpoint": endpoint, "baseline": "b", "arm_mean": arm_mean,
        ...             "baseline_mean": arm_mean - diff, "diff": diff, "ci_low": diff - 1, "ci_high": diff + 1,
        ...             "verdict": "worse", "margin": float("nan"), "n_pairs": 5, "p_holm": 0.01}
        >>> paired = pd.DataFrame([row("steps_to_target", 120.0, 20.0), row("time_to_target", 130.0, 30.0)])
        >>> verdict = {"arms": {"question": "q"}, "throughput_ratio": 2.0, "answer": "no detectable effect"}
        >>> add_time_to_target(verdict, paired, {"levels": {"b": 2.3}, "fixed_by": "declared"}, early_step=25.0)
        >>> verdict["answer"]
        'no detectable effect; trade: 2.00x the throughput (Ktok/s), 1.30x the modelled GPU time to reach probe \
loss 2.3 (1.20x the steps: +20 [+19, +21] steps, 5 pairs, worse)'
    """
    question = (verdict.get("arms") or {}).get("question")
    if question is None:
        return
    sentences = []
    if target is not None:
        entry = time_to_target_entry(paired, question, target, question_baseline(verdict))
        verdict["time_to_target"] = entry
        sentences += [_trade_with_outcomes(verdict, entry) if state_outcome else _trade(verdict, entry)]
    early = paired[(paired["policy"] == question) & (paired["endpoint"] == "probe_loss_early")]
    if not early.empty:
        verdict["early_window"] = _early_window(early.iloc[0], early_step)
        window = verdict["early_window"]
        sentences.append(f"paired probe-loss gap over the first {EARLY_SHARE:.0%} of steps (to step "
                         f"{early_step:.0f}) {_fmt(window['diff'])} [{_fmt(window['ci_low'])}, "
                         f"{_fmt(window['ci_high'])}] ({window['verdict']})")
    sentences = [sentence for sentence in sentences if sentence]
    if sentences:
        verdict["answer"] += "; " + "; ".join(sentences)


def time_to_target_entry(paired: pd.DataFrame, question: str, target: dict, baseline: str | None = None) -> dict:
    """verdict.json's ``time_to_target``: the level, how it was fixed, the question's paired rows of steps, real
    tokens and modelled time to reach it (:func:`_target_row`), their ratios, and the runs that never reached it.
    ``baseline``: the question's baseline where no time-to-target row names it (no seed pair reached the level)."""
    rows = {name: _target_row(paired, question, name) for name, _ in TARGET_ENDPOINTS}
    baseline = next((row["baseline"] for row in rows.values() if row is not None), baseline)
    levels = target.get("levels") or {}
    return {"probe_loss": levels.get("all", levels.get(baseline)), "fixed_by": target.get("fixed_by"),
            "rule": target.get("rule"), "at": target.get("at"), "step": target.get("step"),
            "ratio_margin": target.get("margin"), "question": question, "baseline": baseline, **rows,
            "steps_ratio": (rows["steps_to_target"] or {}).get("ratio"),
            "time_ratio": (rows["time_to_target"] or {}).get("ratio"),
            "not_reached": [entry for entry in target.get("not_reached", []) if entry["arm"] in (question, baseline)]}


def _trade(verdict: dict, entry: dict) -> str:
    """The rules-5 trade sentence (the steps' test stated, the time ratio as a point value); "" without a level."""
    level, steps = entry["probe_loss"], entry["steps_to_target"]
    if level is None:
        return ""
    if steps is None:
        return _never_reached(entry)
    head = _trade_throughput(verdict)
    interval = (f"{_fmt(steps['diff'])} [{_fmt(steps['ci_low'])}, {_fmt(steps['ci_high'])}] steps, "
                f"{steps['n_pairs']} pairs, {steps['verdict']}")
    if entry["not_reached"]:
        interval += f"; {len(entry['not_reached'])} run(s) never reached it, their pairs left out"
    if entry["time_ratio"] is not None:
        head.append(f"{entry['time_ratio']:.2f}x the modelled GPU time to reach probe loss {level:.4g}")
        detail = f"{_plain_ratio(steps['ratio'])}x the steps: {interval}"
    else:   # no cost model: steps are the compute axis stated
        head.append(f"{_plain_ratio(steps['ratio'])}x the steps to reach probe loss {level:.4g}")
        detail = interval
    return f"trade: {', '.join(head)} ({detail})"


def _never_reached(entry: dict) -> str:
    if not entry["not_reached"]:
        return ""
    return (f"no paired time to reach probe loss {entry['probe_loss']:.4g}: never reached by "
            + ", ".join(f"{missed['arm']} seed {missed['seed']}" for missed in entry["not_reached"]))


def _trade_with_outcomes(verdict: dict, entry: dict) -> str:
    """The rules-6 trade sentence: each ratio to the target (modelled GPU time, steps, real tokens) with its own
    paired interval, verdict and Holm p, so a ratio whose test is inconclusive says so where it is stated.

    Example:
        >>> row = {"ratio": 1.21, "diff": 35.1, "ci_low": 1.77, "ci_high": 68.5, "n_pairs": 3, "verdict":
        ...        "inconclusive", "p_holm": 0.09}
        >>> entry = {"probe_loss": 2.2197, "time_to_target": row, "steps_to_target": None,
        ...          "tokens_to_target": None, "not_reached": []}
        >>> _trade_with_outcomes({"throughput_ratio": None}, entry)
        'trade to reach probe loss 2.22: 1.21x the modelled GPU time (+35.1 [+1.77, +68.5], 3 pairs, inconclusive, \
Holm p 0.09)'
    """
    if entry["probe_loss"] is None:
        return ""
    stated = [f"{row['ratio']:.2f}x the {label} ({_fmt(row['diff'])} [{_fmt(row['ci_low'])}, "
              f"{_fmt(row['ci_high'])}], {row['n_pairs']} pairs, {row['verdict']}, Holm p {_plain(row['p_holm'])})"
              for name, label in (("time_to_target", "modelled GPU time"), ("steps_to_target", "steps"),
                                  ("tokens_to_target", "real tokens"))
              for row in [entry[name]] if row is not None and row["ratio"] is not None]
    if not stated:
        return _never_reached(entry)
    if entry["not_reached"]:
        stated.append(f"{len(entry['not_reached'])} run(s) never reached it, their pairs left out")
    return f"trade to reach probe loss {entry['probe_loss']:.3g}: " + ", ".join(_trade_throughput(verdict) + stated)


def _early_window(row: pd.Series, early_step: float) -> dict:
    """verdict.json's ``early_window``: the question's paired probe_loss_early row."""
    return {"endpoint": "probe_loss_early", "until_step": _number(early_step), "baseline": row["baseline"],
            "baseline_mean": _number(row["baseline_mean"]), "question_mean": _number(row["arm_mean"]),
            "diff": _number(row["diff"]), "ci_low": _number(row["ci_low"]), "ci_high": _number(row["ci_high"]),
            "verdict": row["verdict"], "n_pairs": int(row["n_pairs"])}


def finish_verdict(verdict: dict, runs: pd.DataFrame, paired: pd.DataFrame, roles: dict[str, str],
                   rules: dict[str, Any], target: dict | None, early_step: float, alpha: float = 0.05,
                   config_values: Callable[[str], set[str]] | None = None) -> None:
    """What the rules add after :func:`build_verdict`: the trade to the declared target (``time_to_target``,
    rules >= 5, :func:`add_time_to_target`) and, rules >= 6, the composition and the recommendation
    (analysis.recommendation), whose forgetting bound and composition the answer states too."""
    if rules["time_to_target"]:
        add_time_to_target(verdict, paired, target, early_step, state_outcome=rules["recommendation"])
    if not rules["recommendation"]:
        return
    build_recommendation(verdict, runs, roles, lambda table, role, selector: _matching_arm(
        table, role, selector, config_values), config_values, nested=rules["nested"], alpha=alpha)
    question = verdict["arms"].get("question") or "the question"
    phrases = [forgetting_phrase(verdict["recommendation"]["forgetting"], question),
               composition_phrase(verdict["composition"], question)]
    verdict["answer"] += "".join(f"; {phrase}" for phrase in phrases if phrase)


def _plain_ratio(value: float | None) -> str:
    return "nan" if value is None else f"{value:.2f}"
