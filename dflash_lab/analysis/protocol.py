"""The analysis protocol a sweep declares before its runs: baseline arm, endpoints, equivalence margins, cost model.

A sweep file sets it under a top-level `analysis` key, and every run records it in `.hydra/config.yaml` (and in its
W&B config), so the comparison judges the runs by what was declared before they ran, not by what was picked after
seeing them:

    analysis:
      baseline: full_random     # arm selector (analysis.arms.parse_selector); null: no paired comparison
      endpoints: null           # columns compared with the baseline, Holm-corrected together; null: DEFAULT_ENDPOINTS
      margins: {}               # endpoint -> equivalence margin, endpoint units (TOST); none: never "equivalent"
      cost: null                # {c0, c1, c2}: step time = c0 + c1 padded + c2 attention tokens (seconds, per rank)
                                # for the equal-modelled-time endpoint; null: that endpoint is NaN
      alpha: 0.05               # level of the tests and 1 - alpha the confidence of the intervals
      test: t                   # the paired test verdicts use: t (paired t test) or sign_flip (exact; cannot reach
                                # p_holm < 0.05 below 6 seeds); both are reported (analysis.paired)
      window: 0.25              # where the analysis window of jumpiness and forgetting starts: a share of each run's
                                # end step (the same step for every arm of a sweep), or steady (each run's own loss
                                # steady state, which depends on the outcome: the rule of protocol version < 3)
      verdict: null             # {endpoint, positive_control, negative_control, question}: the roles of arms in
                                # the ablation's verdict.json (analysis.verdict); null: no verdict. Optional
                                # matched_control: the question's sampler on data where length carries no signal
                                # (e.g. data.band_skills=independent), whose effect the question is also stated net
                                # of (rules version >= 5; default: the negative control). Optional
                                # equal_updates, equal_tokens, lr_scaled (rules version >= 6): the arms that separate
                                # update count from batch composition (verdict.json's `composition`)
      target: null              # the probe-loss level of the time-to-target endpoints (steps_to_target,
                                # tokens_to_target, time_to_target; analysis.budgets.time_to_target); null: none.
                                # {probe_loss: 2.316}: a fixed level; {rule: baseline_mean_at, at: 0.5}: fixed from
                                # the baseline arm's curves alone, before the arms are compared: the mean over its
                                # finished runs of the probe loss at `at` x the common step budget (each stratum's
                                # own baseline). margin (optional, e.g. 0.10): a ratio margin, within 10% of the
                                # baseline's mean counts as equivalent (TOST margin = margin x the baseline arm's
                                # mean of each endpoint, the smallest over baselines; an analysis.margins entry for
                                # one of them wins). Rules version >= 5: when a target is declared, the three
                                # endpoints and probe_loss_early are paired (their own Holm family unless listed in
                                # endpoints) and the verdict states time to target next to throughput

Frozen at launch: a multirun writes `protocol.json` into its sweep folder before any run starts
(:func:`record_protocol`, the `record_protocol` Hydra callback of conf/train.yaml): the declared section, every key
as it resolves, the rules version (:data:`RULES_VERSION`) and a digest of the analysis code. `compare` judges the
sweep by that record: the section it declared (margins, endpoints, baseline, ...) under the recorded rules, never
the runs' own config files (which a later launch may have edited); when today's rules answer differently it prints
both and names the rules that changed (:data:`RULE_CHANGES`). Runs without a `protocol.json` (single runs, W&B
runs, sweeps launched before protocols were recorded) are judged by the `analysis` sections they recorded, which
must agree (runs that declare different values for a key not given on the command line are an error: they belong
to different sweeps). A `protocol.json` that cannot be read or lacks its rules version is refused in one line.

Each key can be overridden on the `python -m dflash_lab.compare` command line (--baseline, --endpoints, --margins,
--cost, --alpha, --test, --window, --target). An override that changes the launch protocol is allowed, but the answer is
then not the launch protocol's: compare judges the runs both ways, the first note says which keys were overridden
and what the launch protocol answers, and verdict.json's `launch_protocol` holds both answers
(:func:`overridden_keys`). The rules of each version (:data:`RULES`): whether the verdict has a "small" category, and
the defaults of `analysis.test` and `analysis.window` (a sweep that declared them keeps its declaration), and
whether the answer states the co-primary endpoints at equal compute (`costs`, analysis.verdict), and from version 6
whether verdict.json holds the recommendation and the composition split (`recommendation`, analysis.recommendation).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Any

from dflash_lab.analysis.paired import TESTS
from dflash_lab.analysis.schema import BETTER, DEFAULT_ENDPOINTS, RunRecord
from dflash_lab.config_check import as_float, refuse_unknown_keys

PROTOCOL_KEYS = ("baseline", "endpoints", "margins", "cost", "alpha", "verdict", "test", "window", "target")
PROTOCOL_FILE = "protocol.json"

# The verdict rules, by version: what code decides beyond the declared keys. A version is added whenever a rule
# changes, so a sweep recorded under an older version is still judged as it was declared.
RULES_VERSION = 6
_V4 = {"small": True, "test": "t", "window": 0.25, "costs": True}
_BEFORE_V5 = {"nested": False, "controls_by_equivalence": False, "time_to_target": False}
_BEFORE_V6 = {"recommendation": False}
_V5 = {**_V4, "nested": True, "controls_by_equivalence": True, "time_to_target": True}
RULES: dict[int, dict[str, Any]] = {
    1: {"small": False, "test": "sign_flip", "window": "steady", "costs": False, **_BEFORE_V5, **_BEFORE_V6},
    2: {"small": True, "test": "sign_flip", "window": "steady", "costs": False, **_BEFORE_V5, **_BEFORE_V6},
    3: {"small": True, "test": "t", "window": 0.25, "costs": False, **_BEFORE_V5, **_BEFORE_V6},
    4: {**_V4, **_BEFORE_V5, **_BEFORE_V6},
    # nested: seeds nested within targets are analysed with the target as the unit; controls_by_equivalence: a
    # negative control reacts only when it fails equivalence within its margin, and the question is also stated
    # net of its matched control; time_to_target: the answer states time to the declared probe-loss target next to
    # throughput, and the early-window probe-loss gap
    5: {**_V5, **_BEFORE_V6},
    # recommendation: verdict.json's `recommendation` (what to do: the policy and its settings, the break-even
    # throughput ratio, the throughput ratio assumed and its source, the GPU-time conclusion) and `composition`
    # (update count separated from batch composition); the answer states each claim with its test's outcome
    6: {**_V5, "recommendation": True},
}
RULE_CHANGES: dict[int, str] = {
    2: "the verdict gained the 'small' answer (detected, yet inside the declared margin); before, that was 'yes'",
    3: "paired verdicts use the paired t test (was the exact sign-flip test, which cannot conclude at 5 seeds), and "
       "the analysis window starts at 25% of each run's end step (was each run's own loss steady state)",
    4: "the answer also states the co-primary endpoints the question arm declared (tau of the worst band, mean "
       "tau, probe loss at equal steps, equal epochs and equal modelled GPU time); the yes/small/no rule is "
       "unchanged",
    5: "seeds nested within targets are analysed with the target as the unit (the answer says how many targets "
       "and seeds it rests on); a negative control counts as reacting only when it fails equivalence within its "
       "margin, and the question's effect is also stated net of its matched control; tau endpoints need the "
       "positive control too; the answer states time to the declared probe-loss target next to throughput",
    6: "verdict.json gains `recommendation`: the policy to use with its settings, the forgetting effect at most "
       "against its margin, the break-even throughput ratio (the real-tokens-to-target ratio, per unit, with its "
       "interval), the throughput ratio assumed and its source (modelled cost, a plan or a measured run: compare "
       "--throughput-ratio / --throughput-from) and the GPU-time conclusion, inconclusive where the interval "
       "straddles break-even; and `composition`: steps to target at equal optimizer updates and at equal real "
       "tokens per step, and the LR-scaled arm (optional roles equal_updates, equal_tokens, lr_scaled); the "
       "answer states the time to target with its own interval and verdict, and the forgetting bound against its "
       "margin",
}
VERDICT_KEYS = ("endpoint", "positive_control", "negative_control", "question")
TARGET_KEYS = ("probe_loss", "rule", "at", "margin")
TARGET_RULES = ("baseline_mean_at",)
# matched_control: the question's sampler on data where length carries no signal (rules >= 5); equal_updates: the
# question's sampler at the baseline's real tokens per step (as many optimizer updates per epoch); equal_tokens: the
# baseline's sampler at the question's real tokens per step; lr_scaled: the question with its LR scaled for its
# larger step (trainer.lr_scaling). The last three feed verdict.json's `composition` (rules >= 6).
OPTIONAL_VERDICT_KEYS = ("matched_control", "equal_updates", "equal_tokens", "lr_scaled")
COST_KEYS = ("c0", "c1", "c2")


@dataclass(frozen=True)
class Protocol:
    """What a comparison tests (see the module docstring for each field)."""

    baseline: str | None = None
    endpoints: tuple[str, ...] = DEFAULT_ENDPOINTS
    margins: dict[str, float] = field(default_factory=dict)
    cost: tuple[float, float, float] | None = None
    alpha: float = 0.05
    verdict: dict[str, str] | None = None
    test: str = RULES[RULES_VERSION]["test"]
    window: float | str = RULES[RULES_VERSION]["window"]
    target: dict[str, Any] | None = None
    rules: int = RULES_VERSION      # the rules version the comparison applies (protocol.json's, else today's)


def _endpoint(key: str, name: Any) -> str:
    if not isinstance(name, str) or name not in BETTER:
        raise ValueError(f"{key}: unknown endpoint {name!r}; choose from {', '.join(sorted(BETTER))}")
    return name


def check_endpoints(value: Any, key: str = "analysis.endpoints") -> tuple[str, ...]:
    """A non-empty list of distinct endpoint names (schema.BETTER keys).

    Example:
        >>> check_endpoints(["ktok_s", "jumpiness"])
        ('ktok_s', 'jumpiness')
    """
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{key}={value!r}: give a list of endpoint names, e.g. {key}=[ktok_s,residual_amplitude]")
    names = tuple(_endpoint(key, name) for name in value)
    if len(set(names)) != len(names):
        raise ValueError(f"{key}={list(value)}: an endpoint is listed twice")
    return names


def check_margins(value: Any, key: str = "analysis.margins") -> dict[str, float]:
    """endpoint -> margin > 0 (the largest difference, in the endpoint's units, that counts as no difference).

    Example:
        >>> check_margins({"jumpiness": 0.01})
        {'jumpiness': 0.01}
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}={value!r}: give a mapping endpoint -> margin, e.g. {key}={{jumpiness: 0.01}}")
    margins = {}
    for name, margin in value.items():
        endpoint = _endpoint(key, name)
        number = as_float(f"{key}.{endpoint}", margin, example=0.01)
        if number <= 0:
            raise ValueError(f"{key}.{endpoint}={number:g}: a margin must be > 0 (it bounds |difference|)")
        margins[endpoint] = number
    return margins


