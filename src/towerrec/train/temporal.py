"""Training strategies over time-ordered periods (``train.temporal``; docs/temporal.md).

``towerrec replay`` trains at each period t on what ``training_periods`` names:

    incremental   [t]                        one pass over the new period
    batch         [t-window+1 .. t] or 0..t  one pass over the window (cost grows with t)
    fgd           [t]                        as incremental, each dense gradient forecast

Future gradient descent (after Ye et al., "Future Gradient Descent for Adapting the
Temporal Shifting Data Distribution in Online Recommendation Systems", 2022): the
dense step uses a forecast of the *next* period's gradient instead of the current one,
from a small generator meta-learned on the last two periods. Here the generator is
two coefficients per dense parameter tensor i (a simplification of the paper's
network)::

    g_hat_i = (1 + a_i) * g_i + b_i * d_i,   d_i = mean_grad_i(t-1) - mean_grad_i(t-2)

and at the start of period t (t >= 1) it is meta-trained on the pair (t-1, t): for
each of ``fgd_meta_batches`` batch pairs, look ahead with an SGD step from the past
batch's forecast, ``theta' = theta - lr * g_hat(theta; past)``, and take the first-order
hypergradient of the future batch's loss ``L(theta'; future)``: with
``h = grad L(theta'; future)``, ``dL/da_i = -lr <h_i, g_i>``, ``dL/db_i = -lr <h_i, d_i>``;
the coefficients move by ``fgd_meta_lr`` times the cosines (the normalised hypergradient)
and are clipped to ``[-1, fgd_max_coef]`` (a) and ``[-fgd_max_coef, fgd_max_coef]`` (b).
Embedding rows, updated inside backward by their fused optimizer, see their own
gradients unchanged. Zero coefficients leave every gradient untouched, so fgd then
trains bit for bit as incremental.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import torch
from torch import nn

from towerrec.config import TemporalConfig
from towerrec.data.batch import Batch
from towerrec.train.loss import TrainObjective
from towerrec.train.step import autocast

__all__ = ["FutureGradient", "training_periods"]


def training_periods(temporal: TemporalConfig, period: int) -> list[int]:
    """The periods, in time order, that ``temporal.strategy`` trains on at ``period``."""
    if temporal.strategy != "batch":
        return [period]
    first = 0 if temporal.window == 0 else max(0, period - temporal.window + 1)
    return list(range(first, period + 1))


class FutureGradient:
    """The forecast of the next period's dense gradient and its meta-learning (module
    docstring). ``step`` is ``train_step`` with the forecast between backward and the
    optimizer; ``end_period`` closes a period's mean gradient; ``meta_update`` trains
    the coefficients on a past and a future period's batches."""

    def __init__(self, optimizer: torch.optim.Optimizer, temporal: TemporalConfig):
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self.temporal = temporal
        self.a = [0.0] * len(self.params)
        self.b = [0.0] * len(self.params)
        self._sum = [torch.zeros_like(p) for p in self.params]
        self._count = 0
        self._means: list[list[torch.Tensor]] = []  # the last two periods' mean gradients
        self.drift: list[torch.Tensor] | None = None

    def forecast(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``g_hat_i = (1 + a_i) g_i + b_i d_i``; ``g_i`` itself where both are zero."""
        out = []
        for i, g in enumerate(grads):
            a, b = self.a[i], self.b[i]
            if a == 0.0 and b == 0.0:
                out.append(g)
                continue
            g_hat = g * (1.0 + a)
            if b != 0.0 and self.drift is not None:
                g_hat = g_hat + b * self.drift[i]
            out.append(g_hat)
        return out

    def step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Batch,
        autocast_dtype: torch.dtype | None,
        objective: TrainObjective,
    ) -> torch.Tensor:
        with autocast(batch.dense.device, autocast_dtype):
            logits, representation = objective.forward(model, batch)
        loss = objective.loss(logits, representation, batch.labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # embedding rows are updated here with their own gradients
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for total, g in zip(self._sum, grads, strict=True):
            total.add_(g)
        self._count += 1
        if self.temporal.fgd_generator:
            for p, g_hat in zip(self.params, self.forecast(grads), strict=True):
                if p.grad is not None:
                    p.grad = g_hat
        optimizer.step()
        return loss.detach()

    def end_period(self) -> None:
        """Close the period: its mean gradient; the drift between the last two."""
        if self._count:
            self._means = [*self._means[-1:], [s / self._count for s in self._sum]]
        for s in self._sum:
            s.zero_()
        self._count = 0
        if len(self._means) == 2:
            self.drift = [new - old for old, new in zip(*self._means, strict=True)]

    def _grads(
        self, model: nn.Module, batch: Batch, dtype: torch.dtype | None, obj: TrainObjective
    ) -> list[torch.Tensor]:
        """Dense gradients of ``batch``'s loss; ``autograd.grad`` on the dense parameters
        only, so the embeddings' fused update in backward does not run."""
        with autocast(batch.dense.device, dtype):
            logits, representation = obj.forward(model, batch)
        loss = obj.loss(logits, representation, batch.labels)
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]

    def meta_update(
        self,
        model: nn.Module,
        past: Iterable[Batch],
        future: Iterable[Batch],
        lr: float,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        objective: TrainObjective,
    ) -> int:
        """Meta-train the coefficients on batch pairs of a past and the following period
        (module docstring); the model's weights are restored exactly. The pairs used."""
        if not self.temporal.fgd_generator or self.temporal.fgd_meta_lr == 0.0:
            return 0
        limit, used = self.temporal.fgd_max_coef, 0
        pairs = itertools.islice(zip(past, future), self.temporal.fgd_meta_batches)
        for old, new in pairs:
            g = self._grads(model, old.to(device), autocast_dtype, objective)
            g_hat = self.forecast(g)
            saved = [p.detach().clone() for p in self.params]
            with torch.no_grad():
                for p, step in zip(self.params, g_hat, strict=True):
                    p.sub_(step, alpha=lr)
            h = self._grads(model, new.to(device), autocast_dtype, objective)
            with torch.no_grad():
                for p, w in zip(self.params, saved, strict=True):
                    p.copy_(w)
            for i in range(len(self.params)):
                self.a[i] = min(
                    limit, max(-1.0, self.a[i] + self.temporal.fgd_meta_lr * _cos(h[i], g[i]))
                )
                if self.drift is not None:
                    cos_d = _cos(h[i], self.drift[i])
                    self.b[i] = min(
                        limit, max(-limit, self.b[i] + self.temporal.fgd_meta_lr * cos_d)
                    )
            used += 1
        return used


def _cos(x: torch.Tensor, y: torch.Tensor) -> float:
    norm = float(x.norm() * y.norm())
    if not math.isfinite(norm) or norm == 0.0:
        return 0.0
    return float((x * y).sum()) / norm
