"""Fuzz targets of user data beyond line formats: Parquet and CSV tables with a declared
schema (``towerrec data table``), the TSV files ``towerrec predict`` scores, and the
augmented directory a student trainer reads (the augmentation service's manifest).
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path
from typing import Any

from towerrec.bench.fuzz_core import FuzzFailure, FuzzTarget, made_once, refused
from towerrec.bench.fuzz_json import mutated_json

__all__ = ["INPUT_TARGETS"]

_COLUMNS = ("y", "a", "b", "c")


def _tables() -> Any:
    """(format, {column: values}, schema arguments)."""
    from hypothesis import strategies as st

    rows = st.integers(1, 6)
    cell = st.one_of(
        st.none(),
        st.sampled_from(["0", "1", "2", "", "x", "1.0", "nan", "inf", "-3", "a|b", "é"]),
        st.integers(-3, 3).map(str),
        st.floats(allow_nan=False, width=32).map(repr),
    )
    size = st.sampled_from([0, 1, 2, 3, 50])
    names = st.sampled_from([*_COLUMNS, "missing"])
    schema = st.fixed_dictionaries(
        {
            "label": st.one_of(st.just("y"), names),
            "dense": st.one_of(
                st.lists(st.sampled_from(["a", "b"]), max_size=2, unique=True),
                st.lists(names, max_size=2, unique=True),
            ),
            "categorical": st.dictionaries(names, size, max_size=2),
            "multi_hot": st.dictionaries(names, size, max_size=1),
        }
    )
    label = st.sampled_from(["0", "1", "1", "0", None, "2", "1.0", "x"])
    table = rows.flatmap(
        lambda n: st.fixed_dictionaries(
            {c: st.lists(label if c == "y" else cell, min_size=n, max_size=n) for c in _COLUMNS}
        )
    )
    return st.tuples(st.sampled_from(["csv", "parquet"]), table, schema)


def _number(value: Any, missing: float) -> float | None:
    """A cell as the table reader's description says: None (malformed) or its value."""
    if value is None or value == "":
        return missing
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _check_table(example: tuple[str, dict[str, list[Any]], dict[str, Any]], scratch: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from towerrec.data.splits import Split
    from towerrec.data.tabular import TableSchema, preprocess_table

    kind, columns, declared = example
    path = scratch / f"data.{kind}"
    if kind == "parquet":
        pq.write_table(pa.table({c: pa.array(v, pa.string()) for c, v in columns.items()}), path)
    else:
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(_COLUMNS)
            writer.writerows(zip(*(columns[c] for c in _COLUMNS)))
    names = [
        *declared["dense"],
        *declared["categorical"],
        *declared["multi_hot"],
        declared["label"],
    ]
    schema = refused(lambda: TableSchema(**declared), *[])
    if schema is None:
        return
    out = scratch / "cache"
    manifest = refused(
        lambda: preprocess_table([path], out, schema, split=Split(0.0, 0)), str(path)
    )
    if manifest is None:
        return
    n = len(columns["y"])
    good = []
    for i in range(n):
        label = _number(columns[schema.label][i], math.nan)
        dense = [_number(columns[d][i], 0.0) for d in schema.dense]
        if label in (0.0, 1.0) and all(v is not None for v in dense):
            good.append((label, dense))
    kept = manifest["rows"]["train"]
    skipped = manifest["report"]["malformed"]
    if kept != len(good) or kept + skipped != n:
        raise FuzzFailure(
            f"{names}: kept {kept} rows and skipped {skipped} of {n}; the format says keep "
            f"{len(good)}"
        )


# ------------------------------------------------------------------ predict
def _artefact() -> dict[str, Any]:
    """An artefact exported from a few steps on a tiny Criteo cache (made once)."""
    return made_once("artefact", _export_artefact)


def _export_artefact(root: Path) -> dict[str, Any]:
    from towerrec.bench.fuzz_json import _tiny_cache
    from towerrec.config import load_config
    from towerrec.serve.artefact import load_artefact
    from towerrec.serve.export import export_run
    from towerrec.workflows.training import train

    cache, _, _ = _tiny_cache()
    settings = [
        "data.source=criteo", f"data.path={json.dumps(str(cache))}", "train.steps=2",
        "train.batch_size=16", "train.eval_every=0", "train.progress=false",
        "optimizer.warmup_steps=1", "model.embedding_dim=4", "model.bottom_mlp=[8, 4]",
        "model.top_mlp=[8, 1]",
    ]  # fmt: skip
    train(load_config(None, settings), root / "run")
    export_run(root / "run", root / "export")
    return {"artefact": load_artefact(root / "export"), "dir": root / "export"}


def _predict_lines() -> Any:

    from towerrec.bench.fuzz_text import _criteo_lines

    return _criteo_lines().map(lambda t: t[0])


def _check_predict(lines: list[bytes], scratch: Path) -> None:
    from towerrec.bench.fuzz_text import _criteo_reference
    from towerrec.serve.predict import predict

    loaded = _artefact()
    path = scratch / "score.tsv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = scratch / "preds.parquet"
    result = refused(
        lambda: predict(loaded["dir"], [path], out, progress=False, artefact=loaded["artefact"]),
        str(path),
    )
    valid = [line for line in lines if _criteo_reference(line.removesuffix(b"\r")) is not None]
    if result is None:
        if len(valid) == len(lines):
            raise FuzzFailure(f"refused {len(lines)} lines that are all well formed")
        return
    if result["samples"] != len(lines):  # one prediction per line, or an error: never fewer
        raise FuzzFailure(f"{len(lines)} lines scored as {result['samples']} predictions")


# ------------------------------------------------------------------ augmented manifest
def _augmented() -> Path:
    """A student's augmented directory of two periods (made once: a teacher, the service)."""
    return made_once("augmented", _augment)


def _augment(root: Path) -> Path:
    from towerrec.config import load_config
    from towerrec.data.period_files import write_periods
    from towerrec.data.synthetic import SyntheticConfig, SyntheticSource
    from towerrec.serve.export import export_run
    from towerrec.workflows.distill.augment import AugmentService
    from towerrec.workflows.training import train

    tables = "data.synthetic.num_embeddings=[30, 20]"
    settings = [
        tables, "data.synthetic.pooling_factors=[1, 2]", "data.synthetic.eval_samples=128",
        "train.steps=2", "train.batch_size=32", "train.eval_every=0", "train.progress=false",
        "optimizer.warmup_steps=1", "model.embedding_dim=4", "model.bottom_mlp=[8, 4]",
        "model.top_mlp=[8, 1]",
    ]  # fmt: skip
    train(load_config(None, settings), root / "teacher")
    export_run(root / "teacher", root / "export")
    stream = SyntheticSource(
        SyntheticConfig(num_embeddings=(30, 20), pooling_factors=(1, 2), periods=2,
                        period_samples=40, eval_samples=128)
    )  # fmt: skip
    write_periods(stream, root / "student", range(2))
    AugmentService(root / "export", [root / "student"], root / "out", batch_size=32).run(once=True)
    return root / "out" / "student"


def _augmented_manifest() -> Any:
    return mutated_json(json.loads((_augmented() / "manifest.json").read_text()))


def _check_augmented(text: bytes, scratch: Path) -> None:
    from towerrec.data.augmented import AugmentedPeriods

    copy = scratch / "student"
    shutil.copytree(_augmented(), copy)
    (copy / "manifest.json").write_bytes(text)

    def read() -> int:
        periods = AugmentedPeriods(copy, timeout_s=0.0, poll_s=0.01)
        return sum(periods.shard(p).rows.rows for p in range(periods.num_periods))

    rows = refused(read, str(copy))
    if rows is not None and rows != 80:
        raise FuzzFailure(f"the manifest was accepted and {rows} rows read, not 80")


INPUT_TARGETS = [
    FuzzTarget(
        "table_schema",
        "Parquet and CSV tables with a declared schema -> data.tabular.preprocess_table",
        _tables,
        _check_table,
    ),
    FuzzTarget(
        "predict_tsv",
        "Criteo TSV files to score -> serve.predict.predict (one prediction per line)",
        _predict_lines,
        _check_predict,
    ),
    FuzzTarget(
        "augmented_manifest",
        "a student's augmented manifest -> data.augmented.AugmentedPeriods and its shards",
        _augmented_manifest,
        _check_augmented,
    ),
]