def check_cost(value: Any, key: str = "analysis.cost") -> tuple[float, float, float] | None:
    """(c0, c1, c2) from {c0, c1, c2} (c2 optional, default 0), each >= 0; None stays None.

    Example:
        >>> check_cost({"c0": 0.02, "c1": 5e-5})
        (0.02, 5e-05, 0.0)
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}={value!r}: give {{c0: seconds, c1: seconds per padded token, c2: seconds per "
                         "attention token}, e.g. {c0: 0.02, c1: 5.0e-5, c2: 0.0}")
    refuse_unknown_keys(key, value, COST_KEYS)
    if "c0" not in value or "c1" not in value:
        raise ValueError(f"{key}: needs c0 and c1 (c2 defaults to 0), e.g. {{c0: 0.02, c1: 5.0e-5}}")
    c0, c1, c2 = (as_float(f"{key}.{name}", value.get(name, 0.0), minimum=0.0) for name in COST_KEYS)
    return (c0, c1, c2)


def check_alpha(value: Any, key: str = "analysis.alpha") -> float:
    """The test level, strictly between 0 and 0.5.

    Example:
        >>> check_alpha(0.05)
        0.05
    """
    alpha = as_float(key, value, minimum=0.0, maximum=0.5, example=0.05)
    if alpha <= 0:
        raise ValueError(f"{key}=0: give a level above 0, e.g. {key}=0.05")
    return alpha


def check_baseline(value: Any, key: str = "analysis.baseline") -> str | None:
    """An arm selector string (or None).

    Example:
        >>> check_baseline("full_random")
        'full_random'
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key}={value!r}: give an arm selector, e.g. {key}=full_random or "
                         f"{key}='sampler=full_random,data.band_skills=aligned'")
    return value.strip()


