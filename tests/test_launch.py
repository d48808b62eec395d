"""Launcher configs and the pre-submission checks of dflash_lab/cluster/launch.py (no cluster needed).

Configs are composed with Hydra's compose API from the real conf/ (and sweeps/), so a broken launcher or sweep
file fails here; the command-line tests run the real entry point and show that a bad value stops the sweep
before anything runs. The checks against a live Slurm (partition from sinfo, real submissions) are in
tests/test_slurm*.py.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import dflash_lab.sweeps
from dflash_lab.cluster.launch import (
    LaunchConfigError,
    SlurmNode,
    check_launcher,
    check_sampler,
    check_sweep,
    expand_sweep,
    launcher_kind,
    validate_multirun,
)

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = Path(dflash_lab.sweeps.__file__).parent  # the shipped sweep files (package dflash_lab.sweeps)
SEED_BOUNDARIES = [0, 770, 1216, 1728, 2432, 3296, 8192]
CPU_BOUNDARIES = [0, 96, 152, 216, 304, 412, 1024]


def _compose(overrides=(), config_name="train"):
    """Compose like `python -m dflash_lab.train -m ...` would (hydra node included).

    A sweep file is the primary config (`--config-name NAME` on the command line): the shipped sweeps are on the
    search path of pkg://dflash_lab.conf (hydra_plugins/dflash_lab_sweeps), as they are for the command.
    """
    with _hydra_context():
        return compose(config_name, overrides=list(overrides), return_hydra_config=True)


def _hydra_context():
    return initialize_config_module("dflash_lab.conf", version_base="1.3")


@functools.cache
def _with_sweep_checks(config_name, overrides=()):
    """Compose and run the sweep checks inside the same Hydra context (they compose every job again). Cached: a
    sweep's jobs are composed once for the tests that read them (read-only; composing costs ~0.1 s a job)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    with _hydra_context():
        # compose() composes for a single run, where a sweep value such as a=1,2 is an error: compose as -m does.
        cfg = GlobalHydra.instance().hydra.compose_config(
            config_name, list(overrides), run_mode=RunMode.MULTIRUN,
        )
        return cfg, expand_sweep(cfg), check_sweep(cfg)


# ------------------------------------------------------------------------------------------ launcher configs


def test_slurm_launcher_defaults_one_task_per_gpu():
    cfg = _compose(["hydra/launcher=slurm"])
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher_kind(cfg.hydra.launcher) == "slurm"
    assert launcher["gpus_per_node"] == 8 and launcher["tasks_per_node"] == 8 and launcher["nodes"] == 1
    assert launcher["signal_delay_s"] > 0 and launcher["max_num_timeout"] > 0  # requeue after a time-limit hit
    assert launcher["additional_parameters"]["requeue"] is True
    assert launcher["submitit_folder"].startswith(str(cfg.hydra.sweep.dir))
    assert cfg.hydra.callbacks.validate_launch._target_ == "dflash_lab.cluster.launch.ValidateLaunch"
    # tasks follow the GPU count unless set explicitly
    cfg = _compose(["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4"])
    assert cfg.hydra.launcher.tasks_per_node == 4
    assert check_launcher(cfg.hydra.launcher, partitions=["debug"]) == []


def test_slurm_launcher_takes_cluster_settings_from_the_command_line():
    cfg = _compose([
        "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.account=lab",
        "hydra.launcher.qos=high", "hydra.launcher.nodes=2", "hydra.launcher.timeout_min=30",
        "hydra.launcher.mem_gb=400", "hydra.launcher.cpus_per_task=12", '+hydra.launcher.srun_args=["--cpu-bind=none"]',
    ])
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert (launcher["partition"], launcher["account"], launcher["qos"]) == ("gpu", "lab", "high")
    resources = (launcher["nodes"], launcher["timeout_min"], launcher["mem_gb"], launcher["cpus_per_task"])
    assert resources == (2, 30, 400, 12)
    assert launcher["srun_args"] == ["--cpu-bind=none"]
    assert check_launcher(cfg.hydra.launcher, partitions=["gpu", "cpu"]) == []


