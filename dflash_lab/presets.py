"""The shipped YAML presets (``conf/<group>/<name>.yaml``) read as plain dicts: the one home of every default.

Every setting's default is written once, in a preset file; the typed settings (``dflash_lab.training.settings``) and the
model builders (``dflash_lab.model.build``) take every key as a required argument. Training composes the presets
with Hydra; code that holds a section only in part (a doctest, a test, a notebook sizing a model) completes it
from its preset here instead of writing a second default::

    preset("model", "tiny", block_size=4)   # conf/model/tiny.yaml with one key changed

A preset's ``defaults`` list names presets of the same group it extends (``model/hf_cpu.yaml`` extends ``hf``), or a
file its group's presets share, merged in place (``/sampler_common@_here_``: conf/sampler_common.yaml); a preset that
sets other sections too (``# @package _global_``: ``trainer=smoke`` sets ``probes.every``) gives its own section;
interpolations of top-level keys (``${seed}``) resolve against ``seed`` (0, as conf/train.yaml gives it).

Example:
    >>> preset("trainer", "gpu")["precision"], preset("trainer", "gpu")["lr"]
    ('bf16', 0.0006)
    >>> preset("model", "tiny")["fixed_anchors"], preset("model", "hf")["fixed_anchors"]
    (4, 8)
    >>> preset("model", "tiny", blok_size=4)
    Traceback (most recent call last):
    ...
    ValueError: unknown model key(s) ['blok_size'] for preset model=tiny; valid keys: ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import dflash_lab.replicates  # noqa: F401  (registers the dflash_target_seed resolver that model/tiny.yaml uses)

CONF_DIR = Path(__file__).resolve().parent / "conf"   # package data (dflash_lab.conf), in a checkout and a wheel


def preset_names(group: str) -> list[str]:
    """The presets of a config group (``model`` -> ``['hf', 'hf_cpu', 'qwen3_8b', 'tiny']``)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _preset_node(group: str, name: str) -> DictConfig:
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"{group}={name}: no preset {path}; choose one of {', '.join(preset_names(group))}")
    node = OmegaConf.load(path)
    parents = [_parent_node(group, d) for d in node.pop("defaults", []) if d != "_self_"]
    if path.read_text().startswith("# @package _global_"):   # it sets other sections too (trainer=smoke: probes)
        node = node.get(group) or OmegaConf.create()
    return OmegaConf.merge(*parents, node) if parents else node


def _parent_node(group: str, entry: str) -> DictConfig:
    """One entry of a preset's defaults list: a preset of the same group (``cpu``, ``cpu@trainer``), or a shared
    file (``/sampler_common@_here_``)."""
    target = entry.split("@")[0]
    if target.startswith("/"):
        return OmegaConf.load(CONF_DIR / f"{target[1:]}.yaml")
    return _preset_node(group, target)


def preset(group: str, name: str, *, seed: int = 0, **overrides: Any) -> dict[str, Any]:
    """``conf/<group>/<name>.yaml`` (with the presets it extends) as a resolved plain dict, ``overrides`` applied.

    Args:
        group: a config group (``model``, ``trainer``, ``sampler``, ``data``, ``logger``, ``gpu``).
        name: the preset (``tiny``, ``cpu``...).
        seed: the top-level ``seed`` the preset's interpolations read (``model.draft_init_seed: ${seed}``).
        **overrides: keys replaced after loading; a key the preset does not have is refused (a typo must never
            keep a default).
    """
    node = _preset_node(group, name)
    unknown = sorted(set(overrides) - set(node))
    if unknown:
        raise ValueError(f"unknown {group} key(s) {unknown} for preset {group}={name}; valid keys: "
                         f"{', '.join(sorted(node))}")
    root = OmegaConf.create({"seed": seed, group: node})
    values = OmegaConf.to_container(root, resolve=True)[group]
    values.update(overrides)
    return values
