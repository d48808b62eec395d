"""scripts/gpu_deps.py (what scripts/gpu_check.sh installs from wheelhouse/ before anything imports the project) and
the GPU path's imports on an image without omegaconf, W&B or submitit."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gpu_deps(monkeypatch):
    """scripts/gpu_deps.py as a module, its module tables copied so a test may add to them."""
    spec = importlib.util.spec_from_file_location("gpu_deps", ROOT / "scripts" / "gpu_deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "REQUIRED", dict(module.REQUIRED))
    monkeypatch.setattr(module, "WHEELHOUSE_MODULES", dict(module.WHEELHOUSE_MODULES))
    return module


def _require(gpu_deps, module: str, distribution: str) -> None:
    gpu_deps.WHEELHOUSE_MODULES[module] = distribution
    gpu_deps.REQUIRED[module] = distribution


def test_wheel_names_give_normalised_distributions(gpu_deps):
    assert gpu_deps.wheel_distribution(Path("hydra_core-1.3.8-py3-none-any.whl")) == "hydra-core"
    assert gpu_deps.wheel_distribution(Path("antlr4_python3_runtime-4.9.3-py3-none-any.whl")) == \
        "antlr4-python3-runtime"
    assert gpu_deps.wheel_distribution(Path("PyYAML-6.0.3-cp312-cp312-manylinux2014_x86_64.whl")) == "pyyaml"


def test_present_modules_install_nothing(gpu_deps, tmp_path, capsys):
    assert gpu_deps.main(["--wheelhouse", str(tmp_path / "none"), "--target", str(tmp_path / "deps")]) == 0
    assert not (tmp_path / "deps").exists() and "every required module is present" in capsys.readouterr().err


def test_a_missing_module_without_a_wheelhouse_fails_at_once_naming_it_and_the_fix(gpu_deps, tmp_path, capsys):
    _require(gpu_deps, "dflash_probe_absent", "dflash-probe-absent")
    assert gpu_deps.main(["--wheelhouse", str(tmp_path / "wheelhouse"), "--target", str(tmp_path / "deps")]) == 2
    message = capsys.readouterr().err
    assert "dflash-probe-absent (from the wheelhouse)" in message and "holds no wheels" in message
    assert "bash scripts/gpu_wheelhouse.sh" in message and message.count("\n") == 1


@pytest.mark.integration
def test_installs_only_what_is_missing_from_the_wheelhouse_with_no_index(gpu_deps, tmp_path, capsys):
    """A real wheel (built here from a one-module project, no index) is installed into the target; a second run
    finds it there and installs nothing."""
    project = tmp_path / "project"
    (project / "dflash_probe_pkg").mkdir(parents=True)
    (project / "dflash_probe_pkg" / "__init__.py").write_text("VALUE = 7\n")
    (project / "pyproject.toml").write_text('[project]\nname = "dflash-probe-pkg"\nversion = "1.0"\n'
                                            '[build-system]\nrequires = ["setuptools"]\n'
                                            'build-backend = "setuptools.build_meta"\n')
    wheelhouse = tmp_path / "wheelhouse"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--wheel-dir", str(wheelhouse), str(project)], check=True)
    _require(gpu_deps, "dflash_probe_pkg", "dflash-probe-pkg")
    target = tmp_path / "deps"
    assert gpu_deps.main(["--wheelhouse", str(wheelhouse), "--target", str(target)]) == 0
    assert "installed dflash_probe_pkg-1.0" in capsys.readouterr().err
    assert (target / "dflash_probe_pkg" / "__init__.py").exists()
    assert gpu_deps.main(["--wheelhouse", str(wheelhouse), "--target", str(target)]) == 0
    assert "every required module is present" in capsys.readouterr().err


# None in sys.modules: ``import omegaconf`` raises ModuleNotFoundError and ``importlib.util.find_spec`` says absent,
# as on the GPU image
BLOCK_IMPORTS = """
import sys
BLOCKED = ("omegaconf", "hydra", "antlr4", "wandb", "submitit")
for name in BLOCKED:
    sys.modules[name] = None
"""


@pytest.mark.integration
def test_the_gpu_path_imports_without_omegaconf_wandb_or_submitit():
    """What the lent image runs before gpu_deps has installed anything, and what needs none of them after."""
    code = BLOCK_IMPORTS + (
        "import dflash_lab.model.attention, dflash_lab.model.head, dflash_lab.model.footprint, dflash_lab.model\n"
        "import dflash_lab.sampling, dflash_lab.data, dflash_lab.training.dist, dflash_lab.metrics.throughput\n"
        "assert not [m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in BLOCKED]\n"
        "print('imported')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-2000:]
