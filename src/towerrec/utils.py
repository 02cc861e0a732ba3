"""Small helpers shared across layers (no torch, no towerrec imports): enum parsing,
stable seeds, and the range checks every config dataclass's ``__post_init__`` runs
(``positive``, ``at_least``, ``above``, ``within``: one message shape,
``"<key> must be >= 1, got 0"``)."""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound=Enum)
Values = float | None | tuple[float | None, ...]


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


def _refuse(key: str, rule: str, values: Values, unit: str, hint: str) -> None:
    got = " and ".join(str(v) for v in values) if isinstance(values, tuple) else str(values)
    unit = f" {unit}" if unit else ""
    hint = f" ({hint})" if hint else ""
    raise ValueError(f"{key} must {rule}{unit}{hint}, got {got}")


def _each(values: Values) -> tuple[float, ...]:
    """The values that are set (None: unset, not checked)."""
    items = values if isinstance(values, tuple) else (values,)
    return tuple(v for v in items if v is not None)


def at_least(key: str, values: Values, minimum: float, *, unit: str = "", hint: str = "") -> None:
    """Refuse a value below ``minimum`` (or NaN) with ``"<key> must be >= <minimum>
    [<unit>] [(<hint>)], got <value>"``. ``values``: one value, or a tuple of them that
    ``key`` names together ("a and b", listed "got 1 and 0"); None is unset and passes."""
    if not all(v >= minimum for v in _each(values)):
        _refuse(key, f"be >= {minimum}", values, unit, hint)


def above(key: str, values: Values, bound: float, *, unit: str = "", hint: str = "") -> None:
    """Refuse a value not above ``bound``: ``"<key> must be > <bound> ..., got <value>"``
    (as ``at_least``)."""
    if not all(v > bound for v in _each(values)):
        _refuse(key, f"be > {bound}", values, unit, hint)


def positive(key: str, values: Values, *, unit: str = "", hint: str = "") -> None:
    """``above(key, values, 0)``: ``"<key> must be > 0 ..., got <value>"``."""
    above(key, values, 0, unit=unit, hint=hint)


def within(key: str, values: Values, interval: str, *, hint: str = "") -> None:
    """Refuse a value outside ``interval``, written as the message shows it: ``"(0, 1)"``,
    ``"[0, 1)"``, ``"(0, 1]"`` or ``"[0, 1]"`` (brackets include the end):
    ``"<key> must lie in <interval> ..., got <value>"``."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    closed_low, closed_high = interval[0] == "[", interval[-1] == "]"
    for v in _each(values):
        if not ((low <= v if closed_low else low < v) and (v <= high if closed_high else v < high)):
            _refuse(key, f"lie in {interval}", values, "", hint)
