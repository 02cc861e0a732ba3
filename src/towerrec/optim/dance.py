"""DANCE for the dense parameters: a multistage, distributed Newton-CG whose sample
grows from stage to stage (Jahani, He, Ma, Mokhtari, Mudigere, Ribeiro and Takac,
"Efficient distributed Hessian free algorithm for large-scale empirical risk
minimization via accumulating sample strategy", AISTATS 2020).

Stage t works on the accumulated sample S_t (whole chunks, ``sampled.py``) of n
samples and the regularized empirical risk::

    R_n(w) = L_n(w) + (c V_n / 2) ||w||^2      V_n = n^(-accuracy_exponent), c = regularization

One iteration (one ``iterate``) is one damped Newton step on R_n::

    g       = grad R_n(w)                      one evaluation of S_t (one all-reduce)
    switch  if ||g|| <= sqrt(2 c) V_n           R_n(w) is within V_n of its minimum
            (stage rule; or after               (or the stage is capped):
            stage_iterations steps)             S_{t+1} = S_t plus fresh chunks up to
                                                growth * |S_t| (capped), warm-started at w;
                                                only the fresh chunks are evaluated
    v       ~ (grad^2 R_n(w))^(-1) g            conjugate gradient from 0, at most
                                                cg_iterations, until ||r|| <= cg_tolerance ||g||;
                                                each product H p = sum_i H_i p / n + c V_n p
                                                is one double backward per rank and
                                                one all-reduce
    delta   = sqrt(v' H v)                      the approximate Newton decrement (v'(g - r))
    w      <- w - v / (1 + delta)

CG stops at a direction of non-positive curvature (a non-convex model): the
iterate so far is used (or g itself when that is the first direction). A
safeguard the paper (convex losses) does not need: a step that does not lower
R_n on the stage's sample is halved, at most ``max_halvings`` times (one forward
pass of the sample each), after which the point stays; ``max_halvings = 0`` takes
the plain damped step.
Each process evaluates its share of every chunk, so the ranks add their sums and
take the same steps. Reported: the stage, its samples, its Newton and CG
iterations, and the data passes so far ((gradient + Hessian-vector samples) /
the data set's samples, when it is finite).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from towerrec.optim.sampled import (
    ChunkedOptimizer,
    Reducer,
    SampleSet,
    chunk_cap,
    flat_parameters,
    reduce_evaluation,
    set_flat_parameters,
)
from towerrec.utils import above, at_least, positive, within

__all__ = ["Dance", "DanceSettings", "conjugate_gradient"]


@dataclass(frozen=True)
class DanceSettings:
    """The settings of ``optimizer.dance`` (module doc)."""

    initial_chunks: int = 2  # |S_0| in chunks (global batches of train.batch_size)
    growth: float = 2.0  # |S_{t+1}| / |S_t|
    max_chunks: int = 512  # the most chunks a stage's sample grows to
    regularization: float = 1.0  # c
    accuracy_exponent: float = 0.5  # V_n = n^-s
    cg_iterations: int = 10
    cg_tolerance: float = 0.1
    max_halvings: int = 10  # safeguard: step halvings while R_n rises (0: the paper's plain step)
    stage_iterations: int = 10  # Newton steps after which a stage ends anyway (0: no cap)

    def __post_init__(self) -> None:
        key = "optimizer.dance"
        at_least(
            f"{key}.initial_chunks and cg_iterations", (self.initial_chunks, self.cg_iterations), 1
        )
        if self.max_chunks < self.initial_chunks:
            raise ValueError(
                f"optimizer.dance.max_chunks = {self.max_chunks} is below initial_chunks = "
                f"{self.initial_chunks}; raise max_chunks"
            )
        at_least(
            f"{key}.max_halvings and stage_iterations",
            (self.max_halvings, self.stage_iterations),
            0,
            hint="0: off",
        )
        above(f"{key}.growth", self.growth, 1, hint="e.g. 2")
        positive(
            f"{key}.regularization and accuracy_exponent",
            (self.regularization, self.accuracy_exponent),
        )
        within(f"{key}.cg_tolerance", self.cg_tolerance, "(0, 1)")


def conjugate_gradient(
    product: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    iterations: int,
    tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Approximately solve A v = rhs from v = 0 (module doc); v, the residual rhs - A v,
    and the products taken."""
    v = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    rr = torch.dot(r, r)
    bound = tolerance * float(rr.sqrt())
    for i in range(1, iterations + 1):
        ap = product(p)
        curvature = torch.dot(p, ap)
        if curvature <= 0:  # non-convex: stop at the iterate so far (or the gradient)
            return (v, r, i) if i > 1 else (rhs.clone(), torch.zeros_like(rhs), i)
        step = rr / curvature
        v.add_(p, alpha=float(step))
        r.sub_(ap, alpha=float(step))
        rr_next = torch.dot(r, r)
        if float(rr_next.sqrt()) <= bound:
            return v, r, i
        p.mul_(rr_next / rr).add_(r)
        rr = rr_next
    return v, r, iterations


_SCALARS = ("stage", "newton_in_stage", "cg_in_stage")


