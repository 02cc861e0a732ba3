"""Progressive-batching L-BFGS for the dense parameters (Bollapragada, Mudigere,
Nocedal, Shi and Tang, ICML 2018): L-BFGS on a sample S_k that grows when the
gradient it gives is too noisy, with a stochastic Armijo line search and
curvature pairs taken on the overlap of consecutive samples.

Samples are whole chunks (``sampled.py``; in training one chunk is one global batch
of ``train.batch_size``). One iteration k, with g_c the gradient sum of chunk c and
b_c its samples, n = sum b_c, g = sum g_c / n the sample gradient, m_c = g_c / b_c::

    evaluate loss and g_c at w_k on every chunk of S_k  (one all-reduce)
    pair    s = w_k - w_{k-1},  y = g_O(w_k) - g_O(w_{k-1})   O: the overlap of S_{k-1}, S_k
            kept when s'y > curvature_epsilon * s's, else skipped; at most ``history`` kept
    tests   per-sample variances estimated from the chunks (Var_i ~ b_c Var of m_c);
            with N the data set's samples (infinite for a stream), f = 1/n - 1/N:
              inner product   Var_i(g_i'g) f                         <= theta^2 ||g||^4
              orthogonality   Var_i(|g_i - (g_i'g/||g||^2) g|^2) f   <= nu^2 ||g||^2
            a failed test sets |S_{k+1}| to the size that passes it (never smaller than
            |S_k|; capped by max_chunks and the data set)
    p       = -H_k g                   two-loop recursion, H_0 = (s'y / y'y) I
                                       (not a descent direction: history cleared, p = -g)
    alpha   = factor / (1 + Var_i(g_i) f / ||g||^2)        the initial step
            halved (``backtrack``) until F_S(w + alpha p) <= F_S(w) + c1 alpha g'p on S_k
    w_{k+1} = w_k + alpha p
    S_{k+1} = the last ``overlap`` share of S_k's chunks, plus fresh chunks up to the size

``factor`` is the learning-rate schedule's (optimizer.lr's warm-up and decay; 1 with
``decay = "none"`` and no warm-up). A line search that fails ``max_backtracks`` times
is retried once along -g with an empty history; a second failure raises
``LineSearchError``. The overlap's gradient at w_k is already part of S_k's
evaluation and at w_{k+1} part of S_{k+1}'s, so the pairs cost no extra gradients,
unless drawing fresh chunks moves other parameters (in training: the embedding
rows); then the overlap's gradient at w_k is taken again at the current rows (|O|
more gradient samples), so that y sees the dense step only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from towerrec.optim.sampled import (
    ChunkedOptimizer,
    ChunkEvaluation,
    Reducer,
    SampleSet,
    chunk_cap,
    flat_parameters,
    reduce_evaluation,
    set_flat_parameters,
)
from towerrec.utils import at_least, positive, within

__all__ = ["LineSearchError", "PBLBFGSSettings", "ProgressiveBatchLBFGS", "two_loop"]


class LineSearchError(RuntimeError):
    """The backtracking line search found no step that decreases the sampled loss."""


@dataclass(frozen=True)
class PBLBFGSSettings:
    """The settings of ``optimizer.pb_lbfgs`` (module doc)."""

    initial_chunks: int = 4  # |S_0| in chunks (global batches of train.batch_size)
    max_chunks: int = 512  # the most chunks a sample grows to
    history: int = 10  # curvature pairs kept
    theta: float = 0.5  # inner product test
    nu: float = 5.84  # orthogonality test
    overlap: float = 0.25  # share of S_k's chunks carried into S_{k+1}
    armijo_c1: float = 1e-4
    backtrack: float = 0.5
    max_backtracks: int = 20
    curvature_epsilon: float = 1e-8

    def __post_init__(self) -> None:
        key = "optimizer.pb_lbfgs"
        at_least(
            f"{key}.initial_chunks",
            self.initial_chunks,
            2,
            hint="the sample tests estimate variances across chunks",
        )
        if self.max_chunks < self.initial_chunks:
            raise ValueError(
                f"optimizer.pb_lbfgs.max_chunks = {self.max_chunks} is below initial_chunks = "
                f"{self.initial_chunks}; raise max_chunks"
            )
        at_least(f"{key}.history and max_backtracks", (self.history, self.max_backtracks), 1)
        for name in ("theta", "nu", "curvature_epsilon"):
            positive(f"{key}.{name}", getattr(self, name))
        for name in ("overlap", "armijo_c1", "backtrack"):
            within(f"{key}.{name}", getattr(self, name), "(0, 1)")


def two_loop(
    grad: torch.Tensor, s_list: Sequence[torch.Tensor], y_list: Sequence[torch.Tensor]
) -> torch.Tensor:
    """H g for the L-BFGS inverse-Hessian approximation of the pairs (oldest first),
    H_0 = (s'y / y'y) I of the newest pair (I without pairs). [P] -> [P]."""
    q = grad.clone()
    alphas = []
    for s, y in zip(reversed(s_list), reversed(y_list)):
        a = torch.dot(s, q) / torch.dot(y, s)
        q.sub_(y, alpha=float(a))
        alphas.append(a)
    if s_list:
        q.mul_(torch.dot(s_list[-1], y_list[-1]) / torch.dot(y_list[-1], y_list[-1]))
    for (s, y), a in zip(zip(s_list, y_list), reversed(alphas)):
        b = torch.dot(y, q) / torch.dot(y, s)
        q.add_(s, alpha=float(a - b))
    return q


@dataclass
class _Statistics:
    """Per-sample variance estimates of one evaluation (module doc)."""

    inner_product: float
    orthogonality: float
    gradient: float  # trace of the gradient covariance


def sample_statistics(ev: ChunkEvaluation, grad: torch.Tensor) -> _Statistics:
    """Per-sample variances from the chunk means of ``ev`` (needs 2 chunks or more)."""
    assert ev.grads is not None and ev.counts.numel() >= 2
    b = ev.counts.to(grad.dtype)
    means = ev.grads / b[:, None]  # [C, P]
    norm2 = torch.dot(grad, grad)
    dots = means @ grad  # [C]
    residual = means - (dots / norm2)[:, None] * grad  # [C, P]
    c = b.numel()
    return _Statistics(
        inner_product=float((b * (dots - norm2) ** 2).sum() / (c - 1)),
        orthogonality=float((b * residual.pow(2).sum(1)).sum() / (c - 1)),
        gradient=float((b * (means - grad).pow(2).sum(1)).sum() / (c - 1)),
    )


_SCALARS = ("iteration", "size", "overlap", "pairs", "has_previous")


class ProgressiveBatchLBFGS(ChunkedOptimizer):
    """Progressive-batching L-BFGS (module doc) over ``params``. ``reducer`` sums each
    evaluation over the ranks of a data-parallel group."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1.0,
        settings: PBLBFGSSettings | None = None,
        reducer: Reducer | None = None,
    ) -> None:
        positive("pb_lbfgs's lr", lr)
        counters = ("grad_samples", "loss_samples", "fresh_samples", "pairs_skipped")
        super().__init__(params, lr, reducer, counters)
        self.base_lr = lr
        self.settings = settings or PBLBFGSSettings()
        self._s: list[torch.Tensor] = []
        self._y: list[torch.Tensor] = []
        self._overlap: int = 0  # the first chunks of S_k (``_chunks``) carried over from S_{k-1}
        self._size = self.settings.initial_chunks  # |S_k| in chunks
        self._prev: tuple[torch.Tensor, torch.Tensor] | None = None  # w_{k-1}, g_O(w_{k-1})
        self.iteration = 0
        # The whole state up front (checkpoint loaders fill existing entries): per
        # parameter its pieces of the pairs and of w_{k-1}, g_O(w_{k-1}); the numbers
        # (sample, counters) as floats. state_dict() writes the history into them and
        # load_state_dict() reads it back, so a resume continues exactly.
        h = self.settings.history
        for p in self.params:
            state = self.state[p]
            state["history_s"] = p.new_zeros(h, p.numel())
            state["history_y"] = p.new_zeros(h, p.numel())
            state["previous_w"] = p.new_zeros(p.numel())
            state["previous_g"] = p.new_zeros(p.numel())
        self._keep_state("pb_lbfgs_", _SCALARS)

    def _own_scalars(self) -> dict[str, float]:
        return {
            "iteration": self.iteration,
            "size": self._size,
            "overlap": self._overlap,
            "pairs": len(self._s),
            "has_previous": self._prev is not None,
        }

    def _save(self) -> None:
        super()._save()
        for k, (s_k, y_k) in enumerate(zip(self._s, self._y)):
            self._scatter(s_k, "history_s", k)
            self._scatter(y_k, "history_y", k)
        if self._prev is not None:
            self._scatter(self._prev[0], "previous_w")
            self._scatter(self._prev[1], "previous_g")

    def _restore(self, values: dict[str, float]) -> None:
        self.iteration, self._size = int(values["iteration"]), int(values["size"])
        self._overlap = int(values["overlap"])
        pairs = int(values["pairs"])
        self._s = [self._gather("history_s", k) for k in range(pairs)]
        self._y = [self._gather("history_y", k) for k in range(pairs)]
        self._prev = None
        if values["has_previous"]:
            self._prev = (self._gather("previous_w"), self._gather("previous_g"))

    def _scatter(self, flat: torch.Tensor, key: str, row: int | None = None) -> None:
        """Write the [P] vector ``flat`` into the parameters' state entries ``key``."""
        offset = 0
        for p in self.params:
            target = self.state[p][key]
            (target[row] if row is not None else target).copy_(flat[offset : offset + p.numel()])
            offset += p.numel()

    def _gather(self, key: str, row: int | None = None) -> torch.Tensor:
        """The [P] vector kept in the parameters' state entries ``key``."""
        parts = [self.state[p][key] for p in self.params]
        return torch.cat([part[row] if row is not None else part for part in parts]).clone()

    def _evaluate(self, samples: SampleSet, chunks: Sequence[int], grad: bool) -> ChunkEvaluation:
        ev = reduce_evaluation(self.reducer, samples.evaluate(chunks, grad))
        key = "grad_samples" if grad else "loss_samples"
        self.counters[key] += float(ev.counts.sum())
        loss = float(ev.losses.sum() / ev.counts.sum())
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"pb_lbfgs: the sampled loss is {loss} at iteration {self.iteration}; check the "
                "data for non-finite features and lower optimizer.lr"
            )
        return ev

    def iterate(self, samples: SampleSet) -> dict[str, float]:
        """One iteration (module doc); its report for metrics.jsonl."""
        s = self.settings
        self.iteration += 1
        self._count_iteration()
        fresh = samples.draw(self._size - len(self._chunks))
        self._next_chunk = fresh[-1] + 1 if fresh else self._next_chunk
        chunks = self._chunks + fresh
        ev = self._evaluate(samples, chunks, grad=True)
        assert ev.grads is not None
        n = ev.counts.sum()
        grad = ev.grads.sum(0) / n
        loss = float(ev.losses.sum() / n)
        self.counters["fresh_samples"] += float(ev.counts[len(self._chunks) :].sum())
        w = flat_parameters(self.params)
        skipped = self._update_pairs(samples, chunks, w, ev)
        self.counters["pairs_skipped"] += float(skipped)
        stats = sample_statistics(ev, grad)
        norm2 = float(torch.dot(grad, grad))
        if norm2 == 0:
            return self._report(loss, n, 0.0, 0, skipped)
        per_chunk = float(n) / len(chunks)
        population = samples.total_chunks * per_chunk if samples.total_chunks else math.inf
        # ||grad F||^2 without the sample's noise: E||g||^2 = ||grad F||^2 + Var_i(g_i) f
        f = 1 / float(n) - 1 / population
        true2 = max(norm2 - stats.gradient * f, 1e-12 * norm2)
        # Sizes that pass the tests: V (1/n - 1/N) <= bound, N the data set's samples.
        needed = max(
            1 / (s.theta**2 * true2**2 / max(stats.inner_product, 1e-300) + 1 / population),
            1 / (s.nu**2 * true2 / max(stats.orthogonality, 1e-300) + 1 / population),
        )
        self._size = min(
            max(self._size, math.ceil(needed / per_chunk)), chunk_cap(samples, s.max_chunks)
        )

        direction = -two_loop(grad, self._s, self._y)
        if float(torch.dot(grad, direction)) >= 0:
            self._forget()
            direction = -grad
        factor = self.param_groups[0]["lr"] / self.base_lr
        alpha = factor / (1 + stats.gradient * f / norm2)
        reference = loss
        try:
            alpha, tries = self._line_search(samples, chunks, w, direction, grad, reference, alpha)
        except LineSearchError:
            if not self._s:
                raise
            self._forget()  # retry once along -g
            alpha, tries = self._line_search(samples, chunks, w, -grad, grad, reference, alpha)
            tries += s.max_backtracks

        keep = max(1, round(s.overlap * len(chunks)))
        overlap = chunks[-keep:]
        counts = ev.counts[-keep:].sum()
        self._prev = (w, ev.grads[-keep:].sum(0) / counts)
        samples.release(chunks[:-keep])
        self._chunks, self._overlap = overlap, keep
        return self._report(loss, n, alpha, tries, skipped)

    def _forget(self) -> None:
        self._s.clear()
        self._y.clear()

    def _update_pairs(
        self, samples: SampleSet, chunks: Sequence[int], w: torch.Tensor, ev: ChunkEvaluation
    ) -> bool:
        """Add the curvature pair of the last step (module doc); whether it was skipped.
        When the samples moved other parameters (embedding rows) since the overlap's
        gradient at w_{k-1} was taken, it is taken again, so y sees the dense step only."""
        if self._prev is None:
            return False
        assert ev.grads is not None
        w_prev, g_prev = self._prev
        k = self._overlap
        if samples.moves_other_parameters:
            set_flat_parameters(self.params, w_prev)
            again = self._evaluate(samples, chunks[:k], grad=True)
            set_flat_parameters(self.params, w)
            assert again.grads is not None
            g_prev = again.grads.sum(0) / again.counts.sum()
        y = ev.grads[:k].sum(0) / ev.counts[:k].sum() - g_prev
        step = w - w_prev
        if float(torch.dot(step, y)) <= self.settings.curvature_epsilon * float(
            torch.dot(step, step)
        ):
            return True
        self._s.append(step)
        self._y.append(y)
        if len(self._s) > self.settings.history:
            del self._s[0], self._y[0]
        return False

    def _loss(self, samples: SampleSet, chunks: Sequence[int]) -> float:
        ev = self._evaluate(samples, chunks, grad=False)
        return float(ev.losses.sum() / ev.counts.sum())

    def _line_search(
        self,
        samples: SampleSet,
        chunks: Sequence[int],
        w: torch.Tensor,
        direction: torch.Tensor,
        grad: torch.Tensor,
        reference: float,
        alpha: float,
    ) -> tuple[float, int]:
        """The accepted step (parameters left at w + alpha p) and the trials it took."""
        s = self.settings
        slope = float(torch.dot(grad, direction))
        for trial in range(1, s.max_backtracks + 1):
            set_flat_parameters(self.params, w + alpha * direction)
            if self._loss(samples, chunks) <= reference + s.armijo_c1 * alpha * slope:
                return alpha, trial
            alpha *= s.backtrack
        set_flat_parameters(self.params, w)
        raise LineSearchError(
            f"pb_lbfgs: the line search found no decrease of the sampled loss after "
            f"{s.max_backtracks} trials (iteration {self.iteration}, {len(chunks)} chunks, "
            f"last step {alpha / s.backtrack:.3g}, loss {reference:.6g}). The loss is likely "
            "noisy at this sample size (dropout, batch norm) or not smooth; set model.dropout "
            "= 0, raise optimizer.pb_lbfgs.initial_chunks or max_backtracks"
        )

    def _report(
        self, loss: float, n: torch.Tensor, alpha: float, tries: int, skipped: bool
    ) -> dict[str, float]:
        return {
            "loss": loss,
            "batch_size": float(n),
            "step_length": alpha,
            "line_search_trials": tries,
            "pair_skipped": float(skipped),
            "pairs": len(self._s),
            "next_chunks": self._size,
            **self.counters,
        }
