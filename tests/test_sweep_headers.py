"""Every command a sweep file's header shows runs as written: its overrides parse with Hydra's own override parser
and the config it names composes with them (first value of each swept key), as `-m` would for its first job.

A header example is a full command (continuation lines joined): a bare override or a `...` fragment cannot be
pasted into a shell, and once one such line documented an escaped key that Hydra's lexer refuses.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
SWEEP_FILES = sorted((ROOT / "sweeps").glob("*.yaml"))
TRAIN = "python -m dflash_lab.train"
FLAGS_WITH_VALUE = {"--config-dir", "-cd", "--config-name", "-cn"}


def header_lines(file: Path) -> list[str]:
    """The text of the leading comment block, one entry per line, without '#'."""
    lines = []
    for line in file.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return lines


def header_commands(file: Path) -> tuple[list[str], list[str]]:
    """(training commands of the header with continuation lines joined and trailing '(remarks)' cut,
    fragments: lines that look like a piece of a command but are not one)."""
    commands, fragments, continuing = [], [], False
    for text in header_lines(file):
        if continuing:
            commands[-1] += " " + text
        elif text.startswith(TRAIN):
            commands.append(text)
        elif text.startswith("...") or re.match(r"'?[+~]?[\w./\\-]+=", text) or re.search(r"\s\.\.\. --", text):
            fragments.append(text)
        continuing = text.endswith("\\")
        if continuing:
            commands[-1] = commands[-1][:-1]
    return [re.sub(r"\s{2,}\(.*\)\s*$", "", c).strip() for c in commands], fragments


def split_command(command: str) -> tuple[str, list[str]]:
    """(config name, overrides) of one `python -m dflash_lab.train ...` command."""
    words = shlex.split(command)[len(shlex.split(TRAIN)):]
    config_name, overrides, i = "train", [], 0
    while i < len(words):
        if words[i] in FLAGS_WITH_VALUE:
            config_name = words[i + 1] if words[i] in ("--config-name", "-cn") else config_name
            i += 2
            continue
        if words[i] not in ("-m", "--multirun"):
            overrides.append(words[i])
        i += 1
    return config_name, overrides


def first_job(overrides: list[str]) -> list[str]:
    """The overrides with each sweep replaced by its first value (what the first job of `-m` composes)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    out = []
    for override in parsed:
        if override.is_sweep_override():
            prefix = override.get_key_element().removesuffix(override.key_or_group)
            out.append(f"{prefix}{override.key_or_group}={next(iter(override.sweep_string_iterator()))}")
        else:
            out.append(override.input_line)
    return out


@pytest.mark.parametrize("file", SWEEP_FILES, ids=[f.stem for f in SWEEP_FILES])
def test_every_header_command_parses_and_composes(file):
    commands, fragments = header_commands(file)
    assert not fragments, f"{file.name}: write these header examples as full commands: {fragments}"
    assert commands, f"{file.name}: its header shows no training command"
    for command in commands:
        config_name, overrides = split_command(command)
        assert config_name == file.stem, f"{file.name}: {command!r} runs another config"
        job = first_job(overrides)   # raises OverrideParseException on a lexer error
        with initialize_config_module("dflash_lab.conf", version_base="1.3"):
            compose(config_name=config_name, overrides=job, return_hydra_config=True)   # unknown keys raise


@pytest.mark.parametrize("file", SWEEP_FILES, ids=[f.stem for f in SWEEP_FILES])
def test_the_sweep_grid_parses(file):
    params = OmegaConf.load(file).get("hydra", {}).get("sweeper", {}).get("params") or {}
    OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])


def test_the_old_escaped_key_example_is_caught(tmp_path):
    old = tmp_path / "boundaries_grid.yaml"
    old.write_text("# python -m dflash_lab.train -m --config-dir sweeps --config-name boundaries_grid\n"
                   "#   'hydra.sweeper.params.sampler\\.boundaries=[0,770,8192],[0,1024,8192]'\ndefaults: [train]\n")
    commands, fragments = header_commands(old)
    assert fragments == ["'hydra.sweeper.params.sampler\\.boundaries=[0,770,8192],[0,1024,8192]'"]
    with pytest.raises(OverrideParseException, match="LexerNoViableAlt"):
        OverridesParser.create().parse_overrides(shlex.split(fragments[0]))