class Dance(ChunkedOptimizer):
    """DANCE (module doc) over ``params``; ``reducer`` sums over the ranks of a
    data-parallel group: once per evaluation and once per CG iteration."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1.0,
        settings: DanceSettings | None = None,
        reducer: Reducer | None = None,
    ) -> None:
        counters = ("grad_samples", "hvp_samples", "loss_samples", "fresh_samples")
        super().__init__(params, lr, reducer, counters)
        self.settings = settings or DanceSettings()
        self.stage = 0
        self.newton_in_stage = 0
        self.cg_in_stage = 0
        self.stages: list[dict[str, float]] = []  # one record per finished stage
        # The state up front (checkpoint loaders fill existing entries): the stage, its
        # sample (consecutive chunk ids) and counters as floats. CG starts from 0 at
        # every iteration, so nothing of it outlives one. state_dict() writes them and
        # load_state_dict() reads them back, so a resume continues exactly (the finished
        # stages' records in ``stages`` are not kept).
        self._keep_state("dance_", _SCALARS)

    def _own_scalars(self) -> dict[str, float]:
        return {
            "stage": self.stage,
            "newton_in_stage": self.newton_in_stage,
            "cg_in_stage": self.cg_in_stage,
        }

    def _restore(self, values: dict[str, float]) -> None:
        self.stage, self.newton_in_stage = int(values["stage"]), int(values["newton_in_stage"])
        self.cg_in_stage = int(values["cg_in_stage"])

    def _evaluate(self, samples: SampleSet, chunks: list[int]) -> tuple[torch.Tensor, ...]:
        ev = reduce_evaluation(self.reducer, samples.evaluate(chunks, grad=True))
        assert ev.grads is not None
        n = ev.counts.sum()
        self.counters["grad_samples"] += float(n)
        return ev.losses.sum(), ev.grads.sum(0), n

    def iterate(self, samples: SampleSet) -> dict[str, float]:
        """One damped Newton step (module doc); its report for metrics.jsonl."""
        s = self.settings
        switched = False
        first = not self._chunks
        if first:
            self._chunks = samples.draw(min(s.initial_chunks, chunk_cap(samples, s.max_chunks)))
            self._next_chunk = self._chunks[-1] + 1
        loss_sum, grad_sum, n = self._evaluate(samples, self._chunks)
        if first:
            self.counters["fresh_samples"] += float(n)
        w = flat_parameters(self.params)
        lam, grad = self._regularized(w, grad_sum, n)
        accuracy = float(n) ** -s.accuracy_exponent
        cap = chunk_cap(samples, s.max_chunks)
        solved = float(grad.norm()) <= math.sqrt(2 * s.regularization) * accuracy
        capped = bool(s.stage_iterations) and self.newton_in_stage >= s.stage_iterations
        if (solved or capped) and len(self._chunks) < cap:
            self._finish_stage(n)
            fresh = samples.draw(
                min(cap, math.ceil(len(self._chunks) * s.growth)) - len(self._chunks)
            )
            self._next_chunk = fresh[-1] + 1 if fresh else self._next_chunk
            more_loss, more_grad, more_n = self._evaluate(samples, fresh)
            self.counters["fresh_samples"] += float(more_n)
            self._chunks += fresh
            loss_sum, grad_sum, n = loss_sum + more_loss, grad_sum + more_grad, n + more_n
            lam, grad = self._regularized(w, grad_sum, n)
            switched = True
        local = samples.hessian(self._chunks)

        def product(v: torch.Tensor) -> torch.Tensor:
            self.counters["hvp_samples"] += float(n)
            return self.reducer.all_reduce_sum(local(v)) / n + lam * v

        v, residual, cg = conjugate_gradient(product, grad, s.cg_iterations, s.cg_tolerance)
        decrement = math.sqrt(max(float(torch.dot(v, grad - residual)), 0.0))
        loss = float(loss_sum / n) + 0.5 * lam * float(torch.dot(w, w))
        halvings = self._safeguard(samples, w, v / (1 + decrement), loss, lam)
        self.newton_in_stage += 1
        self._count_iteration()
        self.cg_in_stage += cg
        return {
            "loss": loss,
            "stage": self.stage,
            "stage_samples": float(n),
            "stage_switched": float(switched),
            "newton_in_stage": self.newton_in_stage,
            "cg_in_stage": self.cg_in_stage,
            "cg_iterations": cg,
            "gradient_norm": float(grad.norm()),
            "newton_decrement": decrement,
            "step_halvings": halvings,
            **self.counters,
        }

    def _safeguard(
        self, samples: SampleSet, w: torch.Tensor, step: torch.Tensor, loss: float, lam: float
    ) -> int:
        """Take ``w - step``, halved while R_n does not decrease on the stage's sample
        (a non-convex model's indefinite Hessian; never on a convex one near its
        minimum); after ``max_halvings`` the point stays. The halvings taken."""
        for halvings in range(self.settings.max_halvings + 1):
            trial = w - step
            set_flat_parameters(self.params, trial)
            if halvings == 0 and not self.settings.max_halvings:
                return 0
            ev = reduce_evaluation(self.reducer, samples.evaluate(self._chunks, grad=False))
            self.counters["loss_samples"] += float(ev.counts.sum())
            value = float(ev.losses.sum() / ev.counts.sum()) + 0.5 * lam * float(
                torch.dot(trial, trial)
            )
            if value <= loss:
                return halvings
            step = step / 2
        set_flat_parameters(self.params, w)
        return self.settings.max_halvings + 1

    def _regularized(
        self, w: torch.Tensor, grad_sum: torch.Tensor, n: torch.Tensor
    ) -> tuple[float, torch.Tensor]:
        lam = self.settings.regularization * float(n) ** -self.settings.accuracy_exponent
        return lam, grad_sum / n + lam * w

    def _finish_stage(self, n: torch.Tensor) -> None:
        self.stages.append(
            {
                "stage": self.stage,
                "samples": float(n),
                "newton_iterations": self.newton_in_stage,
                "cg_iterations": self.cg_in_stage,
                **self.counters,
            }
        )
        self.stage += 1
        self.newton_in_stage = self.cg_in_stage = 0
