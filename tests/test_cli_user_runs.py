"""What users run, through the real command line: a W&B offline boundary sweep read back by the project's W&B
reader, `compare` and the notebook on that sweep (local run directories and W&B runs), and a run killed with
SIGKILL whose metrics.jsonl keeps every logged row and whose next launch resumes cleanly.

The sweep is the shipped `sweeps/boundaries_grid.yaml` with three boundary lists given on the command line and the
tiny training settings of test_train_e2e (6 steps per run, ~7 s each on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf, open_dict
from helpers import SMALL

from dflash_lab import compare
from dflash_lab.analysis import compare_records, load_offline_runs, load_runs
from dflash_lab.analysis.wandb_runs import OfflineRun
from dflash_lab.records.run_names import swept_keys

ROOT = Path(__file__).resolve().parents[1]
GRID = ([0, 216, 1024], [0, 96, 304, 1024], [0, 96, 216, 412, 1024])
BANDS = [0, 96, 152, 216, 304, 412, 1024]  # probes.bands of conf/train.yaml


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_ENTITY", None)
    env.pop("WANDB_PROJECT", None)
    return env


def _text(boundaries: list[int]) -> str:
    return "[" + ",".join(map(str, boundaries)) + "]"


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Path:
    """`python -m dflash_lab.train -m --config-dir sweeps --config-name boundaries_grid logger=wandb
    sampler.boundaries=[...],[...],[...]`: three runs, each with its local files and an offline W&B run."""
    sweep_dir = tmp_path_factory.mktemp("boundaries_grid") / "2026-01-01_00-00-00"
    command = [sys.executable, "-m", "dflash_lab.train", "-m", "--config-dir", "sweeps", "--config-name",
               "boundaries_grid", "logger=wandb", "sampler.boundaries=" + ",".join(map(_text, GRID)), *SMALL,
               "trainer.max_steps=6", "probes.every=3", "trainer.measure_tau=false", f"hydra.sweep.dir={sweep_dir}"]
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    deadline = time.monotonic() + 30  # wandb-core may still be flushing the last block of an offline log
    while not all(OfflineRun(path).complete for path in OfflineRun.find(sweep_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return sweep_dir


@pytest.fixture(scope="module")
def wandb_folder(grid, tmp_path_factory) -> Path:
    """The sweep's offline W&B runs on their own, as `wandb sync` or a download would leave them."""
    folder = tmp_path_factory.mktemp("wandb_runs")
    for run_dir in sorted(grid.glob("*_bucketed_b*_s0")):   # <job#>_bucketed_b<boundaries>_s0
        shutil.copytree(run_dir / "wandb", folder / run_dir.name, symlinks=True)  # latest-run stays a link
    return folder


@pytest.mark.integration
def test_a_wandb_sweep_reads_back_with_names_group_axes_and_final_figures(grid):
    report = load_offline_runs(grid)
    assert report.problems == [] and len(report.runs) == len(GRID)
    by_name = {record.name: record for record in report.runs}
    # one run per grid point, named by what the sweep varies; one group for the launch
    assert set(by_name) == {f"sampler.boundaries={_text(b)}" for b in GRID}
    assert {record.group for record in report.runs} == {f"boundaries_grid/{grid.name}"}
    for boundaries in GRID:
        record = by_name[f"sampler.boundaries={_text(boundaries)}"]
        local = json.loads((Path(record.location).parents[1] / "summary.json").read_text())
        # the resolved boundaries and K as scalars in the run config, the Hydra overrides beside them
        assert record.config["resolved"]["boundaries"] == str(boundaries)
        assert record.config["resolved"]["num_buckets"] == len(boundaries) - 1
        assert record.config["sampler"]["boundaries"] == boundaries
        assert f"sampler.boundaries={_text(boundaries)}" in record.overrides
        # final figures under final/*, read back as the run's summary (never the last per-step value)
        run = OfflineRun(record.location)
        assert run.complete and run.summary["final/status"] == "finished"
        assert run.summary["final/ktok_s"] == local["ktok_s"] and record.summary["ktok_s"] == local["ktok_s"]
        assert record.status == "finished" and record.summary["final_loss"] == local["final_loss"]
        # a cumulative tokens_seen axis beside step, on every train/* row
        history = run.history()
        steps = history[history["train/loss"].notna()]
        assert steps["step"].tolist() == list(range(1, 7))
        assert steps["tokens_seen"].tolist() == steps["train/real_tokens"].cumsum().tolist()
        # probe/<lo>-<hi>/* keys named by the band's length range
        probe_keys = {c for c in history.columns if c.startswith("probe/")}
        assert probe_keys == {f"probe/{lo}-{hi}/{f}" for lo, hi in zip(BANDS, BANDS[1:]) for f in ("loss", "acc")}
        assert record.probes["step"].unique().tolist() == [0, 3, 6]
        assert record.probes[["band_lo", "band_hi"]].drop_duplicates().values.tolist() == [
            [lo, hi] for lo, hi in zip(BANDS, BANDS[1:])]


