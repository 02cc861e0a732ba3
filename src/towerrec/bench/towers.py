"""``towerrec bench towers``: DMT with compressing towers under each partition strategy.

On the synthetic planted-truth data (the default config), one run each of:
flat DLRM (the reference), DMT with identity towers (the same function as
DLRM, the features routed through towers), and DMT with the same
compressing towers over the partition
found by the tower partitioner (from a short DLRM pilot run), the cost-only
partition and a few random ones. Reported per run: eval AUC and log-loss,
the share of the pair-interaction mass cut between towers (learned: the pilot
model's attribution; planted: the teacher's true pair strength), the towers'
cost imbalance, and the floats per sample the towers send back next to what
the flat model's pooled embeddings are.

``--seeds N`` instead compares the four partitioners over N seeds
(``compare_partitioners``): for each ``train.seed``, one pilot DLRM run gives
the interaction strength and the feature embeddings; DMT is trained under the
interaction-strength partition (``auto``), the embedding clusters
(``embedding``), a random partition of that seed and the cost-only one; eval
AUC and log-loss are reported per run and as mean and std per partitioner.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from towerrec.bench.common import (
    Benchmark,
    add_overrides_argument,
    machine_info,
    time_interleaved,
)
from towerrec.build.models import build_model, feature_stats
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.build.sources import build_source
from towerrec.build.towers import learn_interaction_strength, learn_pilot_signals
from towerrec.config import Config, load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.models.dmt import TowerKind
from towerrec.planner.towers import (
    cluster_features,
    cost_partition,
    cross_tower_mass,
    evaluate_partition,
    feature_costs,
    partition_features,
    random_partition,
)
from towerrec.train.step import train_step
from towerrec.workflows.training import train

__all__ = ["BENCHMARK", "compare_partitioners", "run_towers_benchmark", "step_time_ratios"]

PARTITIONERS = ("interaction", "embedding", "random", "cost_only")


def _with_partition(config: Config, groups: list[list[str]]) -> Config:
    dmt = dataclasses.replace(
        config.model.dmt, partition=tuple(tuple(g) for g in groups), num_towers=len(groups)
    )
    return dataclasses.replace(config, model=dataclasses.replace(config.model, name="dmt", dmt=dmt))


def _train(config: Config) -> dict:
    # the trainer writes its eval lines to stdout; keep stdout for the JSON
    with (
        tempfile.TemporaryDirectory(prefix="towerrec-bench-towers-") as out,
        contextlib.redirect_stdout(sys.stderr),
    ):
        summary = train(config, Path(out) / "run")
    return {
        "auc": summary["auc"],
        "logloss": summary["logloss"],
        "samples_per_s": summary["samples_per_s"],
        "flops_per_sample": summary["flops_per_sample"],
    }


def step_time_ratios(config: Config, groups: list[list[str]], rounds: int = 5) -> dict:
    """Single-device train-step time of flat DLRM, identity DMT and compressing DMT,
    timed round-robin on the same batches (``time_interleaved``), as ratios to flat."""
    source = SyntheticSource(config.data.synthetic)
    batch_size = config.train.batch_size
    batches = [source.samples("train", i * batch_size, batch_size)[0] for i in range(4)]
    identity = dataclasses.replace(
        config.model.dmt, tower=TowerKind.IDENTITY, partition=tuple(tuple(g) for g in groups)
    )
    systems = {
        "flat_dlrm": config,
        "dmt_identity": dataclasses.replace(
            config, model=dataclasses.replace(config.model, name="dmt", dmt=identity)
        ),
        "dmt_compressing": _with_partition(config, groups),
    }
    steps = {}
    for name, cfg in systems.items():
        model = build_model(cfg, source.schema, torch.device("cpu"))
        optimizer = build_dense_optimizer(cfg.optimizer, model)
        steps[name] = lambda i, m=model, o=optimizer: train_step(m, o, batches[i % len(batches)])
    seconds = time_interleaved(steps, rounds=rounds, steps_per_round=5, warmup=3)
    return {
        "seconds_per_step": seconds,
        "samples_per_s": {k: batch_size / v for k, v in seconds.items()},
        "step_time_vs_flat": {k: v / seconds["flat_dlrm"] for k, v in seconds.items()},
    }


def run_towers_benchmark(
    *,
    steps: int = 2500,
    num_towers: int = 2,
    tower: str = "dot",
    tower_outputs: int = 1,
    random_seeds: int = 3,
    pilot_steps: int = 300,
    threads: int = 0,
    overrides: tuple[str, ...] = (),
    throughput_only: bool = False,
) -> dict:
    base = load_config(
        None,
        [
            f"train.steps={steps}",
            "train.eval_every=0",
            "train.progress=false",
            f"train.threads={threads}",
            f"model.dmt.tower={tower}",
            f"model.dmt.tower_outputs={tower_outputs}",
            *overrides,
        ],
    )
    source = SyntheticSource(base.data.synthetic)
    names = source.schema.sparse_names
    planted = source.planted_pair_strength()
    learned = learn_interaction_strength(base, pilot_steps)
    dmt = base.model.dmt
    costs = feature_costs(feature_stats(base, source.schema), dmt.memory_weight, dmt.count_weight)
    tolerance = base.model.dmt.balance_tolerance
    partitions = {
        "partitioner": partition_features(
            names, learned, costs, num_towers, tolerance=tolerance, seed=base.train.seed
        ).groups,
        "cost_only": cost_partition(names, costs, num_towers),
    }
    for seed in range(random_seeds):
        partitions[f"random_{seed}"] = random_partition(names, num_towers, seed=seed)

    if threads:
        torch.set_num_threads(threads)
    throughput = step_time_ratios(base, partitions["partitioner"])
    if throughput_only:
        return {"benchmark": "towers", "machine": machine_info(), "throughput": throughput}
    dim = base.model.embedding_dim
    runs: dict[str, dict] = {
        "flat_dlrm": {**_train(base), "floats_to_top_per_sample": len(names) * dim}
    }
    identity = dataclasses.replace(
        _with_partition(base, partitions["partitioner"]).model.dmt, tower=TowerKind.IDENTITY
    )
    runs["dmt_identity"] = {
        **_train(
            dataclasses.replace(
                base, model=dataclasses.replace(base.model, name="dmt", dmt=identity)
            )
        ),
        "groups": partitions["partitioner"],
        "floats_to_top_per_sample": len(names) * dim,
        "compression_ratio": 1.0,
    }
    for name, groups in partitions.items():
        quality = evaluate_partition(learned, costs, names, groups)
        vectors = sum(
            len(g) if base.model.dmt.tower == "identity" else tower_outputs for g in groups
        )
        runs[f"dmt_{name}"] = {
            **_train(_with_partition(base, groups)),
            "groups": groups,
            "learned_cross_mass": quality.cross_mass,
            "planted_cross_mass": evaluate_partition(planted, costs, names, groups).cross_mass,
            "cost_imbalance": quality.imbalance,
            "floats_to_top_per_sample": vectors * dim,
            "compression_ratio": len(names) / vectors,
        }
    random_aucs = [runs[f"dmt_random_{s}"]["auc"] for s in range(random_seeds)]
    ours = runs["dmt_partitioner"]["auc"]
    return {
        "benchmark": "towers",
        "machine": machine_info(),
        "steps": steps,
        "batch_size": base.train.batch_size,
        "pilot_steps": pilot_steps,
        "num_towers": num_towers,
        "tower": str(base.model.dmt.tower),
        "tower_outputs": tower_outputs,
        "runs": runs,
        "throughput": throughput,
        "summary": {
            "auc_flat_minus_partitioner": runs["flat_dlrm"]["auc"] - ours,
            "auc_partitioner_minus_random_mean": ours - float(np.mean(random_aucs))
            if random_aucs
            else None,
            "auc_partitioner_minus_cost_only": ours - runs["dmt_cost_only"]["auc"],
        },
    }


def _mean_std(values: list[float]) -> dict:
    return {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1))}


def compare_partitioners(
    *,
    seeds: int = 5,
    steps: int = 400,
    num_towers: int = 2,
    pilot_steps: int = 200,
    threads: int = 0,
    overrides: tuple[str, ...] = (),
    config_path: str | None = None,
) -> dict:
    """DMT trained under each of ``PARTITIONERS`` for ``train.seed`` in ``range(seeds)``
    (module doc); std is the sample std over seeds, ``ddof = 1``."""
    if seeds < 2:
        raise ValueError(f"--seeds must be >= 2 for a spread over seeds, got {seeds}")
    if threads:
        torch.set_num_threads(threads)
    base = load_config(
        Path(config_path) if config_path else None,
        [
            f"train.steps={steps}",
            "train.eval_every=0",
            "train.progress=false",
            f"train.threads={threads}",
            "model.name=dmt",
            f"model.dmt.num_towers={num_towers}",
            *overrides,
        ],
    )
    data = build_source(base.data)
    source = data if isinstance(data, SyntheticSource) else None  # with a planted truth
    schema = data.schema
    runs: list[dict] = []
    for seed in range(seeds):
        config = dataclasses.replace(base, train=dataclasses.replace(base.train, seed=seed))
        names = schema.sparse_names
        dmt = config.model.dmt
        costs = feature_costs(feature_stats(config, schema), dmt.memory_weight, dmt.count_weight)
        strength, vectors = learn_pilot_signals(config, pilot_steps)
        tolerance = dmt.balance_tolerance
        partitions = {
            "interaction": partition_features(
                names, strength, costs, num_towers, tolerance=tolerance, seed=seed
            ).groups,
            "embedding": cluster_features(
                names, vectors, costs, num_towers, tolerance=tolerance, seed=seed
            ).groups,
            "random": random_partition(names, num_towers, seed=seed),
            "cost_only": cost_partition(names, costs, num_towers),
        }
        for name, groups in partitions.items():
            run = {"seed": seed, "partitioner": name, "groups": groups}
            run |= _train(_with_partition(config, groups))
            run["learned_cross_mass"] = cross_tower_mass(strength, names, groups)
            if source is not None:
                planted = source.planted_pair_strength()
                run["planted_cross_mass"] = cross_tower_mass(planted, names, groups)
            runs.append(run)
    summary: dict[str, dict] = {}
    for name in PARTITIONERS:
        mine = [r for r in runs if r["partitioner"] == name]
        summary[name] = {
            "auc": _mean_std([r["auc"] for r in mine]),
            "logloss": _mean_std([r["logloss"] for r in mine]),
        }
        if source is not None:
            summary[name]["planted_cross_mass"] = _mean_std([r["planted_cross_mass"] for r in mine])
    by_seed = {(r["seed"], r["partitioner"]): r for r in runs}
    paired = [
        by_seed[(s, "embedding")]["auc"] - by_seed[(s, "interaction")]["auc"] for s in range(seeds)
    ]
    return {
        "benchmark": "towers",
        "mode": "seeds",
        "machine": machine_info(),
        "data": str(base.data.source),
        "config": config_path,
        "seeds": seeds,
        "steps": steps,
        "batch_size": base.train.batch_size,
        "pilot_steps": pilot_steps,
        "num_towers": num_towers,
        "tower": str(base.model.dmt.tower),
        "summary": summary,
        "auc_embedding_minus_interaction": _mean_std(paired),
        "runs": runs,
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=2500, help="training steps per run")
    parser.add_argument("--num-towers", type=int, default=2)
    parser.add_argument("--tower", default="dot", help="tower kind: dot, fm or identity")
    parser.add_argument("--tower-outputs", type=int, default=1, help="vectors out per tower")
    parser.add_argument("--random-seeds", type=int, default=3, help="random partitions to train")
    parser.add_argument("--pilot-steps", type=int, default=300, help="steps of the pilot run")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    add_overrides_argument(parser, "config override for every run")
    parser.add_argument(
        "--throughput-only", action="store_true", help="only the side-by-side step timing"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=0,
        help="compare the interaction, embedding, random and cost-only partitions over this "
        "many train.seed values (mean and std); --steps, --num-towers, --pilot-steps, "
        "--threads, --config and --set apply",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="with --seeds: a config file to start from (e.g. "
        "configs/movielens.toml); default: the built-in synthetic config",
    )


def _run(args: argparse.Namespace) -> dict:
    if args.config and not args.seeds:
        raise ValueError(
            "--config applies to the comparison over seeds only: add --seeds N (e.g. --seeds 5)"
        )
    if args.seeds:
        return compare_partitioners(
            seeds=args.seeds,
            steps=args.steps,
            num_towers=args.num_towers,
            pilot_steps=args.pilot_steps,
            threads=args.threads,
            overrides=tuple(args.overrides),
            config_path=args.config,
        )
    return run_towers_benchmark(
        steps=args.steps,
        num_towers=args.num_towers,
        tower=args.tower,
        tower_outputs=args.tower_outputs,
        random_seeds=args.random_seeds,
        pilot_steps=args.pilot_steps,
        threads=args.threads,
        overrides=tuple(args.overrides),
        throughput_only=args.throughput_only,
    )


BENCHMARK = Benchmark(
    "DMT compressing towers: learned vs random vs cost-only partitions", _add_arguments, _run
)
