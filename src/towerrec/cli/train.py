"""``towerrec train``: one process, ``--nproc N`` local workers, or a worker of torchrun."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
from pathlib import Path

from towerrec.cli.common import add_config_args

__all__ = ["add_commands"]

log = logging.getLogger("towerrec")


def _cmd_train(args: argparse.Namespace) -> int:
    from towerrec.build.planning import load_plan_file
    from towerrec.config import load_config
    from towerrec.train.run_dir import RunDir, default_run_dir
    from towerrec.workflows.training import train

    out = Path(args.out or default_run_dir())
    args.resume = args.resume or args.resume_from is not None
    if args.resume:  # the run's saved config; a conflicting --set is refused before launching
        config = RunDir(out).resume_config(args.config, args.overrides)
    else:
        config = load_config(args.config, args.overrides)
    log.info("run directory: %s", out)
    fresh = not out.exists()
    try:
        if "WORLD_SIZE" in os.environ:  # already a worker of torchrun: train, don't launch
            from towerrec.workflows.worker import train_worker

            hosts = args.hosts if args.hosts > 1 else None  # else as torchrun says
            # as --nproc's workers: after torchrun --max-restarts restarts it, it resumes
            result = train_worker(
                args.config,
                args.overrides,
                out,
                args.resume,
                resume_from=args.resume_from,
                hosts=hosts,
            )
            if result is None:  # not rank 0
                return 0
            summary = result
        elif args.nproc > 1 or args.hosts > 1:
            if config.plan.strategy == "file":  # a wrong plan file: one line, no workers
                load_plan_file(config, args.nproc)
            summary = _launch_train(args, out)
        else:
            summary = train(config, out, resume=args.resume, resume_from=args.resume_from)
    except BaseException:
        if fresh:
            _discard_unstarted_run(out)
        raise
    _print_summary(summary, out)
    return 0


def _print_summary(summary: dict, out: Path) -> None:
    if "auc" not in summary:  # stopped (a signal) before its first evaluation
        print(
            f"stopped after step {summary['steps']}, before the first evaluation: continue "
            f"with towerrec train --out {out} --resume"
        )
        return
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
    from towerrec.workflows.worker import train_worker

    try:
        results = launch(
            train_worker,
            (args.config, args.overrides, out, args.resume, args.resume_from),
            nproc=args.nproc,
            hosts=args.hosts,
            max_restarts=args.max_restarts,
        )
    except WorkerError as e:
        raise ValueError(f"a worker failed: {e}") from None
    return results[0]


def _checkpoint_step(text: str) -> int:
    """``step_N``, ``step_0000000N`` (a checkpoint's directory name) or ``N``."""
    digits = text.strip().removeprefix("step_")
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a checkpoint step: give step_N (a directory name under the "
            "run's checkpoint/) or N"
        )
    return int(digits)


def add_commands(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train", help="train a model (default: DLRM on the synthetic planted-truth data)"
    )
    add_config_args(train)
    train.add_argument("--out", type=Path, help="run directory (default: runs/train-<time>)")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint, with its saved config.toml "
        "(--set may change only train.steps, logging, checkpointing, loader and layout settings)",
    )
    train.add_argument(
        "--resume-from",
        type=_checkpoint_step,
        metavar="step_N",
        help="continue the run in --out from the checkpoint of step N (e.g. the intact one "
        "before a damaged latest): as --resume, and the checkpoints after it are set aside "
        "(renamed *.superseded, not deleted)",
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
