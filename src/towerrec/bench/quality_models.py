"""Plain-PyTorch DLRM, DCNv2, Wukong and a DNN: the models of ``towerrec bench quality``'s
references (``quality_reference.py`` trains them).

This module imports nothing from towerrec (``tests/test_bench_quality.py`` checks it):
``nn.EmbeddingBag`` tables (sum pooling), ``nn.Linear`` MLPs and the three interactions,
written from the papers with the widths of a towerrec model config (``Architecture``).

Data layout, one ``Bag`` per categorical feature (N samples)::

    values   [nnz]   ids of every sample's bag, sample after sample
    offsets  [N+1]   sample i's ids are values[offsets[i]:offsets[i+1]]

Embedding rows start as the recipe says (``TableInit``): uniform in +-sqrt(1/rows)
(facebookresearch/dlrm, TorchRec) or normal with a given std (FuxiCTR: 1e-4); the
dense layers keep PyTorch's default init.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "Architecture",
    "Bag",
    "PlainData",
    "ReferenceModel",
    "TableInit",
    "build_reference_model",
]


@dataclass(frozen=True)
class Bag:
    """One categorical feature of N samples: ``values [nnz]``, ``offsets [N+1]``."""

    values: torch.Tensor
    offsets: torch.Tensor
    num_embeddings: int
    name: str = ""  # the feature's


@dataclass(frozen=True)
class PlainData:
    """N samples: ``dense [N, F]`` float32, ``labels [N]`` float32, one ``Bag`` per feature."""

    dense: torch.Tensor
    labels: torch.Tensor
    bags: tuple[Bag, ...]

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])

    def take(
        self, rows: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """``dense [B, F]``, per feature ``(values, offsets [B+1])``, ``labels [B]`` of ``rows``."""
        bags = []
        for bag in self.bags:
            starts, ends = bag.offsets[rows], bag.offsets[rows + 1]
            lengths = ends - starts
            offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
            # index of every id: its bag's start plus its position inside the bag
            within = torch.arange(int(offsets[-1])) - torch.repeat_interleave(offsets[:-1], lengths)
            bags.append((bag.values[torch.repeat_interleave(starts, lengths) + within], offsets))
        return self.dense[rows], bags, self.labels[rows]


@dataclass(frozen=True)
class Architecture:
    """Layer widths and options, the same numbers as towerrec's model config (no towerrec
    types)."""

    model: str  # dlrm | dcn | wukong | dnn
    embedding_dim: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    self_interaction: bool = False  # dlrm
    concat_embeddings: bool = False  # dlrm: the top MLP reads the pooled embeddings too
    dropout: float = 0.0  # after each hidden ReLU
    batch_norm: bool = False  # BatchNorm1d before each hidden ReLU
    dcn_layers: int = 3
    dcn_rank: int = 0  # 0: full-rank cross weights
    wukong_layers: int = 2
    wukong_fm: int = 8
    wukong_lcb: int = 8
    wukong_rank: int = 8
    wukong_fm_mlp: tuple[int, ...] = (64,)


@dataclass(frozen=True)
class TableInit:
    """How embedding rows start: ``uniform_rows`` (+-sqrt(1/rows)) or ``normal`` (std)."""

    kind: str = "uniform_rows"
    std: float = 1e-4

    def __post_init__(self) -> None:
        if self.kind not in ("uniform_rows", "normal"):
            raise ValueError(f"table init {self.kind!r} is not uniform_rows or normal")

    def apply(self, weight: torch.Tensor) -> None:
        rows = weight.shape[0]
        if self.kind == "normal":
            nn.init.normal_(weight, 0.0, self.std)
        else:
            nn.init.uniform_(weight, -math.sqrt(1 / rows), math.sqrt(1 / rows))


def _mlp(in_features: int, widths: tuple[int, ...], arch: Architecture, last_relu: bool):
    """Linear layers; each hidden one (and the last with ``last_relu``) followed by
    [BatchNorm1d], ReLU, [Dropout], as towerrec's MLP."""
    layers: list[nn.Module] = []
    for i, width in enumerate(widths):
        layers.append(nn.Linear(in_features, width))
        if last_relu or i < len(widths) - 1:
            if arch.batch_norm:
                layers.append(nn.BatchNorm1d(width))
            layers.append(nn.ReLU())
            if arch.dropout:
                layers.append(nn.Dropout(arch.dropout))
        in_features = width
    return nn.Sequential(*layers)


