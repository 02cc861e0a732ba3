"""The supernet of a search space on the DLRM backbone, its cost, and the configs of
its architectures.

``build_supernet(config, schema, device)`` builds the run's DLRM (``towerrec.build.models``)
and applies the space to it: ``mlp`` replaces the searched MLPs by
``SearchableMLP``s, ``emb_dim`` and ``emb_card`` replace the embedding collection by
a search collection. The result's ``decisions`` are the architecture choices; a
*choice* is one candidate index per decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from towerrec.build.models import build_model, build_tables
from towerrec.config import Config
from towerrec.config.nas import SearchSpaceKind
from towerrec.data.batch import DataSchema
from towerrec.models.dlrm import DLRM
from towerrec.models.names import ModelName
from towerrec.modules.compact import EmbeddingKind, TableStorageConfig
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.mlp import MLP
from towerrec.workflows.nas.choice import Decision
from towerrec.workflows.nas.embedding import (
    CardinalitySearchCollection,
    DimSearchCollection,
    FreezableCollection,
    SearchCollection,
)
from towerrec.workflows.nas.mlp import SearchableMLP

__all__ = ["Supernet", "build_supernet"]


@dataclass
class Supernet:
    """A DLRM with searchable parts: ``model``, its ``decisions`` and what each costs
    (MLP FLOPs per sample, or embedding parameters)."""

    kind: SearchSpaceKind
    model: DLRM
    decisions: list[Decision]
    config: Config

    # ------------------------------------------------------------------ cost
    def expected_cost(self, probs: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The cost expected under ``probs`` (default: softmax of the logits), differentiable."""
        if probs is None:
            probs = [d.probs() for d in self.decisions]
        if self.kind is SearchSpaceKind.MLP:
            total, at = torch.tensor(0.0), 0
            for mlp in self._mlps():
                if isinstance(mlp, SearchableMLP):
                    total = total + mlp.expected_flops(probs[at : at + len(mlp.decisions)])
                    at += len(mlp.decisions)
                elif isinstance(mlp, MLP):
                    total = total + float(mlp.flops_per_sample())
            return total
        sparse = self._search_collection()
        costs = [torch.tensor(sparse.costs(i)) for i in range(len(self.decisions))]
        return sum((p.cpu() * c).sum() for p, c in zip(probs, costs))  # type: ignore[return-value]

    def cost_of(self, choice: Sequence[int]) -> float:
        one_hot = [
            torch.nn.functional.one_hot(torch.tensor(k), len(d)).float()
            for d, k in zip(self.decisions, choice)
        ]
        return float(self.expected_cost(one_hot))

    def largest_cost(self) -> float:
        """The most expensive architecture's cost (the cost term's unit)."""
        if self.kind is SearchSpaceKind.MLP:  # the widest of each layer (listed first), no skip
            return self.cost_of([0] * len(self.decisions))
        sparse = self._search_collection()
        return self.cost_of(
            [
                max(range(len(d)), key=sparse.costs(i).__getitem__)
                for i, d in enumerate(self.decisions)
            ]
        )

    # ---------------------------------------------------------------- choices
    def fix(self, choice: Sequence[int] | None) -> None:
        """Use ``choice`` for every example (None: sample per example again)."""
        for i, d in enumerate(self.decisions):
            d.fix(None if choice is None else choice[i])

    def best(self) -> list[int]:
        return [d.best() for d in self.decisions]

    def named(self, choice: Sequence[int]) -> dict[str, int | float]:
        return {d.name: d.candidates[k] for d, k in zip(self.decisions, choice)}

    def config_for(self, choice: Sequence[int]) -> Config:
        """The run config of the standalone model of ``choice``."""
        config = self.config
        if self.kind is SearchSpaceKind.MLP:
            model = config.model
            bottom, top = self._mlps()
            if isinstance(bottom, SearchableMLP):
                model = replace(
                    model, bottom_mlp=tuple(bottom.choice_widths(choice[: len(bottom.decisions)]))
                )
            if isinstance(top, SearchableMLP):
                model = replace(
                    model,
                    top_mlp=tuple(top.choice_widths(choice[len(choice) - len(top.decisions) :])),
                )
            return replace(config, model=model)
        tables = dict(config.embedding.tables)
        for t, d, k in zip(self._search_collection().tables, self.decisions, choice):
            value = d.candidates[k]
            base = tables.get(t.name, TableStorageConfig())
            if self.kind is SearchSpaceKind.EMB_DIM and value < t.embedding_dim:
                tables[t.name] = replace(base, dim=int(value))
            elif self.kind is SearchSpaceKind.EMB_CARD and value > 1:
                tables[t.name] = replace(base, kind=EmbeddingKind.HASH, compression=float(value))
        return replace(config, embedding=replace(config.embedding, tables=tables))

    def standalone_state(
        self, choice: Sequence[int], standalone: nn.Module
    ) -> dict[str, torch.Tensor]:
        """The supernet's weights that the standalone model of ``choice`` (built from
        ``config_for(choice)``) uses, named as its ``state_dict`` names them."""
        state = {
            k: v.detach().clone()
            for k, v in self.model.state_dict().items()
            if not k.startswith("sparse.")
        }
        if self.kind is SearchSpaceKind.MLP:
            state.update(
                {
                    k.replace("sparse.inner.", "sparse."): v.detach().clone()
                    for k, v in self.model.state_dict().items()
                    if k.startswith("sparse.")
                }
            )
            at = 0
            for name, mlp in zip(("bottom", "top"), self._mlps()):
                if isinstance(mlp, SearchableMLP):
                    state = {k: v for k, v in state.items() if not k.startswith(f"{name}.")}
                    sub = mlp.standalone_state(
                        choice[at : at + len(mlp.decisions)], getattr(standalone, name)
                    )
                    state.update({f"{name}.{k}": v for k, v in sub.items()})
                    at += len(mlp.decisions)
            return state
        sparse_state = self._search_collection().standalone_state(choice)
        wanted = standalone.state_dict()
        for key, value in sparse_state.items():
            full = f"sparse.{key}"
            state[full if full in wanted else full.replace("sparse.inner.", "sparse.")] = value
        return state

    # ---------------------------------------------------------------- parts
    def _mlps(self) -> tuple[nn.Module, nn.Module]:
        return self.model.bottom, self.model.top  # type: ignore[return-value]

    def _search_collection(self) -> DimSearchCollection | CardinalitySearchCollection:
        sparse = self.model.sparse
        assert isinstance(sparse, DimSearchCollection | CardinalitySearchCollection)
        return sparse

    def set_frozen_embeddings(self, frozen: bool) -> None:
        """Look up embeddings without autograd (the architecture step): see ``embedding.py``."""
        sparse = self.model.sparse
        assert isinstance(sparse, SearchCollection)  # build_supernet puts one there
        sparse.frozen = frozen


