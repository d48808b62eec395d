"""What to do: the recommendation of a protocol sweep, and its update count separated from batch composition
(rules version >= 6; verdict.json's `recommendation` and `composition`).

The time claim is a ratio of two ratios. The question policy (bucketed) reaches the declared probe-loss target
after q real tokens where its baseline (full_random) needs b; its steps carry real tokens at R times the baseline's
throughput (real tokens per GPU second). Its GPU time to the target is then

    time ratio = (q / b) / R        so bucketed reaches the target sooner exactly when R > q / b

and q / b is the **break-even throughput ratio**: what bucketed's throughput must exceed full_random's by. The two
factors come from different places. q / b is trained, and measured by the sweep (`tokens_to_target`); R is a
property of the data, the GPU and the kernels, which a tiny CPU protocol can only model. So the recommendation
states both, with R's source, and decides only where the interval of q / b lies wholly on one side of R.

Ratios (:func:`ratio_interval`): per seed the log of arm / baseline (finished runs, the seeds both share, values
> 0), per analysis unit as the paired table (the target where seeds nest in several targets, rules >= 5:
`paired.analysis_units`), their mean and t interval at the protocol's alpha, exponentiated: a geometric-mean
ratio with its interval, so the ratio and its interval come from one paired computation (the break-even value
and interval *are* the tokens-to-target ratio's).

recommendation keys:
    policy, settings, overrides   the policy to use and its settings (the swept keys of its arm, and the common
                                  ones: sampler.max_tokens, sampler.boundaries, trainer.lr, ...), as Hydra overrides
    conclusion                    question | baseline (the arm that reaches the target in less GPU time: the
                                  throughput ratio above | below the break-even interval) | inconclusive (the
                                  interval straddles it: the baseline is named as the policy to keep, with the
                                  throughput ratio above which the question wins) | forgetting (the question shows
                                  the forgetting signature: the baseline) | null (nothing to decide by: the text
                                  says why). `policy` names the recommended arm's sampler (bucketed, full_random)
    forgetting                    the question's effect on the primary endpoint at most (the worse end of its
                                  interval), the margin it was tested against, its share of the positive control
    tokens_to_target_ratio        q / b with its interval (:func:`ratio_interval` on tokens_to_target)
    break_even_throughput         the same numbers, named for what they decide
    throughput_ratio              {value, source, detail}: modelled_cost (the protocol's cost model on the runs'
                                  batches), padding_efficiency, measured_ktok_s (time-confounded), command_line
                                  (compare --throughput-ratio, e.g. a measured run) or plan (compare
                                  --throughput-from plan.json: `python -m dflash_lab.plan` on the user's data and
                                  GPU)
    time_ratio                    break-even / throughput ratio, with the interval's ends divided alike; `runs`:
                                  the modelled time-to-target ratio the runs measured (rules 5's figure)
    text                          one paragraph: the policy and settings, then why

composition keys (each a :func:`ratio_interval` of steps to the target, or null where the arm was not run):
    equal_updates     the equal_updates arm (bucketed at full_random's real tokens per step: as many optimizer
                      updates per epoch) over the baseline: what batch composition alone costs
    equal_tokens      the question over the equal_tokens arm (full_random at bucketed's real tokens per step):
                      the same at bucketed's step size
    own_step          the question over the baseline (each at its own step size; update count and composition
                      together)
    lr_scaled         the lr_scaled arm (bucketed with trainer.lr_scaling) over the baseline, in real tokens to
                      target: its own break-even

Cost: a few table lookups and one t interval per ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from dflash_lab.analysis.arms import UNSET
from dflash_lab.analysis.paired import analysis_units, paired_t_p_value, per_seed_values, seed_targets, t_interval
from dflash_lab.sampling.build import POLICIES, policy_keys

# The settings the recommendation names besides the arm's own swept keys (when the runs share one value).
SETTING_KEYS = ("sampler.max_tokens", "sampler.boundaries", "sampler.bucket_by", "sampler.real_tokens_per_step",
                "trainer.lr", "trainer.lr_scaling", "trainer.grad_clip")
COMPOSITION_ROLES = ("equal_updates", "equal_tokens", "lr_scaled")
THROUGHPUT_SOURCES = {
    "modelled_cost": "the protocol's modelled step cost (analysis.cost) on the runs' own batches: modelled time "
                     "per real token of the baseline over the question's",
    "padding_efficiency": "padding efficiency (real / padded tokens) of the question over the baseline: no cost "
                          "model declared",
    "measured_ktok_s": "the measured Ktok/s ratio of the runs: time-confounded unless the arms interleave",
    "command_line": "given on the command line (compare --throughput-ratio), e.g. a measured run's ratio",
    "plan": "python -m dflash_lab.plan's predicted Ktok/s (compare --throughput-from plan.json): the user's data "
            "and cost model",
}


def _number(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _finished(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["status"] == "finished"] if "status" in runs.columns else runs


def ratio_interval(runs: pd.DataFrame, arm: str | None, baseline: str | None, endpoint: str, nested: bool,
                   alpha: float = 0.05) -> dict | None:
    """arm / baseline on ``endpoint``: the geometric mean over analysis units of the per-seed ratios, with its t
    interval (module docstring); None where an arm is missing or no seed pair has both values > 0.

    Example:
        >>> runs = pd.DataFrame({"arm": ["q"] * 4 + ["b"] * 4, "seed": [0, 1, 2, 3] * 2,
        ...                      "x": [200.0, 220.0, 180.0, 210.0, 100.0, 100.0, 100.0, 100.0]})
        >>> r = ratio_interval(runs, "q", "b", "x", nested=False)
        >>> round(r["value"], 3), r["ci_low"] < r["value"] < r["ci_high"], r["n_pairs"], r["unit"]
        (2.019, True, 4, 'seed')
    """
    if arm is None or baseline is None or endpoint not in runs.columns or "seed" not in runs.columns:
        return None
    finished = _finished(runs)
    pairs = pd.concat([per_seed_values(finished, arm, endpoint), per_seed_values(finished, baseline, endpoint)],
                      axis=1, keys=["arm", "baseline"], join="inner").dropna()
    pairs = pairs[(pairs["arm"] > 0) & (pairs["baseline"] > 0)]
    if pairs.empty:
        return None
    units, unit, n_targets = analysis_units(np.log(pairs["arm"] / pairs["baseline"]), seed_targets(finished), nested)
    logs = units.to_numpy(dtype=float)
    low, high = t_interval(logs, alpha)
    return {"arm": arm, "baseline": baseline, "endpoint": endpoint, "value": float(np.exp(logs.mean())),
            "ci_low": _number(np.exp(low)), "ci_high": _number(np.exp(high)),
            "p_t": _number(paired_t_p_value(logs)), "n_pairs": int(logs.size), "unit": unit,
            "n_targets": n_targets, "n_seeds": int(len(pairs))}


def optional_arms(runs: pd.DataFrame, roles: dict[str, str],
                  match: Callable[[pd.DataFrame, str, str], str]) -> tuple[dict[str, str | None], list[str]]:
    """The arms of the composition roles the sweep declared (COMPOSITION_ROLES), None where missing (with why)."""
    arms: dict[str, str | None] = {}
    missing: list[str] = []
    for role in COMPOSITION_ROLES:
        if not roles.get(role):
            continue
        try:
            arms[role] = match(runs, role, roles[role])
        except ValueError as error:   # verdict.MissingArm, or a selector no run can match
            arms[role], missing = None, missing + [str(error)]
    return arms, missing


def composition(runs: pd.DataFrame, arms: dict[str, str | None], question: str | None, baseline: str | None,
                nested: bool, alpha: float) -> dict:
    """verdict.json's `composition` (module docstring): steps to target at equal updates, at equal real tokens and
    each at its own step size, and the LR-scaled arm's real tokens to target."""
    steps = "steps_to_target"
    return {"equal_updates": ratio_interval(runs, arms.get("equal_updates"), baseline, steps, nested, alpha),
            "equal_tokens": ratio_interval(runs, question, arms.get("equal_tokens"), steps, nested, alpha),
            "own_step": ratio_interval(runs, question, baseline, steps, nested, alpha),
            "lr_scaled": ratio_interval(runs, arms.get("lr_scaled"), baseline, "tokens_to_target", nested, alpha),
            "arms": arms}


