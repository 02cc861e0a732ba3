"""``towerrec`` command line: train | bench.

User errors (bad config, missing files, bad data) print one ``error:`` line
and exit with status 2; anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

__all__ = ["main"]

log = logging.getLogger("towerrec")

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, ImportError)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set train.steps=200 (repeatable)",
    )


def _cmd_train(args: argparse.Namespace) -> int:
    from towerrec.config import load_config
    from towerrec.train.run_dir import default_run_dir
    from towerrec.train.trainer import train

    config = load_config(args.config, args.overrides)
    out = args.out or default_run_dir()
    log.info("run directory: %s", out)
    if "WORLD_SIZE" in os.environ:  # already a worker of torchrun: train, don't launch
        if args.hosts > 1:
            os.environ["TOWERREC_HOSTS"] = str(args.hosts)
        summary = train(config, out, resume=args.resume)
        if os.environ.get("RANK", "0") != "0":
            return 0
    elif args.nproc > 1 or args.hosts > 1:
        summary = _launch_train(args, out)
    else:
        summary = train(config, out, resume=args.resume)
    oracle = summary.get("oracle_auc")
    line = f"AUC {summary['auc']:.4f}"
    if oracle is not None:
        line += f" (oracle AUC {oracle:.4f}, gap {oracle - summary['auc']:.4f})"
    line += (
        f", log-loss {summary['logloss']:.4f}, NE {summary['ne']:.4f}, "
        f"{summary['samples_per_s']:,.0f} samples/s over {summary['steps']} steps"
    )
    print(line)
    print(f"results in {out}/ (summary.json, metrics.jsonl, curves.png, checkpoint/)")
    return 0


def _launch_train(args: argparse.Namespace, out: Path) -> dict:
    """``--nproc N``: N local workers through torch.distributed's elastic launcher."""
    from towerrec.distributed.launch import WorkerError, launch
    from towerrec.train.distributed import train_worker

    try:
        results = launch(
            train_worker,
            (args.config, args.overrides, out, args.resume),
            nproc=args.nproc,
            hosts=args.hosts,
            max_restarts=args.max_restarts,
        )
    except WorkerError as e:
        raise ValueError(f"a worker failed: {e}") from None
    return results[0]


def _cmd_bench_train(args: argparse.Namespace) -> int:
    from towerrec.bench.train import run_train_benchmark

    result = run_train_benchmark(
        steps=args.steps,
        warmup=args.warmup,
        backends=args.backends,
        torchrec=not args.no_torchrec,
        batch_size=args.batch_size,
    )
    _print_result(result, args.json)
    return 0


def _cmd_bench_embedding(args: argparse.Namespace) -> int:
    from towerrec.bench.embedding import run_embedding_benchmark

    result = run_embedding_benchmark(
        steps=args.steps,
        warmup=args.warmup,
        backends=args.backends,
        torchrec=not args.no_torchrec,
    )
    _print_result(result, args.json)
    return 0


def _cmd_bench_dist(args: argparse.Namespace) -> int:
    from towerrec.bench.dist import run_dist_benchmark

    result = run_dist_benchmark(
        nprocs=tuple(int(n) for n in args.nproc.split(",")),
        types=tuple(args.types.split(",")),
        steps=args.steps,
        rounds=args.rounds,
        torchrec=not args.no_torchrec,
    )
    _print_result(result, args.json)
    return 0


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        print(f"{key}: {json.dumps(value)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="towerrec", description="Train and plan DLRM-family recommendation models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="train a model (default: DLRM on the synthetic planted-truth data)"
    )
    _add_config_args(train)
    train.add_argument("--out", type=Path, help="run directory (default: runs/train-<time>)")
    train.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last checkpoint"
    )
    train.add_argument(
        "--nproc", type=int, default=1, help="start N local worker processes (gloo on CPU)"
    )
    train.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="let the N local workers stand in for H hosts (cross-host traffic is counted)",
    )
    train.add_argument(
        "--max-restarts", type=int, default=0, help="elastic restarts after a worker failure"
    )
    train.set_defaults(func=_cmd_train)

    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, func, help_text in (
        ("train", _cmd_bench_train, "training throughput on the Criteo-Kaggle-shaped DLRM"),
        ("embedding", _cmd_bench_embedding, "embedding lookup + backward + update alone"),
    ):
        b = bench_sub.add_parser(name, help=help_text)
        b.add_argument("--json", action="store_true", help="print one JSON object")
        b.add_argument("--steps", type=int, default=30, help="timed steps per backend")
        b.add_argument("--warmup", type=int, default=5, help="untimed steps first")
        b.add_argument(
            "--backends", default="torch,fbgemm", help="comma-separated kernel backends to time"
        )
        b.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec comparison")
        if name == "train":
            b.add_argument("--batch-size", type=int, default=2048)
        b.set_defaults(func=func)
    b = bench_sub.add_parser("dist", help="sharded embedding steps on N CPU processes, per type")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--nproc", default="2,4", help="comma-separated world sizes (4: 2 hosts)")
    b.add_argument(
        "--types",
        default="table_wise,row_wise,column_wise,table_row_wise,table_column_wise,data_parallel",
        help="comma-separated sharding types",
    )
    b.add_argument("--steps", type=int, default=20, help="timed steps per system")
    b.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds")
    b.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec comparison")
    b.set_defaults(func=_cmd_bench_dist)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Our own logger at INFO; libraries (FBGEMM logs to the root logger) at WARNING.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
