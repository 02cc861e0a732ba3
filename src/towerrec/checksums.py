"""Checksums of a directory's files: ``checksums.json``, written into a directory after
its files and before it is published (renamed into place), checked before the directory
is read back. Checkpoints (``train/checkpoint.py``) and exported artefacts
(``serve/export.py``; ``serve/artefact.py`` reads the same format on its own) carry one.

::

    checksums.json   {"format": "towerrec-checksums", "version": 1, "hash": "sha256",
                      "files": {"<path under the directory, '/'-separated>":
                                    {"bytes": <size>, "sha256": "<hex digest>"}, ...}}

Every regular file under the directory is listed except ``checksums.json`` itself. A
file that is missing, has another size or another digest is a problem (``problems``);
files that are not listed are not read back as part of the directory and are ignored.

Why SHA-256: what the checksums guard against is damage (a flipped bit, a torn or
truncated write, a file of another checkpoint copied in), not an attacker, who could
rewrite ``checksums.json`` as easily as the files. For damage a CRC32 would do (it
catches every burst of up to 32 bits and other damage but for one case in 2**32);
SHA-256 catches it too, is in the standard library (``hashlib``, OpenSSL), runs on the
SHA extensions of current x86 and ARM CPUs, where it outruns BLAKE2b (docs/
reliability.md, "Checkpoints"), and is what the binary cache's manifest already
records. The file names the hash, so another can follow without a new format.

``json_digest`` is the digest a JSON file carries of its own other keys (the cache
manifest's ``manifest_sha256``, cost data, a locality profile, a sweep's run records):
it covers the values, not the file's layout, so a rewrite with other spacing still
matches and a changed number does not.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKSUMS",
    "ChecksumError",
    "assign",
    "digests",
    "file_digest",
    "json_digest",
    "list_files",
    "problems",
    "read_checksums",
    "sealed",
    "unseal",
    "write_checksums",
]

CHECKSUMS = "checksums.json"
FORMAT = "towerrec-checksums"
VERSION = 1
HASH = "sha256"
_BLOCK = 1 << 22  # bytes read per update: large enough that hashlib runs without the GIL

Entries = dict[str, dict[str, Any]]  # path under the directory -> {"bytes", "sha256"}


class ChecksumError(ValueError):
    """A ``checksums.json`` that cannot be read (malformed, or of an unknown format)."""


def list_files(root: str | Path) -> list[str]:
    """The regular files under ``root`` (``/``-separated, sorted), ``checksums.json`` aside."""
    root = Path(root)
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory) / name
            if path.is_file() and not path.is_symlink():
                found.append(path.relative_to(root).as_posix())
    return sorted(f for f in found if f != CHECKSUMS)


def file_digest(path: str | Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of one file."""
    digest, size = hashlib.new(HASH), 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            size += len(block)
    return {"bytes": size, HASH: digest.hexdigest()}


def json_digest(body: Any) -> str:
    """SHA-256 of ``body`` as canonical JSON (sorted keys, no spaces): the same for the
    value written and the value read back, whatever the file's layout."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def sealed(body: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``body`` with ``key`` holding the ``json_digest`` of its other keys (an old digest
    under ``key`` is replaced)."""
    rest = {k: v for k, v in body.items() if k != key}
    return {**rest, key: json_digest(rest)}


def unseal(data: Any, key: str) -> bool:
    """Pop ``key`` from the dict ``data``; False when it held a digest its other keys do
    not match (True when there is none: a file written before the digest, or not a dict)."""
    if not isinstance(data, dict) or key not in data:
        return True
    return data.pop(key) == json_digest(data)


def digests(root: str | Path, names: Iterable[str]) -> Entries:
    """The entries of ``names`` (paths under ``root``)."""
    return {name: file_digest(Path(root) / name) for name in names}


def assign(sizes: Mapping[str, int], workers: int) -> list[list[str]]:
    """Split files over ``workers`` so each hashes about as many bytes (largest first,
    each to the least loaded worker); the same split for the same input."""
    loads = [0] * workers
    shares: list[list[str]] = [[] for _ in range(workers)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        worker = loads.index(min(loads))
        shares[worker].append(name)
        loads[worker] += sizes[name]
    return shares


def write_checksums(root: str | Path, entries: Entries) -> None:
    """Write ``root/checksums.json`` (whole, then renamed into place)."""
    body = {
        "format": FORMAT,
        "version": VERSION,
        "hash": HASH,
        "files": dict(sorted(entries.items())),
    }
    path = Path(root) / CHECKSUMS
    tmp = path.with_name(CHECKSUMS + ".part")
    with open(tmp, "w") as f:
        f.write(json.dumps(body, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_checksums(root: str | Path) -> Entries | None:
    """The entries of ``root/checksums.json``; None when there is none."""
    path = Path(root) / CHECKSUMS
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT or body.get("hash") != HASH:
            raise ValueError(f"format {body.get('format')!r} with hash {body.get('hash')!r}")
        if body.get("version") != VERSION:
            raise ValueError(f"version {body.get('version')!r}, this towerrec reads {VERSION}")
        files = body["files"]
        return {
            str(name): {"bytes": int(entry["bytes"]), HASH: str(entry[HASH])}
            for name, entry in files.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ChecksumError(f"{path} is unreadable ({type(e).__name__}: {e})") from None


def problems(root: str | Path, entries: Entries) -> list[str]:
    """What is wrong with the files ``entries`` lists under ``root``: one line per file
    that is missing, has another size or another digest (empty: all intact)."""
    root = Path(root)
    found = []
    for name, expected in sorted(entries.items()):
        path = root / name
        if not path.is_file():
            found.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != expected["bytes"]:
            found.append(f"{name} has {size} bytes, {CHECKSUMS} says {expected['bytes']}")
        elif file_digest(path)[HASH] != expected[HASH]:
            found.append(f"{name} does not match its {HASH} in {CHECKSUMS}")
    return found
