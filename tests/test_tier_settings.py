"""The memory-tier setting: declared once (``TierConfig``), resolved once from the run
config (``EmbeddingConfig.tiers``), decided once per table (``TableTiers.place``) and
carried as ``TablePlacement`` values into sharded runs."""

import dataclasses
import warnings

import pytest
import torch

from towerrec.build.models import build_model
from towerrec.config import ConfigError, EmbeddingConfig, load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.modules.compact import build_embedding_collection
from towerrec.modules.compact_config import CompactConfig, TableStorageConfig
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.modules.tiers import (
    Background,
    Memory,
    SsdReads,
    TablePlacement,
    TableTiers,
    TierConfig,
    background_on,
)


def test_the_config_keys_of_a_tier_are_the_fields_of_tier_config():
    embedding = {f.name: f for f in dataclasses.fields(EmbeddingConfig)}
    for f in dataclasses.fields(TierConfig):
        assert f.name in embedding, f"[embedding] has no key {f.name!r} of TierConfig"
        assert embedding[f.name].default == f.default, f.name
    per_table = {f.name for f in dataclasses.fields(TableStorageConfig)}
    tier_fields = {f.name for f in dataclasses.fields(TierConfig)}
    # A table sets its own tier by the same names (a size threshold is per collection).
    assert tier_fields - per_table == {"cache_min_rows"}


def test_a_table_reads_its_ssd_rows_its_own_way():
    config = load_config(
        None,
        ["embedding.ssd_reads=mapped", "embedding.tables.cat_1.ssd_reads=io"],
    )
    tiers = config.embedding.tiers()
    assert tiers.default.ssd_reads is SsdReads.MAPPED
    assert tiers.of("cat_1").ssd_reads is SsdReads.IO
    with pytest.raises(ConfigError, match="ssd_reads = 'fast' is not one of"):
        load_config(None, ["embedding.tables.cat_1.ssd_reads=fast"])


def test_the_run_config_resolves_every_tables_tier_once():
    config = load_config(
        None,
        [
            "embedding.memory=cached",
            "embedding.cache_min_rows=400",
            "embedding.cache_fraction=0.25",
            "embedding.tables.cat_3.memory=device",
            "embedding.tables.cat_1.cache_slots=7",
        ],
    )
    tiers = config.embedding.tiers()
    assert isinstance(tiers, TableTiers)
    assert tiers.default == TierConfig("cached", 0.25, cache_min_rows=400)
    assert tiers.of("cat_0") is tiers.default
    assert tiers.of("cat_3").memory is Memory.DEVICE
    # Its own settings over the collection's; the collection's threshold still holds.
    assert tiers.of("cat_1") == TierConfig("cached", 0.25, cache_min_rows=400, cache_slots=7)


def test_a_table_given_its_own_memory_is_cached_whatever_its_size():
    config = load_config(
        None, ["embedding.cache_min_rows=1000", "embedding.tables.cat_3.memory=cached"]
    )
    tiers = config.embedding.tiers()
    assert tiers.of("cat_3").cache_min_rows == 0
    assert tiers.place("cat_3", 50) == TablePlacement(tiers.of("cat_3"), 3)
    assert not tiers.place("cat_0", 5000).is_cached  # the collection's tier: device


def test_the_one_decision_of_a_tables_placement():
    kv = TierConfig("cached", backing="kv", backing_path="/tmp/x", cache_slots=10)
    tiers = TableTiers(
        TierConfig("cached", 0.1, cache_min_rows=100), {"ids": kv, "cold": TierConfig()}
    )
    assert tiers.place("a", 1000) == TablePlacement(tiers.default, 100)
    assert not tiers.place("a", 100).is_cached  # not more than cache_min_rows
    assert not tiers.place("cold", 10**6).is_cached  # memory = "device"
    big = tiers.place("ids", 2**40)
    assert big.is_cached and big.is_kv and big.cache_rows == 10
    with pytest.warns(UserWarning, match="holds the whole table"):
        small = tiers.place("ids", 10)
    assert small == TablePlacement(kv) and not small.is_kv
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not tiers.place("ids", 10, warn=False).is_cached


