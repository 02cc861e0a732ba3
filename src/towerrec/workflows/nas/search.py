"""``towerrec nas search``: alternate weight and architecture steps, then write the
sampled architectures as run configs and a report.

::

    for step in 1..S:
        tau = tau_start * (tau_end / tau_start) ** (step / S)         per-example masks
        weight step   train batch       BCE                          -> MLPs, tables
        arch step     validation batch  BCE + lambda * E[cost] / max  -> logits alpha
                      (after the warm-up share of steps; tables looked up frozen)

    DIR/arch-0.toml    the most likely architecture (argmax alpha per decision)
    DIR/arch-k.toml    k = 1..samples-1: drawn from softmax(alpha), distinct
    DIR/report.json    probabilities and expected cost over the search, each arch's cost
    DIR/report.png     probabilities per decision over the search, expected cost

The validation split drives the architecture, so the architectures' own runs
(``towerrec nas retrain``) are best judged on the test split.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from towerrec.build.resolve import resolve_device
from towerrec.build.run import build_run
from towerrec.config import Config, config_to_toml
from towerrec.data.batch import Batch, DataSchema
from towerrec.data.source import DataSource
from towerrec.train.numerics import pinned, resolve_threads
from towerrec.train.step import evaluate, lr_factor, set_learning_rates, train_step
from towerrec.workflows.nas.choice import temperature
from towerrec.workflows.nas.supernet import Supernet, build_supernet

__all__ = ["search", "search_steps"]

log = logging.getLogger("towerrec")

HISTORY_POINTS = 20  # records of the probabilities over the search (and each epoch's end)


def search_steps(config: Config, source: DataSource) -> int:
    """``train.steps`` if set, else ``nas.epochs`` passes over the training rows."""
    if config.train.steps is not None:
        return config.train.steps
    rows = source.train_rows
    if rows is None:
        raise ValueError(
            "the synthetic stream has no epochs; set train.steps for the search's length"
        )
    return max(1, math.ceil(config.nas.epochs * rows / config.train.batch_size))


def _arch_batches(source: DataSource, batch_size: int) -> Iterator[Batch]:
    while True:  # the validation split, again and again
        yield from source.eval_batches(batch_size)


def _snapshot(supernet: Supernet, step: int, steps_per_epoch: float, tau: float) -> dict:
    with torch.no_grad():
        return {
            "step": step,
            "epoch": step / steps_per_epoch,
            "tau": tau,
            "expected_cost": float(supernet.expected_cost()),
            "probs": {d.name: d.probs().tolist() for d in supernet.decisions},
        }


def _architectures(supernet: Supernet, count: int, seed: int) -> list[list[int]]:
    """The argmax choice, then up to ``count - 1`` distinct draws from softmax(alpha)."""
    choices = [supernet.best()]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(50 * count):
        if len(choices) >= count:
            break
        choice = [d.sample(gen) for d in supernet.decisions]
        if choice not in choices:
            choices.append(choice)
    return choices


class _SupernetFactory:
    """``build_run``'s model factory for a search: the supernet over the run's DLRM
    (``build_supernet``), kept for the search; one process holds the whole model."""

    supernet: Supernet | None = None

    def __call__(
        self,
        config: Config,
        schema: DataSchema,
        device: torch.device,
        *,
        materialize_embeddings: bool = True,
    ) -> nn.Module:
        self.supernet = build_supernet(config, schema, device)
        return self.supernet.model


@pinned()  # the run's thread count and matmul precision; the process's come back after
def search(config: Config, out: Path, *, progress: bool = True) -> dict[str, Any]:
    """Run the search of ``config.nas`` and write ``out`` (module docstring); returns
    the report."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new --out directory")
    nas, cfg = config.nas, config.train
    torch.set_num_threads(resolve_threads(cfg.threads))
    torch.manual_seed(cfg.seed)
    supernets = _SupernetFactory()
    run = build_run(config, device=resolve_device(cfg.device), model=supernets)
    assert supernets.supernet is not None  # build_run called the factory
    source, device, supernet, weights = run.source, run.device, supernets.supernet, run.optimizer
    model = supernet.model
    arch = torch.optim.Adam([d.logits for d in supernet.decisions], lr=nas.arch_lr)
    steps = search_steps(config, source)
    per_epoch = source.train_rows / cfg.batch_size if source.train_rows else float(steps)
    warmup = int(nas.warmup * steps)
    largest = supernet.largest_cost()
    train_batches = source.train_batches(cfg.batch_size)
    arch_batches = _arch_batches(source, cfg.batch_size)
    record_every = max(1, steps // HISTORY_POINTS)
    epoch_ends = {math.ceil(e * per_epoch) for e in range(1, math.ceil(steps / per_epoch) + 1)}
    history = [_snapshot(supernet, 0, per_epoch, nas.tau_start)]
    log.info(
        "search: %s space, %d decisions, %d steps", nas.space.value, len(supernet.decisions), steps
    )
    model.train()
    bar = tqdm(range(1, steps + 1), desc="nas search", disable=not progress, leave=False)
    for step in bar:
        tau = temperature(nas.tau_start, nas.tau_end, step / steps)
        for d in supernet.decisions:
            d.tau = tau
        set_learning_rates(model, weights, config, lr_factor(config.optimizer, step, steps))
        loss = train_step(model, weights, next(train_batches).to(device))
        if step > warmup:
            batch = next(arch_batches).to(device)
            supernet.set_frozen_embeddings(True)
            logits = model(batch.dense, batch.sparse)
            supernet.set_frozen_embeddings(False)
            cost = supernet.expected_cost() / largest
            arch_loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
            arch.zero_grad(set_to_none=True)
            (arch_loss + nas.cost_weight * cost.to(arch_loss.device)).backward()
            arch.step()
        if step % record_every == 0 or step == steps or step in epoch_ends:
            history.append(_snapshot(supernet, step, per_epoch, tau))
            bar.set_postfix(
                loss=f"{float(loss):.4f}", cost=f"{history[-1]['expected_cost'] / largest:.3f}"
            )
    return _write(supernet, config, source, out, history, steps, largest, device)


def _write(
    supernet: Supernet,
    config: Config,
    source: DataSource,
    out: Path,
    history: list[dict],
    steps: int,
    largest: float,
    device: torch.device,
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    architectures = []
    for i, choice in enumerate(_architectures(supernet, config.nas.samples, config.train.seed)):
        path = out / f"arch-{i}.toml"
        path.write_text(config_to_toml(_as_asked(supernet.config_for(choice), config)))
        supernet.fix(choice)
        metrics = evaluate(supernet.model, source.eval_batches(config.train.batch_size), device)
        cost = supernet.cost_of(choice)
        architectures.append(
            {
                "file": path.name,
                "choice": supernet.named(choice),
                "cost": cost,
                "cost_ratio": cost / largest,
                "supernet_validation": {"auc": metrics.auc, "logloss": metrics.logloss},
            }
        )
    supernet.fix(None)
    report = {
        "space": config.nas.space.value,
        "cost": "MLP FLOPs per sample"
        if config.nas.space.value == "mlp"
        else "embedding parameters",
        "largest_cost": largest,
        "cost_weight": config.nas.cost_weight,
        "steps": steps,
        "decisions": {d.name: d.candidates for d in supernet.decisions},
        "history": history,
        "architectures": architectures,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out / "report.png")
    return report


def _as_asked(arch: Config, asked: Config) -> Config:
    """A sampled architecture's config with the kernel and precision the user asked for:
    the search's ``auto`` choices were made for the supernet, not for this architecture
    (whose tables, e.g. mixed dims, may take another kernel)."""
    embedding = dataclasses.replace(arch.embedding, backend=asked.embedding.backend)
    train = dataclasses.replace(arch.train, precision=asked.train.precision)
    return dataclasses.replace(arch, embedding=embedding, train=train)


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["decisions"])
    shown = names[:11]  # a readable grid; report.json has them all
    cols = 4
    rows = math.ceil((len(shown) + 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    epochs = [h["epoch"] for h in report["history"]]
    cost = [h["expected_cost"] / report["largest_cost"] for h in report["history"]]
    axes[0][0].plot(epochs, cost)
    axes[0][0].set_title("expected cost / largest")
    for ax, name in zip(axes.flat[1:], shown):
        for k, candidate in enumerate(report["decisions"][name]):
            ax.plot(epochs, [h["probs"][name][k] for h in report["history"]], label=str(candidate))
        ax.set_title(name, fontsize=9)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(shown) + 1 :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("epoch")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
