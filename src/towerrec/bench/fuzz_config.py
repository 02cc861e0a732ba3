"""Fuzz targets of the config readers: TOML files and ``--set`` overrides.

Documents and overrides are built from the real keys (``Config()`` as a dict)
with values of the right type, the wrong type and the wrong shape, plus typos
and bytes that are not TOML or not UTF-8. Accepted ones must land in the
config as written (no key dropped, no value changed on the way; a value with a documented
second spelling, ``config.VALUE_ALIASES``, as the value it stands for); refused ones
must name the file, the ``--set`` text or a key of the input.
"""

from __future__ import annotations

import math
import tomllib
from enum import Enum
from pathlib import Path
from typing import Any

from towerrec.bench.fuzz_core import FuzzFailure, FuzzTarget

__all__ = ["CONFIG_TARGETS"]


def _default_leaves() -> dict[str, Any]:
    """``section.key`` -> default value of every setting."""
    from towerrec.config import Config
    from towerrec.config.files import config_to_dict

    leaves: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                leaves[f"{prefix}{key}"] = value

    walk(config_to_dict(Config()), "")
    return leaves


_LEAVES: dict[str, Any] = {}


def _leaves() -> dict[str, Any]:
    if not _LEAVES:
        _LEAVES.update(_default_leaves())
    return _LEAVES


def _values(default: Any) -> Any:
    """Values for a key whose default is ``default``: its own type mostly, others too."""
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=True),
        st.text(max_size=6),
    )
    if isinstance(default, bool):
        own = st.booleans()
    elif isinstance(default, int):
        own = st.integers(-3, 10**6)
    elif isinstance(default, float):
        own = st.floats(-1.0, 1e6)
    elif isinstance(default, str):
        own = st.sampled_from([default, default.upper(), default + "x", ""])
    elif isinstance(default, list):
        own = st.lists(st.integers(-2, 64), max_size=4)
    else:
        own = scalars
    return st.one_of(
        own, own, scalars.filter(lambda v: v is not None), st.lists(scalars, max_size=2)
    )


def _documents() -> Any:
    from hypothesis import strategies as st

    keys = sorted(_leaves())
    key = st.one_of(
        st.sampled_from(keys),
        st.sampled_from(keys).map(lambda k: k + "s"),
        st.sampled_from(keys).map(lambda k: k.rsplit(".", 1)[0]),
        st.text("abc._", min_size=1, max_size=6),
    )
    entry = key.flatmap(lambda k: st.tuples(st.just(k), _values(_leaves().get(k))))
    document = st.lists(entry, max_size=4).map(_nest)
    corrupt = st.tuples(document, st.integers(0, 200), st.binary(max_size=3))
    return st.one_of(
        document.map(_toml_bytes),
        corrupt.map(lambda t: _toml_bytes(t[0])[: t[1]] + t[2]),
    )


