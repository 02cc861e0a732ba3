"""``towerrec bench train --profile N``: where a towerrec row's training step goes, from
``torch.profiler`` over N steps, in milliseconds per step by phase::

    embedding_fwd     the collection's lookup (``forward_start`` and its wait)
    bottom_mlp_fwd    the bottom MLP           top_mlp_fwd   the top MLP
    interaction_fwd   the pairwise dots        forward_other stacking, concatenation
    loss              BCE on the logits        zero_grad     the dense gradients dropped
    embedding_bwd     the lookup's backward with the fused row-wise Adagrad update
    mlp_bwd           the linear layers' and ReLUs' backward (matmuls, bias sums)
    interaction_bwd   the dots' backward (one bmm, or the fused CPU call; on the CPU the
                      top MLP's input is built in one call, DotInteraction.joined)
    copies_bwd        backward of concatenation, stacking, padding, casts
    loss_bwd          BCE's backward           grad_accumulate  gradients stored
    backward_other    the autograd engine around them
    optimizer         the dense optimizer's step (fused Adam)

``wall_phases_ms`` times the same steps again without the profiler, by the wall clock
alone (``wall_phase_table``): the profiler's own cost lands on short calls unevenly (the
interaction's backward on the Criteo-Kaggle shape at two threads read 1.31-1.53 ms under
it and 0.91-0.96 ms by the wall clock, docs/benchmarks.md), so where the two tables
disagree the wall clock's is the step's. Its backward is split where the gradients
arrive: at the top MLP's input (``top_mlp_bwd``, the loss's backward with it), at the
interaction's input (``interaction_bwd``), at the bottom MLP's first weight
(``bottom_mlp_bwd``, with the concatenation's and stacking's backward), and the rest
(``embedding_bwd``: autograd runs the lookup's backward last, the lookup being the
forward's first node).

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
import time
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

__all__ = [
    "BACKWARD_PHASES",
    "WALL_PHASES",
    "backward_phase",
    "phase_table",
    "profile_step",
    "wall_phase_table",
]

PHASE, PART = "phase::", "part::"
EVALUATE = "autograd::engine::evaluate_function: "
# autograd node name fragments -> backward phase, first match wins
BACKWARD_PHASES: tuple[tuple[str, str], ...] = (
    ("Lookup", "embedding_bwd"),
    ("SplitLookupFunction", "embedding_bwd"),
    ("Embedding", "embedding_bwd"),
    ("PairwiseDots", "interaction_bwd"),
    ("Joined", "interaction_bwd"),
    ("LayerStack", "mlp_bwd"),
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


Start = Callable[[KeyedJaggedTensor], PooledHandle]


Joined = Callable[..., "torch.Tensor | None"]


@contextlib.contextmanager
def _instrumented(
    model: DLRM,
    start: Callable[[Start], Start],
    handles: list[Any],
    joined: Callable[[Joined], Joined],
) -> Iterator[None]:
    """``model.sparse.forward_start`` and ``model.interaction.joined`` (the top MLP's
    input in one call, which runs the interaction without calling its module) replaced
    by ``start`` and ``joined`` of the originals while the block runs; then restored,
    and the module hooks ``handles`` removed."""
    sparse, interaction = model.sparse, model.interaction
    sparse.forward_start = start(sparse.forward_start)  # type: ignore[method-assign,assignment]  # while measuring
    interaction.joined = joined(interaction.joined)  # type: ignore[method-assign]  # while measuring
    try:
        yield
    finally:
        del sparse.forward_start
        del interaction.joined
        for h in handles:
            h.remove()


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

    def labelled(start: Start) -> Start:
        def labelled_start(features: KeyedJaggedTensor) -> PooledHandle:
            with record_function(PART + "embedding_fwd"):
                return _LabelledHandle(start(features))

        return labelled_start

    def labelled_joined(joined: Joined) -> Joined:
        def labelled_call(*args: Any) -> torch.Tensor | None:
            with record_function(PART + "interaction_fwd"):
                return joined(*args)

        return labelled_call

    with _instrumented(model, labelled, handles, labelled_joined):
        yield


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


WALL_PHASES = (
    "embedding_fwd", "bottom_mlp_fwd", "interaction_fwd", "top_mlp_fwd", "forward_other",
    "loss", "zero_grad", "top_mlp_bwd", "interaction_bwd", "bottom_mlp_bwd", "embedding_bwd",
    "optimizer",
)  # fmt: skip


@contextlib.contextmanager
def _clocked_parts(model: DLRM, at: dict[str, float]) -> Iterator[None]:
    """Wall-clock marks of one step's parts into ``at`` (module doc): each forward part's
    start and end, the lookup's time, and when the backward's gradients arrive."""
    clock = time.perf_counter
    handles: list[Any] = []
    parts = {"bottom": model.bottom, "interaction": model.interaction, "top": model.top}
    arrivals = {"top": "grad_top", "interaction": "grad_interaction"}
    for name, module in parts.items():
        if module is None:  # a DLRM without dense features has no bottom
            continue

        def enter(_m: nn.Module, args: Any, name: str = name) -> None:
            at[name + "_start"] = clock()
            mark = arrivals.get(name)
            if mark is not None and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                args[0].register_hook(lambda _g, mark=mark: at.__setitem__(mark, clock()))

        def leave(_m: nn.Module, _args: Any, _out: Any, name: str = name) -> None:
            at[name + "_end"] = clock()

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    if model.bottom is not None:
        first = next(p for p in model.bottom.parameters() if p.requires_grad)
        handles.append(first.register_hook(lambda _g: at.__setitem__("grad_bottom", clock())))

    class _Clocked:
        def __init__(self, handle: PooledHandle) -> None:
            self.handle = handle

        def wait(self) -> KeyedTensor:
            t = clock()
            try:
                return self.handle.wait()
            finally:
                at["embedding"] = at.get("embedding", 0.0) + clock() - t

    def clocked(start: Start) -> Start:
        def clocked_start(features: KeyedJaggedTensor) -> PooledHandle:
            t = clock()
            try:
                return _Clocked(start(features))
            finally:
                at["embedding"] = at.get("embedding", 0.0) + clock() - t

        return clocked_start

    def clocked_joined(joined: Joined) -> Joined:
        def clocked_call(x: torch.Tensor, embeddings: torch.Tensor, *rest: Any) -> Any:
            at["interaction_start"] = clock()
            try:
                out = joined(x, embeddings, *rest)
            finally:
                at["interaction_end"] = clock()
            if out is not None and x.requires_grad:  # x's gradient: at the bottom MLP's node
                x.register_hook(lambda _g: at.__setitem__("grad_interaction", clock()))
            return out

        return clocked_call

    with _instrumented(model, clocked, handles, clocked_joined):
        yield


def _wall_step(
    model: DLRM,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    dtype: torch.dtype | None,
    at: dict[str, float],
) -> dict[str, float]:
    """``train_step`` with wall-clock marks: its phases in seconds (``WALL_PHASES``)."""
    clock = time.perf_counter
    at.clear()
    t0 = clock()
    with autocast(batch.dense.device, dtype):
        logits, extra = BCE.forward(model, batch)
    forward_end = clock()
    loss = BCE.loss(logits, extra, batch.labels)
    loss_end = clock()
    optimizer.zero_grad(set_to_none=True)
    zero_end = clock()
    loss.backward()
    backward_end = clock()
    optimizer.step()
    step_end = clock()
    span = {p: at.get(p + "_end", 0.0) - at.get(p + "_start", 0.0) for p in ("bottom", "top")}
    span["interaction"] = at.get("interaction_end", 0.0) - at.get("interaction_start", 0.0)
    marks = [zero_end]  # the backward's marks in the order autograd reaches them
    for mark in ("grad_top", "grad_interaction", "grad_bottom"):
        marks.append(at.get(mark, marks[-1]))
    marks.append(backward_end)
    forward = forward_end - t0
    embedding = at.get("embedding", 0.0)
    return {
        "embedding_fwd": embedding,
        "bottom_mlp_fwd": span["bottom"],
        "interaction_fwd": span["interaction"],
        "top_mlp_fwd": span["top"],
        "forward_other": forward - embedding - sum(span.values()),
        "loss": loss_end - forward_end,
        "zero_grad": zero_end - loss_end,
        "top_mlp_bwd": marks[1] - marks[0],
        "interaction_bwd": marks[2] - marks[1],
        "bottom_mlp_bwd": marks[3] - marks[2],
        "embedding_bwd": marks[4] - marks[3],
        "optimizer": step_end - backward_end,
    }


def wall_phase_table(
    model: DLRM,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    steps: int,
    dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Milliseconds per step of each ``WALL_PHASES`` phase over ``steps`` training steps
    timed by the wall clock, without the profiler (module doc); they add up to the steps'
    wall time."""
    at: dict[str, float] = {}
    total: dict[str, float] = dict.fromkeys(WALL_PHASES, 0.0)
    with _clocked_parts(model, at):
        for i in range(steps):
            for phase, seconds in _wall_step(
                model, optimizer, batches[i % len(batches)], dtype, at
            ).items():
                total[phase] += seconds
    return {phase: round(total[phase] / steps * 1e3, 3) for phase in WALL_PHASES}


def profile_step(
    model: DLRM,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    steps: int,
    dtype: torch.dtype | None = None,
    top: int = 15,
) -> dict[str, Any]:
    """The phase table of ``steps`` training steps of ``model`` (after one untimed step),
    the same steps' wall-clock phases without the profiler (``wall_phase_table``), and the
    ``top`` operators by self time, in ms per step."""
    _step(model, optimizer, batches[0], dtype)
    wall = wall_phase_table(model, optimizer, batches, steps, dtype)
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
        "wall_phases_ms": wall,
        "wall_step_ms": round(sum(wall.values()), 3),
        "top_ops_ms": {
            e.key: {
                "self_ms": round(e.self_cpu_time_total / steps / 1e3, 3),
                "calls": e.count // steps,
            }
            for e in ops[:top]
        },
    }
