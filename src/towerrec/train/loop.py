"""The training loop: ``run(session, strategy)``, the loop (``fit``) and its end (``finish``).

``session.py`` sets the run up (and resumes it). Each step here: the learning rates
(the schedule times the plateau scale), the hooks' ``before_step``, one step of the
``StepStrategy`` (``BatchSteps``: one batch of the stream through ``train_step``), the
traffic and time it took, the hooks' ``after_step``; a validation when due; the stop
the ranks agree on; the hooks' ``on_step_end`` (checkpoints). Logging, early stopping
and checkpointing are hooks (``hooks.py``), and so is what the workflows add. Then
``finish``: the best weights restored, the test split scored, the summary
(``summary.py``).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from towerrec.config import Config
from towerrec.data.batch import Batch
from towerrec.data.source import DataSource
from towerrec.modules.embedding_bag import fused_embedding_modules
from towerrec.modules.interfaces import CachingCollection
from towerrec.modules.tiers import Background, background_on
from towerrec.train.hooks import Checkpointing, EarlyStop, Hooks, TrainLog
from towerrec.train.loss import BCE, TrainObjective
from towerrec.train.metrics import EvalMetrics
from towerrec.train.pipeline import pipelined
from towerrec.train.session import Session
from towerrec.train.step import evaluate, lr_factor, set_learning_rates, train_step
from towerrec.train.summary import log_cache_stats, run_summary, warn_worse_than_base_rate

__all__ = ["BatchSteps", "StepStrategy", "finish", "fit", "run", "train_batches", "validate"]

log = logging.getLogger("towerrec")


class StepStrategy(Protocol):
    """How the loop makes one optimizer step: ``BatchSteps``, or the workflow of an
    optimizer that draws its own samples (``towerrec.workflows.sampled``)."""

    def start(self, session: Session) -> None:
        """Before the first step: open the stream where the session's state left it."""
        ...

    def step(self, step: int) -> tuple[torch.Tensor, int]:
        """One optimizer step: its loss (detached) and this rank's rows read for it."""
        ...


class BatchSteps:
    """One batch of the training stream per step, through ``train_step`` with
    ``objective`` (BCE unless the run's loss, or distillation, says otherwise)."""

    def __init__(self, objective: TrainObjective = BCE) -> None:
        self.objective = objective

    def start(self, session: Session) -> None:
        self.session = session
        self.batches = train_batches(session, session.state["step"])

    def step(self, step: int) -> tuple[torch.Tensor, int]:
        s, batch = self.session, next(self.batches)
        return train_step(s.model, s.optimizer, batch, s.amp_dtype, self.objective), batch.size


def run(session: Session, strategy: StepStrategy, stop_after: int | None = None) -> dict[str, Any]:
    """Train ``session`` from its step (``fit``), then ``finish``: the run's summary."""
    step, last_eval = fit(session, strategy, stop_after)
    return finish(session, step, last_eval)


def fit(
    session: Session, strategy: StepStrategy, stop_after: int | None = None
) -> tuple[int, EvalMetrics | None]:
    """Train from the session's step to ``train.steps`` (or an early or requested stop:
    a signal, or ``stop_after``); the last step and its last validation."""
    s, ctx, state, stopper = session, session.ctx, session.state, session.stopper
    hooks = Hooks([EarlyStop(s), TrainLog(s), Checkpointing(s), *s.hooks])
    strategy.start(s)
    step, last_eval = state["step"], None
    hooks.on_start(step)
    with _stop_on_signal() as stop:
        while step < s.steps:
            step += 1
            s.lr_factor = lr_factor(s.config.optimizer, step, s.steps) * stopper.lr_scale
            set_learning_rates(s.model, s.optimizer, s.config, s.lr_factor)
            tick = time.perf_counter()
            hooks.before_step(step)
            before = ctx.comm_snapshot(s.model)
            loss, rows = strategy.step(step)
            ctx.count_train_bytes(s.model, before)
            state["train_s"] += time.perf_counter() - tick
            state["samples"] += rows * ctx.world_size
            hooks.after_step(step, loss, rows)
            if (s.eval_every and step % s.eval_every == 0) or step == s.steps:
                last_eval = validate(s, "validation")
                s.run.log(
                    {"kind": "eval", "split": "validation", "step": step, **last_eval.as_dict()}
                )
                hooks.on_validation(step, last_eval)
            requested = stop["signal"] is not None or step == stop_after
            stopping = ctx.stop_agreed(requested or stopper.stopped)
            hooks.on_step_end(step, stopping)
            if stopper.stopped:
                log.info(
                    "early stopping after step %d: validation %s has not improved for %d "
                    "evaluations (best: step %d)",
                    step,
                    stopper.metric,
                    stopper.since_best,
                    stopper.best_step,
                )
                break
            if stopping and step < s.steps:
                log.info("stopped after step %d; continue with --resume", step)
                break
    hooks.on_end(step)
    return step, last_eval


def validate(session: Session, split: str) -> EvalMetrics:
    """The model's metrics on the ``validation`` or ``test`` split, over every rank."""
    ctx, source = session.ctx, session.source
    batches = source.eval_batches if split == "validation" else source.test_batches
    return evaluate(
        session.model,
        batches(session.eval_batch, ctx.rank, ctx.world_size),
        session.device,
        autocast_dtype=session.amp_dtype,
        ctx=ctx,
        padding=session.padding,
    )


