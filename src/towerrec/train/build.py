"""Turn a ``Config`` into the objects of a run: data source, model, dense optimizer."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from towerrec.config import Config, DataConfig, OptimizerConfig
from towerrec.data.batch import DataSchema
from towerrec.data.cache import open_cache
from towerrec.data.loader import ColumnSource
from towerrec.data.movielens import bundled_movielens_path, load_movielens
from towerrec.data.synthetic import SyntheticSource
from towerrec.distributed.fsdp import is_sharded
from towerrec.distributed.mesh import Topology
from towerrec.distributed.sum_reduce import GroupReducer
from towerrec.models.dcn import DCN
from towerrec.models.distill_heads import HEADS, Adapter, DistillHeads, distill_heads
from towerrec.models.dlrm import DLRM
from towerrec.models.dmt import DMT, check_partition
from towerrec.models.interfaces import RepresentationModel
from towerrec.models.wukong import Wukong
from towerrec.modules.compact import build_embedding_collection
from towerrec.modules.embedding_bag import dense_parameters
from towerrec.modules.interfaces import PooledEmbeddingCollection
from towerrec.modules.mlp import MLP
from towerrec.modules.tables import TableConfig
from towerrec.optim.dance import Dance
from towerrec.optim.pb_lbfgs import ProgressiveBatchLBFGS
from towerrec.optim.shampoo import BlockExchange, Shampoo
from towerrec.planner.towers import (
    FeatureStats,
    contiguous_partition,
    cost_partition,
    feature_costs,
    random_partition,
)

__all__ = [
    "build_dense_optimizer",
    "build_model",
    "build_source",
    "build_tables",
    "lr_factor",
    "resolve_device",
    "resolve_eval_every",
    "resolve_run_config",
    "resolve_steps",
]

_SEED_OFFSET = 7919  # the distillation heads' own generator: train.seed + this
SYNTHETIC_STEPS = 2500  # train.steps unset on the synthetic stream, which has no epochs


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device = {name!r} but CUDA is not available; use cpu or auto")
    return device


def build_source(config: DataConfig):
    if config.source == "synthetic":
        return SyntheticSource(config.synthetic)
    if config.source == "movielens":
        path = config.path or bundled_movielens_path()
        return ColumnSource(
            load_movielens(path, config.movielens), config.loader, require_eval=True
        )
    if config.source in ("criteo", "cache"):
        store = open_cache(config.path, verify=config.loader.verify)
        return ColumnSource(store, config.loader, require_eval=True)
    if config.source == "augmented":
        raise ValueError(
            "data.source = 'augmented' is a stream of periods with teacher logits: train on "
            "it with `towerrec replay`, which reads periods in order"
        )
    raise ValueError(f"unknown data.source {config.source!r}")


def build_tables(config: Config, schema: DataSchema) -> list[TableConfig]:
    """One table per categorical feature, named after it."""
    emb = config.embedding
    return [
        TableConfig(
            name=f.name,
            num_embeddings=f.num_embeddings,
            embedding_dim=config.model.embedding_dim,
            pooling=emb.pooling,
            init=emb.init,
        )
        for f in schema.sparse
    ]


def build_model(
    config: Config, schema: DataSchema, device: torch.device, *, materialize_embeddings: bool = True
) -> nn.Module:
    """The single-device model; dense weights seeded by ``train.seed``; with the
    distillation heads that ``[distill]`` asks for (``distill.py``).

    ``materialize_embeddings=False`` (distributed runs) leaves full tables unallocated:
    sharding then allocates and initialises only each rank's shards.
    """
    model = _build_model(config, schema, device, materialize_embeddings=materialize_embeddings)
    return attach_distill_heads(model, config, schema, device)


def _build_model(
    config: Config, schema: DataSchema, device: torch.device, *, materialize_embeddings: bool = True
) -> nn.Module:
    emb = config.embedding
    sparse = build_embedding_collection(
        build_tables(config, schema),
        emb.compact(),
        emb.optimizer_config(),
        backend=emb.backend,
        device=device,
        id_policy=emb.id_policy,
        seed=config.train.seed,
        materialize=materialize_embeddings,
        tiers=emb.table_tiers(),
        default_tier=emb.tier_config(),
    )
    if config.model.name == "dmt":
        return _build_dmt(config, schema, sparse, device)
    torch.manual_seed(config.train.seed)
    model = config.model
    parts = (sparse, schema.num_dense, model.bottom_mlp, model.top_mlp)
    if model.name == "dcn":
        return DCN(*parts, model.dcn, dropout=model.dropout, batch_norm=model.batch_norm).to(device)
    if model.name == "wukong":
        wukong = Wukong(*parts, model.wukong, dropout=model.dropout, batch_norm=model.batch_norm)
        return wukong.to(device)
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


def feature_stats(config: Config, schema: DataSchema) -> list[FeatureStats]:
    return [
        FeatureStats(f.name, f.num_embeddings, config.model.embedding_dim, f.pooling_factor)
        for f in schema.sparse
    ]


def check_towers_fit_hosts(config: Config, topology: Topology) -> None:
    """Under the tower transform (several hosts) each host runs one tower: fail before the
    pilot run when ``model.dmt.num_towers`` does not match."""
    if config.model.name != "dmt":
        return
    towers = config.model.dmt.num_towers
    if topology.world_size > 1 and topology.hosts > 1 and towers != topology.hosts:
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
            "built: resolve it with towerrec.train.towers.with_learned_partition(config, "
            "schema) first (towerrec train does), or name the partition"
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


def _build_dmt(
    config: Config, schema: DataSchema, sparse: PooledEmbeddingCollection, device: torch.device
) -> DMT:
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
        tower_outputs=dmt.tower_outputs,
        tower_mlp=dmt.tower_mlp,
        fm_rank=dmt.fm_rank,
        tower_dense=dmt.tower_dense,
        self_interaction=model.self_interaction,
        dropout=model.dropout,
        batch_norm=model.batch_norm,
    ).to(device)


def build_dense_optimizer(
    config: OptimizerConfig,
    model: nn.Module,
    exchange: BlockExchange | None = None,
    local: Iterable[torch.Tensor] = (),
) -> torch.optim.Optimizer:
    """The dense parameters' optimizer. Shampoo with an ``exchange`` deals its blocks over
    the exchange's ranks (``optim/shampoo.py``); ``local``: parameters replicated over
    fewer ranks, whose blocks every rank computes itself."""
    optimizer = _dense_optimizer(config, model, exchange, local)
    split_adapter_group(optimizer, model)  # the distillation adapter's own learning rate
    return optimizer


def _dense_optimizer(
    config: OptimizerConfig,
    model: nn.Module,
    exchange: BlockExchange | None = None,
    local: Iterable[torch.Tensor] = (),
) -> torch.optim.Optimizer:
    params = [p for _, p in dense_parameters(model) if p.requires_grad]
    sharded = sum(is_sharded(p) for p in params)  # distributed.dense = "fsdp"
    # Sharded and whole parameters together (a DMT's tower on a host of one rank) cannot
    # share a multi-tensor kernel: the optimizer then steps tensor by tensor.
    mixed = 0 < sharded < len(params)
    # One fused kernel over all parameters instead of a few ops per tensor (CPU, CUDA);
    # on sharded parameters torch fuses Adam only (Adagrad, SGD: multi-tensor kernels).
    fused = (
        bool(params)
        and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
        and (config.name == "adam" or not sharded)
        and not mixed
    )
    foreach = False if mixed else None
    if sharded and config.name == "shampoo":
        raise ValueError(
            "optimizer.name = 'shampoo' preconditions whole parameter blocks, but "
            "distributed.dense = 'fsdp' leaves each rank a piece of every parameter; use "
            "distributed.dense = 'ddp' with Shampoo (its blocks are dealt over the ranks), "
            "or adam, adagrad or sgd with fsdp"
        )
    if config.name == "adam":  # weight decay decoupled from the gradient, as AdamW
        return torch.optim.Adam(
            params,
            lr=config.lr,
            weight_decay=config.weight_decay,
            decoupled_weight_decay=True,
            fused=fused or None,
            foreach=foreach,
        )
    if config.name == "shampoo":
        return Shampoo(
            params,
            lr=config.lr,
            settings=config.shampoo,
            weight_decay=config.weight_decay,
            exchange=exchange,
            local=local,
        )
    if config.draws_samples:  # the optimizer sums its evaluations over the ranks itself
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        reducer = GroupReducer() if distributed else None
        if config.name == "pb_lbfgs":
            return ProgressiveBatchLBFGS(
                params, lr=config.lr, settings=config.pb_lbfgs, reducer=reducer
            )
        return Dance(params, lr=config.lr, settings=config.dance, reducer=reducer)
    if config.name == "adagrad":
        return torch.optim.Adagrad(
            params,
            lr=config.lr,
            weight_decay=config.weight_decay,
            fused=fused or None,
            foreach=foreach,
        )
    return torch.optim.SGD(
        params,
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        fused=fused or None,
        foreach=foreach,
    )


def lr_factor(config: OptimizerConfig, step: int, total_steps: int) -> float:
    """Multiplier of the base learning rates at 1-based ``step``: linear warm-up, then decay
    (``plateau``: 1 here; the trainer multiplies in the factor its validations set)."""
    if config.warmup_steps and step <= config.warmup_steps:
        return step / config.warmup_steps
    if config.decay in ("none", "plateau"):
        return 1.0
    span = max(total_steps - config.warmup_steps, 1)
    progress = min(max(step - config.warmup_steps, 0) / span, 1.0)
    floor = config.min_lr_ratio
    if config.decay == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def resolve_steps(config: Config, source) -> tuple[int, str]:
    """The run's number of steps, and where it comes from.

    ``train.steps`` if set; else ``train.epochs`` (default 1: one epoch on real
    data, as MLPerf trains Criteo) passes over the source's training rows, rounded
    up to whole global batches; else, on the synthetic stream, 2,500 steps.
    """
    cfg = config.train
    if cfg.steps is not None:
        return cfg.steps, "as train.steps sets it"
    if config.data.source == "synthetic":
        return SYNTHETIC_STEPS, "the synthetic data's default (train.steps unset)"
    epochs = cfg.epochs if cfg.epochs is not None else 1.0
    rows = source.train_rows
    samples = max(1, round(epochs * rows))
    steps = -(-samples // cfg.batch_size)
    why = (
        "train.epochs"
        if cfg.epochs is not None
        else "train.steps and train.epochs unset: one epoch on real data, as MLPerf trains "
        "Criteo; set either to change it"
    )
    return steps, (
        f"{epochs:g} epoch(s) of {rows:,} training rows at a global batch of "
        f"{cfg.batch_size:,}, rounded up to whole steps ({why})"
    )


def resolve_run_config(config: Config, source) -> tuple[Config, str]:
    """``config`` with ``train.steps`` resolved (``resolve_steps``) and ``train.epochs``
    cleared: what a run records as its ``config.toml``; and where the steps come from.

    A run sized from its data (``train.steps`` unset) that is too short for the default
    warm-up gets a tenth of its steps as warm-up instead: a small cache's one epoch of
    15 steps would otherwise end before the learning rate got anywhere."""
    steps, steps_from = resolve_steps(config, source)
    optimizer = config.optimizer
    warmup = max(1, steps // 10)
    if (
        config.train.steps is None
        and optimizer.warmup_steps == OptimizerConfig().warmup_steps
        and optimizer.warmup_steps > warmup
    ):
        optimizer = replace(optimizer, warmup_steps=warmup)
        steps_from += (
            f"; optimizer.warmup_steps {config.optimizer.warmup_steps} -> {warmup}, a tenth "
            "of this run (set optimizer.warmup_steps to choose)"
        )
    train = replace(config.train, steps=steps, epochs=None)
    return replace(config, train=train, optimizer=optimizer), steps_from


def resolve_eval_every(config: Config, source) -> int:
    """Steps between validations: ``train.eval_every``, or the steps of one pass over the
    training rows (rounded up) for ``"epoch"``; 0: only at the end of the run."""
    every = config.train.eval_every
    if every == "epoch":
        return -(-source.train_rows // config.train.batch_size)
    assert isinstance(every, int)  # TrainConfig allows only "epoch" as a string
    return every


def attach_distill_heads(
    model: nn.Module, config: Config, schema: DataSchema, device: torch.device
) -> nn.Module:
    """``model`` with the heads ``config.distill`` asks for as its ``distill_heads``
    (none when distillation is off or needs none); drawn from their own generator."""
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


def split_adapter_group(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Move the adapter's parameters into a param group of their own at
    ``distill.adapter_lr`` (its ``base_lr``, which ``set_learning_rates`` scales); called
    by ``build_dense_optimizer`` before any step."""
    heads = distill_heads(model)
    if heads is None or heads.adapter is None:
        return
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.Adagrad | torch.optim.SGD):
        raise ValueError(
            f"distill.adapter trains at its own learning rate in a parameter group of its "
            f"own, which {type(optimizer).__name__} does not take; use optimizer.name = "
            "adam, adagrad or sgd"
        )
    lr = heads.adapter_lr
    mine = {id(p) for p in heads.adapter.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in mine]
    optimizer.add_param_group({"params": list(heads.adapter.parameters()), "lr": lr, "base_lr": lr})
