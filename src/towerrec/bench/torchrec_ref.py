"""TorchRec reference models for side-by-side benchmarks (torchrec is optional).

On one device TorchRec runs two ways, and the benchmarks time both:
``DistributedModelParallel`` over a one-process gloo group with every table
table-wise on the fused kernel (how its users run a model they will shard),
and its ``FusedEmbeddingBagCollection`` without DMP (the same FBGEMM kernel
with the optimizer in backward, no collectives). Ratios are taken against the
faster of the two.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from towerrec.distributed.launch import free_port

__all__ = [
    "single_process_group",
    "torchrec_available",
    "torchrec_dlrm",
    "torchrec_dlrm_fused",
    "torchrec_fused_collection",
    "torchrec_step",
    "torchrec_tables",
]


def torchrec_available() -> bool:
    return (
        importlib.util.find_spec("torchrec") is not None
        and importlib.util.find_spec("fbgemm_gpu") is not None
    )


@contextmanager
def single_process_group():
    """A gloo group of one process (for TorchRec's DMP), destroyed afterwards."""
    if dist.is_initialized():
        yield
        return
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def torchrec_tables(
    num_tables: int, num_embeddings: int | Sequence[int], embedding_dim: int
) -> list:
    """TorchRec ``EmbeddingBagConfig``s ``t0..`` of one feature each, ``f0..f{T-1}``;
    ``num_embeddings`` rows in each, or one count per table."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    rows = [num_embeddings] * num_tables if isinstance(num_embeddings, int) else num_embeddings
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=embedding_dim,
            num_embeddings=rows[i],
            feature_names=[f"f{i}"],
        )
        for i in range(num_tables)
    ]


def torchrec_fused_collection(tables: list, emb_lr: float):
    """TorchRec's ``FusedEmbeddingBagCollection`` (FBGEMM's kernel, row-wise Adagrad in
    the backward), used without DMP."""
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    return FusedEmbeddingBagCollection(
        tables, RowWiseAdagrad, {"lr": emb_lr, "eps": 1e-8}, device=torch.device("cpu")
    )


def _tables_and_model(
    num_tables: int,
    num_embeddings: int | Sequence[int],
    embedding_dim: int,
    num_dense: int,
    bottom_mlp: list[int],
    top_mlp: list[int],
    ebc_factory,
):
    """TorchRec's DLRM over ``ebc_factory(tables)``; features ``f0..f{T-1}``."""
    from torchrec.models.dlrm import DLRM

    tables = torchrec_tables(num_tables, num_embeddings, embedding_dim)
    model = DLRM(
        embedding_bag_collection=ebc_factory(tables),
        dense_in_features=num_dense,
        dense_arch_layer_sizes=list(bottom_mlp),
        over_arch_layer_sizes=list(top_mlp),
        dense_device=torch.device("cpu"),
    )
    return tables, model


def _dense_adam(named_params: dict, dense_lr: float):
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    # The same fused dense Adam as towerrec's: the comparison is of the libraries.
    return KeyedOptimizerWrapper(
        named_params, lambda params: torch.optim.Adam(params, lr=dense_lr, fused=True)
    )


def torchrec_dlrm(
    num_tables: int,
    num_embeddings: int | Sequence[int],
    embedding_dim: int,
    num_dense: int,
    bottom_mlp: list[int],
    top_mlp: list[int],
    emb_lr: float,
    dense_lr: float,
):
    """TorchRec DLRM under DMP (fused row-wise Adagrad) and its combined optimizer: how
    TorchRec's users run a model on one device.

    Call inside ``single_process_group()``. Features are named ``f0..f{T-1}``.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.types import ShardingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer

    tables, model = _tables_and_model(
        num_tables,
        num_embeddings,
        embedding_dim,
        num_dense,
        bottom_mlp,
        top_mlp,
        lambda tables: EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": emb_lr,
            "eps": 1e-8,
        }
    )
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
        )
        for t in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = {k: v for k, v in dmp.named_parameters() if "embedding_bags" not in k}
    return dmp, CombinedOptimizer([dmp.fused_optimizer, _dense_adam(dense, dense_lr)])


def torchrec_dlrm_fused(
    num_tables: int,
    num_embeddings: int | Sequence[int],
    embedding_dim: int,
    num_dense: int,
    bottom_mlp: list[int],
    top_mlp: list[int],
    emb_lr: float,
    dense_lr: float,
):
    """TorchRec DLRM over its ``FusedEmbeddingBagCollection`` without DMP: FBGEMM's
    table-batched kernel with row-wise Adagrad in the backward, no process group, no
    input/output all-to-alls; and the dense Adam. Needs no ``single_process_group``."""
    _, model = _tables_and_model(
        num_tables,
        num_embeddings,
        embedding_dim,
        num_dense,
        bottom_mlp,
        top_mlp,
        lambda tables: torchrec_fused_collection(tables, emb_lr),
    )
    dense = {k: v for k, v in model.named_parameters() if "embedding_bags" not in k}
    return model, _dense_adam(dense, dense_lr)


def torchrec_step(model, optimizer, batch, autocast_dtype: torch.dtype | None = None) -> None:
    """One TorchRec training step on ``batch = (dense, KeyedJaggedTensor, labels)``, the
    forward under ``autocast_dtype`` when given (as a TorchRec user runs bf16: FBGEMM's
    tables stay fp32, autocast's operators take the dense part)."""
    dense, sparse, labels = batch
    with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(dense, sparse).squeeze(1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def quiet_torchrec_logs() -> None:
    import logging

    for name in ("torchrec", "torch.distributed", "torch.fx"):
        logging.getLogger(name).setLevel(logging.ERROR)
