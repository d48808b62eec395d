"""Config values checked at the door, one way for every section: unknown keys are refused, values are typed.

Components receive plain values (never a DictConfig). Whatever reads a config section calls these helpers before
using a value, so a bad value fails at start-up with a message that names the key and the fix, instead of deep
inside training (or, worse, being cast into something else: ``int("4096.9")``, ``bool("false")``).

A section is checked whole, in one pass (:func:`check_section`): its keys against its :class:`Section` (each key's
checker; a nested section's own ``Section``; a section whose keys depend on its ``kind``, :class:`Kinds`), so the
typed settings of a whole config are checked where they are built, once (``training.settings.RunSettings``).

Rules:
    * an unknown key is refused, and the message lists the valid ones (a typo must never keep a default);
    * a missing key is refused, naming it and the preset that gives it (a section's optional keys excepted);
    * an integer is an ``int`` (or a float with an integral value, as YAML may give ``1e4``), never a bool,
      never a string, never NaN or infinity; ranges are checked after the type;
    * a bool is a bool (``"false"`` is refused: it would be truthy);
    * a choice is one of an explicit list.

Example:
    >>> as_int("sampler.max_tokens", 4096, minimum=1)
    4096
    >>> as_int("sampler.max_tokens", "abc", minimum=1, example=4096)
    Traceback (most recent call last):
    ...
    ValueError: sampler.max_tokens='abc': must be an integer (e.g. sampler.max_tokens=4096)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def refuse_unknown_keys(section: str, given: Iterable[str] | Mapping[str, Any], valid: Iterable[str]) -> None:
    """Raise when ``given`` holds a key outside ``valid``; the message names the section and lists valid keys.

    Example:
        >>> refuse_unknown_keys("trainer", {"lr": 1.0, "lrr": 2.0}, ["lr", "epochs"])
        Traceback (most recent call last):
        ...
        ValueError: unknown trainer key(s) ['lrr']; valid keys: epochs, lr
    """
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(f"unknown {section} key(s) {unknown}; valid keys: {', '.join(sorted(set(valid)))}")


def _example(key: str, example: Any) -> str:
    return f" (e.g. {key}={example})" if example is not None else ""


def as_int(key: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
           allow_none: bool = False, example: Any = None) -> int | None:
    """``value`` as an int, refusing bools, strings, non-integral floats, NaN/inf and out-of-range values.

    Args:
        key: the dotted config key, named in errors (``sampler.max_tokens``).
        value: the raw config value.
        minimum, maximum: inclusive bounds.
        allow_none: accept None (returned as None).
        example: a valid value shown in the error message.

    Example:
        >>> as_int("trainer.max_steps", None, allow_none=True) is None
        True
        >>> as_int("sampler.max_tokens", 4096.9)
        Traceback (most recent call last):
        ...
        ValueError: sampler.max_tokens=4096.9: must be a whole number, not a fraction
    """
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{key} is null: set it to an integer{_example(key, example)}")
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{key}={value!r}: must be an integer, not a boolean{_example(key, example)}")
    if isinstance(value, (int, np.integer)):
        number = int(value)
    elif isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            raise ValueError(f"{key}={value!r}: must be a finite integer{_example(key, example)}")
        if value != math.floor(value):
            raise ValueError(f"{key}={value!r}: must be a whole number, not a fraction")
        number = int(value)
    else:
        raise ValueError(f"{key}={value!r}: must be an integer{_example(key, example)}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{key}={number}: must be >= {minimum}{_example(key, example)}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{key}={number}: must be <= {maximum}{_example(key, example)}")
    return number


def as_float(key: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
             allow_none: bool = False, example: Any = None) -> float | None:
    """``value`` as a finite float (ints accepted), refusing bools, strings, NaN/inf and out-of-range values.

    Example:
        >>> as_float("trainer.lr", 1)
        1.0
        >>> as_float("trainer.lr", "fast")
        Traceback (most recent call last):
        ...
        ValueError: trainer.lr='fast': must be a number
    """
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{key} is null: set it to a number{_example(key, example)}")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{key}={value!r}: must be a number{_example(key, example)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{key}={value!r}: must be finite{_example(key, example)}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{key}={number:g}: must be >= {minimum:g}{_example(key, example)}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{key}={number:g}: must be <= {maximum:g}{_example(key, example)}")
    return number


def as_bool(key: str, value: Any) -> bool:
    """``value`` if it is a real bool; strings such as ``"false"`` are refused (they would be truthy).

    Example:
        >>> as_bool("sampler.drop_last", "false")
        Traceback (most recent call last):
        ...
        ValueError: sampler.drop_last='false': must be true or false (a YAML boolean, not a string)
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{key}={value!r}: must be true or false (a YAML boolean, not a string)")


