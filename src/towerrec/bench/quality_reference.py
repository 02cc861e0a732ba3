"""Plain-PyTorch DLRM, DCNv2 and Wukong with their own training loop: the reference side
of ``towerrec bench quality``.

This module imports nothing from towerrec (``tests/test_bench_quality.py`` checks it).
Its inputs are plain tensors (``PlainData``); the benchmark materialises them from
towerrec's data loader so that both sides see the same rows of the same split.
Everything else is written here: ``nn.EmbeddingBag`` tables (sparse gradients, sum
pooling), MLPs, the three interactions, ``torch.optim.Adam`` for the dense weights,
``torch.optim.Adagrad`` for the embedding rows, the shuffled mini-batch loop and the
early-stopping rule; metrics come from scikit-learn.

Data layout, one ``Bag`` per categorical feature (N samples)::

    values   [nnz]   ids of every sample's bag, sample after sample
    offsets  [N+1]   sample i's ids are values[offsets[i]:offsets[i+1]]

Early stopping: evaluate on the validation rows after every epoch; keep the epoch
of lowest validation log-loss; stop after ``patience`` epochs without a lower one;
report that epoch's metrics.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Architecture",
    "Bag",
    "PlainData",
    "ReferenceSettings",
    "build_reference_model",
    "train_reference",
]


@dataclass(frozen=True)
class Bag:
    """One categorical feature of N samples: ``values [nnz]``, ``offsets [N+1]``."""

    values: torch.Tensor
    offsets: torch.Tensor
    num_embeddings: int


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
    """Layer widths, the same numbers as towerrec's model config (no towerrec types)."""

    model: str  # dlrm | dcn | wukong
    embedding_dim: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    dcn_layers: int = 3
    dcn_rank: int = 0  # 0: full-rank cross weights
    wukong_layers: int = 2
    wukong_fm: int = 8
    wukong_lcb: int = 8
    wukong_rank: int = 8
    wukong_fm_mlp: tuple[int, ...] = (64,)


@dataclass(frozen=True)
class ReferenceSettings:
    """The reference's training recipe: fixed textbook choices, not tuned per data set.

    Embedding rows start uniform in +-sqrt(1/rows) (facebookresearch/dlrm's init);
    dense layers keep PyTorch's default init; constant learning rates.
    """

    dense_lr: float = 1e-3  # torch.optim.Adam
    embedding_lr: float = 0.05  # torch.optim.Adagrad on the sparse embedding gradients
    eval_batch_size: int = 16384

    def as_dict(self) -> dict:
        return asdict(self)


def _mlp(in_features: int, widths: tuple[int, ...], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, width in enumerate(widths):
        layers.append(nn.Linear(in_features, width))
        if last_relu or i < len(widths) - 1:
            layers.append(nn.ReLU())
        in_features = width
    return nn.Sequential(*layers)


class _Tables(nn.Module):
    """One sum-pooled ``nn.EmbeddingBag`` per feature -> ``[B, T, D]``."""

    def __init__(self, sizes: list[int], dim: int) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in sizes)
        for n, table in zip(sizes, self.bags):
            assert isinstance(table, nn.EmbeddingBag)
            nn.init.uniform_(table.weight, -math.sqrt(1 / n), math.sqrt(1 / n))

    def forward(self, bags: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        pooled = [table(v, o[:-1]) for table, (v, o) in zip(self.bags, bags)]
        return torch.stack(pooled, dim=1)


class PlainDLRM(nn.Module):
    """bottom MLP -> x [B, D]; pairwise dots of [x, E] (upper triangle); top MLP on [x, dots]."""

    def __init__(self, arch: Architecture, num_dense: int, sizes: list[int]) -> None:
        super().__init__()
        self.tables = _Tables(sizes, arch.embedding_dim)
        self.bottom = _mlp(num_dense, arch.bottom_mlp, last_relu=True)
        n = len(sizes) + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.pairs: torch.Tensor
        self.register_buffer("pairs", rows * n + cols)
        self.top = _mlp(arch.embedding_dim + len(rows), arch.top_mlp, last_relu=False)

    def forward(self, dense: torch.Tensor, bags: list) -> torch.Tensor:
        x = self.bottom(dense)
        stacked = torch.cat([x.unsqueeze(1), self.tables(bags)], dim=1)  # [B, T+1, D]
        gram = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)  # [B, (T+1)^2]
        return self.top(torch.cat([x, gram[:, self.pairs]], dim=1)).squeeze(1)


