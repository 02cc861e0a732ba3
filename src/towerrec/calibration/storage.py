"""Timing the storage a cached table's rows would live in: SSD and host memory.

A few seconds: a scratch file of ``size_mib`` in ``path`` (the SSD's mount) is
written and fsynced (write bandwidth), dropped from the page cache
(``posix_fadvise(DONTNEED)``, so reads reach the device), read sequentially
(read bandwidth), dropped again and read at ``reads`` random 4 KiB-aligned
offsets one at a time (latency at queue depth 1, median and p99). Host memory:
a 128 MiB in-memory copy (the CPU "device" tier's row traffic). The result is
the calibration JSON's ``storage`` section, which planner/tiers.py reads.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["measure_storage"]

_PAGE = 4096
_CHUNK = 4 << 20
_COPY_BYTES = 128 << 20


def _drop_cache(fd: int) -> bool:
    """Ask the kernel to forget the file's cached pages; False where it cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return True


def measure_storage(
    path: str | Path = ".", size_mib: int = 256, reads: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """SSD write/read bandwidth and random 4 KiB read latency in ``path``, and the host
    memory copy bandwidth; keys as planner/tiers.py's ``TierSpec``."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"storage path {str(folder)!r} is not a directory; point --ssd-path at a folder on "
            "the SSD that would back the tables"
        )
    if size_mib < 1 or reads < 1:
        raise ValueError(
            f"measure_storage needs size_mib >= 1 and reads >= 1 ({size_mib}, {reads})"
        )
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 255, _CHUNK, dtype=np.uint8).tobytes()
    total = size_mib << 20
    fd, name = tempfile.mkstemp(prefix="towerrec-storage-", dir=folder)
    try:
        start = time.perf_counter()
        written = 0
        while written < total:
            written += os.write(fd, block[: min(_CHUNK, total - written)])
        os.fsync(fd)
        write_s = time.perf_counter() - start
        dropped = _drop_cache(fd)
        start = time.perf_counter()
        offset = 0
        while offset < total:
            offset += len(os.pread(fd, _CHUNK, offset))
        read_s = time.perf_counter() - start
        _drop_cache(fd)
        offsets = rng.integers(0, total // _PAGE, reads) * _PAGE
        latencies = []
        for at in offsets.tolist():
            t0 = time.perf_counter()
            os.pread(fd, _PAGE, at)
            latencies.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(name)
    # Far larger than any CPU cache, so the copy runs at memory speed.
    src = np.resize(np.frombuffer(block, dtype=np.uint8), _COPY_BYTES)
    dst = np.empty_like(src)
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
    latencies.sort()
    return {
        "path": str(folder.resolve()),
        "bytes": total,
        "ssd_write_bandwidth": total / write_s,
        "ssd_read_bandwidth": total / read_s,
        "ssd_read_latency_s": statistics.median(latencies),
        "ssd_read_latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "random_reads": reads,
        "page_cache_dropped": dropped,
        # read + write of each byte
        "host_copy_bandwidth": 2 * src.nbytes / statistics.median(copies),
    }
