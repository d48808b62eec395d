"""The project as a user installs it: a wheel (and an editable install) in a fresh venv, commands run from an
empty directory, configs and sweeps read from the installed package.

The venvs see the system site-packages (torch and the other dependencies are not downloaded again); nothing is
fetched from a package index: the wheel is built with the installed setuptools (--no-build-isolation) and
installed with --no-index. The tiny target comes from the usual cache (built once by whichever test needs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "dflash_lab" / "model" / "targets"
SOURCES = ("pyproject.toml", "README.md", "dflash_lab", "conf", "conf_plan", "sweeps", "notebooks", "hydra_plugins")
SMALL = [
    "++model.hidden_size=64", "++model.num_layers=2", "++model.num_heads=4", "++model.num_kv_heads=2",
    "++model.intermediate_size=128", "++model.pretrain_steps=20", "++model.pretrain_tokens_per_step=2048",
    "++model.block_size=4", "++data.num_samples=300", "sampler.max_tokens=1024", "trainer.num_threads=1",
    "trainer.progress=false", "trainer.measure_tau=false", "probes.every=0",
]


def _copy_sources(destination: Path) -> Path:
    """The files a wheel is built from, copied (symlinks kept) so the build leaves the checkout untouched."""
    destination.mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, destination / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, destination / name)
    return destination


def _run(args, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the venv's packages
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def _venv(path: Path) -> Path:
    """A venv that sees the packages this test process sees (torch and every other dependency).

    ``--system-site-packages`` gives the base interpreter's site-packages only: when the tests themselves run in a
    venv (a user's ``python -m venv``), its packages would be missing, so a .pth file adds this process's
    site-packages after the new venv's own (a .pth path line adds the directory without running the .pth files in
    it: the checkout's editable install stays out, and the wheel installed here is the one imported). No
    pip/setuptools of its own: the system's (newer) setuptools builds, this interpreter's pip installs."""
    import site
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True,
                   timeout=300)
    outer = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    inner = subprocess.run([path / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    (Path(inner) / "_dflash_lab_test_outer_env.pth").write_text("\n".join(outer) + "\n")
    return path / "bin"


def _pip_install(bin_dir: Path, *args, cwd: Path) -> None:
    _run([sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "-q", "--no-index", "--no-deps",
          "--force-reinstall", *args], cwd)


def _installed_from(bin_dir: Path, cwd: Path) -> Path:
    out = _run([bin_dir / "python", "-c", "import dflash_lab.conf; print(dflash_lab.conf.__file__)"], cwd)
    return Path(out.stdout.strip()).resolve()


def _check_configs(bin_dir: Path, cwd: Path) -> None:
    """train's --help lists only train's groups; a shipped sweep is a primary config from any directory; a
    user's --config-dir extends the shipped configs."""
    groups = _run([bin_dir / "dflash-train", "--help"], cwd).stdout.split("\n== Config (")[0]
    assert "sampler: bucket_sequential, bucketed," in groups and "trainer: cpu" in groups
    assert "cost" not in groups and "lengths" not in groups
    sweep = _run([bin_dir / "dflash-train", "--config-name", "boundaries_grid", "--cfg", "hydra"], cwd).stdout
    assert "[0,96,152,216,304,412,1024]" in sweep and "dflash_lab.cluster.launch.ValidateLaunch" in sweep
    mine = cwd / "my_configs"
    (mine / "sampler").mkdir(parents=True)
    (mine / "my_run.yaml").write_text("defaults:\n  - train\n  - _self_\nexperiment: mine\n")
    (mine / "sampler" / "my_buckets.yaml").write_text("defaults:\n  - bucketed\n  - _self_\n"
                                                      "boundaries: [0, 128, 1024]\n")
    job = _run([bin_dir / "dflash-train", "--config-dir", mine, "--config-name", "my_run", "sampler=my_buckets",
                "--cfg", "job"], cwd).stdout
    assert "experiment: mine" in job and "- 128" in job and "name: bucketed" in job


@pytest.mark.integration
def test_wheel_installs_and_every_command_runs_from_an_empty_directory(tmp_path):
    source = _copy_sources(tmp_path / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
          source], tmp_path)
    (wheel,) = (tmp_path / "dist").glob("dflash_lab-*.whl")
    shipped = _shipped_files()
    with zipfile.ZipFile(wheel) as archive:   # the reference tiny targets travel in the wheel
        assert {f"dflash_lab/model/targets/{name}" for name in shipped} <= set(archive.namelist())
    bin_dir = _venv(tmp_path / "venv")
    _pip_install(bin_dir, wheel, cwd=tmp_path)
    # Every declared requirement is met by this environment (pins not above what the code runs on).
    _run([bin_dir / "python", "-c", (
        "from importlib.metadata import requires, version; from packaging.requirements import Requirement\n"
        "for text in requires('dflash_lab'):\n"
        "    req = Requirement(text)\n"
        "    if req.marker is None or req.marker.evaluate({'extra': ''}):\n"
        "        assert req.specifier.contains(version(req.name), prereleases=True), (text, version(req.name))\n"
    )], tmp_path)

    work = tmp_path / "empty"
    work.mkdir()
    assert tmp_path / "venv" in _installed_from(bin_dir, work).parents  # the wheel's copy, not a checkout
    _check_configs(bin_dir, work)
    notebook = _run([bin_dir / "python", "-c", "from dflash_lab.notebooks import COMPARE_POLICIES as p; "
                     "import json; print(p, len(json.loads(p.read_text())['cells']))"], work).stdout.split()
    assert tmp_path / "venv" in Path(notebook[0]).parents and int(notebook[1]) > 5   # the notebook, in the wheel

    default = _run([bin_dir / "python", "-c", (
        "from dflash_lab.model.build import build_model; from dflash_lab.presets import preset\n"
        "model, _ = build_model(**preset('model', 'tiny'), activation_checkpointing=False)\n"
        "print(model.target_digest, model.target.dflash_meta['source'], model.target.dflash_meta['path'])")],
        work).stdout.split()
    manifest = json.loads((ROOT / "dflash_lab" / "model" / "targets" / "manifest.json").read_text())
    assert default[:2] == [next(e["target_digest"] for e in manifest["targets"] if e["name"] == "tiny_s0"), "shipped"]
    assert tmp_path / "venv" in Path(default[2]).parents   # loaded from the installed package

    _run([bin_dir / "dflash-train", "hydra.run.dir=run", "trainer.max_steps=2", *SMALL], work)
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2

    _run([bin_dir / "dflash-plan", "hydra.run.dir=plan", "data.num_samples=300", "world_size=1", "epochs=1",
          "cost=cpu_tiny"], work)
    assert (work / "plan" / "plan.csv").is_file()

    _run([bin_dir / "dflash-compare", "run", "--out", "comparison", "--no-plots"], work)
    assert (work / "comparison" / "comparison.csv").is_file()

    has_export = _run([bin_dir / "python", "-c", "import importlib.util as u; print(bool(u.find_spec("
                                                 "'dflash_lab.export')))"], work).stdout.strip() == "True"
    if has_export:  # the command is registered in any case; its module is written separately
        assert "usage" in _run([bin_dir / "dflash-export", "--help"], work).stdout.lower()