def _check_tables(named: Mapping[str, object], tables: list[str], key: str) -> None:
    unknown = sorted(set(named) - set(tables))
    if unknown:
        raise ValueError(
            f"{key} names {unknown}, which are not tables of this data; its tables: "
            f"{', '.join(tables)}"
        )


def build_supernet(config: Config, schema: DataSchema, device: torch.device) -> Supernet:
    """The supernet of ``config.nas.space`` over the run's DLRM (module docstring)."""
    nas, model_config = config.nas, config.model
    if model_config.name != ModelName.DLRM:
        raise ValueError(
            f"towerrec nas searches the DLRM backbone, but model.name = {model_config.name!r}; "
            "set model.name = 'dlrm'"
        )
    if model_config.dropout or model_config.batch_norm:
        raise ValueError(
            "the MLP supernet has no dropout or batch norm; set model.dropout = 0 and "
            "model.batch_norm = false for the search"
        )
    if not config.embedding.compact().is_full and nas.space is not SearchSpaceKind.MLP:
        raise ValueError(
            f"the {nas.space.value} search replaces the embedding tables, so it starts from "
            "full ones; remove embedding.kind and embedding.tables settings"
        )
    model = build_model(config, schema, device)
    assert isinstance(model, DLRM)  # model.name = "dlrm", checked above
    tables = build_tables(config, schema)
    names = [t.name for t in tables]
    emb = config.embedding
    decisions: list[Decision] = []
    if nas.space is SearchSpaceKind.MLP:
        inner = model.sparse
        assert isinstance(inner, EmbeddingBagCollection)  # full tables: checked above
        model.register_module("sparse", FreezableCollection(inner))
        for name, space, out, final in (
            ("bottom", nas.mlp.bottom, model_config.embedding_dim, True),
            ("top", nas.mlp.top, 1, False),
        ):
            current = getattr(model, name)
            if not space:
                continue
            if current is None:
                raise ValueError(
                    "nas.mlp.bottom searches the bottom MLP, but the data has no dense "
                    "features and the model no bottom MLP; set nas.mlp.bottom = []"
                )
            mlp = SearchableMLP(
                current.in_features, space, out, final_activation=final, name=f"mlp.{name}"
            ).to(device)
            model.register_module(name, mlp)  # the supernet in the MLP's place
            decisions += mlp.decisions
    elif nas.space is SearchSpaceKind.EMB_DIM:
        _check_tables(nas.emb_dim.tables, names, "nas.emb_dim.tables")
        sparse = DimSearchCollection(
            tables,
            {n: nas.emb_dim.for_table(n) for n in names},
            emb.optimizer_config(),
            backend=emb.backend,
            device=device,
            id_policy=emb.id_policy,
            seed=config.train.seed,
        )
        model.register_module("sparse", sparse)
        decisions = sparse.decisions
    else:
        _check_tables(nas.emb_card.tables, names, "nas.emb_card.tables")
        card = CardinalitySearchCollection(
            tables,
            {n: nas.emb_card.for_table(n) for n in names},
            emb.optimizer_config(),
            backend=emb.backend,
            device=device,
            id_policy=emb.id_policy,
            seed=config.train.seed,
        )
        model.register_module("sparse", card)
        decisions = card.decisions
    return Supernet(nas.space, model, decisions, config)
