"""Rolling evaluation over time-ordered data (``towerrec replay``).

The data source's periods (``data/periods.py``) are trained on once, in time
order; before each period after the first, the model trained so far is scored
on it::

    for t in 0 .. P-1:
        t >= 1: score the model (trained through periods 0..t-1) on period t
        train one pass over period t, batch by batch, in time order

so each score is "train through period t, evaluate on period t+1" (1-based):
the model always meets rows it has not seen, from a later time, as in
production. Each result has AUC, log-loss, NE and, on the synthetic data, the
oracle AUC of that period's teacher; the mean over periods closes the summary.

What each period trains on, and how, is ``train.temporal.strategy``
(``temporal.py``): ``incremental`` (the loop above), ``batch`` (one pass over
periods ``0..t``, or the last ``window``, at period t) or ``fgd`` (period t, dense
steps on a meta-learned forecast of the next period's gradient).

The train step, learning-rate schedule (over the replay's steps) and model are
those of ``towerrec train``: on a stationary stream (drift 0, id_turnover 0)
replay ends with the weights a plain run of the same steps ends with.
``--nproc N`` runs N ranks with the layouts of ``towerrec train --nproc``: each
reads its share of every global batch; a period's last batch is split as evenly
as it goes, and evaluation pads a rank whose share ran out.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from towerrec.build.resolve import resolve_device
from towerrec.build.run import build_run
from towerrec.build.sources import build_periods
from towerrec.config import Config, ConfigFiles, OptimizerConfig, load_config
from towerrec.data.periods import PeriodSource
from towerrec.data.registry import SOURCES
from towerrec.train.distributed import start_distributed
from towerrec.train.metrics import EvalMetrics, auc
from towerrec.train.numerics import local_processes, pinned, resolve_threads
from towerrec.train.step import autocast_dtype, evaluate, lr_factor, set_learning_rates, train_step
from towerrec.workflows.distill.loss import fit_adapter, with_distillation
from towerrec.workflows.pu.prior import resolve_objective
from towerrec.workflows.replay.temporal import FutureGradient, training_periods

__all__ = [
    "PeriodResult",
    "check_out_dir",
    "period_steps",
    "replay",
    "replay_worker",
    "run_replay",
    "write_replay_plot",
]

log = logging.getLogger("towerrec")


@dataclass(frozen=True)
class PeriodResult:
    """The model trained through periods ``0..period-1`` scored on ``period`` (0-based)."""

    period: int
    rows: int
    auc: float
    logloss: float
    ne: float
    calibration: float
    oracle_auc: float | None = None


def _check(config: Config, periods: PeriodSource) -> None:
    if periods.num_periods < 2:
        how = SOURCES[config.data.source].periods_hint
        raise ValueError(
            f"towerrec replay needs at least 2 periods, data.source = {config.data.source!r} "
            f"has {periods.num_periods}: {how}"
        )
    if config.optimizer.draws_samples:
        raise ValueError(
            f"optimizer.name = {config.optimizer.name!r} draws its own samples; replay reads "
            "each period once in order: use adam, adagrad, sgd or shampoo"
        )
    if config.train.prune_grow.enabled:
        raise ValueError("train.prune_grow is not supported by replay; disable it")
    if config.loss.class_prior == "estimate":
        raise ValueError(
            "loss.class_prior = 'estimate' estimates from a training split; replay has none: "
            "give the prior as a number"
        )
    if config.plan.strategy == "auto":
        raise ValueError(
            "plan.strategy = 'auto' measures the training stream's tables; replay has no such "
            "stream: use plan.strategy = 'none' (distributed.sharding) or 'file'"
        )
    if config.train.temporal.strategy == "fgd" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "train.temporal.strategy = 'fgd' runs on one process: drop --nproc, or use "
            "strategy 'incremental' or 'batch'"
        )
    if config.distill.adapter_order == "first" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "distill.adapter_order = 'first' runs on one process (the adapter's own pass "
            "does not all-reduce): drop --nproc, or use distill.adapter_order = 'joint'"
        )
    if config.distributed.pipeline:
        warnings.warn(
            "distributed.pipeline is ignored by replay: its steps run one batch at a time",
            stacklevel=4,  # the caller of run_replay()
        )
    if config.train.steps is not None or config.train.epochs is not None:
        warnings.warn(
            "train.steps and train.epochs are ignored by replay: it trains one pass over "
            "every period",
            stacklevel=4,  # the caller of run_replay()
        )


def period_steps(rows: int, global_batch: int, world_size: int) -> int:
    """Training steps of a period of ``rows`` rows: its global batches
    (``data/periods.py``), less a last one with fewer rows than ranks (a rank would
    train on none; those rows, at most ``world_size - 1``, are skipped)."""
    steps, rest = divmod(rows, global_batch)
    return steps + (rest >= world_size)


def run_replay(
    config: Config,
    progress: bool = True,
    hosts: int | None = None,
    periods: PeriodSource | None = None,
    train_periods: PeriodSource | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train through the periods with rolling evaluation (module docstring); the trained
    model and the summary (what ``replay`` writes as ``replay.json``). In a distributed
    run (``--nproc``) every rank calls it; each reads its share of every batch.
    ``periods``: the data, instead of ``config.data``'s (e.g. ``distill.TeacherPeriods``,
    whose batches carry a teacher's logits). ``train_periods``: where period t's training
    batches come from, when not from ``periods`` (which is still what each period is
    scored on): ``bench temporal``'s foresight reference trains on the next period's
    distribution; it has ``periods``' schema and number of periods."""
    with pinned():  # the run's thread count and matmul precision (train/numerics.py)
        return _run_replay(config, progress, hosts, periods, train_periods)


