"""The package's import structure: no cycle between its top-level parts (subpackages and root modules), counting
every import in a module, the ones inside functions included (a lazy import is still a dependency)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_lab"


def _part_of(module_path: Path) -> str:
    relative = module_path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def _imported_parts(path: Path) -> set[str]:
    """Top-level dflash_lab parts a module imports (absolute ``dflash_lab.x`` and relative ``..x`` imports)."""
    tree = ast.parse(path.read_text())
    depth_of_file = len(path.relative_to(PACKAGE).parts) - 1   # 0 for dflash_lab/x.py, 1 for dflash_lab/pkg/x.py
    parts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: climb to the package root, then down
                if node.level - 1 > depth_of_file:
                    continue
                base = list(path.relative_to(PACKAGE).parts[:-1])[: depth_of_file - (node.level - 1)]
                module = [*base, *(node.module.split(".") if node.module else [])]
                if module:
                    parts.add(module[0])
                else:
                    parts.update(alias.name for alias in node.names)
                continue
            names = [node.module or ""]
        else:
            continue
        for name in names:
            pieces = name.split(".")
            if pieces[0] == "dflash_lab" and len(pieces) > 1:
                parts.add(pieces[1])
    return parts


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if any(p in ("conf", "conf_plan", "sweeps", "notebooks") for p in path.relative_to(PACKAGE).parts):
            continue
        part = _part_of(path)
        if part == "__init__":
            continue
        edges = graph.setdefault(part, set())
        edges.update(p for p in _imported_parts(path) if p not in (part, "__init__"))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_metrics_never_import_sampling():
    assert "sampling" not in package_graph()["metrics"]


def test_the_record_layer_sits_below_the_model_and_data():
    """A run's records (dflash_lab/records/) import nothing of the training run, the model, the data or the policies:
    analysis and tools read run directories without building any of them."""
    above = {"training", "train", "model", "data", "sampling", "analysis", "plan", "planning", "cluster"}
    assert not package_graph()["records"] & above, package_graph()["records"]


def test_the_training_runs_modules_import_nothing_of_the_analysis():
    """training/ builds and runs one training run; the analysis reads what runs recorded (and says, through the
    program dflash_lab/train.py, what a run's size lets it measure): no module of training/ imports analysis/."""
    assert "analysis" not in package_graph()["training"], package_graph()["training"]


def test_the_package_root_holds_entry_points_not_the_training_runs_modules():
    """The training run's modules live in training/ and records/; the root keeps the command-line entry points and
    the few modules every layer shares."""
    root = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert root == ["compare", "config_check", "export", "plan", "presets", "refusal", "replicates", "train"], root


def test_no_import_cycle_between_the_packages_parts():
    cycle = find_cycle(package_graph())
    assert cycle is None, " -> ".join(cycle)
