"""TorchRec reference models for side-by-side benchmarks (torchrec is optional).

TorchRec's fused FBGEMM kernels need ``DistributedModelParallel``; at world
size 1 we run it over a one-process gloo group with every table table-wise on
the fused kernel.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["single_process_group", "torchrec_available", "torchrec_dlrm"]


def torchrec_available() -> bool:
    return (
        importlib.util.find_spec("torchrec") is not None
        and importlib.util.find_spec("fbgemm_gpu") is not None
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def single_process_group():
    """A gloo group of one process (for TorchRec's DMP), destroyed afterwards."""
    if dist.is_initialized():
        yield
        return
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def torchrec_dlrm(
    num_tables: int,
    num_embeddings: int,
    embedding_dim: int,
    num_dense: int,
    bottom_mlp: list[int],
    top_mlp: list[int],
    emb_lr: float,
    dense_lr: float,
):
    """TorchRec DLRM under DMP (fused row-wise Adagrad) and its combined optimizer.

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
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=embedding_dim,
            num_embeddings=num_embeddings,
            feature_names=[f"f{i}"],
        )
        for i in range(num_tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=list(bottom_mlp),
        over_arch_layer_sizes=list(top_mlp),
        dense_device=torch.device("cpu"),
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
    # The same fused dense Adam as towerrec's: the comparison is of the libraries.
    dense_opt = KeyedOptimizerWrapper(
        dense, lambda params: torch.optim.Adam(params, lr=dense_lr, fused=True)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt])


def quiet_torchrec_logs() -> None:
    os.environ.setdefault("TORCHREC_LOG_LEVEL", "ERROR")
    import logging

    for name in ("torchrec", "torch.distributed", "torch.fx"):
        logging.getLogger(name).setLevel(logging.ERROR)
