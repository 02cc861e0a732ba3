"""``towerrec bench prune-grow``: growth and pruning against dense training.

On generated Criteo-format data (``towerrec data gen-criteo``, converted with a seeded
10 % validation and 10 % test split) a DLRM with a 1024-512-256 top MLP trains one
epoch densely and once under ``train.prune_grow`` (the same seed, data order and
initial weights), for each seed, in alternating order. Reported per seed and as
means:

- MLP training FLOPs (forward + backward of the pruned MLPs, from the schedule) over
  the dense run's;
- wall-clock of the training steps (``train_s`` of the summary, reshapes included)
  and the process's CPU seconds of the whole run, pruned over dense;
- one train step of the full and of the pruned model timed round-robin
  (``time_interleaved``), and the run's wall-clock ratio those step times predict
  (``1 - f + f * pruned / full``, ``f`` the pruned share of the steps): on a shared
  machine the end-to-end ratio wanders with other tenants' load, the interleaved one
  much less;
- test log-loss and AUC, and the relative log-loss change.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from towerrec.bench.common import (
    Benchmark,
    add_overrides_argument,
    comma_list,
    keeps_process_settings,
    machine_info,
    set_threads,
    time_interleaved,
)
from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.build.resolve import resolve_steps
from towerrec.build.sources import build_source
from towerrec.config import Config, load_config
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.train.step import train_step
from towerrec.workflows.prune_grow import PruneGrow
from towerrec.workflows.training import train

__all__ = ["BENCHMARK"]

# configs/criteo.toml's recipe with the top MLP.
BASE = [
    "data.source=criteo",
    "model.name=dlrm",
    "model.embedding_dim=16",
    "model.bottom_mlp=[64, 16]",
    "model.top_mlp=[1024, 512, 256, 1]",
    "embedding.optimizer=rowwise_adagrad",
    "embedding.lr=0.1",
    "optimizer.name=adam",
    "optimizer.lr=0.002",
    "optimizer.warmup_steps=0",
    "optimizer.decay=cosine",
    "train.batch_size=2048",
    "train.eval_every=0",
    "train.progress=false",
    "train.device=cpu",
]


def _cache(args: argparse.Namespace, root: Path) -> Path:
    if args.data:
        return Path(args.data)
    paths = generate_criteo_files(root / "raw", args.files, args.rows, seed=0)
    options = CriteoOptions(
        num_embeddings=(args.num_embeddings,), eval_fraction=0.1, test_fraction=0.1, seed=0
    )
    with contextlib.redirect_stdout(sys.stderr):
        preprocess_criteo(paths, root / "cache", options, progress=False)
    return root / "cache"


def _configs(args: argparse.Namespace, cache: Path, seed: int) -> tuple[Config, Config]:
    common = [
        *BASE,
        f"data.path={cache}",
        f"train.epochs={args.epochs}",
        f"train.seed={seed}",
        f"data.loader.seed={seed}",
        f"train.threads={args.threads or 0}",
        *args.overrides,
    ]
    schedule = [
        f"train.prune_grow.mlps={list(comma_list(args.mlps))}".replace("'", '"'),
        f"train.prune_grow.keep={args.keep}",
        f"train.prune_grow.prune_at=[{args.prune_at}]",
        f"train.prune_grow.grow_at=[{args.grow_at}]",
    ]
    return load_config(None, common), load_config(None, [*common, *schedule])


def _run(config: Config, root: Path) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(dir=root))
    cpu = time.process_time()
    with contextlib.redirect_stdout(sys.stderr):
        summary = train(config, out)
    test = summary["test"] or {}
    return {
        "train_s": summary["train_s"],
        "cpu_s": time.process_time() - cpu,
        "test_logloss": test.get("logloss"),
        "test_auc": test.get("auc"),
        "steps": summary["steps"],
        "prune_grow": summary.get("prune_grow"),
    }


def _step_times(config: Config, rounds: int) -> dict[str, float]:
    """Seconds per train step of the full and the pruned model, timed round-robin."""
    source = build_source(config.data)
    steps, _ = resolve_steps(config, source)
    models, optimizers = {}, {}
    for name in ("full", "pruned"):
        models[name] = build_model(config, source.schema, torch.device("cpu"))
        optimizers[name] = build_dense_optimizer(config.optimizer, models[name])
    pg = PruneGrow(config, steps, models["pruned"], optimizers["pruned"])
    pg.before_step(pg.phases[0][0] + 1, optimizers["pruned"])
    batches = list(itertools.islice(source.train_batches(config.train.batch_size, 0, 0, 1), 4))

    def stepper(name: str):
        return lambda i: train_step(models[name], optimizers[name], batches[i % len(batches)])

    cpu: dict[str, float] = {}
    wall = time_interleaved(
        {n: stepper(n) for n in models}, rounds, steps_per_round=3, warmup=2, cpu_seconds=cpu
    )
    return {
        "full_step_s": wall["full"],
        "pruned_step_s": wall["pruned"],
        "step_ratio": wall["pruned"] / wall["full"],
        "cpu_step_ratio": cpu["pruned"] / cpu["full"],
    }


def _ratio(runs: list[dict], key: str) -> list[float]:
    return [r["prune_grow"][key] / r["dense"][key] for r in runs]


@keeps_process_settings
def _bench(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    seeds = [int(s) for s in comma_list(args.seeds)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cache = _cache(args, root)
        steps = _step_times(_configs(args, cache, seeds[0])[1], args.rounds)
        print(f"step times: {steps}", file=sys.stderr)
        runs: list[dict[str, Any]] = []
        for i, seed in enumerate(seeds):
            dense_config, pg_config = _configs(args, cache, seed)
            order = ["dense", "prune_grow"] if i % 2 == 0 else ["prune_grow", "dense"]
            configs = {"dense": dense_config, "prune_grow": pg_config}
            runs.append({"seed": seed, **{name: _run(configs[name], root) for name in order}})
            print(f"seed {seed}: {runs[-1]}", file=sys.stderr)
    schedule = runs[0]["prune_grow"]["prune_grow"]
    pruned_share = schedule["pruned_steps"] / runs[0]["prune_grow"]["steps"]
    wall = _ratio(runs, "train_s")
    logloss = [r - 1 for r in _ratio(runs, "test_logloss")]
    flops = schedule["mlp_train_flops_ratio"]
    predicted = 1 - pruned_share + pruned_share * steps["step_ratio"]
    return {
        "benchmark": "prune-grow",
        "machine": machine_info(),
        "data": {"files": args.files, "rows_per_file": args.rows, "cache": args.data},
        "schedule": schedule,
        "pruned_share_of_steps": pruned_share,
        "runs": runs,
        "mlp_train_flops_ratio": flops,
        "wall_ratio": {"per_seed": wall, "mean": statistics.mean(wall)},
        "cpu_ratio_per_seed": _ratio(runs, "cpu_s"),
        "step_times": steps,
        "predicted_wall_ratio": predicted,
        "test_logloss_rel_change": {"per_seed": logloss, "mean": statistics.mean(logloss)},
        "targets": {
            "flops_at_least_30pct_fewer": flops <= 0.7,
            "wall_at_least_15pct_less (measured mean)": statistics.mean(wall) <= 0.85,
            "wall_at_least_15pct_less (interleaved steps)": predicted <= 0.85,
            "logloss_within_0.3pct (mean)": abs(statistics.mean(logloss)) <= 0.003,
        },
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, default=2, help="generated Criteo files")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per generated file")
    parser.add_argument("--num-embeddings", type=int, default=20_000, help="rows per table")
    parser.add_argument(
        "--data", default=None, help="an existing cache instead (with a test split)"
    )
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    parser.add_argument("--mlps", default="top", help="MLPs to prune (top, bottom)")
    parser.add_argument("--keep", type=float, default=0.5, help="share of hidden units kept")
    parser.add_argument("--prune-at", default="0.1, 0.5", help="fractions of the run")
    parser.add_argument("--grow-at", default="0.4, 0.8", help="fractions of the run")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the step timing")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    add_overrides_argument(parser)


BENCHMARK = Benchmark(
    help="growth and pruning against dense training (MLP FLOPs, wall-clock, test log-loss)",
    add_arguments=_add_arguments,
    run=_bench,
)
