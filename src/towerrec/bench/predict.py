"""``towerrec bench predict``: scoring throughput of an exported artefact, and what fp16 and
int8 tables cost in AUC.

::

    data set ─► towerrec train (a short run) ─► export fp32 | fp16 | int8 ─► predict the
                                                                            validation split
    per data set: AUC, log-loss and table bytes per table dtype, and the change from fp32
    default model: scoring samples/s (lookup + program, reading excluded) per thread count

Data sets: the synthetic default (DLRM, the built-in config) and the bundled MovieLens
(configs/movielens.toml). Runs are short (``--steps``): the table dtypes are compared on
the same trained weights, which is what the AUC change measures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from towerrec.bench.common import Benchmark, comma_list, machine_info
from towerrec.config import load_config
from towerrec.serve.artefact import load_artefact
from towerrec.serve.export import TableDtype, export_run
from towerrec.serve.predict import predict
from towerrec.workflows.training import train

__all__ = ["BENCHMARK"]

REPO = Path(__file__).resolve().parents[3]
DATASETS: dict[str, tuple[Path | None, list[str]]] = {
    "default": (None, []),
    "movielens": (REPO / "configs" / "movielens.toml", []),
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--datasets", type=comma_list, default=tuple(DATASETS))
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run")
    parser.add_argument("--batch-size", type=int, default=8192, help="samples per forward")
    parser.add_argument(
        "--threads", type=comma_list, default=("1", "2"), help="intra-op thread counts to time"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed passes (median reported)")
    parser.add_argument("--out", type=Path, help="keep the runs and artefacts here")


def _dataset(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    config_path, overrides = DATASETS[name]
    config = load_config(
        config_path, [*overrides, f"train.steps={args.steps}", "train.progress=false"]
    )
    run = root / name / "run"
    train(config, run)
    result: dict[str, Any] = {"train_steps": args.steps, "model": config.model.name}
    for dtype in TableDtype:
        artefact = root / name / dtype.value
        manifest = export_run(run, artefact, dtype)
        scored = predict(artefact, batch_size=args.batch_size, progress=False)
        result[dtype.value] = {
            "table_bytes": manifest["tables"]["bytes"],
            "auc": scored["auc"],
            "logloss": scored["logloss"],
            "eval_samples": scored["eval_samples"],
        }
    fp32 = result["fp32"]
    for dtype in ("fp16", "int8"):
        result[dtype]["auc_change"] = result[dtype]["auc"] - fp32["auc"]
        result[dtype]["logloss_change"] = result[dtype]["logloss"] - fp32["logloss"]
        result[dtype]["table_bytes_ratio"] = result[dtype]["table_bytes"] / fp32["table_bytes"]
    if name == "default":
        result["throughput"] = _throughput(root / name, args)
    return result


def _throughput(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Scoring samples/s of each table dtype and thread count (median of the repeats),
    the tables and program loaded once."""
    out: dict[str, Any] = {}
    before = torch.get_num_threads()
    try:
        for threads in (int(t) for t in args.threads):
            torch.set_num_threads(threads)
            for dtype in TableDtype:
                artefact = load_artefact(root / dtype.value)
                rates = [
                    predict(
                        root / dtype.value,
                        batch_size=args.batch_size,
                        progress=False,
                        artefact=artefact,
                    )["samples_per_s"]
                    for _ in range(args.repeats)
                ]
                out[f"{dtype.value}_threads_{threads}"] = statistics.median(rates)
    finally:
        torch.set_num_threads(before)
    return out


def _run(args: argparse.Namespace) -> dict[str, Any]:
    unknown = [d for d in args.datasets if d not in DATASETS]
    if unknown:
        raise ValueError(f"--datasets: unknown {unknown}; choose from {list(DATASETS)}")
    result: dict[str, Any] = {
        "benchmark": "predict",
        "machine": machine_info(),
        "batch_size": args.batch_size,
    }
    with tempfile.TemporaryDirectory(prefix="towerrec-bench-predict-") as scratch:
        root = args.out or Path(scratch)
        for name in args.datasets:
            result[name] = _dataset(name, args, root)
    default = result.get("default", {}).get("throughput", {})
    if default:
        best = max(default.values())
        result["target_samples_per_s"] = 100_000
        result["best_samples_per_s"] = best
        result["meets_target"] = best >= 100_000
    return result


BENCHMARK = Benchmark(
    help="predict throughput of an exported model and the AUC change of fp16 / int8 tables",
    add_arguments=_add_arguments,
    run=_run,
)
