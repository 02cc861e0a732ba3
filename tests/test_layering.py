"""The import ladder of docs/architecture.md: imports only point down."""

import ast
import re
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
    "checksums.py": ["torch", "towerrec."],
    "data": [
        "torch.distributed",
        "towerrec.modules",
        "towerrec.models",
        "towerrec.train",
        "towerrec.distributed",
        "towerrec.planner",
        "towerrec.calibration",
        "towerrec.config",
        "towerrec.build",
        "towerrec.workflows",
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
        "towerrec.config",
        "towerrec.build",
        "towerrec.workflows",
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
    # The run config: below the build layer and everything that builds or trains; it
    # holds the search's settings as its own leaf (config/nas.py), never the search.
    "config": [
        "torch.distributed",
        "towerrec.build",
        "towerrec.train",
        "towerrec.workflows",
        "towerrec.serve",
        "towerrec.cli",
        "towerrec.bench",
    ],
    "config/nas.py": ["torch", "towerrec."],
    # The build layer: between the config and the engine. Of the engine it uses the
    # step primitives only (test_the_build_layer_uses_only_the_step_primitives).
    "build": ["towerrec.workflows", "towerrec.serve", "towerrec.cli", "towerrec.bench"],
    # The engine: no workflow, lazily or not; the workflows plug in as hooks and step
    # strategies.
    "train": ["towerrec.workflows", "towerrec.serve", "towerrec.cli", "towerrec.bench"],
    # The workflows: above the engine and the build layer, below the command line; of
    # serve/ they read the artefact loader alone (the augmentation service's teacher).
    "workflows": [
        "towerrec.serve.export",
        "towerrec.serve.predict",
        "towerrec.cli",
        "towerrec.bench",
    ],
    "workflows/nas": ["torch.distributed", "towerrec.cli", "towerrec.bench"],
    "bench": ["towerrec.cli"],
    # Export and predict sit on the build layer and the engine (the run's model and
    # checkpoint), below the command line and beside the workflows; the artefact loader is
    # standalone: torch and numpy only, never towerrec.
    "serve": ["towerrec.workflows", "towerrec.cli", "towerrec.bench"],
    "serve/artefact.py": ["towerrec."],
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
                for alias in node.names:  # `from towerrec.train import loop` is a module
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
    assert "towerrec.workflows.training" in import_graph()["towerrec.workflows.worker"]


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


# The engine's floor: the step primitives that the build layer's pilot run uses too.
STEP_PRIMITIVES = {"towerrec.train.step", "towerrec.train.loss", "towerrec.train.metrics"}


def test_the_engine_imports_no_workflow():
    """The loop speaks to hooks and step strategies; the workflows supply them."""
    graph = import_graph()
    found = {
        (m, d)
        for m, deps in graph.items()
        if _in(m, "towerrec.train")
        for d in deps
        if _in(d, "towerrec.workflows")
    }
    assert found == set()


def test_the_config_imports_no_search():
    """The run config holds the search's settings (config/nas.py), not the search."""
    graph = import_graph()
    found = {
        (m, d)
        for m, deps in graph.items()
        if _in(m, "towerrec.config")
        for d in deps
        if _in(d, "towerrec.workflows")
    }
    assert found == set()


def test_the_step_primitives_stand_alone():
    """train/step.py, loss.py and metrics.py import nothing else of the engine, so that
    the build layer below the rest of it can use them."""
    graph = import_graph()
    for module in STEP_PRIMITIVES:
        engine = {d for d in graph[module] if _in(d, "towerrec.train")}
        assert engine <= STEP_PRIMITIVES, (module, engine - STEP_PRIMITIVES)


def test_the_build_layer_uses_only_the_step_primitives():
    """build/ sits below the engine: of towerrec.train it imports the step primitives."""
    graph = import_graph()
    found = {
        (m, d)
        for m, deps in graph.items()
        if _in(m, "towerrec.build")
        for d in deps
        if _in(d, "towerrec.train") and d not in STEP_PRIMITIVES
    }
    assert found == set()


# Where a source or a model is chosen by its name: their registries.
REGISTRIES = {"data/registry.py", "build/models.py"}
CHAIN = re.compile(
    r"""(\bsource|\bmodel\.name|\bmodel_config\.name)\s*(==|!=|(not\s+)?in\s*[(\[{])\s*["']"""
)


def test_no_string_chain_over_the_source_or_the_model_name():
    """``data.source`` and ``model.name`` are looked up in their registries
    (``SOURCES``, ``MODELS``), not compared with names written out in if-chains."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if str(path.relative_to(SRC)) in REGISTRIES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if CHAIN.search(line.split("#")[0]):
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert found == []


def test_the_chain_check_finds_a_chain():
    for line in (
        'if data.source == "synthetic":',
        "if config.data.source in ('criteo', 'cache'):",
        'if config.model.name != "dmt":',
        'elif model.name == "dcn":',
    ):
        assert CHAIN.search(line), line
    assert not CHAIN.search("entry = SOURCES[config.data.source]")
