"""One trial's training: in the tuning process, or in each worker of ``--nproc N``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from towerrec.config import ConfigFiles, load_config
from towerrec.workflows.training import train
from towerrec.workflows.tune.report_hook import TrialLink, TrialPruned, TrialReport

__all__ = ["tune_worker"]

log = logging.getLogger("towerrec")


def tune_worker(
    config_files: ConfigFiles, overrides: list[str], out: Path, resume: bool, link: TrialLink
) -> dict[str, Any] | None:
    """Train the trial's config into ``out`` (resumed: its saved config.toml) with its
    report hook. Rank 0 returns the summary, or ``{"pruned": validation, "value": v}``
    when the study pruned the trial; other ranks None."""
    distributed = "WORLD_SIZE" in os.environ
    if distributed and int(os.environ.get("RANK", "0")) == 0:
        logging.basicConfig(level=logging.WARNING)
        log.setLevel(logging.INFO)
    config = (
        load_config(base=out / "config.toml") if resume else load_config(config_files, overrides)
    )
    try:
        result: dict[str, Any] = train(config, out, resume=resume, hooks=[TrialReport(link)])
    except TrialPruned as e:
        result = {"pruned": e.validation, "value": e.value}
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
    return result if int(os.environ.get("RANK", "0")) == 0 else None
