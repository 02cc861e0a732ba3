"""Embedding supernets: per-table dims (truncations) and per-table rows (hashed tables).

::

    emb_dim   one table [rows, D] per feature ─► pooled e [B, D]
              candidate d: e[:, :d] W_d   (W_d [d, D]; none for d = D)
              out [B, D] = sum_k g[:, k] * candidate_k            (g: per-example mask)

    emb_card  one table [ceil(rows / c_k), D] per feature and candidate c_k,
              looked up with id mod ceil(rows / c_k) (c = 1: the full table)
              out [B, D] = sum_k g[:, k] * e_k

Both are ``PooledEmbeddingCollection``s (``modules/interfaces.py``): a DLRM takes
them in place of its collection. Their tables live in one inner
``EmbeddingBagCollection`` (fused kernels, optimizer in backward). ``frozen``
looks up without autograd: the architecture step must not update embedding rows
(the fused optimizer would, inside backward) on the architecture's data.
Under a fixed one-hot choice each computes what ``CompactEmbeddingCollection``
computes for the table settings the choice writes (``embedding.tables.<t>.dim``,
or ``kind = "hash"`` with ``compression = c``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from towerrec.modules.compositional import hash_rows
from towerrec.modules.embedding_bag import EmbeddingBagCollection, IdPolicy, apply_id_policy
from towerrec.modules.interfaces import Ready
from towerrec.modules.kernels import Backend
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor, KeyedTensor
from towerrec.utils import stable_seed
from towerrec.workflows.nas.choice import Decision

__all__ = [
    "CardinalitySearchCollection",
    "DimSearchCollection",
    "FreezableCollection",
    "SearchCollection",
    "card_rows",
    "dim_cost",
]


def dim_cost(rows: int, dim: int, full_dim: int) -> int:
    """Parameters of a table of ``rows`` stored at ``dim`` and projected to ``full_dim``."""
    return rows * dim + (dim * full_dim if dim < full_dim else 0)


def card_rows(rows: int, compression: float) -> int:
    """Rows of a table compressed ``compression`` times (1: the full table)."""
    return rows if compression == 1 else hash_rows(rows, compression)


def _mix(g: torch.Tensor, outs: list[torch.Tensor]) -> torch.Tensor:
    """``sum_k g[:, k] * outs[k]`` (``g [B, K]``, ``outs[k] [B, D]``)."""
    mixed = g[:, :1] * outs[0]
    for k, out in enumerate(outs[1:], start=1):
        mixed = mixed + g[:, k : k + 1] * out
    return mixed


class SearchCollection(nn.Module):
    """What both supernets share: the decisions, the collection interface, ``frozen``."""

    inner: EmbeddingBagCollection

    def __init__(self, tables: Sequence[TableConfig], decisions: list[Decision]) -> None:
        super().__init__()
        for t in tables:
            if len(t.feature_names) != 1:
                raise ValueError(
                    f"the embedding search needs one feature per table; {t.name} has {t.feature_names}"
                )
        self._tables = list(tables)
        self.decisions = decisions
        self.frozen = False

    @property
    def tables(self) -> list[TableConfig]:
        return self._tables

    @property
    def feature_names(self) -> list[str]:
        return [t.feature_names[0] for t in self._tables]

    @property
    def embedding_dims(self) -> list[int]:
        return [t.embedding_dim for t in self._tables]

    @property
    def backend(self) -> Backend:
        return self.inner.backend

    @property
    def num_embedding_parameters(self) -> int:
        return self.inner.num_embedding_parameters + sum(p.numel() for p in self.parameters())

    def flops_per_sample(self) -> int:
        return 0

    def describe(self) -> list[dict[str, Any]]:
        return self.inner.describe()

    def collisions(self) -> dict[str, int] | None:
        return None

    def forward_start(self, features: KeyedJaggedTensor) -> Ready:
        return Ready(self(features))

    def _lookup(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self.frozen:
            with torch.no_grad():
                return self.inner(features)
        return self.inner(features)


class FreezableCollection(SearchCollection):
    """A plain ``EmbeddingBagCollection`` with ``frozen`` (the ``mlp`` space's tables)."""

    def __init__(self, inner: EmbeddingBagCollection) -> None:
        super().__init__(inner.tables, [])
        self.inner = inner

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self._lookup(features)


class DimSearchCollection(SearchCollection):
    """Per-table dims by truncation of one ``[rows, D]`` table (module docstring)."""

    def __init__(
        self,
        tables: Sequence[TableConfig],
        candidates: dict[str, Sequence[int]],
        optimizer: EmbeddingOptimizerConfig | None = None,
        *,
        backend: Backend | str = Backend.AUTO,
        device: torch.device | str | None = None,
        id_policy: IdPolicy | str = IdPolicy.ERROR,
        seed: int = 0,
    ) -> None:
        self.dims = [sorted(candidates[t.name]) for t in tables]  # per table, ascending
        decisions = [Decision(f"emb_dim.{t.name}", dims) for t, dims in zip(tables, self.dims)]
        super().__init__(tables, decisions)
        for t, dims in zip(tables, self.dims):
            if max(dims) > t.embedding_dim:
                raise ValueError(
                    f"nas.emb_dim candidates {dims} of table {t.name} exceed "
                    f"model.embedding_dim = {t.embedding_dim}, the width of the table they "
                    "truncate; use candidates <= it or raise model.embedding_dim"
                )
        self.inner = EmbeddingBagCollection(
            tables, optimizer, backend=backend, device=device, id_policy=id_policy, seed=seed
        )
        self.projections = nn.ModuleDict()
        for t, dims in zip(tables, self.dims):
            for dim in dims:
                if dim < t.embedding_dim:
                    proj = nn.Linear(dim, t.embedding_dim, bias=False)
                    gen = torch.Generator().manual_seed(stable_seed("projection", seed, t.name))
                    with torch.no_grad():  # the init of CompactEmbeddingCollection's projection
                        proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen) / dim**0.5)
                    self.projections[f"{t.name}__{dim}"] = proj
        self.projections.to(self.inner.device)

    def costs(self, index: int) -> list[float]:
        """Parameters of table ``index`` at each of its candidate dims."""
        t = self._tables[index]
        return [float(dim_cost(t.num_embeddings, d, t.embedding_dim)) for d in self.dims[index]]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        pooled = self._lookup(features)
        batch, outs = features.stride(), []
        for t, decision, dims in zip(self._tables, self.decisions, self.dims):
            e = pooled[t.feature_names[0]]
            g = decision.mask(batch, e.device)
            candidates = [e if d == t.embedding_dim else self._project(t.name, d, e) for d in dims]
            outs.append(_mix(g, candidates))
        return KeyedTensor(self.feature_names, self.embedding_dims, torch.cat(outs, dim=1))

    def _project(self, table: str, dim: int, e: torch.Tensor) -> torch.Tensor:
        """``e[:, :dim] W`` (``e [B, D]``, ``W [dim, D]``) -> ``[B, D]``."""
        proj = self.projections[f"{table}__{dim}"]
        assert isinstance(proj, nn.Linear)  # the dict holds the projections only
        return proj(e[:, :dim])

    def standalone_state(self, choice: Sequence[int]) -> dict[str, torch.Tensor]:
        """State of the ``CompactEmbeddingCollection`` of ``choice``, as it names it."""
        weights, state = self.inner.table_weights(), {}
        for t, dims, k in zip(self._tables, self.dims, choice):
            dim = dims[k]
            state[f"inner.embedding_bags.{t.name}.weight"] = (
                weights[t.name][:, :dim].detach().clone()
            )
            if dim < t.embedding_dim:
                proj = self.projections[f"{t.name}__{dim}"]
                assert isinstance(proj, nn.Linear)  # the dict holds the projections only
                state[f"projections.{t.name}.weight"] = proj.weight.detach().clone()
        return state