def test_a_lazy_collection_carries_its_tables_placements():
    tables = [TableConfig("a", 1000, 4), TableConfig("b", 10, 4)]
    lazy = build_embedding_collection(
        tables,
        CompactConfig(),
        materialize=False,
        default_tier=TierConfig("cached", 0.5, cache_min_rows=100),
        backend="torch",
    )
    assert isinstance(lazy, EmbeddingBagCollection) and not lazy.is_materialized
    assert lazy.tiers == {
        "a": TablePlacement(TierConfig("cached", 0.5, cache_min_rows=100), 500),
        "b": TablePlacement(TierConfig("cached", 0.5, cache_min_rows=100)),
    }


def test_build_model_places_tables_as_the_config_says():
    config = load_config(None, ["embedding.memory=cached", "embedding.cache_fraction=0.5"])
    schema = SyntheticSource(config.data.synthetic).schema
    model = build_model(config, schema, torch.device("cpu"), materialize_embeddings=False)
    placements = model.sparse.tiers
    assert set(placements) == {f.name for f in schema.sparse}
    for feature in schema.sparse:
        assert placements[feature.name].cache_rows == (feature.num_embeddings + 1) // 2


def test_background_threads_take_auto_on_off_or_a_bool_and_refuse_other_values():
    config = load_config(
        None,
        [
            "embedding.write_behind=false",
            "embedding.prefetch=on",
            "embedding.tables.cat_1.write_behind=true",
            "embedding.tables.cat_2.write_behind=auto",
        ],
    )
    tiers = config.embedding.tiers()
    assert config.embedding.prefetch is Background.ON
    assert tiers.of("cat_0").write_behind is Background.OFF
    assert tiers.of("cat_1").write_behind is Background.ON
    assert tiers.of("cat_2").write_behind is Background.AUTO
    assert EmbeddingConfig().write_behind is EmbeddingConfig().prefetch is Background.AUTO
    with pytest.raises(ValueError, match=r"embedding\.prefetch.*'sometimes'.*auto"):
        load_config(None, ["embedding.prefetch=sometimes"])


@pytest.mark.parametrize(
    ("setting", "cpus", "threads", "want"),
    [
        ("auto", 2, 2, False),  # every core has a torch thread: no spare one
        ("auto", 3, 2, True),
        ("auto", 16, 1, True),
        ("auto", 1, 1, False),
        ("on", 1, 4, True),  # forced on or off wins
        ("off", 64, 1, False),
        (True, 1, 1, True),
        (False, 64, 1, False),
    ],
)
def test_a_background_thread_runs_where_a_core_is_spare_unless_forced(
    caplog, setting, cpus, threads, want
):
    with caplog.at_level("INFO", logger="towerrec"):
        got = background_on(setting, "embedding.write_behind", cpus=cpus, torch_threads=threads)
    assert got is want
    logged = [r.getMessage() for r in caplog.records if "embedding.write_behind" in r.getMessage()]
    if setting == "auto":
        said = "on" if want else "off"
        assert logged and logged[0].startswith(
            f"embedding.write_behind = auto: {said} ({cpus} cores for this process, "
            f"{threads} torch threads"
        )
    else:
        assert not logged  # a forced setting decides nothing


@pytest.mark.parametrize("setting", ["auto", "off"])
def test_background_threads_run_where_the_step_computes_on_an_accelerator(caplog, setting):
    """On a GPU the step's torch threads leave the host's cores free: auto turns the thread
    on even where the cores are no more than the torch threads; a forced off still wins."""
    with caplog.at_level("INFO", logger="towerrec"):
        got = background_on(setting, "embedding.prefetch", device="cuda", cpus=2, torch_threads=2)
    assert got is (setting == "auto")
    assert (
        background_on(setting, "embedding.prefetch", device="cpu", cpus=2, torch_threads=2) is False
    )
    if setting == "auto":
        assert "embedding.prefetch = auto: on (the step computes on cuda)" in caplog.text
