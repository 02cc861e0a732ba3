"""Alternate growth and pruning of MLP hidden layers during training (``train.prune_grow``).

With ``P_i``, ``G_i`` the schedule's boundaries in steps (``prune_at[i]``,
``grow_at[i]`` times ``train.steps``, rounded, or as given with ``unit = "step"``)::

    steps 1 .. P_0           full width
    steps P_0+1 .. G_0       pruned: every hidden layer of the chosen MLPs keeps
                             round(keep x width) units (at least 1)
    steps G_0+1 .. P_1       full width again
    ...
    steps G_last+1 .. end    full width: the run ends full-size

Pruning, before step ``P_i + 1``: each hidden layer's units are ranked by
``||incoming|| x ||outgoing||`` (``modules/mlp_width.py``) on the weights after step
``P_i``; the best ``keep`` share stays. The Linear weights of the layer (rows) and
of its successor (columns), a batch norm's entries, and the dense optimizer's state
of these parameters (``optim/reshape.py``) are sliced: surviving units keep their
weights and state bit for bit, the step gets cheaper (fewer multiply-adds forward and
backward, fewer entries for the optimizer). DDP keeps replicas equal, so every rank
ranks the same weights and keeps the same units without communicating.

Growth, before step ``G_i + 1``: each pruned layer gets fresh units back up to full
width, after the survivors. Their outgoing weights are zero, so the model computes
the same function before and after growing (no jump in the loss); their incoming
weights are drawn like ``nn.Linear``'s own init, from a generator seeded by
(``train.seed``, i, MLP, layer), so every rank and a resumed run draw the same; their
optimizer state starts at zero. Construction and pruning alternate: a pruned phase
concentrates the function in its strongest units, the growth after it adds new
capacity that training then shapes from where the narrow model stands. The pruned
units' old weights are not brought back: they were frozen while the rest moved on,
and re-inserting them would change the function at once. A checkpoint therefore
holds only the live model, as any other.

Resume: a checkpoint saved in a pruned phase holds the narrowed tensors under their
usual names; ``restore_widths`` narrows the freshly built model to the widths of the
checkpoint's step before it is loaded (the loaded values replace the placeholder
units). After every change of shape the caller rebuilds DDP's gradient buckets
(``RunContext.rebuild_dense_replicas``). In a run, ``PruneGrowHook`` does both: it is
the loop's step hook (``towerrec.train.hooks``).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from towerrec.config import Config, PruneGrowConfig
from towerrec.modules.mlp import MLP
from towerrec.modules.mlp_width import (
    Narrowed,
    Widened,
    hidden_widths,
    keep_by_score,
    narrow_hidden,
    unit_scores,
    widen_hidden,
)
from towerrec.optim.reshape import check_reshapable, narrow_state, widen_state
from towerrec.train.hooks import StepHook
from towerrec.train.session import Session
from towerrec.utils import stable_seed

__all__ = ["PruneGrow", "PruneGrowHook", "phase_steps"]

log = logging.getLogger("towerrec")


def phase_steps(config: PruneGrowConfig, steps: int) -> list[tuple[int, int]]:
    """The pruned phases ``(P_i, G_i)`` in steps: steps ``P_i + 1 .. G_i`` train pruned."""
    if config.unit == "step":
        points = [
            int(p) for pair in zip(config.prune_at, config.grow_at, strict=True) for p in pair
        ]
    else:
        points = [
            round(p * steps)
            for pair in zip(config.prune_at, config.grow_at, strict=True)
            for p in pair
        ]
    if any(b <= a for a, b in itertools.pairwise(points)) or points[0] < 1:
        raise ValueError(
            f"train.prune_grow: at train.steps = {steps} the boundaries fall on steps {points}, "
            "which leave a phase without steps; space prune_at and grow_at further apart"
        )
    if points[-1] >= steps:
        raise ValueError(
            f"train.prune_grow: the last growth falls on step {points[-1]} of {steps}, so the "
            "run would end pruned; grow earlier or raise train.steps"
        )
    return list(zip(points[::2], points[1::2], strict=True))


@dataclass(frozen=True)
class _Layer:
    mlp: str
    index: int
    full: int
    kept: int


def _mlp_flops(mlp: MLP, widths: list[int]) -> int:
    """Forward FLOPs per sample of ``mlp`` with hidden widths ``widths``."""
    sizes = [mlp.in_features, *widths, mlp.out_features]
    return sum(2 * a * b for a, b in itertools.pairwise(sizes))


class PruneGrow:
    """The schedule of one run and the changes it makes (module doc)."""

    def __init__(self, config: Config, steps: int, model: nn.Module, optimizer) -> None:
        pg = config.train.prune_grow
        check_reshapable(optimizer)
        self.phases = phase_steps(pg, steps)
        self.seed = config.train.seed
        self.mlps: dict[str, MLP] = {}
        self.layers: list[_Layer] = []
        for name in pg.mlps:
            mlp = _find_mlp(model, name)
            widths = hidden_widths(mlp)
            if not widths:
                raise ValueError(
                    f"train.prune_grow.mlps names {name!r}, whose MLP has no hidden layer "
                    "(a single linear layer); give it hidden layers or leave it out"
                )
            self.mlps[name] = mlp
            self.layers += [
                _Layer(name, i, w, max(1, round(pg.keep * w))) for i, w in enumerate(widths)
            ]

    def pruned_at(self, step: int) -> bool:
        """Whether (1-based) ``step`` trains pruned; step 0 (nothing trained) is full."""
        return any(p < step <= g for p, g in self.phases)

    def _phase_index(self, step: int) -> int:
        return next(i for i, (p, g) in enumerate(self.phases) if p < step <= g)

    def _widths(self) -> list[int]:
        return [hidden_widths(self.mlps[x.mlp])[x.index] for x in self.layers]

    def _widths_at(self, step: int) -> list[int]:
        pruned = self.pruned_at(step)
        return [x.kept if pruned else x.full for x in self.layers]

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> bool:
        """Prune or grow as the schedule says for ``step``; True if shapes changed."""
        want = self._widths_at(step)
        if want == self._widths():
            return False
        if self.pruned_at(step):
            self._prune(optimizer, by_score=True)
        else:
            self._grow(optimizer, self._phase_index(step - 1))
        log.info(
            "step %d: %s the hidden layers of %s to %s",
            step,
            "pruned" if self.pruned_at(step) else "grew",
            " and ".join(self.mlps),
            ", ".join(f"{x.mlp}.{x.index}: {w}" for x, w in zip(self.layers, want, strict=True)),
        )
        return True

    def restore_widths(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """Give a full-size model the widths it had after ``step`` (before loading a
        checkpoint of that step into it): the first units stand in for the kept ones."""
        if self._widths_at(step) != self._widths():
            self._prune(optimizer, by_score=False)

    def _prune(self, optimizer: torch.optim.Optimizer, by_score: bool) -> None:
        # Every layer's units are chosen on the full weights, then all are narrowed.
        chosen = []
        for x in self.layers:
            mlp = self.mlps[x.mlp]
            index = (
                keep_by_score(unit_scores(mlp, x.index), x.kept)
                if by_score
                else torch.arange(x.kept)
            )
            chosen.append((mlp, x.index, index))
        for mlp, i, index in chosen:
            _apply(optimizer, narrow_hidden(mlp, i, index))

    def _grow(self, optimizer: torch.optim.Optimizer, phase: int) -> None:
        for x in self.layers:  # ascending per MLP: a grown layer's successor sees full fan-in
            generator = torch.Generator().manual_seed(
                stable_seed(self.seed, "prune_grow", phase, x.mlp, x.index)
            )
            _apply(optimizer, widen_hidden(self.mlps[x.mlp], x.index, x.full, generator))

    def mlp_flops_per_sample(self, pruned: bool) -> int:
        """Forward FLOPs per sample of the chosen MLPs, full or pruned."""
        total = 0
        for name, mlp in self.mlps.items():
            widths = [x.kept if pruned else x.full for x in self.layers if x.mlp == name]
            total += _mlp_flops(mlp, widths)
        return total

    def summary(self, steps_done: int, global_batch: int) -> dict[str, Any]:
        """MLP training FLOPs (forward + backward, 3x forward) of the steps done, against
        the same steps at full width."""
        pruned_steps = sum(max(0, min(g, steps_done) - p) for p, g in self.phases)
        full, narrow = self.mlp_flops_per_sample(False), self.mlp_flops_per_sample(True)
        done = 3 * global_batch * (pruned_steps * narrow + (steps_done - pruned_steps) * full)
        dense = 3 * global_batch * steps_done * full
        return {
            "mlps": list(self.mlps),
            "phases": [list(p) for p in self.phases],
            "pruned_steps": pruned_steps,
            "hidden_widths": {x.mlp + f".{x.index}": [x.full, x.kept] for x in self.layers},
            "mlp_train_flops": done,
            "dense_mlp_train_flops": dense,
            "mlp_train_flops_ratio": done / dense if dense else None,
        }


def _find_mlp(model: nn.Module, name: str) -> MLP:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, MLP):
        raise ValueError(
            f"train.prune_grow.mlps names {name!r}, but this {type(model).__name__} has no "
            f"{name} MLP (a model without dense features has no bottom MLP); name only the "
            "model's MLPs"
        )
    return module


def _apply(optimizer: torch.optim.Optimizer, changes: list[Narrowed | Widened]) -> None:
    for change in changes:
        if isinstance(change, Narrowed):
            narrow_state(optimizer, change.param, change.dim, change.index, change.before)
        else:
            widen_state(optimizer, change.param, change.dim, change.added, change.before)


class PruneGrowHook(StepHook):
    """``train.prune_grow`` in a run: the schedule made once the session is built, the
    checkpoint step's widths before a resumed run loads it, pruning or growth before
    each step (DDP rebuilt after a change of shape), the FLOPs it saved in the summary."""

    session: Session
    schedule: PruneGrow

    def setup(self, session: Session) -> None:
        self.session = session
        self.schedule = PruneGrow(session.config, session.steps, session.model, session.optimizer)

    def on_restore(self, step: int) -> None:
        self.schedule.restore_widths(step, self.session.optimizer)

    def before_step(self, step: int) -> None:
        if self.schedule.before_step(step, self.session.optimizer):
            self.session.ctx.rebuild_dense_replicas(self.session.model)

    def on_summary(self, summary: dict[str, Any]) -> None:
        batch_size = self.session.config.train.batch_size
        summary["prune_grow"] = self.schedule.summary(summary["steps"], batch_size)
