"""``towerrec export RUN --out DIR``: a finished run as a self-contained inference artefact.

::

    RUN/config.toml ──► build the single-device model ◄── RUN/best|checkpoint/step_N (DCP,
                                                          any world size and sharding)
          │
          ├─ tables:  model.sparse.table_weights()  ──► DIR/tables/<table>.npy
          │           (fp32, fp16, or int8 row-wise: q [rows, D] uint8, scale, bias [rows])
          └─ program: the model with its collection swapped for ``PooledInput``,
                      torch.export'ed with a dynamic batch ──► DIR/program.pt2
                      (dense [B, F_d], pooled [B, sum(D_f)]) -> logits [B]

The program's first step is the transform the run's loader applied to the dense columns
(``data/dense_transform.py``: standardised, skewed counts logged), so it reads the values
as the cache holds them; the manifest records it. The program holds only the dense part
(MLPs, interaction, towers): the embedding
lookup stays outside it, as in serving stacks where tables live apart from the
network, so tables can be stored in a smaller dtype and looked up by any kernel.
``serve/artefact.py`` loads the result with torch and numpy alone. The manifest
(format in ``artefact.py``) records the feature schema, the id policy and how the
run's data mapped raw values to ids; ``checksums.json`` (``towerrec/checksums.py``), written
last before the artefact's directory is renamed into place, the size and SHA-256 of every
file, which the loader checks. The checkpoint exported from is checked against its own
checksums first (``verify=False``: not; ``towerrec export --no-verify``).
"""

from __future__ import annotations

import json
import logging
import shutil
from datetime import UTC, datetime
from enum import StrEnum
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.export import Dim

from towerrec.build.run import build_run
from towerrec.checksums import digests, list_files, write_checksums
from towerrec.config import Config, config_to_toml, load_config
from towerrec.data.batch import DataSchema
from towerrec.data.dense_transform import DenseTransform
from towerrec.data.registry import SOURCES
from towerrec.models.distill_heads import detach_distill_heads
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.interfaces import Ready
from towerrec.serve.artefact import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PROGRAM,
    TABLES,
    table_files,
)
from towerrec.sparse import KeyedTensor
from towerrec.train.checkpoint import CheckpointError, CheckpointManager, capture_rng
from towerrec.train.run_dir import RunDir

__all__ = [
    "RUN_CONFIG",
    "TableDtype",
    "export_run",
    "load_run_model",
    "quantize_rowwise",
    "towerrec_version",
]

log = logging.getLogger("towerrec")

RUN_CONFIG = "run_config.toml"  # the run's config.toml, copied: predict's default data