def check_verdict(value: Any, key: str = "analysis.verdict") -> dict[str, str] | None:
    """The verdict roles: a primary endpoint and an arm selector per role (all four keys, and optionally those of
    ``OPTIONAL_VERDICT_KEYS``), or None.

    Example:
        >>> check_verdict({"endpoint": "residual_amplitude", "positive_control": "bucket_sequential",
        ...                "negative_control": "sampler=bucket_sequential,data.band_skills=independent",
        ...                "question": "bucketed"})["question"]
        'bucketed'
    """
    if value is None:
        return None
    example = ("{endpoint: residual_amplitude, positive_control: 'sampler=bucket_sequential,data.band_skills=aligned',"
               " negative_control: 'sampler=bucket_sequential,data.band_skills=independent', question: "
               "'sampler=bucketed,data.band_skills=aligned'}")
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}={value!r}: give a mapping, e.g. {key}={example}")
    refuse_unknown_keys(key, value, VERDICT_KEYS + OPTIONAL_VERDICT_KEYS)
    missing = [name for name in VERDICT_KEYS if name not in value]
    if missing:
        raise ValueError(f"{key}: missing {missing}; give all of {', '.join(VERDICT_KEYS)}, e.g. {example}")
    roles = {"endpoint": _endpoint(f"{key}.endpoint", value["endpoint"])}
    for name in VERDICT_KEYS[1:]:
        roles[name] = check_baseline(value[name], key=f"{key}.{name}")
        if roles[name] is None:
            raise ValueError(f"{key}.{name}: give an arm selector, e.g. {example}")
    for name in OPTIONAL_VERDICT_KEYS:
        if value.get(name) is not None:
            roles[name] = check_baseline(value[name], key=f"{key}.{name}")
    return roles


