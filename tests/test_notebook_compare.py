"""End to end on REAL training runs: a small 3-policy x 2-seed CPU multirun trained with `python -m dflash_lab.train`
through sweeps/ablation_policies.yaml, then `python -m dflash_lab.compare` on it, then the notebook executed with
nbmake against it.

The multirun is written to a temporary folder (never into the checkout) and handed to the notebook through
DFLASH_RUNS. By hand: `DFLASH_RUNS=<multirun> pytest --nbmake notebooks/`.
"""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dflash_lab.analysis import find_run_dirs
from dflash_lab.analysis.schema import COMPARISON_COLUMNS
from dflash_lab.analysis.summarize import explains

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("bucketed", "full_random", "packed")
SEEDS = (0, 1)
# Small enough for CI on 2 cores, with margin for every comparison column of a shuffled order wherever the steady
# state starts. The probe dynamics use the evals from the training loss's steady-state start on: amplitude and
# own-share slope need 8, the cross effect with 6 bands 11 (forgetting.cross_band_min_evals). That start follows the
# loss EMA's lag after the early drop, ~30 steps on the fastest policy, packed (20 steps per epoch at a 2048-token
# budget, which doubles the steps for the same tokens), and moves from machine to machine: 3 epochs with probes
# every 3 steps left packed exactly 11 evals, and a machine whose start came a few steps later had a NaN cross
# effect. 4 epochs (80 packed steps; every example presented 4 times: forgetting events need 3) with probes every 2
# steps: the start measured at step 32 leaves 25 evals, and the cross effect keeps 1.5 x 11 = 17 for a start as late
# as step 48 (amplitude and slope 1.5 x 8 = 12 until step 58); spike score needs >= 33 steps. Cost: ~1.3 x the
# training steps and ~2 x the (cheap, 2 examples per band) probe evals of the 3-epoch setting; setup and tau are
# unchanged (a short tau measurement).
TRAIN_OVERRIDES = (
    "data.num_samples=160",
    "sampler.max_tokens=2048",
    "trainer.epochs=4",
    "probes.every=2",
    "probes.per_band=2",
    "model.decode_num_prompts=4",  # tau: 16 prompts x 64 tokens would cost more than the training itself
    "model.decode_max_new_tokens=16",
    "trainer.progress=false",
    "trainer.ckpt_every=0",
)
ABLATION_POLICIES = ("sorted_static", "full_random", "bucketed", "packed", "bucketed_megabatch")


def _env() -> dict:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    env.pop("WANDB_ENTITY", None)
    env.pop("WANDB_PROJECT", None)
    return env


@pytest.fixture(scope="module")
def trained_multirun(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("notebook") / "multirun"
    command = [
        sys.executable, "-m", "dflash_lab.train", "-m", "--config-dir", "sweeps", "--config-name", "ablation_policies",
        f"sampler={','.join(POLICIES)}", f"seed={','.join(map(str, SEEDS))}", *TRAIN_OVERRIDES,
        f"hydra.sweep.dir={runs}",
    ]
    result = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=3000)
    assert result.returncode == 0, f"multirun failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return runs


@pytest.mark.integration
def test_multirun_holds_one_finished_run_per_policy_and_seed(trained_multirun):
    runs = find_run_dirs(trained_multirun)
    assert len(runs) == len(POLICIES) * len(SEEDS)
    for run in runs:
        for name in ("metrics.jsonl", "probes.jsonl", "presentations.parquet", "summary.json", ".hydra/config.yaml"):
            assert (run / name).is_file(), f"{run.name} lacks {name}"


