"""``towerrec`` command line: train | plan | data | bench | config.

User errors (bad config, missing files, bad data) print one ``error:`` line
and exit with status 2; anything else is a bug and shows its traceback. A
reader that closes stdout early (``towerrec data info DIR | head``) ends the
command quietly with status 141, as a process stopped by SIGPIPE.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import shutil
import sys
from pathlib import Path

__all__ = ["main"]

log = logging.getLogger("towerrec")

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, ImportError)
STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left


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


def _cmd_config_show(args: argparse.Namespace) -> int:
    from towerrec.config import config_to_toml, load_config
    from towerrec.train.build import build_source, resolve_run_config

    config = load_config(args.config, args.overrides)
    config, _ = resolve_run_config(config, build_source(config.data))
    print(config_to_toml(config), end="")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from towerrec.config import load_config
    from towerrec.train.run_dir import RunDir, default_run_dir
    from towerrec.train.trainer import train

    out = Path(args.out or default_run_dir())
    if args.resume:  # the run's saved config; a conflicting --set is refused before launching
        config = RunDir(out).resume_config(args.config, args.overrides)
    else:
        config = load_config(args.config, args.overrides)
    log.info("run directory: %s", out)
    fresh = not out.exists()
    try:
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
    except BaseException:
        if fresh:
            _discard_unstarted_run(out)
        raise
    oracle = summary.get("oracle_auc")
    line = f"AUC {summary['auc']:.4f}"
    if oracle is not None:
        line += f" (oracle AUC {oracle:.4f}, gap {oracle - summary['auc']:.4f})"
    line += (
        f", log-loss {summary['logloss']:.4f}, NE {summary['ne']:.4f}, "
        f"{summary['samples_per_s']:,.0f} samples/s over {summary['steps']} steps"
    )
    print(line)
    if summary.get("weights_step") not in (None, summary["steps"]):
        print(f"the returned weights are the best validation step's, {summary['weights_step']}")
    if test := summary.get("test"):
        print(f"test AUC {test['auc']:.4f}, log-loss {test['logloss']:.4f}, NE {test['ne']:.4f}")
    print(f"results in {out}/ (summary.json, metrics.jsonl, curves.png, checkpoint/)")
    return 0


def _discard_unstarted_run(out: Path) -> None:
    """Remove a run directory this command created if the run failed before its first
    logged step: it holds nothing but the config, and would make the next attempt with
    the same --out fail with "already holds a run"."""
    metrics = out / "metrics.jsonl"
    has_checkpoint = (out / "checkpoint").is_dir() and any((out / "checkpoint").iterdir())
    if out.is_dir() and not has_checkpoint and (not metrics.exists() or not metrics.stat().st_size):
        shutil.rmtree(out, ignore_errors=True)


def _launch_train(args: argparse.Namespace, out: Path) -> dict:
    """``--nproc N``: N local workers through torch.distributed's elastic launcher."""
    from towerrec.distributed.launch import WorkerError, launch
    from towerrec.train.worker import train_worker

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
        threads=args.threads,
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
        threads=args.threads,
    )
    _print_result(result, args.json)
    return 0


def _cmd_bench_zoo(args: argparse.Namespace) -> int:
    from towerrec.bench.zoo import run_zoo_benchmark

    variants = [v for v in args.variants.split(",") if v]
    result = run_zoo_benchmark(
        args.bench,
        args.steps,
        args.batch_size,
        args.device,
        args.threads,
        args.overrides,
        variants,
        args.seeds,
    )
    _print_result(result, args.json)
    return 0


