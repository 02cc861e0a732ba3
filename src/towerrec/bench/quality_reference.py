"""The practitioners' training recipes, in plain PyTorch: the reference side of
``towerrec bench quality``.

This module imports nothing from towerrec (``tests/test_bench_quality.py`` checks it).
Its inputs are plain tensors (``PlainData``); the benchmark materialises them from
towerrec's data loader so that both sides see the same rows of the same splits. The
models are ``quality_models.py``'s; the recipes, the mini-batch loop, the early stopping
and the row-wise Adagrad are written here; metrics come from scikit-learn.

Two recipes (``RECIPES``), each as its community writes it::

                     FuxiCTR (BARS benchmark)           TorchRec / facebookresearch/dlrm
    embedding init   normal, std 1e-4                   uniform +-sqrt(1/rows)
    embeddings       Adam 1e-3 with the dense weights   row-wise Adagrad (sparse gradients)
                     (dense gradients: every row's
                     moments move every step)
    dense weights    Adam 1e-3                          Adam 1e-3
    regulariser      L2 1e-6 x sum of squares of the    none
                     rows a batch looks up
    early stopping   validation AUC, patience 2         validation log-loss, patience 2
    plateau          LR x 0.1 at every epoch without    none
                     improvement (not below 1e-6)
    kept weights     the best epoch's                   the best epoch's
    MLP widths       top 400-400-400-1 (the hidden      bottom 512-256-64-dim, top
                     units of BARS's benchmark          512-256-1 (dlrm's Criteo
                     configs); bottom as towerrec's     Kaggle script)

The widths are each recipe's own (``recipe_architecture``), not towerrec's: a reference
with towerrec's widths could only show that towerrec matches its own choices. The
embedding dim, the model's kind and options and the batch size are the config's, so
every side sees the same inputs; ``--reference-widths config`` gives the references
towerrec's widths as well.

Every epoch ends with an evaluation of the validation and test rows; the run stops when
the recipe's own metric has not improved for ``patience`` epochs. ``selections`` reads
both rules off the epochs trained: the epoch of best validation log-loss and the epoch
of best validation AUC, each with its test metrics.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from towerrec.bench.quality_models import (  # plain torch (no towerrec inside)
    Architecture,
    PlainData,
    ReferenceModel,
    TableInit,
    build_reference_model,
)

__all__ = [
    "RECIPES",
    "Recipe",
    "ReferenceResult",
    "RowwiseAdagrad",
    "recipe_architecture",
    "selections",
    "train_reference",
]

SELECTION_RULES = ("logloss", "auc")  # the epoch of best validation log-loss / AUC


# adam: one Adam over every weight, the tables' dense gradients included (every row's
# moments move every step); sparse_adam: Adam on the looked-up rows only (as FBGEMM's and
# towerrec's row kernels); the others on sparse gradients too.
EMBEDDING_OPTIMIZERS = ("adam", "sparse_adam", "rowwise_adagrad", "adagrad", "sgd")


@dataclass(frozen=True)
class Recipe:
    """A training recipe (module doc): init, optimizers, regulariser, stopping."""

    name: str
    init: TableInit
    embedding_optimizer: str  # one of EMBEDDING_OPTIMIZERS
    embedding_lr: float
    dense_lr: float = 1e-3  # torch.optim.Adam
    embedding_l2: float = 0.0  # x sum of squares of the looked-up rows, added to the loss
    monitor: str = "logloss"  # early stopping's validation metric: auc | logloss
    patience: int = 2  # epochs without improvement before stopping
    plateau_factor: float | None = None  # LR x this at each epoch without improvement
    min_lr: float = 1e-6
    eval_batch_size: int = 16384
    # The recipe's own MLP widths (None: the config's): the top (DCN: deep) MLP, ending in
    # one logit, and the bottom MLP's hidden widths (it then ends at the embedding dim).
    top_mlp: tuple[int, ...] | None = None
    bottom_hidden: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.top_mlp is not None and (not self.top_mlp or self.top_mlp[-1] != 1):
            raise ValueError(f"recipe {self.name}: top_mlp must end in 1, got {self.top_mlp}")
        if self.embedding_optimizer not in EMBEDDING_OPTIMIZERS:
            raise ValueError(
                f"recipe {self.name}: embedding optimizer {self.embedding_optimizer!r} is not "
                f"one of {', '.join(EMBEDDING_OPTIMIZERS)}"
            )
        if self.embedding_optimizer == "sparse_adam" and self.embedding_l2:
            raise ValueError(
                f"recipe {self.name}: sparse_adam takes sparse gradients only; set embedding_l2 "
                "to 0"
            )
        if self.monitor not in SELECTION_RULES:
            raise ValueError(f"recipe {self.name}: monitor {self.monitor!r} is not auc or logloss")
        if self.patience < 1:
            raise ValueError(f"recipe {self.name}: patience must be >= 1")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


RECIPES: dict[str, Recipe] = {
    "fuxictr": Recipe(
        "fuxictr",
        TableInit("normal", 1e-4),
        embedding_optimizer="adam",
        embedding_lr=1e-3,
        embedding_l2=1e-6,
        monitor="auc",
        plateau_factor=0.1,
        top_mlp=(400, 400, 400, 1),
    ),
    "torchrec": Recipe(
        "torchrec",
        TableInit("uniform_rows"),
        embedding_optimizer="rowwise_adagrad",
        embedding_lr=0.05,
        monitor="logloss",
        top_mlp=(512, 256, 1),
        bottom_hidden=(512, 256, 64),
    ),
}


def recipe_architecture(arch: Architecture, recipe: Recipe) -> Architecture:
    """``arch`` with the recipe's own MLP widths where it has them. Data without dense
    features has no bottom MLP on any side."""
    if recipe.top_mlp is not None:
        arch = replace(arch, top_mlp=recipe.top_mlp)
    if recipe.bottom_hidden is not None and arch.bottom_mlp:
        arch = replace(arch, bottom_mlp=(*recipe.bottom_hidden, arch.bottom_mlp[-1]))
    return arch


class RowwiseAdagrad(torch.optim.Optimizer):
    """FBGEMM's and TorchRec's row-wise Adagrad on sparse gradients: per touched row r,
    ``m[r] += mean_j g[r, j]^2``, ``w[r] -= lr g[r] / (sqrt(m[r]) + eps)``."""

    def __init__(self, params: Any, lr: float, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.coalesce()
                rows, values = grad.indices()[0], grad.values()
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=p.dtype)
                state["sum"].index_add_(0, rows, values.pow(2).mean(1))
                scale = group["lr"] / (state["sum"][rows].sqrt() + group["eps"])
                p.index_add_(0, rows, -values * scale.unsqueeze(1))


def _optimizers(model: ReferenceModel, recipe: Recipe) -> list[torch.optim.Optimizer]:
    tables = [p for n, p in model.named_parameters() if n.startswith("tables.")]
    dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    if recipe.embedding_optimizer == "adam":  # one Adam over every weight, tables included
        return [torch.optim.Adam([*dense, *tables], lr=recipe.dense_lr)]
    rows: torch.optim.Optimizer
    if recipe.embedding_optimizer == "rowwise_adagrad":
        rows = RowwiseAdagrad(tables, lr=recipe.embedding_lr)
    elif recipe.embedding_optimizer == "adagrad":
        rows = torch.optim.Adagrad(tables, lr=recipe.embedding_lr)
    elif recipe.embedding_optimizer == "sparse_adam":  # only the looked-up rows' moments move
        rows = torch.optim.SparseAdam(tables, lr=recipe.embedding_lr)
    else:
        rows = torch.optim.SGD(tables, lr=recipe.embedding_lr)
    return [torch.optim.Adam(dense, lr=recipe.dense_lr), rows]


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


def _better(metric: str, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value > best if metric == "auc" else value < best


def selections(history: list[dict]) -> dict[str, dict]:
    """Per selection rule (``logloss``, ``auc``): the epoch record of the best validation
    value among ``history``'s (``{"epoch", "validation": {...}, "test": {...}}``)."""
    chosen = {}
    for rule in SELECTION_RULES:
        best = history[0]
        for record in history[1:]:
            if _better(rule, record["validation"][rule], best["validation"][rule]):
                best = record
        chosen[rule] = best
    return chosen


