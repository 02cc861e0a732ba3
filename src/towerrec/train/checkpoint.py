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

    meta.json             values a later version may add or drop (``save(meta=)``)
    checksums.json        the size and SHA-256 of every file above, of every rank
                          (``towerrec/checksums.py``), written last

Names do not depend on the kernel backend or (for sharded models) the layout,
so a checkpoint loads into any of them. A checkpoint is written to a temporary
directory and renamed when complete: an interrupted save never shadows the
previous one. Once every rank has written its files, each hashes a share of them
(about the same bytes each) and rank 0 writes ``checksums.json`` before the rename.
A load checks them first (``CheckpointManager(verify=True)``, the default; each rank a
share, all refusing together) and refuses a damaged or incomplete checkpoint with a
``CheckpointError`` naming the files; ``verify_checkpoint(path)`` checks one in this
process alone. A refusal deletes and rewrites nothing.
"""

from __future__ import annotations

import errno
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

from towerrec.checksums import (
    CHECKSUMS,
    ChecksumError,
    Entries,
    assign,
    digests,
    list_files,
    problems,
    read_checksums,
    write_checksums,
)
from towerrec.data.json_shape import COUNT, FINITE, FLAG, NUMBER, ROWS, Map, Opt, check_shape
from towerrec.modules.embedding_bag import fused_embedding_modules
from towerrec.modules.interfaces import CachingCollection

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "capture_rng",
    "embedding_optimizer_state_dict",
    "load_embedding_optimizer_state_dict",
    "read_meta",
    "restore_rng",
    "verify_checkpoint",
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


NO_CHECKSUMS = (
    f"{CHECKSUMS} is missing: the checkpoint was written by a towerrec that did not record "
    "checksums yet, or not by towerrec; if you trust it, load it unverified with "
    "train.verify_checkpoints = false (towerrec train --resume --set "
    "train.verify_checkpoints=false; towerrec export --no-verify)"
)


class CheckpointError(ValueError):
    """A checkpoint whose files do not match its ``checksums.json`` (or that has none):
    ``path`` and one line per damaged or missing file in ``problems``."""

    def __init__(self, path: str | Path, problems: list[str], hint: str = "") -> None:
        self.path, self.problems = Path(path), list(problems)
        shown = "; ".join(problems[:4])
        if len(problems) > 4:
            shown += f"; and {len(problems) - 4} more"
        super().__init__(
            f"checkpoint {path} is damaged or incomplete, refused: {shown}"
            + (f". {hint}" if hint else "")
        )


def _share_problems(path: Path, rank: int, world: int) -> list[str]:
    """What is wrong with rank ``rank``'s share of ``path``'s files (of ``world``)."""
    try:
        entries = read_checksums(path)
    except ChecksumError as e:
        return [str(e)]
    if entries is None:
        return [NO_CHECKSUMS]
    sizes = {name: int(entry["bytes"]) for name, entry in entries.items()}
    return problems(path, {name: entries[name] for name in assign(sizes, world)[rank]})


def verify_checkpoint(path: str | Path) -> None:
    """Check every file of the checkpoint at ``path`` against its ``checksums.json``, in
    this process; raises ``CheckpointError`` naming what is damaged or missing."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {path}")
    found = _share_problems(path, 0, 1)
    if found:
        raise CheckpointError(path, found)


def _verify_together(path: Path) -> list[str]:
    """``path``'s problems, each rank checking a share of its files; every rank gets them all
    (the same list), so all refuse or load together."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _share_problems(path, 0, 1)
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, _share_problems(path, rank, world))
    return list(dict.fromkeys(p for share in gathered for p in share))  # in order, once


def _hash_together(root: Path) -> Entries:
    """The checksum entries of ``root``'s files, each rank hashing a share (about the same
    bytes): all of them on rank 0, {} elsewhere. Every rank's files must be written."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return digests(root, list_files(root))
    rank, world = dist.get_rank(), dist.get_world_size()
    shares: list[Any] = [None]
    if rank == 0:
        shares = [assign({f: (root / f).stat().st_size for f in list_files(root)}, world)]
    dist.broadcast_object_list(shares, src=0)
    mine = digests(root, shares[0][rank])
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return {k: v for part in gathered or [] for k, v in part.items()}