def _run_replay(
    config: Config,
    progress: bool,
    hosts: int | None,
    periods: PeriodSource | None,
    train_periods: PeriodSource | None,
) -> tuple[nn.Module, dict[str, Any]]:
    periods = build_periods(config.data) if periods is None else periods
    _check(config, periods)
    train_source = periods if train_periods is None else train_periods
    if train_source.num_periods != periods.num_periods:
        raise ValueError(
            f"train_periods has {train_source.num_periods} periods, the scored data "
            f"{periods.num_periods}: give both the same periods"
        )
    cfg = config.train
    device = resolve_device(cfg.device)
    ctx = start_distributed(config, device, hosts)
    world = ctx.world_size
    torch.set_num_threads(resolve_threads(config.train.threads, local_processes(world)))
    local_batch = ctx.local_batch(cfg.batch_size)
    local_eval = ctx.local_batch(cfg.eval_batch_size, "train.eval_batch_size")
    rows = [train_source.period_rows(p) for p in range(periods.num_periods)]
    counts = [period_steps(n, cfg.batch_size, world) for n in rows]
    trains = [training_periods(cfg.temporal, p) for p in range(len(rows))]
    steps = sum(counts[q] for plan in trains for q in plan)
    config = replace(config, optimizer=_warmup_for(config.optimizer, steps))
    built = build_run(config, source=periods, device=device, layout=ctx)
    amp_dtype = autocast_dtype(built.config.train.precision)  # resolved (build/choices.py)
    model, optimizer = built.model, built.optimizer
    base, _ = resolve_objective(config)
    objective = with_distillation(base, config.distill)
    objective.check_model(model)
    fgd = FutureGradient(optimizer, cfg.temporal) if cfg.temporal.strategy == "fgd" else None
    # A rank out of evaluation rows forwards this one (row 0) while the others finish.
    padding = next(iter(periods.period_batches(0, 1))) if world > 1 else None
    log.info(
        "replay: %d periods (%s rows), %s steps at batch %d on %d rank(s), %s updates",
        len(rows),
        ", ".join(f"{n:,}" for n in rows),
        f"{steps:,}",
        cfg.batch_size,
        world,
        cfg.temporal.strategy,
    )
    results: list[PeriodResult] = []
    step, train_s, tick = 0, 0.0, time.perf_counter()
    show = progress and cfg.progress and ctx.is_main
    bar = tqdm(total=steps, unit="step", disable=not show, desc="replay")
    for period in range(periods.num_periods):
        if period > 0:
            batches = periods.period_batches(period, local_eval, ctx.rank, world)
            metrics = evaluate(model, batches, device, amp_dtype, ctx=ctx, padding=padding)
            result = _result(period, metrics, periods.period_oracle(period))
            results.append(result)
            line = _progress_line(result)
            log.info("%s", line) if bar.disable else bar.write(line, file=sys.stderr)
        if counts[period] * cfg.batch_size < rows[period] and ctx.is_main:
            log.warning(
                "period %d: the last %d row(s) are fewer than the %d ranks and are not trained on",
                period,
                rows[period] % cfg.batch_size,
                world,
            )
        start = time.perf_counter()
        if fgd is not None and period > 0:
            fgd.meta_update(
                model,
                train_source.period_batches(period - 1, local_batch),
                train_source.period_batches(period, local_batch),
                optimizer.param_groups[0]["lr"],
                device,
                amp_dtype,
                objective,
                before=train_source.period_batches(period - 2, local_batch) if period > 1 else None,
            )
        if config.distill.adapter_order == "first":  # the adapter meets the labels first
            # at the schedule's decay, not its warm-up: the adapter starts as the identity
            decay = lr_factor(config.optimizer, max(step, config.optimizer.warmup_steps), steps)
            batches = train_source.period_batches(period, local_batch, ctx.rank, world)
            fit_adapter(model, optimizer, itertools.islice(batches, counts[period]), device, decay)
        for trained in trains[period]:
            batches = train_source.period_batches(trained, local_batch, ctx.rank, world)
            for batch in itertools.islice(batches, counts[trained]):
                step += 1
                batch.check()
                factor = lr_factor(config.optimizer, step, steps)
                set_learning_rates(model, optimizer, config, factor)
                if fgd is not None:
                    fgd.step(model, optimizer, batch.to(device), amp_dtype, objective)
                else:
                    train_step(model, optimizer, batch.to(device), amp_dtype, objective)
                bar.update(1)
        if fgd is not None:
            fgd.end_period()
        train_s += time.perf_counter() - start
    bar.close()
    trained_rows = sum(rows[q] for plan in trains for q in plan)
    summary = _summary(
        config, rows, steps, results, trained_rows / train_s if train_s > 0 else None, tick
    )
    summary["ranks"] = world
    summary["strategy"] = cfg.temporal.strategy
    summary["window"] = cfg.temporal.window
    summary["trained_periods"] = trains
    if fgd is not None:
        summary["fgd_generator"] = fgd.summary()
    return model, summary


