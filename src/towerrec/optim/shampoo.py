"""Shampoo for the dense parameters: a block-diagonal, Kronecker-factored
AdaGrad-family preconditioner (Gupta, Koren and Singer, 2018), in the
distributed data-parallel form of Shi et al. (2023).

Each parameter is cut into blocks of at most ``max_preconditioner_dim`` along
every dimension (a [4096, 512] weight with 1024: four [1024, 512] blocks; a
bias of 3000: 1024, 1024 and 952). A block ``G`` of order k (1: a vector, 2: a
matrix) keeps one factor per dimension, fed by the raw gradient::

    L_i <- beta2 L_i + (1 - beta2) G_(i) G_(i)^T     G_(i): G unfolded along dim i
                                                     (beta2 = 1: a plain sum)
    every precondition_frequency steps from start_preconditioning_step:
        Q_i = (L_i + epsilon I)^(-1/(2k))            eigendecomposition, float64
    P = G' x_1 Q_1 ... x_k Q_k                        a matrix: P = Q_1 G' Q_2

``G'`` is the gradient, or with ``beta1 > 0`` its bias-corrected exponential
average. The step size comes from a diagonal method on the same block, the
*graft*, whose statistics also see the raw gradient::

    adagrad   A += G^2                              D = G' / (sqrt(A) + graft_epsilon)
    adam      V = b2 V + (1 - b2) G^2               D = G' / (sqrt(V / (1 - b2^t)) + graft_epsilon)
    sgd                                             D = G'
    update = D                      before start_preconditioning_step
           = P * ||D|| / ||P||      from it on (per block)
    w <- w - lr * update

``weight_decay``: with ``decoupled_weight_decay`` (the default, as the trainer's Adam
and AdamW) ``w <- (1 - lr wd) w`` before the step; without, L2: ``wd * w`` is added to
the gradient before all of it.

The graft's arithmetic is torch's, operation for operation (the first moment by
``lerp``, ``lr`` over its bias correction as one step size, ``addcdiv``): before
``start_preconditioning_step``, Adagrad grafting with ``beta1 = 0`` takes
``torch.optim.Adagrad``'s steps and Adam grafting with ``beta1 = 0.9``,
``graft_beta2 = 0.999`` takes ``torch.optim.Adam``'s (single-tensor and foreach)
bit for bit; torch's fused Adam kernel, the trainer's, rounds differently in the
last bit.

Distributed (``exchange``): the blocks of all parameters are dealt to the ranks,
each to the least loaded by its preconditioner cost (sum of n_i^3); a rank keeps
the statistics of its own blocks only and computes their updates; one
all-gather gives every rank every block's update, and every rank applies the
same updates to its replica. A block's arithmetic is the same on whichever rank
owns it, so given the same gradients a distributed run takes the single-process
steps bit for bit. The optimizer state of a rank holds its own blocks only.
Parameters named in ``local`` (replicated over fewer ranks than the exchange's
group, such as a tower's under the tower transform) are not dealt: every rank
computes all their blocks itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any, Protocol

import torch

from towerrec.utils import at_least, positive, within

__all__ = ["BlockExchange", "Shampoo", "ShampooSettings", "block_slices", "inverse_root"]

GRAFTS = ("adagrad", "adam", "sgd")


class BlockExchange(Protocol):
    """How the ranks of a data-parallel group hand each other their blocks' updates."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, local: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
        """Every rank's flat ``local`` (rank r's holds ``counts[r]`` elements), in rank order."""
        ...


@dataclass(frozen=True)
class ShampooSettings:
    """The settings of ``optimizer.shampoo`` (module doc)."""

    # Adam grafting with momentum 0.9: optimizer.lr means what it means for Adam (the
    # default dense optimizer), and before the start step the steps are Adam's. With
    # Adagrad grafting at Adam's lr the AUC was 0.05 lower (docs/benchmarks.md).
    beta1: float = 0.9
    beta2: float = 1.0
    epsilon: float = 1e-12
    max_preconditioner_dim: int = 1024
    precondition_frequency: int = 20
    start_preconditioning_step: int = 20
    grafting: str = "adam"
    graft_epsilon: float = 1e-8
    graft_beta2: float = 0.999
    decoupled_weight_decay: bool = True  # optimizer.weight_decay as AdamW's; false: L2

    def __post_init__(self) -> None:
        if self.grafting not in GRAFTS:
            raise ValueError(
                f"optimizer.shampoo.grafting must be one of {', '.join(GRAFTS)}, "
                f"got {self.grafting!r}"
            )
        key = "optimizer.shampoo"
        within(f"{key}.beta1", self.beta1, "[0, 1)")
        within(f"{key}.beta2", self.beta2, "(0, 1]", hint="1: sum the statistics")
        within(f"{key}.graft_beta2", self.graft_beta2, "(0, 1)")
        positive(
            f"{key}.epsilon and graft_epsilon",
            (self.epsilon, self.graft_epsilon),
            hint="e.g. 1e-12 and 1e-8",
        )
        for name in (
            "max_preconditioner_dim",
            "precondition_frequency",
            "start_preconditioning_step",
        ):
            at_least(f"{key}.{name}", getattr(self, name), 1)


