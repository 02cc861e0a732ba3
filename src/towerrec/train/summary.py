"""A run's summary.json: the returned weights' validation and test metrics, the best
step, throughput, model size, traffic and memory, and a warning when the final
normalized entropy says the model predicts worse than the click rate alone."""

from __future__ import annotations

import logging
from typing import Any

from towerrec.train.session import Session

__all__ = ["run_summary", "warn_worse_than_base_rate"]

log = logging.getLogger("towerrec")


def run_summary(
    session: Session,
    step: int,
    finished: bool,
    final: dict[str, Any],
    weights_step: int,
    test: dict[str, Any] | None,
) -> dict[str, Any]:
    """The summary of ``session`` after ``step``; ``final``: the returned weights'
    validation metrics (of ``weights_step``), ``test``: their test metrics, if any."""
    s, stopper, model, state = session, session.stopper, session.recommender, session.state
    collisions = model.sparse.collisions()
    return {
        **final,  # validation metrics of the returned weights (the best step's, if restored)
        "oracle_auc": s.oracle_auc,
        "oracle_ne": s.oracle_ne,
        "samples_per_s": state["samples"] / state["train_s"] if state["train_s"] else None,
        "steps": step,
        "completed": finished,
        "stopped_early": stopper.stopped,
        "eval_every": s.eval_every,
        "weights_step": weights_step,  # the step of the returned weights
        "best_step": stopper.best_step,
        "best_validation": stopper.best_metrics,
        "lr_scale": stopper.lr_scale,
        "test": test,  # test metrics of the returned weights; None without a test split
        "batch_size": s.config.train.batch_size,
        "num_params": s.num_dense + s.num_embedding,
        "num_dense_params": s.num_dense,
        "num_embedding_params": s.num_embedding,
        "flops_per_sample": model.flops_per_sample(),
        "backend": model.sparse.backend.value,
        "precision": s.config.train.precision,
        "hash_collisions": sum(collisions.values()) if collisions is not None else None,
        "embedding_tables": model.sparse.describe(),
        "device": str(s.device),
        "train_s": state["train_s"],
        **s.ctx.comm_per_sample(state["samples"]),
        **s.ctx.memory_summary(),
        **(
            {"prune_grow": s.prune_grow.summary(step, s.config.train.batch_size)}
            if s.prune_grow
            else {}
        ),
    }


def warn_worse_than_base_rate(ne: float, samples: int, train_rows: int | None) -> None:
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
