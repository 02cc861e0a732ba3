"""External distillation of a student from a foundation model's logits (ExFM; docs/exfm.md).

The batches carry the teacher's logit ``z_T [B]`` (``Batch.teacher_logits``, written by
``towerrec distill serve`` or, in tests and benchmarks, by ``TeacherPeriods``). With
``distill.weight = w > 0`` the student's loss is::

    L = BCE(s, y)                                  the serving head on the labels
        + w * BCE(d, sigmoid(alpha * t))           distillation on a soft label
        + BCE(a, y)                                the adapter on the labels (with adapter)

    s  the serving logit (the model's output; the only one evaluation and export see)
    d  head = "shared": s itself; head = "auxiliary": aux(G_beta(h)), a separate head
       (an MLP shaped as the top MLP) over the representation h (the DLRM's top MLP
       input), G_beta the identity forward whose backward multiplies by beta, so the
       distillation gradient reaching the shared backbone is beta times its own
    t  no adapter: z_T; adapter: stop_gradient(a), a = z_T + MLP([z_T, x]) the student
       adapter (``distill.adapter_width`` hidden units; x the dense features with
       ``distill.adapter_features``, else nothing; last layer zero at start, so it
       begins as the identity), trained on the fresh labels at ``distill.adapter_lr``:
       with each batch in the student's step (``adapter_order = "joint"``), and with
       ``"first"`` also in a pass of its own over each period before the student trains on
       it (``fit_adapter``, called by replay)

``alpha`` (``label_scale``) scales the teacher's logit before the sigmoid: > 1 sharpens
the soft label, < 1 softens it. The auxiliary head and adapter are ``DistillHeads``
(``towerrec.models.distill_heads``), a submodule of the model that the build layer
attaches when ``[distill]`` asks (``towerrec.build.models.attach_distill_heads``); they
are drawn from their own generator, so the student's own initial weights are those of a
run without distillation; w = 0 builds no heads and trains bit for bit as without
distillation. Teacher logits come from the augmentation service (``augment.py``) or, in
process, from ``TeacherPeriods`` (``teacher.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from towerrec.config import DistillConfig
from towerrec.data.batch import Batch
from towerrec.models.distill_heads import distill_heads
from towerrec.models.interfaces import RepresentationModel
from towerrec.train.loss import LossKind, Objective

__all__ = ["DistillTerms", "Distillation", "fit_adapter", "grad_scale", "with_distillation"]


_NO_TEACHER = (
    "distill.weight {weight} needs the teacher's logits in every batch, but this batch has "
    'none: train on data augmented by `towerrec distill serve` (data.source = "augmented"), '
    "or set distill.weight = 0"
)


class _GradScale(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def grad_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x``, with the gradient flowing back through it multiplied by ``scale``."""
    return x if scale == 1.0 else _GradScale.apply(x, scale)


@dataclass
class DistillTerms:
    """What ``Distillation.forward`` hands its ``loss``: the base objective's
    representation, the distillation logit ``d [B]``, the soft label ``[B]`` and the
    adapter's logit ``a [B]`` (None without adapter)."""

    representation: torch.Tensor | None
    distill_logit: torch.Tensor
    soft_label: torch.Tensor
    adapter_logit: torch.Tensor | None


@dataclass(frozen=True)
class Distillation:
    """``base``'s loss plus the distillation terms of ``config`` (module docstring); the
    same interface as ``Objective``."""

    base: Objective
    config: DistillConfig

    def check_model(self, model: nn.Module) -> None:
        self.base.check_model(model)
        heads = distill_heads(model)
        if self.config.head == "auxiliary" and (heads is None or heads.aux is None):
            raise ValueError(
                "distill.head = 'auxiliary' but the model has no auxiliary head: build it "
                "with build_model from a config whose [distill] asks for it"
            )
        if self.config.adapter and (heads is None or heads.adapter is None):
            raise ValueError("distill.adapter = true but the model has no adapter")

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, DistillTerms]:
        teacher = batch.teacher_logits
        if teacher is None:
            raise ValueError(_NO_TEACHER.format(weight=f"= {self.config.weight}"))
        auxiliary = self.config.head == "auxiliary"
        captured: list[torch.Tensor] = []
        hook = None
        if auxiliary or self.base.kind is LossKind.PUNCE:
            assert isinstance(model, RepresentationModel)  # check_model / Config
            hook = model.representation_module.register_forward_pre_hook(
                lambda _module, args: captured.append(args[0])
            )
        try:
            logits = model(batch.dense, batch.sparse)
        finally:
            if hook is not None:
                hook.remove()
        heads = distill_heads(model)
        adapter_logit = None
        target = teacher.float()
        if self.config.adapter:
            assert heads is not None and heads.adapter is not None  # check_model
            adapter_logit = heads.adapter(target, batch.dense)
            target = adapter_logit.detach().float()  # the stop-gradient
        soft_label = torch.sigmoid(self.config.label_scale * target)
        if auxiliary:
            assert heads is not None and heads.aux is not None  # check_model
            shared = grad_scale(captured[0], self.config.grad_scale)
            distill_logit = heads.aux(shared).squeeze(1)
        else:
            distill_logit = logits
        representation = captured[0] if self.base.kind is LossKind.PUNCE else None
        return logits, DistillTerms(representation, distill_logit, soft_label, adapter_logit)

    def loss(self, logits: torch.Tensor, terms: DistillTerms, labels: torch.Tensor) -> torch.Tensor:
        total = self.base.loss(logits, terms.representation, labels)
        distill = F.binary_cross_entropy_with_logits(terms.distill_logit.float(), terms.soft_label)
        total = total + self.config.weight * distill
        if terms.adapter_logit is not None:
            adapter = terms.adapter_logit.float()
            total = total + F.binary_cross_entropy_with_logits(adapter, labels)
        return total


def fit_adapter(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    device: torch.device,
    factor: float,
) -> int:
    """One pass of the adapter alone over ``batches`` (``distill.adapter_order = "first"``:
    a period's labels, before the student trains on it): a step of ``optimizer`` per batch
    on ``BCE(a, y)``, at the adapter's learning rate times ``factor``. Only the adapter has
    gradients, so the optimizer leaves every other parameter (and its state) alone; the
    model's forward is not run. The number of steps."""
    heads = distill_heads(model)
    assert heads is not None and heads.adapter is not None  # Distillation.check_model
    mine = {id(p) for p in heads.adapter.parameters()}
    group = next(g for g in optimizer.param_groups if any(id(p) in mine for p in g["params"]))
    saved, group["lr"] = group["lr"], heads.adapter_lr * factor  # split_adapter_group's
    steps = 0
    try:
        for batch in batches:
            on = batch.to(device)
            if on.teacher_logits is None:
                raise ValueError(_NO_TEACHER.format(weight="> 0 with distill.adapter"))
            adapter_logit = heads.adapter(on.teacher_logits.float(), on.dense)
            loss = F.binary_cross_entropy_with_logits(adapter_logit.float(), on.labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
    finally:
        optimizer.zero_grad(set_to_none=True)
        group["lr"] = saved
    return steps


def with_distillation(objective: Objective, config: DistillConfig) -> Objective | Distillation:
    """``objective`` itself when distillation is off (w = 0), else its ``Distillation``."""
    return Distillation(objective, config) if config.enabled else objective
