"""The plain PyTorch DLRM: the peer of towerrec's step on a GPU without FBGEMM.

What a PyTorch user writes for the same shape, with no towerrec code in it::

    dense [B, F_d] ─► bottom MLP (nn.Linear + ReLU) ─► x [B, D]
    ids (one KeyedJagged batch) ─► nn.EmbeddingBag(sparse=True), sum ─► E [B, T, D]
        per_table: one EmbeddingBag per table
        fused:     one EmbeddingBag over every table's rows (ids offset by table), one
                   kernel for all tables
    Z = bmm([x, E], [x, E]^T), its strict upper triangle ─► dots [B, (T+1)T/2]
    top MLP(concat[x, dots]) ─► logit [B]; BCE with logits

Optimizers: fused Adam on the MLPs, as towerrec's step;
``torch.optim.Adagrad`` on the tables' sparse gradients (element-wise Adagrad: it keeps
D state floats a row where towerrec's exact row-wise Adagrad keeps one).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from towerrec.data.batch import Batch

__all__ = ["PlainDLRM", "plain_dlrm", "plain_step"]


def _mlp(sizes: list[int], final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if final_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class PlainDLRM(nn.Module):
    """The module doc's model; ``forward(dense, values, lengths, counts)`` takes the
    batch's ids as a KeyedJagged batch lays them out (table-major bags, ``counts`` ids
    of each table)."""

    pairs: torch.Tensor
    table_base: torch.Tensor

    def __init__(
        self,
        num_tables: int,
        num_embeddings: int | list[int],
        embedding_dim: int,
        num_dense: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
        fused: bool,
    ) -> None:
        super().__init__()
        if bottom_mlp[-1] != embedding_dim:
            raise ValueError(
                f"the bottom MLP must end at the embedding dim {embedding_dim}, "
                f"got {bottom_mlp[-1]}"
            )
        rows = (
            [num_embeddings] * num_tables
            if isinstance(num_embeddings, int)
            else list(num_embeddings)
        )
        if len(rows) != num_tables:
            raise ValueError(f"{len(rows)} row counts for {num_tables} tables")
        self.num_tables, self.rows, self.dim, self.fused = num_tables, rows, embedding_dim, fused
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(n, embedding_dim, mode="sum", sparse=True)
            for n in ([sum(rows)] if fused else rows)
        )
        self.bottom = _mlp([num_dense, *bottom_mlp], final_relu=True)
        vectors = num_tables + 1
        self.top = _mlp([embedding_dim + vectors * (vectors - 1) // 2, *top_mlp], False)
        rows_i, cols_i = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pairs", rows_i * vectors + cols_i, persistent=False)
        base = torch.tensor([0, *itertools.accumulate(rows)][:-1], dtype=torch.long)
        self.register_buffer("table_base", base, persistent=False)

    def embeddings(
        self, values: torch.Tensor, lengths: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        """Pooled ``[B, T, D]`` of the bags ``lengths [T*B]`` (table-major) over ``values``,
        ``counts[t]`` of them table t's (known on the host: no wait on the device)."""
        batch = lengths.numel() // self.num_tables
        offsets = torch.zeros(lengths.numel(), dtype=torch.long, device=lengths.device)
        offsets[1:] = torch.cumsum(lengths, 0)[:-1]
        if self.fused:
            per_table = lengths.view(self.num_tables, batch).sum(1)
            base = torch.repeat_interleave(self.table_base, per_table, output_size=sum(counts))
            pooled = self.tables[0](values + base, offsets)
            return pooled.view(self.num_tables, batch, self.dim).transpose(0, 1)
        parts = []
        starts = [0]
        for n in counts[:-1]:
            starts.append(starts[-1] + n)
        for t, (table, ids) in enumerate(zip(self.tables, values.split(counts))):
            bag_offsets = offsets[t * batch : (t + 1) * batch] - starts[t]
            parts.append(table(ids, bag_offsets))
        return torch.stack(parts, dim=1)

    def forward(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.embeddings(values, lengths, counts)
        stacked = torch.cat([x.unsqueeze(1), pooled.to(x.dtype)], 1)
        grid = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)
        dots = grid[:, self.pairs]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def plain_dlrm(
    shape: dict[str, Any], device: torch.device, fused: bool, emb_lr: float, dense_lr: float
) -> tuple[PlainDLRM, list[torch.optim.Optimizer]]:
    """The peer model of ``shape`` (``bench/train.py``'s keys) on ``device`` and its
    optimizers (module doc)."""
    torch.manual_seed(0)
    model = PlainDLRM(
        shape["num_tables"],
        shape["num_embeddings"],
        shape["embedding_dim"],
        shape["num_dense"],
        list(shape["bottom_mlp"]),
        list(shape["top_mlp"]),
        fused,
    ).to(device)
    dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.Adam(dense, lr=dense_lr, fused=True),
        torch.optim.Adagrad(list(model.tables.parameters()), lr=emb_lr),
    ]
    return model, optimizers


def plain_step(
    model: PlainDLRM,
    optimizers: list[torch.optim.Optimizer],
    batch: Batch,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One training step of the peer: forward (the MLPs under ``autocast_dtype``), BCE,
    backward, every optimizer's step."""
    device = batch.dense.device
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        sparse = batch.sparse
        logits = model(batch.dense, sparse.values(), sparse.lengths(), sparse.length_per_key())
    loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
    return loss.detach()
