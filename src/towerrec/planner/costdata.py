"""Measured cost data: what learned cost models (NeuroShard, DreamShard) train on.

A versioned JSON file written by ``towerrec plan collect-costs`` (the measuring
lives in towerrec.calibration; this module only reads, writes and checks)::

    {"format": "towerrec-cost-data", "version": 1,
     "machine": {cpu, flags, cores, torch, kernel backend, ...},
     "kernel": "torch" | "fbgemm",          the embedding kernel that was timed
     "batch": B,                            samples a device's kernel processes; each
                                            rank's samples in an all-to-all
     "compute": [                           one device: a fused multi-table kernel
        {"shards": [{TableStats fields..., "rows": r, "cols": c}, ...],
         "forward_s": f, "backward_s": b}, ...],   backward_s: backward + fused update
     "comm": [                              one all-to-all of pooled outputs
        {"world": k, "dims": [per-device total output dims], "batch": B,
         "seconds": s}, ...],                forward exchange + backward (gradient) exchange
     "data_sha256": hex}                    SHA-256 of the other keys (checksums.json_digest)

A file of another format or version, timed with another kernel than the one asked
for, or that does not match its ``data_sha256`` (a changed time or shape), is
refused with an error naming the file and the fix (re-run ``towerrec plan
collect-costs``); files without ``data_sha256``, from earlier versions, are read.
Pure: json and dataclasses, no torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from towerrec.checksums import sealed, unseal
from towerrec.planner.stats import TableStats
from towerrec.utils import at_least

__all__ = [
    "FORMAT",
    "KERNELS",
    "VERSION",
    "CommSample",
    "ComputeSample",
    "CostData",
    "Shard",
    "file_digest",
]

FORMAT = "towerrec-cost-data"
VERSION = 1
KERNELS = ("torch", "fbgemm")
SELF_DIGEST = "data_sha256"  # the file's digest of its own other keys

Shard = tuple[TableStats, int, int]  # (stats, rows, cols) on one device

_STATS_FIELDS = {f.name for f in fields(TableStats)}


@dataclass(frozen=True)
class ComputeSample:
    """One device's shards and its measured kernel seconds (forward; backward + update)."""

    shards: tuple[Shard, ...]
    forward_s: float
    backward_s: float

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class CommSample:
    """One all-to-all of pooled outputs: ``dims[r]`` = total output dims of rank r."""

    world: int
    dims: tuple[int, ...]
    batch: int
    seconds: float