@pytest.mark.integration
def test_editable_install_reads_the_checkout_configs(tmp_path):
    source = _copy_sources(tmp_path / "src")
    bin_dir = _venv(tmp_path / "venv")
    _pip_install(bin_dir, "--no-build-isolation", "-e", source, cwd=tmp_path)
    work = tmp_path / "empty"
    work.mkdir()
    assert _installed_from(bin_dir, work) == (source / "conf" / "__init__.py").resolve()
    _check_configs(bin_dir, work)


@pytest.mark.integration
def test_checkout_on_pythonpath_runs_from_any_directory(tmp_path):
    # What the test suite itself relies on: PYTHONPATH=<checkout>, any working directory.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "dflash_lab.train", "--config-name", "bucket_count_grid", "--cfg",
                          "job"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "experiment: bucket_count_grid" in out.stdout


def _shipped_files() -> set[str]:
    """manifest.json and every weights file it lists (the reference tiny targets, dflash_lab/model/target.py)."""
    manifest = json.loads((TARGETS / "manifest.json").read_text())
    return {"manifest.json", *(entry["file"] for entry in manifest["targets"])}


def test_the_reference_targets_are_package_data_and_the_files_the_manifest_records():
    import fnmatch
    import hashlib

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "dflash_lab.model"]
    shipped = _shipped_files()
    assert all(any(fnmatch.fnmatch(f"targets/{name}", pattern) for pattern in patterns) for name in shipped)
    manifest = json.loads((TARGETS / "manifest.json").read_text())
    names = {entry["name"] for entry in manifest["targets"]}
    assert {f"tiny_s{seed}" for seed in range(5)} <= names   # the default target and the protocol's five
    for entry in manifest["targets"]:
        assert hashlib.sha256((TARGETS / entry["file"]).read_bytes()).hexdigest() == entry["file_sha256"]
        assert (TARGETS / entry["file"]).stat().st_size < 2 * 1024 * 1024   # small enough to ship