@pytest.mark.integration
def test_compare_on_a_boundaries_grid_gives_one_row_per_boundary_list(grid, wandb_folder, tmp_path):
    out = tmp_path / "refused"   # offline W&B runs are read only when asked: the hint names the option
    assert compare.main([str(wandb_folder), "--out", str(out), "--no-plots"]) == 1
    for source, extra in ((grid, []), (wandb_folder, ["--no-plots", "--offline-wandb"])):  # run dirs, then W&B runs
        out = tmp_path / source.name
        assert compare.main([str(source), "--out", str(out), *extra]) == 0
        groups = pd.read_csv(out / "comparison_groups.csv")
        assert groups["boundaries"].tolist() == [str(b) for b in GRID]
        assert groups["K"].tolist() == [len(b) - 1 for b in GRID]
        assert (groups["n_runs"] == 1).all() and groups["ktok_s_mean"].gt(0).all()
    assert (tmp_path / grid.name / "tradeoff.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.integration
def test_the_notebook_reads_a_wandb_sweep_as_a_sweep(wandb_folder, tmp_path, monkeypatch):
    """The notebook executed (nbclient, as nbmake runs it) on the W&B runs: one settings row per boundary list."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("DFLASH_RUNS", str(wandb_folder))
    monkeypatch.delenv("DFLASH_OFFLINE_WANDB", raising=False)   # issue 31: found without it
    monkeypatch.setenv("DFLASH_NOTEBOOK_FIGURES", str(tmp_path / "figures"))
    for name, value in _env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    notebook = nbformat.read(ROOT / "notebooks" / "compare_policies.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    loaded = "".join(output.get("text", "") for output in code[0].outputs)
    assert f"read offline W&B runs from their .wandb logs ({wandb_folder} holds no run directory)" in loaded
    assert f"{len(GRID)} runs from {wandb_folder} in {len(GRID)} settings; 0 partial" in loaded
    settings = code[1].outputs[0]["data"]["text/plain"]
    assert all(str(b) in settings for b in GRID) and re.search(r"\bK\b", settings)
    assert (tmp_path / "figures" / "tradeoff.png").is_file()


class CountingApi:
    """`wandb.Api` over the sweep's offline runs, counting every history and file fetch per run."""

    def __init__(self, folder: Path):
        self.runs_given = [OfflineRun(path) for path in OfflineRun.find(folder)]
        self.fetches = {(run.id, method): 0 for run in self.runs_given for method in ("history", "files")}
        for run_id, method in self.fetches:
            run = next(r for r in self.runs_given if r.id == run_id)
            setattr(run, method, self._counted(run_id, method, getattr(run, method)))

    def _counted(self, run_id, method, original):
        def fetch(*args, **kwargs):
            self.fetches[run_id, method] += 1
            return original(*args, **kwargs)
        return fetch

    def runs(self, path, filters=None):
        return list(self.runs_given)


@pytest.mark.integration
def test_the_notebook_fetches_each_wandb_run_once(wandb_folder):
    """The notebook's one `load_runs(wandb=...)` call fetches each run's history and files once; everything after
    works on the loaded records."""
    notebook = json.loads((ROOT / "notebooks" / "compare_policies.ipynb").read_text())
    source = "\n".join("".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code")
    assert source.count("load_runs(wandb=") == 1
    assert not re.search(r"wandb\.Api|\.history\(|scan_history|\.files\(", source)
    api = CountingApi(wandb_folder)
    report = load_runs(wandb="me/dflash_lab", group=None, api=api)
    compare_records(report.runs)
    assert len(report.runs) == len(GRID) and set(api.fetches.values()) == {1}, api.fetches


def test_swept_keys_come_from_the_launch_command_and_the_sweep_file(tmp_path):
    (tmp_path / "multirun.yaml").write_text(OmegaConf.to_yaml({"hydra": {"overrides": {"task": [
        "sampler.boundaries=[0,96,1024],[0,1024]", "++data.num_samples=300", "seed=range(2)", "+x=choice(1,2)"]}}}))
    hydra_cfg = OmegaConf.create({"sweep": {"dir": str(tmp_path)},
                                  "sweeper": {"params": {"sampler.num_buckets": "2,4", "+trainer.lr": "1e-3,3e-3"}}})
    assert swept_keys(hydra_cfg) == {"sampler.boundaries", "seed", "x", "sampler.num_buckets", "trainer.lr"}
    hydra_cfg.sweep.dir = str(tmp_path / "no_launch_file")
    assert swept_keys(hydra_cfg) == {"sampler.num_buckets", "trainer.lr"}


def test_fitted_boundaries_of_a_wandb_run_come_from_its_resolved_config():
    """A num_buckets sweep logged to W&B: the config holds no list (boundaries: null), the trainer's resolved one
    (a string in the W&B config) is what the boundaries column shows."""
    from dflash_lab.analysis.arms import bucket_columns, sweep_of
    from dflash_lab.analysis.schema import RunRecord

    records = [RunRecord(f"k{k}", "wandb", "x", config={
        "sampler": {"name": "bucketed", "boundaries": None, "num_buckets": k}, "seed": 0,
        "resolved": {"boundaries": str(fitted), "num_buckets": k, "steps_per_epoch": 100 + k}},
        overrides=[f"sampler.num_buckets={k}", "seed=0"])
        for k, fitted in ((2, [0, 200, 1024]), (3, [0, 90, 300, 1024]))]
    sweep = sweep_of(records)
    assert sweep.keys == ["sampler", "sampler.num_buckets"]  # the resolved facts are not settings
    assert bucket_columns(records, sweep).to_dict("records") == [
        {"boundaries": "[0, 200, 1024]", "K": 2}, {"boundaries": "[0, 90, 300, 1024]", "K": 3}]


@pytest.mark.integration
def test_train_help_lists_the_own_data_path_and_every_key_of_data_jsonl_and_model_hf():
    """`python -m dflash_lab.train --help` (the code behind `dflash-train --help`): the config groups with their
    options, the own-data command, and every key of conf/data/jsonl.yaml and conf/model/hf.yaml by name."""
    result = subprocess.run([sys.executable, "-m", "dflash_lab.train", "--help"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    groups = dict(line.split(": ", 1) for line in text.splitlines() if re.fullmatch(r"\w+: [\w, ]+", line))
    assert "jsonl" in groups["data"].split(", ") and "hf" in groups["model"].split(", ")
    assert "model=hf model.target_path=" in text and "data=jsonl data.path=" in text
    own_data = text.split("== Your data, your target ==")[1].split("== Config")[0]
    for name, group in (("jsonl", "data"), ("hf", "model")):
        keys = set(OmegaConf.load(ROOT / "conf" / group / f"{name}.yaml")) - {"kind"}
        entry = re.search(rf"^{group}={name}  .*?(?=^\S|\Z)", own_data, re.M | re.S)   # its indented block
        assert entry, f"--help has no {group}={name} entry"
        listed = entry.group(0).split("keys:")[1]
        missing = sorted(k for k in keys if not re.search(rf"\b{k}\b", listed))
        assert not missing, f"--help lists no {missing} for {group}={name}: update conf/hydra/help/train.yaml"


@pytest.mark.integration
def test_sweep_run_folders_are_named_by_the_boundary_list(grid):
    names = sorted((p.name for p in grid.iterdir() if p.is_dir() and p.name[0].isdigit()), key=lambda n: int(n[0]))
    assert names == [f"{i}_bucketed_b{'-'.join(map(str, b))}_s0" for i, b in enumerate(GRID)]


def _wandb_name(overrides: list[str]) -> str:
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig

    from dflash_lab.records.run_names import name_wandb_run

    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["logger=wandb", *overrides], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]   # the job's config, as the task function receives it
    name_wandb_run(cfg)
    return cfg.logger.name


def test_a_single_runs_wandb_name_is_short_and_drops_paths():
    long_dir = "/scratch/" + "very_long_directory_name/" * 8
    name = _wandb_name([f"run_dir={long_dir}run", "data=jsonl", f"data.path={long_dir}chats.jsonl",
                        "model=hf", f"model.target_path={long_dir}Qwen3-8B", "sampler=packed", "seed=3"])
    assert name == "logger=wandb,data=jsonl,model=hf,sampler=packed,seed=3"
    many = ["trainer.lr=0.0010", "probes.per_band=3", "sampler.max_tokens=8192", "trainer.max_steps=12345",
            "sampler.boundaries=[0,64,96,128,152,184,216,256,304,352,412,512,768,1024]", "probes.every=25", "seed=7"]
    capped = _wandb_name(many)
    assert len(capped) == 96 and re.fullmatch(r".+~[0-9a-f]{6}", capped) and capped.startswith("logger=wandb,")
    assert capped == _wandb_name(many) != _wandb_name([*many[:-1], "seed=8"])   # stable, and distinct when cut