def finish(session: Session, step: int, last_eval: EvalMetrics | None) -> dict[str, Any]:
    """After the loop: a finished run's best weights restored (early stopping) and its
    test split scored; the summary written (with the hooks' entries) and returned."""
    stopper, run_dir = session.stopper, session.run
    finished = step == session.steps or stopper.stopped
    final = last_eval.as_dict() if last_eval else {}
    weights_step = step  # the step whose weights the run returns
    if finished and stopper.keeps_best and stopper.best_step not in (None, step):
        final, weights_step = _restore_best(session), stopper.best_step
    test = None
    if finished and session.source.test_rows:
        test = validate(session, "test").as_dict()
        run_dir.log({"kind": "test", "split": "test", "step": weights_step, **test})
        log.info(
            "test (weights of step %d): AUC %.4f, log-loss %.4f",
            weights_step,
            test["auc"],
            test["logloss"],
        )
    summary = run_summary(session, step, finished, final, weights_step, test)
    session.hooks.on_summary(summary)
    run_dir.write_summary(summary)
    log_cache_stats(summary)
    run_dir.plot_curves(session.oracle_auc)
    run_dir.close()
    if final and final["ne"] >= 1 and session.ctx.is_main:
        warn_worse_than_base_rate(
            final["ne"],
            session.state["samples"],
            session.source.train_rows,
            session.config.train.batch_size,
        )
    return summary


def _restore_best(session: Session) -> dict[str, Any]:
    """Load the best validation step's weights (``best/``); their validation metrics."""
    stopper, run_dir = session.stopper, session.run
    path = session.best.latest()
    if path is None or path.name != f"step_{stopper.best_step:08d}":
        raise FileNotFoundError(
            f"the best step's checkpoint {run_dir.best_dir}/step_{stopper.best_step:08d} is "
            "missing; the run's weights are the last step's (in its checkpoint/)"
        )
    session.best.load(path, session.model, session.optimizer, dict(session.state))
    assert stopper.best_metrics is not None  # set with best_step
    log.info(
        "restored the best weights, of step %d (validation %s %.4f)",
        stopper.best_step,
        stopper.metric,
        stopper.best_value,
    )
    return stopper.best_metrics


@contextmanager
def _stop_on_signal():
    """SIGINT/SIGTERM ask the loop to stop after the current step (and checkpoint); in a
    distributed run the ranks agree on that step (``RunContext.stop_agreed``)."""
    requested = {"signal": None}

    def handler(signum, _frame):
        if requested["signal"] is not None:  # second signal: stop now
            raise KeyboardInterrupt
        requested["signal"] = signum
        log.warning("stop requested: finishing this step and writing a checkpoint")

    try:
        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: no signal handling
        previous = {}
    try:
        yield requested
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def train_batches(session: Session, start: int) -> Iterator[Batch]:
    """This rank's training batches from global batch ``start`` on, on the run's device,
    checked; pipelined (``pipeline.py``) under ``distributed.pipeline`` or when cached
    tables read each next batch's rows ahead."""
    s, ctx = session, session.ctx
    local_batch = ctx.local_batch(s.config.train.batch_size)
    batches = _batches(s.source, local_batch, start, s.device, ctx.rank, ctx.world_size)
    reads_rows_ahead = _prefetches_rows(s.config, s.model, ctx.all_agree, s.device)
    if s.config.distributed.pipeline:
        if s.config.optimizer.draws_samples:
            raise ValueError(
                f"distributed.pipeline prefetches one batch per step; optimizer.name = "
                f"{s.config.optimizer.name!r} draws its own: set distributed.pipeline = false"
            )
        return pipelined(s.model, batches)
    if reads_rows_ahead:
        return pipelined(s.model, batches)  # cached tables read the next batch's rows
    return batches


def _batches(
    source: DataSource,
    batch_size: int,
    start: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[Batch]:
    for batch in source.train_batches(batch_size, start, rank, world_size):
        batch.check()  # finite dense features, labels in [0, 1]: microseconds per batch
        yield batch.to(device, non_blocking=True)


def _prefetches_rows(
    config: Config,
    model: nn.Module,
    all_agree: Callable[[bool], bool] = bool,
    device: torch.device | str = "cpu",
) -> bool:
    """Whether cached tables read each next batch's missing rows ahead (``embedding.prefetch``;
    ``auto``: when the step runs on an accelerator or this process has a core beyond its
    torch threads, on every rank: ``all_agree``, ``modules/tiers.background_on``).

    Sharded cached tables read ahead under the pipelined input_dist (it gives a rank the
    next batch's ids of its shards), so this turns the pipeline on for them too; each
    caching collection is told whether to read ahead (``CachingCollection``). Decided on
    every rank alike (on the tables cached on any rank), as the pipeline's collectives
    need."""
    setting = config.embedding.prefetch
    on = not config.optimizer.draws_samples and setting is not Background.OFF
    if on and setting is Background.AUTO:
        on = all_agree(background_on(setting, "embedding.prefetch", device=device))
    found = False
    for _, module in fused_embedding_modules(model):
        if isinstance(module, CachingCollection):
            found = module.read_rows_ahead(on) or found
    return on and found