def arm_settings(runs: pd.DataFrame, arm: str | None,
                 config_values: Callable[[str], set[str]] | None) -> dict[str, str]:
    """The settings of one arm, as Hydra would take them: ``sampler`` and the arm's swept keys (its own values),
    then each of SETTING_KEYS the runs share one value of; keys the arm's policy does not have are left out.

    Example:
        >>> runs = pd.DataFrame({"arm": ["b"], "sampler": ["bucketed"], "sampler.bucket_by": ["length"]})
        >>> arm_settings(runs, "b", lambda key: {"trainer.lr": {"0.003"}}.get(key, set()))
        {'sampler': 'bucketed', 'sampler.bucket_by': 'length', 'trainer.lr': '0.003'}
    """
    rows = runs[runs["arm"] == arm] if arm is not None else runs.iloc[:0]
    if rows.empty:
        return {}
    row = rows.iloc[0]
    sampler = str(row["sampler"])
    own = {"max_tokens", *policy_keys(sampler)} if sampler in POLICIES else None

    def applies(key: str) -> bool:   # a sampler key of another policy (boundaries for full_random) does not
        return not key.startswith("sampler.") or own is None or key.split(".", 1)[1] in own

    settings = {"sampler": sampler}
    swept = [c for c in runs.columns if c.startswith(("sampler.", "trainer.", "data.", "model."))]
    for key in swept:
        if pd.notna(row[key]) and str(row[key]) != UNSET and applies(key):
            settings[key] = str(row[key])
    for key in SETTING_KEYS:
        held = config_values(key) if config_values is not None and key not in swept and applies(key) else set()
        if len(held) == 1:
            settings[key] = next(iter(held))
    return settings