def check_test(value: Any, key: str = "analysis.test") -> str:
    """The paired test verdicts use (analysis.paired.TESTS).

    Example:
        >>> check_test("sign_flip")
        'sign_flip'
    """
    if value not in TESTS:
        raise ValueError(f"{key}={value!r}: choose one of {', '.join(TESTS)} (t: paired t test; sign_flip: exact "
                         f"sign-flip permutation test)")
    return value


def check_window(value: Any, key: str = "analysis.window") -> float | str:
    """Where the analysis window starts: ``steady`` or a share of the run's end step in [0, 1).

    Example:
        >>> check_window(0.25), check_window("steady")
        (0.25, 'steady')
    """
    if value == "steady":
        return value
    share = as_float(key, value, minimum=0.0, maximum=0.99, example=0.25)
    return share


def check_target(value: Any, key: str = "analysis.target") -> dict[str, Any] | None:
    """The time-to-target level: ``{probe_loss: L}`` (fixed) or ``{rule: baseline_mean_at, at: share in (0, 1]}``
    (fixed from the baseline's curves), each with an optional ratio ``margin`` > 0; None stays None.

    Example:
        >>> check_target({"rule": "baseline_mean_at", "at": 0.5, "margin": 0.1})
        {'rule': 'baseline_mean_at', 'at': 0.5, 'margin': 0.1}
        >>> check_target({"probe_loss": 2.316, "at": 0.5})
        Traceback (most recent call last):
        ...
        ValueError: analysis.target: at belongs to rule baseline_mean_at; a fixed level takes probe_loss only, e.g. analysis.target={probe_loss: 2.316} or {rule: baseline_mean_at, at: 0.5}, optionally with margin: 0.1
    """
    if value is None:
        return None
    example = f"{key}={{probe_loss: 2.316}} or {{rule: baseline_mean_at, at: 0.5}}, optionally with margin: 0.1"
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}={value!r}: give a mapping, e.g. {example}")
    refuse_unknown_keys(key, value, TARGET_KEYS)
    fixed, ruled = "probe_loss" in value, "rule" in value
    if fixed == ruled:
        raise ValueError(f"{key}: give {'either' if fixed else 'one of'} probe_loss (a fixed level) or rule (a level "
                         f"fixed from the baseline's curves){', not both' if fixed else ''}, e.g. {example}")
    target: dict[str, Any] = {}
    if fixed:
        if "at" in value:
            raise ValueError(f"{key}: at belongs to rule baseline_mean_at; a fixed level takes probe_loss only, "
                             f"e.g. {example}")
        target["probe_loss"] = as_float(f"{key}.probe_loss", value["probe_loss"], example=2.316)
        if target["probe_loss"] <= 0:
            raise ValueError(f"{key}.probe_loss={target['probe_loss']:g}: a probe loss is > 0, e.g. {example}")
    else:
        if value["rule"] not in TARGET_RULES:
            raise ValueError(f"{key}.rule={value['rule']!r}: choose {', '.join(TARGET_RULES)} (the baseline arm's "
                             f"mean probe loss at a share of the common step budget), e.g. {example}")
        if "at" not in value:
            raise ValueError(f"{key}: rule {value['rule']} needs at, the share of the common step budget, e.g. "
                             f"{example}")
        at = as_float(f"{key}.at", value["at"], maximum=1.0, example=0.5)
        if at <= 0:
            raise ValueError(f"{key}.at={at:g}: give a share of the common step budget in (0, 1], e.g. {example}")
        target.update(rule=value["rule"], at=at)
    if value.get("margin") is not None:
        margin = as_float(f"{key}.margin", value["margin"], example=0.1)
        if margin <= 0:
            raise ValueError(f"{key}.margin={margin:g}: a ratio margin must be > 0 (0.1: within 10% of the "
                             f"baseline's time to target counts as equivalent)")
        target["margin"] = margin
    return target


