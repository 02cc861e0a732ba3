"""The config reference (docs/config.md) as Markdown: every key of the config dataclasses,
its default, whether ``--resume`` may change it, and its one-line comment from
``configs/default.toml``.

The dataclasses give the keys, their order and their defaults; ``configs/default.toml``
gives the words (a test keeps it in step with the dataclasses). ``towerrec config
reference --out docs/config.md`` writes the page, and a test fails when the page differs
from what ``config_reference`` returns.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import tomllib
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

from towerrec.config.sections import RESUME_SAFE_KEYS, Config

__all__ = ["config_reference"]

TABLE = "<table>"  # the name of a per-entry section's entry (embedding.tables.<table>)


@dataclass
class _Section:
    """One ``[section]`` of the reference: its notes and its keys' comments and examples."""

    notes: list[str] = field(default_factory=list)
    comments: dict[str, str] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)  # unset keys: the commented value


def _split_comment(text: str) -> tuple[str, str]:
    """``value  # comment`` into its two parts (a ``#`` inside a string is the value's)."""
    quote = ""
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == "#":
            return text[:i].strip(), text[i + 1 :].strip()
    return text.strip(), ""


def _parse_defaults(text: str) -> dict[str, _Section]:
    """The comments of a commented config file, by section: ``key = value  # comment``, a
    commented-out ``# key = value  # comment`` (an unset key and an example value),
    indented ``# ...`` lines that continue the comment above them, a comment after a
    ``[section]`` header, and blocks of ``# ...`` lines (a section's notes, or the comment
    of the key right below them when that key has none). A commented-out
    ``# [a.b.name]`` header opens the section ``a.b.<table>``."""
    sections: dict[str, _Section] = {}
    section: _Section | None = None
    last: tuple[_Section, str | None] | None = None  # what an indented comment continues
    block: list[str] = []  # free comment lines not yet attached

    def flush() -> None:
        if section is not None and block:
            section.notes.append(re.sub(r":$", ".", " ".join(block)))
        block.clear()

    for raw in text.splitlines():
        line = raw.strip()
        header = re.match(r"(#\s*)?\[([\w.]+)\]\s*(.*)", line)
        key = re.match(r"(#\s*)?(\w+)\s*=\s*(.*)", line)
        if header:
            name = header.group(2)
            if header.group(1):  # a commented-out example section: one entry of a table,
                name = f"{name.rpartition('.')[0]}.{TABLE}"  # the notes above it its own
            else:
                flush()
            section = sections.setdefault(name, _Section())
            flush()
            note = _split_comment(header.group(3))[1]
            if note:
                section.notes.append(note)
            last = (section, None)
        elif key and section is not None:
            value, comment = _split_comment(key.group(3))
            name = key.group(2)
            if not comment and block:
                comment = re.sub(rf"^{name}:\s*", "", " ".join(block))
                block.clear()
            flush()
            section.comments[name] = comment
            if key.group(1):
                section.examples[name] = value
            last = (section, name)
        elif line.startswith("#") and raw[:1].isspace() and last is not None:
            owner, name = last
            extra = line.lstrip("#").strip()
            if name is None:
                owner.notes[-1] = f"{owner.notes[-1]} {extra}" if owner.notes else extra
            else:
                owner.comments[name] = f"{owner.comments[name]} {extra}".strip()
        elif line.startswith("#"):
            block.append(line.lstrip("#").strip())
        else:  # a blank line ends a block of notes
            flush()
            last = None
    flush()
    return sections