def test_local_launcher_defaults_two_cpu_ranks():
    cfg = _compose(["hydra/launcher=local"])
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher_kind(cfg.hydra.launcher) == "local"
    assert (launcher["tasks_per_node"], launcher["gpus_per_node"], launcher["nodes"]) == (2, 0, 1)
    assert check_launcher(cfg.hydra.launcher) == []  # no sinfo needed for the local executor


# ------------------------------------------------------------------------------------------ launcher checks


def test_more_tasks_than_gpus_is_rejected_with_the_key_and_the_fix():
    cfg = _compose(["hydra/launcher=slurm", "hydra.launcher.tasks_per_node=16"])
    problems = check_launcher(cfg.hydra.launcher, partitions=["debug"])
    assert len(problems) == 1
    msg = problems[0]
    assert "hydra.launcher.tasks_per_node=16" in msg and "hydra.launcher.gpus_per_node=8" in msg
    assert "Fix: hydra.launcher.tasks_per_node=8" in msg and "hydra.launcher.gpus_per_node=0" in msg


def test_cpu_run_with_several_tasks_is_valid():
    # How CI tests DDP on Slurm: no GPUs, two tasks.
    cfg = _compose([
        "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=4",
    ])
    assert check_launcher(cfg.hydra.launcher, partitions=["debug"]) == []
    cfg = _compose(["hydra/launcher=local", "hydra.launcher.tasks_per_node=4"])
    assert check_launcher(cfg.hydra.launcher) == []


def test_zero_gpus_without_a_task_count_says_to_set_tasks():
    # tasks_per_node follows gpus_per_node (0) unless given: the message must say which key to set.
    cfg = _compose(["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0"])
    (msg,) = check_launcher(cfg.hydra.launcher, partitions=["debug"])
    assert "hydra.launcher.tasks_per_node=0" in msg and "hydra.launcher.tasks_per_node=2" in msg


def test_unknown_partition_is_rejected_and_named():
    cfg = _compose(["hydra/launcher=slurm", "hydra.launcher.partition=gpu_big"])
    (msg,) = check_launcher(cfg.hydra.launcher, partitions=["debug", "long"])
    assert "hydra.launcher.partition='gpu_big'" in msg and "debug, long" in msg
    assert "hydra.launcher.partition=null" in msg  # the way back to the cluster default
    cfg = _compose(["hydra/launcher=slurm", "hydra.launcher.partition=long"])
    assert check_launcher(cfg.hydra.launcher, partitions=["debug", "long"]) == []


def test_no_partition_means_cluster_default():
    cfg = _compose(["hydra/launcher=slurm"])
    assert cfg.hydra.launcher.partition is None
    assert check_launcher(cfg.hydra.launcher, partitions=["debug"]) == []


# Node lists as `sinfo -N` reports them (parse_sinfo_nodes has its own doctest).
DEBUG_2CPU = [SlurmNode("n1", "debug", True, 2, 20000, 0)]
MIXED = [SlurmNode("c1", "cpu", True, 32, 128000, 0), SlurmNode("c2", "cpu", True, 16, 64000, 0),
         SlurmNode("g1", "gpu", False, 64, 512000, 8), SlurmNode("g2", "gpu", False, 64, 512000, 8)]


def test_cpu_request_larger_than_the_nodes_is_refused_with_the_numbers_and_the_fix():
    # The commonest mistake: a CPU job with 2 tasks keeps the GPU default of 8 CPUs per task (16 > 2 per node).
    cfg = _compose(["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.tasks_per_node=2"])
    (msg,) = check_launcher(cfg.hydra.launcher, cluster_nodes=DEBUG_2CPU)
    assert "asks 16 CPUs per node; nodes in partition debug have 2: set hydra.launcher.cpus_per_task=1" in msg
    assert msg.startswith("hydra.launcher.tasks_per_node=2 x hydra.launcher.cpus_per_task=8")
    fixed = _compose(["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.tasks_per_node=2",
                      "hydra.launcher.cpus_per_task=1"])
    assert check_launcher(fixed.hydra.launcher, cluster_nodes=DEBUG_2CPU) == []
    more_tasks_than_cpus = _compose(["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0",
                                     "hydra.launcher.tasks_per_node=4", "hydra.launcher.cpus_per_task=1"])
    (msg,) = check_launcher(more_tasks_than_cpus.hydra.launcher, cluster_nodes=DEBUG_2CPU)
    assert "asks 4 CPUs per node" in msg and "set hydra.launcher.tasks_per_node=2 hydra.launcher.cpus_per_task=1" in msg


