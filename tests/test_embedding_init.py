"""``embedding.init`` and ``init_scale``: every storage and backend starts the same rows
from the same setting.

A run's tables are resolved once from the config (``build_tables``: the rule, its scale
and ``[embedding.tables.<t>]`` overrides); from there each storage fills its rows from
that table: the fused kernels (torch and FBGEMM) and cached tables over host or SSD
stores with ``init_table_block``, kv tables on first touch with ``init_rows``, compact
tables (hash, QR, mixed dims) and the NAS supernets through their part tables, a DMT
through its collection. Shards that initialise themselves are tests/test_self_init_shards.py.
"""

import math

import pytest
import torch
from conftest import needs_fbgemm

from towerrec.build.models import build_model, build_tables
from towerrec.config import ConfigError, config_to_toml, load_config
from towerrec.data.batch import DataSchema, SparseFeature
from towerrec.modules.tables import INIT_BLOCK_ROWS, TableConfig, init_rows, init_table_block
from towerrec.sparse import KeyedJaggedTensor
from towerrec.workflows.nas.supernet import build_supernet

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = DataSchema(
    num_dense=2,
    sparse=(
        SparseFeature("tiny", 3),
        SparseFeature("mid", 40),
        SparseFeature("big", INIT_BLOCK_ROWS + 77),  # two init blocks
        SparseFeature("wide", 900),
    ),
)
SEED = 5
# The collection's rule, one table of another rule with a scale of its own, one of a
# _rows rule, the rest on the collection's.
SETTINGS = [
    "embedding.init=normal_scale",
    "embedding.init_scale=0.02",
    "embedding.tables.tiny.init=uniform_scale",
    "embedding.tables.tiny.init_scale=0.3",
    "embedding.tables.mid.init=uniform_rows",
]
EXPECTED = {"tiny": ("uniform", 0.3), "mid": ("uniform", None), "big": ("normal", 0.02)}


def config(*extra: str):
    base = ["model.bottom_mlp=[8, 8]", "model.embedding_dim=8", "model.top_mlp=[8, 1]"]
    return load_config(None, [*base, f"train.seed={SEED}", *SETTINGS, *extra])


def assert_tables_start_from_their_init(weights: dict, tables: list[TableConfig]) -> None:
    assert set(weights) == {t.name for t in tables}
    for t in tables:
        assert torch.equal(weights[t.name], init_table_block(t, SEED)), t.name


def test_settings_resolve_into_each_tables_rule_and_scale():
    tables = {t.name: t for t in build_tables(config(), SCHEMA)}
    for name, (init, scale) in EXPECTED.items():
        assert (tables[name].init, tables[name].init_scale) == (init, scale), name
    assert tables["mid"].scale == 40**-0.5 and tables["wide"].scale == 0.02
    weights = init_table_block(tables["tiny"], SEED)
    assert 0.2 < weights.abs().max() <= 0.3
    big = init_table_block(tables["big"], SEED)
    assert abs(float(big.std()) - 0.02) < 0.001 and abs(float(big.mean())) < 0.001


def test_the_earlier_names_keep_their_meaning():
    """``uniform`` and ``normal`` were +-sqrt(1/rows) and std sqrt(1/rows): aliases of the
    _rows rules, written back under those names."""
    for old, new, distribution in (
        ("uniform", "uniform_rows", "uniform"),
        ("normal", "normal_rows", "normal"),
    ):
        cfg = load_config(None, [f"embedding.init={old}"])
        assert cfg.embedding.init == new
        assert f'init = "{new}"' in config_to_toml(cfg)
        tables = build_tables(cfg, SCHEMA)
        assert all((t.init, t.init_scale) == (distribution, None) for t in tables)
        assert [t.scale for t in tables] == [f.num_embeddings**-0.5 for f in SCHEMA.sparse]
    table = load_config(None, ["embedding.tables.mid.init=normal"]).embedding.tables["mid"]
    assert table.init == "normal_rows"