class PlainDCN(nn.Module):
    """x0 = [bottom(dense), E] [B, N]; x_{l+1} = x0 * (W_l x_l + b_l) + x_l; deep MLP."""

    def __init__(self, arch: Architecture, num_dense: int, sizes: list[int]) -> None:
        super().__init__()
        self.tables = _Tables(sizes, arch.embedding_dim)
        self.bottom = _mlp(num_dense, arch.bottom_mlp, last_relu=True)
        width = arch.embedding_dim * (len(sizes) + 1)
        if arch.dcn_rank:
            self.cross = nn.ModuleList(
                nn.Sequential(
                    nn.Linear(width, arch.dcn_rank, bias=False), nn.Linear(arch.dcn_rank, width)
                )
                for _ in range(arch.dcn_layers)
            )
        else:
            self.cross = nn.ModuleList(nn.Linear(width, width) for _ in range(arch.dcn_layers))
        self.deep = _mlp(width, arch.top_mlp, last_relu=False)

    def forward(self, dense: torch.Tensor, bags: list) -> torch.Tensor:
        x0 = torch.cat([self.bottom(dense), self.tables(bags).flatten(1)], dim=1)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.deep(x).squeeze(1)


class _WukongLayer(nn.Module):
    """[B, n, D] -> [B, n_F + n_L, D]: FM block (X (X^T Y) -> LayerNorm -> MLP) next to a
    linear compression (W X), plus a (projected) residual, then LayerNorm over D."""

    def __init__(self, n: int, dim: int, arch: Architecture) -> None:
        super().__init__()
        self.dim, self.num_fm = dim, arch.wukong_fm
        out = arch.wukong_fm + arch.wukong_lcb
        self.y = nn.Parameter(torch.randn(n, arch.wukong_rank) / math.sqrt(n))
        self.fm_norm = nn.LayerNorm(n * arch.wukong_rank)
        self.fm_mlp = _mlp(n * arch.wukong_rank, (*arch.wukong_fm_mlp, arch.wukong_fm * dim), False)
        self.lcb = nn.Parameter(torch.randn(arch.wukong_lcb, n) / math.sqrt(n))
        self.project = nn.Parameter(torch.randn(out, n) / math.sqrt(n)) if out != n else None
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        fm = torch.bmm(x, torch.matmul(x.transpose(1, 2), self.y))  # [B, n, k]
        fm = self.fm_mlp(self.fm_norm(fm.flatten(1))).view(batch, self.num_fm, self.dim)
        lcb = torch.matmul(self.lcb, x)  # [B, n_L, D]
        skip = x if self.project is None else torch.matmul(self.project, x)
        return self.norm(torch.cat([fm, lcb], dim=1) + skip)


class PlainWukong(nn.Module):
    """X0 = [bottom(dense) as one row, E] [B, T+1, D] -> Wukong layers -> flatten -> top MLP."""

    def __init__(self, arch: Architecture, num_dense: int, sizes: list[int]) -> None:
        super().__init__()
        if arch.wukong_fm < 1 or arch.wukong_lcb < 1:
            raise ValueError("the reference Wukong needs wukong_fm >= 1 and wukong_lcb >= 1")
        self.tables = _Tables(sizes, arch.embedding_dim)
        self.bottom = _mlp(num_dense, arch.bottom_mlp, last_relu=True)
        layers, n = [], len(sizes) + 1
        for _ in range(arch.wukong_layers):
            layers.append(_WukongLayer(n, arch.embedding_dim, arch))
            n = arch.wukong_fm + arch.wukong_lcb
        self.layers = nn.Sequential(*layers)
        self.top = _mlp(n * arch.embedding_dim, arch.top_mlp, last_relu=False)

    def forward(self, dense: torch.Tensor, bags: list) -> torch.Tensor:
        x = torch.cat([self.bottom(dense).unsqueeze(1), self.tables(bags)], dim=1)
        return self.top(self.layers(x).flatten(1)).squeeze(1)


