"""The data augmentation service: ``towerrec distill serve``.

External distillation (ExFM): a teacher exported with ``towerrec export`` scores the
students' training data as it arrives, and the students read it with the teacher's
logit as a column. The service is a separate process; it meets the producers and the
trainers through files only::

    STUDENT_DIR (producer: towerrec data periods)        OUT (this service)
      manifest.json  complete periods, in order    ──►     memo/<student>.<period>.npz
      parts/period-0000p/  columns + example_id            counters.json
                                                           <student>/manifest.json
                                                           <student>/parts/period-0000p/
                                                             columns + example_id + teacher_logit
                                                      ──►  trainer: AugmentedPeriods(OUT/<student>)

Per student and period, in period order (``augment_period``):

1. read the period once the producer's manifest lists it (checksums checked);
2. join by example id against the memo: the ids the teacher has not scored yet (first
   row of each) go to the teacher, in batches; every other row is a duplicate served
   from the memo (an id seen earlier in this or another student, or twice here);
3. write the new ids' logits and the period's counts as one memo file (temp, fsync,
   rename): the teacher never scores an id again, across restarts and students;
4. write the augmented shard (``PartWriter``: temp directory, fsync, rename), then
   append it to the student's augmented manifest (temp, fsync, rename);
5. rewrite ``counters.json`` (teacher calls, duplicates, rows, shards written; summed
   from the memo files and the manifests, so it is right after any restart).

A kill at any point loses and duplicates nothing: a period is done when its
augmented manifest lists it; before that, a restart writes its shard again (from the
memo when step 3 was reached, so the teacher is not called again). ``teacher_calls``
counts rows the teacher scored and the memo kept; work lost to a kill between steps 2
and 3 is redone and counted once.

Errors, each naming the fix: a teacher whose features are not the student's (dense
width, a missing feature, a different id space), a producer manifest that lists
periods out of order or with a gap, a period that changed after it was augmented, an
output directory augmented with another teacher.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from towerrec.data.augmented import AUGMENTED, TEACHER_LOGIT
from towerrec.data.batch import DataSchema
from towerrec.data.cache import (
    CacheError,
    PartWriter,
    fsync_path,
    read_manifest,
    sha256_file,
    write_manifest,
)
from towerrec.data.loader import SplitRows
from towerrec.data.period_files import (
    EXAMPLE_ID,
    SPLIT,
    PeriodFile,
    StreamManifest,
    open_period,
    part_name,
    read_stream,
)
from towerrec.serve.artefact import PROGRAM, ArtefactError, InferenceArtefact, load_artefact

__all__ = ["COUNTERS", "CRASH_ENV", "AugmentService", "Counts", "check_teacher"]

log = logging.getLogger("towerrec")

COUNTERS = "counters.json"
MEMO = "memo"
# Test hook: "STUDENT:PERIOD:STAGE" kills the service (SIGKILL) at that point of that
# period; STAGE is memo (memo file written), write (shard files written, not renamed) or
# shard (shard renamed, not yet in the manifest).
CRASH_ENV = "TOWERREC_AUGMENT_CRASH"
WAITING_LOG_S = 30.0  # a progress line at most this often while waiting for periods


def _crash_point(student: str, period: int, stage: str) -> None:
    if os.environ.get(CRASH_ENV) == f"{student}:{period}:{stage}":
        os.kill(os.getpid(), signal.SIGKILL)


def check_teacher(teacher: InferenceArtefact, schema: DataSchema, student: Path) -> None:
    """The teacher must read what the student's rows hold: the same dense width and every
    sparse feature it reads, with the same id space."""
    problems = []
    if schema.num_dense != teacher.num_dense:
        problems.append(
            f"dense width: the teacher reads {teacher.num_dense}, the student has "
            f"{schema.num_dense}"
        )
    rows = {f.name: f.num_embeddings for f in schema.sparse}
    missing = [f.name for f in teacher.features if f.name not in rows]
    if missing:
        problems.append(f"feature(s) {missing} the teacher reads are not in the student's")
    problems += [
        f"feature {f.name!r}: the teacher's table has {f.num_embeddings} rows, the student's "
        f"ids span {rows[f.name]}"
        for f in teacher.features
        if f.name in rows and rows[f.name] != f.num_embeddings
    ]
    if problems:
        raise ArtefactError(
            f"the teacher {teacher.path} does not match the student {student}: "
            f"{'; '.join(problems)} (the student has {sorted(rows)}). Export a teacher "
            "trained on data of the student's format, or write the student's periods from "
            "the teacher's data source"
        )


@dataclass
class Counts:
    """Rows of one student's periods: scored by the teacher, served from the memo."""

    teacher_calls: int = 0
    duplicates: int = 0
    rows: int = 0
    shards_written: int = 0

    def add(self, other: Counts) -> None:
        self.teacher_calls += other.teacher_calls
        self.duplicates += other.duplicates
        self.rows += other.rows
        self.shards_written += other.shards_written