@pytest.mark.parametrize("backend", ["torch", pytest.param("fbgemm", marks=needs_fbgemm)])
def test_fused_kernels_start_from_the_setting(backend):
    cfg = config(f"embedding.backend={backend}")
    model = build_model(cfg, SCHEMA, torch.device("cpu"))
    assert_tables_start_from_their_init(model.sparse.table_weights(), build_tables(cfg, SCHEMA))


@pytest.mark.parametrize("backing", ["host", "ssd"])
def test_cached_tables_start_from_the_setting(tmp_path, backing):
    cfg = config(
        "embedding.memory=cached",
        f"embedding.backing={backing}",
        f"embedding.backing_path='{tmp_path}'",
        "embedding.cache_min_rows=100",  # tiny and mid stay in device memory
    )
    sparse = build_model(cfg, SCHEMA, torch.device("cpu")).sparse
    assert sorted(sparse.caches) == ["big", "wide"]
    assert_tables_start_from_their_init(sparse.table_weights(), build_tables(cfg, SCHEMA))


def test_kv_tables_create_rows_from_the_setting_on_first_touch(tmp_path):
    cfg = config(
        "embedding.memory=cached",
        "embedding.backing=kv",
        f"embedding.backing_path='{tmp_path}'",
        "embedding.cache_slots=64",
        "embedding.cache_min_rows=100",
        "embedding.backend=torch",
    )
    sparse = build_model(cfg, SCHEMA, torch.device("cpu")).sparse
    tables = {t.name: t for t in build_tables(cfg, SCHEMA)}
    ids = {"tiny": [2, 0], "mid": [39, 1], "big": [INIT_BLOCK_ROWS + 3, 17], "wide": [5, 899]}
    kjt = KeyedJaggedTensor(
        list(ids),
        torch.tensor([i for v in ids.values() for i in v]),
        torch.ones(8, dtype=torch.int64),
    )
    with torch.no_grad():
        pooled = sparse(kjt).to_dict()
    for name, rows in ids.items():
        table, rows = tables[name], torch.tensor(rows)
        if name in sparse.kv_stores:  # made from the id alone
            want = init_rows(table, SEED, rows)
        else:
            want = init_table_block(table, SEED)[rows]
        assert torch.equal(pooled[name], want), name
    assert sorted(sparse.kv_stores) == ["big", "wide"]
    big = init_rows(tables["big"], SEED, torch.arange(INIT_BLOCK_ROWS))
    assert abs(float(big.std()) - 0.02) < 0.001  # normal_scale's std, as the blocks have


@pytest.mark.parametrize(
    "storage",
    [
        ["embedding.kind=hash"],
        ["embedding.kind=qr", "embedding.qr_operation=mult"],
        ["embedding.kind=qr", "embedding.qr_operation=add"],
        ["embedding.kind=qr", "embedding.qr_operation=concat"],
        ["embedding.kind=md", "embedding.tables={}"],
        ["embedding.tables.wide.dim=4"],
    ],
    ids=["hash", "qr-mult", "qr-add", "qr-concat", "md", "narrow"],
)
def test_compact_tables_start_their_parts_from_the_setting(storage):
    """Each part of a logical table takes its distribution and scale (QR ``add``: the scale
    over sqrt(partitions), so the sum has it; ``mult``: factors 1 + init); ``md`` takes no per-table settings, so it
    runs on the collection's rule alone."""
    cfg = config(*storage)
    sparse = build_model(cfg, SCHEMA, torch.device("cpu")).sparse
    tables = {t.name: t for t in build_tables(cfg, SCHEMA)}
    weights = sparse.inner.table_weights()
    compacted = 0
    for plan in sparse.plans:
        table = tables[plan.table.name]
        divisor = math.sqrt(len(plan.parts)) if cfg.embedding.qr_operation == "add" else 1
        compacted += plan.parts != [table]
        for j, part in enumerate(plan.parts):
            assert part.init == table.init, part.name
            assert part.scale == pytest.approx(table.scale / divisor), part.name
            factor = j and cfg.embedding.qr_operation == "mult" and plan.kind.value == "qr"
            want = init_table_block(part, SEED) + (1.0 if factor else 0.0)  # mult: 1 + init
            assert torch.equal(weights[part.name], want), part.name
    assert compacted