def _cmd_bench_towers(args: argparse.Namespace) -> int:
    from towerrec.bench.towers import run_towers_benchmark

    result = run_towers_benchmark(
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
    _print_result(result, args.json)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from towerrec.cli_plan import run_plan

    return run_plan(args)


def _cmd_bench_plan(args: argparse.Namespace) -> int:
    from towerrec.bench.plan import run_plan_benchmark

    result = run_plan_benchmark(
        tasks=args.tasks,
        torchrec_tasks=0 if args.no_torchrec else args.torchrec_tasks,
        measured_tasks=args.measured_tasks,
        full=not args.no_full,
        topology=args.topology,
        calibration=args.calibration,
    )
    _print_result(result, args.json)
    return 0


def _cmd_bench_costmodel(args: argparse.Namespace) -> int:
    from towerrec.bench.costmodel import run_costmodel_benchmark

    result = run_costmodel_benchmark(
        num_devices=args.devices, samples_in=args.samples, samples_out=args.save_samples
    )
    _print_result(result, args.json)
    return 0


def _cmd_bench_dmt_scale(args: argparse.Namespace) -> int:
    from towerrec.bench.dmt_scale import run_scale_model

    result = run_scale_model(
        cross_host_gbs=tuple(float(v) for v in args.cross_host_gbs.split(",")),
        intra_host_gbs=args.intra_host_gbs,
        ranks_per_host=args.ranks_per_host,
        compression=args.compression,
        plot=args.plot,
    )
    _print_result(result, args.json)
    return 0


_ALL_TYPES = "table_wise,row_wise,column_wise,table_row_wise,table_column_wise,data_parallel"


def _cmd_bench_dist(args: argparse.Namespace) -> int:
    from towerrec.bench.dist import run_dist_benchmark
    from towerrec.bench.dist_train import TORCHREC_TYPES, run_dist_train_benchmark

    if args.model == "dlrm":
        result = run_dist_train_benchmark(
            nprocs=tuple(int(n) for n in args.nproc.split(",")),
            types=tuple(args.types.split(",")) if args.types else TORCHREC_TYPES,
            steps=args.steps,
            rounds=args.rounds,
            torchrec=not args.no_torchrec,
        )
        _print_result(result, args.json)
        return 0
    result = run_dist_benchmark(
        nprocs=tuple(int(n) for n in args.nproc.split(",")),
        types=tuple((args.types or _ALL_TYPES).split(",")),
        steps=args.steps,
        rounds=args.rounds,
        torchrec=not args.no_torchrec,
    )
    _print_result(result, args.json)
    return 0


def _cmd_bench_memory(args: argparse.Namespace) -> int:
    from towerrec.bench.memory import run_memory_benchmark

    for flag in ("tables", "rows", "dim", "steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"bench memory: --{flag} must be >= 1, got {getattr(args, flag)}")
    if args.nproc < 0 or args.workers < 0:
        raise ValueError("bench memory: --nproc and --workers must be >= 0 (0 skips that part)")
    shape = {"num_tables": args.tables, "num_embeddings": args.rows, "embedding_dim": args.dim}
    result = run_memory_benchmark(args.nproc, args.steps, args.workers, shape)
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
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint, with its saved config.toml "
        "(--set may change only train.steps, logging, checkpointing, loader and layout settings)",
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

    config = sub.add_parser("config", help="the resolved run config")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show",
        help="print the resolved config as TOML (what `towerrec train` writes as config.toml)",
    )
    _add_config_args(show)
    show.set_defaults(func=_cmd_config_show)

    plan = sub.add_parser(
        "plan", help="shard embedding tables over devices: per-device table, plan JSON, chart"
    )
    _add_config_args(plan)
    from towerrec.cli_plan import add_plan_args

    add_plan_args(plan)
    plan.set_defaults(func=_cmd_plan)

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
        b.add_argument("--threads", type=int, default=None, help="intra-op threads")
        if name == "train":
            b.add_argument("--batch-size", type=int, default=2048)
        b.set_defaults(func=func)
    for name, help_text in (
        ("models", "DLRM vs DCNv2 vs Wukong at matched FLOPs per sample (planted data)"),
        ("embeddings-memory", "AUC vs parameters: full, hash, QR and mixed-dimension tables"),
        ("optimizers", "CF-SGD vs row-wise Adagrad on the embedding tables"),
        ("precision", "bf16 autocast vs fp32: samples/s (Criteo shape) and AUC"),
    ):
        b = bench_sub.add_parser(name, help=help_text)
        b.add_argument("--json", action="store_true", help="print one JSON object")
        b.add_argument("--steps", type=int, default=600, help="training steps per variant")
        b.add_argument("--batch-size", type=int, default=2048)
        b.add_argument("--device", default="cpu", help="cpu, cuda or auto")
        b.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
        b.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="config override for every variant, e.g. --set data.synthetic.seed=1",
        )
        b.add_argument(
            "--variants",
            default="",
            help="comma-separated variants of embeddings-memory or optimizers (default: all)",
        )
        b.add_argument(
            "--seeds",
            type=int,
            default=1,
            help="runs per variant (model-init and data-order seeds 0..N-1): mean and std",
        )
        b.set_defaults(func=_cmd_bench_zoo)

    from towerrec.cli_data import add_data_commands

    add_data_commands(sub, bench_sub)
    b = bench_sub.add_parser("plan", help="planners on synthetic DLRM-like table suites")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--tasks", type=int, default=100, help="tasks of 10-60 tables on 4 devices")
    b.add_argument(
        "--torchrec-tasks", type=int, default=20, help="of those, for TorchRec's planner"
    )
    b.add_argument("--measured-tasks", type=int, default=5, help="tasks timed on this machine")
    b.add_argument("--no-full", action="store_true", help="skip 856 tables on 128 devices")
    b.add_argument("--no-torchrec", action="store_true", help="skip TorchRec's planner")
    b.add_argument("--topology", default="gpu", help="topology preset without --calibration")
    b.add_argument("--calibration", help="constants from `towerrec plan --calibrate` (cpu)")
    b.set_defaults(func=_cmd_bench_plan)
    b = bench_sub.add_parser(
        "costmodel", help="analytic vs learned device cost on measured multi-table kernels"
    )
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--devices", type=int, default=200, help="random devices to measure")
    b.add_argument("--samples", help="reuse measured devices from this JSON, measure nothing")
    b.add_argument("--save-samples", help="write the measured devices as JSON")
    b.set_defaults(func=_cmd_bench_costmodel)
    towers = bench_sub.add_parser(
        "towers", help="DMT compressing towers: learned vs random vs cost-only partitions"
    )
    towers.add_argument("--json", action="store_true", help="print one JSON object")
    towers.add_argument("--steps", type=int, default=2500, help="training steps per run")
    towers.add_argument("--num-towers", type=int, default=2)
    towers.add_argument("--tower", default="dot", help="tower kind: dot, fm or identity")
    towers.add_argument("--tower-outputs", type=int, default=1, help="vectors out per tower")
    towers.add_argument("--random-seeds", type=int, default=3, help="random partitions to train")
    towers.add_argument("--pilot-steps", type=int, default=300, help="steps of the pilot run")
    towers.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    towers.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    towers.add_argument(
        "--throughput-only", action="store_true", help="only the side-by-side step timing"
    )
    towers.set_defaults(func=_cmd_bench_towers)
    from towerrec.cli_dmt import add_bench_dmt_command

    add_bench_dmt_command(bench_sub)
    from towerrec.cli_quality import add_bench_quality_command

    add_bench_quality_command(bench_sub)
    scale = bench_sub.add_parser(
        "dmt-scale", help="analytic step time of flat DLRM vs DMT, 16 to 512 accelerators"
    )
    scale.add_argument("--json", action="store_true", help="print one JSON object")
    scale.add_argument("--cross-host-gbs", default="25,50", help="GB/s per accelerator, comma list")
    scale.add_argument("--intra-host-gbs", type=float, default=300.0)
    scale.add_argument("--ranks-per-host", type=int, default=8)
    scale.add_argument("--compression", type=float, default=4.0, help="DMT tower compression")
    scale.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    scale.set_defaults(func=_cmd_bench_dmt_scale)
    b = bench_sub.add_parser("dist", help="sharded embedding steps on N CPU processes, per type")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--nproc", default="2,4", help="comma-separated world sizes (4: 2 hosts)")
    b.add_argument(
        "--types",
        default=None,
        help=f"comma-separated sharding types (default: {_ALL_TYPES}; with --model dlrm: "
        "the types TorchRec has on CPU)",
    )
    b.add_argument(
        "--model",
        choices=("embedding", "dlrm"),
        default="embedding",
        help="embedding: the sharded collection's step alone; dlrm: full DLRM training "
        "steps (pipelined input_dist, fp16 wires) against TorchRec's TrainPipelineSparseDist",
    )
    b.add_argument("--steps", type=int, default=20, help="timed steps per system")
    b.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds")
    b.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec comparison")
    b.set_defaults(func=_cmd_bench_dist)
    b = bench_sub.add_parser(
        "memory", help="per-rank and loader-worker memory with tables much larger than a rank's"
    )
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument(
        "--nproc", type=int, default=4, help="ranks sharing the tables row-wise (0: skip)"
    )
    b.add_argument("--steps", type=int, default=20, help="training steps per run")
    b.add_argument("--workers", type=int, default=2, help="data-loader workers (0: skip)")
    b.add_argument("--tables", type=int, default=4)
    b.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    b.add_argument("--dim", type=int, default=32)
    b.set_defaults(func=_cmd_bench_memory)
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
        code = args.func(args)
        sys.stdout.flush()  # a closed stdout fails here, not in the flush at exit
        return code
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if _stdout_open():
            raise  # another pipe broke: not the reader of our output leaving
        # Later writes (the flush at exit included) go nowhere instead of failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return STDOUT_CLOSED


def _stdout_open() -> bool:
    """False when stdout's reader is gone (a pipe reports an error condition), or when
    this platform cannot tell (Windows has no ``select.poll``): the broken pipe is then
    taken to be stdout's."""
    if sys.platform == "win32":
        return False
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return not any(events & select.POLLERR for _, events in poller.poll(0))


if __name__ == "__main__":
    sys.exit(main())
