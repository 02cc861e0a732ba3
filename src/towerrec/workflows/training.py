"""``train(config, out_dir)``: a full run of ``towerrec train``.

It composes the workflows the config asks for and hands them to the engine
(``towerrec.train``)::

    set_up(config, out_dir, hooks)       the session (train/session.py); hooks:
                                         growth and pruning (prune_grow.py)
    objective                            loss.kind's (a PU prior estimated first when
                                         loss.class_prior = "estimate": pu/prior.py),
                                         with distillation's terms (distill/loss.py)
    strategy                             BatchSteps on that objective, or, for an
                                         optimizer that draws its own samples,
                                         SampledSteps (sampled.py)
    run(session, strategy)               the loop and its end (train/loop.py)

``worker.py`` runs it in each process of ``towerrec train --nproc N``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from towerrec.config import Config, TemporalConfig
from towerrec.train.hooks import StepHook, SummaryEntry
from towerrec.train.loop import BatchSteps, StepStrategy, run
from towerrec.train.numerics import pinned
from towerrec.train.session import set_up
from towerrec.workflows.distill.loss import with_distillation
from towerrec.workflows.prune_grow import PruneGrowHook
from towerrec.workflows.pu.prior import resolve_objective
from towerrec.workflows.sampled import SampledSteps

__all__ = ["train"]


def train(
    config: Config,
    out_dir: str | Path,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    hosts: int | None = None,
    hooks: Sequence[StepHook] = (),
    resume_from: int | None = None,
) -> dict[str, Any]:
    """Train ``config`` into ``out_dir``; returns the summary (also in summary.json).

    ``resume`` continues from the directory's latest checkpoint, ``resume_from`` from that
    step's (``config`` may differ from its config.toml only in ``RESUME_SAFE_KEYS``); a
    damaged checkpoint is refused (``train/session.py: resume_point``); ``stop_after``
    ends the run (with a checkpoint) after that step, as a stop signal does. ``hosts``:
    how many hosts a distributed run's ranks stand for (``None``: as its environment says).
    ``hooks``: the caller's own step hooks (``train/hooks.py``), after the run's (e.g. a
    tuner reporting each validation: ``towerrec.workflows.tune``).
    The run sets its own thread count and matmul precision (``train/numerics.py``); the
    process has its own back when it returns.
    """
    with pinned():
        return _train(config, out_dir, resume, stop_after, hosts, hooks, resume_from)


def _train(
    config: Config,
    out_dir: str | Path,
    resume: bool,
    stop_after: int | None,
    hosts: int | None,
    extra_hooks: Sequence[StepHook],
    resume_from: int | None = None,
) -> dict[str, Any]:
    if config.train.temporal != TemporalConfig():
        warnings.warn(
            "train.temporal is used by towerrec replay only; towerrec train ignores it",
            stacklevel=3,  # the caller of train()
        )
    hooks: list[StepHook] = []
    if config.train.prune_grow.enabled:
        hooks.append(PruneGrowHook())
    hooks.extend(extra_hooks)
    session = set_up(config, out_dir, resume, hosts, hooks, resume_from)
    base, prior_estimate = resolve_objective(session.config)
    objective = with_distillation(base, session.config.distill)
    objective.check_model(session.model)
    if prior_estimate is not None:  # loss.class_prior = "estimate"
        session.hooks.append(SummaryEntry("class_prior_estimate", prior_estimate.as_dict()))
    strategy: StepStrategy = (
        SampledSteps() if session.config.optimizer.draws_samples else BatchSteps(objective)
    )
    return run(session, strategy, stop_after)
