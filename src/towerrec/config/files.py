"""A ``Config`` from TOML files and ``--set`` overrides, back to TOML, and the changes a
resumed run may make to its saved config."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import fnmatch
import functools
import tomllib
import types
import typing
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any, cast

import tomli_w

from towerrec.config.recipes import recipe_names, resolve_config_file
from towerrec.config.sections import RESUME_SAFE_KEYS, Config, ConfigError, ModelConfig
from towerrec.models.names import ModelName

__all__ = [
    "FOR_MODEL",
    "UNSET_PREFIX",
    "ConfigFiles",
    "config_from_dict",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "resume_changes",
]


def _convert(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        errors = []
        for option in options:
            try:
                return _convert(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table of settings, got {value!r}")
        return _build(cast(type, hint), value, key)  # a dataclass type hint, not an instance
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table of named entries, got {value!r}")
        item = typing.get_args(hint)[1]
        return {str(k): _convert(v, item, f"{key}.{k}") for k, v in value.items()}
    if origin in (tuple, list):
        args = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        item = args[0] if args else Any
        items = [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in hint)
            raise ConfigError(f"{key} = {value!r} is not one of {choices}") from None
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{where}.{key}" if where else key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown config key {full!r}{hint}; valid keys here: {', '.join(names)}"
            )
        kwargs[key] = _convert(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"[{where or 'config'}] {e}") from None


def config_from_dict(data: dict[str, Any]) -> Config:
    return _build(Config, data, "")


# An override "!section.key" (what `--unset section.key` adds to the overrides, in order
# with --set): the key goes back to its default, whatever a config file set it to.
UNSET_PREFIX = "!"


def _known_key(parts: list[str], text: str) -> None:
    """Refuse an ``--unset`` of a key the config does not have (a typo would do nothing)."""
    hint: Any = Config
    for i, part in enumerate(parts):
        if typing.get_origin(hint) is dict:  # a named entry (a table's own settings)
            hint = typing.get_args(hint)[1]
            continue
        if not dataclasses.is_dataclass(hint):
            raise ConfigError(f"--unset {text}: {'.'.join(parts[:i])} is a value, not a section")
        fields = typing.get_type_hints(hint)
        if part not in fields:
            where = ".".join(parts[:i]) or "the config"
            close = difflib.get_close_matches(part, list(fields), n=1)
            tip = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"--unset {text}: {where} has no key {part!r}{tip}")
        hint = fields[part]
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(options) == 1:
            hint = options[0]


def _unset(data: dict[str, Any], text: str) -> None:
    key = text.removeprefix(UNSET_PREFIX).strip()
    parts = [part.strip() for part in key.split(".")]
    if not all(parts) or "=" in key:
        raise ConfigError(f"--unset {key!r}: expected section.key, e.g. --unset train.epochs")
    _known_key(parts, key)
    node: Any = data
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(parts[-1], None)


def _parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    parts = [part.strip() for part in key.split(".")]
    if not sep or not all(parts):
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set train.steps=100")
    try:
        parsed = tomllib.loads(f"v = {raw.strip()}")
    except tomllib.TOMLDecodeError:
        parsed = {"v": raw.strip()}  # a bare word: a string
    if len(parsed) > 1:  # "1\nother = 2": the value would silently drop the rest
        raise ConfigError(f"--set {text!r}: the value after '=' must be one TOML value")
    value = parsed["v"]
    return parts, value


def _read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file {str(path)!r} does not exist; give the path of a TOML file, or "
            f"the name of a packaged recipe: {', '.join(recipe_names())}"
        )
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {e.start}); TOML files are UTF-8"
        ) from None


def _merge(into: dict[str, Any], data: dict[str, Any]) -> None:
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


# One TOML file, several (later ones override earlier ones), or none.
ConfigFiles = str | Path | Sequence[str | Path] | None


def _config_files(path: ConfigFiles) -> list[str | Path]:
    """``path`` as a list of files, in the order they are read."""
    if path is None:
        return []
    if isinstance(path, str | Path):
        return [path]
    return list(path)


# A config file's settings for one model: ``[for_model.NAME.SECTION]`` tables, applied over
# the file's own sections when model.name is NAME (and before --set, which still wins). A
# recipe carries each model's measured settings this way, so that `--config movielens
# --set model.name=dcn` trains DCNv2 with DCNv2's.
FOR_MODEL = "for_model"


def _take_for_model(data: dict[str, Any], file: str | Path, into: dict[str, Any]) -> None:
    """Move ``data``'s ``[for_model]`` tables (read from ``file``) into ``into`` by model."""
    tables = data.pop(FOR_MODEL, None)
    if tables is None:
        return
    names = [n.value for n in ModelName]
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise ConfigError(
            f"config file {str(file)!r}: [{FOR_MODEL}] holds one table of sections per model, "
            f'e.g. [{FOR_MODEL}.dcn.embedding] with init = "uniform_rows"'
        )
    for name, table in tables.items():
        if name not in names:
            raise ConfigError(
                f"config file {str(file)!r}: [{FOR_MODEL}.{name}] names no model; use one of "
                f"{', '.join(names)}"
            )
        if "model" in table and "name" in table["model"]:
            raise ConfigError(
                f"config file {str(file)!r}: [{FOR_MODEL}.{name}.model] cannot set model.name; "
                "set it in [model]"
            )
        _merge(into.setdefault(name, {}), table)