class Tables(nn.Module):
    """One sum-pooled ``nn.EmbeddingBag`` per feature -> ``[B, T, D]``; ``sparse``: sparse
    gradients (for a row-wise optimizer), else dense ones (Adam on everything)."""

    def __init__(self, sizes: list[int], dim: int, init: TableInit, sparse: bool) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=sparse) for n in sizes)
        for table in self.bags:
            assert isinstance(table, nn.EmbeddingBag)
            init.apply(table.weight.data)

    def forward(self, bags: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        pooled = [table(v, o[:-1]) for table, (v, o) in zip(self.bags, bags)]
        return torch.stack(pooled, dim=1)

    def squared_rows(self, bags: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Sum of the squares of every looked-up row (each id of the batch once per
        occurrence): what an L2 on the looked-up rows penalises."""
        total = torch.zeros(())
        for table, (values, _) in zip(self.bags, bags):
            assert isinstance(table, nn.EmbeddingBag)
            total = total + table.weight[values].pow(2).sum()
        return total


class ReferenceModel(nn.Module):
    """The parts every reference model has: tables and, with dense features, a bottom MLP;
    ``forward(dense [B, F], bags) -> logits [B]``."""

    def __init__(
        self, arch: Architecture, num_dense: int, sizes: list[int], init: TableInit, sparse: bool
    ) -> None:
        super().__init__()
        self.tables = Tables(sizes, arch.embedding_dim, init, sparse)
        self.bottom = (
            _mlp(num_dense, arch.bottom_mlp, arch, last_relu=True)
            if num_dense and arch.bottom_mlp
            else None
        )
        # dense features without a bottom MLP: read as they are (DCN, DNN)
        self.raw_dense = num_dense if num_dense and not arch.bottom_mlp else 0
        if self.raw_dense and arch.model in ("dlrm", "wukong"):
            raise ValueError(
                f"reference {arch.model}: {num_dense} dense features need a bottom MLP "
                "(its interaction takes one vector of the embedding dim)"
            )

    def first_order(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """[bottom(dense) or the raw dense features, embeddings [B, T*D]] [B, N]."""
        if self.bottom is not None:
            return torch.cat([self.bottom(dense), embeddings], 1)
        return torch.cat([dense, embeddings], 1) if self.raw_dense else embeddings


class PlainDLRM(ReferenceModel):
    """bottom MLP -> x [B, D]; pairwise dots of [x, E] (upper triangle); top MLP on
    [x, (E with concat_embeddings), dots]; no dense features: no x."""

    def __init__(self, arch: Architecture, num_dense: int, sizes: list[int], init, sparse) -> None:
        super().__init__(arch, num_dense, sizes, init, sparse)
        n = len(sizes) + int(self.bottom is not None)
        rows, cols = torch.triu_indices(n, n, offset=0 if arch.self_interaction else 1)
        self.pairs: torch.Tensor
        self.register_buffer("pairs", rows * n + cols)
        self.concat = arch.concat_embeddings
        top_in = len(rows) + (arch.embedding_dim if self.bottom is not None else 0)
        top_in += len(sizes) * arch.embedding_dim if self.concat else 0
        self.top = _mlp(top_in, arch.top_mlp, arch, last_relu=False)

    def forward(self, dense: torch.Tensor, bags: list) -> torch.Tensor:
        embeddings = self.tables(bags)  # [B, T, D]
        x = self.bottom(dense) if self.bottom is not None else None
        stacked = embeddings if x is None else torch.cat([x.unsqueeze(1), embeddings], dim=1)
        gram = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)  # [B, n^2]
        parts = [] if x is None else [x]
        if self.concat:
            parts.append(embeddings.flatten(1))
        parts.append(gram[:, self.pairs])
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


class PlainDCN(ReferenceModel):
    """x0 = [bottom(dense), E] [B, N]; x_{l+1} = x0 * (W_l x_l + b_l) + x_l; deep MLP."""

    def __init__(self, arch: Architecture, num_dense: int, sizes: list[int], init, sparse) -> None:
        super().__init__(arch, num_dense, sizes, init, sparse)
        width = arch.embedding_dim * (len(sizes) + int(self.bottom is not None)) + self.raw_dense
        if arch.dcn_rank:
            self.cross = nn.ModuleList(
                nn.Sequential(
                    nn.Linear(width, arch.dcn_rank, bias=False), nn.Linear(arch.dcn_rank, width)
                )
                for _ in range(arch.dcn_layers)
            )
        else:
            self.cross = nn.ModuleList(nn.Linear(width, width) for _ in range(arch.dcn_layers))
        self.deep = _mlp(width, arch.top_mlp, arch, last_relu=False)

    def forward(self, dense: torch.Tensor, bags: list) -> torch.Tensor:
        x0 = self.first_order(dense, self.tables(bags).flatten(1))
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.deep(x).squeeze(1)


class _WukongLayer(nn.Module):
    """[B, n, D] -> [B, n_F + n_L, D]: FM block (X (X^T Y) -> LayerNorm -> MLP) next to a
    linear compression (W X), plus a (projected) residual, then LayerNorm over D."""

    def __init__(self, n: int, arch: Architecture) -> None:
        super().__init__()
        dim, self.num_fm, self.num_lcb = arch.embedding_dim, arch.wukong_fm, arch.wukong_lcb
        self.dim, out = dim, arch.wukong_fm + arch.wukong_lcb
        if self.num_fm:
            self.y = nn.Parameter(torch.randn(n, arch.wukong_rank) / math.sqrt(n))
            self.fm_norm = nn.LayerNorm(n * arch.wukong_rank)
            widths = (*arch.wukong_fm_mlp, self.num_fm * dim)
            self.fm_mlp = _mlp(n * arch.wukong_rank, widths, arch, last_relu=False)
        if self.num_lcb:
            self.lcb = nn.Parameter(torch.randn(self.num_lcb, n) / math.sqrt(n))
        self.project = nn.Parameter(torch.randn(out, n) / math.sqrt(n)) if out != n else None
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, parts = x.shape[0], []
        if self.num_fm:
            fm = torch.bmm(x, torch.matmul(x.transpose(1, 2), self.y))  # [B, n, k]
            parts.append(self.fm_mlp(self.fm_norm(fm.flatten(1))).view(batch, self.num_fm, -1))
        if self.num_lcb:
            parts.append(torch.matmul(self.lcb, x))  # [B, n_L, D]
        skip = x if self.project is None else torch.matmul(self.project, x)
        return self.norm(torch.cat(parts, dim=1) + skip)


class PlainWukong(ReferenceModel):
    """X0 = [bottom(dense) as one row, E] [B, n, D] -> Wukong layers -> flatten -> top MLP."""

    def __init__(self, arch: Architecture, num_dense: int, sizes: list[int], init, sparse) -> None:
        super().__init__(arch, num_dense, sizes, init, sparse)
        layers, n = [], len(sizes) + int(self.bottom is not None)
        for _ in range(arch.wukong_layers):
            layers.append(_WukongLayer(n, arch))
            n = arch.wukong_fm + arch.wukong_lcb
        self.layers = nn.Sequential(*layers)
        self.top = _mlp(n * arch.embedding_dim, arch.top_mlp, arch, last_relu=False)

    def forward(self, dense: torch.Tensor, bags: list) -> torch.Tensor:
        x = self.tables(bags)
        if self.bottom is not None:
            x = torch.cat([self.bottom(dense).unsqueeze(1), x], dim=1)
        return self.top(self.layers(x).flatten(1)).squeeze(1)


class PlainDNN(ReferenceModel):
    """The first model a practitioner writes (FuxiCTR's DNN): the dense features, through
    the bottom MLP where there is one, and every feature's embedding concatenated into
    the top MLP; no explicit interaction."""

    def __init__(self, arch: Architecture, num_dense: int, sizes: list[int], init, sparse) -> None:
        super().__init__(arch, num_dense, sizes, init, sparse)
        width = len(sizes) * arch.embedding_dim + self.raw_dense
        width += arch.bottom_mlp[-1] if self.bottom is not None else 0
        self.top = _mlp(width, arch.top_mlp, arch, last_relu=False)

    def forward(self, dense: torch.Tensor, bags: list) -> torch.Tensor:
        return self.top(self.first_order(dense, self.tables(bags).flatten(1))).squeeze(1)


_MODELS: dict[str, type[ReferenceModel]] = {
    "dlrm": PlainDLRM,
    "dnn": PlainDNN,
    "dcn": PlainDCN,
    "wukong": PlainWukong,
}


def build_reference_model(
    arch: Architecture,
    num_dense: int,
    sizes: list[int],
    init: TableInit | None = None,
    sparse: bool = True,
) -> ReferenceModel:
    """The plain model of ``arch`` over tables of ``sizes`` rows (``num_dense`` dense inputs)."""
    if arch.model not in _MODELS:
        raise ValueError(f"reference model {arch.model!r} is not one of {', '.join(_MODELS)}")
    return _MODELS[arch.model](arch, num_dense, sizes, init or TableInit(), sparse)
