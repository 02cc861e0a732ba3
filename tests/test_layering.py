"""The import ladder of docs/architecture.md: imports only point down."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src" / "towerrec"

# package -> what it must not import (modules of towerrec, or torch.distributed)
FORBIDDEN = {
    "sparse.py": ["torch.distributed", "towerrec."],
    "utils.py": ["torch", "towerrec."],
    "compat.py": ["torch", "towerrec."],
    "memory.py": ["torch", "towerrec."],
    "scaling.py": ["torch", "towerrec."],
    "data": [
        "torch.distributed",
        "towerrec.modules",
        "towerrec.models",
        "towerrec.train",
        "towerrec.distributed",
        "towerrec.planner",
        "towerrec.calibration",
    ],
    "optim": [
        "torch.distributed",
        "towerrec.modules",
        "towerrec.models",
        "towerrec.train",
        "towerrec.data",
        "towerrec.calibration",
    ],
    "modules": [
        "torch.distributed",
        "towerrec.models",
        "towerrec.train",
        "towerrec.distributed",
        "towerrec.data",
        "towerrec.planner",
        "towerrec.calibration",
    ],
    "models": [
        "torch.distributed",
        "towerrec.train",
        "towerrec.distributed",
        "towerrec.data",
        "towerrec.planner",
        "towerrec.calibration",
    ],
    # The planner reads cost constants; measuring them is calibration's job, above it.
    "planner": [
        "torch.distributed",
        "towerrec.train",
        "towerrec.distributed",
        "towerrec.calibration",
    ],
    "distributed": [
        "towerrec.train",
        "towerrec.cli",
        "towerrec.bench",
        "towerrec.data",
        "towerrec.calibration",
    ],
    # Above the kernels (modules), the collectives (distributed) and the planner whose
    # constants it measures; below the command line and the benchmarks that use it.
    "calibration": [
        "towerrec.train",
        "towerrec.cli",
        "towerrec.bench",
        "towerrec.config",
        "towerrec.interop",
        "towerrec.data",
    ],
    "sharding": [
        "torch.distributed",
        "towerrec.planner",
        "towerrec.distributed",
        "towerrec.train",
        "towerrec.models",
        "towerrec.data",
        "towerrec.cli",
        "towerrec.bench",
    ],
    "config": ["torch.distributed", "towerrec.train", "towerrec.cli", "towerrec.bench"],
    "train": ["towerrec.cli", "towerrec.bench"],
    "bench": ["towerrec.cli"],
    # Export and predict sit on train/ (the run's model and checkpoint), below the command
    # line; the artefact loader is standalone: torch and numpy only, never towerrec.
    "serve": ["towerrec.cli", "towerrec.bench"],
    "serve/artefact.py": ["towerrec."],
    # Above train/ (it builds the DLRM and runs train_step); the run config holds its leaf
    # nas/config.py, which imports nothing of towerrec.
    "nas": ["torch.distributed", "towerrec.cli", "towerrec.bench"],
    "nas/config.py": ["torch", "towerrec."],
}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_imports_point_down(part):
    target = SRC / part
    files = [target] if target.is_file() else sorted(target.rglob("*.py"))
    for path in files:
        for name in imports_of(path):
            for banned in FORBIDDEN[part]:
                if name == banned.rstrip(".") or name.startswith(
                    banned if banned.endswith(".") else banned + "."
                ):
                    pytest.fail(
                        f"{path.relative_to(SRC)} imports {name}, which is above it in the ladder"
                    )


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (annotations, never run)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            lines.update(n.lineno for n in ast.walk(node) if isinstance(n, ast.ImportFrom))
    return lines


def import_graph() -> dict[str, set[str]]:
    """towerrec module -> the towerrec modules it imports, at the top or inside a function
    (a lazy import is an import all the same), leaving out ``TYPE_CHECKING`` ones."""
    paths = {_module_of(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.lineno not in skip:
                for alias in node.names:  # `from towerrec.train import trainer` is a module
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in paths else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[module] = {d for d in deps if d in paths and d != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert "towerrec.train.trainer" in import_graph()["towerrec.train.worker"]


def test_only_the_command_line_imports_the_benchmarks():
    graph = import_graph()
    users = {
        m
        for m, deps in graph.items()
        if any(d.startswith("towerrec.bench") for d in deps)
        and not m.startswith(("towerrec.bench", "towerrec.cli"))
    }
    assert users == set()


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_nothing_imports_the_command_line():
    """The command line is the top of the ladder: only its own modules and the
    ``python -m towerrec`` entry point import it."""
    graph = import_graph()
    users = {
        m
        for m, deps in graph.items()
        if any(_in(d, "towerrec.cli") for d in deps)
        and not _in(m, "towerrec.cli")
        and m != "towerrec.__main__"
    }
    assert users == set()


def test_the_calibration_is_used_from_above():
    """Calibration measures kernels and collectives for the planner: the planner reads
    its constants from a file, and only the command line and the benchmarks call it."""
    graph = import_graph()
    users = {
        m
        for m, deps in graph.items()
        if any(_in(d, "towerrec.calibration") for d in deps)
        and not any(_in(m, p) for p in ("towerrec.calibration", "towerrec.cli", "towerrec.bench"))
    }
    assert users == set()