@functools.cache
def _built_in_for_model() -> dict[str, Any]:
    """The ``[for_model]`` tables of the packaged ``default`` recipe: each model's own
    settings where a run names no config file (``--config default`` reads the same).
    Cached: callers merge copies of it."""
    per_model: dict[str, Any] = {}
    _take_for_model(_read_toml(resolve_config_file("default")), "built-in defaults", per_model)
    return per_model


def _for_model_error(
    data: dict[str, Any],
    table: dict[str, Any],
    name: str,
    overrides: list[str] | tuple[str, ...] = (),
) -> Exception | None:
    """The error of model ``name`` run from ``data`` with its ``table``, then ``overrides``
    (the order of a run), or None when that config loads."""
    trial = copy.deepcopy(data)
    _merge(trial, copy.deepcopy(table))
    trial = _apply_overrides(trial, overrides)
    trial.setdefault("model", {})["name"] = name
    try:
        config_from_dict(trial)
    except (ConfigError, ValueError) as e:
        return e
    return None


def _check_for_model(
    data: dict[str, Any], per_model: dict[str, Any], overrides: list[str] | tuple[str, ...]
) -> None:
    """Every model's settings must hold for that model (whichever model runs): each table
    over the files' settings, or, where the files alone do not load either (they leave a
    setting such as data.path to --set), over the files' settings and the overrides. An
    error the files' settings and the overrides already have is theirs, raised as it is."""
    for name, table in per_model.items():
        error = _for_model_error(data, table, name)
        if error is not None and _for_model_error(data, {}, name) is not None:
            error = _for_model_error(data, table, name, overrides)
        if error is not None:
            config_from_dict(_apply_overrides(copy.deepcopy(data), overrides))  # theirs
            raise ConfigError(f"[{FOR_MODEL}.{name}]: {error}") from None


def _model_name(data: dict[str, Any]) -> str:
    model = data.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    return name if isinstance(name, str) else ModelConfig.name  # the field's default


def load_config(
    path: ConfigFiles = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    base: str | Path | None = None,
) -> Config:
    """Defaults, then the TOML file at ``base`` (a resumed run's saved config.toml), then
    the TOML file(s) ``path`` names in order (a path, or a packaged recipe's name:
    ``recipes.resolve_config_file``), then their ``[for_model.NAME]`` settings for the
    model the whole config names (``FOR_MODEL``; with no file and no ``base``, those of
    the packaged ``default`` recipe), then ``section.key=value`` overrides and
    ``!section.key`` unsets (back to the default), in order."""
    data: dict[str, Any] = {}
    files = [resolve_config_file(f) for f in _config_files(path)]
    # with no file, the built-in defaults: their models' own settings too
    per_model = copy.deepcopy(_built_in_for_model()) if base is None and not files else {}
    for file in [*([] if base is None else [base]), *files]:
        table = _read_toml(file)
        if file == base:
            _as_written_before(table)
        _take_for_model(table, file, per_model)
        _merge(data, table)
    if per_model:
        _check_for_model(data, per_model, overrides)
        chosen = _model_name(_apply_overrides(copy.deepcopy(data), overrides))
        _merge(data, per_model.get(chosen, {}))
    return config_from_dict(_apply_overrides(data, overrides))


# Settings whose default changed, and the value a run's saved config.toml written before
# the key existed ran with: such a run is resumed, exported and scored as it trained.
WRITTEN_BEFORE: dict[tuple[str, ...], Any] = {
    ("data", "loader", "dense"): "none",  # dense columns standardised from then on
}


def _as_written_before(table: dict[str, Any]) -> None:
    """A saved config.toml's missing ``WRITTEN_BEFORE`` keys set to what its run ran with."""
    for path, value in WRITTEN_BEFORE.items():
        node = table
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node.setdefault(path[-1], value)


def _apply_overrides(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...]
) -> dict[str, Any]:
    """``data`` with the ``--set`` overrides and ``--unset`` keys applied in order."""
    for text in overrides:
        if text.startswith(UNSET_PREFIX):
            _unset(data, text)
            continue
        parts, value = _parse_override(text)
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resume_changes(saved: Config, config: Config) -> dict[str, dict[str, Any]]:
    """The settings ``config`` changes of a run's ``saved`` config, ``{key: {"from": saved
    value, "to": new value}}``; a ``ConfigError`` names every change not in
    ``RESUME_SAFE_KEYS``."""
    old, new = _flatten(config_to_dict(saved)), _flatten(config_to_dict(config))
    changed = {
        key: {"from": old.get(key), "to": new.get(key)}
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    }
    refused = [
        key
        for key in changed
        if not any(fnmatch.fnmatchcase(key, safe) for safe in RESUME_SAFE_KEYS)
    ]
    if refused:
        detail = ", ".join(
            f"{key} = {changed[key]['to']!r} (the run has {changed[key]['from']!r})"
            for key in refused
        )
        raise ConfigError(
            f"--resume continues the run with its saved config.toml; it cannot change {detail}. "
            f"Drop those --set/--config values, or start a new run with another --out "
            f"(a resume may change only {', '.join(RESUME_SAFE_KEYS)})"
        )
    return changed


# ------------------------------------------------------------------ writing
def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        }
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    return _plain(config)


def config_to_toml(config: Config) -> str:
    return tomli_w.dumps(config_to_dict(config))
