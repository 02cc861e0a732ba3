"""A student's augmented stream: its periods with the teacher's logit on every row.

``towerrec distill serve`` (``workflows/distill/augment.py``) writes, per watched student, a
directory in the towerrec cache format whose parts are the student's periods with two
more columns::

    AUG_DIR/manifest.json        cache manifest; "source": "augmented", the student's
                                 "stream" (num_periods, period_rows) and "teacher"
    AUG_DIR/parts/period-00000/  the student's columns of period 0, plus
        train.example_id.bin     int64   [rows]
        train.teacher_logit.bin  float32 [rows]  the teacher's logit of the row's example

A shard is listed in the manifest only once it is complete (written to a temp
directory, fsynced, renamed), so readers go by the manifest alone. Its dense columns are
the source's values, which the teacher scored; the reader applies the manifest's
``stream.dense_transform`` (``data/period_files.py``), so the student reads what a run
on the source itself reads.

``AugmentedPeriods(dir, timeout_s)`` is a ``PeriodSource`` over such a directory: its
batches carry ``teacher_logits``. It may start before the service has written
anything: it waits (polling) for the manifest and for each period's shard up to
``timeout_s`` and then fails naming the period and the service command. A shard
without a teacher-logit column or with a non-finite logit is refused, naming the shard
and the row. Configured as ``data.source = "augmented"`` with ``data.augmented.dir``
and ``data.augmented.wait_s`` (``AugmentedConfig``); ``towerrec replay`` trains on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from towerrec.data.batch import Batch, DataSchema
from towerrec.data.cache import (
    CacheError,
    map_column,
    open_part,
    read_manifest,
    schema_from_manifest,
    verify_part,
)
from towerrec.data.json_shape import COUNT, check_shape
from towerrec.data.loader import SplitRows
from towerrec.data.period_files import EXAMPLE_ID, SPLIT, stream_dense_transform
from towerrec.data.periods import period_rank_batches
from towerrec.utils import at_least, positive

__all__ = [
    "AUGMENTED",
    "TEACHER_LOGIT",
    "AugmentedConfig",
    "AugmentedPeriods",
    "AugmentedShard",
    "AugmentedTimeout",
    "open_shard",
]

log = logging.getLogger("towerrec")

AUGMENTED = "augmented"
TEACHER_LOGIT = "teacher_logit"
SERVICE_COMMAND = "towerrec distill serve --teacher EXPORT_DIR --watch STUDENT_DIR --out OUT"


class AugmentedTimeout(ValueError):
    """A period's shard did not land within the wait; the message names the service."""


@dataclass(frozen=True)
class AugmentedConfig:
    """``data.augmented``: the student's augmented directory (``OUT/<student>`` of the
    service) and how long to wait for a period's shard to land, in seconds."""

    dir: str = ""
    wait_s: float = 600.0
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        at_least("data.augmented.wait_s", self.wait_s, 0, unit="seconds")
        positive("data.augmented.poll_s", self.poll_s, unit="seconds")


@dataclass
class AugmentedShard:
    """One augmented period, memory-mapped and checked."""

    period: int
    rows: SplitRows
    example_ids: np.ndarray  # int64 [n]
    teacher_logits: np.ndarray  # float32 [n], finite


def open_shard(
    path: Path, entry: dict[str, Any], schema: DataSchema, single: list[str], multi: list[str]
) -> AugmentedShard:
    """Shard ``entry`` of the augmented directory ``path``: checksums, the teacher-logit
    column present and finite (module docstring)."""
    shard = path / "parts" / entry["name"]
    column = f"{SPLIT}.{TEACHER_LOGIT}.bin"
    if column not in entry["files"]:
        raise ValueError(
            f"augmented shard {shard} (period {entry['period']}) has no teacher-logit column "
            f"({column}): it was not written by the augmentation service; delete {path} and "
            f"run `{SERVICE_COMMAND}` again"
        )
    verify_part(path, entry)
    splits = open_part(path, entry, schema.num_dense, single, multi)
    if SPLIT not in splits:
        raise ValueError(
            f"augmented shard {shard} (period {entry['period']}): its manifest entry lists no "
            f"{SPLIT!r} rows (splits: {sorted(splits)}); the manifest is damaged: delete "
            f"{path} and run `{SERVICE_COMMAND}` again"
        )
    columns = splits[SPLIT]
    logits = map_column(path, entry["name"], SPLIT, TEACHER_LOGIT, np.float32, columns.rows)
    bad = np.flatnonzero(~np.isfinite(logits))
    if bad.size:
        raise ValueError(
            f"augmented shard {shard} (period {entry['period']}): the teacher logit of row "
            f"{int(bad[0])} is {float(logits[bad[0]])} ({bad.size} non-finite in all); the "
            f"teacher produced an invalid score: check the teacher, delete {path} and run "
            f"`{SERVICE_COMMAND}` again"
        )
    ids = map_column(path, entry["name"], SPLIT, EXAMPLE_ID, np.int64, columns.rows)
    return AugmentedShard(int(entry["period"]), SplitRows([columns]), ids, logits)