def _literal(value: Any) -> str:
    """A default as TOML writes it inline."""
    if isinstance(value, Enum):
        return _literal(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


def _cell(text: str) -> str:
    """Comment text as one Markdown table cell: plain text escaped, `code` kept as written
    (but for the table's ``|``), and ``docs/x.md`` a link beside this page."""
    parts = text.split("`")
    for i, part in enumerate(parts):
        if i % 2 == 0:  # outside a code span
            part = part.replace("\\", "\\\\").replace("*", "\\*")
            part = part.replace("<", "&lt;").replace(">", "&gt;")
            part = re.sub(r"\bdocs/([\w-]+\.md)\b", r"[\1](\1)", part)
        parts[i] = part.replace("|", "\\|")
    return "`".join(parts)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _walk(cls: type, instance: Any, prefix: str, out: dict[str, dict[str, Any]]) -> None:
    """``out[section][key] = default`` for every leaf key under ``cls``, sections in
    field order; a table of named entries (``dict[str, <dataclass>]``) is the section
    ``<prefix>.<key>.<table>`` whose defaults are None (each entry's keys are unset)."""
    hints = typing.get_type_hints(cls)
    leaves = out.setdefault(prefix, {})
    nested: list[tuple[str, type, Any]] = []
    for f in dataclasses.fields(cls):
        hint, value = hints[f.name], getattr(instance, f.name)
        if dataclasses.is_dataclass(hint):
            nested.append((f"{prefix}.{f.name}".lstrip("."), cast(type, hint), value))
        elif typing.get_origin(hint) is dict and dataclasses.is_dataclass(
            item := typing.get_args(hint)[1]
        ):
            entry = cast(type, item)
            nested.append((f"{prefix}.{f.name}.{TABLE}", entry, entry()))
        else:
            leaves[f.name] = value
    for name, hint, value in nested:
        _walk(hint, value, name, out)


def _default(section: str, key: str, value: Any, sections: dict[str, dict[str, Any]]) -> str:
    if section.endswith(f".{TABLE}"):
        parent = section.removesuffix(f".{TABLE}").rpartition(".")[0]
        return f"`{parent}.{key}`" if key in sections.get(parent, {}) else "unset"
    if value is None or value == {}:
        return "unset"
    return f"`{_literal(value)}`"


def _comment(section: str, key: str, comments: dict[str, _Section]) -> str:
    """A key's comment, and the example value of an unset one; a per-entry key that
    overrides a key of the section above says so and repeats that key's comment."""
    own = comments.get(section, _Section())
    text = own.comments.get(key, "")
    parent = section.removesuffix(f".{TABLE}").rpartition(".")[0]
    if section.endswith(f".{TABLE}") and key in comments.get(parent, _Section()).comments:
        text = f"this table's `{parent}.{key}`: {comments[parent].comments[key]}"
    if key in own.examples:
        text = f"{text} (e.g. `{own.examples[key]}`)".strip()
    return text


def config_reference(defaults_toml: str) -> str:
    """The Markdown page of every config key, from the ``Config`` dataclasses and the
    comments of ``defaults_toml`` (the text of ``configs/default.toml``)."""
    sections: dict[str, dict[str, Any]] = {}
    _walk(Config, Config(), "", sections)
    sections.pop("", None)
    comments = _parse_defaults(defaults_toml)
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by `towerrec config reference --out docs/config.md` from the config",
        "dataclasses and the comments of configs/default.toml: edit those, not this page. -->",
        "",
        "Every key of a run's config, its default and what it means. A run's settings are",
        "these defaults, then each `--config FILE` in turn, then each `--set section.key=value`",
        "([configuration.md](configuration.md) says how they combine);",
        "`towerrec config show` prints the resolved config as TOML. *Resume*: the keys that",
        "`towerrec train --resume` may change (every other difference is refused).",
        "`configs/default.toml` lists every key in TOML form.",
        "",
        " · ".join(f"[`{name}`](#{_slug(name)})" for name in sections),
    ]
    for name, keys in sections.items():
        lines += ["", f"## `{name}`", ""]
        for note in comments.get(name, _Section()).notes:
            lines += [_cell(note), ""]
        lines += ["| key | default | resume | meaning |", "|---|---|:---:|---|"]
        for key, value in keys.items():
            full = f"{name}.{key}"
            resume = "yes" if any(fnmatch.fnmatchcase(full, p) for p in RESUME_SAFE_KEYS) else ""
            default = _default(name, key, value, sections)
            lines.append(
                f"| `{full}` | {default} | {resume} | {_cell(_comment(name, key, comments))} |"
            )
    lines += _for_model_part(defaults_toml, comments)
    return "\n".join(lines) + "\n"


def _for_model_part(defaults_toml: str, comments: dict[str, _Section]) -> list[str]:
    """The models' own defaults (``[for_model.NAME.SECTION]`` of ``default.toml``)."""
    tables = tomllib.loads(defaults_toml).get("for_model", {})
    if not tables:
        return []
    lines = ["", "## Each model's own defaults: `[for_model]`", ""]
    for name in (n for n in comments if n.startswith("for_model.")):
        for note in comments[name].notes:
            lines += [_cell(note), ""]
    lines += ["| model | key | default for that model |", "|---|---|---|"]
    for model, sections in tables.items():
        for section, keys in sections.items():
            for key, value in keys.items():
                lines.append(f"| `{model}` | `{section}.{key}` | `{_literal(value)}` |")
    return lines
