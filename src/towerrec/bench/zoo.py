"""Model-zoo and memory-efficient-embedding benchmarks that print JSON.

- ``models``: DLRM vs DCNv2 vs Wukong at matched FLOPs per sample, on planted
  data whose labels are mostly high-order (3-way) interactions.
- ``embeddings-memory``: AUC and log-loss against embedding parameters for
  full, hashed, quotient-remainder (2x, 4x, 16x fewer rows) and
  mixed-dimension (alpha 0.2 to 0.4) tables.
- ``optimizers``: CF-SGD against row-wise Adagrad.
(``precision``, bf16 against fp32, is in ``precision.py`` on this module's sweep.)

Every variant trains with ``towerrec.workflows.training.train`` on the same data
stream and seed, so AUC differences come from the variant alone. With
``seeds = N`` every variant trains N times, run s with model-init seed s
(``train.seed``) and data-order seed s (``data.loader.seed`` for file data;
``data.synthetic.stream_seed``, another draw of training samples from the same
teacher, for planted data); the result then holds the mean, the standard
deviation over seeds and the per-seed values of AUC and log-loss. Seed 0 is
the one-seed run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from towerrec.bench.common import (
    Benchmark,
    add_overrides_argument,
    comma_list,
    machine_info,
)
from towerrec.build.models import build_model
from towerrec.build.sources import build_source
from towerrec.config import load_config
from towerrec.workflows.training import train

__all__ = [
    "BENCHMARKS",
    "EMBEDDINGS_MEMORY",
    "MODELS",
    "OPTIMIZERS",
    "Sweep",
    "add_sweep_arguments",
    "paired_difference",
    "run_zoo_benchmark",
    "seed_stats",
]

# Labels mostly from 3-way interactions: what Wukong's stacked FMs are for.
HIGH_ORDER = [
    "data.synthetic.first_order_share=0.1",
    "data.synthetic.pairwise_share=0.3",
    "data.synthetic.higher_order_share=0.6",
    "data.synthetic.num_triples=8",
]
SUMMARY_KEYS = (
    "auc",
    "logloss",
    "ne",
    "oracle_auc",
    "samples_per_s",
    "num_dense_params",
    "num_embedding_params",
    "flops_per_sample",
    "hash_collisions",
    "backend",
    "steps",
    "best_step",
)


@dataclass
class Sweep:
    """Trains variants of one base config (``extra`` overrides apply to every variant)."""

    steps: int
    batch_size: int
    device: str
    root: Path
    extra: tuple[str, ...] = ()
    only: tuple[str, ...] = ()  # variant names to run; empty: all
    seeds: int = 1
    base: Path | None = None  # the config file every variant starts from; None: the defaults

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {self.seeds}")
        if self.steps < 0 or self.batch_size < 0:
            raise ValueError(
                f"--steps {self.steps} / --batch-size {self.batch_size}: each must be >= 1, "
                "or 0 for the config's own (training to convergence with its early stopping)"
            )
        self._schemas: dict = {}

    def select(self, variants: dict[str, list[str]]) -> dict[str, list[str]]:
        unknown = sorted(set(self.only) - set(variants))
        if unknown:
            raise ValueError(f"unknown variants {unknown}; choose from {', '.join(variants)}")
        return {n: o for n, o in variants.items() if not self.only or n in self.only}

    def config(self, overrides: list[str]):
        return load_config(self.base, [*overrides, *self.extra])

    def flops(self, overrides: list[str]) -> int:
        """Forward FLOPs per sample of the model on the configured data's schema."""
        config = self.config(overrides)
        key = repr(config.data)
        if key not in self._schemas:  # reading MovieLens once, not per width tried
            self._schemas[key] = build_source(config.data).schema
        return build_model(config, self._schemas[key], torch.device("cpu")).flops_per_sample()  # type: ignore[operator]  # duck-typed model attribute (nn.Module types it Tensor | Module)

    def run_one(self, overrides: list[str], seed: int = 0) -> dict:
        seeded = []
        if seed:
            seeded = [
                f"train.seed={seed}",
                f"data.loader.seed={seed}",
                f"data.synthetic.stream_seed={seed}",
            ]
        # --steps 0: the config's own length (on data with a validation split, epochs
        # until early stopping, the best weights kept); --batch-size 0: its own batch
        length = [f"train.steps={self.steps}", "train.eval_every=0"] if self.steps else []
        batch = [f"train.batch_size={self.batch_size}"] if self.batch_size else []
        config = self.config(
            [
                *length,
                *batch,
                "train.progress=false",
                f"train.device={self.device}",
                *overrides,
                *seeded,
            ]
        )
        out = Path(tempfile.mkdtemp(dir=self.root))
        with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON result
            summary = train(config, out)
        result: dict[str, Any] = {k: summary.get(k) for k in SUMMARY_KEYS}
        test = summary.get("test") or {}  # the returned weights on the test split, if any
        result["test_auc"] = test.get("auc")
        for key in ("auc", "logloss", "ne", "oracle_auc", "test_auc"):
            result[key] = round(result[key], 5) if result[key] is not None else None
        result["samples_per_s"] = round(result["samples_per_s"], 1)
        return result

    def run(self, overrides: list[str]) -> dict:
        """One variant: its result, or with ``seeds > 1`` the mean over seeds (``seed_stats``)."""
        runs = [self.run_one(overrides, seed) for seed in range(self.seeds)]
        return runs[0] if self.seeds == 1 else seed_stats(runs)


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def seed_stats(runs: list[dict]) -> dict:
    """Runs of one variant over seeds 0..N-1: seed 0's sizes and FLOPs; the mean of the
    metrics, their sample standard deviation (``*_std``) and per-seed values (``per_seed``)."""
    result = dict(runs[0])
    for key in ("auc", "logloss", "ne", "samples_per_s", "test_auc"):
        values = [r[key] for r in runs if r[key] is not None]
        if len(values) == len(runs):
            mean, std = _mean_std(values)
            digits = 1 if key == "samples_per_s" else 5
            result[key], result[f"{key}_std"] = round(mean, digits), round(std, digits)
    result["per_seed"] = [
        {"seed": s, "auc": r["auc"], "logloss": r["logloss"], "test_auc": r.get("test_auc")}
        for s, r in enumerate(runs)
    ]
    return result


