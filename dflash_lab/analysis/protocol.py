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
      verdict: null             # {endpoint, positive_control, negative_control, question}: the roles of arms in
                                # the ablation's verdict.json (analysis.verdict); null: no verdict

Each key can be overridden on the `python -m dflash_lab.compare` command line (--baseline, --endpoints, --margins,
--cost, --alpha, --test). Runs that declare different values for a key not given on the command line are an error (they
belong to different sweeps).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dflash_lab.analysis.paired import TESTS
from dflash_lab.analysis.schema import BETTER, DEFAULT_ENDPOINTS, RunRecord
from dflash_lab.config_check import as_float, refuse_unknown_keys

PROTOCOL_KEYS = ("baseline", "endpoints", "margins", "cost", "alpha", "verdict", "test")
VERDICT_KEYS = ("endpoint", "positive_control", "negative_control", "question")
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
    test: str = "t"


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
    """The verdict roles: a primary endpoint and an arm selector per role (all four keys), or None.

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
    refuse_unknown_keys(key, value, VERDICT_KEYS)
    missing = [name for name in VERDICT_KEYS if name not in value]
    if missing:
        raise ValueError(f"{key}: missing {missing}; give all of {', '.join(VERDICT_KEYS)}, e.g. {example}")
    roles = {"endpoint": _endpoint(f"{key}.endpoint", value["endpoint"])}
    for name in VERDICT_KEYS[1:]:
        roles[name] = check_baseline(value[name], key=f"{key}.{name}")
        if roles[name] is None:
            raise ValueError(f"{key}.{name}: give an arm selector, e.g. {example}")
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


_CHECKS = {"baseline": check_baseline, "endpoints": check_endpoints, "margins": check_margins, "cost": check_cost,
           "alpha": check_alpha, "verdict": check_verdict, "test": check_test}


def protocol_from_section(section: Mapping | None) -> Protocol:
    """Check one run's `analysis` section and turn it into a Protocol (missing keys take the defaults).

    Example:
        >>> protocol_from_section({"baseline": "full_random", "margins": {"jumpiness": 0.01}}).margins
        {'jumpiness': 0.01}
        >>> protocol_from_section({"margin": {}})
        Traceback (most recent call last):
        ...
        ValueError: unknown analysis key(s) ['margin']; valid keys: alpha, baseline, cost, endpoints, margins, test, verdict
    """
    if section is None:
        return Protocol()
    if not isinstance(section, Mapping):
        raise ValueError(f"analysis={section!r}: give a mapping with keys {', '.join(PROTOCOL_KEYS)}")
    refuse_unknown_keys("analysis", section, PROTOCOL_KEYS)
    given = {key: _CHECKS[key](value) for key, value in section.items() if key != "endpoints" or value is not None}
    return replace(Protocol(), **given)


def resolve_protocol(records: list[RunRecord], **command_line: Any) -> Protocol:
    """The protocol of a set of runs: each key from the command line if given (not None), else from the runs'
    recorded `analysis` sections, which must agree, else the default.

    Args:
        records: the loaded runs (their `config["analysis"]`).
        command_line: baseline / endpoints / margins / cost / alpha as given to compare (None: not given).

    Raises:
        ValueError: a bad value (naming analysis.<key>), or runs that declare different values for a key.

    Example:
        >>> run = RunRecord("r", "local", "/r", config={"analysis": {"baseline": "full_random"}})
        >>> resolve_protocol([run], alpha=0.1)
        Protocol(baseline='full_random', endpoints=('ktok_s', 'jumpiness', 'residual_amplitude', \
'own_share_slope', 'band_forgetting', 'probe_loss_at_tokens'), margins={}, cost=None, alpha=0.1, verdict=None, \
test='t')
    """
    refuse_unknown_keys("compare option", command_line, PROTOCOL_KEYS)
    declared = [(record.run_id, protocol_from_section(record.config.get("analysis"))) for record in records
                if record.config.get("analysis") is not None]
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
    return replace(Protocol(), **chosen)