def forgetting_bound(verdict: dict) -> dict:
    """The question's effect on the primary endpoint at most (the worse end of its paired interval), the margin
    it was tested against and the share of the positive control's effect it could be at most."""
    endpoint = verdict["endpoint"]
    row = next((r for r in verdict["bucketed_vs_full_random"] if r["endpoint"] == endpoint), None)
    if row is None or row["ci_low"] is None or row["ci_high"] is None:
        return {"endpoint": endpoint, "at_most": None, "margin": None, "verdict": None, "share_at_most": None}
    worse_is_higher = verdict["better"] == "lower"
    at_most = row["ci_high"] if worse_is_higher else -row["ci_low"]
    positive = (verdict.get("positive_control") or {}).get("diff")
    return {"endpoint": endpoint, "diff": row["diff"], "at_most": at_most, "margin": row["margin"],
            "verdict": row["verdict"], "within_margin": (row["margin"] is not None and at_most <= row["margin"]),
            "share_at_most": at_most / abs(positive) if positive else None,
            "answer": verdict["answer"].split(":")[0]}


def default_throughput(verdict: dict) -> dict | None:
    """The throughput ratio the answer claims (verdict's `throughput_from`: modelled cost, else padding
    efficiency, else the measured Ktok/s), as {value, source, detail}; None when the sweep has none."""
    source = verdict.get("throughput_from") or {}
    claim = source.get("claim")
    value = source.get(claim) if claim else verdict.get("throughput_ratio")
    if value is None:
        return None
    return {"value": float(value), "source": claim or "measured_ktok_s",
            "detail": THROUGHPUT_SOURCES[claim or "measured_ktok_s"]}


def compared_policies(recommendation: dict) -> tuple[str, str]:
    """The sampler names of the question's and the baseline's arms (what a plan is read for).

    Example:
        >>> compared_policies({"policies": {"question": {"sampler": "bucketed"}, "baseline": {}}})
        ('bucketed', 'full_random')
    """
    names = {role: (recommendation["policies"].get(role) or {}).get("sampler") for role in ("question", "baseline")}
    return names["question"] or "bucketed", names["baseline"] or "full_random"


def plan_throughput(plan: dict, question_policy: str, baseline_policy: str, path: str = "plan.json") -> dict:
    """The throughput ratio a plan predicts (``python -m dflash_lab.plan``'s plan.json): the question policy's
    predicted Ktok/s over the baseline policy's.

    Raises:
        ValueError: the plan lacks either policy or its predicted Ktok/s (one line, naming the file and the fix).

    Example:
        >>> plan_throughput({"policies": {"bucketed": {"pred_ktok_s": 9.0}, "full_random": {"pred_ktok_s": 7.3}}},
        ...                 "bucketed", "full_random")["value"]
        1.2328767123287672
    """
    policies = plan.get("policies") if isinstance(plan, dict) else None
    rates = {name: _number((policies or {}).get(name, {}).get("pred_ktok_s")) for name in
             (question_policy, baseline_policy)}
    lacking = [name for name, rate in rates.items() if rate is None or rate <= 0]
    if lacking:
        present = ", ".join(sorted(policies or {})) or "none"
        raise ValueError(f"--throughput-from {path}: no predicted Ktok/s (pred_ktok_s) for {', '.join(lacking)} "
                         f"(policies in the plan: {present}); plan both, e.g. python -m dflash_lab.plan "
                         f"policies=[{question_policy},{baseline_policy}]")
    cost = (plan.get("meta") or {}).get("cost_model") or {}
    form = ("FLOPs form" if cost.get("utilisation") is not None else "linear form") if cost else "cost model unknown"
    return {"value": rates[question_policy] / rates[baseline_policy], "source": "plan",
            "detail": f"{THROUGHPUT_SOURCES['plan']} ({path}: {question_policy} {rates[question_policy]:.4g} / "
                      f"{baseline_policy} {rates[baseline_policy]:.4g} Ktok/s, {form})"}


