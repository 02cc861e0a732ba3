"""``towerrec bench precision``: bf16 autocast of the dense part against fp32.

Two measurements, each side by side in one process:

- speed: training steps of the Criteo-Kaggle-shaped DLRM (``bench/train.py``) in fp32
  and under bf16 autocast, timed round-robin (wall and CPU time), beside the matmul
  peaks of both dtypes (``bench/roofline.py``);
- quality: the same config trained in fp32 and in bf16 (``train.precision``) over
  ``--seeds`` seeds on the data the config names (planted data by default; MovieLens
  with ``--config configs/movielens.toml``; a Criteo-format cache with ``--set
  data.source=criteo --set data.path=DIR``). Runs of one seed share data order and
  initialisation, so the AUC difference is taken seed by seed (``auc_bf16_minus_fp32``,
  mean and sample std over seeds; on the test split too, where the data has one).
  ``within_noise``: the mean difference is no larger than fp32's own spread over seeds
  (its AUC's sample std), and no larger than two standard errors of the paired
  difference; ``not_worse``: bf16's mean is at most fp32's spread below fp32's (a
  consistent gain counts, which ``within_noise`` flags).
"""

from __future__ import annotations

import argparse
import math

import torch

from towerrec.bench.common import Benchmark, time_interleaved
from towerrec.bench.roofline import matmul_peak
from towerrec.bench.train import CRITEO_SHAPE, DENSE_LR, EMB_LR, build_tables, make_batches
from towerrec.bench.zoo import Sweep, add_sweep_arguments, paired_difference, run_zoo_benchmark
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.train.step import train_step

__all__ = ["BENCHMARK", "criteo_shape_timing", "quality_verdict"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def criteo_shape_timing(device: torch.device, batch_size: int = 2048) -> dict:
    """Samples/s and CPU ms per step of the Criteo-shaped DLRM in fp32 and bf16."""
    batches = [b.to(device) for b in make_batches(CRITEO_SHAPE, batch_size)]
    systems = {}
    for name, dtype in PRECISIONS.items():
        ebc = EmbeddingBagCollection(
            build_tables(CRITEO_SHAPE), EmbeddingOptimizerConfig(lr=EMB_LR), device=device
        )
        torch.manual_seed(0)
        shape = CRITEO_SHAPE
        model = DLRM(ebc, shape["num_dense"], shape["bottom_mlp"], shape["top_mlp"]).to(device)
        opt = torch.optim.Adam([p for _, p in dense_parameters(model)], lr=DENSE_LR, fused=True)

        def step(i: int, m: DLRM = model, o: torch.optim.Optimizer = opt, dt=dtype) -> None:
            train_step(m, o, batches[i % len(batches)], dt)
            if device.type == "cuda":
                torch.cuda.synchronize()

        systems[name] = step
    cpu: dict[str, float] = {}
    seconds = time_interleaved(systems, rounds=5, steps_per_round=4, warmup=3, cpu_seconds=cpu)
    return {
        "batch_size": batch_size,
        "samples_per_s": {n: round(batch_size / s, 1) for n, s in seconds.items()},
        "cpu_ms_per_step": {n: round(c * 1e3, 2) for n, c in cpu.items()},
        "bf16_over_fp32_samples_per_s": round(seconds["fp32"] / seconds["bf16"], 3),
        "bf16_over_fp32_cpu_time": round(cpu["fp32"] / cpu["bf16"], 3),
        "matmul_peak_gflops": {
            n: round(matmul_peak(device, dt or torch.float32, seconds=0.5) / 1e9, 1)
            for n, dt in PRECISIONS.items()
        },
    }


def quality_verdict(bf16: dict, fp32: dict) -> dict:
    """The AUC difference bf16 - fp32 seed by seed, and whether it is within noise
    (module doc)."""
    mean, std = paired_difference(bf16, fp32)
    seeds = len(fp32.get("per_seed", [fp32]))
    spread = fp32.get("auc_std", 0.0)
    two_se = 2 * std / math.sqrt(seeds) if seeds > 1 else 0.0
    out = {
        "auc_bf16_minus_fp32": mean,
        "auc_bf16_minus_fp32_std": std,
        "fp32_auc_std": spread,
        "within_noise": seeds > 1 and abs(mean) <= spread and abs(mean) <= two_se,
        # the default's question: is bf16 no worse than fp32's own spread over seeds?
        "not_worse": seeds > 1 and mean >= -spread,
    }
    if fp32.get("test_auc") is not None and bf16.get("test_auc") is not None:
        test_mean, test_std = paired_difference(bf16, fp32, "test_auc")
        out.update(test_auc_bf16_minus_fp32=test_mean, test_auc_bf16_minus_fp32_std=test_std)
    return out


def precision_sweep(sweep: Sweep, timing: bool) -> dict:
    device = _device(sweep.device)
    result: dict = {"device": str(device)}
    if timing:
        result["criteo_shape_timing"] = criteo_shape_timing(device)
    runs = {p: sweep.run([f"train.precision={p}"]) for p in PRECISIONS}
    result["quality"] = {**runs, **quality_verdict(runs["bf16"], runs["fp32"])}
    return result


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_sweep_arguments(parser)
    parser.add_argument(
        "--no-timing",
        action="store_true",
        help="skip the Criteo-shape samples/s (quality runs only)",
    )


def _run(args: argparse.Namespace) -> dict:
    return run_zoo_benchmark(
        "precision",
        args.steps,
        args.batch_size,
        args.device,
        args.threads,
        args.overrides,
        seeds=args.seeds,
        base=args.config,
        benchmark=lambda sweep: precision_sweep(sweep, timing=not args.no_timing),
    )


BENCHMARK = Benchmark(
    "bf16 autocast vs fp32: samples/s (Criteo shape) and AUC", _add_arguments, _run
)