def test_gpu_memory_and_node_count_requests_are_checked_against_the_partition():
    # Default partition (cpu) has no GPUs: the 8-GPU default is refused and the GPU partition is suggested.
    cfg = _compose(["hydra/launcher=slurm"])
    problems = check_launcher(cfg.hydra.launcher, cluster_nodes=MIXED)
    assert any("asks 64 CPUs per node; nodes in partition cpu have at most 32" in m for m in problems)
    (gpu_msg,) = [m for m in problems if "GPUs per node" in m]
    assert "nodes in partition cpu have 0" in gpu_msg and "hydra.launcher.partition=gpu" in gpu_msg
    # ... and fits the GPU partition, on one node or two.
    on_gpu = ["hydra/launcher=slurm", "hydra.launcher.partition=gpu"]
    assert check_launcher(_compose(on_gpu).hydra.launcher, cluster_nodes=MIXED) == []
    assert check_launcher(_compose([*on_gpu, "hydra.launcher.nodes=2"]).hydra.launcher, cluster_nodes=MIXED) == []
    (msg,) = check_launcher(_compose([*on_gpu, "hydra.launcher.nodes=3"]).hydra.launcher, cluster_nodes=MIXED)
    assert "hydra.launcher.nodes=3 asks 3 nodes" in msg and "has 2 such node(s): set hydra.launcher.nodes=2" in msg
    (msg,) = check_launcher(_compose([*on_gpu, "hydra.launcher.mem_gb=600"]).hydra.launcher, cluster_nodes=MIXED)
    assert "asks 600 GB per node; nodes in partition gpu have 500 GB: set hydra.launcher.mem_gb=500" in msg
    # Each resource exists somewhere, but no node has them all.
    split = [SlurmNode("fat", "mix", True, 64, 256000, 0), SlurmNode("thin", "mix", True, 8, 64000, 8)]
    (msg,) = check_launcher(_compose(["hydra/launcher=slurm"]).hydra.launcher, cluster_nodes=split)
    assert "asks 64 CPUs and 8 GPUs on one node; no node of partition mix has all of them" in msg
    # A list of partitions: fine when one of them can run the job.
    either = ["hydra/launcher=slurm", "hydra.launcher.partition='cpu,gpu'"]
    assert check_launcher(_compose(either).hydra.launcher, cluster_nodes=MIXED) == []


def test_signal_delay_longer_than_time_limit_is_rejected():
    cfg = _compose(["hydra/launcher=slurm", "hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=300"])
    (msg,) = check_launcher(cfg.hydra.launcher, partitions=["debug"])
    assert "hydra.launcher.signal_delay_s=300" in msg and "hydra.launcher.timeout_min=2" in msg


def test_several_problems_are_reported_together():
    cfg = _compose([
        "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=9", "hydra.launcher.partition=nope",
        "hydra.launcher.cpus_per_task=0",
    ])
    with pytest.raises(LaunchConfigError) as err:
        validate_multirun(cfg, partitions=["debug"])
    assert len(err.value.problems) == 3
    text = str(err.value)
    assert "nothing was submitted" in text
    for key in ("tasks_per_node", "partition", "cpus_per_task"):
        assert f"hydra.launcher.{key}" in text


def test_basic_launcher_is_not_checked():
    cfg = _compose([])
    assert launcher_kind(cfg.hydra.launcher) is None
    assert check_launcher(cfg.hydra.launcher) == []


# ------------------------------------------------------------------------------------------ sweep value checks


@pytest.mark.parametrize(
    "boundaries, words",
    [
        ([0, 152, 96, 1024], ["unsorted", "152", "96"]),
        ([0, 96, 96, 1024], ["duplicate"]),
        ([16, 96, 1024], ["first boundary must be 0"]),
        ([0, 96.5, 1024], ["96.5", "not an integer"]),
        ([0], ["at least two"]),
        ("bogus", ["'bogus'", "preset"]),
    ],
)
def test_invalid_boundary_lists_are_rejected(boundaries, words):
    (msg,) = check_sampler({"name": "bucketed", "boundaries": boundaries, "num_buckets": None}, "job #2 (x): ")
    assert msg.startswith("job #2 (x): sampler.boundaries=")
    assert "Fix:" in msg and "sampler.num_buckets=K" in msg
    for word in words:
        assert word in msg


