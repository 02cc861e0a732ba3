"""What varies around the training loop, as Lightning's callbacks: ``StepHook``.

The loop (``loop.py``) calls every hook at the same points, in order::

    set_up        setup(session)             once built, before a resumed run's checkpoint
                  on_restore(step)           before a checkpoint of ``step`` is loaded
    fit           on_start(step)             before the first step (``step``: steps done)
                  before_step(step)          after the learning rates are set
                  after_step(step, loss, rows)
                  on_validation(step, metrics)   when the loop validated
                  on_step_end(step, stopping)    ``stopping``: the ranks agreed to stop
                  on_end(step)               after the last step
    finish        on_summary(summary)        add to the run's summary before it is written

Every method is a no-op here: a hook overrides the ones it needs. The engine's own
hooks are below: ``EarlyStop`` (the stopper and the best weights), ``TrainLog``
(records, progress bar, validation lines) and ``Checkpointing``; the workflows add
theirs (growth and pruning: ``towerrec.workflows.prune_grow``).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from towerrec.train.metrics import EvalMetrics

if TYPE_CHECKING:
    from towerrec.train.session import Session

__all__ = ["Checkpointing", "EarlyStop", "Hooks", "StepHook", "SummaryEntry", "TrainLog"]

log = logging.getLogger("towerrec")


class StepHook:
    """One hook of the loop (module doc); override what you need."""

    def setup(self, session: Session) -> None:
        """The session is built; a resumed run's checkpoint is not loaded yet."""

    def on_restore(self, step: int) -> None:
        """A checkpoint of ``step`` is about to be loaded into the model."""

    def on_start(self, step: int) -> None:
        """The loop starts after ``step`` steps done (0, or a resumed run's)."""

    def before_step(self, step: int) -> None:
        """Step ``step`` (1-based) is next; its learning rates are set."""

    def after_step(self, step: int, loss: torch.Tensor, rows: int) -> None:
        """Step ``step`` is done: its ``loss`` (detached) and this rank's ``rows``."""

    def on_validation(self, step: int, metrics: EvalMetrics) -> None:
        """The loop validated after step ``step``."""

    def on_step_end(self, step: int, stopping: bool) -> None:
        """The end of step ``step``; ``stopping``: the run stops after it (a request
        or early stopping, agreed by every rank)."""

    def on_end(self, step: int) -> None:
        """The loop ended after step ``step``."""

    def on_summary(self, summary: dict[str, Any]) -> None:
        """The run's summary, before it is written: add to it."""


class Hooks(list[StepHook]):
    """Hooks called in their order."""

    def setup(self, session: Session) -> None:
        for hook in self:
            hook.setup(session)

    def on_restore(self, step: int) -> None:
        for hook in self:
            hook.on_restore(step)

    def on_start(self, step: int) -> None:
        for hook in self:
            hook.on_start(step)

    def before_step(self, step: int) -> None:
        for hook in self:
            hook.before_step(step)

    def after_step(self, step: int, loss: torch.Tensor, rows: int) -> None:
        for hook in self:
            hook.after_step(step, loss, rows)

    def on_validation(self, step: int, metrics: EvalMetrics) -> None:
        for hook in self:
            hook.on_validation(step, metrics)

    def on_step_end(self, step: int, stopping: bool) -> None:
        for hook in self:
            hook.on_step_end(step, stopping)

    def on_end(self, step: int) -> None:
        for hook in self:
            hook.on_end(step)

    def on_summary(self, summary: dict[str, Any]) -> None:
        for hook in self:
            hook.on_summary(summary)


class EarlyStop(StepHook):
    """Each validation updates the session's stopper (``early_stopping.py``: the best
    step, the plateau LR scale, the stop) and saves an improving step's weights into
    ``best/`` when the run keeps the best."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def on_validation(self, step: int, metrics: EvalMetrics) -> None:
        stopper = self.session.stopper
        if stopper.update(step, metrics.as_dict()) and stopper.keeps_best:
            self.session.checkpoint(step, best=True)


class TrainLog(StepHook):
    """The run's records and progress: a ``train`` record (mean loss, learning-rate
    factor, samples/s, traffic) every ``train.log_every`` steps and at the last, the
    progress bar, a line per validation and a warning, once, when the model gives
    every validation example the same prediction."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.warned_constant = False

    def on_start(self, step: int) -> None:
        s = self.session
        self.loss_sum, self.loss_count = torch.zeros((), device=s.device), 0
        self.window_start, self.window_samples = time.perf_counter(), 0
        self.bar = tqdm(
            total=s.steps,
            initial=step,
            unit="step",
            disable=not s.config.train.progress or not s.ctx.is_main,
            dynamic_ncols=True,
            desc="train",
        )
        s.run.open_events(step)

    def after_step(self, step: int, loss: torch.Tensor, rows: int) -> None:
        s = self.session
        self.loss_sum += loss.to(self.loss_sum.device)
        self.loss_count += 1
        self.window_samples += rows * s.ctx.world_size
        self.bar.update(1)
        if step % s.config.train.log_every and step != s.steps:
            return
        now = time.perf_counter()
        record = {
            "kind": "train",
            "step": step,
            "loss": float(self.loss_sum) / self.loss_count,
            "lr_factor": s.lr_factor,
            "samples_per_s": self.window_samples / (now - self.window_start),
            "samples": s.state["samples"],
            **s.ctx.comm_per_sample(s.state["samples"]),
        }
        s.run.log(record)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", sps=f"{record['samples_per_s']:,.0f}")
        self.loss_sum.zero_()
        self.loss_count, self.window_start, self.window_samples = 0, now, 0

    def on_validation(self, step: int, metrics: EvalMetrics) -> None:
        if self.session.ctx.is_main and metrics.constant and not self.warned_constant:
            self.warned_constant = True
            log.warning(
                "step %d: the model gives every validation example the same "
                "prediction, so it has stopped learning; the usual causes are a layer "
                "of dead ReLUs (a narrow MLP, e.g. model.top_mlp = [4, 1]) or a "
                "learning rate too high: widen the narrowest MLP or lower optimizer.lr",
                step,
            )
        if self.session.ctx.is_main:  # stderr: stdout is for results (e.g. a bench's JSON)
            line = f"step {step}: validation AUC {metrics.auc:.4f}, log-loss {metrics.logloss:.4f}"
            log.info(line) if self.bar.disable else self.bar.write(line, file=sys.stderr)
        self.window_start = time.perf_counter()  # keep eval time out of samples/s

    def on_end(self, step: int) -> None:
        self.bar.close()


class Checkpointing(StepHook):
    """A checkpoint every ``train.checkpoint_every`` steps, at the last step, and at the
    step the run stops after (the ranks write it together)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def on_step_end(self, step: int, stopping: bool) -> None:
        s, every = self.session, self.session.config.train.checkpoint_every
        if (every and step % every == 0) or step == s.steps or stopping:
            s.checkpoint(step)


class SummaryEntry(StepHook):
    """One more entry of the run's summary (e.g. the estimated class prior)."""

    def __init__(self, key: str, value: Any) -> None:
        self.key, self.value = key, value

    def on_summary(self, summary: dict[str, Any]) -> None:
        summary[self.key] = self.value
