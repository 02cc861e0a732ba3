"""Process memory as the operating system counts it (Linux ``/proc``; rusage elsewhere).

- ``peak_rss_mb()``: the high-water mark of this process's resident memory.
- ``process_memory(pid)``: current RSS, PSS and USS of a process. RSS counts
  every page the process maps, shared or not: a worker forked from a trainer
  that holds the tables shows them in its RSS although it holds no copy. PSS
  splits each shared page among its sharers and USS counts only pages no
  other process has, so "does this worker hold its own copy of the tables?"
  is a question about USS.
"""

from __future__ import annotations

import os
import resource

__all__ = ["peak_rss_mb", "process_memory"]

_MIB = 1024 * 1024


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_memory(pid: int | None = None) -> dict[str, float]:
    """``{"rss_mb", "pss_mb", "uss_mb"}`` of process ``pid`` (default: this one), in MiB.

    Read from ``/proc/<pid>/smaps_rollup``; where that does not exist (not Linux,
    old kernels) only ``rss_mb`` of this process is known, from rusage.
    """
    path = f"/proc/{pid if pid is not None else os.getpid()}/smaps_rollup"
    try:
        with open(path) as f:
            fields = {}
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    fields[name] = int(parts[0]) * 1024
    except FileNotFoundError:
        if pid not in (None, os.getpid()):
            raise
        return {"rss_mb": peak_rss_mb()}
    private = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return {
        "rss_mb": fields.get("Rss", 0) / _MIB,
        "pss_mb": fields.get("Pss", 0) / _MIB,
        "uss_mb": private / _MIB,
    }