def paired_difference(result: dict, baseline: dict, key: str = "auc") -> tuple[float, float]:
    """Mean and standard deviation over seeds of ``result[key] - baseline[key]``, seed by seed
    (runs with the same seed share data order and initialisation)."""
    if "per_seed" not in result:
        return round(result[key] - baseline[key], 5), 0.0
    diffs = [a[key] - b[key] for a, b in zip(result["per_seed"], baseline["per_seed"])]
    mean, std = _mean_std(diffs)
    return round(mean, 5), round(std, 5)


def _matched_width(sweep: Sweep, prefix: list[str], target: int) -> tuple[int, int]:
    """The width w of ``top_mlp = [w, w/2, 1]`` whose FLOPs per sample come closest to target."""
    best = (0, 0)
    lo, hi = 4, 4096
    while hi - lo > 1:  # FLOPs grow with w
        mid = (lo + hi) // 2
        if sweep.flops([*prefix, f"model.top_mlp=[{mid}, {mid // 2}, 1]"]) < target:
            lo = mid
        else:
            hi = mid
    for w in (lo, hi):
        flops = sweep.flops([*prefix, f"model.top_mlp=[{w}, {w // 2}, 1]"])
        if not best[0] or abs(flops - target) < abs(best[1] - target):
            best = (w, flops)
    return best


