"""What a run is made of before its first step: the resolved config, the process's
run context, data source, model and optimizer (``towerrec.build.run.build_run``), run
directory, checkpoint managers, early stopper and the workflow's hooks (``set_up``), and
the state a ``--resume`` restores (``Session.resume``): the latest checkpoint, or the step
``--resume-from`` names, its checksums checked first (``resume_point``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from towerrec.build.choices import Choice, resolve_choices, with_recorded_choices
from towerrec.build.models import check_towers_fit_hosts, tower_transform
from towerrec.build.planning import refuse_kv_tables
from towerrec.build.resolve import (
    embedding_rule_warning,
    resolve_device,
    resolve_eval_every,
    resolve_run_config,
)
from towerrec.build.run import build_run
from towerrec.build.sources import build_source
from towerrec.config import Config, load_config
from towerrec.data.batch import Batch
from towerrec.data.registry import SOURCES
from towerrec.data.source import DataSource
from towerrec.memory import reuse_freed_memory
from towerrec.models.interfaces import RecommendationModel
from towerrec.modules.embedding_bag import fused_embedding_modules
from towerrec.optim.shampoo import Shampoo
from towerrec.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng,
    read_meta,
    restore_rng,
)
from towerrec.train.distributed import RunContext, start_distributed
from towerrec.train.early_stopping import EarlyStopping
from towerrec.train.hooks import Hooks, StepHook
from towerrec.train.metrics import auc, normalized_entropy
from towerrec.train.numerics import local_processes, resolve_threads
from towerrec.train.run_dir import RunDir
from towerrec.train.step import autocast_dtype

__all__ = ["Session", "resume_point", "set_up"]

log = logging.getLogger("towerrec")


@dataclass
class Session:
    """One run's objects; ``state`` is the checkpointed train state (step, samples, ...)."""

    config: Config
    steps: int
    device: torch.device
    ctx: RunContext
    source: DataSource
    run: RunDir
    checkpoints: CheckpointManager
    best: CheckpointManager
    eval_every: int
    stopper: EarlyStopping
    model: nn.Module  # a RecommendationModel (checked in set_up): see ``recommender``
    optimizer: torch.optim.Optimizer
    state: dict[str, Any]
    oracle_auc: float | None
    oracle_ne: float | None  # the teacher's own NE on the eval set: the floor a model can reach
    num_dense: int
    num_embedding: int
    threads: int = 1  # this rank's intra-op threads (numerics.py: the run's numbers depend on it)
    eval_batch: int = 0  # this rank's share of train.eval_batch_size
    padding: Batch | None = None  # what a rank out of eval batches forwards (several ranks)
    hooks: Hooks = field(default_factory=Hooks)  # the workflow's (hooks.py)
    lr_factor: float = 1.0  # the learning-rate factor of the current step
    choices: dict[str, Choice] = field(default_factory=dict)  # how `auto` settings resolved

    @property
    def amp_dtype(self) -> torch.dtype | None:
        """The dense part's autocast dtype (``train.precision``; None: fp32)."""
        return autocast_dtype(self.config.train.precision)

    @property
    def recommender(self) -> RecommendationModel:
        """``model`` as the interface it was checked to have."""
        return cast(RecommendationModel, self.model)

    def checkpoint(self, step: int, best: bool = False) -> None:
        """Save the run at ``step`` (into ``best/`` for the best validation's weights)."""
        self.state.update(step=step, rng=capture_rng())
        meta = {
            "threads": self.threads,
            "train_bytes": self.ctx.run_train_bytes(),
            "early_stopping": self.stopper.state_dict(),
        }
        manager = self.best if best else self.checkpoints
        manager.save(step, self.model, self.optimizer, self.state, meta)

    def resume(self, path: Path, changed: dict[str, Any]) -> None:
        """Load the checkpoint at ``path`` (``resume_point``): weights, optimizer states, train
        state, RNG, byte counters and the early stopper; the run's records after its step are
        dropped."""
        self.hooks.on_restore(int(path.name.split("_")[-1]))  # e.g. the step's MLP widths
        self.state = self.checkpoints.load(  # resume_point checked its checksums
            path, self.model, self.optimizer, self.state, checked=True
        )
        if self.state["step"] >= self.steps:
            raise ValueError(
                f"the run in {self.run.path} already finished step {self.state['step']} of "
                f"train.steps = {self.steps}; raise train.steps (--set train.steps=N) to train "
                "further"
            )
        restore_rng(self.state["rng"])
        meta = read_meta(path)
        self.ctx.restore_train_bytes(meta.get("train_bytes", []))
        self.stopper.load_state_dict(meta.get("early_stopping"))
        if self.stopper.stopped:
            raise ValueError(
                f"the run in {self.run.path} already stopped early at step {self.state['step']} "
                f"(best validation step {self.stopper.best_step}); start a new run to train further"
            )
        self.run.truncate_after(self.state["step"])
        self.run.log({"kind": "resume", "step": self.state["step"], "changed": changed})
        log.info("resumed from %s at step %d", path, self.state["step"])


