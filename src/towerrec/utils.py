"""Small helpers shared across layers (no torch.distributed, no heavy imports)."""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound=Enum)


def parse_enum(cls: type[E], value: object, what: str) -> E:
    """``cls(value)`` with an error that lists the valid choices."""
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown {what} {value!r}; choose one of {choices}") from None


def stable_seed(*parts: object) -> int:
    """A 63-bit seed derived from ``parts``, the same in every process and run."""
    text = "/".join(str(p) for p in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