@pytest.mark.parametrize("boundaries", [SEED_BOUNDARIES, CPU_BOUNDARIES, [0, 1024], "seed", "cpu"])
def test_valid_boundary_lists_pass(boundaries):
    assert check_sampler({"name": "bucketed", "boundaries": boundaries, "num_buckets": None}) == []


def test_bucket_count_settings():
    assert check_sampler({"name": "bucketed", "boundaries": None, "num_buckets": 4}) == []
    (msg,) = check_sampler({"name": "bucketed", "boundaries": None, "num_buckets": 0})
    assert "sampler.num_buckets=0" in msg
    (msg,) = check_sampler({"name": "bucketed", "boundaries": CPU_BOUNDARIES, "num_buckets": 4})
    assert "sampler.num_buckets=4" in msg and "sampler.boundaries=null" in msg
    (msg,) = check_sampler({"name": "bucketed", "boundaries": None, "num_buckets": None})
    assert "sampler.boundaries=null and sampler.num_buckets=null" in msg
    assert check_sampler({"name": "full_random", "max_tokens": 4096}) == []  # nothing to check


def test_a_bad_value_in_a_command_line_sweep_names_its_job():
    cfg, jobs, problems = _with_sweep_checks(
        "train", ("sampler=bucketed", "sampler.boundaries=[0,96,1024],[0,300,200,1024]", "seed=0,1")
    )
    assert len(jobs) == 4
    assert len(problems) == 2  # the bad list, once per seed
    assert all("sampler.boundaries=[0, 300, 200, 1024]" in p for p in problems)
    assert problems[0].startswith("job #2 (") and problems[1].startswith("job #3 (")


# ------------------------------------------------------------------------------------------ sweep files


@pytest.mark.parametrize(
    "name, njobs",
    [("boundaries_grid", 7), ("bucket_count_grid", 15), ("policies_seeds", 15), ("forgetting_epochs", 25),
     ("forgetting_scale", 24)],
)
def test_sweep_files_expand_to_valid_jobs(name, njobs):
    cfg, jobs, problems = _with_sweep_checks(name)
    assert len(jobs) == njobs
    assert problems == []
    assert cfg.experiment == name  # own multirun folder: multirun/<name>/<time>/
    assert cfg.hydra.callbacks.validate_launch._target_ == "dflash_lab.cluster.launch.ValidateLaunch"
    text = (SWEEPS / f"{name}.yaml").read_text()
    assert text.startswith("# python -m dflash_lab.train -m --config-dir sweeps --config-name " + name)