def build_recommendation(verdict: dict, runs: pd.DataFrame, roles: dict[str, str],
                         match: Callable[[pd.DataFrame, str, str], str],
                         config_values: Callable[[str], set[str]] | None, nested: bool, alpha: float) -> None:
    """Add `composition` and `recommendation` to a rules-6 verdict (module docstring), with the throughput ratio
    the answer claims; :func:`decide` redoes the decision for another throughput ratio."""
    question = verdict["arms"].get("question")
    entry = verdict.get("time_to_target") or {}
    baseline = entry.get("baseline") or next((r["baseline"] for r in verdict["bucketed_vs_full_random"]), None)
    arms, missing = optional_arms(runs, roles, match)
    verdict["composition"] = {**composition(runs, arms, question, baseline, nested, alpha), "missing": missing}
    tokens = ratio_interval(runs, question, baseline, "tokens_to_target", nested, alpha)
    policies = {role: arm_settings(runs, arm, config_values) for role, arm in
                (("question", question), ("baseline", baseline), ("lr_scaled", arms.get("lr_scaled")))}
    recommendation = {
        "question": question, "baseline": baseline, "policies": policies,
        "probe_loss": entry.get("probe_loss"), "target_declared": bool(entry),
        "not_reached": [f"{missed['arm']} seed {missed['seed']}" for missed in entry.get("not_reached", [])],
        "forgetting": forgetting_bound(verdict), "valid": verdict["valid"],
        "tokens_to_target_ratio": tokens,
        "break_even_throughput": None if tokens is None else {
            key: tokens[key] for key in ("value", "ci_low", "ci_high", "n_pairs", "unit")} | {
            "from": "tokens_to_target_ratio: the throughput ratio at which both reach the target in equal GPU time"},
        "time_ratio_runs": entry.get("time_ratio"),
        "composition": verdict["composition"]}
    verdict["recommendation"] = decide(recommendation, default_throughput(verdict))


def decide(recommendation: dict, throughput: dict | None) -> dict:
    """The recommendation's conclusion for one throughput ratio ({value, source, detail}): the policy, its
    settings, the time ratio and the text (rules in the module docstring). Returns a new dict.

    Example:
        >>> base = {"question": "bucketed", "baseline": "full_random", "probe_loss": 2.2, "valid": True,
        ...         "policies": {"question": {"sampler": "bucketed"}, "baseline": {"sampler": "full_random"}},
        ...         "forgetting": {"endpoint": "x", "at_most": 0.01, "margin": 0.01, "share_at_most": 0.1,
        ...                        "answer": "no detectable effect"},
        ...         "break_even_throughput": {"value": 2.0, "ci_low": 1.7, "ci_high": 2.4, "n_pairs": 5,
        ...                                   "unit": "target"}, "composition": {}}
        >>> [decide(base, {"value": r, "source": "command_line", "detail": ""})["conclusion"] for r in (1.2, 2.0, 3)]
        ['baseline', 'inconclusive', 'question']
    """
    result = {**recommendation, "throughput_ratio": throughput}
    even = recommendation.get("break_even_throughput")
    forgetting = recommendation["forgetting"]
    if even is None or throughput is None:
        return {**result, "conclusion": None, "policy": None, "settings": {}, "overrides": "", "time_ratio": None,
                "text": f"no recommendation: {_why_none(recommendation, throughput)}"}
    rate = float(throughput["value"])
    low, high = even["ci_low"], even["ci_high"]
    result["time_ratio"] = {"value": even["value"] / rate, "ci_low": None if low is None else low / rate,
                            "ci_high": None if high is None else high / rate, "runs": recommendation.get(
                                "time_ratio_runs"), "from": "break_even_throughput / throughput_ratio"}
    if forgetting.get("answer") == "yes":
        conclusion = "forgetting"
    elif low is None or high is None or low <= rate <= high:
        conclusion = "inconclusive"
    else:
        conclusion = "question" if rate > high else "baseline"
    role = "question" if conclusion == "question" else "baseline"
    settings = recommendation["policies"].get(role) or {}
    result.update(conclusion=conclusion, policy=settings.get("sampler"), settings=settings,
                  overrides=" ".join(f"{key}={value}" for key, value in settings.items()))
    result["text"] = recommendation_text(result)
    return result


