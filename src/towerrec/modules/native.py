"""The optional native extension of fused CPU kernels (``_fused.c``): the module, or
``None`` where ``pip install`` found no C compiler to build it (its callers then take
their PyTorch paths)."""

from __future__ import annotations

from types import ModuleType

__all__ = ["fused"]

fused: ModuleType | None
try:
    from towerrec.modules import _fused as fused  # type: ignore[attr-defined,no-redef,unused-ignore]
except ImportError:  # not built here
    fused = None