def as_choice(key: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices``.

    Example:
        >>> as_choice("sampler.overlong", "cut", ["error", "truncate", "drop"])
        Traceback (most recent call last):
        ...
        ValueError: sampler.overlong='cut': choose one of error, truncate, drop
    """
    options = list(choices)
    if value not in options:
        raise ValueError(f"{key}={value!r}: choose one of {', '.join(str(o) for o in options)}")
    return value


Checker = Callable[[str, Any], Any]   # (dotted key, raw value) -> the checked value, or ValueError naming the key


def as_given(key: str, value: Any) -> Any:
    """``value`` unchecked: a key that has no rule (a name, a list of tags), or a section whose builder checks it
    (the sampler, data and model sections: ``sampling.build_policy``, ``data.build_dataset``, ``model.build_model``)."""
    return value


@dataclass(frozen=True)
class Section:
    """The keys of one config section: each key's checker (a :class:`Section` or :class:`Kinds` for a nested section),
    the fix named when a key is missing (the preset that gives it), and the keys the section may leave out."""

    checks: Mapping[str, Checker | Section | Kinds]
    missing: str
    optional: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Kinds:
    """A section whose keys depend on its ``kind`` (``logger.kind``: none | wandb): the :class:`Section` of each kind,
    and the fix named when the kind itself is missing."""

    sections: Mapping[str, Section]
    missing: str


def check_section(path: str, values: Any, section: Section | Kinds) -> dict[str, Any]:
    """One section checked whole: unknown keys refused, missing keys refused (``section.optional`` excepted), then
    every value by its checker, nested sections included.

    Args:
        path: the section's key (``trainer``; empty for the top level), which names it and its keys in messages.
        values: the section's raw values.
        section: its keys (a :class:`Kinds` picks the section of ``values["kind"]``).

    Returns:
        The checked values, keyed as given.

    Example:
        >>> spec = Section({"lr": lambda k, v: as_float(k, v, minimum=0.0), "epochs": lambda k, v: as_int(k, v)},
        ...                missing="conf/trainer/cpu.yaml gives every trainer key")
        >>> check_section("trainer", {"lr": 1, "epochs": 2}, spec)
        {'lr': 1.0, 'epochs': 2}
        >>> check_section("trainer", {"lr": 1}, spec)
        Traceback (most recent call last):
        ...
        ValueError: trainer lacks trainer.epochs: conf/trainer/cpu.yaml gives every trainer key
    """
    if isinstance(section, Kinds):
        if not isinstance(values, Mapping) or "kind" not in values:
            raise ValueError(f"the {path} section lacks {path}.kind: {section.missing}")
        section = section.sections[as_choice(f"{path}.kind", values["kind"], section.sections)]
    name = path or "top-level config"
    if not isinstance(values, Mapping):
        raise ValueError(f"{name}={values!r}: must be a section of keys; {section.missing}")
    refuse_unknown_keys(name, values, section.checks)
    missing = [key for key in section.checks if key not in values and key not in section.optional]
    if missing:
        raise ValueError(f"{path or 'the config'} lacks {', '.join(_dotted(path, key) for key in missing)}: "
                         f"{section.missing}")
    return {key: _check_value(_dotted(path, key), value, section.checks[key]) for key, value in values.items()}


def _dotted(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_value(key: str, value: Any, check: Checker | Section | Kinds) -> Any:
    if isinstance(check, (Section, Kinds)):
        return check_section(key, value, check)
    return check(key, value)