def block_slices(shape: Sequence[int], max_dim: int) -> list[tuple[slice, ...]]:
    """The blocks of a tensor of ``shape``: chunks of at most ``max_dim`` along every dim,
    in row-major order of the chunk grid (a 0-d tensor is one block)."""
    per_dim = [[slice(a, min(a + max_dim, n)) for a in range(0, n, max_dim)] for n in shape]
    return [tuple(s) for s in product(*per_dim)]


def inverse_root(matrix: torch.Tensor, root: int, epsilon: float) -> torch.Tensor:
    """``(matrix + epsilon I)^(-1/root)`` of a symmetric positive semi-definite matrix,
    through its eigendecomposition in float64 (negative rounding-error eigenvalues are
    taken as 0)."""
    values, vectors = torch.linalg.eigh(matrix.double())
    scale = (values.clamp(min=0) + epsilon).pow(-1.0 / root)
    out: torch.Tensor = ((vectors * scale) @ vectors.T).to(matrix.dtype)
    return out


def _unfold(block: torch.Tensor, dim: int) -> torch.Tensor:
    return block.movedim(dim, 0).reshape(block.shape[dim], -1)


def _apply_along(block: torch.Tensor, dim: int, matrix: torch.Tensor) -> torch.Tensor:
    """``block`` multiplied by ``matrix`` along ``dim`` (the mode-``dim`` product)."""
    moved = block.movedim(dim, 0)
    out = (matrix @ moved.reshape(moved.shape[0], -1)).reshape(moved.shape)
    return out.movedim(0, dim)


def _cost(shape: Sequence[int]) -> int:
    return sum(n**3 for n in shape) or 1


