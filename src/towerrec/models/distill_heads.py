"""The distillation heads of a student model (external distillation, ExFM; docs/exfm.md).

::

    dense, sparse ──► model ──► s            the serving logit (evaluation and export)
                        │
                        └── h (the DLRM's top MLP input)
                              └──► aux(h) ──► d        the auxiliary head (head = "auxiliary")
    z_T [B] (the teacher's logit), x [B, F_d]
                              └──► a = z_T + MLP([z_T, x])   the student adapter

``DistillHeads`` holds the auxiliary head and the adapter, either may be None, as the
model's submodule ``distill_heads``: checkpoints hold them, data parallelism replicates
them like any dense layer, the model's forward never calls them, and export drops them
(``detach_distill_heads``). The build layer attaches them when ``[distill]`` asks
(``towerrec.build.models``); the loss that uses them is the distillation workflow's
(``towerrec.workflows.distill.loss``).
"""

from __future__ import annotations

import torch
from torch import nn

from towerrec.modules.mlp import MLP

__all__ = ["HEADS", "Adapter", "DistillHeads", "detach_distill_heads", "distill_heads"]

HEADS = "distill_heads"  # the submodule's name in the model


class Adapter(nn.Module):
    """``a = z + MLP([z, x])``: the teacher's logit ``z [B]`` corrected, from it and (with
    ``num_dense`` > 0) the dense features ``x [B, F_d]``; the identity at start."""

    def __init__(self, width: int, num_dense: int = 0) -> None:
        super().__init__()
        self.num_dense = num_dense
        self.mlp = MLP(1 + num_dense, [width, 1], final_activation=False)
        last = self.mlp[-1]
        assert isinstance(last, nn.Linear)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)

    def forward(self, teacher: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
        parts = [teacher.unsqueeze(1)]
        if self.num_dense:
            assert dense is not None and dense.shape[1] == self.num_dense
            parts.append(dense.float())
        return teacher + self.mlp(torch.cat(parts, dim=1)).squeeze(1)


class DistillHeads(nn.Module):
    """The auxiliary head (``aux``, over the representation) and the adapter, either may
    be None; dense parameters of the model (module docstring)."""

    def __init__(self, aux: MLP | None, adapter: Adapter | None, adapter_lr: float) -> None:
        super().__init__()
        self.aux = aux
        self.adapter = adapter
        self.adapter_lr = adapter_lr


def distill_heads(model: nn.Module) -> DistillHeads | None:
    """The model's ``DistillHeads``, if it has them."""
    heads = dict(model.named_children()).get(HEADS)
    assert heads is None or isinstance(heads, DistillHeads)
    return heads


def detach_distill_heads(model: nn.Module) -> nn.Module:
    """``model`` without its distillation heads: the serving model alone (export)."""
    if distill_heads(model) is not None:
        delattr(model, HEADS)
    return model