_CHECKS = {"baseline": check_baseline, "endpoints": check_endpoints, "margins": check_margins, "cost": check_cost,
           "alpha": check_alpha, "verdict": check_verdict, "test": check_test, "window": check_window,
           "target": check_target}


def default_protocol(rules: int = RULES_VERSION) -> Protocol:
    """The protocol of a sweep that declares nothing, under the rules of version ``rules``."""
    if rules not in RULES:
        raise ValueError(f"protocol rules version {rules} is unknown to this dflash_lab (it knows "
                         f"{', '.join(map(str, RULES))}): compare the sweep with the dflash_lab version that ran it")
    return Protocol(test=RULES[rules]["test"], window=RULES[rules]["window"], rules=rules)


def protocol_from_section(section: Mapping | None, rules: int = RULES_VERSION) -> Protocol:
    """Check one run's `analysis` section and turn it into a Protocol (missing keys take the defaults of the rules
    version ``rules``).

    Example:
        >>> protocol_from_section({"baseline": "full_random", "margins": {"jumpiness": 0.01}}).margins
        {'jumpiness': 0.01}
        >>> protocol_from_section({"margin": {}})
        Traceback (most recent call last):
        ...
        ValueError: unknown analysis key(s) ['margin']; valid keys: alpha, baseline, cost, endpoints, margins, target, \
test, verdict, window
    """
    if section is None:
        return default_protocol(rules)
    if not isinstance(section, Mapping):
        raise ValueError(f"analysis={section!r}: give a mapping with keys {', '.join(PROTOCOL_KEYS)}")
    refuse_unknown_keys("analysis", section, PROTOCOL_KEYS)
    given = {key: _CHECKS[key](value) for key, value in section.items()
             if (key != "endpoints" and key not in RULES[rules]) or value is not None}
    return replace(default_protocol(rules), **given)