class Shampoo(torch.optim.Optimizer):
    """Shampoo with grafting (module doc). ``exchange`` spreads the blocks over the
    ranks of a data-parallel group whose replicas see the same gradients."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        settings: ShampooSettings | None = None,
        weight_decay: float = 0.0,
        exchange: BlockExchange | None = None,
        local: Iterable[torch.Tensor] = (),
    ) -> None:
        positive("Shampoo's lr", lr)
        at_least("Shampoo's weight_decay", weight_decay, 0)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.settings = settings or ShampooSettings()
        self.exchange = exchange
        local_ids = {id(p) for p in local}
        self._blocks = {
            p: block_slices(p.shape, self.settings.max_preconditioner_dim)
            for group in self.param_groups
            for p in group["params"]
        }
        self._local = {i for i, p in enumerate(self._blocks) if id(p) in local_ids}
        self._owner = self._deal()
        for i, p in enumerate(self._blocks):
            self._init_state(i, p)

    def _init_state(self, i: int, p: torch.Tensor) -> None:
        """The whole state up front (checkpoint loaders fill existing entries in place):
        the step, and for each block this rank owns its factors, inverse roots (computed
        from ``start_preconditioning_step`` on), graft statistic and filtered gradient."""
        s = self.settings
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float64)
        for j, block in enumerate(self._blocks[p]):
            if not self._mine(i, j):
                continue
            dims = [b.stop - b.start for b in block] or [1]
            for d, n in enumerate(dims):
                state[f"b{j}.L{d}"] = p.new_zeros(n, n)
                state[f"b{j}.Q{d}"] = p.new_zeros(n, n)
            if s.grafting != "sgd":
                state[f"b{j}.graft"] = p.new_zeros(dims)
            if s.beta1:
                state[f"b{j}.m"] = p.new_zeros(dims)

    def _deal(self) -> dict[tuple[int, int], int]:
        """(parameter index, block index) -> the rank computing it."""
        world = self.exchange.world_size if self.exchange is not None else 1
        blocks = [
            (i, j, _cost([s.stop - s.start for s in block]))
            for i, p in enumerate(self._blocks)
            if i not in self._local
            for j, block in enumerate(self._blocks[p])
        ]
        load = [0] * world
        owner = {}
        for i, j, cost in sorted(blocks, key=lambda b: -b[2]):  # stable: ties in order
            rank = min(range(world), key=lambda r: (load[r], r))
            owner[(i, j)] = rank
            load[rank] += cost
        return owner

    def block_counts(self) -> tuple[int, int]:
        """(blocks this rank preconditions, blocks in all)."""
        total = sum(len(blocks) for blocks in self._blocks.values())
        mine = sum(
            self._mine(i, j)
            for i, p in enumerate(self._blocks)
            for j in range(len(self._blocks[p]))
        )
        return mine, total

    def _mine(self, param_index: int, block: int) -> bool:
        if param_index in self._local:
            return True
        rank = self.exchange.rank if self.exchange is not None else 0
        return self._owner[(param_index, block)] == rank

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch types closure loosely
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = {p: i for i, p in enumerate(self._blocks)}
        updates: dict[tuple[int, int], torch.Tensor] = {}
        lrs: dict[int, float] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                i = index[p]
                lrs[i] = group["lr"]
                state = self.state[p]
                state["step"] += 1
                t = int(state["step"])
                grad = p.grad
                if group["weight_decay"] and not self.settings.decoupled_weight_decay:
                    grad = grad.add(p, alpha=group["weight_decay"])
                grad = grad.reshape(p.shape if p.dim() else (1,))
                for j, block in enumerate(self._blocks[p]):
                    if self._mine(i, j):
                        g = grad[block] if p.dim() else grad
                        updates[(i, j)] = self._block_update(state, j, g, t, group["lr"])
        if self.exchange is not None:
            updates.update(self._gather(updates, lrs))
        for group in self.param_groups:
            for p in group["params"]:
                i = index[p]
                if i not in lrs:
                    continue
                if group["weight_decay"] and self.settings.decoupled_weight_decay:
                    p.mul_(1 - group["lr"] * group["weight_decay"])  # as AdamW, before the step
                view = p.view(p.shape if p.dim() else (1,))
                for j, block in enumerate(self._blocks[p]):
                    target = view[block] if p.dim() else view
                    target.add_(updates[(i, j)].view_as(target))
        return loss

    def _gather(
        self, own: dict[tuple[int, int], torch.Tensor], stepped: dict[int, float]
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Every stepped block's update, from the ranks that own them (module doc)."""
        assert self.exchange is not None
        keys = sorted(k for k in self._owner if k[0] in stepped)
        sizes = {
            (i, j): math.prod(s.stop - s.start for s in self._blocks[p][j])
            for i, p in enumerate(self._blocks)
            for j in range(len(self._blocks[p]))
        }
        counts = [0] * self.exchange.world_size
        for k in keys:
            counts[self._owner[k]] += sizes[k]
        mine = [own[k].reshape(-1) for k in keys if k in own]
        local = torch.cat(mine) if mine else torch.zeros(0)
        parts = self.exchange.all_gather(local, counts)
        offsets = [0] * self.exchange.world_size
        out = {}
        for k in keys:
            r = self._owner[k]
            out[k] = parts[r][offsets[r] : offsets[r] + sizes[k]]
            offsets[r] += sizes[k]
        return out

    def _block_update(
        self, state: dict[str, Any], j: int, g: torch.Tensor, t: int, lr: float
    ) -> torch.Tensor:
        """The step of block ``j`` (what is added to it): ``-lr * update`` (module doc).
        The graft's arithmetic is torch's Adagrad and single-tensor Adam, operation for
        operation, so that before ``start_preconditioning_step`` the steps are theirs bit
        for bit."""
        s = self.settings
        order = max(g.dim(), 1)
        dims = list(g.shape) or [1]
        g = g.reshape(dims)
        filtered = g
        step_size = lr  # lr over the first moment's bias correction
        if s.beta1:
            filtered = state[f"b{j}.m"].lerp_(g, 1 - s.beta1)
            step_size = lr / (1 - s.beta1**t)
        for d in range(order):
            unfolded = _unfold(g, d)
            factor = state[f"b{j}.L{d}"]
            if s.beta2 == 1:
                factor.add_(unfolded @ unfolded.T)
            else:
                factor.mul_(s.beta2).add_(unfolded @ unfolded.T, alpha=1 - s.beta2)
        if s.grafting == "adagrad":
            denom = state[f"b{j}.graft"].addcmul_(g, g).sqrt().add_(s.graft_epsilon)
            graft = torch.zeros_like(filtered).addcdiv_(filtered, denom, value=-step_size)
        elif s.grafting == "adam":
            acc = state[f"b{j}.graft"].mul_(s.graft_beta2).addcmul_(g, g, value=1 - s.graft_beta2)
            correction = (1 - s.graft_beta2**t) ** 0.5
            denom = (acc.sqrt() / correction).add_(s.graft_epsilon)
            graft = torch.zeros_like(filtered).addcdiv_(filtered, denom, value=-step_size)
        else:
            graft = filtered * -step_size
        if t < s.start_preconditioning_step:
            return graft
        if (t - s.start_preconditioning_step) % s.precondition_frequency == 0:
            for d in range(order):
                state[f"b{j}.Q{d}"] = inverse_root(state[f"b{j}.L{d}"], 2 * order, s.epsilon)
        direction = filtered  # its bias correction is a scale, which the graft's norm sets
        for d in range(order):
            direction = _apply_along(direction, d, state[f"b{j}.Q{d}"])
        norm = direction.norm()
        if norm == 0:
            return torch.zeros_like(direction)
        scaled: torch.Tensor = direction * -(graft.norm() / norm)  # the graft holds -lr
        return scaled
