"""The import ladder of docs/architecture.md: imports only point down."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src" / "towerrec"

# package -> what it must not import (modules of towerrec, or torch.distributed)
FORBIDDEN = {
    "sparse.py": ["torch.distributed", "towerrec."],
    "utils.py": ["torch", "towerrec."],
    "memory.py": ["torch", "towerrec."],
    "data": [
        "torch.distributed",
        "towerrec.modules",
        "towerrec.models",
        "towerrec.train",
        "towerrec.distributed",
        "towerrec.planner",
    ],
    "optim": [
        "torch.distributed",
        "towerrec.modules",
        "towerrec.models",
        "towerrec.train",
        "towerrec.data",
    ],
    "modules": [
        "torch.distributed",
        "towerrec.models",
        "towerrec.train",
        "towerrec.distributed",
        "towerrec.data",
        "towerrec.planner",
    ],
    "models": [
        "torch.distributed",
        "towerrec.train",
        "towerrec.distributed",
        "towerrec.data",
        "towerrec.planner",
    ],
    "planner": ["torch.distributed", "towerrec.train", "towerrec.distributed"],
    "distributed": ["towerrec.train", "towerrec.cli", "towerrec.bench", "towerrec.data"],
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
