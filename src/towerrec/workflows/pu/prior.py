"""Class-prior estimation for positive-unlabeled data, and the run's resolved objective.

Positive-unlabeled (PU) data: label 1 marks a *labelled* positive, label 0 an example
whose class is unknown. Under the usual assumption that the labelled positives are a
random sample of the positives ("selected completely at random", with label frequency
``c = P(labelled | positive)``), a classifier ``g(x) = P(labelled | x)`` trained to
tell labelled from unlabelled examples equals ``c * P(positive | x)`` (Elkan and Noto,
2008). So on any set of examples whose members are all positive, ``g`` averages ``c``.

The estimator (``estimate_prior``), on held-out examples (the validation split):

1. train ``g``: the configured model with BCE on the observed labels (the train split);
2. take the ``top_fraction`` of held-out examples ``g`` scores highest (of each
   cross-fitting fold, ranked by that fold's own classifier): the set most nearly all
   positive; ``c`` is the share of labelled examples in it (an unbiased
   count, not the model's own probabilities, so miscalibration of ``g`` does not enter);
3. ``prior = labelled fraction / c`` (clipped below 1), and the share of positives among
   the unlabelled examples, ``unlabelled_prior = (prior - l) / (1 - l)``, ``l`` the
   labelled fraction: the value ``loss.class_prior`` takes.

Elkan and Noto's own estimator averages ``g`` over *all* labelled positives; it is
unbiased only when positives and negatives do not overlap (``P(positive | x) = 1`` on
every positive). Click data overlap heavily, and there it underestimates ``c`` (and
overestimates the prior) by the mean ``P(positive | x)`` over positives; restricting to
the examples ``g`` ranks highest keeps the set where that assumption nearly holds.
``elkan_noto_c`` is kept beside it for comparison (``towerrec data pu-prior`` prints both).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm import tqdm

from towerrec.build.resolve import converges, resolve_device, resolve_run_config
from towerrec.build.run import build_run
from towerrec.build.sources import build_source
from towerrec.config import Config
from towerrec.data.batch import Batch
from towerrec.data.source import DataSource, RowAccessSource
from towerrec.train.loss import Objective, build_objective, check_prior
from towerrec.train.numerics import pinned, resolve_threads
from towerrec.train.step import fit_steps

__all__ = [
    "PriorEstimate",
    "estimate_class_prior",
    "estimate_prior",
    "held_out_scores",
    "resolve_objective",
]

log = logging.getLogger("towerrec")

TOP_FRACTION = 0.02  # of the held-out examples: those the classifier scores highest
FOLDS = 5  # cross-fitting folds over the training rows


@dataclass(frozen=True)
class PriorEstimate:
    """``prior``: P(positive); ``unlabelled_prior``: P(positive | unlabelled), the value of
    ``loss.class_prior``; ``label_frequency``: c = P(labelled | positive)."""

    prior: float
    unlabelled_prior: float
    labelled_fraction: float
    label_frequency: float
    elkan_noto_c: float
    held_out: int
    top: int

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def estimate_prior(
    scores: torch.Tensor,
    labels: torch.Tensor,
    top_fraction: float = TOP_FRACTION,
    groups: torch.Tensor | None = None,
) -> PriorEstimate:
    """The class prior from held-out classifier ``scores [N]`` (probabilities of being
    labelled) and observed ``labels [N]`` (1 labelled positive, 0 unlabelled); module doc.

    ``groups [N]`` (the cross-fitting folds): each group's examples are ranked among
    themselves, since two folds' classifiers need not score on one scale; the top set is
    the union of every group's ``top_fraction``."""
    scores, labels = scores.double().reshape(-1), labels.double().reshape(-1)
    if scores.numel() != labels.numel():
        raise ValueError(f"{scores.numel()} scores but {labels.numel()} labels")
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError("PU labels must be 1 (labelled positive) or 0 (unlabelled)")
    if not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction must lie in (0, 1], got {top_fraction}")
    labelled = float(labels.sum())
    n = labels.numel()
    if labelled == 0:
        raise ValueError(
            "the data have no labelled positives (no label 1), so the class prior cannot be "
            "estimated; PU learning needs some examples labelled positive"
        )
    if labelled == n:
        raise ValueError(
            "every example is labelled positive (no label 0): there is no unlabelled "
            "example whose class prior could be estimated"
        )
    fraction = labelled / n
    groups = torch.zeros(n, dtype=torch.long) if groups is None else groups.reshape(-1)
    chosen = []
    for group in torch.unique(groups):
        members = torch.nonzero(groups == group).reshape(-1)
        order = torch.argsort(scores[members], descending=True, stable=True)
        chosen.append(members[order[: max(1, round(len(members) * top_fraction))]])
    top_set = torch.cat(chosen)
    top = top_set.numel()
    c = float(labels[top_set].mean())
    if c == 0:
        raise ValueError(
            f"none of the {top} held-out examples the classifier scores highest is labelled: "
            "it did not learn to find positives; train it longer (train.steps)"
        )
    prior = min(fraction / c, 1 - 1e-6)
    return PriorEstimate(
        prior=prior,
        unlabelled_prior=(prior - fraction) / (1 - fraction),
        labelled_fraction=fraction,
        label_frequency=c,
        elkan_noto_c=float(scores[labels == 1].mean()),
        held_out=n,
        top=top,
    )