_MODELS: dict[str, type[nn.Module]] = {"dlrm": PlainDLRM, "dcn": PlainDCN, "wukong": PlainWukong}


def build_reference_model(arch: Architecture, num_dense: int, sizes: list[int]) -> nn.Module:
    if arch.model not in _MODELS:
        raise ValueError(f"reference model {arch.model!r} is not one of {', '.join(_MODELS)}")
    return _MODELS[arch.model](arch, num_dense, sizes)


@torch.no_grad()
def _evaluate(model: nn.Module, data: PlainData, batch_size: int) -> dict[str, float]:
    try:
        from sklearn.metrics import log_loss, roc_auc_score
    except ImportError:
        raise ImportError(
            "the reference side of `towerrec bench quality` is scored with scikit-learn: "
            "pip install 'towerrec[quality]' (or scikit-learn)"
        ) from None
    model.eval()
    probs = []
    for start in range(0, data.rows, batch_size):
        dense, bags, _ = data.take(torch.arange(start, min(start + batch_size, data.rows)))
        probs.append(torch.sigmoid(model(dense, bags)))
    model.train()
    p = torch.cat(probs).double().numpy()
    y = data.labels.numpy()
    return {
        "auc": float(roc_auc_score(y, p)),
        "logloss": float(log_loss(y, np.clip(p, 1e-7, 1 - 1e-7), labels=[0, 1])),
    }


@dataclass
class ReferenceResult:
    best_epoch: int
    auc: float
    logloss: float
    num_dense_params: int
    epochs: list[dict] = field(default_factory=list)  # per epoch: epoch, auc, logloss


def train_reference(
    arch: Architecture,
    train: PlainData,
    valid: PlainData,
    *,
    epochs: int,
    batch_size: int,
    patience: int,
    seed: int,
    settings: ReferenceSettings | None = None,
) -> ReferenceResult:
    """Train from seed ``seed`` (init and shuffling) with early stopping (module docstring)."""
    settings = settings or ReferenceSettings()
    torch.manual_seed(seed)
    sizes = [bag.num_embeddings for bag in train.bags]
    model = build_reference_model(arch, train.dense.shape[1], sizes)
    tables = [p for n, p in model.named_parameters() if n.startswith("tables.")]
    dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    dense_opt = torch.optim.Adam(dense, lr=settings.dense_lr)
    sparse_opt = torch.optim.Adagrad(tables, lr=settings.embedding_lr)
    order = torch.Generator().manual_seed(seed)
    history: list[dict] = []
    best = -1
    # torch's sparse Adagrad warns on every step that it skips its sparse-tensor checks.
    warnings.filterwarnings("ignore", message="Sparse invariant checks", category=UserWarning)
    for epoch in range(1, epochs + 1):
        permutation = torch.randperm(train.rows, generator=order)
        for start in range(0, train.rows, batch_size):
            x, bags, y = train.take(permutation[start : start + batch_size])
            loss = F.binary_cross_entropy_with_logits(model(x, bags), y)
            dense_opt.zero_grad(set_to_none=True)
            sparse_opt.zero_grad(set_to_none=True)
            loss.backward()
            dense_opt.step()
            sparse_opt.step()
        history.append({"epoch": epoch, **_evaluate(model, valid, settings.eval_batch_size)})
        if best < 0 or history[-1]["logloss"] < history[best]["logloss"]:
            best = len(history) - 1
        elif len(history) - 1 - best >= patience:
            break
    chosen = history[best]
    num_dense = sum(p.numel() for p in dense)
    return ReferenceResult(chosen["epoch"], chosen["auc"], chosen["logloss"], num_dense, history)
