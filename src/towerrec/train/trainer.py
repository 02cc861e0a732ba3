"""The training loop: ``train(config, out_dir)``.

Around each step (``step.py``): LR schedule, logging, periodic validation with
early stopping and the best weights (``early_stopping.py``), checkpoints, and
resume from the last checkpoint.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from towerrec.config import Config
from towerrec.data.batch import Batch
from towerrec.data.source import DataSource
from towerrec.models.interfaces import RecommendationModel
from towerrec.modules.embedding_bag import fused_embedding_modules
from towerrec.train.build import (
    build_dense_optimizer,
    build_model,
    build_source,
    lr_factor,
    resolve_device,
    resolve_eval_every,
    resolve_run_config,
)
from towerrec.train.checkpoint import CheckpointManager, capture_rng, read_meta, restore_rng
from towerrec.train.distributed import start_distributed
from towerrec.train.early_stopping import EarlyStopping
from towerrec.train.metrics import EvalMetrics, auc
from towerrec.train.pipeline import pipelined
from towerrec.train.run_dir import RunDir
from towerrec.train.step import evaluate, set_learning_rates, train_step
from towerrec.train.towers import with_learned_partition

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


def _warn_worse_than_base_rate(ne: float, samples: int, train_rows: int | None) -> None:
    """NE >= 1: the predictions say less than the eval click rate alone would."""
    if train_rows:
        overfit = f"too many passes over the training data ({samples / train_rows:.3g} epochs "
        overfit += "here; try train.epochs = 1)"
    else:
        overfit = "too many train.steps"
    log.warning(
        "the final eval normalized entropy is %.3f >= 1: the model predicts worse than the "
        "click rate alone. Likely causes: overfitting from %s, a learning rate too high "
        "(optimizer.lr, embedding.lr), or a run too short to learn even the click rate "
        "(train.steps against optimizer.warmup_steps)",
        ne,
        overfit,
    )


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
) -> dict[str, Any]:
    """Train ``config`` into ``out_dir``; returns the summary (also in summary.json).

    ``resume`` continues from the directory's latest checkpoint (``config`` may differ
    from its config.toml only in ``RESUME_SAFE_KEYS``); ``stop_after``
    ends the run (with a checkpoint) after that step, as a stop signal does.
    """
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    device = resolve_device(config.train.device)
    ctx = start_distributed(config, device)
    source: DataSource = build_source(config.data)
    config, steps_from = resolve_run_config(config, source)
    cfg, steps = config.train, config.train.steps
    assert steps is not None  # resolved
    run = RunDir(out_dir, writer=ctx.is_main, tensorboard=cfg.tensorboard)
    checkpoints = CheckpointManager(run.checkpoint_dir, keep=cfg.keep_checkpoints)
    best = CheckpointManager(run.best_dir, keep=1)
    eval_every = resolve_eval_every(config, source)
    stopper = EarlyStopping.from_config(config)
    if resume and checkpoints.latest() is None:
        raise FileNotFoundError(
            f"--resume: {run.checkpoint_dir} holds no checkpoint to resume from"
        )
    changed = run.resume_changes(config) if resume else {}
    if ctx.is_main:
        run.start(config, resume=resume)
    ctx.barrier()
    log.info("train.steps = %s: %s", f"{steps:,}", steps_from)
    if config.optimizer.warmup_steps >= steps:
        log.warning(
            "optimizer.warmup_steps = %d >= train.steps = %d: the learning rate never reaches "
            "optimizer.lr; lower optimizer.warmup_steps",
            config.optimizer.warmup_steps,
            steps,
        )

    if config.plan.strategy != "none" and ctx.world_size == 1:
        log.warning("plan.strategy only shards tables over ranks; one process keeps them all")
    # A DMT's learned partition comes from a pilot run (on rank 0) before the model is built.
    # Distributed: no rank allocates the full tables; each builds only its shards.
    model = build_model(
        with_learned_partition(config, source.schema),
        source.schema,
        device,
        materialize_embeddings=ctx.world_size == 1,
    )
    model = ctx.parallelize(model, config, source)
    if not isinstance(model, RecommendationModel):  # every model build_model makes is one
        raise TypeError(f"{type(model).__name__} is not a RecommendationModel")
    optimizer = build_dense_optimizer(config.optimizer, model)
    state: dict[str, Any] = {"step": 0, "samples": 0, "train_s": 0.0, "rng": capture_rng()}
    if resume:
        path = checkpoints.latest()
        assert path is not None  # checked before the run started
        state = checkpoints.load(path, model, optimizer, state)
        if state["step"] >= cfg.steps:
            raise ValueError(
                f"the run in {run.path} already finished step {state['step']} of train.steps = "
                f"{cfg.steps}; raise train.steps (--set train.steps=N) to train further"
            )
        restore_rng(state["rng"])
        meta = read_meta(path)
        ctx.restore_train_bytes(meta.get("train_bytes", []))
        stopper.load_state_dict(meta.get("early_stopping"))
        if stopper.stopped:
            raise ValueError(
                f"the run in {run.path} already stopped early at step {state['step']} (best "
                f"validation step {stopper.best_step}); start a new run to train further"
            )
        run.truncate_after(state["step"])
        run.log({"kind": "resume", "step": state["step"], "changed": changed})
        log.info("resumed from %s at step %d", path, state["step"])

    oracle_auc = None
    if (oracle := source.eval_oracle()) is not None:  # a planted truth's probabilities
        labels, probs = oracle
        oracle_auc = auc(probs, labels)
    num_dense = model.num_dense_parameters()
    num_embedding = sum(m.num_embedding_parameters for _, m in fused_embedding_modules(model))
    log.info(
        "model: %s dense + %s embedding parameters, %s backend, device %s",
        f"{num_dense:,}",
        f"{num_embedding:,}",
        model.sparse.backend.value,
        device,
    )

    def checkpoint(step: int, manager: CheckpointManager = checkpoints) -> None:
        state.update(step=step, rng=capture_rng())
        meta = {"train_bytes": ctx.run_train_bytes(), "early_stopping": stopper.state_dict()}
        manager.save(step, model, optimizer, state, meta)

    local_batch = ctx.local_batch(cfg.batch_size)
    local_eval_batch = ctx.local_batch(cfg.eval_batch_size, "train.eval_batch_size")
    batches = _batches(source, local_batch, state["step"], device, ctx.rank, ctx.world_size)
    if config.distributed.pipeline:
        batches = pipelined(model, batches)
    # A rank out of eval batches forwards this one (eval row 0) while the others finish.
    eval_padding = next(iter(source.eval_batches(1))) if ctx.world_size > 1 else None
    amp_dtype = torch.bfloat16 if cfg.precision == "bf16" else None
    last_eval: EvalMetrics | None = None
    loss_sum, loss_count = torch.zeros((), device=device), 0
    window_start, window_samples = time.perf_counter(), 0
    bar = tqdm(
        total=cfg.steps,
        initial=state["step"],
        unit="step",
        disable=not cfg.progress or not ctx.is_main,
        dynamic_ncols=True,
        desc="train",
    )
    run.open_events(state["step"])
    with _stop_on_signal() as stop:
        step = state["step"]
        while step < cfg.steps:
            step += 1
            factor = lr_factor(config.optimizer, step, steps) * stopper.lr_scale
            set_learning_rates(model, optimizer, config, factor)
            tick = time.perf_counter()
            batch = next(batches)
            before = ctx.comm_snapshot(model)
            loss_sum += train_step(model, optimizer, batch, amp_dtype)
            ctx.count_train_bytes(model, before)
            loss_count += 1
            state["train_s"] += time.perf_counter() - tick
            state["samples"] += batch.size * ctx.world_size
            window_samples += batch.size * ctx.world_size
            bar.update(1)

            if step % cfg.log_every == 0 or step == cfg.steps:
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
            if (eval_every and step % eval_every == 0) or step == cfg.steps:
                last_eval = evaluate(
                    model,
                    source.eval_batches(local_eval_batch, ctx.rank, ctx.world_size),
                    device,
                    autocast_dtype=amp_dtype,
                    ctx=ctx,
                    padding=eval_padding,
                )
                run.log(
                    {"kind": "eval", "split": "validation", "step": step, **last_eval.as_dict()}
                )
                if stopper.update(step, last_eval.as_dict()) and stopper.keeps_best:
                    checkpoint(step, best)
                if ctx.is_main:  # stderr: stdout is for results (e.g. a bench's JSON)
                    line = (
                        f"step {step}: validation AUC {last_eval.auc:.4f}, "
                        f"log-loss {last_eval.logloss:.4f}"
                    )
                    if bar.disable:
                        log.info(line)
                    else:
                        bar.write(line, file=sys.stderr)
                window_start = time.perf_counter()  # keep eval time out of samples/s
            stopping = ctx.stop_agreed(
                stop["signal"] is not None or step == stop_after or stopper.stopped
            )
            if (
                (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                or step == cfg.steps
                or stopping
            ):
                checkpoint(step)
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
            if stopping and step < cfg.steps:
                log.info("stopped after step %d; continue with --resume", step)
                break
    bar.close()

    finished = step == cfg.steps or stopper.stopped
    final = last_eval.as_dict() if last_eval else {}
    weights_step = step  # the step whose weights the run returns
    if finished and stopper.keeps_best and stopper.best_step not in (None, step):
        path = best.latest()
        if path is None or path.name != f"step_{stopper.best_step:08d}":
            raise FileNotFoundError(
                f"the best step's checkpoint {run.best_dir}/step_{stopper.best_step:08d} is "
                "missing; the run's weights are the last step's (in its checkpoint/)"
            )
        best.load(path, model, optimizer, dict(state))
        assert stopper.best_metrics is not None  # set with best_step
        final, weights_step = stopper.best_metrics, stopper.best_step
        log.info(
            "restored the best weights, of step %d (validation %s %.4f)",
            stopper.best_step,
            stopper.metric,
            stopper.best_value,
        )
    test = None
    if finished and source.test_rows:
        test = evaluate(
            model,
            source.test_batches(local_eval_batch, ctx.rank, ctx.world_size),
            device,
            autocast_dtype=amp_dtype,
            ctx=ctx,
            padding=eval_padding,
        ).as_dict()
        run.log({"kind": "test", "split": "test", "step": weights_step, **test})
        log.info(
            "test (weights of step %d): AUC %.4f, log-loss %.4f",
            weights_step,
            test["auc"],
            test["logloss"],
        )

    collisions = model.sparse.collisions()
    summary = {
        **final,  # validation metrics of the returned weights (the best step's, if restored)
        "oracle_auc": oracle_auc,
        "samples_per_s": state["samples"] / state["train_s"] if state["train_s"] else None,
        "steps": step,
        "completed": finished,
        "stopped_early": stopper.stopped,
        "eval_every": eval_every,
        "weights_step": weights_step,  # the step of the returned weights
        "best_step": stopper.best_step,
        "best_validation": stopper.best_metrics,
        "lr_scale": stopper.lr_scale,
        "test": test,  # test metrics of the returned weights; None without a test split
        "batch_size": cfg.batch_size,
        "num_params": num_dense + num_embedding,
        "num_dense_params": num_dense,
        "num_embedding_params": num_embedding,
        "flops_per_sample": model.flops_per_sample(),
        "backend": model.sparse.backend.value,
        "precision": cfg.precision,
        "hash_collisions": sum(collisions.values()) if collisions is not None else None,
        "embedding_tables": model.sparse.describe(),
        "device": str(device),
        "train_s": state["train_s"],
        **ctx.comm_per_sample(state["samples"]),
        **ctx.memory_summary(),
    }
    run.write_summary(summary)
    run.plot_curves(oracle_auc)
    run.close()
    if final and final["ne"] >= 1 and ctx.is_main:
        _warn_worse_than_base_rate(final["ne"], state["samples"], source.train_rows)
    return summary
