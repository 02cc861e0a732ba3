"""A run's summary.json: the returned weights' validation and test metrics, the best
step, throughput, model size, traffic and memory, the caches of cached tables (hooks
add theirs: ``StepHook.on_summary``), and a warning when the final normalized entropy
says the model predicts worse than the click rate alone."""

from __future__ import annotations

import logging
from typing import Any

from towerrec.modules.table_cache import CacheStats
from towerrec.train.session import Session

__all__ = ["cache_summary", "log_cache_stats", "run_summary", "warn_worse_than_base_rate"]

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
    caches = s.ctx.cache_stats(s.model)  # a collective
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
        "auto_choices": {name: c.as_dict() for name, c in s.choices.items()},
        "hash_collisions": sum(collisions.values()) if collisions is not None else None,
        "embedding_tables": model.sparse.describe(),
        "device": str(s.device),
        "threads": s.threads,  # this rank's intra-op threads (bit-for-bit results need the same)
        "train_s": state["train_s"],
        **s.ctx.comm_per_sample(state["samples"]),
        **s.ctx.memory_summary(),
        **({"cache": cache_summary(caches)} if caches else {}),
    }


def cache_summary(stats: dict[str, CacheStats]) -> dict[str, Any]:
    """The summary's ``cache``: each cached table's lookups of distinct rows, hits, misses,
    hit rate and backing-store traffic over the run (training and evaluation lookups;
    ``train_*`` of the training lookups alone; summed over ranks; a resumed run counts
    from its resume), and their total."""
    total = CacheStats.from_counts(
        [sum(col) for col in zip(*(s.counts() for s in stats.values()), strict=True)]
    )
    return {"tables": {name: s.as_dict() for name, s in stats.items()}, "total": total.as_dict()}


def log_cache_stats(summary: dict[str, Any]) -> None:
    """One line per cached table (the summary's ``cache``), then the total."""
    cache = summary.get("cache")
    if not cache:
        return
    for name, c in [*cache["tables"].items(), ("(all)", cache["total"])]:
        log.info(
            "cache %s: hit rate %.2f%% (%d of %d rows looked up; training %.2f%%), %d rows "
            "read (%.1f MiB), %d written back (%.1f MiB)",
            name,
            100 * c["hit_rate"],
            c["hits"],
            c["lookups"],
            100 * c["train_hit_rate"],
            c["rows_read"],
            c["bytes_read"] / 2**20,
            c["rows_written_back"],
            c["bytes_written"] / 2**20,
        )


def warn_worse_than_base_rate(
    ne: float, samples: int, train_rows: int | None, batch_size: int
) -> None:
    """NE >= 1: the predictions say less than the eval click rate alone would. Too many
    passes is named as a cause only when the run made more than one epoch rounded up to
    whole global batches of ``batch_size``."""
    causes = []
    if not train_rows:
        causes.append("overfitting from too many train.steps")
    elif samples - train_rows >= batch_size:
        causes.append(
            f"overfitting from too many passes over the training data ({samples / train_rows:.3g} "
            "epochs here; try train.epochs = 1)"
        )
    causes.append("a learning rate too high (optimizer.lr, embedding.lr)")
    causes.append(
        "a run too short to learn even the click rate (train.steps against optimizer.warmup_steps)"
    )
    log.warning(
        "the final eval normalized entropy is %.3f >= 1: the model predicts worse than the "
        "click rate alone. Likely causes: %s, or %s",
        ne,
        ", ".join(causes[:-1]),
        causes[-1],
    )
