"""Fuzz targets of the line readers: Criteo TSV lines, libFM lines and field maps.

Each generates lines that are mostly almost right (a field too many, a bad digit,
a stray carriage return, bytes that are not UTF-8) and compares what the reader
kept with a reference reader written here from the format's description: every
line is kept with the reference's values or skipped and counted at its own line.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from towerrec.bench.fuzz_core import FuzzFailure, FuzzTarget, refused

__all__ = ["TEXT_TARGETS"]

_JUNK = "0123456789abcdefABCDEF+-.: \t\r\x0c\x00xé#"


def _criteo_lines() -> Any:
    from hypothesis import strategies as st

    label = st.sampled_from(["0", "1", "", "2", "01", "+1", " 1", "1.0", "-0"])
    integer = st.one_of(
        st.just(""),
        st.integers(-(2**63), 2**63 - 1).map(str),
        st.tuples(
            st.sampled_from(["", " ", "+", "-", "00", "- "]),
            st.integers(0, 2**64),
            st.sampled_from(["", " ", "\x0c", ".0"]),
        ).map(lambda t: f"{t[0]}{t[1]}{t[2]}"),
        st.text(_JUNK, max_size=4),
    )
    hexa = st.one_of(
        st.just(""),
        st.integers(0, 2**64 - 1).map(lambda v: f"{v:x}"),
        st.integers(0, 2**32 - 1).map(lambda v: f"{v:08X}"),
        st.text("0123456789abcdefABCDEFg ", max_size=18),
    )
    good = st.tuples(
        label, st.lists(integer, min_size=13, max_size=13), st.lists(hexa, min_size=26, max_size=26)
    )
    line = st.one_of(
        good.map(lambda t: "\t".join([t[0], *t[1], *t[2]])),
        good.map(lambda t: "\t".join([t[0], *t[1], *t[2][:-1]])),  # a field short
        good.map(lambda t: "\t".join([t[0], *t[1], *t[2], ""])),  # a field too many
        st.text(_JUNK, max_size=30),
    )
    as_bytes = st.one_of(
        line.map(str.encode),
        st.tuples(line, st.integers(0, 40)).map(lambda t: t[0].encode()[: t[1]] + b"\xff"),
    )
    return st.tuples(
        st.lists(as_bytes, min_size=1, max_size=12), st.booleans(), st.sampled_from([64, 1 << 20])
    )


_INT = re.compile(rb"-?[0-9]+")
_HEXA = re.compile(rb"^[0-9a-fA-F]{1,16}$")


def _criteo_reference(line: bytes) -> tuple[float, list[float], list[int], list[bool]] | None:
    """What the format's description says a line holds; None for a malformed one."""
    fields = line.split(b"\t")
    if len(fields) != 40 or fields[0] not in (b"0", b"1"):
        return None
    dense, values, missing = [], [], []
    for text in fields[1:14]:
        number = text.strip(b" ")
        if text and not (_INT.fullmatch(number) and -(2**63) <= int(number) < 2**63):
            return None
        dense.append(float(np.log1p(np.float32(max(int(number or 0), 0)))))
    for text in fields[14:]:
        if text and not _HEXA.match(text):
            return None
        values.append(int(text, 16) if text else 0)
        missing.append(not text)
    return float(fields[0] == b"1"), dense, values, missing


def _check_criteo(example: tuple[list[bytes], bool, int], scratch: Path) -> None:
    from towerrec.data.criteo import parsed_chunks
    from towerrec.data.text_input import Problems

    lines, last_newline, chunk_bytes = example
    if not last_newline and not lines[-1]:
        last_newline = True  # a file's last line without its newline is not empty
    path = scratch / "day_0"
    path.write_bytes(b"\n".join(lines) + (b"\n" if last_newline else b""))
    problems = Problems()
    read = []
    for _, parsed in parsed_chunks(path, problems, chunk_bytes):
        read.append(parsed)
    ended = [True] * (len(lines) - 1) + [last_newline]  # CR LF ends a line as LF does
    expected = {
        i + 1: _criteo_reference(line[:-1] if end and line.endswith(b"\r") else line)
        for i, (line, end) in enumerate(zip(lines, ended))
    }
    kept = [n for n, row in expected.items() if row is not None]
    got_lines = [int(n) for p in read for n in p.lines]
    skipped = sorted({n for p in read for n, _ in p.problems})
    if got_lines != kept or skipped != [n for n in expected if n not in kept]:
        raise FuzzFailure(
            f"kept lines {got_lines} and skipped {skipped}; the format says keep {kept}"
        )
    if problems.total != len(skipped):
        raise FuzzFailure(f"counted {problems.total} malformed rows, skipped {len(skipped)}")
    rows = [
        (
            float(p.labels[i]),
            p.dense[i].tolist(),
            [int(v) for v in p.values[i]],
            p.missing[i].tolist(),
        )
        for p in read
        for i in range(len(p.lines))
    ]
    for n, got in zip(kept, rows):
        if got != expected[n]:
            raise FuzzFailure(f"line {n} read as {got}, not {expected[n]}")