def test_dmt_towers_start_from_the_setting():
    cfg = config("model.name=dmt", "model.dmt.partition=contiguous", "model.dmt.num_towers=2")
    model = build_model(cfg, SCHEMA, torch.device("cpu"))
    assert type(model).__name__ == "DMT"
    assert_tables_start_from_their_init(model.sparse.table_weights(), build_tables(cfg, SCHEMA))


@pytest.mark.parametrize("space", ["emb_dim", "emb_card"])
def test_nas_supernets_start_from_the_setting(space):
    cfg = config(
        f"nas.space={space}", "nas.emb_dim.candidates=[4, 8]", "nas.emb_card.candidates=[1.0, 4.0]"
    )
    sparse = build_supernet(cfg, SCHEMA, torch.device("cpu")).model.sparse
    physical = sparse.inner.tables
    tables = {t.name: t for t in build_tables(cfg, SCHEMA)}
    for part in physical:
        table = tables[part.name.split("__")[0]]
        assert (part.init, part.scale) == (table.init, table.scale), part.name
    assert_tables_start_from_their_init(sparse.inner.table_weights(), physical)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["embedding.init_scale=0"], r"embedding.init_scale = 0.0 must be a finite number > 0"),
        (["embedding.init_scale=-0.01"], r"embedding.init_scale = -0.01 must be a finite"),
        (["embedding.init_scale=nan"], r"embedding.init_scale = nan must be a finite"),
        (["embedding.init_scale=inf"], r"embedding.init_scale = inf must be a finite"),
        (
            ["embedding.init=xavier"],
            r"embedding.init = 'xavier' is not an init rule; choose one of 'uniform_rows'",
        ),
        (["embedding.tables.mid.init=gaussian"], r"init = 'gaussian' is not an init rule"),
        (["embedding.tables.mid.init_scale=0"], r"init_scale = 0.0 must be a finite number > 0"),
        (
            ["embedding.init=uniform_rows", "embedding.init_scale=0.05"],
            r"embedding.init_scale = 0.05 is not used: embedding.init = 'uniform_rows' scales "
            r"each table by sqrt\(1/rows\); set embedding.init = 'uniform_scale'",
        ),
        (
            ["embedding.init=normal", "embedding.tables.mid.init_scale=0.1"],
            r"embedding.tables.mid.init_scale = 0.1 is not used: the table's init "
            r"'normal_rows' scales by sqrt\(1/rows\); set its init = 'normal_scale'",
        ),
    ],
)
def test_bad_init_settings_name_the_key_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_a_collection_scale_read_by_one_table_of_its_own_rule_is_accepted():
    cfg = load_config(
        None,
        [
            "embedding.init=uniform_rows",
            "embedding.init_scale=0.2",
            "embedding.tables.mid.init=uniform_scale",
        ],
    )
    assert cfg.embedding.table_init("mid") == ("uniform", 0.2)
    assert cfg.embedding.table_init("wide") == ("uniform", None)


def test_an_init_override_changes_no_storage_setting():
    """A table named only for its init is stored as the collection says (a hash threshold
    still applies to it)."""
    cfg = config("embedding.kind=hash", "embedding.row_threshold=100")
    compact = cfg.embedding.compact()
    assert compact.for_table("tiny") is compact and compact.for_table("mid") is compact
    sparse = build_model(cfg, SCHEMA, torch.device("cpu")).sparse
    kinds = {plan.table.name: plan.kind.value for plan in sparse.plans}
    assert kinds == {"tiny": "full", "mid": "full", "big": "hash", "wide": "hash"}