class CheckpointManager:
    """Saves and finds the checkpoints of one run directory; ``verify``: check a
    checkpoint's checksums before loading it (``train.verify_checkpoints``)."""

    def __init__(self, directory: str | Path, keep: int = 2, verify: bool = True) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.verify = verify

    def path(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.directory.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def check(self, path: str | Path) -> None:
        """Refuse the checkpoint at ``path`` (``CheckpointError``) unless its files match its
        checksums. Collective in a distributed run: every rank calls it and checks a share."""
        found = _verify_together(Path(path))
        if found:
            raise CheckpointError(path, found)

    def intact_before(self, step: int) -> int | None:
        """The newest step before ``step`` whose checkpoint is intact (None: none is).
        Collective in a distributed run, like ``check``."""
        for earlier in reversed([s for s in self.steps() if s < step]):
            if not _verify_together(self.path(earlier)):
                return earlier
        return None

    def set_aside_after(self, step: int) -> list[Path]:
        """Rename the checkpoints after ``step`` to ``step_<N>.superseded`` (run from
        rank 0 alone): a run resumed from ``step`` trains those steps again, and must
        neither take them for its latest nor prune its own in their favour. Nothing is
        deleted; the new names, which ``steps`` does not list."""
        moved = []
        for later in [s for s in self.steps() if s > step]:
            source = self.path(later)
            target = source.with_name(source.name + ".superseded")
            n = 1
            while target.exists():
                n += 1
                target = source.with_name(f"{source.name}.superseded{n}")
            source.rename(target)
            moved.append(target)
        return moved

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
        final = self.path(step)
        partial = final.with_name(final.name + ".partial")
        if _is_main():
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        try:
            with _single_process_quiet():
                dcp.save(self._state(model, optimizer, train), checkpoint_id=partial)
            for name, module in _kv_collections(model):  # each kv table's owner saves it
                module.save_stores(partial / KV_DIR / name)
        except (CheckpointException, OSError, RuntimeError) as e:
            raise self._write_failed(partial, e) from None
        _barrier()  # every rank's files are written
        if _is_main() and meta is not None:
            (partial / META).write_text(json.dumps(meta) + "\n")
        entries = _hash_together(partial)  # a collective: rank 0's meta.json is written
        if _is_main():
            write_checksums(partial, entries)
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            for old in self.steps()[: -self.keep]:
                shutil.rmtree(self.path(old), ignore_errors=True)
        _barrier()
        return final

    def _write_failed(self, partial: Path, error: BaseException) -> ValueError:
        """The error of a checkpoint that could not be written (its partial directory is
        removed; the previous checkpoints are untouched): a full disk said as such."""
        shutil.rmtree(partial, ignore_errors=True)
        free = shutil.disk_usage(self.directory).free
        latest = self.latest()
        kept = f"the last checkpoint, {latest.name}, is intact" if latest else "no checkpoint"
        previous = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()) if latest else 0
        if free < max(previous, 64 << 20) or _no_space(error):
            cause = f"the disk is full ({free / 2**20:.1f} MiB free)"
        else:
            cause = _first_line(error)
        return ValueError(
            f"could not write checkpoint {partial.name.removesuffix('.partial')} in "
            f"{self.directory}: {cause}; {kept}. Free space there (or lower "
            "train.keep_checkpoints) and continue with --resume"
        )

    def load(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train: dict[str, Any],
        checked: bool = False,
    ) -> dict[str, Any]:
        """Load ``path`` into ``model`` and ``optimizer`` in place; returns the train state,
        shaped like ``train`` (whose values are placeholders). Its checksums are checked
        first (``check``) unless the manager was made with ``verify=False`` or the caller
        has just checked them (``checked``: a resume, ``resume_point``)."""
        path = Path(path)
        if self.verify and not checked and path.is_dir():
            self.check(path)
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


# What a resume reads of meta.json (data/json_shape.py); a later version may add keys.
META_SHAPE = {
    "threads": Opt(ROWS),
    "train_bytes": Opt([FINITE], null=False),
    "early_stopping": Opt(
        {
            "best_step": Opt(COUNT, absent=False),
            "best_value": Opt(NUMBER, absent=False),
            "best_metrics": Opt(Map(Opt(NUMBER)), absent=False),
            "since_best": COUNT,
            "lr_scale": FINITE,
            "stopped": FLAG,
        }
    ),
}


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta`` saved with the checkpoint at ``path`` ({} for one saved without);
    ``ValueError`` naming the file and key when it is damaged."""
    file = Path(path) / META
    if not file.is_file():
        return {}
    try:
        meta = json.loads(file.read_text())
        check_shape(meta, META_SHAPE)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(
            f"checkpoint {file} is damaged ({e}); resume from an earlier checkpoint"
        ) from None
    return meta


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = [line for line in lines if "mismatch" in line.lower() or "missing" in line.lower()]
    return (detail or lines or [type(error).__name__])[-1]


def _no_space(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    return "No space left" in str(error)  # DCP wraps a writer's OSError in its own error
