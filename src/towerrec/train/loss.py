"""The training objective, outside the model: BCE, or a positive-unlabeled (PU) loss.

``loss.kind`` picks one (docs/pu_learning.md has the math):

``bce``     ``mean_i BCE(x_i, y_i)``: every label taken at face value (the default).
``pu_bce``  labels 1 are labelled positives, labels 0 are *unlabelled*. A labelled
            positive counts as a positive of weight 1; an unlabelled example as a
            positive of weight ``pi`` and a negative of weight ``1 - pi`` (puNCE's
            weighting), ``pi`` the share of positives among the unlabelled examples
            (``loss.class_prior``)::

                l_i = y_i softplus(-x_i)
                      + (1 - y_i) [pi softplus(-x_i) + (1 - pi) softplus(x_i)]

            Each example's weights sum to 1, so the loss is a per-example mean like
            BCE (it equals BCE against the soft target ``y_i + (1 - y_i) pi``) and a
            data-parallel run averages it over ranks exactly as it averages BCE.
``punce``   ``pu_bce`` plus ``loss.contrastive_weight`` times puNCE's contrastive term
            on the model's representation ``h [B, R]`` (``punce_contrastive``): each
            example is a positive anchor of weight ``w+`` and a negative one of weight
            ``w-`` (1 and 0 for a labelled positive, ``pi`` and ``1 - pi`` for an
            unlabelled one); an anchor's partners are the other examples of its
            class, each weighted by its own membership of that class. Only models with
            a representation qualify (``RepresentationModel``: the DLRM, whose
            representation is its top MLP's input). The term pairs the examples of
            one rank's batch: on several ranks it pairs within each rank's local batch.

``Objective`` runs the forward (``forward``, under the step's autocast) and the loss
(``loss``), so ``train_step`` stays the same for every kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from towerrec.data.batch import Batch
from towerrec.models.interfaces import RepresentationModel

__all__ = [
    "BCE",
    "LossKind",
    "Objective",
    "TrainObjective",
    "build_objective",
    "pu_bce",
    "pu_targets",
    "punce_contrastive",
]


class LossKind(StrEnum):
    BCE = "bce"
    PU_BCE = "pu_bce"
    PUNCE = "punce"


def check_prior(prior: float, what: str = "loss.class_prior") -> float:
    """``prior`` if it lies strictly inside (0, 1); a ``ValueError`` naming the fix if not."""
    if not 0 < prior < 1:
        raise ValueError(
            f"{what} = {prior} must lie strictly between 0 and 1: the share of positives "
            'among the unlabelled examples (or "estimate" to estimate it from the training '
            "data, as `towerrec data pu-prior` does)"
        )
    return prior


def pu_targets(labels: torch.Tensor, prior: float) -> torch.Tensor:
    """Soft targets ``[B]``: 1 for a labelled positive, ``prior`` for an unlabelled example."""
    return labels + (1 - labels) * prior


def pu_bce(logits: torch.Tensor, labels: torch.Tensor, prior: float) -> torch.Tensor:
    """Mean PU-weighted BCE of ``logits [B]`` (float32) and observed ``labels [B]`` (0/1).

    A labelled positive counts once as a positive; an unlabelled example as a positive of
    weight ``prior`` and a negative of weight ``1 - prior``: BCE against ``pu_targets``.
    """
    return F.binary_cross_entropy_with_logits(logits, pu_targets(labels, check_prior(prior)))


def punce_contrastive(
    representation: torch.Tensor, labels: torch.Tensor, prior: float, temperature: float
) -> torch.Tensor:
    """puNCE's weighted contrastive term over one batch; ``representation [B, R]``.

    With ``z = h / |h|``, ``p_ij = softmax_{j != i}(z_i . z_j / temperature)`` and class
    memberships ``w_i+ = y_i + (1 - y_i) prior``, ``w_i- = 1 - w_i+``::

        loss = 1/B sum_i sum_{c in +,-} w_ic * ( - sum_{j != i} w_jc log p_ij
                                                  / sum_{j != i} w_jc )

    An anchor copy whose class has no partner in the batch adds nothing. Needs B >= 2.
    """
    batch = representation.shape[0]
    if batch < 2:
        raise ValueError(f"the puNCE contrastive term needs at least 2 examples, got {batch}")
    z = F.normalize(representation.float(), dim=1)
    similarity = z @ z.T / temperature  # [B, B]
    self_pair = torch.eye(batch, dtype=torch.bool, device=z.device)
    log_p = torch.log_softmax(similarity.masked_fill(self_pair, float("-inf")), dim=1)
    log_p = log_p.masked_fill(self_pair, 0.0)  # -inf * 0 would be nan
    positive = pu_targets(labels.float(), check_prior(prior))
    loss = z.new_zeros(())
    for member in (positive, 1 - positive):  # [B] membership of the class
        partners = member.unsqueeze(0).expand(batch, batch).masked_fill(self_pair, 0.0)
        mass = partners.sum(dim=1)  # [B]
        per_anchor = -(partners * log_p).sum(dim=1) / mass.clamp_min(1e-12)
        loss = loss + (member * per_anchor * (mass > 0)).sum()
    return loss / batch


@dataclass(frozen=True)
class Objective:
    """The loss of ``loss.kind`` on a model's forward; ``prior`` resolved (not "estimate")."""

    kind: LossKind = LossKind.BCE
    prior: float | None = None
    contrastive_weight: float = 0.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.kind is not LossKind.BCE:
            if self.prior is None:
                raise ValueError(f"loss.kind = {self.kind.value!r} needs a class prior")
            check_prior(self.prior)

    def check_model(self, model: nn.Module) -> None:
        """A clear error when ``punce`` meets a model without a representation."""
        if self.kind is LossKind.PUNCE and not isinstance(model, RepresentationModel):
            raise ValueError(
                f"loss.kind = 'punce' needs a model with a representation, but "
                f"{type(model).__name__} has none; use model.name = 'dlrm' (its "
                "representation is the top MLP's input) or loss.kind = 'pu_bce'"
            )

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``logits [B]`` of ``batch`` and, for ``punce``, the representation ``[B, R]``
        (None otherwise); call under the step's autocast."""
        if self.kind is not LossKind.PUNCE:
            return model(batch.dense, batch.sparse), None
        self.check_model(model)
        assert isinstance(model, RepresentationModel)
        captured: list[torch.Tensor] = []
        hook = model.representation_module.register_forward_pre_hook(
            lambda _module, args: captured.append(args[0])
        )
        try:  # through model(...), so a data-parallel wrapper's hooks run as usual
            logits = model(batch.dense, batch.sparse)
        finally:
            hook.remove()
        return logits, captured[0]

    def loss(
        self, logits: torch.Tensor, representation: torch.Tensor | None, labels: torch.Tensor
    ) -> torch.Tensor:
        """The scalar loss of ``logits [B]`` (and ``representation [B, R]``) on ``labels``."""
        if self.kind is LossKind.BCE:
            return F.binary_cross_entropy_with_logits(logits.float(), labels)
        assert self.prior is not None  # checked on construction
        pointwise = pu_bce(logits.float(), labels, self.prior)
        if self.kind is LossKind.PU_BCE:
            return pointwise
        assert representation is not None  # forward captured it
        contrastive = punce_contrastive(representation, labels, self.prior, self.temperature)
        return pointwise + self.contrastive_weight * contrastive


class TrainObjective(Protocol):
    """What a train step needs of its objective: ``Objective``, or ``Distillation``
    (``towerrec.workflows.distill.loss``), which adds terms on the batch's teacher logits."""

    def check_model(self, model: nn.Module) -> None: ...

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
        """``logits [B]`` and what ``loss`` needs besides them."""
        ...

    def loss(self, logits: torch.Tensor, extra: Any, labels: torch.Tensor) -> torch.Tensor: ...


BCE = Objective()  # the default: every label at face value


def build_objective(
    kind: str, prior: float | None, contrastive_weight: float = 0.0, temperature: float = 1.0
) -> Objective:
    return Objective(LossKind(kind), prior, contrastive_weight, temperature)
