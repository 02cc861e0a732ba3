"""``towerrec bench streaming``: ExFM students on a drifting multi-domain stream
(docs/exfm.md).

A family of ``--domains`` synthetic streams (``data.synthetic.domains``) drifts over
``warmup + periods`` periods. Per seed:

1. the foundation model (FM, the teacher: a wider DLRM) trains on the union of every
   domain's stream, one pass per period in time order; ``fm[s]`` is its copy after
   period s;
2. per domain, students (a small DLRM) replay the domain's last ``periods`` periods
   (``run_replay``: train through period t, score period t+1), their batches carrying
   the FM's logits (``TeacherPeriods``): at absolute period t the fresh teacher is
   ``fm[t-1]``, the stale one ``fm[t-1-k]``. Variants::

       none          no distillation (distill.weight = 0)
       shared        distillation on the serving head, fresh teacher
       auxiliary     auxiliary head (alpha, beta), fresh teacher
       stale         auxiliary head, teacher k periods stale
       stale_adapter auxiliary head + student adapter, teacher k periods stale
                     (``--adapter-order first``: the adapter also passes over each
                     period's labels before the student trains on it)

``--student-seeds R`` trains R students per seed and domain (``train.seed`` = seed + 1000 r),
paired across the variants: the recovered share below is noisy (a 2 % change of w moves it
by tens of points over 9 students), and more students narrow it.

The result: each variant's mean next-period NE over domains, periods and seeds, its
relative difference to ``none`` (negative: better), and the share of the NE lost to
staleness that the adapter recovers, ``(NE_stale - NE_stale_adapter) / (NE_stale -
NE_auxiliary)``, with its value per seed and its 5-95 % bootstrap interval over the
students; the FM's own NE on the students' periods. Unless ``--skip-temporal``,
the temporal strategies' bench (``bench temporal``: batch, incremental, fgd and the
foresight reference, next-period log-loss per period) runs on domain 0 of the same
family. Targets: auxiliary <= -0.5 % against none; the adapter recovers >= 50 %; fgd
<= -2 % against batch on the drifting stream, within 0.2 % on the stationary one.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from towerrec.bench import temporal
from towerrec.bench.common import (
    Benchmark,
    add_overrides_argument,
    comma_list,
    keeps_process_settings,
    machine_info,
)
from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.config import Config, load_config
from towerrec.data.batch import Batch, DataSchema
from towerrec.data.periods import PeriodSource
from towerrec.data.synthetic import SyntheticSource
from towerrec.train.step import evaluate, lr_factor, set_learning_rates, train_step
from towerrec.workflows.distill.teacher import TeacherPeriods
from towerrec.workflows.replay.replay import period_steps, run_replay

__all__ = ["BENCHMARK", "UnionPeriods", "WindowPeriods"]

VARIANTS = ("none", "shared", "auxiliary", "stale", "stale_adapter")


class UnionPeriods:
    """The union of several streams' periods (one schema): each period's batches taken
    in turn from every stream, in time order within each."""

    def __init__(self, sources: list[PeriodSource]) -> None:
        self.sources = sources

    @property
    def schema(self) -> DataSchema:
        return self.sources[0].schema

    @property
    def num_periods(self) -> int:
        return self.sources[0].num_periods

    def period_rows(self, period: int) -> int:
        return sum(s.period_rows(period) for s in self.sources)

    def period_batches(
        self, period: int, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]:
        streams = [s.period_batches(period, batch_size, rank, world_size) for s in self.sources]
        for group in itertools.zip_longest(*streams):
            yield from (b for b in group if b is not None)

    def period_oracle(self, period: int) -> None:
        return None


class WindowPeriods:
    """Periods ``first ..`` of ``source`` as periods ``0 ..``."""

    def __init__(self, source: PeriodSource, first: int) -> None:
        self.source, self.first = source, first

    @property
    def schema(self) -> DataSchema:
        return self.source.schema

    @property
    def num_periods(self) -> int:
        return self.source.num_periods - self.first

    def period_rows(self, period: int) -> int:
        return self.source.period_rows(self.first + period)

    def period_batches(
        self, period: int, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]:
        return self.source.period_batches(self.first + period, batch_size, rank, world_size)

    def period_oracle(self, period: int) -> tuple[np.ndarray, np.ndarray] | None:
        return self.source.period_oracle(self.first + period)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--domains", type=int, default=3)
    parser.add_argument("--domain-shared", type=float, default=0.7)
    parser.add_argument("--periods", type=int, default=6, help="periods the students replay")
    parser.add_argument("--warmup", type=int, default=4, help="FM-only periods before them")
    parser.add_argument("--period-samples", type=int, default=8000, help="per domain")
    parser.add_argument(
        "--num-embeddings",
        type=comma_list,
        default=("60", "30", "100", "20", "80", "40", "30", "40", "80"),
        help="rows of each synthetic table (comma-separated)",
    )
    parser.add_argument("--lr", type=float, default=0.005, help="dense learning rate")
    parser.add_argument("--drift", type=float, default=0.2)
    parser.add_argument("--id-turnover", type=float, default=0.02)
    parser.add_argument("--stale", type=int, default=3, help="k: the stale teacher's age")
    parser.add_argument("--weight", type=float, default=1.0, help="distill.weight w")
    parser.add_argument("--label-scale", type=float, default=1.0, help="alpha")
    parser.add_argument("--grad-scale", type=float, default=1.0, help="beta")
    parser.add_argument("--adapter-lr", type=float, default=0.05)
    parser.add_argument(
        "--adapter-features", action="store_true", help="the adapter reads the dense features"
    )
    parser.add_argument(
        "--adapter-order",
        choices=("joint", "first"),
        default="joint",
        help="distill.adapter_order: first = a pass over each period's labels before the student",
    )
    parser.add_argument(
        "--student-seeds",
        type=int,
        default=1,
        help="students per seed and domain, each from its own train.seed (less noise)",
    )
    parser.add_argument("--variants", type=comma_list, default=VARIANTS, help="comma-separated")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument(
        "--student",
        type=comma_list,
        default=("model.embedding_dim=8", "model.bottom_mlp=[16,8]", "model.top_mlp=[16,1]"),
        help="the students' model overrides (comma-separated)",
    )
    parser.add_argument(
        "--fm",
        type=comma_list,
        default=("model.embedding_dim=32", "model.bottom_mlp=[64,32]", "model.top_mlp=[128,64,1]"),
        help="the FM's model overrides (comma-separated)",
    )
    parser.add_argument("--skip-temporal", action="store_true", help="no fgd/batch/incremental")
    parser.add_argument("--temporal-period-samples", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_overrides_argument(parser)


def _data(args: argparse.Namespace, seed: int) -> list[str]:
    return [
        f"data.synthetic.domains={args.domains}",
        f"data.synthetic.domain_shared={args.domain_shared}",
        f"data.synthetic.periods={args.warmup + args.periods}",
        f"data.synthetic.period_samples={args.period_samples}",
        f"data.synthetic.drift={args.drift}",
        f"data.synthetic.id_turnover={args.id_turnover}",
        f"data.synthetic.seed={seed}",
        f"data.synthetic.num_embeddings=[{', '.join(args.num_embeddings)}]",
        f"optimizer.lr={args.lr}",
        f"train.seed={seed}",
        f"train.batch_size={args.batch_size}",
        f"train.threads={args.threads}",
        "train.progress=false",
    ]


def _train_fm(config: Config, union: UnionPeriods) -> list[nn.Module]:
    """The FM trained one pass per period over ``union``; its copy after each period."""
    device = torch.device("cpu")
    model = build_model(config, union.schema, device)
    optimizer = build_dense_optimizer(config.optimizer, model)
    batch_size = config.train.batch_size
    counts = [period_steps(union.period_rows(p), batch_size, 1) for p in range(union.num_periods)]
    total, step, snapshots = sum(counts), 0, []
    for period in range(union.num_periods):
        for batch in union.period_batches(period, batch_size):
            step += 1
            set_learning_rates(model, optimizer, config, lr_factor(config.optimizer, step, total))
            train_step(model, optimizer, batch.to(device))
        snapshots.append(copy.deepcopy(model).eval())
    return snapshots


class _Teacher:
    """Student period i's teacher: the FM's copy ``age`` periods before absolute period
    ``first + i`` (age 1: the FM trained through the period before)."""

    def __init__(self, snapshots: list[nn.Module], first: int, age: int) -> None:
        self.snapshots, self.first, self.age = snapshots, first, age

    def __call__(self, period: int) -> nn.Module:
        return self.snapshots[self.first + period - self.age]


def _variant(name: str, args: argparse.Namespace) -> tuple[list[str], int]:
    """A variant's ``distill`` overrides and its teacher's age in periods (1: fresh)."""
    w = f"distill.weight={args.weight}"
    aux = [w, "distill.head=auxiliary", f"distill.label_scale={args.label_scale}"]
    aux.append(f"distill.grad_scale={args.grad_scale}")
    return {
        "none": ([], 1),
        "shared": ([w, "distill.head=shared", f"distill.label_scale={args.label_scale}"], 1),
        "auxiliary": (aux, 1),
        "stale": (aux, 1 + args.stale),
        "stale_adapter": (
            [
                *aux,
                "distill.adapter=true",
                f"distill.adapter_lr={args.adapter_lr}",
                f"distill.adapter_features={str(args.adapter_features).lower()}",
                f"distill.adapter_order={args.adapter_order}",
            ],
            1 + args.stale,
        ),
    }[name]


def _relative(means: dict[str, float], name: str) -> float | None:
    return means[name] / means["none"] - 1 if name in means and "none" in means else None


def recovered_share(ne: dict[str, np.ndarray]) -> float | None:
    """The share of the NE lost to staleness that the adapter wins back, over the students
    given (arrays of one NE per student, paired across variants)."""
    lost = float(ne["stale"].mean() - ne["auxiliary"].mean())
    return float(ne["stale"].mean() - ne["stale_adapter"].mean()) / lost if lost > 0 else None


def _recovered_spread(ne: dict[str, list[float]], seeds: int) -> dict:
    """The recovered share per seed, and its spread over the students: the 5th and 95th
    percentiles of the share over 2,000 bootstrap draws of the students (each draw keeps a
    student's variants together)."""
    runs = {k: np.asarray(ne[k]) for k in ("auxiliary", "stale", "stale_adapter")}
    n = len(runs["stale"])
    per_seed = [
        recovered_share({k: v.reshape(seeds, -1)[s] for k, v in runs.items()}) for s in range(seeds)
    ]
    rng = np.random.default_rng(0)
    draws = [
        recovered_share({k: v[idx] for k, v in runs.items()})
        for idx in rng.integers(0, n, (2000, n))
    ]
    known = [d for d in draws if d is not None]
    interval = [float(np.percentile(known, q)) for q in (5, 95)] if known else None
    return {"adapter_recovered_per_seed": per_seed, "adapter_recovered_interval_5_95": interval}


@keeps_process_settings
def _run(args: argparse.Namespace) -> dict:
    if args.seeds < 1 or args.periods < 2 or args.domains < 2 or args.student_seeds < 1:
        raise ValueError(
            "--seeds and --student-seeds must be >= 1, --periods >= 2 and --domains >= 2"
        )
    if args.warmup < args.stale + 1:
        raise ValueError(f"--warmup must be >= --stale + 1 = {args.stale + 1}")
    for name in args.variants:
        if name not in VARIANTS:
            raise ValueError(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    tick = time.perf_counter()
    result: dict = {
        "machine": machine_info(),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }
    ne: dict[str, list[float]] = {v: [] for v in args.variants}
    per_period: dict[str, list[list[float]]] = {v: [] for v in args.variants}
    fm_ne: list[float] = []
    for seed in range(args.seeds):
        base = [*_data(args, seed), *args.overrides]
        domains = [
            SyntheticSource(load_config(None, [*base, f"data.synthetic.domain={d}"]).data.synthetic)
            for d in range(args.domains)
        ]
        fm_config = load_config(None, [*base, *args.fm])
        fm = _train_fm(fm_config, UnionPeriods(list(domains)))
        for d, source in enumerate(domains):
            for p in range(args.warmup + 1, args.warmup + args.periods):
                batches = source.period_batches(p, 4096)
                fm_ne.append(evaluate(fm[p - 1], batches, torch.device("cpu")).ne)
            for name, replica in itertools.product(args.variants, range(args.student_seeds)):
                overrides, age = _variant(name, args)
                student = [*args.student, *overrides, f"train.seed={seed + 1000 * replica}"]
                config = load_config(None, [*base, f"data.synthetic.domain={d}", *student])
                periods = TeacherPeriods(
                    WindowPeriods(source, args.warmup), _Teacher(fm, args.warmup, age)
                )
                _, summary = run_replay(config, progress=False, periods=periods)
                ne[name].append(summary["mean"]["ne"])
                per_period[name].append([r["ne"] for r in summary["results"]])
    means = {name: statistics.fmean(values) for name, values in ne.items()}
    result["students"] = {
        "mean_ne": means,
        "relative_to_none": {name: _relative(means, name) for name in means if name != "none"},
        "ne_per_run": ne,
        "ne_per_period": per_period,
        "runs_per_variant": args.seeds * args.domains * args.student_seeds,
    }
    result["fm_mean_ne"] = statistics.fmean(fm_ne)
    if {"auxiliary", "stale", "stale_adapter"} <= set(means):
        lost = means["stale"] - means["auxiliary"]
        result["adapter_recovered_share"] = (
            (means["stale"] - means["stale_adapter"]) / lost if lost > 0 else None
        )
        result["stale_ne_lost"] = lost
        result.update(_recovered_spread(ne, args.seeds))
    if not args.skip_temporal:
        temporal_args = argparse.Namespace(
            seeds=args.seeds,
            periods=args.periods,
            period_samples=args.temporal_period_samples,
            drift=args.drift,
            id_turnover=args.id_turnover,
            strategies=temporal.DEFAULT_STRATEGIES,
            streams=("drifting", "stationary"),
            threads=args.threads,
            overrides=[
                f"data.synthetic.domains={args.domains}",
                f"data.synthetic.domain_shared={args.domain_shared}",
                f"train.batch_size={args.batch_size}",
                f"data.synthetic.num_embeddings=[{', '.join(args.num_embeddings)}]",
                f"optimizer.lr={args.lr}",
                *args.student,
                *args.overrides,
            ],
        )
        result["temporal"] = temporal.BENCHMARK.run(temporal_args)
        result["temporal"].pop("machine", None)
    result["targets"] = (
        "auxiliary vs none <= -0.5 %; adapter recovers >= 50 % of the stale NE loss; "
        "fgd vs batch <= -2 % drifting, |.| <= 0.2 % stationary"
    )
    result["wall_s"] = time.perf_counter() - tick
    return result


BENCHMARK = Benchmark(
    help="ExFM students on a drifting multi-domain stream: no distillation, shared head, "
    "auxiliary head, stale teacher with and without adapter; fgd vs batch and incremental",
    add_arguments=_add_arguments,
    run=_run,
)
