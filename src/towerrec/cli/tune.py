"""``towerrec tune``: hyperparameter search on the validation split (workflows/tune/)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from towerrec.cli.common import add_config_args

__all__ = ["add_commands"]

log = logging.getLogger("towerrec")


def _cmd_tune(args: argparse.Namespace) -> int:
    from towerrec.workflows.tune.report import (
        format_table,
        trial_rows,
        write_best_config,
        write_plot,
        write_table,
    )
    from towerrec.workflows.tune.space import load_space
    from towerrec.workflows.tune.study import StudyRun, run_study

    space = load_space(args.space)
    run = StudyRun(args.config, tuple(args.overrides), space, args.out, args.nproc, args.hosts)
    study = run_study(run, args.trials)
    rows = trial_rows(study, run)
    write_table(rows, args.out / "trials.csv")
    if rows:
        write_plot(rows, space, args.out / "trials.png")
    print(format_table(rows, space))
    best = write_best_config(study, run, args.out / "best.toml")
    if best is None:
        print(f"no trial completed; the trials are in {args.out}/trials.csv")
        return 0
    print(
        f"best: trial {study.best_trial.number}, validation {space.study.metric} "
        f"{study.best_value:.5f}; its config: {best} "
        f"(towerrec train --config {best})"
    )
    print(f"trials in {args.out}/trials.csv and trials.png; runs in {args.out}/trial-NNN/")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser(
        "tune", help="search hyperparameters on the validation split (Optuna; resumable)"
    )
    add_config_args(tune)
    tune.add_argument(
        "--space", type=Path, required=True, help="TOML file of the space (docs/tuning.md)"
    )
    tune.add_argument(
        "--out",
        type=Path,
        required=True,
        help="study directory: study.db, trial-NNN/ runs, trials.csv, best.toml; run the "
        "same command again to continue the study",
    )
    tune.add_argument(
        "--trials", type=int, help="trials in the study (default: the space's study.trials)"
    )
    tune.add_argument(
        "--nproc", type=int, default=1, help="train each trial on N local worker processes"
    )
    tune.add_argument(
        "--hosts", type=int, default=1, help="let each trial's N workers stand in for H hosts"
    )
    tune.set_defaults(func=_cmd_tune)
