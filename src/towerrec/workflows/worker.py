"""One worker process of ``towerrec train --nproc N`` (what the elastic launcher runs).

It sets up logging for its rank, resumes after an elastic restart
(``--max-restarts``) when a checkpoint exists, trains (``training.train``), and leaves
the process group; ``train/distributed.py`` holds the run context the engine uses inside.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from towerrec.config import ConfigFiles, load_config
from towerrec.train.checkpoint import CheckpointManager
from towerrec.train.run_dir import RunDir
from towerrec.workflows.training import train

__all__ = ["train_worker"]

log = logging.getLogger("towerrec")


def train_worker(
    config_path: ConfigFiles,
    overrides: list[str],
    out: Path,
    resume: bool,
    resume_from: int | None = None,
    hosts: int | None = None,
) -> dict[str, Any] | None:
    """One worker of ``towerrec train --nproc N`` or of torchrun: the summary on rank 0,
    None elsewhere. ``resume_from``: the step ``--resume-from`` names (implies
    ``resume``); ``hosts``: as ``train``'s.

    After an elastic restart (``--max-restarts``) the run resumes from its last
    checkpoint, or starts over if it had none yet.
    """
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if int(os.environ.get("RANK", "0")) == 0:
        log.setLevel(logging.INFO)  # rank 0 speaks for the run, as the one process does
    run = RunDir(out)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        if CheckpointManager(run.checkpoint_dir).latest() is not None:
            resume, resume_from = True, None  # the latest: the first attempt's, if it saved
            log.warning("restarted: resuming from the last checkpoint in %s", out)
        elif not resume and int(os.environ.get("RANK", "0")) == 0:
            run.metrics_path.unlink(missing_ok=True)
    if resume or resume_from is not None:
        config = run.resume_config(config_path, overrides)
    else:
        config = load_config(config_path, overrides)
    try:
        summary = train(config, out, resume=resume, resume_from=resume_from, hosts=hosts)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return summary if int(os.environ.get("RANK", "0")) == 0 else None
