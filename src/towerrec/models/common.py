"""Helpers shared by the model files."""

from __future__ import annotations

from torch import nn

__all__ = ["shared_embedding_dim", "sparse_flops_per_sample"]


def sparse_flops_per_sample(sparse: nn.Module) -> int:
    """Dense FLOPs of an embedding collection itself (projections, combinations), if any."""
    flops = getattr(sparse, "flops_per_sample", None)
    return int(flops()) if callable(flops) else 0


def shared_embedding_dim(sparse: nn.Module, model: str) -> int:
    """The one embedding dim of every feature of ``sparse`` (the models stack them)."""
    dims = set(sparse.embedding_dims)
    if len(dims) != 1:
        raise ValueError(f"{model} needs one embedding dim for every feature, got {sorted(dims)}")
    return dims.pop()
