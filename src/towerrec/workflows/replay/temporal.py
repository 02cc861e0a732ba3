"""Training strategies over time-ordered periods (``train.temporal``; docs/temporal.md).

``towerrec replay`` trains at each period t on what ``training_periods`` names:

    incremental   [t]                        one pass over the new period
    batch         [t-window+1 .. t] or 0..t  one pass over the window (cost grows with t)
    fgd           [t]                        as incremental, each dense gradient forecast

Future gradient descent (after Ye et al., "Future Gradient Descent for Adapting the
Temporal Shifting Data Distribution in Online Recommendation Systems", 2022): the
dense step uses a forecast of the *next* period's gradient instead of the current one,
from a generator meta-learned on past periods, where the "future" is known. Two
generators (``fgd_generator``):

``mlp`` (``GeneratorNet``): one small network applied to every coordinate of every
dense tensor (learned-optimizer style). Per coordinate of tensor i it reads the
current gradient ``g``, the drift ``delta`` of the mean gradient from the period
before to this one (both measured at the weights of the period's start) and the
weight, each divided by its RMS over tensor i, and adds a bounded correction::

    g_hat = g + c * rms_i(g) * tanh(MLP(g / rms_i(g), delta / rms_i(delta), w / rms_i(w)))

(c = ``fgd_max_coef``). Its output layer starts at zero, so the forecast starts as
the gradient itself. At the start of period t (t >= 1) it is meta-trained by Adam
(learning rate ``fgd_net_lr``) on batch pairs (x of period t-1, y of period t): with
the past batch's gradient ``g_x``
and the drift known then (period t-2 to t-1), one SGD look-ahead step
``theta' = theta - lr * g_hat(g_x, delta_{t-1}, theta)`` and the future batch's loss
``L(theta'; y)``; its gradient in the network's weights is exact:
``-lr * J_phi(g_hat)^T grad L(theta'; y)`` (``g_x`` does not depend on them). Training
on period t then uses ``delta_t`` (period t-1 to t).

``linear``: two coefficients per dense tensor,
``g_hat_i = (1 + a_i) * g_i + b_i * d_i``, ``d_i = mean_grad_i(t-1) - mean_grad_i(t-2)``
(the running means of training), meta-trained on the same look-ahead with the
first-order hypergradient ``dL/da_i = -lr <h_i, g_i>``, ``dL/db_i = -lr <h_i, d_i>``
(``h = grad L(theta'; y)``): the coefficients move by ``fgd_meta_lr`` times the cosines
and are clipped to ``[-1, fgd_max_coef]`` (a) and ``[-fgd_max_coef, fgd_max_coef]`` (b).

Embedding rows, updated inside backward by their fused optimizer, see their own
gradients unchanged. A generator that was never meta-trained (``none``, meta-lr 0)
leaves every gradient untouched, so fgd then trains bit for bit as incremental.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch
from torch import nn

from towerrec.config import TemporalConfig
from towerrec.data.batch import Batch
from towerrec.train.loss import TrainObjective
from towerrec.train.step import autocast

__all__ = ["FutureGradient", "GeneratorNet", "training_periods"]

Future = Callable[[list[torch.Tensor]], tuple[float, list[torch.Tensor]]]


def training_periods(temporal: TemporalConfig, period: int) -> list[int]:
    """The periods, in time order, that ``temporal.strategy`` trains on at ``period``."""
    if temporal.strategy != "batch":
        return [period]
    first = 0 if temporal.window == 0 else max(0, period - temporal.window + 1)
    return list(range(first, period + 1))


class GeneratorNet(nn.Module):
    """The ``mlp`` generator (module docstring): ``FEATURES`` inputs per coordinate, one
    hidden tanh layer, a bounded correction to the gradient; the output layer starts at
    zero, so ``forecast`` is then the gradient itself."""

    FEATURES = 3  # gradient, drift, weight

    def __init__(self, hidden: int, bound: float) -> None:
        super().__init__()
        self.hidden = nn.Linear(self.FEATURES, hidden, bias=False)
        self.out = nn.Linear(hidden, 1, bias=False)
        nn.init.zeros_(self.out.weight)
        self.bound = bound

    def forward(
        self,
        grads: list[torch.Tensor],
        drift: list[torch.Tensor] | None,
        weights: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """``g_hat`` of every tensor: one batched pass over all their coordinates."""
        drifts = drift if drift is not None else [torch.zeros_like(g) for g in grads]
        scales = [_rms(g) for g in grads]
        features = torch.cat(
            [
                torch.stack([g / s, _unit(d), _unit(w.detach())], dim=-1).reshape(-1, 3)
                for g, s, d, w in zip(grads, scales, drifts, weights, strict=True)
            ]
        )
        correction = torch.tanh(self.out(torch.tanh(self.hidden(features)))).squeeze(-1)
        out, offset = [], 0
        for g, s in zip(grads, scales, strict=True):
            n = g.numel()
            part = correction[offset : offset + n].view_as(g)
            out.append(g + (self.bound * s) * part)
            offset += n
        return out


def _rms(x: torch.Tensor) -> torch.Tensor:
    """RMS of ``x``, 1 where it is zero (so ``x / _rms(x)`` is 0, not NaN)."""
    rms = x.detach().pow(2).mean().sqrt()
    return torch.where(rms > 0, rms, torch.ones_like(rms))


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / _rms(x)


class FutureGradient:
    """The forecast of the next period's dense gradient and its meta-learning (module
    docstring). ``step`` is ``train_step`` with the forecast between backward and the
    optimizer; ``end_period`` closes a period's mean gradient (linear); ``meta_update``
    trains the generator on past and future periods' batches."""

    def __init__(self, optimizer: torch.optim.Optimizer, temporal: TemporalConfig):
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self.temporal = temporal
        self.kind = temporal.fgd_generator
        # linear
        self.a = [0.0] * len(self.params)
        self.b = [0.0] * len(self.params)
        self._sum = [torch.zeros_like(p) for p in self.params] if self.kind == "linear" else []
        self._count = 0
        self._means: list[list[torch.Tensor]] = []  # the last two periods' mean gradients
        self.drift: list[torch.Tensor] | None = None
        # mlp: its own initial weights, drawn without touching the global random stream
        self.net: GeneratorNet | None = None
        self.net_optimizer: torch.optim.Optimizer | None = None
        self.trained = False  # the network has had a meta-update (before: g_hat = g)
        self.meta_losses: list[float] = []  # mean look-ahead loss of each meta-update
        if self.kind == "mlp":
            device = self.params[0].device if self.params else torch.device("cpu")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self.net = GeneratorNet(temporal.fgd_hidden, temporal.fgd_max_coef).to(device)
            self.net_optimizer = torch.optim.Adam(self.net.parameters(), lr=temporal.meta_lr)

    def forecast(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The forecast used for training: ``g`` itself until the generator has learned."""
        if self.kind == "mlp":
            if self.net is None or not self.trained:
                return grads
            with torch.no_grad():
                return self.net(grads, self.drift, self.params)
        if self.kind != "linear":
            return grads
        return self._linear(grads)

    def _linear(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
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
        if self.kind == "linear":
            for total, g in zip(self._sum, grads, strict=True):
                total.add_(g)
            self._count += 1
        if self.kind != "none":
            for p, g_hat in zip(self.params, self.forecast(grads), strict=True):
                if p.grad is not None:
                    p.grad = g_hat
        optimizer.step()
        return loss.detach()

    def end_period(self) -> None:
        """Close the period: (linear) its mean gradient; the drift between the last two."""
        if self.kind != "linear":
            return
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
        return self._loss_and_grads(model, batch, dtype, obj)[1]

    def _loss_and_grads(
        self, model: nn.Module, batch: Batch, dtype: torch.dtype | None, obj: TrainObjective
    ) -> tuple[float, list[torch.Tensor]]:
        with autocast(batch.dense.device, dtype):
            logits, representation = obj.forward(model, batch)
        loss = obj.loss(logits, representation, batch.labels)
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        dense = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]
        return float(loss.detach()), dense

    def meta_update(
        self,
        model: nn.Module,
        past: Iterable[Batch],
        future: Iterable[Batch],
        lr: float,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        objective: TrainObjective,
        before: Iterable[Batch] | None = None,
    ) -> int:
        """Meta-train the generator on batch pairs of a past period and the following one
        (``before``: the period before the past one, for the mlp's drift feature; module
        docstring); the model's weights are restored exactly. The pairs used."""
        if self.kind == "none" or self.temporal.meta_lr == 0.0:
            return 0
        lr = self.temporal.fgd_lookahead_lr or lr
        if self.kind == "mlp":
            return self._meta_mlp(
                model, past, future, before, lr, device, autocast_dtype, objective
            )
        return self._meta_linear(model, past, future, lr, device, autocast_dtype, objective)

    def _meta_mlp(
        self,
        model: nn.Module,
        past: Iterable[Batch],
        future: Iterable[Batch],
        before: Iterable[Batch] | None,
        lr: float,
        device: torch.device,
        dtype: torch.dtype | None,
        objective: TrainObjective,
    ) -> int:
        assert self.net is not None and self.net_optimizer is not None
        count = self.temporal.fgd_meta_batches
        xs = [b.to(device) for b in itertools.islice(past, count)]
        ys = [b.to(device) for b in itertools.islice(future, count)]
        pairs = min(len(xs), len(ys))
        if pairs == 0:
            return 0
        g_past = [self._grads(model, x, dtype, objective) for x in xs]
        g_future = [self._grads(model, y, dtype, objective) for y in ys]
        mean_past, mean_future = _mean(g_past), _mean(g_future)
        drift_past = None
        if before is not None:
            g_before = [
                self._grads(model, z.to(device), dtype, objective)
                for z in itertools.islice(before, count)
            ]
            if g_before:
                drift_past = [p - q for p, q in zip(mean_past, _mean(g_before), strict=True)]
        futures = [
            (g, partial(self._at, model, batch=y, lr=lr, dtype=dtype, objective=objective))
            for g, y in zip(g_past, ys)
        ]
        self.meta_losses.append(self.look_ahead(futures[:pairs], drift_past, lr))
        self.drift = [f - p for f, p in zip(mean_future, mean_past, strict=True)]
        self.trained = True
        return pairs

    def look_ahead(
        self,
        pairs: Sequence[tuple[list[torch.Tensor], Future]],
        drift: list[torch.Tensor] | None,
        lr: float,
    ) -> float:
        """One Adam step of the network per pair ``(g_x, future)`` on the look-ahead loss
        ``L(theta - lr * g_hat(g_x, drift, theta); y)``: ``future(step)`` is the future
        batch's loss and dense gradient at ``theta - lr * step`` (theta restored). The
        mean look-ahead loss over the pairs, each met before its step."""
        assert self.net is not None and self.net_optimizer is not None
        weights = list(self.net.parameters())
        met = []
        for g, future in pairs:
            g_hat = self.net(g, drift, self.params)
            loss, h = future([x.detach() for x in g_hat])
            met.append(loss)
            meta = torch.autograd.grad(g_hat, weights, grad_outputs=[-lr * x for x in h])
            for w, m in zip(weights, meta, strict=True):
                w.grad = m
            self.net_optimizer.step()
        return sum(met) / len(met)

    def _at(
        self,
        model: nn.Module,
        step: list[torch.Tensor],
        batch: Batch,
        lr: float,
        dtype: torch.dtype | None,
        objective: TrainObjective,
    ) -> tuple[float, list[torch.Tensor]]:
        """Loss and dense gradient of ``batch`` at ``theta - lr * step``; theta restored."""
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, step, strict=True):
                p.sub_(s, alpha=lr)
        try:
            return self._loss_and_grads(model, batch, dtype, objective)
        finally:
            with torch.no_grad():
                for p, w in zip(self.params, saved, strict=True):
                    p.copy_(w)

    def _meta_linear(
        self,
        model: nn.Module,
        past: Iterable[Batch],
        future: Iterable[Batch],
        lr: float,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        objective: TrainObjective,
    ) -> int:
        limit, used, meta_lr = self.temporal.fgd_max_coef, 0, self.temporal.meta_lr
        pairs = itertools.islice(zip(past, future), self.temporal.fgd_meta_batches)
        for old, new in pairs:
            g = self._grads(model, old.to(device), autocast_dtype, objective)
            h = self._at(model, self._linear(g), new.to(device), lr, autocast_dtype, objective)[1]
            for i in range(len(self.params)):
                self.a[i] = min(limit, max(-1.0, self.a[i] + meta_lr * _cos(h[i], g[i])))
                if self.drift is not None:
                    cos_d = _cos(h[i], self.drift[i])
                    self.b[i] = min(limit, max(-limit, self.b[i] + meta_lr * cos_d))
            used += 1
        return used

    def summary(self) -> dict:
        """What replay's summary records of the generator."""
        if self.kind == "mlp":
            return {
                "generator": "mlp",
                "look_ahead_loss": self.meta_losses,
            }
        return {"generator": self.kind, "a": self.a, "b": self.b}


def _mean(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(parts).mean(0) for parts in zip(*grads, strict=True)]


def _cos(x: torch.Tensor, y: torch.Tensor) -> float:
    norm = float(x.norm() * y.norm())
    if not math.isfinite(norm) or norm == 0.0:
        return 0.0
    return float((x * y).sum()) / norm