def _field_maps() -> Any:
    from hypothesis import strategies as st

    word = st.text("abcxyz_09 -#\t\r:é", max_size=8)
    number = st.one_of(st.integers(-3, 40).map(str), word)
    kind = st.sampled_from(["", " single", " multi", " dense", " other", " multi extra"])
    line = st.one_of(
        st.tuples(st.sampled_from(["f", "g", "h", "f"]), number, number, kind).map(
            lambda t: f"{t[0]} {t[1]} {t[2]}{t[3]}"
        ),
        word,
        st.just("# a comment"),
    )
    return st.lists(line, max_size=6).map("\n".join)


def _check_field_map(text: str, scratch: Path) -> None:
    from towerrec.data.libfm import read_field_map

    path = scratch / "fields.txt"
    path.write_text(text)
    fields = refused(lambda: read_field_map(path), str(path))
    if fields is None:
        return
    spans = list(zip(fields.firsts, fields.lasts))
    if spans != sorted(spans) or any(a[1] + 1 != b[0] for a, b in itertools.pairwise(spans)):
        raise FuzzFailure(f"field map {text!r} read as overlapping or gapped spans {spans}")
    if any(k not in ("single", "multi", "dense") for k in fields.kinds):
        raise FuzzFailure(f"field map {text!r} read with kinds {fields.kinds}")


_LIBFM_FIELDS = "a 0 2\nb 3 5 multi\nc 6 7 dense\n"


def _libfm_lines() -> Any:
    from hypothesis import strategies as st

    index = st.one_of(st.integers(-1, 9).map(str), st.text("0123456789x-+ ", max_size=3))
    value = st.one_of(
        st.sampled_from(["1", "0.5", "-2", "1e3", "nan", "inf", "-inf", "", "x"]),
        st.floats(allow_nan=False, allow_infinity=False, width=32).map(repr),
    )
    token = st.tuples(index, st.sampled_from([":", "", "::"]), value).map("".join)
    label = st.sampled_from(["1", "0", "-1", "2", "0.5", "nan", "inf", "x", ""])
    line = st.tuples(label, st.lists(token, max_size=5)).map(lambda t: " ".join([t[0], *t[1]]))
    junk = st.text("0123456789: .\t\r\x0c\x1c\x85", max_size=12)
    return st.lists(st.one_of(line, junk), min_size=1, max_size=10)


def _libfm_reference(line: str) -> tuple[float, list[float], int, list[int]] | None:
    """The libFM line of ``_LIBFM_FIELDS`` as the format says: (label, dense [2], a's id,
    b's indices); None when malformed."""
    tokens = line.split()
    if not tokens:
        return None
    try:
        label = float(tokens[0])
    except ValueError:
        return None
    if not math.isfinite(label):
        return None
    dense, single, multi = [0.0, 0.0], 0, []
    for token in tokens[1:]:
        index_text, sep, value_text = token.partition(":")
        try:
            index, value = int(index_text), float(value_text)
        except ValueError:
            return None
        if not sep or not 0 <= index <= 7 or not math.isfinite(value):
            return None
        if index <= 2:
            if single:
                return None
            single = 1 + index
        elif index <= 5:
            multi.append(index - 3)
        else:
            dense[index - 6] = float(np.float32(value))
    return (1.0 if label > 0 else 0.0), dense, single, multi


def _check_libfm(lines: list[str], scratch: Path) -> None:
    from towerrec.data.cache import open_cache
    from towerrec.data.libfm import preprocess_libfm
    from towerrec.data.splits import Split

    fields, data = scratch / "fields.txt", scratch / "train.libfm"
    fields.write_text(_LIBFM_FIELDS)
    data.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
    expected = {n: _libfm_reference(line) for n, line in enumerate(lines, 1)}
    kept = [n for n, row in expected.items() if row is not None]
    out = scratch / "cache"
    manifest = refused(
        lambda: preprocess_libfm([data], out, fields, split=Split(0.0, 0)), str(data)
    )
    if manifest is None:
        if kept:
            raise FuzzFailure(f"refused a file with {len(kept)} good lines")
        return
    skipped = manifest["report"]["malformed"]
    store = open_cache(out)
    part = store.splits["train"][0] if store.splits.get("train") else None
    rows = part.rows if part is not None else 0
    if rows != len(kept) or skipped != len(lines) - len(kept):
        raise FuzzFailure(f"kept {rows} rows and skipped {skipped}; the format says keep {kept}")
    if part is None:
        return
    labels = part.labels.tolist()
    dense = part.dense.tolist()
    single = part.sparse[:, 0].tolist()
    for i, n in enumerate(kept):
        label, d, s, _ = expected[n]  # type: ignore[misc]
        if (labels[i], d, s) != (label, dense[i], single[i]):
            raise FuzzFailure(
                f"line {n} {lines[n - 1]!r} read as {(labels[i], dense[i], single[i])}, "
                f"not {(label, d, s)}"
            )


TEXT_TARGETS = [
    FuzzTarget(
        "criteo_lines",
        "Criteo TSV lines -> data.criteo.parse_chunk, against a reference reader",
        _criteo_lines,
        _check_criteo,
    ),
    FuzzTarget(
        "libfm_field_map",
        "libFM field map files -> data.libfm.read_field_map",
        _field_maps,
        _check_field_map,
    ),
    FuzzTarget(
        "libfm_lines",
        "libFM lines -> towerrec data libfm's cache, against a reference reader",
        _libfm_lines,
        _check_libfm,
    ),
]
