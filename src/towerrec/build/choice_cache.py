"""The file where measured choices are kept, one per machine and workload.

``<cache dir>/choices.json``; the directory is ``$TOWERREC_CACHE_DIR`` when set, else
``$XDG_CACHE_HOME/towerrec``, else ``~/.cache/towerrec``::

    {"version": 1,
     "entries": {"<sha1 of kind, machine and workload>": {
         "kind": "backend" | "precision",
         "machine": {...},        # towerrec.hardware.machine_key
         "workload": {...},       # what was timed (choices.py)
         "choice": "fbgemm",
         "seconds": {"torch": 0.0148, "fbgemm": 0.0048},
         "load_per_core": 0.2,    # the 1-minute load average / cores when measured
         "measured": "2026-11-28T10:00:00"}}}

An entry is used only when its kind, machine and workload are this run's and its
choice is still one of the candidates; it is stale (measured again) when it was
measured on a busy machine (load per core above 1) and this one is quiet (below 0.5).
A file that cannot be read as such (truncated, another format) is ignored with a
warning and rewritten by the next measurement; entries of other machines stay. Writes
go to a temporary file renamed over the old one, so that a reader never sees half a
file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["CACHE_ENV", "ChoiceCache", "cache_dir", "load_per_core"]

log = logging.getLogger("towerrec")

CACHE_ENV = "TOWERREC_CACHE_DIR"
VERSION = 1
BUSY, QUIET = 1.0, 0.5  # load per core


def cache_dir() -> Path:
    """Where measured choices are kept (module doc)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "towerrec"


def load_per_core() -> float:
    """The 1-minute load average per core of the processes' CPUs (0 where unknown)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 0.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return load / max(1, cores or 1)


def _key(kind: str, machine: dict, workload: dict) -> str:
    text = json.dumps([kind, machine, workload], sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()


class ChoiceCache:
    """The measured choices of ``directory`` (default ``cache_dir()``)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.path = (directory if directory is not None else cache_dir()) / "choices.json"

    def _entries(self) -> dict[str, Any]:
        """The file's entries; {} (with a warning) where it is missing or damaged."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except OSError as e:
            log.warning("cannot read %s (%s); measuring again", self.path, e)
            return {}
        except ValueError as e:  # not JSON, or not UTF-8
            log.warning("%s is damaged (%s); it will be rewritten", self.path, e)
            return {}
        entries = data.get("entries") if isinstance(data, dict) else None
        if (
            not isinstance(data, dict)
            or data.get("version") != VERSION
            or not isinstance(entries, dict)
        ):
            log.warning(
                "%s is not a version-%d choice file; it will be rewritten", self.path, VERSION
            )
            return {}
        return entries

    def lookup(
        self, kind: str, machine: dict, workload: dict, candidates: Collection[str]
    ) -> dict[str, Any] | None:
        """The entry for ``kind`` on ``machine`` and ``workload``, or None where there is
        none or it does not hold (module doc)."""
        entry = self._entries().get(_key(kind, machine, workload))
        if entry is None:
            return None
        valid = (
            isinstance(entry, dict)
            and entry.get("kind") == kind
            and entry.get("machine") == machine
            and entry.get("workload") == workload
            and entry.get("choice") in candidates
        )
        if not valid:
            log.warning("%s: ignoring a %s entry that does not hold here", self.path, kind)
            return None
        measured_load = entry.get("load_per_core")
        busy_then = isinstance(measured_load, int | float) and measured_load > BUSY
        if busy_then and load_per_core() < QUIET:
            log.info(
                "the cached %s choice was measured on a busy machine (load %.1f per core); "
                "measuring again now that it is quiet",
                kind,
                measured_load,
            )
            return None
        return entry

    def store(
        self, kind: str, machine: dict, workload: dict, choice: str, seconds: dict[str, float]
    ) -> dict[str, Any]:
        """Record a measured choice (replacing this kind, machine and workload's old one)."""
        entry = {
            "kind": kind,
            "machine": machine,
            "workload": workload,
            "choice": choice,
            "seconds": seconds,
            "load_per_core": round(load_per_core(), 2),
            "measured": datetime.now().isoformat(timespec="seconds"),
        }
        entries = self._entries()
        entries[_key(kind, machine, workload)] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": VERSION, "entries": entries}, indent=1) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: the choice holds for this run alone
            log.warning("cannot write %s (%s); the choice is not kept for later runs", self.path, e)
        return entry
