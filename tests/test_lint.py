"""The code passes the project's ruff configuration (``[tool.ruff]`` in pyproject.toml): part of the unit tier."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes_with_the_projects_configuration():
    try:
        import ruff  # noqa: F401  (installed with the dev extra; the module locates its binary)
        command = [sys.executable, "-m", "ruff"]
    except ImportError:
        if shutil.which("ruff") is None:
            pytest.skip("ruff is not installed (pip install -e '.[dev]')")
        command = ["ruff"]
    result = subprocess.run([*command, "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