def resolve_protocol(records: list[RunRecord], rules: int | None = None, **command_line: Any) -> Protocol:
    """The protocol of a set of runs: each key from the command line if given (not None), else from the section
    the sweep declared in its `protocol.json` (frozen at launch, :func:`recorded_protocol`), else (no such record)
    from the runs' recorded `analysis` sections, which must agree, else the default of the rules version.

    Args:
        records: the loaded runs (their sweep folder's `protocol.json`, else their `config["analysis"]`).
        rules: the rules version to judge by; None: the one the sweep recorded at launch (:func:`recorded_protocol`),
            else today's (:data:`RULES_VERSION`).
        command_line: baseline / endpoints / margins / cost / alpha / test / window / target as given to compare (None: not
            given).

    Raises:
        ValueError: a bad value (naming analysis.<key>), runs that declare different values for a key, or a
            `protocol.json` that cannot be read.

    Example:
        >>> run = RunRecord("r", "local", "/r", config={"analysis": {"baseline": "full_random"}})
        >>> resolve_protocol([run], alpha=0.1)
        Protocol(baseline='full_random', endpoints=('ktok_s', 'jumpiness', 'residual_amplitude', \
'own_share_slope', 'band_forgetting', 'probe_loss_at_tokens'), margins={}, cost=None, alpha=0.1, verdict=None, \
test='t', window=0.25, target=None, rules=6)
    """
    refuse_unknown_keys("compare option", command_line, PROTOCOL_KEYS)
    recorded = recorded_protocol(records)
    if rules is None:
        rules = recorded["rules_version"] if recorded else RULES_VERSION
    if recorded is not None:   # frozen at launch: the sweep's declaration, not what the runs' files say now
        declared = [(PROTOCOL_FILE, protocol_from_section(recorded.get("declared"), rules))]
    else:
        declared = [(record.run_id, protocol_from_section(record.config.get("analysis"), rules))
                    for record in records if record.config.get("analysis") is not None]
    chosen: dict[str, Any] = {}
    for key in PROTOCOL_KEYS:
        if command_line.get(key) is not None:
            chosen[key] = _CHECKS[key](command_line[key], key=f"--{key}")
            continue
        values = {repr(getattr(protocol, key)): (run_id, getattr(protocol, key)) for run_id, protocol in declared}
        if len(values) > 1:
            examples = "; ".join(f"{run_id}: {text}" for text, (run_id, _) in list(values.items())[:3])
            raise ValueError(f"runs declare different analysis.{key} ({examples}): compare runs of one sweep, or "
                             f"choose one with --{key}")
        if values:
            chosen[key] = next(iter(values.values()))[1]
    return replace(default_protocol(rules), **chosen)