# What a trainer reads of an augmented manifest besides a cache's (data/json_shape.py).
AUGMENTED_SHAPE = {
    "stream": {"num_periods": COUNT, "period_rows": [COUNT]},
    "parts": [{"period": COUNT}],
}


class AugmentedPeriods:
    """``PeriodSource`` over a student's augmented directory (module docstring)."""

    def __init__(self, path: str | Path, timeout_s: float = 600.0, poll_s: float = 0.2) -> None:
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        manifest = self._wait(lambda m: True, "its manifest (no shard written yet)")
        if manifest.get("source") != AUGMENTED:
            raise CacheError(
                f"{self.path} is not an augmented directory (its manifest's source is "
                f"{manifest.get('source')!r}); point data.augmented.dir at OUT/<student> of "
                f"`{SERVICE_COMMAND}`"
            )
        try:
            check_shape(manifest, AUGMENTED_SHAPE)
            stream = manifest["stream"]
            if len(stream["period_rows"]) != stream["num_periods"]:
                raise ValueError(
                    f"stream.period_rows lists {len(stream['period_rows'])} periods, "
                    f"stream.num_periods says {stream['num_periods']}"
                )
        except ValueError as e:
            raise CacheError(
                f"{self.path}/manifest.json is damaged ({e}); delete {self.path} and run "
                f"`{SERVICE_COMMAND}` again"
            ) from None
        self._schema, self._single, self._multi = schema_from_manifest(manifest["schema"])
        # the student's period files hold the source's dense values; the student reads
        # them through the transform a run on that source fits (data/period_files.py)
        self.dense_transform = stream_dense_transform(
            manifest, self.path, self._schema.num_dense,
            f"augment its student's period files again (`{SERVICE_COMMAND}`, over files "
            "written by `towerrec data periods` of this towerrec)",
        )  # fmt: skip
        self._rows = [int(n) for n in manifest["stream"]["period_rows"]]
        self._shards: dict[int, AugmentedShard] = {}

    def _read(self) -> dict[str, Any] | None:
        if not (self.path / "manifest.json").is_file():
            return None
        return read_manifest(self.path)

    def _wait(self, ready: Any, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            manifest = self._read()
            if manifest is not None and ready(manifest):
                return manifest
            if time.monotonic() >= deadline:
                raise AugmentedTimeout(
                    f"{what} of {self.path} has not landed after {self.timeout_s:g} s: is the "
                    f"augmentation service running (`{SERVICE_COMMAND}`, with --out the parent "
                    "of this directory)? Raise data.augmented.wait_s to wait longer"
                )
            time.sleep(self.poll_s)

    @property
    def schema(self) -> DataSchema:
        return self._schema

    @property
    def num_periods(self) -> int:
        return len(self._rows)

    def period_rows(self, period: int) -> int:
        if not 0 <= period < self.num_periods:
            raise ValueError(f"period {period} is not in [0, {self.num_periods})")
        return self._rows[period]

    def shard(self, period: int) -> AugmentedShard:
        """Period ``period``'s shard, waiting for it to land (``timeout_s``)."""
        self.period_rows(period)
        if period not in self._shards:
            manifest = self._wait(lambda m: len(m["parts"]) > period, f"period {period}")
            entry = manifest["parts"][period]
            if int(entry["period"]) != period:
                raise ValueError(
                    f"{self.path}/manifest.json lists period {entry['period']} where period "
                    f"{period} belongs: the directory is damaged; delete it and run "
                    f"`{SERVICE_COMMAND}` again"
                )
            shard = open_shard(self.path, entry, self._schema, self._single, self._multi)
            if shard.rows.rows != self._rows[period]:
                raise ValueError(
                    f"augmented period {period} of {self.path} has {shard.rows.rows} rows, the "
                    f"stream declares {self._rows[period]}; delete it and augment again"
                )
            self._shards = {period: shard}  # one period mapped at a time
        return self._shards[period]

    def period_batches(
        self, period: int, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]:
        shard = self.shard(period)
        for lo, hi in period_rank_batches(self.period_rows(period), batch_size, rank, world_size):
            if hi > lo:
                rows = np.arange(lo, hi)
                batch = shard.rows.gather(rows, self._single, self._multi)
                if self.dense_transform is not None:
                    self.dense_transform.apply(batch.dense.numpy())
                teacher = torch.from_numpy(np.array(shard.teacher_logits[lo:hi]))
                yield replace(batch, teacher_logits=teacher, validate=False)

    def period_oracle(self, period: int) -> None:
        """Recorded data has no known click probabilities."""
        return None
