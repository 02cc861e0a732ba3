"""The shape of a JSON file towerrec reads back, checked before its values are used.

A shape is a value of this small language::

    COUNT, ROWS, FINITE, NUMBER              a whole number >= 0, >= 1, a finite
                                             number, any number (NaN and infinities too)
    FLAG, TEXT, NAME                         a bool, any string, a string that is one
                                             plain path component
    [shape]                                  a list of items of that shape
    {"key": shape, ...}                      an object with at least these keys
    Map(shape, keys=...)                     an object of any keys (or only ``keys``)
                                             whose values have that shape
    Opt(shape)                               that shape, null, or (in an object) absent
    Opt(shape, absent=False)                 that shape or null, never absent
    Opt(shape, null=False)                   that shape or absent, never null

``check_shape(value, shape)`` raises ``ValueError`` naming the first key that is
missing or has the wrong type (``parts[2].rows.train``), so a damaged or
hand-edited manifest is refused with its key instead of failing later with a
``KeyError`` or, worse, being read to other values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["COUNT", "FINITE", "FLAG", "NAME", "NUMBER", "ROWS", "TEXT", "Map", "Opt", "check_shape"]


@dataclass(frozen=True)
class _Leaf:
    what: str


COUNT, ROWS = _Leaf("a whole number >= 0"), _Leaf("a whole number >= 1")
FINITE, NUMBER = _Leaf("a finite number"), _Leaf("a number")
FLAG, TEXT, NAME = _Leaf("true or false"), _Leaf("a string"), _Leaf("a file name")


@dataclass(frozen=True)
class Map:
    """An object whose values all have ``shape`` (and whose keys are in ``keys``, if given)."""

    shape: Any
    keys: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Opt:
    """``shape``, or null, or (as a value of an object, if ``absent``) no key at all."""

    shape: Any
    absent: bool = True
    null: bool = True


def _leaf_ok(value: Any, leaf: _Leaf) -> bool:
    if leaf is FLAG:
        return isinstance(value, bool)
    if leaf in (TEXT, NAME):
        plain = isinstance(value, str) and value not in ("", ".", "..")
        return isinstance(value, str) and (leaf is TEXT or (plain and "/" not in value))
    if isinstance(value, bool):
        return False
    if leaf is NUMBER:
        return isinstance(value, int | float)
    if leaf is FINITE:
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, int) and value >= (1 if leaf is ROWS else 0)


def check_shape(value: Any, shape: Any, where: str = "") -> None:
    """Raise ``ValueError`` naming the first place where ``value`` is not ``shape``."""
    name = where or "the top level"
    if isinstance(shape, Opt):
        if value is not None or not shape.null:
            check_shape(value, shape.shape, where)
    elif isinstance(shape, _Leaf):
        if not _leaf_ok(value, shape):
            raise ValueError(f"{name} must be {shape.what}, got {value!r}"[:300])
    elif isinstance(shape, list):
        if not isinstance(value, list):
            raise ValueError(f"{name} must be a list, got {value!r}"[:300])
        for i, item in enumerate(value):
            check_shape(item, shape[0], f"{where}[{i}]")
    elif isinstance(shape, Map):
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be an object, got {value!r}"[:300])
        for key, item in value.items():
            if shape.keys is not None and key not in shape.keys:
                raise ValueError(f"{where}.{key}: unknown key; expected one of {shape.keys}")
            check_shape(item, shape.shape, f"{where}.{key}" if where else key)
    else:
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be an object, got {value!r}"[:300])
        for key, item_shape in shape.items():
            if key not in value and isinstance(item_shape, Opt) and item_shape.absent:
                continue
            if key not in value:
                raise ValueError(f"{where + '.' if where else ''}{key} is missing")
            check_shape(value[key], item_shape, f"{where}.{key}" if where else key)
