"""The project's documents stand alone and agree with the code.

* Every `*.md` a document, docstring, comment or config names exists in the repository (files the project writes,
  such as plan.md, and the `--out` target of a command are outputs, not references); nothing points outside it.
* docs/metrics.md holds, verbatim, the formula block of every module that defines a metric.
* docs/workloads.md's length statistics are what `dflash_lab.data.lengths.workload_table` computes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# docs/ablation/ is a sweep's report folder (its README is written from the measured tables): not scanned here.
SOURCES = [
    ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md")),
    *[p for folder in ("dflash_lab", "benchmarks", "hydra_plugins") for p in sorted((ROOT / folder).rglob("*.py"))],
    *[p for folder in ("conf", "conf_plan", "sweeps") for p in sorted((ROOT / folder).rglob("*.yaml"))],
    *sorted((ROOT / "scripts").glob("*.sh")), *sorted((ROOT / "notebooks").glob("*.ipynb")),
]
OUTPUTS = {"plan.md", "comparison.md"}  # written by dflash_lab.plan and dflash_lab.compare
MD_REFERENCE = re.compile(r"(?P<out>--out\s+)?(?P<path>[\w./-]*\w\.md)\b")
OUTSIDE = re.compile(r"\.\./shared|/work/|shared/design")
FORMULA_MODULES = ("dflash_lab/metrics/throughput.py", "dflash_lab/metrics/diversity.py",
                   "dflash_lab/metrics/jumpiness.py", "dflash_lab/metrics/forgetting.py",
                   "dflash_lab/metrics/draft_quality.py", "dflash_lab/analysis/budgets.py",
                   "dflash_lab/analysis/paired.py", "dflash_lab/plan.py")


def _resolves(reference: str, source: Path) -> bool:
    return any((base / reference).exists() for base in (ROOT, ROOT / "docs", source.parent))


def test_every_referenced_document_exists_and_nothing_points_outside_the_repository():
    missing, outside = [], []
    for source in SOURCES:
        text = source.read_text()
        for match in MD_REFERENCE.finditer(text):
            reference = match["path"]
            if match["out"] or Path(reference).name in OUTPUTS or _resolves(reference, source):
                continue
            missing.append(f"{source.relative_to(ROOT)}: {reference}")
        outside += [f"{source.relative_to(ROOT)}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not missing, f"references to documents that are not in the repository: {missing}"
    assert not outside, f"references outside the repository: {outside}"


def _normalised(text: str) -> str:
    return " ".join(text.split())


def formula_blocks(module: str) -> list[str]:
    """The indented runs of a module docstring (its formula blocks), whitespace-normalised."""
    doc = ast.get_docstring(ast.parse((ROOT / module).read_text()), clean=False) or ""
    blocks, current = [], []
    for line in [*doc.splitlines(), ""]:
        if line.startswith("    ") and not line.lstrip().startswith(">>>"):
            current.append(line)
        elif current:
            blocks.append(_normalised("\n".join(current)))
            current = []
    return blocks


@pytest.mark.parametrize("module", FORMULA_MODULES)
def test_docs_metrics_holds_each_module_formula_block_verbatim(module):
    blocks = formula_blocks(module)
    assert blocks, f"{module}: no indented formula block in its docstring"
    page = _normalised((ROOT / "docs" / "metrics.md").read_text())
    for block in blocks:
        assert block in page, f"docs/metrics.md lacks (or differs from) this block of {module}:\n{block}"


def test_docs_workloads_table_is_what_the_generator_gives():
    from dflash_lab.data.lengths import WORKLOADS, workload_table

    page = (ROOT / "docs" / "workloads.md").read_text()
    assert workload_table() in page
    assert all(f"| `{name}` |" in page for name in WORKLOADS)