def models_benchmark(sweep: Sweep) -> dict:
    wukong = [*HIGH_ORDER, "model.name=wukong"]
    target = sweep.flops(wukong)
    variants = {"wukong": wukong}
    widths = {}
    for name, extra in (
        ("dlrm", ["model.name=dlrm"]),
        ("dcn", ["model.name=dcn", "model.dcn.num_layers=2", "model.dcn.rank=16"]),
    ):
        width, _ = _matched_width(sweep, [*HIGH_ORDER, *extra], target)
        widths[name] = [width, width // 2, 1]
        variants[name] = [*HIGH_ORDER, *extra, f"model.top_mlp=[{width}, {width // 2}, 1]"]
    results = {name: sweep.run(o) for name, o in variants.items()}
    for name in ("dlrm", "dcn"):
        mean, std = paired_difference(results["wukong"], results[name])
        results[name]["wukong_auc_minus_this"] = mean
        if sweep.seeds > 1:
            results[name]["wukong_auc_minus_this_std"] = std
    return {
        "target_flops_per_sample": target,
        "top_mlp": widths,
        "data": HIGH_ORDER,
        "results": results,
    }


def embedding_variants() -> dict[str, list[str]]:
    variants: dict[str, list[str]] = {"full": []}
    for c in (2, 4, 16):
        variants[f"hash_{c}x"] = ["embedding.kind=hash", f"embedding.compression={c}"]
    for c in (2, 4, 16):
        variants[f"qr_mult_{c}x"] = ["embedding.kind=qr", f"embedding.compression={c}"]
    for op in ("add", "concat"):
        variants[f"qr_{op}_4x"] = [
            "embedding.kind=qr",
            "embedding.compression=4",
            f"embedding.qr_operation={op}",
        ]
    variants["qr_mult_crt3_16x"] = [
        "embedding.kind=qr",
        "embedding.compression=16",
        "embedding.qr_partitions=3",
        "embedding.qr_scheme=crt",
    ]
    for alpha in (0.2, 0.3, 0.4):
        variants[f"md_{alpha}"] = ["embedding.kind=md", f"embedding.md_alpha={alpha}"]
    return variants


def embeddings_benchmark(sweep: Sweep) -> dict:
    results = {name: sweep.run(o) for name, o in sweep.select(embedding_variants()).items()}
    full = results.get("full")
    for r in results.values() if full else ():
        assert full is not None  # the loop runs only with a full-table result
        r["param_ratio"] = round(full["num_embedding_params"] / r["num_embedding_params"], 2)
        r["auc_minus_full"], std = paired_difference(r, full)
        if sweep.seeds > 1:
            r["auc_minus_full_std"] = std
    return {"results": results}


def optimizers_benchmark(sweep: Sweep) -> dict:
    variants = {
        "rowwise_adagrad": ["embedding.optimizer=rowwise_adagrad"],
        "cf_sgd": ["embedding.optimizer=cf_sgd", "embedding.lr=0.05"],
        "cf_sgd_halflife_200": [
            "embedding.optimizer=cf_sgd",
            "embedding.lr=0.05",
            "embedding.counter_halflife=200",
        ],
        "rowwise_adagrad_torch": ["embedding.optimizer=rowwise_adagrad", "embedding.backend=torch"],
    }
    return {"results": {n: sweep.run(o) for n, o in sweep.select(variants).items()}}


BENCHMARKS = {
    "models": models_benchmark,
    "embeddings-memory": embeddings_benchmark,
    "optimizers": optimizers_benchmark,
}


def run_zoo_benchmark(
    name: str,
    steps: int,
    batch_size: int,
    device: str = "cpu",
    threads: int = 1,
    overrides: list[str] | tuple[str, ...] = (),
    variants: list[str] | tuple[str, ...] = (),
    seeds: int = 1,
    base: Path | None = None,
    benchmark: Callable[[Sweep], dict] | None = None,
) -> dict:
    """``threads``: torch intra-op threads (1 keeps a shared machine's cores from
    thrashing); ``overrides``: ``section.key=value`` settings for every variant;
    ``seeds``: runs per variant (module docstring); ``base``: the config file every
    variant starts from; ``benchmark``: what runs on the sweep (default: ``name``'s
    entry of ``BENCHMARKS``)."""
    if threads:
        torch.set_num_threads(threads)
    load_config(base, list(overrides))  # a bad override fails now, not after the first run
    # each run sets its own threads (train.threads; 0: the cores): the same number
    extra = (*overrides, f"train.threads={threads}") if threads else tuple(overrides)
    with tempfile.TemporaryDirectory() as root:
        sweep = Sweep(steps, batch_size, device, Path(root), extra, tuple(variants), seeds, base)
        result = (benchmark or BENCHMARKS[name])(sweep)
    return {
        "benchmark": name,
        "machine": machine_info(),
        "steps": steps,
        "batch_size": batch_size,
        "seeds": seeds,
        "config": str(base) if base is not None else None,
        "overrides": list(overrides),
        **result,
    }


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of every benchmark on a ``Sweep`` (this module's and ``precision``)."""
    parser.add_argument(
        "--steps",
        type=int,
        default=600,
        help="training steps per variant; 0: the config's own (to convergence, early stopping)",
    )
    parser.add_argument("--batch-size", type=int, default=2048, help="0: the config's own")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    add_overrides_argument(
        parser, "config override for every variant, e.g. --set data.synthetic.seed=1"
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="config file every variant starts from (default: the built-in defaults)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="runs per variant (model-init and data-order seeds 0..N-1): mean and std",
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_sweep_arguments(parser)
    parser.add_argument(
        "--variants",
        default="",
        help="comma-separated variants of embeddings-memory or optimizers (default: all)",
    )


def _declare(name: str, help: str) -> Benchmark:
    def run(args: argparse.Namespace) -> dict:
        return run_zoo_benchmark(
            name,
            args.steps,
            args.batch_size,
            args.device,
            args.threads,
            args.overrides,
            list(comma_list(args.variants)),
            args.seeds,
            args.config,
        )

    return Benchmark(help, _add_arguments, run)


MODELS = _declare("models", "DLRM vs DCNv2 vs Wukong at matched FLOPs per sample (planted data)")
EMBEDDINGS_MEMORY = _declare(
    "embeddings-memory", "AUC vs parameters: full, hash, QR and mixed-dimension tables"
)
OPTIMIZERS = _declare("optimizers", "CF-SGD vs row-wise Adagrad on the embedding tables")