@torch.no_grad()
def _predict(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device):
    """Probabilities ``[N]`` and labels ``[N]`` of ``batches``."""
    model.eval()
    probs, labels = [], []
    for batch in batches:
        batch = batch.to(device)
        probs.append(torch.sigmoid(model(batch.dense, batch.sparse).float()).cpu())
        labels.append(batch.labels.cpu())
    model.train()
    return torch.cat(probs), torch.cat(labels)


def _fit(config: Config, source: DataSource, batches: Iterator[Batch], device: torch.device):
    """``config``'s model trained with BCE for its ``train.steps`` on ``batches``."""
    steps = config.train.steps
    assert steps is not None  # resolved
    run = build_run(config, source=source, device=device)
    fit_steps(run.model, run.optimizer, config, batches, steps, device)
    return run.model


def _row_batches(source: RowAccessSource, rows: np.ndarray, batch_size: int, seed: int):
    """Endless batches of ``rows`` of the training split, reshuffled every pass."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(rows)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield source.gather_train(order[start : start + batch_size])


@pinned()  # its own thread count; the caller's comes back after
def held_out_scores(
    config: Config, folds: int = FOLDS, source: DataSource | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Classifier probabilities ``[N]`` of being labelled, on examples it did not train on,
    their observed labels ``[N]`` and the fold that scored each ``[N]``.

    A source with row access (``RowAccessSource``: MovieLens, caches) is cross-fitted:
    its training rows are dealt at random (``train.seed``) into ``folds`` folds, and each
    fold is scored by a model trained on the others, so every training row is held out
    once. A stream (synthetic) trains one model on its stream and scores its
    validation set, drawn from the same distribution. ``source``: ``config.data``'s
    unless given.
    """
    if folds < 2:
        raise ValueError(f"cross-fitting needs at least 2 folds, got {folds}")
    torch.set_num_threads(resolve_threads(config.train.threads))
    device = resolve_device(config.train.device)
    source = source if source is not None else build_source(config.data)
    if converges(config, source):  # the folds' fits have no early stopping: one pass
        config = replace(config, train=replace(config.train, epochs=1.0))
    config, _ = resolve_run_config(config, source)
    batch_size, eval_size = config.train.batch_size, config.train.eval_batch_size
    if not isinstance(source, RowAccessSource):
        model = _fit(config, source, source.train_batches(batch_size), device)
        probs, observed = _predict(model, source.eval_batches(eval_size), device)
        return probs, observed, torch.zeros(len(probs), dtype=torch.long)
    n = source.train_rows
    fold_of = np.random.default_rng(config.train.seed).permutation(n) % folds
    if n // folds < batch_size:
        raise ValueError(
            f"{n} training rows in {folds} folds leave fewer than train.batch_size = "
            f"{batch_size} rows per fold; lower train.batch_size"
        )
    scores, labels = torch.zeros(n), torch.zeros(n)
    for fold in tqdm(
        range(folds), desc="pu-prior folds", unit="fold", disable=not config.train.progress
    ):
        rest, held = np.nonzero(fold_of != fold)[0], np.nonzero(fold_of == fold)[0]
        batches = _row_batches(source, rest, batch_size, config.train.seed + fold)
        model = _fit(config, source, batches, device)
        pieces = (held[i : i + eval_size] for i in range(0, len(held), eval_size))
        probs, observed = _predict(model, (source.gather_train(r) for r in pieces), device)
        scores[held], labels[held] = probs, observed
    return scores, labels, torch.from_numpy(fold_of)


def estimate_class_prior(
    config: Config,
    folds: int = FOLDS,
    top_fraction: float = TOP_FRACTION,
    source: DataSource | None = None,
) -> PriorEstimate:
    """``estimate_prior`` over ``held_out_scores`` of ``config`` (its model, trained with
    BCE on the observed labels for its ``train.steps``)."""
    scores, labels, fold_of = held_out_scores(config, folds, source)
    return estimate_prior(scores, labels, top_fraction, fold_of)


def resolve_objective(config: Config) -> tuple[Objective, PriorEstimate | None]:
    """The run's ``Objective``: ``loss.class_prior = "estimate"`` estimated first (with
    BCE, so the estimate does not depend on the PU loss); the estimate, if any."""
    loss = config.loss
    estimate = None
    prior = loss.class_prior
    if prior == "estimate":
        bce = replace(config, loss=replace(loss, kind="bce", class_prior=None))
        estimate = estimate_class_prior(bce)
        prior = estimate.unlabelled_prior
        if not prior > 0:
            raise ValueError(
                f"the estimated label frequency is {estimate.label_frequency:.3f}: every "
                "top-ranked held-out example is labelled, so the estimate finds no positive "
                "among the unlabelled examples; train with loss.kind = 'bce', or set "
                "loss.class_prior to a number in (0, 1)"
            )
        log.info(
            "loss.class_prior estimated: %.4f of the unlabelled examples are positive "
            "(prior %.4f, label frequency %.4f)",
            prior,
            estimate.prior,
            estimate.label_frequency,
        )
    assert not isinstance(prior, str)  # "estimate" resolved above; LossConfig allows no other
    if prior is not None:
        check_prior(prior)
    return (
        build_objective(loss.kind, prior, loss.contrastive_weight, loss.temperature),
        estimate,
    )