class Memo:
    """example id -> teacher logit, persisted as one file per (student, period)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.ids = np.zeros(0, dtype=np.int64)  # sorted
        self.logits = np.zeros(0, dtype=np.float32)
        self.counts: dict[tuple[str, int], Counts] = {}
        loaded_ids, loaded_logits = [], []
        for file in sorted(path.glob("*.npz")):
            student, _, period = file.stem.rpartition(".")
            try:
                with np.load(file) as data:
                    loaded_ids.append(data["ids"])
                    loaded_logits.append(data["logits"])
                    self.counts[(student, int(period))] = Counts(
                        int(data["teacher_calls"]), int(data["duplicates"]), int(data["rows"])
                    )
            # What np.load and zipfile raise for a cut or changed file.
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, RuntimeError) as e:
                raise CacheError(
                    f"memo file {file} is damaged or truncated ({type(e).__name__}: {e}); "
                    "give a fresh --out directory (if the student's augmented manifest does "
                    "not list that period yet, deleting the file is enough: the period is "
                    "scored again)"
                ) from None
        if loaded_ids:
            self._merge(np.concatenate(loaded_ids), np.concatenate(loaded_logits))

    def _merge(self, ids: np.ndarray, logits: np.ndarray) -> None:
        ids = np.concatenate([self.ids, ids])
        logits = np.concatenate([self.logits, logits])
        order = np.argsort(ids, kind="stable")
        self.ids, self.logits = ids[order], logits[order]
        if self.ids.size > 1 and bool((np.diff(self.ids) == 0).any()):
            dup = int(self.ids[1:][np.diff(self.ids) == 0][0])
            raise CacheError(
                f"the memo in {self.path} holds example id {dup} twice: it is damaged; "
                "delete the output directory and augment again"
            )

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Whether each id is known, and its logit (0 where unknown)."""
        at = np.searchsorted(self.ids, ids).clip(max=max(self.ids.size - 1, 0))
        known = (self.ids[at] == ids) if self.ids.size else np.zeros(ids.shape, dtype=bool)
        return known, np.where(known, self.logits[at] if self.ids.size else 0, 0).astype(np.float32)

    def add(
        self, student: str, period: int, ids: np.ndarray, logits: np.ndarray, counts: Counts
    ) -> None:
        """Persist (temp, fsync, rename) and remember one period's new ids."""
        final = self.path / f"{student}.{period}.npz"
        tmp = final.with_name(final.name + ".tmp")  # not *.npz: a leftover is never loaded
        with open(tmp, "wb") as f:
            np.savez(
                f, ids=ids, logits=logits, teacher_calls=counts.teacher_calls,
                duplicates=counts.duplicates, rows=counts.rows,
            )  # fmt: skip
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_path(self.path)
        self._merge(ids, logits)
        self.counts[(student, period)] = counts


@dataclass
class Student:
    """One watched period directory and its augmented directory."""

    name: str
    watch: Path
    out: Path
    manifest: dict[str, Any] | None = None  # the augmented manifest, once created
    checked: bool = False
    done_checksums: dict[int, str] = field(default_factory=dict)

    @property
    def done(self) -> int:
        return 0 if self.manifest is None else len(self.manifest["parts"])


