"""Helpers shared by the model files."""

from __future__ import annotations

from torch import nn

__all__ = ["sparse_flops_per_sample"]


def sparse_flops_per_sample(sparse: nn.Module) -> int:
    """Dense FLOPs of an embedding collection itself (projections, combinations), if any."""
    flops = getattr(sparse, "flops_per_sample", None)
    return int(flops()) if callable(flops) else 0