@dataclass
class CostData:
    machine: dict[str, Any]
    kernel: str
    batch: int
    compute: list[ComputeSample] = field(default_factory=list)
    comm: list[CommSample] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"cost data kernel {self.kernel!r} must be one of {KERNELS}")
        at_least("cost data batch", self.batch, 1)

    # ------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "machine": self.machine,
            "kernel": self.kernel,
            "batch": self.batch,
            "compute": [
                {
                    "shards": [
                        {**asdict(s), "feature_names": list(s.feature_names), "rows": r, "cols": c}
                        for s, r, c in sample.shards
                    ],
                    "forward_s": sample.forward_s,
                    "backward_s": sample.backward_s,
                }
                for sample in self.compute
            ],
            "comm": [
                {"world": c.world, "dims": list(c.dims), "batch": c.batch, "seconds": c.seconds}
                for c in self.comm
            ],
        }

    def save(self, path: str | Path) -> None:
        """Compact JSON, one sample per line (the shipped file stays small and diffable)."""
        data = sealed(self.to_json(), SELF_DIGEST)
        samples = {key: data.pop(key) for key in ("compute", "comm")}
        head = json.dumps(data, separators=(",", ":"))[:-1]
        parts = [head]
        for key, rows in samples.items():
            lines = ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows)
            parts.append(f',\n"{key}":[\n{lines}\n]')
        Path(path).write_text("".join(parts) + "}\n")

    @staticmethod
    def from_json(
        data: Any, where: str = "cost data", kernel: str | None = None, path: str = "FILE"
    ) -> CostData:
        """Parse and check ``data``; ``kernel``: refuse data timed with another kernel.
        ``where`` names the data in errors, ``path`` is the file the fix writes."""
        fix = f"re-run `towerrec plan collect-costs --out {path}` to write a current one"
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where} is not a {FORMAT} file (format {got!r}); {fix}")
        if data.get("version") != VERSION:
            raise ValueError(
                f"{where} has {FORMAT} version {data.get('version')!r}, this towerrec reads "
                f"version {VERSION}; {fix}"
            )
        if kernel is not None and data.get("kernel") != kernel:
            raise ValueError(
                f"{where} was measured with the {data.get('kernel')!r} embedding kernel, not "
                f"{kernel!r}; re-run `towerrec plan collect-costs --out {path}` with the "
                f"{kernel!r} kernel (embedding backend)"
            )
        try:
            compute = [
                ComputeSample(
                    tuple(_shard(s) for s in entry["shards"]),
                    float(entry["forward_s"]),
                    float(entry["backward_s"]),
                )
                for entry in data["compute"]
            ]
            comm = [
                CommSample(
                    int(c["world"]),
                    tuple(int(d) for d in c["dims"]),
                    int(c["batch"]),
                    float(c["seconds"]),
                )
                for c in data["comm"]
            ]
            out = CostData(
                dict(data["machine"]), str(data["kernel"]), int(data["batch"]), compute, comm
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where} is malformed ({type(e).__name__}: {e}); {fix}") from None
        for i, sample in enumerate(out.compute):
            if not sample.shards or sample.forward_s <= 0 or sample.backward_s <= 0:
                raise ValueError(
                    f"{where}: compute sample {i} needs shards and positive times; {fix}"
                )
        for i, c in enumerate(out.comm):
            if len(c.dims) != c.world or c.seconds <= 0 or min(c.dims, default=0) < 0:
                raise ValueError(
                    f"{where}: comm sample {i} needs one dim >= 0 per rank of its world "
                    f"({c.world}) and a positive time; {fix}"
                )
        if not unseal(dict(data), SELF_DIGEST):
            raise ValueError(
                f"{where} does not match its own {SELF_DIGEST}: the file is damaged or was "
                f"edited (its times and shapes cannot be trusted); {fix}"
            )
        return out

    @staticmethod
    def load(path: str | Path, kernel: str | None = None) -> CostData:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"cost data file {str(path)!r} does not exist; write one with "
                f"`towerrec plan collect-costs --out {path}`"
            )
        try:
            data = json.loads(path.read_text())
        except ValueError as e:  # not JSON, or not UTF-8
            raise ValueError(
                f"cost data file {str(path)!r} is not valid JSON ({e}); re-run "
                f"`towerrec plan collect-costs --out {path}`"
            ) from None
        return CostData.from_json(data, f"cost data file {str(path)!r}", kernel, str(path))

    def summary(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "batch": self.batch,
            "compute_samples": len(self.compute),
            "comm_samples": len(self.comm),
            "machine": self.machine,
        }


def _shard(entry: dict[str, Any]) -> Shard:
    unknown = sorted(set(entry) - _STATS_FIELDS - {"rows", "cols"})
    if unknown:
        raise KeyError(f"unknown shard fields {unknown}")
    known: dict[str, Any] = {k: v for k, v in entry.items() if k in _STATS_FIELDS}
    stats = TableStats(**{**known, "feature_names": tuple(known.get("feature_names", ()))})
    rows, cols = int(entry["rows"]), int(entry["cols"])
    if not (1 <= rows <= stats.num_embeddings and 1 <= cols <= stats.embedding_dim):
        raise TypeError(
            f"shard {rows}x{cols} does not fit table {stats.name!r} "
            f"({stats.num_embeddings}x{stats.embedding_dim})"
        )
    return stats, rows, cols


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (weights record which cost data they were trained on)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