def test_the_seed_lr_sweep_is_the_protocol_at_lr_6e_4_with_a_clip_that_does_not_bind():
    """sweeps/forgetting_seed_lr.yaml differs from the protocol by the learning rate and the clip alone (so its jobs
    are the protocol's, which test_own_data launches)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    with _hydra_context():
        seed_lr, protocol = (GlobalHydra.instance().hydra.compose_config(name, [], run_mode=RunMode.MULTIRUN)
                             for name in ("forgetting_seed_lr", "forgetting_protocol"))
    assert seed_lr.trainer.lr == 6.0e-4 and seed_lr.trainer.grad_clip == 100.0
    assert seed_lr.analysis == protocol.analysis and seed_lr.probes == protocol.probes
    assert seed_lr.hydra.sweeper.params == protocol.hydra.sweeper.params
    differ = {key for key in protocol.trainer if seed_lr.trainer[key] != protocol.trainer[key]}
    assert differ == {"lr", "grad_clip"}


def test_the_protocol_runs_eight_arms_on_five_targets_with_two_seeds_each():
    """Rules version 6's protocol: the equal-updates and LR-scaled arms join the six, the seeds nest within the five
    shipped targets, and every arm role the verdict declares is an arm of the sweep."""
    cfg, jobs, problems = _with_sweep_checks("forgetting_protocol")
    assert problems == [] and len(jobs) == 80 and cfg.target_seeds == 5
    arms = {o.split("=", 1)[1] for job in jobs for o in job if o.startswith("+arm=")}
    assert {"any_bucketed_equal_updates", "any_bucketed_lr_sqrt", "any_full_random_equal_tokens"} <= arms
    assert len(arms) == 8 and {o for job in jobs for o in job if o.startswith("seed=")} == {f"seed={s}"
                                                                                        for s in range(10)}
    roles = cfg.analysis.verdict
    assert roles.equal_updates and roles.equal_tokens and roles.lr_scaled


def test_boundaries_grid_holds_the_seed_lists():
    cfg, jobs, _ = _with_sweep_checks("boundaries_grid")
    values = [job[0].split("=", 1)[1] for job in jobs]
    assert "[" + ",".join(map(str, SEED_BOUNDARIES)) + "]" in values
    assert "[" + ",".join(map(str, CPU_BOUNDARIES)) + "]" in values


def test_bucket_count_grid_fits_k_2_to_16():
    _, jobs, _ = _with_sweep_checks("bucket_count_grid")
    ks = sorted(int(o.split("=")[1]) for job in jobs for o in job if o.startswith("sampler.num_buckets="))
    assert ks == list(range(2, 17))
    assert all("sampler.boundaries=null" in job for job in jobs)


def test_policies_seeds_covers_every_policy():
    from dflash_lab.sampling import POLICIES

    _, jobs, _ = _with_sweep_checks("policies_seeds")
    pairs = {(job[0].split("=")[1], job[1].split("=")[1]) for job in jobs}
    production = [p for p in POLICIES if p != "bucket_sequential"]  # a positive control, not a batching choice
    assert pairs == {(p, s) for p in production for s in ("0", "1", "2")}


def test_sweep_jobs_get_distinct_directories():
    # Every job of a sweep must land in its own run directory (subdir resolved per job, as Hydra does).
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    # The name shows what the grid varies, filesystem-safe, after the job number (sampler and seed as before).
    first_names = {"boundaries_grid": "0_bucketed_b0-96-152-216-304-412-1024_s0",   # the baseline: first
                   "bucket_count_grid": "0_bucketed_K2_s0", "policies_seeds": "0_sorted_static_s0",
                   "forgetting_ablation": "0_full_random_aligned_full_random_s0"}
    for name in ("boundaries_grid", "bucket_count_grid", "policies_seeds", "forgetting_ablation"):
        with _hydra_context():
            master = compose(name, return_hydra_config=True)
            loader = GlobalHydra.instance().config_loader()
            jobs = expand_sweep(master)
            subdirs = []
            for num, overrides in enumerate(jobs):
                job = loader.load_sweep_config(master, overrides)
                OmegaConf.set_struct(job, False)
                job.hydra.job.num = num
                job.hydra.mode = "MULTIRUN"
                HydraConfig.instance().set_config(job)
                subdirs.append(str(job.hydra.sweep.subdir))
            assert len(set(subdirs)) == len(jobs), name
            assert subdirs[0] == first_names[name], subdirs[:3]
            assert all(re.fullmatch(rf"{num}_[A-Za-z0-9._+-]+_s\d", d) for num, d in enumerate(subdirs)), subdirs
            if name == "boundaries_grid":   # one distinct boundary list per folder name
                assert subdirs[3] == "3_bucketed_b0-216-1024_s0"


# ------------------------------------------------------------------------------------------ the real command line


def _cli(*args, cwd: Path, timeout=180):
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run(
        [sys.executable, "-m", "dflash_lab.train", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.integration
def test_cli_rejects_a_bad_boundary_sweep_before_any_job_runs(tmp_path):
    sweep_dir = tmp_path / "multirun"
    out = _cli(
        "-m", "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}", "sampler=bucketed",
        "sampler.boundaries=[0,96,1024],[0,512,256,1024]", "trainer.max_steps=1",
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert "launch config rejected before submission" in out.stderr
    assert "job #1 (" in out.stderr and "sampler.boundaries=[0, 512, 256, 1024]" in out.stderr
    assert not sweep_dir.exists()  # the sweeper never started: no job, not even the good one


@pytest.mark.integration
def test_cli_rejects_more_tasks_than_gpus_before_submission(tmp_path):
    sweep_dir = tmp_path / "multirun"
    out = _cli(
        "-m", "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}", "hydra.launcher.gpus_per_node=2",
        "hydra.launcher.tasks_per_node=4", "trainer.max_steps=1",
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert "hydra.launcher.tasks_per_node=4 exceeds hydra.launcher.gpus_per_node=2" in out.stderr
    assert not sweep_dir.exists()


@pytest.mark.integration
def test_cli_sweep_file_with_a_bad_override_is_rejected(tmp_path):
    sweep_dir = tmp_path / "multirun"
    out = _cli(
        "-m", "--config-dir", "sweeps", "--config-name", "bucket_count_grid", f"hydra.sweep.dir={sweep_dir}",
        "sampler.num_buckets=0,3",  # replaces the file's K grid (command-line sweeps win over sweeper params)
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert "job #0 (" in out.stderr and "sampler.num_buckets=0" in out.stderr
    assert not sweep_dir.exists()


# ------------------------------------------- issue 31: what a (re)launch of a sweep says before anything runs
def _multirun_config(config_name, overrides):
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    with _hydra_context():
        return GlobalHydra.instance().hydra.compose_config(config_name, list(overrides), run_mode=RunMode.MULTIRUN)


def test_a_short_grid_sweep_is_told_at_launch_that_its_probes_cannot_give_the_forgetting_endpoints():
    from dflash_lab.cluster.launch import launch_probe_warning

    lists = "'sampler.boundaries=[0,96,152,216,304,412,1024],[0,216,1024]'"
    cfg = _multirun_config("boundaries_grid", [lists.strip("'"), "trainer.max_steps=40"])
    section = OmegaConf.to_container(cfg.analysis, resolve=True)
    warning = launch_probe_warning(cfg, section)
    assert warning.startswith("analysis: every run of this sweep (trainer.max_steps=40) probes 1 time(s) in the "
                              "analysis window (steps 11..40 of 40, probes.every=100)"), warning
    assert "residual_amplitude needs 8, own_share_slope needs 8" in warning and "probes.every=4 or less" in warning
    cfg = _multirun_config("boundaries_grid", [lists.strip("'"), "trainer.max_steps=40", "probes.every=4"])
    assert launch_probe_warning(cfg, section) is None
    # the runs' length unknown at launch (epochs) or swept: each run says it before its first step instead
    assert launch_probe_warning(_multirun_config("boundaries_grid", [lists.strip("'")]), section) is None
    swept = _multirun_config("boundaries_grid", [lists.strip("'"), "trainer.max_steps=40,400"])
    assert launch_probe_warning(swept, section) is None


def test_a_relaunch_names_the_kept_protocol_and_the_jobs_that_never_started(tmp_path, caplog):
    import json
    import logging

    from dflash_lab.cluster.launch import record_sweep_protocol

    sweep = tmp_path / "sweep"
    overrides = ["sampler=bucketed", "seed=0,1,2,3", "trainer.max_steps=40", "probes.every=4",
                 f"hydra.sweep.dir={sweep}"]
    cfg = _multirun_config("train", overrides)
    record_sweep_protocol(cfg)
    recorded = (sweep / "protocol.json").read_text()
    for job, status in ((0, "finished"), (1, "preempted")):   # jobs 2 and 3 never started: the sweep was killed
        (sweep / f"{job}_bucketed_s{job}").mkdir()
        (sweep / f"{job}_bucketed_s{job}" / "summary.json").write_text(json.dumps({"status": status}))
    cfg = _multirun_config("train", [*overrides, "+analysis.margins.jumpiness=0.02"])
    with caplog.at_level(logging.INFO, logger="dflash_lab.cluster.launch"):
        record_sweep_protocol(cfg)
    assert (sweep / "protocol.json").read_text() == recorded
    said = caplog.text
    assert "relaunch: protocol.json keeps the first launch's analysis protocol" in said
    assert "analysis.margins={'jumpiness': 0.02} (recorded: {}), which compare will NOT apply" in said
    assert (f"relaunch into {sweep}: 1 of 4 jobs finished (nothing to do); unfinished, continued now: job 1 "
            f"(preempted); never started, run now: job 2 (seed=2); job 3 (seed=3)") in said