class CardinalitySearchCollection(SearchCollection):
    """Per-table rows by separate hashed tables of candidate sizes (module docstring)."""

    _rows_per_feature: torch.Tensor

    def __init__(
        self,
        tables: Sequence[TableConfig],
        candidates: dict[str, Sequence[float]],
        optimizer: EmbeddingOptimizerConfig | None = None,
        *,
        backend: Backend | str = Backend.AUTO,
        device: torch.device | str | None = None,
        id_policy: IdPolicy | str = IdPolicy.ERROR,
        seed: int = 0,
    ) -> None:
        decisions = [Decision(f"emb_card.{t.name}", sorted(candidates[t.name])) for t in tables]
        super().__init__(tables, decisions)
        self.id_policy = IdPolicy(id_policy)
        physical = [
            replace(
                t,
                name=self._physical(t.name, c),
                feature_names=(self._physical(t.feature_names[0], c),),
                num_embeddings=card_rows(t.num_embeddings, c),
                init_scale=t.scale,
            )
            for t, d in zip(tables, decisions)
            for c in d.candidates
        ]
        self.inner = EmbeddingBagCollection(
            physical, optimizer, backend=backend, device=device, seed=seed
        )
        rows = [t.num_embeddings for t in tables]
        self.register_buffer(
            "_rows_per_feature",
            torch.tensor(rows, dtype=torch.int64, device=self.inner.device),
            persistent=False,
        )

    @staticmethod
    def _physical(name: str, compression: float) -> str:
        return f"{name}__x{compression:g}"

    def costs(self, index: int) -> list[float]:
        """Parameters of table ``index`` at each of its candidate row counts."""
        t = self._tables[index]
        return [
            float(card_rows(t.num_embeddings, c) * t.embedding_dim)
            for c in self.decisions[index].candidates
        ]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if features.keys() != self.feature_names:
            features = features.select(self.feature_names)
        values = apply_id_policy(features, self._rows_per_feature, self.id_policy).long()
        batch, lengths, weights = features.stride(), features.lengths(), features.weights_or_none()
        bounds = features.offsets()[::batch].tolist()
        names, phys_values, phys_lengths, phys_weights = [], [], [], []
        for f, (t, d) in enumerate(zip(self._tables, self.decisions)):
            ids, lens = values[bounds[f] : bounds[f + 1]], lengths[f * batch : (f + 1) * batch]
            for c in d.candidates:
                rows = card_rows(t.num_embeddings, c)
                names.append(self._physical(t.feature_names[0], c))
                phys_values.append(ids if c == 1 else torch.remainder(ids, rows))
                phys_lengths.append(lens)
                if weights is not None:
                    phys_weights.append(weights[bounds[f] : bounds[f + 1]])
        physical = KeyedJaggedTensor(
            names,
            torch.cat(phys_values),
            torch.cat(phys_lengths),
            torch.cat(phys_weights) if phys_weights else None,
            validate=False,
        )
        pooled = self._lookup(physical)
        outs = []
        for t, d in zip(self._tables, self.decisions):
            e = [pooled[self._physical(t.feature_names[0], c)] for c in d.candidates]
            outs.append(_mix(d.mask(batch, e[0].device), e))
        return KeyedTensor(self.feature_names, self.embedding_dims, torch.cat(outs, dim=1))

    def standalone_state(self, choice: Sequence[int]) -> dict[str, torch.Tensor]:
        """State of the ``CompactEmbeddingCollection`` of ``choice``, as it names it."""
        weights = self.inner.table_weights()
        return {
            f"inner.embedding_bags.{t.name}.weight": weights[
                self._physical(t.name, d.candidates[k])
            ]
            .detach()
            .clone()
            for t, d, k in zip(self._tables, self.decisions, choice)
        }
