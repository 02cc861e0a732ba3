"""``towerrec bench train --profile N``: where a towerrec row's training step goes, from
``torch.profiler`` over N steps, in milliseconds per step by phase::

    embedding_fwd     the collection's lookup (``forward_start`` and its wait)
    bottom_mlp_fwd    the bottom MLP           top_mlp_fwd   the top MLP
    interaction_fwd   the pairwise dots        forward_other stacking, concatenation
    loss              BCE on the logits        zero_grad     the dense gradients dropped
    embedding_bwd     the lookup's backward with the fused row-wise Adagrad update
    mlp_bwd           the linear layers' and ReLUs' backward (matmuls, bias sums)
    interaction_bwd   the dots' backward (one bmm, or the fused CPU call)
    copies_bwd        backward of concatenation, stacking, padding, casts
    loss_bwd          BCE's backward           grad_accumulate  gradients stored
    backward_other    the autograd engine around them
    optimizer         the dense optimizer's step (fused Adam)

The step is ``train_step``'s, written out with a ``record_function`` label per phase;
the forward's parts are labelled by hooks on the model's modules (and a wrapper of the
collection's ``forward_start``, removed afterwards); the backward is split by the
autograd node each op runs under. Times are spans on the calling thread (an op using
several intra-op threads counts once), so the phases add up to the step's wall time
plus the profiler's own cost. ``top_ops``: the operators with the most self time.
The benchmark's batches are made before the timing: data loading is not in this table.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from towerrec.data.batch import Batch
from towerrec.models.dlrm import DLRM
from towerrec.modules.interfaces import PooledHandle
from towerrec.sparse import KeyedJaggedTensor, KeyedTensor
from towerrec.train.loss import BCE
from towerrec.train.step import autocast

__all__ = ["BACKWARD_PHASES", "backward_phase", "phase_table", "profile_step"]

PHASE, PART = "phase::", "part::"
EVALUATE = "autograd::engine::evaluate_function: "
# autograd node name fragments -> backward phase, first match wins
BACKWARD_PHASES: tuple[tuple[str, str], ...] = (
    ("Lookup", "embedding_bwd"),
    ("SplitLookupFunction", "embedding_bwd"),
    ("Embedding", "embedding_bwd"),
    ("PairwiseDots", "interaction_bwd"),
    ("Addmm", "mlp_bwd"),
    ("Mm", "mlp_bwd"),
    ("Relu", "mlp_bwd"),
    ("Threshold", "mlp_bwd"),
    ("TBackward", "mlp_bwd"),
    ("Linear", "mlp_bwd"),
    ("BinaryCrossEntropy", "loss_bwd"),
    ("AccumulateGrad", "grad_accumulate"),
    ("Cat", "copies_bwd"),
    ("Stack", "copies_bwd"),
    ("Pad", "copies_bwd"),
    ("ToCopy", "copies_bwd"),
    ("Squeeze", "copies_bwd"),
    ("Unsqueeze", "copies_bwd"),
    ("Slice", "copies_bwd"),
    ("View", "copies_bwd"),
    ("Split", "copies_bwd"),
)
FORWARD_PARTS = {"bottom": "bottom_mlp_fwd", "interaction": "interaction_fwd", "top": "top_mlp_fwd"}


def backward_phase(node: str) -> str:
    """The phase of autograd node ``node`` (``BACKWARD_PHASES``; else ``backward_other``)."""
    return next((phase for part, phase in BACKWARD_PHASES if part in node), "backward_other")


class _LabelledHandle:
    """A lookup's handle whose ``wait`` counts as the embedding forward."""

    def __init__(self, handle: PooledHandle) -> None:
        self.handle = handle

    def wait(self) -> KeyedTensor:
        with record_function(PART + "embedding_fwd"):
            return self.handle.wait()