def set_up(
    config: Config,
    out_dir: str | Path,
    resume: bool,
    hosts: int | None = None,
    hooks: Sequence[StepHook] = (),
    resume_from: int | None = None,
) -> Session:
    """Everything before the first step (module doc); resumed if ``resume`` (from the
    latest checkpoint) or ``resume_from`` (from that step's). ``hosts``: how many hosts
    the ranks stand for (``None``: as the environment says); ``hooks``: the workflow's,
    set up before a resumed run's checkpoint is loaded."""
    device = resolve_device(config.train.device)
    ctx = start_distributed(config, device, hosts)
    run = RunDir(out_dir, writer=ctx.is_main, tensorboard=config.train.tensorboard)
    verify = config.train.verify_checkpoints
    checkpoints = CheckpointManager(
        run.checkpoint_dir, keep=config.train.keep_checkpoints, verify=verify
    )
    best = CheckpointManager(run.best_dir, keep=1, verify=verify)
    resume = resume or resume_from is not None
    start = resume_point(checkpoints, run.path, resume_from) if resume else None
    if start is not None and resume_from is not None and ctx.is_main:
        _set_aside_after(resume_from, checkpoints, best)
    threads = _run_threads(config, ctx, start)
    torch.set_num_threads(threads)  # before any numbers are made (a synthetic teacher's too)
    reuse_freed_memory()  # each step's buffers reused, not faulted in afresh (memory.py)
    source: DataSource = build_source(config.data)
    if SOURCES[config.data.source].configured_periods(config.data) > 1:
        log.warning(
            "data.%s.periods is read by `towerrec replay`; `towerrec train` trains on the "
            "stream as one (the synthetic data's period 0)",
            config.data.source,
        )
    config, steps_from = resolve_run_config(config, source)
    if resume and run.config_path.is_file():  # the kernel and precision it ran with
        config = with_recorded_choices(config, load_config(base=run.config_path))
    # `auto` kernel and precision, measured (rank 0) before config.toml records them
    config, choices = resolve_choices(config, source.schema, device, ctx.world_size)
    steps = config.train.steps
    assert steps is not None  # resolved
    eval_every = resolve_eval_every(config, source)
    stopper = EarlyStopping.from_config(config)
    # a config.toml holding `auto` (written before runs recorded their choice, or by
    # hand) agrees with whatever this resume chose
    chosen = config
    changed = (
        run.resume_changes(config, lambda saved: with_recorded_choices(saved, chosen))
        if resume
        else {}
    )
    if ctx.is_main:
        run.start(config, resume=resume)
    ctx.barrier()
    log.info("train.steps = %s: %s", f"{steps:,}", steps_from)
    warmup = config.optimizer.warmup_steps
    if warmup > steps or warmup == steps > 1:  # (one step of one: the full rate at once)
        log.warning(
            "optimizer.warmup_steps = %d >= train.steps = %d: the learning rate reaches "
            "optimizer.lr at the last step at best; lower optimizer.warmup_steps",
            config.optimizer.warmup_steps,
            steps,
        )
    rule_warning = embedding_rule_warning(config, source.schema, source.train_rows)
    if rule_warning is not None:
        log.warning(rule_warning)
    if config.plan.strategy != "none" and ctx.world_size == 1:
        log.warning("plan.strategy only shards tables over ranks; one process keeps them all")
    if config.distributed.dense == "fsdp" and ctx.world_size == 1:
        log.warning(
            "distributed.dense = 'fsdp' shards the dense parameters over ranks; one process "
            "keeps them whole (as with 'ddp')"
        )
    if not config.distributed.reshard_after_forward and config.distributed.dense != "fsdp":
        log.warning(
            "distributed.reshard_after_forward = false applies to distributed.dense = 'fsdp' "
            "only; it is ignored under %r",
            config.distributed.dense,
        )
    check_towers_fit_hosts(config, ctx.topology)  # before a DMT's pilot run
    # A DMT's learned partition comes from a pilot run (on rank 0) before the model is built.
    # Distributed: no rank allocates the full tables; each builds only its shards.
    # Kv tables shard table-wise (each whole on its owner rank); the tower transform
    # splits every table over a host's ranks, which a kv table cannot take.
    if tower_transform(config, ctx.topology):
        refuse_kv_tables(
            config,
            [(f.name, f.num_embeddings) for f in source.schema.sparse],
            f"the tower transform (a DMT on {ctx.topology.hosts} hosts)",
        )
    built = build_run(config, source=source, device=device, layout=ctx)
    model = built.model
    if not isinstance(model, RecommendationModel):  # every model build_model makes is one
        raise TypeError(f"{type(model).__name__} is not a RecommendationModel")
    oracle_auc = oracle_ne = None
    if (oracle := source.eval_oracle()) is not None:  # a planted truth's probabilities
        labels, probs = oracle
        oracle_auc = auc(probs, labels)
        oracle_ne = normalized_entropy(probs, labels)
    session = Session(
        config=config,
        steps=steps,
        device=device,
        ctx=ctx,
        source=source,
        run=run,
        checkpoints=checkpoints,
        best=best,
        eval_every=eval_every,
        stopper=stopper,
        model=model,
        optimizer=built.optimizer,
        state={"step": 0, "samples": 0, "train_s": 0.0, "rng": capture_rng()},
        threads=threads,
        oracle_auc=oracle_auc,
        oracle_ne=oracle_ne,
        num_dense=model.num_dense_parameters(),
        num_embedding=sum(m.num_embedding_parameters for _, m in fused_embedding_modules(model)),
        hooks=Hooks(hooks),
        choices=choices,
    )
    if isinstance(session.optimizer, Shampoo) and ctx.world_size > 1:
        mine, total = session.optimizer.block_counts()
        log.info("Shampoo: this rank preconditions %d of %d blocks", mine, total)
    session.hooks.setup(session)
    if start is not None:
        session.resume(start, changed)
    log.info(
        "model: %s dense + %s embedding parameters, %s backend, device %s",
        f"{session.num_dense:,}",
        f"{session.num_embedding:,}",
        model.sparse.backend.value,
        device,
    )
    session.eval_batch = ctx.local_batch(config.train.eval_batch_size, "train.eval_batch_size")
    # A rank out of eval batches forwards this one (eval row 0) while the others finish.
    session.padding = next(iter(source.eval_batches(1))) if ctx.world_size > 1 else None
    return session


