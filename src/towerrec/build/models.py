"""The run's model from its config: ``MODELS``, one builder per ``model.name``.

::

    config ──► build_tables ──► build_embedding_collection ──► MODELS[model.name].build
           (one table per             (full, compact or             (DLRM, DCN, Wukong, DMT
            categorical feature)       cached tables)                over that collection)
                                                                      │
                                                      attach_distill_heads (when [distill]
                                                      asks for an auxiliary head or adapter)

Each builder seeds the dense weights with ``train.seed``. A DMT groups its features
into towers by ``model.dmt.partition``: named groups, or ``contiguous``, ``random``,
``cost`` (``partition_groups``); the learned ones (``auto``, ``embedding``) come from
a pilot run first (``towers.with_learned_partition``, which ``run.build_run`` calls).
The names are declared in ``towerrec.models.names`` for the config to check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from towerrec.config import Config
from towerrec.data.batch import DataSchema
from towerrec.distributed.mesh import Topology
from towerrec.models.dcn import DCN
from towerrec.models.distill_heads import HEADS, Adapter, DistillHeads
from towerrec.models.dlrm import DLRM
from towerrec.models.dmt import DMT, check_partition
from towerrec.models.interfaces import RepresentationModel
from towerrec.models.names import ModelName
from towerrec.models.wukong import Wukong
from towerrec.modules.compact import build_embedding_collection
from towerrec.modules.interfaces import PooledEmbeddingCollection
from towerrec.modules.mlp import MLP
from towerrec.modules.tables import TableConfig
from towerrec.planner.towers import (
    FeatureStats,
    contiguous_partition,
    cost_partition,
    feature_costs,
    random_partition,
)

__all__ = [
    "MODELS",
    "ModelEntry",
    "attach_distill_heads",
    "build_model",
    "build_tables",
    "check_towers_fit_hosts",
    "feature_stats",
    "partition_groups",
    "tower_transform",
]

_SEED_OFFSET = 7919  # the distillation heads' own generator: train.seed + this

# (config, schema, embedding collection, device) -> the model
ModelBuilder = Callable[[Config, DataSchema, PooledEmbeddingCollection, torch.device], nn.Module]


@dataclass(frozen=True)
class ModelEntry:
    """One ``model.name``: its builder, and whether it is a multi-tower model (its
    features grouped into towers by ``model.dmt``; on several hosts it runs as the
    tower transform, one tower per host)."""

    build: ModelBuilder
    towers: bool = False


def _dlrm(config: Config, schema: DataSchema, sparse: PooledEmbeddingCollection, device):
    torch.manual_seed(config.train.seed)
    model = config.model
    return DLRM(
        sparse,
        num_dense=schema.num_dense,
        bottom_mlp=model.bottom_mlp,
        top_mlp=model.top_mlp,
        self_interaction=model.self_interaction,
        concat_embeddings=model.concat_embeddings,
        dropout=model.dropout,
        batch_norm=model.batch_norm,
    ).to(device)


def _dcn(config: Config, schema: DataSchema, sparse: PooledEmbeddingCollection, device):
    torch.manual_seed(config.train.seed)
    model = config.model
    parts = (sparse, schema.num_dense, model.bottom_mlp, model.top_mlp)
    return DCN(*parts, model.dcn, dropout=model.dropout, batch_norm=model.batch_norm).to(device)


def _wukong(config: Config, schema: DataSchema, sparse: PooledEmbeddingCollection, device):
    torch.manual_seed(config.train.seed)
    model = config.model
    parts = (sparse, schema.num_dense, model.bottom_mlp, model.top_mlp)
    wukong = Wukong(*parts, model.wukong, dropout=model.dropout, batch_norm=model.batch_norm)
    return wukong.to(device)


def _dmt(config: Config, schema: DataSchema, sparse: PooledEmbeddingCollection, device):
    """The DMT model of ``config`` over ``sparse``; dense weights seeded by ``train.seed``."""
    groups = partition_groups(config, schema)
    torch.manual_seed(config.train.seed)
    model, dmt = config.model, config.model.dmt
    return DMT(
        sparse,
        num_dense=schema.num_dense,
        bottom_mlp=model.bottom_mlp,
        top_mlp=model.top_mlp,
        partition=groups,
        tower=dmt.tower,
        tower_outputs=dmt.outputs_per_tower([len(group) for group in groups]),
        tower_mlp=dmt.tower_mlp,
        fm_rank=dmt.fm_rank,
        tower_dense=dmt.tower_dense,
        self_interaction=model.self_interaction,
        dropout=model.dropout,
        batch_norm=model.batch_norm,
    ).to(device)


MODELS: dict[str, ModelEntry] = {
    ModelName.DLRM: ModelEntry(_dlrm),
    ModelName.DCN: ModelEntry(_dcn),
    ModelName.WUKONG: ModelEntry(_wukong),
    ModelName.DMT: ModelEntry(_dmt, towers=True),
}


def build_tables(config: Config, schema: DataSchema) -> list[TableConfig]:
    """One table per categorical feature, named after it, started as ``embedding.init``
    and ``init_scale`` (or its ``[embedding.tables.<name>]`` settings) say."""
    emb = config.embedding
    tables = []
    for f in schema.sparse:
        init, scale = emb.table_init(f.name)
        tables.append(
            TableConfig(
                name=f.name,
                num_embeddings=f.num_embeddings,
                embedding_dim=config.model.embedding_dim,
                pooling=emb.pooling,
                init=init,
                init_scale=scale,
            )
        )
    return tables


def build_model(
    config: Config, schema: DataSchema, device: torch.device, *, materialize_embeddings: bool = True
) -> nn.Module:
    """The single-device model; dense weights seeded by ``train.seed``; with the
    distillation heads that ``[distill]`` asks for (``attach_distill_heads``).

    ``materialize_embeddings=False`` (distributed runs) leaves full tables unallocated:
    sharding then allocates and initialises only each rank's shards.
    """
    emb = config.embedding
    tiers = emb.tiers()
    sparse = build_embedding_collection(
        build_tables(config, schema),
        emb.compact(),
        emb.optimizer_config(),
        backend=emb.backend,
        device=device,
        id_policy=emb.id_policy,
        seed=config.train.seed,
        materialize=materialize_embeddings,
        tiers=tiers.tables,
        default_tier=tiers.default,
    )
    model = MODELS[config.model.name].build(config, schema, sparse, device)
    return attach_distill_heads(model, config, schema, device)


def attach_distill_heads(
    model: nn.Module, config: Config, schema: DataSchema, device: torch.device
) -> nn.Module:
    """``model`` with the heads ``config.distill`` asks for as its ``distill_heads``
    (``towerrec.models.distill_heads``; none when distillation is off or needs none);
    drawn from their own generator, so the model's own weights are those of a run
    without distillation."""
    distill = config.distill
    auxiliary = distill.enabled and distill.head == "auxiliary"
    if not (auxiliary or distill.adapter):
        return model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.train.seed + _SEED_OFFSET)
        aux = None
        if auxiliary:
            if not isinstance(model, RepresentationModel):
                raise ValueError(
                    f"distill.head = 'auxiliary' needs a model with a representation, but "
                    f"{type(model).__name__} has none; use model.name = 'dlrm' or "
                    "distill.head = 'shared'"
                )
            top = model.representation_module
            assert isinstance(top, MLP)  # the DLRM's top MLP
            sizes = [m.out_features for m in top if isinstance(m, nn.Linear)]
            aux = MLP(top.in_features, sizes, final_activation=False)
        num_dense = schema.num_dense if distill.adapter_features else 0
        adapter = Adapter(distill.adapter_width, num_dense) if distill.adapter else None
    model.add_module(HEADS, DistillHeads(aux, adapter, distill.adapter_lr).to(device))
    return model


def tower_transform(config: Config, topology: Topology) -> bool:
    """Whether the run's model runs as the tower transform: a multi-tower model on
    several ranks of several hosts (``distributed/towers.py``)."""
    return MODELS[config.model.name].towers and topology.world_size > 1 and topology.hosts > 1


def feature_stats(config: Config, schema: DataSchema) -> list[FeatureStats]:
    return [
        FeatureStats(f.name, f.num_embeddings, config.model.embedding_dim, f.pooling_factor)
        for f in schema.sparse
    ]


def check_towers_fit_hosts(config: Config, topology: Topology) -> None:
    """Under the tower transform (several hosts) each host runs one tower: fail before the
    pilot run when ``model.dmt.num_towers`` does not match."""
    if not tower_transform(config, topology):
        return
    towers = config.model.dmt.num_towers
    if towers != topology.hosts:
        raise ValueError(
            f"model.dmt.num_towers = {towers} but the run has {topology.hosts} hosts; the tower "
            f"transform runs one tower per host: set model.dmt.num_towers = {topology.hosts} "
            f"(or run on --hosts {towers})"
        )


def partition_groups(config: Config, schema: DataSchema) -> list[list[str]]:
    """The feature groups of ``model.dmt.partition`` when no pilot run is needed: the
    explicit groups, or ``contiguous``, ``random``, ``cost``. ``auto`` and ``embedding``
    are learned by a pilot run (``towers.resolve_partition``) before the model is built."""
    dmt = config.model.dmt
    names = schema.sparse_names
    if not isinstance(dmt.partition, str):
        groups = [list(g) for g in dmt.partition]
        check_partition(groups, names)
        return groups
    if dmt.partition in ("auto", "embedding"):
        raise ValueError(
            f"model.dmt.partition = {dmt.partition!r} is learned by a pilot run before the model is "
            "built: resolve it with towerrec.build.towers.with_learned_partition(config, "
            "schema) first (towerrec.build.run.build_run does), or name the partition"
        )
    if dmt.num_towers > len(names):
        raise ValueError(
            f"model.dmt.num_towers = {dmt.num_towers} but the data has only {len(names)} "
            f"categorical features; use num_towers <= {len(names)}"
        )
    if dmt.partition == "contiguous":
        return contiguous_partition(names, dmt.num_towers)
    if dmt.partition == "random":
        return random_partition(names, dmt.num_towers, seed=config.train.seed)
    stats = feature_stats(config, schema)  # "cost"
    return cost_partition(
        names, feature_costs(stats, dmt.memory_weight, dmt.count_weight), dmt.num_towers
    )
