"""Every conf/sampler/*.yaml composes with Hydra's compose API and builds a working policy."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from dflash_lab.data.lengths import reference_lengths
from dflash_lab.plan import CONF_DIR
from dflash_lab.sampling import POLICIES, policy_from_config

CONF = CONF_DIR  # the shipped configs (package dflash_lab.conf)
SAMPLERS = sorted(p.stem for p in (CONF / "sampler").glob("*.yaml"))


def test_config_groups_mirror_code():
    assert set(SAMPLERS) == set(POLICIES)


@pytest.mark.parametrize("config_name", ["train", "plan"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_compose_and_build(config_name, sampler):
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=[f"sampler={sampler}"])
    sampler_cfg = OmegaConf.to_container(cfg.sampler, resolve=True)
    assert sampler_cfg["name"] == sampler
    policy = policy_from_config(sampler_cfg, reference_lengths("cpu", 2000), seed=0, world_size=2, rank=1)
    assert len(policy) > 0 and policy.name == sampler


def test_every_config_file_starts_with_its_command():
    for path in CONF.rglob("*.yaml"):
        first = path.read_text().lstrip().splitlines()[0]
        assert first.startswith("#") and "python" in first or "@package" in first, f"{path}: {first!r}"


@pytest.mark.parametrize("override", ["sampler.boundaries=[0,300,200,1024]", "sampler.overlong=ignore"])
def test_bad_sampler_values_fail_at_build(override):
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["sampler=bucketed", override])
    with pytest.raises(ValueError, match="sampler"):
        policy_from_config(OmegaConf.to_container(cfg.sampler), reference_lengths("cpu", 500), seed=0)
