"""Fuzz targets of the training state towerrec reads back: a checkpoint's meta.json,
the header of a table's backing store (row file and kv store) and a kv table's
``store.json`` in a checkpoint.

Each starts from what towerrec wrote (a two-step run's checkpoint, a fresh store)
and damages it: JSON mutations (``fuzz_json.mutated_json``), and for the row
file's binary header byte changes as well as JSON bodies under a recomputed
CRC32 (damage the checksum cannot see). The reader must refuse the file naming
it, or read back exactly what was written.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

from towerrec.bench.fuzz_core import FuzzFailure, FuzzTarget, made_once, refused
from towerrec.bench.fuzz_json import mutated_json

__all__ = ["STATE_TARGETS"]

_QUICK = [
    "data.synthetic.num_embeddings=[40, 30]",
    "data.synthetic.pooling_factors=[1, 2]",
    "data.synthetic.eval_samples=256",
    "train.steps=2",
    "train.batch_size=64",
    "train.eval_every=0",
    "train.progress=false",
    "optimizer.warmup_steps=1",
    "model.embedding_dim=4",
    "model.bottom_mlp=[8, 4]",
    "model.top_mlp=[8, 1]",
]


def _tiny_run() -> tuple[Path, Any]:
    """A two-step run with its final checkpoint (made once) and its config."""
    return made_once("run", _train_tiny_run)


def _train_tiny_run(root: Path) -> tuple[Path, Any]:
    from towerrec.config import load_config
    from towerrec.workflows.training import train

    train(load_config(None, _QUICK), root / "run")
    return root / "run", load_config(None, [*_QUICK, "train.steps=3"])


def _meta_base() -> Any:
    from towerrec.train.checkpoint import CheckpointManager

    run, _ = _tiny_run()
    latest = CheckpointManager(run / "checkpoint").latest()
    assert latest is not None
    return mutated_json(json.loads((latest / "meta.json").read_text()))


def _check_meta(text: bytes, scratch: Path) -> None:
    from towerrec.checksums import digests, list_files, write_checksums
    from towerrec.train.checkpoint import CheckpointManager
    from towerrec.train.numerics import pinned
    from towerrec.train.session import set_up

    run, config = _tiny_run()
    copy = scratch / "run"
    shutil.copytree(run, copy)
    latest = CheckpointManager(copy / "checkpoint").latest()
    assert latest is not None
    (latest / "meta.json").write_bytes(text)
    # a checkpoint whose meta.json was written so (checksums.json agrees): the meta parser
    # is fuzzed here, the checksums' refusal of a changed file in test_checkpoint_verify
    write_checksums(latest, digests(latest, list_files(latest)))
    with pinned():  # an error names the file, or the run (a run that stopped early)
        session = refused(lambda: set_up(config, copy, resume=True), str(copy))
    if session is None:
        return
    recorded = json.loads(text).get("threads")
    if recorded is not None and session.threads != recorded:
        raise FuzzFailure(f"meta threads {recorded!r} resumed as {session.threads}")


# ------------------------------------------------------------------ backing stores
def _layout() -> Any:
    from towerrec.modules.tier_store import RowLayout

    return RowLayout("t0", 16, 4, (("momentum1", 1),))


def _header_bodies() -> Any:
    """Row-file headers: bytes changed anywhere, or a mutated JSON body under a valid CRC."""
    from hypothesis import strategies as st

    from towerrec.modules.ssd_store import encode_header

    header = encode_header(_layout())
    flips = st.lists(
        st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=3
    ).map(lambda changes: ("bytes", changes))
    bodies = mutated_json(_layout().to_json()).map(lambda body: ("body", body))
    return st.one_of(flips, bodies, st.just(("bytes", [])).map(lambda _: ("cut", header[:30])))


def _check_ssd_header(example: tuple[str, Any], scratch: Path) -> None:
    from towerrec.modules.ssd_store import HEADER_BYTES, MAGIC, VERSION, SsdStore, read_header

    kind, change = example
    layout = _layout()
    path = scratch / "t0.tstore"
    SsdStore(layout, path).release()
    raw = bytearray(path.read_bytes())
    if kind == "bytes":
        for at, value in change:
            raw[at] = value
    elif kind == "body":
        head = MAGIC + struct.pack("<II", VERSION, len(change)) + change
        head += struct.pack("<I", zlib.crc32(change))
        raw[:HEADER_BYTES] = head[:HEADER_BYTES].ljust(HEADER_BYTES, b"\0")
    else:
        raw = bytearray(change)
    path.write_bytes(bytes(raw))
    store = refused(lambda: SsdStore(layout, path), str(path))
    if store is not None:
        store.release()
        if read_header(path) != layout.to_json():
            raise FuzzFailure(f"a store with header {read_header(path)} opened as {layout}")


def _kv_table() -> Any:
    from towerrec.modules.tables import TableConfig

    return TableConfig("t0", 16, 4)


def _kv_header() -> Any:
    from towerrec.modules.kv_store import KvStore

    with tempfile.TemporaryDirectory() as tmp:
        store = KvStore(_layout(), Path(tmp) / "t0.kv", _kv_table(), seed=0)
        header = dict(store.header)
        store.close()
    return mutated_json(header)


def _check_kv_header(text: bytes, scratch: Path) -> None:
    import lmdb

    from towerrec.modules.kv_store import KvStore

    path = scratch / "t0.kv"
    store = KvStore(_layout(), path, _kv_table(), seed=0)
    header = dict(store.header)
    with store._env.begin(write=True, db=store._meta) as txn:
        txn.put(b"header", text)
    store.close()
    reopened = refused(lambda: KvStore(_layout(), path, _kv_table(), seed=0), str(path))
    if reopened is None:
        return
    reopened.close()
    env = lmdb.open(str(path), max_dbs=2, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"meta", create=False)) as txn:
        raw = txn.get(b"header")
    if raw is None:
        env.close()
        raise FuzzFailure(f"a kv store reopened without its header: {path}")
    stored = json.loads(raw)
    env.close()
    if stored != header:
        raise FuzzFailure(f"a kv store with header {stored} opened as {header}")


def _kv_copy_meta() -> Any:
    from towerrec.modules.kv_store import KV_COPY_META, KvStore

    with tempfile.TemporaryDirectory() as tmp:
        store = KvStore(_layout(), Path(tmp) / "t0.kv", _kv_table(), seed=0)
        store.save_copy(Path(tmp) / "copy")
        meta = json.loads((Path(tmp) / "copy" / KV_COPY_META).read_text())
        store.close()
    return mutated_json(meta)


def _check_kv_copy(text: bytes, scratch: Path) -> None:
    from towerrec.modules.kv_store import KV_COPY_META, KvStore

    store = KvStore(_layout(), scratch / "t0.kv", _kv_table(), seed=0)
    store.save_copy(scratch / "copy")
    (scratch / "copy" / KV_COPY_META).write_bytes(text)
    try:
        refused(lambda: store.load_copy(scratch / "copy"), str(scratch / "copy"))
    finally:
        store.close()


STATE_TARGETS = [
    FuzzTarget(
        "checkpoint_meta",
        "a checkpoint's meta.json -> train.session.set_up(resume=True)",
        _meta_base,
        _check_meta,
    ),
    FuzzTarget(
        "store_header",
        "the header of a table's row file (embedding.backing = ssd) -> SsdStore",
        _header_bodies,
        _check_ssd_header,
    ),
    FuzzTarget(
        "kv_store_header",
        "the header of a kv table's LMDB store (embedding.backing = kv) -> KvStore",
        _kv_header,
        _check_kv_header,
    ),
    FuzzTarget(
        "kv_checkpoint_meta",
        "store.json of a kv table's copy in a checkpoint -> KvStore.load_copy",
        _kv_copy_meta,
        _check_kv_copy,
    ),
]