def _why_none(recommendation: dict, throughput: dict | None) -> str:
    """Why there is nothing to decide by: no target declared, no seed pair that reached it, or no throughput."""
    if recommendation.get("break_even_throughput") is not None:
        return "no throughput ratio (no cost model, padding or Ktok/s record; give compare --throughput-ratio)"
    if not recommendation.get("target_declared"):
        return ("no time to a target: declare analysis.target (the break-even throughput is the ratio of the real "
                "tokens each policy needs to reach it)")
    level = recommendation.get("probe_loss")
    missed = recommendation.get("not_reached") or []
    return (f"no seed pair of {recommendation['question']} and {recommendation['baseline']} reached probe loss "
            f"{'the target' if level is None else f'{level:.3g}'}"
            + (f" (never reached: {', '.join(missed)})" if missed else "")
            + ": train longer, or declare a target the runs reach")


def _interval(entry: dict) -> str:
    if entry.get("ci_low") is None or entry.get("ci_high") is None:
        return f"{entry['value']:.2f}x (no interval: fewer than 2 units)"
    return f"{entry['value']:.2f}x [{entry['ci_low']:.2f}, {entry['ci_high']:.2f}]"


def recommendation_text(result: dict) -> str:
    """The recommendation in one paragraph: what to use with which settings, then the numbers that decide it."""
    even, rate, time = result["break_even_throughput"], result["throughput_ratio"], result["time_ratio"]
    question, baseline = compared_policies(result)
    level = f"probe loss {result['probe_loss']:.3g}" if result.get("probe_loss") is not None else "the target"
    lead = {"question": f"Use {question} ({result['overrides']}): it reaches {level} in less GPU time.",
            "baseline": f"Use {baseline} ({result['overrides']}): it reaches {level} in less GPU time.",
            "inconclusive": f"Inconclusive on GPU time; keep {baseline} ({result['overrides']}) unless {question}'s "
                            f"throughput on your data and GPU exceeds {baseline}'s by more than "
                            f"{even['ci_high'] or even['value']:.2f}x (measure it, or plan it: python -m "
                            f"dflash_lab.plan, then compare --throughput-from plan.json).",
            "forgetting": f"Use {baseline} ({result['overrides']}): {question} shows the forgetting signature."}
    text = [lead[result["conclusion"]]]
    units = f"{even['n_pairs']} {even['unit']}{'s' if even['n_pairs'] != 1 else ''}"
    straddles = result["conclusion"] == "inconclusive" and even.get("ci_low") is not None
    text.append(f"Break-even: {question} needs {_interval(even)} the real tokens of {baseline} to reach {level} "
                f"({units}), so it saves GPU time only above that throughput ratio; assumed {rate['value']:.2f}x "
                f"({rate['source'].replace('_', ' ')}: {rate['detail']}), hence {_interval(time)} the GPU time"
                + (" (the interval straddles break-even)" if straddles else "") + ".")
    text.append(_capital(forgetting_phrase(result["forgetting"], question)))
    text.append(_capital(composition_phrase(result.get("composition") or {}, question)))
    if not result.get("valid", True):
        text.append("The controls did not validate the forgetting instruments (verdict.json answer).")
    return " ".join(part for part in text if part)


def _capital(phrase: str) -> str:
    return phrase[:1].upper() + phrase[1:] + "." if phrase else ""


def forgetting_phrase(forgetting: dict, question: str) -> str:
    """"forgetting: <question>'s <endpoint> effect is at most X (share of the curriculum's), inside/beyond the
    margin m declared irrelevant"; "" without an interval."""
    if forgetting.get("at_most") is None:
        return ""
    margin = forgetting.get("margin")
    against = (f", {'inside' if forgetting['at_most'] <= margin else 'beyond'} the margin {margin:g} declared "
               "irrelevant") if margin is not None else ", no margin declared"
    share = (f" ({forgetting['share_at_most']:.0%} of the forgetting curriculum's)"
             if forgetting.get("share_at_most") is not None else "")
    return (f"forgetting: {question}'s {forgetting['endpoint']} effect is at most {forgetting['at_most']:+.3g}"
            f"{share}{against}")


def composition_phrase(parts: dict, question: str) -> str:
    """"batch composition: <question> needs Rx [low, high] the steps at equal updates per epoch, ... to reach it";
    "" when no composition arm was run."""
    stated = [f"{label} {_interval(parts[key])} the steps"
              for key, label in (("equal_updates", "at equal updates per epoch"),
                                 ("equal_tokens", "at equal real tokens per step"))
              if parts.get(key) is not None]
    if parts.get("lr_scaled") is not None:
        stated.append(f"with its LR scaled for its larger step, {_interval(parts['lr_scaled'])} the real tokens")
    return f"batch composition: {question} needs {', '.join(stated)} to reach it" if stated else ""