def _nest(entries: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for dotted, value in entries:
        node = data
        *sections, last = dotted.split(".")
        for part in sections:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            if not isinstance(node.get(last), dict):
                node[last] = value
    return data


def _toml_bytes(data: dict[str, Any]) -> bytes:
    import tomli_w

    def clean(value: Any) -> Any:  # TOML has no null
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [clean(v) for v in value if v is not None]
        return value

    try:
        return tomli_w.dumps(clean(data)).encode()
    except (TypeError, ValueError):  # a mixed-type list: TOML 1.0 allows it, tomli_w not always
        return b"[train]\nsteps = 1\n"


def _as_read(key: str, written: Any) -> Any:
    """``written`` as the config reads ``key``: one of its documented second spellings
    (``config.VALUE_ALIASES``, e.g. ``data.loader.verify = false`` is ``"never"``) is
    compared as the value it stands for; any other value as written."""
    from towerrec.config import VALUE_ALIASES

    aliases = VALUE_ALIASES.get(key, {})
    if isinstance(written, bool) and written in aliases:
        return aliases[written]
    return written


def _same(config_value: Any, written: Any) -> bool:
    if isinstance(config_value, Enum):
        config_value = config_value.value
    if isinstance(config_value, tuple | list) and isinstance(written, list):
        return len(config_value) == len(written) and all(
            _same(a, b) for a, b in zip(config_value, written)
        )
    if isinstance(config_value, dict) and isinstance(written, dict):
        return all(_same(config_value.get(k), v) for k, v in written.items())
    if isinstance(config_value, float) and isinstance(written, int | float):
        return config_value == float(written) or (math.isnan(config_value) and math.isnan(written))
    return bool(config_value == written)


def _check_landed(config: Any, data: dict[str, Any], where: str) -> None:
    """Every value of ``data`` is in ``config`` as written."""
    from towerrec.config.files import config_to_dict

    resolved = config_to_dict(config)

    def walk(node: dict[str, Any], into: Any, prefix: str) -> None:
        for key, value in node.items():
            if not isinstance(into, dict) or key not in into:
                raise FuzzFailure(f"{where}: {prefix}{key} = {value!r} was accepted and dropped")
            if isinstance(value, dict) and isinstance(into[key], dict) and value:
                walk(value, into[key], f"{prefix}{key}.")
            elif not _same(into[key], _as_read(f"{prefix}{key}", value)):
                raise FuzzFailure(f"{where}: {prefix}{key} = {value!r} was read as {into[key]!r}")

    walk(data, resolved, "")


def _names(data: Any, prefix: str = "") -> list[str]:
    """Every dotted key and section name of a TOML document."""
    out: list[str] = []
    if isinstance(data, dict):
        for key, value in data.items():
            out += [f"{prefix}{key}", str(key), *_names(value, f"{prefix}{key}.")]
    return out


def _refused_naming(read: Any, names: list[str]) -> Any:
    """``read()``, or None when it raised a ValueError naming one of ``names``."""
    try:
        return read()
    except ValueError as e:
        if not any((n and n in str(e)) or repr(n) in str(e) for n in names):
            raise FuzzFailure(f"{type(e).__name__} names none of {names[:6]}: {e}") from e
        return None
    except Exception as e:
        raise FuzzFailure(f"unhandled {type(e).__name__}: {e}") from e


def _check_toml(text: bytes, scratch: Path) -> None:
    from towerrec.config import load_config

    path = scratch / "run.toml"
    path.write_bytes(text)
    try:
        data = tomllib.loads(path.read_text())  # newlines as Python reads them
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        data = None
    config = _refused_naming(lambda: load_config(path), [str(path), *_names(data)])
    if config is not None:
        if data is None:
            raise FuzzFailure(f"{text!r} is not TOML, yet it was read")
        _check_landed(config, data, str(path))


def _overrides() -> Any:
    from hypothesis import strategies as st

    keys = sorted(_leaves())
    literal = st.sampled_from(keys).flatmap(
        lambda k: st.tuples(st.just(k), _values(_leaves()[k]).map(_toml_literal))
    )
    junk_value = st.text("ab1 .#'\"\n[]{}=,\\", max_size=10)
    junk_key = st.one_of(st.sampled_from(keys), st.text("ab._ ", max_size=8))
    return st.one_of(
        literal.map(lambda t: f"{t[0]}={t[1]}"),
        literal.map(lambda t: f"{t[0]}={t[1]}\nother = 2"),
        st.tuples(junk_key, st.sampled_from(["=", "", "==", " = "]), junk_value).map("".join),
    )


def _toml_literal(value: Any) -> str:
    import tomli_w

    if value is None:
        return ""
    try:
        return tomli_w.dumps({"v": value})[len("v = ") :].strip()
    except (TypeError, ValueError):
        return str(value)


def _check_override(text: str, scratch: Path) -> None:
    from towerrec.config import load_config

    key = text.partition("=")[0].strip()
    parts = [part.strip() for part in key.split(".")]
    config = _refused_naming(lambda: load_config(None, [text]), [text, key, *parts])
    if config is None:
        return
    raw = text.partition("=")[2].strip()
    try:
        value = tomllib.loads(f"v = {raw}")
        if set(value) != {"v"}:  # more than one value after the = sign
            raise FuzzFailure(f"--set {text!r}: read as {value['v']!r}, the rest dropped")
        value = value["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    data: dict[str, Any] = {}
    node = data
    *sections, last = parts
    for part in sections:
        node = node.setdefault(part, {})
    node[last] = value
    _check_landed(config, data, f"--set {text!r}")


CONFIG_TARGETS = [
    FuzzTarget(
        "config_toml",
        "config TOML files -> config.load_config; accepted values must land as written",
        _documents,
        _check_toml,
    ),
    FuzzTarget(
        "config_set",
        "--set SECTION.KEY=VALUE -> config.load_config; accepted values must land as written",
        _overrides,
        _check_override,
    ),
]