def resume_point(checkpoints: CheckpointManager, run: Path, step: int | None = None) -> Path:
    """The checkpoint a resume loads: the latest, or ``step``'s (``--resume-from``), its
    checksums checked unless ``checkpoints.verify`` is off. A damaged or incomplete one
    is refused (``CheckpointError``) with the newest intact checkpoint before it offered,
    never taken silently; nothing is deleted. Collective in a distributed run."""
    steps = checkpoints.steps()
    if not steps:
        raise FileNotFoundError(
            f"--resume: {checkpoints.directory} holds no checkpoint to resume from"
        )
    if step is not None and step not in steps:
        raise FileNotFoundError(
            f"--resume-from step_{step}: {checkpoints.directory} holds no checkpoint of step "
            f"{step}; it holds steps {steps}"
        )
    chosen = steps[-1] if step is None else step
    path = checkpoints.path(chosen)
    if not checkpoints.verify:
        log.warning(
            "resuming from %s without checking its checksums (train.verify_checkpoints = false)",
            path,
        )
        return path
    try:
        checkpoints.check(path)
    except CheckpointError as e:
        previous = checkpoints.intact_before(chosen)
        if previous is None:
            hint = f"No earlier intact checkpoint is left in {checkpoints.directory}"
        else:
            hint = (
                f"The previous intact checkpoint is step {previous} "
                f"({checkpoints.path(previous)}): resume from it with --resume-from "
                f"step_{previous} (towerrec train --out {run} --resume-from step_{previous}); "
                "the steps after it are trained again"
            )
        raise CheckpointError(e.path, e.problems, hint + "; nothing was deleted") from None
    return path


def _set_aside_after(step: int, checkpoints: CheckpointManager, best: CheckpointManager) -> None:
    """A run resumed from ``step`` trains the steps after it again: their checkpoints (and a
    best checkpoint among them) are renamed, not deleted (``set_aside_after``)."""
    moved = checkpoints.set_aside_after(step) + best.set_aside_after(step)
    if moved:
        log.warning(
            "resuming from step %d: the later checkpoints are set aside as %s (remove them "
            "when they are no longer needed)",
            step,
            ", ".join(str(p) for p in moved),
        )


def _run_threads(config: Config, ctx: RunContext, checkpoint: Path | None) -> int:
    """This rank's intra-op threads (``numerics.resolve_threads``); a resumed run keeps
    the count its checkpoint records unless ``train.threads`` names one (then a
    different count is warned about: the weights may then differ from an uninterrupted
    run's in the last bits)."""
    threads = resolve_threads(config.train.threads, local_processes(ctx.world_size))
    recorded = read_meta(checkpoint).get("threads") if checkpoint is not None else None
    if recorded is None or recorded == threads:
        return threads
    if not config.train.threads:
        log.info("intra-op threads: %d, as the run was checkpointed with", recorded)
        return int(recorded)
    log.warning(
        "train.threads = %d, but the run was checkpointed with %d threads: a matrix "
        "product's sums can depend on the thread count, so the weights may differ from an "
        "uninterrupted run's in the last bits (resume without train.threads to keep %d)",
        threads,
        recorded,
        recorded,
    )
    return threads
