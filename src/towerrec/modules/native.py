"""The optional native extensions: the fused CPU kernels (``_fused.c``) and the host
bookkeeping of cached tables (``_cache.c``); each module, or ``None`` where ``pip
install`` found no C compiler to build it (its callers then take their PyTorch paths)."""

from __future__ import annotations

from types import ModuleType

# torch first: its CPU build loads its own libgomp.so.1, and _fused, built with OpenMP,
# then binds to that library and so to the threads torch's operators run on
import torch  # noqa: F401

__all__ = ["cache", "fused", "native_lanes"]

fused: ModuleType | None
try:
    from towerrec.modules import _fused as fused  # type: ignore[attr-defined,no-redef,unused-ignore]
except ImportError:  # not built here
    fused = None

cache: ModuleType | None
try:
    from towerrec.modules import _cache as cache  # type: ignore[attr-defined,no-redef,unused-ignore]
except ImportError:  # not built here
    cache = None


def native_lanes() -> int | None:
    """The lanes of the vectors the fused dots' kernels hold a row in on this CPU: 16
    with AVX-512, 8 with AVX2, 4 on 128-bit vector units (x86's baseline, AArch64's NEON)
    (``_fused.c``, the note at ``lanes``); None where the extension is not built."""
    if fused is None:
        return None
    return int(fused.vector_lanes())