@pytest.mark.integration
def test_compare_fills_every_column_on_real_runs(trained_multirun, tmp_path):
    out = tmp_path / "comparison"
    result = subprocess.run(
        [sys.executable, "-m", "dflash_lab.compare", str(trained_multirun), "--out", str(out),
         "--baseline", "full_random"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    runs = pd.read_csv(out / "comparison.csv")
    assert sorted(runs["sampler"].unique()) == sorted(POLICIES)
    assert sorted(runs["seed"].unique()) == list(SEEDS)
    assert not runs["partial"].any(), runs[["run_id", "status", "notes"]].to_string()
    periodic_only = {"loop_score"}  # every policy here shuffles its order: no period, no loop score
    assert runs["loop_score"].isna().all() and runs["order_period_steps"].isna().all()
    # a NaN cell is accepted only with its documented reason: the run's notes name the column (analyse_run)
    notes = runs["notes"].map(lambda text: text if isinstance(text, str) else "")  # an empty column reads as NaN
    silent = {c: runs.loc[runs[c].isna() & ~notes.map(lambda text, c=c: explains(text, c)), "run_id"].tolist()
              for c in COMPARISON_COLUMNS if c not in periodic_only}
    silent = {c: ids for c, ids in silent.items() if ids}
    assert not silent, f"NaN comparison columns without a reason in the notes {silent}; notes: {notes.tolist()}"
    for name in ("comparison.md", "comparison_groups.csv", "paired.csv", "loss_curves.png", "band_accuracy.png",
                 "metric_bars.png", "tradeoff.png", "equal_compute.png", "bands.csv", "cross_effects.csv"):
        assert (out / name).is_file(), name
    # throughput figures are the trainer's (summary.json), computed with metrics.throughput
    assert (runs["pad_eff"] > 0).all() and (runs["pad_eff"] <= 1).all()
    packed = runs[runs["sampler"] == "packed"]["pad_eff"]
    full_random = runs[runs["sampler"] == "full_random"]["pad_eff"]
    assert packed.mean() > full_random.mean()  # packing leaves no padding inside rows; random batches pad a lot
    groups = pd.read_csv(out / "comparison_groups.csv", index_col="arm")
    assert sorted(groups.index) == sorted(POLICIES) and (groups["n_runs"] == len(SEEDS)).all()
    paired = pd.read_csv(out / "paired.csv")
    assert list(paired.columns[:8]) == ["policy", "endpoint", "diff", "ci_low", "ci_high", "p_value", "p_holm",
                                        "verdict"]
    assert set(paired["policy"]) == {"bucketed", "packed"} and (paired["n_pairs"] == len(SEEDS)).all()
    assert "## Per setting" in result.stdout and "## Paired differences" in result.stdout


@pytest.mark.integration
def test_notebook_executes_under_nbmake_against_the_multirun(trained_multirun, tmp_path):
    env = _env() | {"DFLASH_RUNS": str(trained_multirun), "DFLASH_NOTEBOOK_FIGURES": str(tmp_path / "figures"),
                    "DFLASH_BASELINE": "full_random"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "--nbmake", "--nbmake-timeout=600",
         "notebooks/compare_policies.ipynb"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert (tmp_path / "figures" / "tradeoff.png").is_file()
    assert (tmp_path / "figures" / "equal_compute.png").is_file()


def test_ablation_sweep_composes_every_policy_with_train_yaml():
    """sweeps/ablation_policies.yaml, as `--config-dir sweeps --config-name ablation_policies` loads it: the 5 x 3
    grid, and each sweep point composes with conf/train.yaml (the search path order of that command is mirrored)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module("dflash_lab.conf", version_base="1.3"):  # the shipped sweeps are on its path
        base = ["hydra.job.num=0", "hydra.runtime.output_dir=/tmp/unused"]
        cfg = compose(config_name="ablation_policies", overrides=base, return_hydra_config=True)
        params = cfg.hydra.sweeper.params
        assert tuple(params["sampler"].split(",")) == ABLATION_POLICIES
        assert params["seed"] == "0,1,2"
        for policy in ABLATION_POLICIES:
            point = compose(config_name="ablation_policies", overrides=[*base, f"sampler={policy}", "seed=2"])
            assert point.sampler.name == policy and point.seed == 2
            assert point.experiment == "ablation_policies"
            assert point.trainer.epochs == 2 and point.data.num_samples == 1000 and point.probes.every == 10


def test_forgetting_sweep_composes_every_arm_and_declares_its_protocol():
    """sweeps/forgetting_ablation.yaml: 9 arm files x 5 seeds; every arm composes into the sampler and data it names,
    every arm runs the same optimizer steps, and the declared protocol (baseline, margins, verdict roles) is valid."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from dflash_lab.analysis.protocol import protocol_from_section

    expected = {
        "aligned_full_random": ("full_random", "aligned"),
        "aligned_full_random_equal_tokens": ("full_random", "aligned"),
        "aligned_bucketed": ("bucketed", "aligned"), "aligned_bucketed_run8": ("bucketed", "aligned"),
        "aligned_bucketed_megabatch": ("bucketed_megabatch", "aligned"),
        "aligned_bucket_sequential": ("bucket_sequential", "aligned"),
        "independent_full_random": ("full_random", "independent"), "independent_bucketed": ("bucketed", "independent"),
        "independent_bucket_sequential": ("bucket_sequential", "independent"),
    }
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        base = ["hydra.job.num=0", "hydra.runtime.output_dir=/tmp/unused"]
        cfg = compose(config_name="forgetting_ablation", overrides=base, return_hydra_config=True)
        params = cfg.hydra.sweeper.params
        assert params["+arm"].split(",") == list(expected) and params["seed"].split(",") == list("01234")
        for arm, (sampler, skills) in expected.items():
            point = compose(config_name="forgetting_ablation", overrides=[f"+arm={arm}", "seed=3"])
            assert (point.sampler.name, point.data.band_skills, point.seed) == (sampler, skills, 3), arm
            assert point.trainer.max_steps == 390 and point.probes.per_band >= 24
        run8 = compose(config_name="forgetting_ablation", overrides=["+arm=aligned_bucketed_run8"])
        assert run8.sampler.run_length == 8
        protocol = protocol_from_section(OmegaConf.to_container(point.analysis, resolve=True))
        assert protocol.verdict["positive_control"] == "sampler=bucket_sequential,data.band_skills=aligned"
        assert protocol.margins["residual_amplitude"] == 0.01
