"""Disaggregated Multi-Tower (DMT) model on one device: feature towers, then a DLRM-style top.

::

    dense [B, F_d] ─► bottom MLP ─► x [B, D] ───────────────────────────┬───────────┐
                                                                        │           │
    sparse ─► EmbeddingBagCollection ─► E [B, T, D]                     │           │
               │ split by the partition (features of tower t: T_t)     │           │
               ├─► E_0 [B, T_0, D] ─► tower 0 ─► O_0 [B, K_0, D] ──┐   │           │
               │                    ...                            ├─► stack [B, 1+K, D]
               └─► E_n [B, T_n, D] ─► tower n ─► O_n [B, K_n, D] ──┘   │           │
                                                           pairwise dots [B, P]     │
                          concat [x, (flattened O, compressing towers), dots] ◄─────┘
                                                  │
                                   top MLP ─► logit [B]

A tower (``TowerModule``) sees only its own features' pooled embeddings
(and, with ``tower_dense``, the bottom output x): that is what lets the
semantic-preserving tower transform run tower t on host t and send back only
its output. Kinds:

- ``identity``: ``O_t = E_t`` (K_t = T_t). With every tower the identity the
  model is a DLRM whose features are listed in tower order; ``from_dlrm``
  copies a DLRM's weights so that both compute the same function.
- ``dot``: the tower's pairwise dots, concatenated with its flattened
  embeddings, projected by an MLP to ``K_t`` vectors of dim D: ``tower_outputs``
  per tower, or by default (``DMTConfig.tower_outputs = 0``) one per
  ``features_per_output`` (4) of the tower's features, rounded up.
- ``fm``: as ``dot`` with a low-rank factorization machine instead of all
  dots: ``E_t (E_t^T Y)`` for a learned ``Y [T_t, r]``, ``[B, T_t, r]``.

Data without dense features has no bottom MLP and no x: the dots are those of
the tower outputs alone, and ``tower_dense`` is refused.

The compression ratio is ``sum T_t / sum K_t``: the floats a tower sends back
per sample shrink by it. The model has no ``torch.distributed`` in it; the
tower transform splits it at ``tower_inputs`` / ``towers[t]`` / ``interact``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from towerrec.models.common import (
    check_dense_input,
    check_mlp_ends,
    count_dense_parameters,
    shared_embedding_dim,
)
from towerrec.models.interfaces import SparseArchModel
from towerrec.modules.interaction import DotInteraction
from towerrec.modules.interfaces import PooledEmbeddingCollection
from towerrec.modules.mlp import MLP
from towerrec.sparse import KeyedJaggedTensor
from towerrec.utils import at_least, parse_enum

if TYPE_CHECKING:
    from towerrec.models.dlrm import DLRM

__all__ = [
    "DMT",
    "DMTConfig",
    "LowRankFM",
    "TowerKind",
    "TowerModule",
    "check_partition",
]

PARTITION_STRATEGIES = ("auto", "embedding", "random", "cost", "contiguous")


class TowerKind(StrEnum):
    IDENTITY = "identity"
    DOT = "dot"
    FM = "fm"


@dataclass(frozen=True)
class DMTConfig:
    """``model.dmt``: towers, partition and tower modules of the DMT model.

    ``partition`` is a strategy (``auto``: the tower partitioner on interaction
    strengths learned by a short DLRM run of ``pilot_steps``; ``embedding``: balanced
    clusters of the features' embeddings learned by the same pilot run; ``random``;
    ``cost``: balance the towers' cost only; ``contiguous``: features in order)
    or an explicit list of feature-name groups, one per tower.

    A compressing tower of ``T_t`` features sends ``tower_outputs`` vectors of dim D,
    or with ``tower_outputs = 0`` (the default) ``ceil(T_t / features_per_output)``:
    one vector per 4 features, the compression the paper's shapes use. One vector for
    a whole host's features is too few: on the synthetic data (each feature a 4-dim
    teacher embedding) 9 features in towers of 5 and 4 with one vector each train to
    0.007 AUC below flat DLRM at 300 steps; 2 and 1 vectors match it
    (docs/benchmarks.md, ``bench dmt``).
    """

    num_towers: int = 2
    partition: str | tuple[tuple[str, ...], ...] = "auto"
    tower: TowerKind = TowerKind.DOT
    tower_outputs: int = 0  # vectors of dim model.embedding_dim per compressing tower; 0: by size
    features_per_output: int = 4  # tower_outputs = 0: a tower of T features sends ceil(T / this)
    tower_mlp: tuple[int, ...] = ()  # hidden widths of the projection (empty: one linear)
    fm_rank: int = 4
    tower_dense: bool = False  # give each tower the bottom output x as one more vector
    pilot_steps: int = 300
    balance_tolerance: float = 0.0
    # Tower cost mix: the share of feature count (what a tower compresses), of table
    # memory, and (the rest) of lookup bytes. Count balance is the default: with
    # every tower compressing into the same K vectors, its feature count is its load.
    memory_weight: float = 0.0
    count_weight: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tower", parse_enum(TowerKind, self.tower, "model.dmt.tower"))
        at_least("model.dmt.num_towers", self.num_towers, 1)
        if isinstance(self.partition, str):
            if self.partition not in PARTITION_STRATEGIES:
                raise ValueError(
                    f"model.dmt.partition = {self.partition!r}: use one of "
                    f"{', '.join(map(repr, PARTITION_STRATEGIES))} or a list of feature groups, "
                    "e.g. [['cat_0', 'cat_1'], ['cat_2']]"
                )
        else:
            groups = tuple(tuple(g) for g in self.partition)
            if len(groups) != self.num_towers:
                raise ValueError(
                    f"model.dmt.partition lists {len(groups)} groups but model.dmt.num_towers = "
                    f"{self.num_towers}; give one group of features per tower"
                )
            object.__setattr__(self, "partition", groups)
        at_least("model.dmt.tower_outputs", self.tower_outputs, 0)
        at_least("model.dmt.features_per_output", self.features_per_output, 1)
        at_least("model.dmt.fm_rank", self.fm_rank, 1)
        if any(w < 1 for w in self.tower_mlp):
            raise ValueError(f"model.dmt.tower_mlp widths must be >= 1, got {list(self.tower_mlp)}")
        at_least("model.dmt.pilot_steps", self.pilot_steps, 1)
        if not (self.memory_weight >= 0 and 0 <= self.count_weight <= 1 - self.memory_weight):
            raise ValueError(
                f"model.dmt.memory_weight ({self.memory_weight}) and count_weight "
                f"({self.count_weight}) must be >= 0 with a sum <= 1"
            )
        at_least("model.dmt.balance_tolerance", self.balance_tolerance, 0)

    def outputs_per_tower(self, tower_sizes: Sequence[int]) -> list[int]:
        """Vectors each compressing tower sends, for towers of ``tower_sizes`` features."""
        if self.tower_outputs:
            return [self.tower_outputs] * len(tower_sizes)
        return [math.ceil(size / self.features_per_output) for size in tower_sizes]


def check_partition(groups: Sequence[Sequence[str]], features: Sequence[str]) -> None:
    """Raise ``ValueError`` unless ``groups`` put every feature in exactly one non-empty group."""
    seen: dict[str, int] = {}
    for t, group in enumerate(groups):
        if not group:
            raise ValueError(f"tower {t} of the partition has no features; every tower needs one")
        for name in group:
            if name in seen:
                raise ValueError(f"feature {name!r} is in towers {seen[name]} and {t}; pick one")
            seen[name] = t
    unknown = sorted(set(seen) - set(features))
    missing = [f for f in features if f not in seen]
    if unknown or missing:
        raise ValueError(
            f"the partition must hold each model feature once: unknown {unknown}, "
            f"missing {missing}; the features are {list(features)}"
        )


class LowRankFM(nn.Module):
    """Low-rank factorization machine ``[B, N, D] -> [B, N*r]``: ``X (X^T Y)``, ``Y [N, r]``.

    Each output column mixes all pairwise dots ``<x_i, x_j>`` with the learned
    weights ``Y[j, k]``, at ``O(N D r)`` instead of ``O(N^2 D)``.
    """

    def __init__(self, num_features: int, rank: int) -> None:
        super().__init__()
        self.num_features, self.rank = num_features, rank
        self.projection = nn.Parameter(torch.randn(num_features, rank) / num_features**0.5)

    @property
    def out_features(self) -> int:
        return self.num_features * self.rank

    def flops_per_sample(self, dim: int) -> int:
        return 4 * self.num_features * dim * self.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        summary = torch.matmul(x.transpose(1, 2), self.projection)  # [B, D, r]
        return torch.bmm(x, summary).flatten(1)  # [B, N*r]


class TowerModule(nn.Module):
    """One tower: ``[B, T_t, D]`` (+ x ``[B, D]`` with ``tower_dense``) -> ``[B, K_t, D]``."""

    def __init__(
        self,
        num_features: int,
        dim: int,
        kind: TowerKind | str = TowerKind.DOT,
        *,
        outputs: int = 1,
        hidden: Sequence[int] = (),
        fm_rank: int = 4,
        use_dense: bool = False,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.kind = parse_enum(TowerKind, kind, "tower kind")
        if self.kind is TowerKind.IDENTITY and use_dense:
            raise ValueError(
                "an identity tower passes its embeddings through; use_dense needs kind dot or fm"
            )
        self.num_features, self.dim, self.use_dense = num_features, dim, use_dense
        vectors = num_features + int(use_dense)
        self.interaction: DotInteraction | LowRankFM | None = None
        self.projection: MLP | None = None
        if self.kind is TowerKind.IDENTITY:
            self.num_outputs = num_features
            return
        if self.kind is TowerKind.DOT:
            self.interaction = DotInteraction(vectors, self_interaction=vectors < 2)
        else:
            self.interaction = LowRankFM(vectors, fm_rank)
        self.num_outputs = outputs
        self.projection = MLP(
            vectors * dim + self.interaction.out_features,
            [*hidden, outputs * dim],
            final_activation=False,
            dropout=dropout,
            batch_norm=batch_norm,
        )

    @property
    def compresses(self) -> bool:
        return self.kind is not TowerKind.IDENTITY

    def flops_per_sample(self) -> int:
        if self.projection is None:
            return 0
        assert self.interaction is not None  # built with the projection
        return self.interaction.flops_per_sample(self.dim) + self.projection.flops_per_sample()

    def forward(self, embeddings: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
        if self.projection is None:
            return embeddings
        if self.use_dense:
            if dense is None:
                raise ValueError("this tower was built with use_dense: pass the bottom output x")
            embeddings = torch.cat([dense.unsqueeze(1), embeddings], dim=1)
        assert self.interaction is not None  # built with the projection
        mixed = torch.cat([embeddings.flatten(1), self.interaction(embeddings)], dim=1)
        return self.projection(mixed).view(-1, self.num_outputs, self.dim)


class DMT(SparseArchModel):
    """DMT over an embedding collection whose features all have one dim D (module doc).

    ``partition`` lists the feature names of each tower (every feature of
    ``sparse`` exactly once). ``sparse`` maps a ``KeyedJaggedTensor`` to a
    ``KeyedTensor`` (the ``EmbeddingBagCollection`` or a sharded twin).
    ``tower_outputs``: the vectors every compressing tower sends, or a count per tower
    (``DMTConfig.outputs_per_tower``).
    """

    tower_order: torch.Tensor

    def __init__(
        self,
        sparse: PooledEmbeddingCollection,
        num_dense: int,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        partition: Sequence[Sequence[str]],
        *,
        tower: TowerKind | str = TowerKind.DOT,
        tower_outputs: int | Sequence[int] = 1,
        tower_mlp: Sequence[int] = (),
        fm_rank: int = 4,
        tower_dense: bool = False,
        self_interaction: bool = False,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        dim = shared_embedding_dim(sparse, "DMT")
        check_dense_input(num_dense, bottom_mlp)
        if tower_dense and not num_dense:
            raise ValueError(
                "the data has no dense features, so there is no bottom output for the towers; "
                "set model.dmt.tower_dense = false"
            )
        check_mlp_ends(
            bottom_mlp,
            top_mlp,
            dim,
            f"the embedding dim {dim} (it is dotted with the tower outputs)",
        )
        features = list(sparse.feature_names)
        check_partition(partition, features)
        self.partition = [list(group) for group in partition]
        self.embedding_dim = dim
        self.sparse = sparse
        mlp = partial(MLP, dropout=dropout, batch_norm=batch_norm)
        self.bottom = mlp(num_dense, bottom_mlp) if num_dense else None
        x_dim = dim if self.bottom is not None else 0
        index = {name: i for i, name in enumerate(features)}
        order = [index[name] for group in self.partition for name in group]
        self.register_buffer("tower_order", torch.tensor(order), persistent=False)
        self.tower_sizes = [len(group) for group in self.partition]
        if isinstance(tower_outputs, int):
            outputs = [tower_outputs] * len(self.tower_sizes)
        elif len(tower_outputs) == len(self.tower_sizes):
            outputs = list(tower_outputs)
        else:
            raise ValueError(
                f"tower_outputs lists {len(tower_outputs)} counts for {len(self.tower_sizes)} "
                "towers; give one count per tower, or one int for all"
            )
        self.towers = nn.ModuleList(
            TowerModule(
                size,
                dim,
                tower,
                outputs=k,
                hidden=tower_mlp,
                fm_rank=fm_rank,
                use_dense=tower_dense,
                dropout=dropout,
                batch_norm=batch_norm,
            )
            for size, k in zip(self.tower_sizes, outputs, strict=True)
        )
        self.num_tower_vectors = sum(
            t.num_outputs for t in cast("Iterable[TowerModule]", self.towers)
        )
        self.interaction = DotInteraction(
            int(self.bottom is not None) + self.num_tower_vectors, self_interaction
        )
        concat = sum(
            t.num_outputs * dim for t in cast("Iterable[TowerModule]", self.towers) if t.compresses
        )
        self.top = mlp(
            x_dim + concat + self.interaction.out_features, top_mlp, final_activation=False
        )

    @property
    def compression_ratio(self) -> float:
        """Floats into the towers over floats out of them, per sample."""
        return len(self.tower_order) / self.num_tower_vectors

    def num_dense_parameters(self) -> int:
        """Parameters that the dense optimizer owns."""
        return count_dense_parameters(self)

    def flops_per_sample(self) -> int:
        """Forward FLOPs of the dense part per sample (MLPs, towers, interaction, and
        the embedding collection's own projections, as the other models count)."""
        return (
            (self.bottom.flops_per_sample() if self.bottom is not None else 0)
            + sum(t.flops_per_sample() for t in cast("Iterable[TowerModule]", self.towers))
            + self.interaction.flops_per_sample(self.embedding_dim)
            + self.top.flops_per_sample()
            + self.sparse.flops_per_sample()
        )

    def tower_inputs(self, pooled) -> list[torch.Tensor]:
        """Split the pooled ``KeyedTensor`` ``[B, T*D]`` into ``[B, T_t, D]`` per tower."""
        stacked = pooled.stacked().index_select(1, self.tower_order)
        return list(stacked.split(self.tower_sizes, dim=1))

    def interact(self, x: torch.Tensor | None, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The top: x ``[B, D]`` (None without dense features) and tower outputs
        ``[B, K_t, D]`` -> logits ``[B]``: pairwise dots of the stacked vectors, concatenated
        with x and the flattened outputs of the towers that compress, through the top MLP
        (the tower-parallel DMT calls this one)."""
        compresses = [t.compresses for t in cast("Iterable[TowerModule]", self.towers)]
        vectors = list(outputs) if x is None else [x.unsqueeze(1), *outputs]
        flat = [o.flatten(1) for o, c in zip(outputs, compresses) if c]
        head = [] if x is None else [x]
        dots = self.interaction(torch.cat(vectors, dim=1))
        return self.top(torch.cat([*head, *flat, dots], dim=1)).squeeze(1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x = self.bottom(dense) if self.bottom is not None else None
        inputs = self.tower_inputs(self.sparse(sparse))
        outputs = [tower(e, x) for tower, e in zip(self.towers, inputs)]
        return self.interact(x, outputs)

    @classmethod
    def from_dlrm(
        cls,
        dlrm: DLRM,
        partition: Sequence[Sequence[str]],
        sparse: PooledEmbeddingCollection | None = None,
    ) -> DMT:
        """An identity-tower DMT computing the same function as ``dlrm``.

        Bottom and top weights are copied, the top's input columns permuted to
        the tower order of the pairwise dots. ``sparse`` defaults to the DLRM's
        own collection (shared); pass a copy to train the two side by side.
        """
        if dlrm.concat_embeddings:
            raise ValueError("DMT.from_dlrm needs a DLRM without concat_embeddings")
        bottom: Iterable[nn.Module] = dlrm.bottom if dlrm.bottom is not None else ()
        model = cls(
            sparse if sparse is not None else dlrm.sparse,
            dlrm.bottom.in_features if dlrm.bottom is not None else 0,
            [m.out_features for m in bottom if isinstance(m, nn.Linear)],
            [m.out_features for m in dlrm.top if isinstance(m, nn.Linear)],
            partition,
            tower=TowerKind.IDENTITY,
            self_interaction=dlrm.interaction.self_interaction,
            dropout=dlrm.top.dropout,
            batch_norm=dlrm.top.batch_norm,
        ).to(cast(nn.Linear, dlrm.top[0]).weight.device)
        if model.bottom is not None and dlrm.bottom is not None:
            model.bottom.load_state_dict(dlrm.bottom.state_dict())
        model.top.load_state_dict(dlrm.top.state_dict())
        x = int(dlrm.bottom is not None)  # the bottom output x: vector 0, the top's first D
        dim = model.embedding_dim * x
        # DMT vector -> DLRM vector
        vector_of = [0] * x + [x + int(i) for i in model.tower_order]
        dlrm_pairs = _pair_positions(len(vector_of), dlrm.interaction.self_interaction)
        columns = list(range(dim)) + [
            dim + dlrm_pairs[tuple(sorted((vector_of[i], vector_of[j])))]
            for i, j in zip(*_triu(len(vector_of), dlrm.interaction.self_interaction))
        ]
        with torch.no_grad():
            cast(nn.Linear, model.top[0]).weight.copy_(
                cast(nn.Linear, dlrm.top[0]).weight[:, columns]
            )
        return model


def _triu(n: int, self_interaction: bool) -> tuple[list[int], list[int]]:
    rows, cols = torch.triu_indices(n, n, offset=0 if self_interaction else 1)
    return rows.tolist(), cols.tolist()


def _pair_positions(n: int, self_interaction: bool) -> dict[tuple[int, ...], int]:
    rows, cols = _triu(n, self_interaction)
    return {(i, j): k for k, (i, j) in enumerate(zip(rows, cols))}
