"""What differs between the Python, torch and FBGEMM versions towerrec supports, in one
place.

Supported: Python 3.11 to 3.13 and torch 2.11 or newer (pyproject's ``requires-python``
and ``torch>=2.11``; README, "Install"). Tested on the CPU: 3.11 with torch 2.13 (CI),
3.12 with torch 2.11 (the GPU machines' stack), 3.13 with torch 2.14; on a GPU by
``tools/device_check.sh``. Code that depends on a version asks here, not with its own
probe:

- FBGEMM moved ``WeightDecayMode`` to ``fbgemm_gpu.tbe.config`` in 1.8 (torch 2.13);
  ``split_table_batched_embeddings_ops_training`` exports it in every release from 1.6
  (torch 2.11) on: ``fbgemm_weight_decay_mode``. ``fbgemm-gpu-cpu`` wheels: 1.6.0 for
  torch 2.11 (tested on 3.12), 1.8.0 for 2.13 (the ``cpu`` extra), 1.9.0 for 2.14
  (tested on 3.13).
- Python 3.12 checks a runtime ``Protocol``'s members with ``inspect.getattr_static``,
  which does not see an ``nn.Module``'s submodules (kept in ``_modules``, reached
  through ``__getattr__``): the models' ``sparse`` is a class-level property
  (``models/interfaces.py``, ``SparseArchModel``), found the same on every version.
- torch 2.9 added ``torch.backends.*.matmul.fp32_precision``, which ``train/numerics.py``
  pins; every supported torch has it.

This module imports neither torch nor towerrec (``towerrec --help`` stays light).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from typing import Any

__all__ = [
    "MIN_PYTHON",
    "MIN_TORCH",
    "TESTED",
    "check_versions",
    "fbgemm_weight_decay_mode",
    "version_tuple",
]

MIN_PYTHON = (3, 11)
MIN_TORCH = (2, 11)
# Python -> the torch the suite ran on (CPU); tools/device_check.sh on a GPU.
TESTED = {(3, 11): "2.13", (3, 12): "2.11", (3, 13): "2.14"}


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.11.0+cu130"`` -> ``(2, 11, 0)``: the leading release numbers."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def check_versions(python: tuple[int, ...] | None = None, torch_version: str | None = None) -> None:
    """Refuse a Python or torch older than supported, naming the fix (a source checkout
    on ``PYTHONPATH`` skips pip's check). ``torch_version`` defaults to the installed
    distribution's; an unknown one (a build without metadata) passes."""
    python = python or sys.version_info[:2]
    if tuple(python[:2]) < MIN_PYTHON:
        raise RuntimeError(
            f"towerrec needs Python {'.'.join(map(str, MIN_PYTHON))} or newer, this is "
            f"{'.'.join(map(str, python[:2]))}; use Python 3.11 to 3.13"
        )
    if torch_version is None:
        try:
            torch_version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return
    if version_tuple(torch_version)[:2] < MIN_TORCH:
        raise RuntimeError(
            f"towerrec needs torch {'.'.join(map(str, MIN_TORCH))} or newer, this is "
            f"{torch_version}; pip install 'torch>=2.11' (or the cpu extra's build)"
        )


def fbgemm_weight_decay_mode() -> Any:
    """FBGEMM's ``WeightDecayMode`` enum, from the module every release since 1.6 exports
    it from (module doc)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    return WeightDecayMode
