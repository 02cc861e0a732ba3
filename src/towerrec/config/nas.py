"""Settings of ``towerrec nas search``: the ``[nas]`` section of a run config.

::

    [nas]
    space = "emb_dim"          # mlp | emb_dim | emb_card
    cost_weight = 1.0          # lambda of  loss + lambda * E[cost] / cost of the largest choice
    [nas.emb_dim]
    candidates = [4, 8, 16]
    tables = { user = [8, 16] }        # per-table candidates (a table of the data)
    [nas.mlp]
    bottom = [[64, 32], [32, 16, 0]]    # candidate widths per hidden layer, 0 = skip it
    top = [[256, 128], [128, 64, 0]]

The run config (``config/sections.py``) holds a ``NASConfig``; the search that reads it is
``towerrec.workflows.nas``. A leaf: it imports nothing of towerrec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["EmbCardSpace", "EmbDimSpace", "MLPSpace", "NASConfig", "SearchSpaceKind"]


class SearchSpaceKind(StrEnum):
    MLP = "mlp"  # MLP widths and depth (skip edges)
    EMB_DIM = "emb_dim"  # per-table embedding dims: truncations of one full-width table
    EMB_CARD = "emb_card"  # per-table rows: separate hashed tables of candidate sizes


def _check_candidates(values: tuple[int | float, ...], key: str, low: float) -> None:
    if not values:
        raise ValueError(f"{key} is an empty candidate list; give at least one choice")
    if len(set(values)) != len(values):
        raise ValueError(f"{key} = {list(values)} repeats a candidate; list each once")
    bad = [v for v in values if v < low]
    if bad:
        raise ValueError(f"{key} = {list(values)} has candidates below {low}: {bad}")


@dataclass(frozen=True)
class MLPSpace:
    """Candidate widths per hidden layer of the bottom and top MLP (an empty list: that
    MLP is kept as the model config says); a 0 among a layer's candidates lets the search
    skip the layer (depth). The last layer of each MLP (the embedding dim, the logit) is
    fixed."""

    bottom: tuple[tuple[int, ...], ...] = ()
    top: tuple[tuple[int, ...], ...] = ((512, 256, 128, 64), (256, 128, 64, 32, 0))

    def __post_init__(self) -> None:
        for name, layers in (("bottom", self.bottom), ("top", self.top)):
            for i, widths in enumerate(layers):
                _check_candidates(widths, f"nas.mlp.{name}[{i}]", 0)
        if not self.bottom and not self.top:
            raise ValueError(
                "nas.mlp.bottom and nas.mlp.top are both empty: nothing to search; give "
                "candidate widths per hidden layer, e.g. nas.mlp.top = [[256, 128], [64, 0]]"
            )


@dataclass(frozen=True)
class EmbDimSpace:
    """Candidate dims of every table (at most ``model.embedding_dim``), or per table."""

    candidates: tuple[int, ...] = (4, 8, 16)
    tables: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_candidates(self.candidates, "nas.emb_dim.candidates", 1)
        for name, values in self.tables.items():
            _check_candidates(values, f"nas.emb_dim.tables.{name}", 1)

    def for_table(self, name: str) -> tuple[int, ...]:
        return tuple(sorted(self.tables.get(name, self.candidates)))


@dataclass(frozen=True)
class EmbCardSpace:
    """Candidate row compressions of every table (1: the full table; c > 1: a table
    hashed to rows / c), or per table."""

    candidates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    tables: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_candidates(self.candidates, "nas.emb_card.candidates", 1)
        for name, values in self.tables.items():
            _check_candidates(values, f"nas.emb_card.tables.{name}", 1)

    def for_table(self, name: str) -> tuple[float, ...]:
        return tuple(sorted(self.tables.get(name, self.candidates)))


@dataclass(frozen=True)
class NASConfig:
    """The search: alternating weight steps (train split) and architecture steps (the
    validation split), per-example Gumbel-softmax masks whose temperature falls
    geometrically from ``tau_start`` to ``tau_end``, and a cost term."""

    space: SearchSpaceKind = SearchSpaceKind.EMB_DIM
    epochs: float = 2.0  # passes over the training rows (steps: train.steps if set)
    warmup: float = 0.2  # share of the steps with weight updates only
    arch_lr: float = 0.01  # Adam on the architecture logits
    cost_weight: float = 1.0
    tau_start: float = 5.0
    tau_end: float = 0.5
    samples: int = 4  # architectures written: arch-0 the most likely, then sampled ones
    mlp: MLPSpace = field(default_factory=MLPSpace)
    emb_dim: EmbDimSpace = field(default_factory=EmbDimSpace)
    emb_card: EmbCardSpace = field(default_factory=EmbCardSpace)

    def __post_init__(self) -> None:
        object.__setattr__(self, "space", SearchSpaceKind(self.space))
        if not self.epochs > 0:
            raise ValueError(f"nas.epochs must be > 0, got {self.epochs}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"nas.warmup must lie in [0, 1), got {self.warmup}")
        if not self.arch_lr > 0:
            raise ValueError(f"nas.arch_lr must be > 0, got {self.arch_lr}")
        if self.cost_weight < 0:
            raise ValueError(f"nas.cost_weight must be >= 0, got {self.cost_weight}")
        if not 0 < self.tau_end <= self.tau_start:
            raise ValueError(
                f"need 0 < nas.tau_end <= nas.tau_start, got {self.tau_end}, {self.tau_start}"
            )
        if self.samples < 1:
            raise ValueError(f"nas.samples must be >= 1, got {self.samples}")
