"""conf/train.yaml composes with every sampler, trainer and logger through Hydra's compose API."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from dflash_lab.metrics.throughput import format_eta
from dflash_lab.plan import CONF_DIR
from dflash_lab.presets import preset
from dflash_lab.training.settings import ProbeSettings, TrainerSettings
from dflash_lab.training.step import LRSchedule

CONF = CONF_DIR  # the shipped configs (package dflash_lab.conf)
SAMPLERS = sorted(p.stem for p in (CONF / "sampler").glob("*.yaml"))


def _compose(overrides):
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        return compose(config_name="train", overrides=["run_dir=/tmp/unused", *overrides])


def test_every_sampler_is_present():
    assert {"sorted_static", "full_random", "bucketed", "bucketed_megabatch", "packed"} <= set(SAMPLERS)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_compose_every_sampler(sampler):
    cfg = _compose([f"sampler={sampler}"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert plain["sampler"]["name"] == sampler
    for key in ("seed", "resume", "experiment", "run_dir"):
        assert key in plain
    trainer = TrainerSettings.from_dict(plain["trainer"])
    assert trainer.max_steps is None and trainer.epochs >= 1 and trainer.lr == 6e-4 and trainer.grad_clip == 1.0
    assert trainer.warmup_frac == 0.04
    ProbeSettings.from_dict(plain["probes"])
    assert plain["logger"]["kind"] == "none"


@pytest.mark.parametrize("sampler", ["bucketed", "packed"])
def test_wandb_logger_resolves_group_and_job_type(sampler):
    cfg = _compose([f"sampler={sampler}", "logger=wandb", "seed=3"])
    logger = OmegaConf.to_container(cfg.logger, resolve=True)
    assert logger == {"kind": "wandb", "mode": "offline", "project": "dflash_lab", "entity": None,
                      "group": None, "job_type": sampler, "name": None, "tags": []}  # named at launch by main()


def test_gpu_trainer_inherits_cpu_defaults():
    plain = OmegaConf.to_container(_compose(["trainer=gpu"]), resolve=True)["trainer"]
    assert plain["device"] == "cuda" and plain["precision"] == "bf16" and plain["grad_clip"] == 1.0


def test_overrides_tools_rely_on():
    cfg = _compose(["sampler=full_random", "seed=5", "trainer.epochs=3", "trainer.max_steps=7", "resume=true"])
    assert (cfg.sampler.name, cfg.seed, cfg.trainer.epochs, cfg.trainer.max_steps, cfg.resume) == (
        "full_random", 5, 3, 7, True)


def test_unknown_trainer_key_is_refused():
    with pytest.raises(ValueError, match="unknown trainer key"):
        TrainerSettings.from_dict({**preset("trainer", "cpu"), "epochz": 2})


def test_a_missing_trainer_key_is_refused_naming_it_and_the_preset():
    values = preset("trainer", "cpu")
    del values["grad_clip"]
    with pytest.raises(ValueError, match=r"trainer lacks trainer\.grad_clip: conf/trainer/cpu\.yaml gives every"):
        TrainerSettings.from_dict(values)


@pytest.mark.parametrize("values, key", [({"epochs": 0}, "trainer.epochs"), ({"grad_accum": 0}, "trainer.grad_accum"),
                                         ({"precision": "bf16"}, "trainer.precision"),
                                         ({"warmup_frac": 1.5}, "trainer.warmup_frac"),
                                         ({"lr": "fast"}, "trainer.lr"), ({"max_steps": 4.5}, "trainer.max_steps"),
                                         ({"progress": "false"}, "trainer.progress"),
                                         ({"epochs": True}, "trainer.epochs"),
                                         ({"betas": [0.9]}, "trainer.betas")])
def test_bad_trainer_values_name_the_key(values, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        TrainerSettings.from_dict(preset("trainer", "cpu", **values))


def test_schedule_warmup_then_cosine():
    total = 200
    schedule = LRSchedule(peak_lr=1.0, total_steps=total, warmup_frac=0.04, min_lr_ratio=0.1)
    lrs = [schedule.lr(s) for s in range(total)]
    warmup = 8
    assert lrs[0] == pytest.approx(1 / warmup) and lrs[warmup - 1] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[: warmup - 1], lrs[1:warmup]))  # linear rise
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :]))  # monotone decay
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_probe_settings_refuse_unknown_keys_and_bad_values():
    probes = OmegaConf.to_container(_compose([]).probes)
    with pytest.raises(ValueError, match="unknown probes key"):
        ProbeSettings.from_dict({**probes, "per_bands": 3})
    with pytest.raises(ValueError, match=r"probes\.per_band"):
        ProbeSettings.from_dict({**probes, "per_band": 0})
    del probes["seed"]
    with pytest.raises(ValueError, match=r"probes lacks probes\.seed: conf/train\.yaml gives every probes key"):
        ProbeSettings.from_dict(probes)


def test_human_eta():
    assert [format_eta(s) for s in (403200, 3725, 125, 4.4, float("nan"))] == ["4d 16h", "1h 02m", "2m 05s", "4s", "?"]


def test_tiny_target_pretrains_on_a_skills_corpus_only_when_the_data_is_one():
    from dflash_lab.training.components import pretrain_corpus_follows_data

    plain = OmegaConf.to_container(_compose([]), resolve=True)
    assert plain["data"]["band_skills"] == "none"
    assert pretrain_corpus_follows_data(plain["model"], plain["data"]) == plain["model"]  # same cached target
    skills = OmegaConf.to_container(_compose(["data.band_skills=aligned", "data.seed=3"]), resolve=True)
    corpus = pretrain_corpus_follows_data(skills["model"], skills["data"])["pretrain_data"]
    assert corpus["band_skills"] == "aligned" and corpus["seed"] == 3 and corpus["kind"] == "synthetic"
    assert corpus["skill_bands"] == skills["data"]["skill_bands"]
