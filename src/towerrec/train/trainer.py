"""The training loop: ``train(config, out_dir)``.

``session.py`` sets the run up (and resumes it); here, around each step
(``step.py``): LR schedule, logging, periodic validation with early stopping and
the best weights (``early_stopping.py``), checkpoints and agreed stops; then the
best weights restored, the test split scored, and the summary (``summary.py``).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from towerrec.config import Config, TemporalConfig
from towerrec.data.batch import Batch
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.towers import TowerEmbeddingBagCollection
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.embedding_bag import fused_embedding_modules
from towerrec.optim.sampled import SampledOptimizer
from towerrec.train.loss import TrainObjective
from towerrec.train.metrics import EvalMetrics
from towerrec.train.numerics import pinned
from towerrec.train.pipeline import pipelined
from towerrec.train.session import Session, set_up
from towerrec.train.step import evaluate, lr_factor, set_learning_rates, train_step
from towerrec.train.summary import log_cache_stats, run_summary, warn_worse_than_base_rate
from towerrec.workflows.distill.loss import with_distillation
from towerrec.workflows.pu.prior import resolve_objective
from towerrec.workflows.sampled import BatchSamples, sampled_train_step

__all__ = ["evaluate", "train", "train_step"]  # the step's two re-exported with the loop

log = logging.getLogger("towerrec")


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


def _batches(
    source, batch_size: int, start: int, device: torch.device, rank: int = 0, world_size: int = 1
) -> Iterator[Batch]:
    for batch in source.train_batches(batch_size, start, rank, world_size):
        batch.check()  # finite dense features, labels in [0, 1]: microseconds per batch
        yield batch.to(device, non_blocking=True)


def train(
    config: Config,
    out_dir: str | Path,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    hosts: int | None = None,
) -> dict[str, Any]:
    """Train ``config`` into ``out_dir``; returns the summary (also in summary.json).

    ``resume`` continues from the directory's latest checkpoint (``config`` may differ
    from its config.toml only in ``RESUME_SAFE_KEYS``); ``stop_after``
    ends the run (with a checkpoint) after that step, as a stop signal does. ``hosts``:
    how many hosts a distributed run's ranks stand for (``None``: as its environment says).
    The run sets its own thread count and matmul precision (``numerics.py``); the
    process has its own back when it returns.
    """
    with pinned():
        return _train(config, out_dir, resume, stop_after, hosts)


def _train(
    config: Config,
    out_dir: str | Path,
    resume: bool,
    stop_after: int | None,
    hosts: int | None,
) -> dict[str, Any]:
    if config.train.temporal != TemporalConfig():
        warnings.warn(
            "train.temporal is used by towerrec replay only; towerrec train ignores it",
            stacklevel=3,  # the caller of train()
        )
    session = set_up(config, out_dir, resume, hosts)
    cfg = session.config.train
    local_eval_batch = session.ctx.local_batch(cfg.eval_batch_size, "train.eval_batch_size")
    # A rank out of eval batches forwards this one (eval row 0) while the others finish.
    padding = next(iter(session.source.eval_batches(1))) if session.ctx.world_size > 1 else None
    amp_dtype = torch.bfloat16 if cfg.precision == "bf16" else None

    def validate(split: str) -> EvalMetrics:
        ctx, source = session.ctx, session.source
        batches = source.eval_batches if split == "validation" else source.test_batches
        return evaluate(
            session.model,
            batches(local_eval_batch, ctx.rank, ctx.world_size),
            session.device,
            autocast_dtype=amp_dtype,
            ctx=ctx,
            padding=padding,
        )

    base, prior_estimate = resolve_objective(session.config)
    objective = with_distillation(base, session.config.distill)
    objective.check_model(session.model)
    step, last_eval = _loop(session, validate, amp_dtype, stop_after, objective)
    stopper, run = session.stopper, session.run
    finished = step == session.steps or stopper.stopped
    final = last_eval.as_dict() if last_eval else {}
    weights_step = step  # the step whose weights the run returns
    if finished and stopper.keeps_best and stopper.best_step not in (None, step):
        final, weights_step = _restore_best(session), stopper.best_step
    test = None
    if finished and session.source.test_rows:
        test = validate("test").as_dict()
        run.log({"kind": "test", "split": "test", "step": weights_step, **test})
        log.info(
            "test (weights of step %d): AUC %.4f, log-loss %.4f",
            weights_step,
            test["auc"],
            test["logloss"],
        )
    summary = run_summary(session, step, finished, final, weights_step, test)
    if prior_estimate is not None:  # loss.class_prior = "estimate"
        summary["class_prior_estimate"] = prior_estimate.as_dict()
    run.write_summary(summary)
    log_cache_stats(summary)
    run.plot_curves(session.oracle_auc)
    run.close()
    if final and final["ne"] >= 1 and session.ctx.is_main:
        warn_worse_than_base_rate(
            final["ne"],
            session.state["samples"],
            session.source.train_rows,
            session.config.train.batch_size,
        )
    return summary


def _loop(
    session: Session,
    validate: Any,
    amp_dtype: torch.dtype | None,
    stop_after: int | None,
    objective: TrainObjective,
) -> tuple[int, EvalMetrics | None]:
    """Train from the session's step to ``train.steps`` (or an early or requested stop);
    the last step and its last validation."""
    s, cfg, state, stopper = session, session.config.train, session.state, session.stopper
    ctx, model, run = s.ctx, s.model, s.run
    start, next_chunk = state["step"], 0
    held: list[int] = []
    if isinstance(s.optimizer, SampledOptimizer):  # one chunk is one batch of the stream
        held, next_chunk = s.optimizer.chunk_position()
        start = held[0] if held else next_chunk
    batches = _batches(
        s.source, ctx.local_batch(cfg.batch_size), start, s.device, ctx.rank, ctx.world_size
    )
    reads_rows_ahead = _prefetches_rows(s.config, model)
    if s.config.distributed.pipeline:
        if s.config.optimizer.draws_samples:
            raise ValueError(
                f"distributed.pipeline prefetches one batch per step; optimizer.name = "
                f"{s.config.optimizer.name!r} draws its own: set distributed.pipeline = false"
            )
        batches = pipelined(model, batches)
    elif reads_rows_ahead:
        batches = pipelined(model, batches)  # cached tables read the next batch's rows
    samples = None  # the stream as chunks, for an optimizer that draws its own samples
    if isinstance(s.optimizer, SampledOptimizer):
        params = [p for group in s.optimizer.param_groups for p in group["params"]]
        rows = s.source.train_rows
        epoch = -(-rows // cfg.batch_size) if rows else None  # no sample beyond one pass
        samples = BatchSamples(model, params, batches, amp_dtype, epoch, first=start)
        if held and held[-1] + 1 != next_chunk:
            raise AssertionError(f"held chunks {held} do not end before chunk {next_chunk}")
        samples.redraw(held)  # a resumed optimizer's sample; the stream goes on at next_chunk
    last_eval: EvalMetrics | None = None
    warned_constant = False
    loss_sum, loss_count = torch.zeros((), device=s.device), 0
    window_start, window_samples = time.perf_counter(), 0
    bar = tqdm(
        total=s.steps,
        initial=state["step"],
        unit="step",
        disable=not cfg.progress or not ctx.is_main,
        dynamic_ncols=True,
        desc="train",
    )
    run.open_events(state["step"])
    with _stop_on_signal() as stop:
        step = state["step"]
        while step < s.steps:
            step += 1
            factor = lr_factor(s.config.optimizer, step, s.steps) * stopper.lr_scale
            set_learning_rates(model, s.optimizer, s.config, factor)
            tick = time.perf_counter()
            if s.prune_grow is not None and s.prune_grow.before_step(step, s.optimizer):
                ctx.rebuild_dense_replicas(model)  # the dense parameters changed shape
            before = ctx.comm_snapshot(model)
            if samples is not None:
                assert isinstance(s.optimizer, SampledOptimizer)
                loss, rows, report = sampled_train_step(s.optimizer, samples)
                run.log({"kind": "optimizer", "step": step, **report})
            else:
                batch = next(batches)
                loss = train_step(model, s.optimizer, batch, amp_dtype, objective)
                rows = batch.size
            loss_sum += loss.to(loss_sum.device)
            ctx.count_train_bytes(model, before)
            loss_count += 1
            state["train_s"] += time.perf_counter() - tick
            state["samples"] += rows * ctx.world_size
            window_samples += rows * ctx.world_size
            bar.update(1)

            if step % cfg.log_every == 0 or step == s.steps:
                now = time.perf_counter()
                record = {
                    "kind": "train",
                    "step": step,
                    "loss": float(loss_sum) / loss_count,
                    "lr_factor": factor,
                    "samples_per_s": window_samples / (now - window_start),
                    "samples": state["samples"],
                    **ctx.comm_per_sample(state["samples"]),
                }
                run.log(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", sps=f"{record['samples_per_s']:,.0f}")
                loss_sum.zero_()
                loss_count, window_start, window_samples = 0, now, 0
            if (s.eval_every and step % s.eval_every == 0) or step == s.steps:
                last_eval = validate("validation")
                run.log(
                    {"kind": "eval", "split": "validation", "step": step, **last_eval.as_dict()}
                )
                if stopper.update(step, last_eval.as_dict()) and stopper.keeps_best:
                    s.checkpoint(step, best=True)
                if ctx.is_main and last_eval.constant and not warned_constant:
                    warned_constant = True
                    log.warning(
                        "step %d: the model gives every validation example the same "
                        "prediction, so it has stopped learning; the usual causes are a layer "
                        "of dead ReLUs (a narrow MLP, e.g. model.top_mlp = [4, 1]) or a "
                        "learning rate too high: widen the narrowest MLP or lower optimizer.lr",
                        step,
                    )
                if ctx.is_main:  # stderr: stdout is for results (e.g. a bench's JSON)
                    line = f"step {step}: validation AUC {last_eval.auc:.4f}, log-loss {last_eval.logloss:.4f}"
                    log.info(line) if bar.disable else bar.write(line, file=sys.stderr)
                window_start = time.perf_counter()  # keep eval time out of samples/s
            stopping = ctx.stop_agreed(
                stop["signal"] is not None or step == stop_after or stopper.stopped
            )
            if (
                (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                or step == s.steps
                or stopping
            ):
                s.checkpoint(step)
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
    bar.close()
    return step, last_eval


def _restore_best(session: Session) -> dict[str, Any]:
    """Load the best validation step's weights (``best/``); their validation metrics."""
    stopper, run = session.stopper, session.run
    path = session.best.latest()
    if path is None or path.name != f"step_{stopper.best_step:08d}":
        raise FileNotFoundError(
            f"the best step's checkpoint {run.best_dir}/step_{stopper.best_step:08d} is "
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


def _prefetches_rows(config: Config, model: nn.Module) -> bool:
    """Whether cached tables read each next batch's missing rows ahead (``embedding.prefetch``).

    Sharded cached tables read ahead under the pipelined input_dist (it gives a rank the
    next batch's ids of its shards), so this turns the pipeline on for them too; it sets
    their collections' ``prefetch_rows`` to match. Decided on every rank alike (on the
    tables cached on any rank), as the pipeline's collectives need."""
    on = config.embedding.prefetch and not config.optimizer.draws_samples
    found = False
    for _, module in fused_embedding_modules(model):
        if isinstance(module, CachedEmbeddingBagCollection):
            found = True
        elif isinstance(module, TowerEmbeddingBagCollection):
            module.prefetch_rows = False  # the tower transform routes ids itself: no pipeline
        elif isinstance(module, ShardedEmbeddingBagCollection):
            module.prefetch_rows = on
            found = found or bool(module.cached_tables)
    return on and found