def _warmup_for(optimizer: OptimizerConfig, steps: int) -> OptimizerConfig:
    """A short replay gets a tenth of its steps as warm-up when the warm-up is the
    default, as a ``towerrec train`` run sized by its data does."""
    warmup = max(1, steps // 10)
    if optimizer.warmup_steps == OptimizerConfig().warmup_steps and warmup < optimizer.warmup_steps:
        log.info(
            "optimizer.warmup_steps %d -> %d, a tenth of the replay", optimizer.warmup_steps, warmup
        )
        return replace(optimizer, warmup_steps=warmup)
    return optimizer


def _result(
    period: int, metrics: EvalMetrics, oracle: tuple[np.ndarray, np.ndarray] | None
) -> PeriodResult:
    return PeriodResult(
        period=period,
        rows=metrics.samples,
        auc=metrics.auc,
        logloss=metrics.logloss,
        ne=metrics.ne,
        calibration=metrics.calibration,
        oracle_auc=auc(oracle[1], oracle[0]) if oracle is not None else None,
    )


def _progress_line(r: PeriodResult) -> str:
    line = (
        f"period {r.period + 1} (trained through {r.period}): AUC {r.auc:.4f}, "
        f"log-loss {r.logloss:.4f}, NE {r.ne:.4f}"
    )
    if r.oracle_auc is not None:
        line += f" (oracle AUC {r.oracle_auc:.4f})"
    return line


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None and math.isfinite(v)]
    return sum(known) / len(known) if known and len(known) == len(values) else None


def _summary(
    config: Config,
    rows: list[int],
    steps: int,
    results: list[PeriodResult],
    samples_per_s: float | None,
    tick: float,
) -> dict[str, Any]:
    return {
        "source": config.data.source,
        "periods": len(rows),
        "period_rows": rows,
        "batch_size": config.train.batch_size,
        "steps": steps,
        "results": [asdict(r) for r in results],
        "mean": {
            key: _mean([getattr(r, key) for r in results])
            for key in ("auc", "logloss", "ne", "oracle_auc")
        },
        "train_samples_per_s": samples_per_s,
        "wall_s": time.perf_counter() - tick,
    }


def check_out_dir(out: Path) -> None:
    if (out / "replay.json").exists():
        raise FileExistsError(f"{out} already holds a replay (replay.json); choose another --out")


def replay(
    config: Config, out_dir: str | Path, progress: bool = True, hosts: int | None = None
) -> dict[str, Any]:
    """``run_replay`` into ``out_dir``: ``replay.json`` and ``replay.png`` (written by the
    first rank); the summary."""
    out = Path(out_dir)
    check_out_dir(out)
    _, summary = run_replay(config, progress, hosts)
    if int(os.environ.get("RANK", "0")) == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps(_finite(summary), indent=2) + "\n")
        write_replay_plot(summary, out / "replay.png")
    return summary


def replay_worker(
    config_path: ConfigFiles, overrides: list[str], out: Path
) -> dict[str, Any] | None:
    """One worker of ``towerrec replay --nproc N``: the summary on rank 0, None elsewhere."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if rank == 0:
        log.setLevel(logging.INFO)  # rank 0 speaks for the run
    try:
        summary = replay(load_config(config_path, overrides), out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return summary if rank == 0 else None


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats (an AUC of one class) as None: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_replay_plot(summary: dict[str, Any], path: str | Path) -> None:
    """AUC per evaluated period (and the oracle's, when known), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = summary["results"]
    x = [r["period"] + 1 for r in results]  # 1-based, as the progress lines
    fig, (ax_auc, ax_ne) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    ax_auc.plot(x, [r["auc"] for r in results], "o-", label="model")
    if all(r["oracle_auc"] is not None for r in results):
        ax_auc.plot(x, [r["oracle_auc"] for r in results], "s--", color="k", label="oracle")
    ax_auc.set_ylabel("AUC on the next period")
    ax_auc.set_title(f"replay over {summary['periods']} periods ({summary['source']})")
    ax_auc.legend()
    ax_ne.plot(x, [r["ne"] for r in results], "o-", color="tab:orange")
    ax_ne.set_ylabel("NE")
    ax_ne.set_xlabel("evaluated period (trained through the one before)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
