"""Checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is one DCP directory ``<run>/checkpoint/step_<N>/`` holding::

    model                 model.state_dict(): dense weights and embedding tables
                          under canonical names (embedding_bags.<table>.weight)
    embedding_optimizer   fused optimizer state (embedding_bags.<table>.momentum1)
    optimizer             dense optimizer state keyed by parameter name
    train                 step, data position, RNG states, counters
    kv/<module>/<table>/  the LMDB store of each kv table (``backing = "kv"``: rows
                          keyed by 64-bit id, not a dense array DCP could hold), a
                          compacted copy with a CRC32 checked on load; in a sharded
                          run the table's owner rank saves and loads it (a kv table
                          is whole on one rank), so the copy is the same whatever
                          the world size or plan, and any owner can load it

Names do not depend on the kernel backend or (for sharded models) the layout,
so a checkpoint loads into any of them. A checkpoint is written to a temporary
directory and renamed when complete: an interrupted save never shadows the
previous one.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from towerrec.modules.embedding_bag import fused_embedding_modules
from towerrec.modules.interfaces import CachingCollection

__all__ = [
    "CheckpointManager",
    "capture_rng",
    "embedding_optimizer_state_dict",
    "load_embedding_optimizer_state_dict",
    "read_meta",
    "restore_rng",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"


def embedding_optimizer_state_dict(model: nn.Module) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, module in fused_embedding_modules(model):
        state.update(module.optimizer_state_dict(prefix=f"{name}." if name else ""))
    return state


def load_embedding_optimizer_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    for name, module in fused_embedding_modules(model):
        prefix = f"{name}." if name else ""
        module.load_optimizer_state_dict(
            {k: v for k, v in state.items() if k.startswith(prefix)}, prefix=prefix
        )


KV_DIR = "kv"


def _kv_collections(model: nn.Module) -> list[tuple[str, CachingCollection]]:
    """``(directory name, collection)`` of this process's collections holding kv tables:
    a sharded collection's are those of this rank's shards (a kv table is whole on
    its owner rank, so every table's store is saved and loaded by one rank only)."""
    out: list[tuple[str, CachingCollection]] = []
    for name, module in fused_embedding_modules(model):
        if isinstance(module, CachingCollection) and module.kv_stores:
            out.append((name or "sparse", module))
    return out


def capture_rng() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


@contextmanager
def _single_process_quiet():
    """DCP warns that it runs without a process group; that is expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    """Saves and finds the checkpoints of one run directory."""

    def __init__(self, directory: str | Path, keep: int = 2) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.directory.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.directory / f"step_{steps[-1]:08d}" if steps else None

    @staticmethod
    def _state(model: nn.Module, optimizer: torch.optim.Optimizer, train: dict) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "embedding_optimizer": embedding_optimizer_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
            "train": train,
        }

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train: dict[str, Any],
        meta: dict[str, Any] | None = None,
    ) -> Path:
        """Save a checkpoint of ``step``; ``meta`` (JSON, the same on every rank) goes
        beside it as ``meta.json`` for values that a later version may add or drop."""
        final = self.directory / f"step_{step:08d}"
        partial = self.directory / f"step_{step:08d}.partial"
        if _is_main():
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        with _single_process_quiet():
            dcp.save(self._state(model, optimizer, train), checkpoint_id=partial)
        for name, module in _kv_collections(model):  # each kv table's owner saves it
            module.save_stores(partial / KV_DIR / name)
        _barrier()
        if _is_main():
            if meta is not None:
                (partial / META).write_text(json.dumps(meta) + "\n")
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            for old in self.steps()[: -self.keep]:
                shutil.rmtree(self.directory / f"step_{old:08d}", ignore_errors=True)
        _barrier()
        return final

    def load(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train: dict[str, Any],
    ) -> dict[str, Any]:
        """Load ``path`` into ``model`` and ``optimizer`` in place; returns the train state,
        shaped like ``train`` (whose values are placeholders)."""
        path = Path(path)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(
                f"{path} is not a complete checkpoint (no .metadata); pick another step or "
                "start a fresh run"
            )
        state = self._state(model, optimizer, train)
        try:
            with _single_process_quiet():
                # No flattening of nested ShardedTensors (there are none): it would mangle
                # the optimizer's param_groups when sharded embeddings are present.
                dcp.load(
                    state,
                    checkpoint_id=path,
                    planner=DefaultLoadPlanner(flatten_sharded_tensors=False),
                )
        except (CheckpointException, RuntimeError, ValueError) as e:
            raise ValueError(
                f"checkpoint {path} does not fit this model and config ({_first_line(e)}); "
                "resume with the config the run was started with (its config.toml)"
            ) from None
        model.load_state_dict(state["model"])
        for name, module in _kv_collections(model):
            module.load_stores(path / KV_DIR / name)
        load_embedding_optimizer_state_dict(model, state["embedding_optimizer"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        return state["train"]


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta`` saved with the checkpoint at ``path`` ({} for one saved without)."""
    file = Path(path) / META
    return json.loads(file.read_text()) if file.is_file() else {}


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = [line for line in lines if "mismatch" in line.lower() or "missing" in line.lower()]
    return (detail or lines or [type(error).__name__])[-1]