class TableDtype(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"  # row-wise: per-row scale and bias


def towerrec_version() -> str:
    try:
        return version("towerrec")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "0+unknown"


class PooledInput(nn.Module):
    """Stands in for a model's embedding collection: its "features" are the pooled
    embeddings ``[B, sum(D_f)]`` themselves, handed back as the ``KeyedTensor`` the
    model would have got from the lookup."""

    def __init__(self, feature_names: list[str], embedding_dims: list[int]) -> None:
        super().__init__()
        self.feature_names = feature_names
        self.embedding_dims = embedding_dims

    def forward(self, pooled: torch.Tensor) -> KeyedTensor:
        return KeyedTensor(self.feature_names, self.embedding_dims, pooled)

    def forward_start(self, pooled: torch.Tensor) -> Ready:
        return Ready(self(pooled))


class DenseProgram(nn.Module):
    """``(dense [B, F_d], pooled [B, sum(D_f)]) -> logits [B]``: the model after its lookup,
    the dense columns first transformed as the run's loader did (``dense_transform``:
    None where it read them as they are)."""

    def __init__(self, model: nn.Module, dense_transform: DenseTransform | None = None) -> None:
        super().__init__()
        self.model = model
        self.dense = dense_transform.module() if dense_transform is not None else nn.Identity()

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.model(self.dense(dense), pooled)


def quantize_rowwise(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-wise 8-bit quantisation of ``weight`` [rows, D]: ``q`` [rows, D] uint8 and
    per-row ``scale``, ``bias`` [rows] float32 with ``row ~= q * scale + bias``
    (bias the row's minimum, scale its range / 255; a constant row has scale 1)."""
    w = weight.detach().float()
    low = w.min(dim=1).values
    span = w.max(dim=1).values - low
    scale = torch.where(span > 0, span / 255.0, torch.ones_like(span))
    q = torch.round((w - low.unsqueeze(1)) / scale.unsqueeze(1)).clamp(0, 255).to(torch.uint8)
    return q.numpy(), scale.numpy(), low.numpy()


def _pick_checkpoint(run: Path) -> tuple[Path, int]:
    """The checkpoint of the weights the run returned (``summary.json``'s weights_step:
    the best validation step's under early stopping, else the last)."""
    summary_path = run / "summary.json"
    if not (run / "config.toml").is_file() or not summary_path.is_file():
        raise FileNotFoundError(
            f"{run} holds no finished run (it needs config.toml and summary.json); give the "
            "directory of a towerrec train run that has finished (or finish it with "
            "towerrec train --out RUN --resume)"
        )
    files = RunDir(run)
    files.check("config.toml")
    summary = files.read_summary()
    if not summary.get("completed"):
        raise ValueError(
            f"the run in {run} stopped at step {summary.get('steps')} before it finished; "
            f"finish it first (towerrec train --out {run} --resume)"
        )
    step = int(summary.get("weights_step") or summary["steps"])
    for directory in (run / "best", run / "checkpoint"):
        path = directory / f"step_{step:08d}"
        if (path / ".metadata").is_file():
            return path, step
    raise FileNotFoundError(
        f"{run} has no checkpoint of its returned weights (step {step}) under best/ or "
        "checkpoint/; was it pruned (train.keep_checkpoints)? Export needs that step's "
        "checkpoint"
    )


def load_run_model(
    run: str | Path, verify: bool = True
) -> tuple[Config, DataSchema, nn.Module, int, DenseTransform | None]:
    """The run's config, data schema and single-device model (eval mode) with the
    returned weights loaded from its checkpoint, whatever the world size and sharding
    that wrote it; that checkpoint's step; and the transform of the dense columns its
    loader applied (None: none). The checkpoint's checksums are checked first unless
    ``verify`` is False; a damaged one is refused (``CheckpointError``)."""
    run = Path(run)
    path, step = _pick_checkpoint(run)
    if not verify:
        log.warning("loading %s without checking its checksums (--no-verify)", path)
    built = build_run(load_config(base=run / "config.toml"), device=torch.device("cpu"))
    config, model, optimizer = built.config, built.model, built.optimizer
    train_state = {"step": 0, "samples": 0, "train_s": 0.0, "rng": capture_rng()}
    try:
        CheckpointManager(path.parent, verify=verify).load(path, model, optimizer, train_state)
    except CheckpointError as e:
        raise CheckpointError(
            e.path,
            e.problems,
            f"It holds the weights the run returned (step {step}), which no other checkpoint "
            "holds; nothing was deleted",
        ) from None
    transform = getattr(built.source, "dense_transform", None)
    return config, built.schema, model.eval(), step, transform


def _data_mapping(config: Config) -> dict[str, Any]:
    """How the run's data turned raw values into ids, for scoring raw files alike."""
    data = config.data
    return {"source": data.source, "path": data.path, **SOURCES[data.source].export_mapping(data)}


def export_run(
    run: str | Path,
    out: str | Path,
    tables: TableDtype | str = TableDtype.FP32,
    verify: bool = True,
) -> dict[str, Any]:
    """Write the artefact of ``run`` into ``out`` (module doc); returns its manifest.
    ``verify``: check the run's checkpoint against its checksums first."""
    run, out, dtype = Path(run), Path(out), TableDtype(tables)
    if (out / MANIFEST).exists():
        raise FileExistsError(f"{out} already holds an artefact; choose another --out")
    config, schema, model, step, transform = load_run_model(run, verify)
    detach_distill_heads(model)  # the serving head only: distillation heads stay behind
    sparse = model.sparse
    if not isinstance(sparse, EmbeddingBagCollection):
        raise ValueError(
            f"export stores full tables; this run's embedding.kind makes a "
            f"{type(sparse).__name__}: export supports embedding.kind = 'full' runs"
        )
    features = _feature_specs(sparse)
    weights = sparse.table_weights()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / TABLES).mkdir(parents=True)
    stored = 0
    for table, weight in weights.items():
        arrays = _stored(weight, dtype)
        for name, array in zip(table_files(table, dtype.value), arrays):
            np.save(tmp / TABLES / name, array, allow_pickle=False)
            stored += array.nbytes
    model.sparse = PooledInput(list(sparse.feature_names), list(sparse.embedding_dims))
    program = _export_program(model, schema.num_dense, sum(sparse.embedding_dims), transform)
    torch.export.save(program, tmp / PROGRAM)
    (tmp / RUN_CONFIG).write_text(config_to_toml(config))
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "towerrec_version": towerrec_version(),
        "torch_version": torch.__version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "run": str(run.resolve()),
        "step": step,
        "model": config.model.name,
        "program": {"file": PROGRAM, "inputs": ["dense [B, F_d]", "pooled [B, sum(D_f)]"]},
        "tables": {"dtype": dtype.value, "bytes": stored},
        "schema": {"num_dense": schema.num_dense, "sparse": features},
        "id_policy": sparse.id_policy.value,
        "data": _data_mapping(config),
        # the program applies it to its dense input: give it the values the cache holds
        "dense_transform": None if transform is None else transform.describe(),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    write_checksums(tmp, digests(tmp, list_files(tmp)))  # last, before the rename
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("exported %s (step %d, %s tables, %s bytes) to %s", run, step, dtype, stored, out)
    return manifest


def _feature_specs(sparse: EmbeddingBagCollection) -> list[dict[str, Any]]:
    """Per feature, in the order the model lays out its pooled embeddings."""
    table_of = {f: t for t in sparse.tables for f in t.feature_names}
    return [
        {
            "name": name,
            "table": table_of[name].name,
            "num_embeddings": table_of[name].num_embeddings,
            "embedding_dim": dim,
            "pooling": table_of[name].pooling.value,
        }
        for name, dim in zip(sparse.feature_names, sparse.embedding_dims)
    ]


def _stored(weight: torch.Tensor, dtype: TableDtype) -> list[np.ndarray]:
    w = weight.detach().cpu().float()
    if dtype is TableDtype.FP16:
        return [w.half().numpy()]
    if dtype is TableDtype.INT8:
        return list(quantize_rowwise(w))
    return [w.numpy().copy()]


def _export_program(
    model: nn.Module, num_dense: int, pooled_width: int, transform: DenseTransform | None
):
    """torch.export of ``DenseProgram(model, transform)`` with the batch dimension dynamic."""
    example = 4  # any size > 1 (a size-1 example specialises the batch dimension)
    dense = torch.zeros(example, num_dense)
    pooled = torch.zeros(example, pooled_width)
    batch = Dim("batch", min=1)
    with torch.no_grad():
        return torch.export.export(
            DenseProgram(model, transform),
            (dense, pooled),
            dynamic_shapes={"dense": {0: batch}, "pooled": {0: batch}},
        )