def test_every_imported_third_party_package_is_declared():
    import ast
    from importlib.metadata import packages_distributions

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_normalise(r) for r in project["dependencies"]}
    dev = {_normalise(r) for r in project["optional-dependencies"]["dev"]}
    imported: dict[str, set[str]] = {}
    for folder in ("dflash_lab", "tests", "benchmarks"):
        for file in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                for name in names:
                    imported.setdefault(name.split(".")[0], set()).add(folder)
    distributions = packages_distributions()
    undeclared = []
    for module, folders in sorted(imported.items()):
        # the project's own, the tests' helpers, and the benchmarks' and scripts' modules (imported by each other)
        local = ("dflash_lab", "hydra_plugins", "helpers", "conftest",
                 *(f.stem for folder in ("benchmarks", "scripts") for f in (ROOT / folder).glob("*.py")))
        if module in sys.stdlib_module_names or module in local or module.startswith("test"):
            continue
        names = {_normalise(d) for d in distributions.get(module, [module])}
        allowed = declared if "dflash_lab" in folders else declared | dev  # the package needs runtime deps
        if not names & allowed:
            undeclared.append((module, sorted(folders)))
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def _normalise(requirement: str) -> str:
    name = requirement.split(";")[0]
    for stop in "<>=!~[ ":
        name = name.split(stop)[0]
    return name.strip().lower().replace("_", "-")


def _notebook_loading_cell() -> str:
    notebook = json.loads((ROOT / "notebooks" / "compare_policies.ipynb").read_text())
    return "".join(next(c["source"] for c in notebook["cells"] if "load_runs(" in "".join(c["source"])))


def test_the_notebook_without_runs_names_dflash_runs_and_the_fix(tmp_path, monkeypatch):
    """Its loading cell, run where there is no repository and no runs: a FileNotFoundError naming DFLASH_RUNS and
    how to set it, never a bare AssertionError."""
    from dflash_lab.notebooks import COMPARE_POLICIES

    assert COMPARE_POLICIES == (ROOT / "notebooks" / "compare_policies.ipynb").resolve()
    monkeypatch.chdir(tmp_path)
    for name in ("DFLASH_RUNS", "WANDB_ENTITY", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(FileNotFoundError, match="DFLASH_RUNS is not set .*Set DFLASH_RUNS to a multirun folder"):
        exec(_notebook_loading_cell(), {})
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("DFLASH_RUNS", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="no runs found in .*empty: .*point DFLASH_RUNS"):
        exec(_notebook_loading_cell(), {})