# ------------------------------------------------------------------------------------------ frozen at launch
def analysis_code_digest() -> str:
    """A digest of the code that turns runs into answers (analysis and metrics modules): recorded at launch, so a
    later comparison can tell whether the code changed since."""
    import hashlib

    import dflash_lab.analysis as analysis_package
    import dflash_lab.metrics as metrics_package

    digest = hashlib.sha256()
    for package in (analysis_package, metrics_package):
        for path in sorted(Path(package.__file__).parent.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def protocol_record(section: Mapping | None) -> dict[str, Any]:
    """What a sweep records at launch: the declared `analysis` section, every key as it resolves under today's
    rules, the rules version and the analysis code's digest."""
    import datetime

    import dflash_lab

    protocol = protocol_from_section(section)
    resolved = {key: getattr(protocol, key) for key in PROTOCOL_KEYS}
    resolved["endpoints"] = list(resolved["endpoints"])
    resolved["cost"] = list(resolved["cost"]) if resolved["cost"] is not None else None
    return {"rules_version": RULES_VERSION, "rules": RULES[RULES_VERSION], "declared": dict(section or {}),
            "resolved": resolved, "analysis_code": analysis_code_digest(),
            "dflash_lab_version": getattr(dflash_lab, "__version__", None),
            "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def record_protocol(sweep_dir: Path, section: Mapping | None) -> Path:
    """Write ``protocol.json`` into a sweep folder before its runs start. A folder that holds one already (a
    re-launch into the same sweep) keeps it: the protocol stays the one of the first launch."""
    import json

    path = Path(sweep_dir) / PROTOCOL_FILE
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(protocol_record(section), indent=1, default=str) + "\n")
    return path


def kept_protocol_note(path: Path, section: Mapping | None) -> str:
    """What a relaunch into a sweep folder that holds a ``protocol.json`` does with its own ``analysis`` section:
    nothing (the first launch's protocol is kept). Names each key this launch declares otherwise and the way to
    see its answer (compare's command line), or says that the declarations agree.

    Example:
        >>> import json, tempfile
        >>> path = Path(tempfile.mkdtemp()) / PROTOCOL_FILE
        >>> _ = path.write_text(json.dumps({"declared": {"margins": {"jumpiness": 0.01}}, "recorded_at": "T"}))
        >>> print(kept_protocol_note(path, {"margins": {"jumpiness": 0.02}}))  # doctest: +ELLIPSIS
        relaunch: protocol.json keeps the first launch's analysis protocol (recorded T); this launch declares analysis.margins={'jumpiness': 0.02} (recorded: {'jumpiness': 0.01}), which compare will NOT apply: ...
    """
    import json

    try:
        recorded = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return f"relaunch: {path} is kept as it is (unreadable: compare names the problem)"
    declared = recorded.get("declared") or {}
    section = dict(section or {})
    differ = [key for key in PROTOCOL_KEYS
              if json.dumps(section.get(key), sort_keys=True, default=str)
              != json.dumps(declared.get(key), sort_keys=True, default=str)]
    if not differ:
        return f"relaunch: the analysis protocol recorded in {path} at {recorded.get('recorded_at')} is kept"
    changes = ", ".join(f"analysis.{key}={section.get(key)!r} (recorded: {declared.get(key)!r})" for key in differ)
    return (f"relaunch: protocol.json keeps the first launch's analysis protocol (recorded "
            f"{recorded.get('recorded_at')}); this launch declares {changes}, which compare will NOT apply: give them "
            f"on compare's command line (--{differ[0]} ...) to see both answers, or launch into a new sweep folder")


def recorded_protocol(records: list[RunRecord]) -> dict[str, Any] | None:
    """The ``protocol.json`` of the sweep folder(s) of local runs (a run's parent folder); None when none
    recorded one (sweeps launched before protocols were recorded, single runs, W&B runs).

    Raises:
        ValueError: runs of sweeps that recorded different protocols, or a ``protocol.json`` that is not JSON,
            lacks its rules version or holds a declaration that is not a mapping (one line, with the fix).
    """
    import json

    found: dict[str, tuple[str, dict]] = {}
    for record in records:
        if record.source != "local" or not record.location:
            continue
        path = Path(record.location).parent / PROTOCOL_FILE
        if path.is_file() and str(path) not in found:
            found[str(path)] = (record.run_id, check_recorded_protocol(path))
    if not found:
        return None
    kinds = {json.dumps({k: v for k, v in data.items() if k not in ("recorded_at",)}, sort_keys=True, default=str):
             path for path, (_, data) in found.items()}
    if len(kinds) > 1:
        raise ValueError(f"the runs come from sweeps that recorded different protocols ({', '.join(kinds.values())})"
                         f": compare one sweep at a time")
    return next(iter(found.values()))[1]


def check_recorded_protocol(path: Path) -> dict[str, Any]:
    """A sweep's ``protocol.json``, read and checked: a JSON object with a known ``rules_version`` and a
    ``declared`` mapping (or none).

    Raises:
        ValueError: one line naming the file, what is wrong and the fix.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / PROTOCOL_FILE
        >>> _ = path.write_text('{"declared": {}}')
        >>> check_recorded_protocol(path)
        Traceback (most recent call last):
        ...
        ValueError: .../protocol.json holds no rules_version: it was edited or cut; restore it from a copy of ...
    """
    import json

    fix = ("restore it from a copy of the sweep folder, or move it away to judge the runs by their own recorded "
           "analysis sections and today's rules")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read as JSON ({exc}): {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds {type(data).__name__}, not the protocol object: {fix}")
    version = data.get("rules_version")
    if version is None:
        raise ValueError(f"{path} holds no rules_version: it was edited or cut; {fix}")
    if isinstance(version, bool) or not isinstance(version, int) or version not in RULES:
        raise ValueError(f"{path}: rules_version {version!r} is unknown to this dflash_lab (it knows "
                         f"{', '.join(map(str, RULES))}): compare the sweep with the dflash_lab version that ran it, "
                         f"or {fix}")
    if data.get("declared") is not None and not isinstance(data["declared"], Mapping):
        raise ValueError(f"{path}: declared is {data['declared']!r}, not the analysis section: {fix}")
    return data


def _plain(value: Any) -> Any:
    """A protocol value as JSON holds it (tuples as lists)."""
    if isinstance(value, tuple):
        return list(value)
    return value


def overridden_keys(launch: Protocol, applied: Protocol) -> dict[str, dict[str, Any]]:
    """The protocol keys whose applied value differs from the launch protocol's (given on the command line):
    key -> {"launch": value, "applied": value}; {} when the launch protocol is the one applied.

    Example:
        >>> overridden_keys(Protocol(margins={"jumpiness": 0.01}), Protocol(margins={"jumpiness": 1.0}))
        {'margins': {'launch': {'jumpiness': 0.01}, 'applied': {'jumpiness': 1.0}}}
    """
    return {key: {"launch": _plain(getattr(launch, key)), "applied": _plain(getattr(applied, key))}
            for key in PROTOCOL_KEYS if getattr(launch, key) != getattr(applied, key)}


def section_disagreements(records: list[RunRecord], recorded: Mapping[str, Any] | None, rules: int) -> list[str]:
    """The runs whose own recorded `analysis` section differs from the sweep's ``protocol.json`` (edited after the
    launch, or launched with other values): one line per key, naming the runs. ``protocol.json`` applies.

    Example:
        >>> runs = [RunRecord("r", "local", "/r", config={"analysis": {"margins": {"jumpiness": 1.0}}})]
        >>> section_disagreements(runs, {"declared": {"margins": {"jumpiness": 0.01}}}, RULES_VERSION)
        ["analysis.margins of run(s) r ({'jumpiness': 1.0}) differs from the sweep's protocol.json \
({'jumpiness': 0.01}): protocol.json, frozen at launch, applies"]
    """
    if recorded is None:
        return []
    launch = protocol_from_section(recorded.get("declared"), rules)
    differing: dict[str, dict[str, list[str]]] = {}
    for record in records:
        section = record.config.get("analysis")
        if section is None:
            continue
        try:
            own = protocol_from_section(section, rules)
        except ValueError:
            continue
        for key in PROTOCOL_KEYS:
            if getattr(own, key) != getattr(launch, key):
                differing.setdefault(key, {}).setdefault(repr(_plain(getattr(own, key))), []).append(record.run_id)
    lines = []
    for key, values in differing.items():
        for text, run_ids in values.items():
            shown = ", ".join(run_ids[:5]) + (f" and {len(run_ids) - 5} more" if len(run_ids) > 5 else "")
            lines.append(f"analysis.{key} of run(s) {shown} ({text}) differs from the sweep's protocol.json "
                         f"({_plain(getattr(launch, key))!r}): protocol.json, frozen at launch, applies")
    return lines