@contextlib.contextmanager
def _labelled_parts(model: DLRM) -> Iterator[None]:
    """Labels for the forward's parts while profiling (module doc)."""
    handles, open_ranges = [], {}
    parts = {"bottom": model.bottom, "interaction": model.interaction, "top": model.top}
    for attr, label in FORWARD_PARTS.items():
        module = parts[attr]
        if module is None:  # a DLRM without dense features has no bottom
            continue

        def enter(_m: nn.Module, _args: Any, label: str = label) -> None:
            open_ranges[label] = record_function(PART + label).__enter__()

        def leave(_m: nn.Module, _args: Any, _out: Any, label: str = label) -> None:
            open_ranges.pop(label).__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    sparse = model.sparse
    start = sparse.forward_start

    def labelled_start(features: KeyedJaggedTensor) -> PooledHandle:
        with record_function(PART + "embedding_fwd"):
            return _LabelledHandle(start(features))

    sparse.forward_start = labelled_start  # type: ignore[method-assign]  # while profiling
    try:
        yield
    finally:
        del sparse.forward_start
        for h in handles:
            h.remove()


def _step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, dtype: torch.dtype | None
) -> None:
    """``train_step`` (train/step.py) with a label per phase."""
    with record_function(PHASE + "forward"), autocast(batch.dense.device, dtype):
        logits, extra = BCE.forward(model, batch)
    with record_function(PHASE + "loss"):
        loss = BCE.loss(logits, extra, batch.labels)
    with record_function(PHASE + "zero_grad"):
        optimizer.zero_grad(set_to_none=True)
    with record_function(PHASE + "backward"):
        loss.backward()
    with record_function(PHASE + "optimizer"):
        optimizer.step()


def _nodes(event: Any) -> Iterator[Any]:
    """The outermost autograd node evaluations under ``event``."""
    for child in event.cpu_children:
        if child.name.startswith(EVALUATE):
            yield child
        else:
            yield from _nodes(child)


def _parts(event: Any) -> Iterator[Any]:
    for child in event.cpu_children:
        if child.name.startswith(PART):
            yield child
        else:
            yield from _parts(child)


def phase_table(events: Any, steps: int) -> dict[str, float]:
    """Milliseconds per step of each phase (module doc) from a profile's ``events``."""
    us: dict[str, float] = defaultdict(float)
    for event in events:
        if not event.name.startswith(PHASE) or event.cpu_parent is not None:
            continue
        phase, total = event.name.removeprefix(PHASE), event.cpu_time_total
        inner: Callable[[Any], Iterator[Any]] | None = {"forward": _parts, "backward": _nodes}.get(
            phase
        )
        if inner is None:
            us[phase] += total
            continue
        covered = 0.0
        for child in inner(event):
            name = child.name
            label = name.removeprefix(PART) if phase == "forward" else None
            us[label or backward_phase(name.removeprefix(EVALUATE))] += child.cpu_time_total
            covered += child.cpu_time_total
        us[f"{phase}_other"] += total - covered
    return {k: round(v / steps / 1e3, 3) for k, v in sorted(us.items(), key=lambda kv: -kv[1])}


def profile_step(
    model: DLRM,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    steps: int,
    dtype: torch.dtype | None = None,
    top: int = 15,
) -> dict[str, Any]:
    """The phase table of ``steps`` training steps of ``model`` (after one untimed step),
    and the ``top`` operators by self time, in ms per step."""
    _step(model, optimizer, batches[0], dtype)
    with _labelled_parts(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            _step(model, optimizer, batches[i % len(batches)], dtype)
    events = prof.events()
    phases = phase_table(events, steps)
    ops = [
        e
        for e in prof.key_averages()
        if not e.key.startswith((PHASE, PART, EVALUATE, "Optimizer.", "autograd::"))
    ]
    ops.sort(key=lambda e: -e.self_cpu_time_total)
    return {
        "steps": steps,
        "phases_ms": phases,
        "step_ms": round(sum(phases.values()), 3),
        "top_ops_ms": {
            e.key: {
                "self_ms": round(e.self_cpu_time_total / steps / 1e3, 3),
                "calls": e.count // steps,
            }
            for e in ops[:top]
        },
    }