@dataclass
class ReferenceResult:
    num_dense_params: int
    stopped_epoch: int  # the last epoch trained
    best_epoch: int  # the recipe's own choice (its monitor)
    epochs: list[dict] = field(default_factory=list)  # epoch, validation, test


def train_reference(
    arch: Architecture,
    train: PlainData,
    valid: PlainData,
    test: PlainData | None,
    *,
    recipe: Recipe,
    epochs: int,
    batch_size: int,
    seed: int,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
) -> ReferenceResult:
    """Train ``recipe`` from seed ``seed`` (init and shuffling) for at most ``epochs``
    (module doc); ``test`` None: the validation rows stand in for it. ``on_epoch`` sees
    each epoch's record (its number, validation and test metrics) as it ends."""
    torch.manual_seed(seed)
    sizes = [bag.num_embeddings for bag in train.bags]
    sparse = recipe.embedding_optimizer != "adam"
    model = build_reference_model(arch, train.dense.shape[1], sizes, recipe.init, sparse)
    optimizers = _optimizers(model, recipe)
    order = torch.Generator().manual_seed(seed)
    history: list[dict] = []
    best_value: float | None = None
    best_epoch, since_best = 0, 0
    # torch's sparse Adagrad warns on every step that it skips its sparse-tensor checks.
    warnings.filterwarnings("ignore", message="Sparse invariant checks", category=UserWarning)
    for epoch in range(1, epochs + 1):
        permutation = torch.randperm(train.rows, generator=order)
        for start in range(0, train.rows, batch_size):
            x, bags, y = train.take(permutation[start : start + batch_size])
            loss = F.binary_cross_entropy_with_logits(model(x, bags), y)
            if recipe.embedding_l2:
                loss = loss + recipe.embedding_l2 * model.tables.squared_rows(bags)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            for opt in optimizers:
                opt.step()
        record: dict[str, Any] = {
            "epoch": epoch,
            "validation": _evaluate(model, valid, recipe.eval_batch_size),
        }
        record["test"] = (
            _evaluate(model, test, recipe.eval_batch_size) if test else record["validation"]
        )
        history.append(record)
        if on_epoch is not None:
            on_epoch(record)
        value = record["validation"][recipe.monitor]
        if _better(recipe.monitor, value, best_value):
            best_value, best_epoch, since_best = value, epoch, 0
            continue
        since_best += 1
        if recipe.plateau_factor is not None:
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = max(group["lr"] * recipe.plateau_factor, recipe.min_lr)
        if since_best >= recipe.patience:
            break
    num_dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("tables."))
    return ReferenceResult(num_dense, history[-1]["epoch"], best_epoch, history)


def with_overrides(recipe: Recipe, **changes: Any) -> Recipe:
    """``recipe`` with the fields in ``changes`` that are not None replaced."""
    return replace(recipe, **{k: v for k, v in changes.items() if v is not None})
