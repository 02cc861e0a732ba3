"""``towerrec bench shampoo``: Shampoo against Adam and Adagrad on the dense part, trained
by ``towerrec train`` on N processes (blocks dealt over the ranks), at the same steps.

Each run is a ``towerrec train`` subprocess; the runs go round-robin over the optimizers
within each seed, so that a machine's drifting load falls on all of them alike. Per run:
validation AUC and log-loss, and the training time per step (``train_s`` of the summary:
the steps alone, no validation). Per model: the means over seeds, the AUC's spread
(sample standard deviation, lowest and highest), each optimizer's AUC minus Adam's seed
by seed (mean and standard deviation) and its step time over Adam's, from the means and
per seed. ``--set optimizer.shampoo.KEY=VALUE`` changes Shampoo's runs only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from towerrec.bench.common import Benchmark, add_overrides_argument, comma_list, machine_info

__all__ = ["BENCHMARK", "run_shampoo_benchmark"]

# A dense part with real compute: wide MLPs (DLRM) or a wide Wukong stack, on the planted data.
MODEL_OVERRIDES: dict[str, tuple[str, ...]] = {
    "dlrm": (
        "model.name=dlrm",
        "model.bottom_mlp=[512, 256, 16]",
        "model.top_mlp=[1024, 1024, 512, 1]",
    ),
    "wukong": (
        "model.name=wukong",
        "model.wukong.fm_mlp=[1024, 1024]",
        "model.top_mlp=[1024, 512, 1]",
    ),
}


def _train(
    out: Path, nproc: int, overrides: list[str], timeout_s: float, threads: int
) -> dict[str, float]:
    sets = [x for s in overrides for x in ("--set", s)]
    command = [sys.executable, "-m", "towerrec", "train", "--nproc", str(nproc), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run(
        [*command, *sets], capture_output=True, text=True, timeout=timeout_s, env=env
    )
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "auc": summary["auc"],
        "logloss": summary["logloss"],
        "step_ms": 1000 * summary["train_s"] / summary["steps"],
    }


def run_shampoo_benchmark(
    models: tuple[str, ...] = ("dlrm", "wukong"),
    optimizers: tuple[str, ...] = ("adam", "adagrad", "shampoo"),
    nproc: int = 2,
    seeds: int = 3,
    steps: int = 200,
    overrides: tuple[str, ...] = (),
    timeout_s: float = 1800.0,
    threads: int = 1,
) -> dict:
    unknown = [m for m in models if m not in MODEL_OVERRIDES]
    if unknown:
        raise ValueError(f"--models: unknown {unknown}; choose from {sorted(MODEL_OVERRIDES)}")
    if "adam" not in optimizers:
        raise ValueError("--optimizers must include adam: the step times are relative to it")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="towerrec-bench-shampoo-") as root:
        for model in models:
            for seed in range(seeds):
                for name in optimizers:
                    settings = [
                        *MODEL_OVERRIDES[model],
                        f"optimizer.name={name}",
                        f"train.seed={seed}",
                        f"train.steps={steps}",
                        "train.eval_every=0",
                        "train.progress=false",
                        *overrides,
                    ]
                    out = Path(root) / f"{model}-{name}-{seed}"
                    result = _train(out, nproc, settings, timeout_s, threads)
                    runs.append({"model": model, "optimizer": name, "seed": seed, **result})
    summary: dict[str, dict] = {}
    for model in models:
        means, spread, vs_adam = {}, {}, {}
        adam = {r["seed"]: r for r in runs if r["model"] == model and r["optimizer"] == "adam"}
        for name in optimizers:
            mine = [r for r in runs if r["model"] == model and r["optimizer"] == name]
            means[name] = {
                key: round(statistics.mean(r[key] for r in mine), 5)
                for key in ("auc", "logloss", "step_ms")
            }
            aucs = [r["auc"] for r in mine]
            spread[name] = {
                "auc_std": round(statistics.stdev(aucs), 5) if len(aucs) > 1 else 0.0,
                "auc_min": round(min(aucs), 5),
                "auc_max": round(max(aucs), 5),
            }
            # Seed by seed: runs of one seed share initialisation and data order.
            diffs = [r["auc"] - adam[r["seed"]]["auc"] for r in mine]
            ratios = [r["step_ms"] / adam[r["seed"]]["step_ms"] for r in mine]
            vs_adam[name] = {
                "auc_minus_adam": round(statistics.mean(diffs), 5),
                "auc_minus_adam_std": round(statistics.stdev(diffs), 5) if len(diffs) > 1 else 0.0,
                "step_time_per_seed": [round(x, 3) for x in ratios],
            }
        adam_ms = means["adam"]["step_ms"]
        summary[model] = {
            "mean": means,
            "spread": spread,
            "paired_with_adam": vs_adam,
            "step_time_vs_adam": {
                name: round(means[name]["step_ms"] / adam_ms, 3) for name in optimizers
            },
        }
    return {
        "benchmark": "shampoo",
        "machine": machine_info(),
        "nproc": nproc,
        "seeds": seeds,
        "steps": steps,
        "overrides": list(overrides),
        "runs": runs,
        "summary": summary,
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=comma_list, default=("dlrm", "wukong"))
    parser.add_argument("--optimizers", type=comma_list, default=("adam", "adagrad", "shampoo"))
    parser.add_argument("--nproc", type=int, default=2, help="ranks of each training run")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    add_overrides_argument(parser, "config override for every run")


def _run(args: argparse.Namespace) -> dict:
    return run_shampoo_benchmark(
        models=args.models,
        optimizers=args.optimizers,
        nproc=args.nproc,
        seeds=args.seeds,
        steps=args.steps,
        overrides=tuple(args.overrides),
        threads=args.threads,
    )


BENCHMARK = Benchmark(
    "Shampoo vs Adam and Adagrad on the dense part: AUC and step time, on N processes",
    _add_arguments,
    _run,
)
