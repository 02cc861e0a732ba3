"""Fuzz targets of the JSON files towerrec reads back: plan files and cache manifests.

Each starts from a file towerrec itself wrote and mutates it (``mutated_json``):
values replaced by others of any type or near the original (off by one,
negative, huge, NaN, as text), keys deleted or added, the text cut short or a
byte changed. The reader must refuse the file naming it, or read it to what a
reader of the original would have read.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

from towerrec.bench.fuzz_core import FuzzFailure, FuzzTarget, made_once, refused

__all__ = ["JSON_TARGETS", "mutated_json"]


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


def _json_values() -> Any:
    from hypothesis import strategies as st

    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 3),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=5),
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=4,
    )


def _near(value: Any) -> list[Any]:
    """Values a careless edit or a bit rot might leave in place of ``value``."""
    out: list[Any] = [None, str(value), [value]]
    if isinstance(value, bool):
        out.append(not value)
    elif isinstance(value, int):
        out += [value + 1, value - 1, -value, 0, value * 2**40, float(value)]
    elif isinstance(value, float):
        out += [float("nan"), float("inf"), -value, int(value)]
    elif isinstance(value, str):
        out += [value + "x", "", value.upper()]
    elif isinstance(value, list):
        out += [value[:-1], [*value, *value[-1:]], {}]
    return out


def _apply(data: Any, op: tuple) -> Any:
    kind, path, value = op
    if not path:
        return value if kind == "set" else data
    node = data
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return data  # an earlier mutation moved the path
    last = path[-1]
    try:
        if kind == "set":
            node[last] = value
        elif kind == "delete":
            del node[last]
        elif kind == "add" and isinstance(node, dict):
            node[f"{last}_extra"] = value
    except (KeyError, IndexError, TypeError):
        pass
    return data


def _mutated(base: Any, mutations: list[tuple]) -> bytes:
    """``base`` with ``mutations`` applied, as JSON bytes; ``base`` is left as it was."""
    # copies of both: a value near one of base's (``[value]``, ``value[:-1]``) shares base's
    # lists and dicts, which a later mutation of the same input would change in place;
    # base changed from one input to the next makes Hypothesis's replay draw differently
    data, mutations = copy.deepcopy((base, mutations))
    for op in mutations:
        data = _apply(data, op)
    return json.dumps(data).encode()


def mutated_json(base: Any) -> Any:
    """A strategy of ``base`` (a JSON value) mutated, as bytes of its file."""
    from hypothesis import strategies as st

    base = copy.deepcopy(base)  # the caller's value may change; the strategy must not
    paths = _paths(base)

    def at(path: tuple) -> Any:
        node = base
        for key in path:
            node = node[key]
        return node

    def op_for(path: tuple) -> Any:
        near = st.sampled_from(_near(at(path)))
        return st.one_of(
            st.tuples(st.just("set"), st.just(path), st.one_of(near, _json_values())),
            st.tuples(st.just("delete"), st.just(path), st.none()),
            st.tuples(st.just("add"), st.just(path), _json_values()),
        )

    ops = st.lists(st.sampled_from(paths).flatmap(op_for), min_size=1, max_size=3)

    text = json.dumps(base).encode()
    return st.one_of(
        ops.map(lambda mutations: _mutated(base, mutations)),
        ops.map(lambda mutations: _mutated(base, mutations)),
        st.integers(0, len(text)).map(lambda n: text[:n]),
        st.tuples(st.integers(0, len(text) - 1), st.binary(min_size=1, max_size=1)).map(
            lambda t: text[: t[0]] + t[1] + text[t[0] + 1 :]
        ),
    )


# ------------------------------------------------------------------ plan files
_PLAN_TABLES = (("t0", 40, 8), ("t1", 30, 8), ("t2", 20, 8))


def _plan_base() -> dict[str, Any]:
    from towerrec.modules.tables import TableConfig
    from towerrec.sharding.plan import ShardingPlan, plan_table

    tables = [TableConfig(n, rows, dim) for n, rows, dim in _PLAN_TABLES]
    kinds = ("table_wise", "row_wise", "column_wise")
    plans = {
        t.name: plan_table(t, k, [0] if k == "table_wise" else [0, 1])
        for t, k in zip(tables, kinds)
    }
    return ShardingPlan(2, 1, plans).to_dict()


def _check_plan(text: bytes, scratch: Path) -> None:
    from towerrec.build.planning import load_plan_file
    from towerrec.config import load_config
    from towerrec.modules.tables import TableConfig

    path = scratch / "plan.json"
    path.write_bytes(text)
    config = load_config(None, ["plan.strategy=file", f"plan.path={json.dumps(str(path))}"])
    plan = refused(lambda: load_plan_file(config, 2), str(path))
    if plan is None:
        return
    tables = [TableConfig(n, rows, dim) for n, rows, dim in _PLAN_TABLES]

    def validated() -> bool:
        plan.validate(tables)
        return True

    valid = refused(validated, "invalid sharding plan")
    if not valid:
        return
    for name, table_plan in plan.tables.items():  # a plan that validates holds whole numbers
        for shard in table_plan.shards:
            numbers = (shard.rank, *shard.rows, *shard.cols)
            if not all(type(v) is int for v in numbers) or not 0 <= shard.rank < 2:
                raise FuzzFailure(f"table {name}: shard {shard} passed validation")


# ------------------------------------------------------------------ cache manifests
def _tiny_cache() -> tuple[Path, dict[str, Any], Any]:
    """A cache of 64 generated Criteo rows (made once), its manifest and first batch."""
    return made_once("cache", _make_tiny_cache)


def _make_tiny_cache(root: Path) -> tuple[Path, dict[str, Any], Any]:
    from towerrec.data.criteo import CriteoOptions, preprocess_criteo
    from towerrec.data.criteo_gen import generate_criteo_files

    generate_criteo_files(root / "tsv", files=1, rows_per_file=64, seed=0)
    options = CriteoOptions(num_embeddings=(50,), eval_fraction=0.25)
    manifest = preprocess_criteo([root / "tsv" / "day_0"], root / "cache", options, progress=False)
    return root / "cache", manifest, _first_batch(root / "cache")


def _first_batch(cache: Path) -> Any:
    from towerrec.data.cache import open_cache
    from towerrec.data.loader import ColumnSource, LoaderConfig

    source = ColumnSource(open_cache(cache, verify="always"), LoaderConfig(shuffle=False))
    return next(iter(source.train_batches(16, 0, 0, 1)))


def _cache_manifest() -> Any:
    _, manifest, _ = _tiny_cache()
    return mutated_json(json.loads(json.dumps(manifest)))


def _check_cache_manifest(text: bytes, scratch: Path) -> None:
    import torch

    cache, _, original = _tiny_cache()
    copy_dir = scratch / "cache"
    shutil.copytree(cache, copy_dir)
    (copy_dir / "verified.json").unlink(missing_ok=True)
    (copy_dir / "manifest.json").write_bytes(text)
    batch = refused(lambda: _first_batch(copy_dir), str(copy_dir))
    if batch is None:
        return
    same = (
        torch.equal(batch.labels, original.labels)
        and torch.equal(batch.dense, original.dense)
        and torch.equal(batch.sparse.values(), original.sparse.values())
        and torch.equal(batch.sparse.lengths(), original.sparse.lengths())
    )
    if not same:
        raise FuzzFailure("the manifest was accepted and the first batch read differs")


JSON_TARGETS = [
    FuzzTarget(
        "plan_json",
        "plan files (towerrec plan's JSON) -> build.planning.load_plan_file, then validate",
        lambda: mutated_json(_plan_base()),
        _check_plan,
    ),
    FuzzTarget(
        "cache_manifest",
        "a data cache's manifest.json -> data.cache.open_cache and the first batch",
        _cache_manifest,
        _check_cache_manifest,
    ),
]