class AugmentService:
    """The service's state over its output directory (module docstring)."""

    def __init__(
        self, teacher: str | Path, watch: list[str | Path], out: str | Path, batch_size: int = 4096
    ) -> None:
        if not watch:
            raise ValueError("give at least one student directory to watch (--watch DIR)")
        if batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
        self.teacher = load_artefact(teacher)
        self.teacher_id = {
            "path": str(Path(teacher).resolve()),
            "program_sha256": sha256_file(Path(teacher) / PROGRAM),
        }
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.batch_size = batch_size
        self.students: list[Student] = []
        for path in map(Path, watch):
            name = path.resolve().name
            if name == MEMO:
                raise ValueError(
                    f"a watched directory is named {name!r}, which OUT/{MEMO} (the memo) "
                    "takes; rename the student's directory"
                )
            if name in {s.name for s in self.students}:
                raise ValueError(
                    f"two watched directories are named {name!r}; each student's augmented "
                    "data goes to OUT/<directory name>: give the students distinct names"
                )
            student = Student(name, path, self.out / name)
            if (student.out / "manifest.json").is_file():
                student.manifest = read_manifest(student.out)
                if (
                    student.manifest.get("teacher", {}).get("program_sha256")
                    != (self.teacher_id["program_sha256"])
                ):
                    raise ValueError(
                        f"{student.out} was augmented by another teacher "
                        f"({student.manifest.get('teacher', {}).get('path')}); augmenting on "
                        "would mix two teachers' logits: give a fresh --out directory"
                    )
                for entry in student.manifest["parts"]:
                    student.done_checksums[int(entry["period"])] = entry.get("student_files", "")
            self.students.append(student)
        self.memo = Memo(self.out / MEMO)
        for student in self.students:
            lost = [p for p in range(student.done) if (student.name, p) not in self.memo.counts]
            if lost:
                raise CacheError(
                    f"{student.out} lists periods {lost} whose memo files are missing from "
                    f"{self.memo.path}: the output directory is damaged; give a fresh --out "
                    "directory"
                )
        self.write_counters()

    # ------------------------------------------------------------------ one pass
    def step(self) -> int:
        """Augment every period that is complete and not yet augmented, student by
        student in period order; returns the shards written."""
        written = 0
        for student in self.students:
            if not (student.watch / "manifest.json").is_file():
                continue
            stream = read_stream(student.watch)
            complete = stream.complete()
            if not student.checked:
                check_teacher(self.teacher, stream.schema, student.watch)
                self._start(student, stream)
            self._check_done(student, stream, complete)
            for period in complete[student.done :]:
                self.augment_period(student, stream, period)
                written += 1
        return written

    def finished(self) -> bool:
        """Every student's every declared period augmented."""
        for student in self.students:
            if student.manifest is None:
                return False
            if student.done < int(student.manifest["stream"]["num_periods"]):
                return False
        return True

    def _start(self, student: Student, stream: StreamManifest) -> None:
        if student.manifest is None:
            manifest = {
                "source": AUGMENTED,
                "schema": stream.manifest["schema"],
                "stream": stream.manifest["stream"],
                "student": str(student.watch.resolve()),
                "teacher": self.teacher_id,
                "parts": [],
            }
            student.out.mkdir(parents=True, exist_ok=True)
            write_manifest(student.out, manifest, fsync=True)
            student.manifest = read_manifest(student.out)
        elif student.manifest["schema"] != stream.manifest["schema"]:
            raise ValueError(
                f"the schema of {student.watch} differs from the one {student.out} was "
                "augmented for; give a fresh --out directory"
            )
        student.checked = True

    def _check_done(self, student: Student, stream: StreamManifest, complete: list[int]) -> None:
        """Periods already augmented must still be the producer's, unchanged."""
        if len(complete) < student.done:
            raise ValueError(
                f"{student.watch} now lists {len(complete)} complete periods but "
                f"{student.done} were augmented from it: the producer's directory was "
                f"rewritten; give a fresh --out directory for the new stream"
            )
        for period, checksum in student.done_checksums.items():
            now = json.dumps(stream.entry(period)["files"], sort_keys=True)
            if now != checksum:
                raise ValueError(
                    f"period {period} of {student.watch} changed after it was augmented "
                    f"(into {student.out}): a period must not be rewritten; give a fresh "
                    "--out directory to augment the new data"
                )

    # ------------------------------------------------------------------ one period
    def augment_period(self, student: Student, stream: StreamManifest, period: int) -> None:
        assert student.manifest is not None and period == student.done
        data = open_period(stream, period)
        counts = self.memo.counts.get((student.name, period))
        if counts is None:  # not scored yet (else a restart: the memo has every id)
            counts = self._score(student, stream, data)
        _crash_point(student.name, period, "memo")
        known, logits = self.memo.lookup(np.asarray(data.example_ids))
        if not bool(known.all()):
            raise CacheError(
                f"the memo in {self.memo.path} lacks example ids of {student.name} period "
                f"{period} although it records the period as scored: it is damaged; delete "
                f"{self.out} and augment again"
            )
        self._write_shard(student, stream, data, logits, counts)
        self.write_counters()
        log.info(
            "augmented %s period %d: %d rows, %d teacher calls, %d duplicates from the memo",
            student.name, period, counts.rows, counts.teacher_calls, counts.duplicates,
        )  # fmt: skip

    def _score(self, student: Student, stream: StreamManifest, data: PeriodFile) -> Counts:
        ids = np.asarray(data.example_ids)
        unique, first = np.unique(ids, return_index=True)
        known, _ = self.memo.lookup(unique)
        new_ids, rows = unique[~known], first[~known]
        logits = np.empty(len(rows), dtype=np.float32)
        source = SplitRows([data.columns])
        single, multi = stream.single, stream.multi  # gather names the columns in order
        for lo in range(0, len(rows), self.batch_size):
            batch = source.gather(rows[lo : lo + self.batch_size], single, multi)
            kjt = batch.sparse
            out = self.teacher.logits(batch.dense, kjt.keys(), kjt.values(), kjt.lengths())
            logits[lo : lo + len(out)] = out.float().numpy()
        bad = np.flatnonzero(~np.isfinite(logits))
        if bad.size:
            raise ArtefactError(
                f"the teacher gave a non-finite logit ({logits[bad[0]]}) for example id "
                f"{int(new_ids[bad[0]])} of {student.name} period {data.period}; the teacher "
                "is broken: export it again from a healthy run"
            )
        counts = Counts(len(new_ids), len(ids) - len(new_ids), len(ids))
        self.memo.add(student.name, data.period, new_ids, logits, counts)
        return counts

    def _write_shard(
        self,
        student: Student,
        stream: StreamManifest,
        data: PeriodFile,
        logits: np.ndarray,
        counts: Counts,
    ) -> None:
        assert student.manifest is not None
        writer = PartWriter(student.out, part_name(data.period), stream.schema.num_dense,
                            stream.multi)  # fmt: skip
        try:
            columns = data.columns
            multi = {}
            for name in stream.multi:
                values, offsets = columns.multi[name]
                multi[name] = (np.asarray(values), np.diff(offsets).astype(np.int32))
            writer.append(SPLIT, np.asarray(columns.labels), np.asarray(columns.dense),
                          np.asarray(columns.sparse), multi)  # fmt: skip
            writer.append_column(SPLIT, EXAMPLE_ID, np.asarray(data.example_ids))
            writer.append_column(SPLIT, TEACHER_LOGIT, logits)
            _crash_point(student.name, data.period, "write")
        except BaseException:
            writer.abort()
            raise
        entry = writer.finish(
            {
                "period": data.period,
                "student_files": data.checksum,
                "teacher_calls": counts.teacher_calls,
                "duplicates": counts.duplicates,
            },
            fsync=True,
        )
        _crash_point(student.name, data.period, "shard")
        student.manifest["parts"].append(entry)
        write_manifest(student.out, student.manifest, fsync=True)
        student.done_checksums[data.period] = data.checksum

    def progress(self) -> str:
        """``student done/declared`` for each student (``?`` before its manifest)."""
        parts = []
        for student in self.students:
            m = student.manifest
            total = "?" if m is None else m["stream"]["num_periods"]
            parts.append(f"{student.name} {student.done}/{total}")
        return ", ".join(parts)

    # ------------------------------------------------------------------ counters
    def counters(self) -> dict[str, Any]:
        """Totals and per student, from the memo files and the augmented manifests."""
        per: dict[str, Counts] = {}
        for student in self.students:
            c = per[student.name] = Counts()
            for period in range(student.done):
                scored = self.memo.counts[(student.name, period)]
                c.add(Counts(scored.teacher_calls, scored.duplicates, scored.rows, 1))
        total = Counts()
        for c in per.values():
            total.add(c)
        return {
            **vars(total),
            "unique_examples": int(self.memo.ids.size),
            "students": {name: vars(c) for name, c in per.items()},
            "teacher": self.teacher_id,
        }

    def write_counters(self) -> dict[str, Any]:
        data = self.counters()
        path = self.out / COUNTERS
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
        return data

    # ------------------------------------------------------------------ loop
    def run(self, once: bool = False, poll_s: float = 1.0) -> dict[str, Any]:
        """Augment until every student's declared periods are done (``once``: what is
        there now); returns the counters."""
        said = time.monotonic()
        while True:
            written = self.step()
            if once or self.finished():
                break
            if not written:
                if time.monotonic() - said >= WAITING_LOG_S:
                    log.info("waiting for periods: %s", self.progress())
                    said = time.monotonic()
                time.sleep(poll_s)
        counters = self.write_counters()
        log.info(
            "augmentation %s: %d shards, %d teacher calls, %d duplicates served from the memo",
            "done" if self.finished() else "paused", counters["shards_written"],
            counters["teacher_calls"], counters["duplicates"],
        )  # fmt: skip
        return counters
