"""Load and run an inference artefact written by ``towerrec export``.

This file is the whole loader: it imports only the standard library, numpy and
torch, never towerrec, so a serving process can copy it next to an artefact and
run it without the training code::

    from artefact import load_artefact          # this file, copied
    model = load_artefact("export/")
    probs = model.predict(dense, keys, values, lengths)   # [B] click probabilities

An artefact is a directory::

    checksums.json     the size and SHA-256 of every other file (written last; the
                       format of towerrec/checksums.py, checked here on load unless
                       ``verify=False``)
    manifest.json      format and towerrec version, the feature schema (dense width;
                       per sparse feature its table, rows, dim, pooling), the id policy
                       and how the run's data mapped raw values to ids
    program.pt2        the dense part (``torch.export``): (dense [B, F_d] float32,
                       pooled [B, sum(D_f)] float32) -> logits [B]
    tables/            one table per file, numpy .npy (no pickle):
                         fp32, fp16   <table>.npy              [rows, D]
                         int8         <table>.q.npy  uint8     [rows, D]
                                      <table>.scale.npy float32 [rows]
                                      <table>.bias.npy  float32 [rows]
                       an int8 row is ``q * scale + bias`` (row-wise min/max quantisation)

The sparse input has TorchRec's jagged layout: for T keys and B samples,
``lengths`` holds T*B counts key-major and ``values`` the ids of every (key,
sample) bag end to end in that order; ``weights`` (optional) one float per id.
The loader pools each feature's bags (sum or mean, as the run did), lays the
pooled vectors side by side in the program's feature order and runs the program.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ArtefactError",
    "FeatureSpec",
    "InferenceArtefact",
    "TableStore",
    "load_artefact",
    "verify_files",
]

FORMAT = "towerrec-inference"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CHECKSUMS = "checksums.json"
PROGRAM = "program.pt2"
TABLES = "tables"
TABLE_DTYPES = ("fp32", "fp16", "int8")


class ArtefactError(ValueError):
    """An artefact that cannot be loaded or input that does not fit it."""


@dataclass(frozen=True)
class FeatureSpec:
    """One sparse feature: the table it is looked up in and how its bags pool."""

    name: str
    table: str
    num_embeddings: int
    embedding_dim: int
    pooling: str  # "sum" | "mean"


def table_files(table: str, dtype: str) -> list[str]:
    """The files under ``tables/`` that hold ``table`` stored as ``dtype``."""
    if dtype == "int8":
        return [f"{table}.q.npy", f"{table}.scale.npy", f"{table}.bias.npy"]
    return [f"{table}.npy"]


class TableStore:
    """One embedding table as stored (fp32, fp16 or row-wise int8); pools bags to fp32."""

    def __init__(self, dtype: str, arrays: list[np.ndarray], spec: FeatureSpec) -> None:
        self.dtype = dtype
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        self.weight = tensors[0]  # [rows, D]: float32, float16 or uint8
        shape = (spec.num_embeddings, spec.embedding_dim)
        if tuple(self.weight.shape) != shape:
            raise ArtefactError(
                f"table {spec.table!r} has shape {tuple(self.weight.shape)} but the manifest "
                f"says {shape}; the artefact is damaged: export the run again"
            )
        self.packed: torch.Tensor | None = None
        if dtype == "int8":
            # torch's row-wise 8-bit bag kernel (FBGEMM's layout): each row's D bytes,
            # then its scale and bias as float32 bytes, [rows, D + 8]
            scale, bias = (t.float().reshape(-1, 1).view(torch.uint8) for t in tensors[1:3])
            self.packed = torch.cat([self.weight, scale, bias], dim=1).contiguous()

    def pool(
        self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, mode: str
    ) -> torch.Tensor:
        """Pooled rows of ``ids`` [N] in bags ``offsets`` [B + 1] -> [B, D] float32."""
        if self.packed is not None:  # int8: dequantised inside the kernel, summed in fp32
            out = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                self.packed, ids, offsets, False, 0, False, weights, None, True
            )  # mode 0, sum: its mean mode did not average in our tests, so divide here
            return out / offsets.diff().clamp(min=1).unsqueeze(1) if mode == "mean" else out
        if self.dtype == "fp32":
            return F.embedding_bag(
                ids, self.weight, offsets, mode=mode, per_sample_weights=weights,
                include_last_offset=True,
            )  # fmt: skip
        rows = self.weight.index_select(0, ids).float()  # fp16: [N, D], summed in fp32
        if weights is not None:
            rows = rows * weights.unsqueeze(1)
        lengths = offsets.diff()
        batch = lengths.numel()
        bag = torch.repeat_interleave(torch.arange(batch), lengths, output_size=ids.numel())
        out = torch.zeros(batch, rows.shape[1]).index_add_(0, bag, rows)
        if mode == "mean":
            out /= lengths.clamp(min=1).unsqueeze(1).to(out.dtype)
        return out


class InferenceArtefact:
    """A loaded artefact: tables, the dense program and the manifest that describes them."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        schema = manifest["schema"]
        self.num_dense: int = int(schema["num_dense"])
        self.features = [FeatureSpec(**f) for f in schema["sparse"]]
        self.id_policy: str = manifest["id_policy"]
        self.table_dtype: str = manifest["tables"]["dtype"]
        if self.table_dtype not in TABLE_DTYPES:
            raise ArtefactError(
                f"{path / MANIFEST}: unknown table dtype {self.table_dtype!r}; "
                f"this loader reads {list(TABLE_DTYPES)}"
            )
        self.tables: dict[str, TableStore] = {}
        for spec in self.features:
            if spec.table not in self.tables:
                files = [path / TABLES / name for name in table_files(spec.table, self.table_dtype)]
                arrays = [np.load(_required(f), allow_pickle=False) for f in files]
                self.tables[spec.table] = TableStore(self.table_dtype, arrays, spec)
        self.program = torch.export.load(_required(path / PROGRAM)).module()

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.features]

    def pooled(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled embeddings ``[B, sum(D_f)]`` of a jagged batch (module doc), in the
        program's feature order; ``keys`` may hold more features than the artefact's."""
        keys = list(keys)
        missing = [f.name for f in self.features if f.name not in keys]
        if missing:
            raise ArtefactError(
                f"the input lacks the sparse feature(s) {missing} that the model reads; "
                f"it has {keys}: give every feature of the artefact's schema"
            )
        if lengths.numel() % max(len(keys), 1):
            raise ArtefactError(
                f"lengths has {lengths.numel()} entries, not a multiple of the {len(keys)} keys"
            )
        batch = lengths.numel() // max(len(keys), 1)
        lengths = lengths.long()
        starts = torch.zeros(len(keys) + 1, dtype=torch.int64)
        torch.cumsum(lengths.view(len(keys), batch).sum(dim=1), 0, out=starts[1:])
        if int(starts[-1]) != values.numel():
            raise ArtefactError(
                f"lengths sum to {int(starts[-1])} but there are {values.numel()} values"
            )
        parts = []
        for spec in self.features:
            k = keys.index(spec.name)
            lo, hi = int(starts[k]), int(starts[k + 1])
            ids = self._map_ids(values[lo:hi].long(), spec)
            offsets = torch.zeros(batch + 1, dtype=torch.int64)
            torch.cumsum(lengths[k * batch : (k + 1) * batch], 0, out=offsets[1:])
            w = weights[lo:hi].float() if weights is not None else None
            parts.append(self.tables[spec.table].pool(ids, offsets, w, spec.pooling))
        return torch.cat(parts, dim=1)

    def _map_ids(self, ids: torch.Tensor, spec: FeatureSpec) -> torch.Tensor:
        """The run's id policy: ``hash`` (id mod rows), ``clip``, or ``error`` for ids
        outside ``[0, rows)``."""
        rows = spec.num_embeddings
        if self.id_policy == "hash":
            return torch.remainder(ids, rows)
        if self.id_policy == "clip":
            return ids.clamp(0, rows - 1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            bad = ids[(ids < 0) | (ids >= rows)][0]
            raise ArtefactError(
                f"id {int(bad)} of feature {spec.name!r} is out of range for its table of "
                f"{rows} rows (the run's id policy is 'error'); map raw values to ids as the "
                "run's data did (manifest.json, 'data')"
            )
        return ids

    @torch.inference_mode()
    def logits(
        self,
        dense: torch.Tensor,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B]`` of dense ``[B, F_d]`` and the jagged sparse features."""
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ArtefactError(
                f"dense features have shape {tuple(dense.shape)}; the model reads "
                f"[B, {self.num_dense}]"
            )
        pooled = self.pooled(keys, values, lengths, weights)
        if pooled.shape[0] != dense.shape[0]:
            raise ArtefactError(
                f"{dense.shape[0]} dense rows but {pooled.shape[0]} samples of sparse features"
            )
        return self.program(dense.float(), pooled)

    def predict(
        self,
        dense: torch.Tensor,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Click probabilities ``[B]`` (the sigmoid of ``logits``)."""
        return torch.sigmoid(self.logits(dense, keys, values, lengths, weights))


def _required(file: Path) -> Path:
    if not file.is_file():
        raise FileNotFoundError(
            f"the artefact lacks {file}; it is incomplete or damaged: export the run again "
            "(towerrec export RUN --out DIR)"
        )
    return file


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def verify_files(path: str | Path) -> None:
    """Check every file ``checksums.json`` lists (its size and SHA-256); an
    ``ArtefactError`` names those damaged or missing, or a missing ``checksums.json``."""
    path = Path(path)
    file = path / CHECKSUMS
    if not file.is_file():
        raise ArtefactError(
            f"{path} has no {CHECKSUMS}: it was exported by a towerrec before artefacts "
            "carried checksums, or is incomplete; export the run again (towerrec export RUN "
            "--out DIR), or, if you trust it, load it unverified (load_artefact(path, "
            "verify=False); towerrec predict --no-verify)"
        )
    try:
        body = json.loads(file.read_text())
        if (body.get("format"), body.get("version"), body.get("hash")) != (
            "towerrec-checksums",
            1,
            "sha256",
        ):
            raise ValueError("not a towerrec-checksums file of version 1 with sha256")
        files = {str(k): (int(v["bytes"]), str(v["sha256"])) for k, v in body["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ArtefactError(
            f"{file} is unreadable ({type(e).__name__}: {e}); the artefact is damaged: export "
            "the run again"
        ) from None
    problems = []
    for name, (size, sha256) in sorted(files.items()):
        target = path / name
        if not target.is_file():
            problems.append(f"{name} is missing")
        elif target.stat().st_size != size:
            problems.append(f"{name} has {target.stat().st_size} bytes, {CHECKSUMS} says {size}")
        elif _sha256(target) != sha256:
            problems.append(f"{name} does not match its sha256 in {CHECKSUMS}")
    if problems:
        raise ArtefactError(
            f"the artefact in {path} is damaged or incomplete, refused: {'; '.join(problems)}. "
            "Export the run again (towerrec export RUN --out DIR)"
        )


def read_manifest(path: str | Path, towerrec_version: str | None = None) -> dict[str, Any]:
    """The artefact's manifest, checked: its format, its format version, and (when
    ``towerrec_version`` is given) the towerrec version that exported it."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"no artefact directory {path}; write one with towerrec export RUN --out {path}"
        )
    manifest = json.loads(_required(path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ArtefactError(f"{path / MANIFEST} is not a towerrec inference artefact")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtefactError(
            f"{path} has artefact format version {version}, this loader reads version "
            f"{FORMAT_VERSION}; export the run again with this version (towerrec export), or "
            "load it with the loader of the version that wrote it"
        )
    exported_by = manifest.get("towerrec_version")
    if towerrec_version is not None and exported_by != towerrec_version:
        raise ArtefactError(
            f"{path} was exported by towerrec {exported_by}, this is towerrec "
            f"{towerrec_version}; export the run again with this version (towerrec export "
            "RUN --out DIR)"
        )
    return manifest


def load_artefact(
    path: str | Path, towerrec_version: str | None = None, verify: bool = True
) -> InferenceArtefact:
    """Load the artefact in ``path`` (see ``read_manifest`` for the version checks); its
    files are checked against ``checksums.json`` first unless ``verify`` is False."""
    if verify and Path(path).is_dir():
        verify_files(path)
    manifest = read_manifest(path, towerrec_version)
    return InferenceArtefact(Path(path), manifest)
