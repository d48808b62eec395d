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


# ---- issue 31: one measured time per README command, in one place ------------------------------------------------
# The commands of README.md's time table, as other texts name them, and a duration as they would state it.
TIMED_COMMANDS = re.compile(r"scripts/setup\.sh|scripts/test\.sh|dflash_lab\.train sampler=bucketed|"
                            r"dflash_lab\.train trainer=cpu|\bdefault (?:cpu )?(?:run|training)\b|\bunit tier\b|"
                            r"plain `pytest`|\bfirst time\b", re.IGNORECASE)
DURATION = re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|secs?|seconds?|mins?|minutes?|h|hours?)\b|"
                      r"\b(?:a|one|few|several)\s+minutes?\b|\bminutes\b", re.IGNORECASE)


def _prose(path: Path) -> str:
    """The text a reader sees of a file: a Python file's docstrings and comments, other files whole."""
    import io
    import tokenize

    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".py":
        return text
    docstrings = [ast.get_docstring(node) or "" for node in ast.walk(ast.parse(text))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    comments = [token.string for token in tokenize.generate_tokens(io.StringIO(text).readline)
                if token.type == tokenize.COMMENT]
    return "\n\n".join(docstrings + ["\n".join(comments)])


def readme_time_statements(path: Path) -> list[str]:
    """Sentences of ``path`` that state a duration for a command of README.md's time table without pointing at
    README.md (line breaks and comment markers joined, so a sentence over several comment lines is one)."""
    flat = re.sub(r"\n[ \t]*(?:#+[ \t]*)?", " ", _prose(path))
    return [sentence.strip() for sentence in re.split(r"(?<=[.;!?])\s+|\s{2,}-\s", flat)
            if TIMED_COMMANDS.search(sentence) and DURATION.search(sentence) and "README" not in sentence]


def test_the_readme_table_is_the_one_place_that_times_its_commands():
    """README.md's table (the machine it was measured on above it) gives each command's time; any other file that
    states one (a config header's "~5 min", a docstring's "a few minutes") would disagree with it sooner or later."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Two commands on a fresh machine", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"measured .* on ", section), "the table says which machine its times were measured on"
    for command in ("bash scripts/setup.sh", "python -m dflash_lab.train sampler=bucketed", "pytest",
                    "bash scripts/test.sh"):
        row = next(line for line in section.splitlines() if line.startswith(f"| `{command}`"))
        assert DURATION.search(row.rsplit("|", 2)[-2]), row
    others = [p for p in SOURCES if p.name != "README.md"] + sorted((ROOT / "tests").glob("*.py"))
    stated = {str(p.relative_to(ROOT)): found for p in others if (found := readme_time_statements(p))}
    assert not stated, f"times of README commands stated outside README.md's table: {stated}"


def test_the_time_statement_finder_finds_them():
    import tempfile

    folder = Path(tempfile.mkdtemp())
    examples = {"a.yaml": "# python -m dflash_lab.train sampler=bucketed          (CPU, tiny target, ~5 min)\n",
                "b.py": '"""Runs the default\ntraining on the CPU (a few minutes on 2 cores)."""\n',
                "c.sh": "# The unit tier alone: plain `pytest` (about 1.5 minutes).\n",
                "d.md": "The default run: its time is in README.md's table (2 minutes here).\n"}
    for name, text in examples.items():
        (folder / name).write_text(text)
    assert [bool(readme_time_statements(folder / name)) for name in sorted(examples)] == [True, True, True, False]


def test_the_slowest_first_order_names_test_modules_that_exist():
    """tests/conftest.py's SLOWEST_FIRST: a renamed module would silently lose its place at the front."""
    from conftest import SLOWEST_FIRST

    missing = [name for name in SLOWEST_FIRST if not (ROOT / "tests" / name).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_FIRST names no such module: {missing}"
    assert list(SLOWEST_FIRST.values()) == sorted(SLOWEST_FIRST.values(), reverse=True)
