"""Helpers shared by the model files."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from towerrec.modules.embedding_bag import dense_parameters
from towerrec.modules.interfaces import PooledEmbeddingCollection

__all__ = [
    "check_dense_input",
    "check_mlp_ends",
    "count_dense_parameters",
    "shared_embedding_dim",
]


def count_dense_parameters(model: nn.Module) -> int:
    """Parameters of ``model`` that the dense optimizer owns (not the fused embeddings')."""
    return sum(p.numel() for _, p in dense_parameters(model))


def shared_embedding_dim(sparse: PooledEmbeddingCollection, model: str) -> int:
    """The one embedding dim of every feature of ``sparse`` (the models stack them)."""
    dims = set(sparse.embedding_dims)
    if len(dims) != 1:
        raise ValueError(f"{model} needs one embedding dim for every feature, got {sorted(dims)}")
    return dims.pop()


def check_mlp_ends(
    bottom_mlp: Sequence[int], top_mlp: Sequence[int], bottom_end: int, what: str
) -> None:
    """Raise unless the bottom MLP (if any) ends at ``bottom_end`` (``what`` says why,
    e.g. "the embedding dim 16") and the top MLP in one logit."""
    if bottom_mlp and bottom_mlp[-1] != bottom_end:
        raise ValueError(f"the bottom MLP must end at {what}, got bottom_mlp={list(bottom_mlp)}")
    if top_mlp[-1] != 1:
        raise ValueError(f"the top MLP must end in one logit, got top_mlp={list(top_mlp)}")


def check_dense_input(num_dense: int, bottom_mlp: Sequence[int], raw_ok: bool = False) -> None:
    """Raise unless there is a bottom MLP exactly when there are dense features: data
    without them (libFM, ``num_dense = 0``) has no bottom MLP, and the interaction runs
    over the embeddings alone. ``raw_ok``: a model that can read the dense features as
    they are (DCN) takes them so when the bottom MLP is empty."""
    if num_dense == 0 and bottom_mlp:
        raise ValueError(
            f"the data has no dense features, so the model has no bottom MLP, but "
            f"bottom_mlp = {list(bottom_mlp)}; set model.bottom_mlp = [] (the interaction "
            "then runs over the embeddings alone)"
        )
    if num_dense > 0 and not bottom_mlp and not raw_ok:
        raise ValueError(
            f"the data has {num_dense} dense features but bottom_mlp = [] reads none of them; "
            "give the bottom MLP's widths, e.g. model.bottom_mlp = [64, 16] for "
            "embedding_dim = 16"
        )
