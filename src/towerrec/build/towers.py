"""The DMT's learned tower partition: a pilot run, then the tower partitioner.

``model.dmt.partition = "auto"`` trains a DLRM of the same shape for
``model.dmt.pilot_steps`` steps, measures how much its top MLP relies on each
pairwise dot (``learn_interaction_strength``), and hands that matrix with the
features' costs to the tower partitioner (``towerrec.planner.towers``).
``model.dmt.partition = "embedding"`` trains the same pilot and clusters the
features by their learned embeddings instead (``learn_feature_representations``:
the direction of each feature's pooled-embedding covariance), a balanced
k-means under the same cost cap (``cluster_features``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from towerrec.build.models import MODELS, build_model, feature_stats, partition_groups
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.build.ranks import on_first_rank
from towerrec.build.sources import build_source
from towerrec.config import Config
from towerrec.data.batch import Batch, DataSchema
from towerrec.planner.towers import cluster_features, feature_costs, partition_features
from towerrec.train.step import fit_steps

if TYPE_CHECKING:
    from towerrec.models.dlrm import DLRM

__all__ = [
    "LEARNED_PARTITIONS",
    "embedding_representations",
    "learn_feature_representations",
    "learn_interaction_strength",
    "learn_pilot_signals",
    "pair_attribution",
    "resolve_partition",
    "with_learned_partition",
]

log = logging.getLogger("towerrec")

LEARNED_PARTITIONS = ("auto", "embedding")  # model.dmt.partition values a pilot run learns


def pair_attribution(model: DLRM, batch: Batch) -> np.ndarray:
    """``[T, T]``: mean over samples of ``|(dot_ij - mean dot_ij) * d logit / d dot_ij|``.

    For a DLRM: a first-order estimate of how much of each sample's logit
    flows through the dot product of features i and j as it varies between
    samples (a constant dot is a bias, not an interaction). The bottom
    output's dots are left out: the dense input goes to every tower's owner.
    The DLRM has no ``concat_embeddings`` (``learn_interaction_strength`` builds it).
    """
    with torch.enable_grad():
        x = model.bottom(batch.dense).detach() if model.bottom is not None else None
        embeddings = model.sparse(batch.sparse).stacked()
        vectors = embeddings if x is None else torch.cat([x.unsqueeze(1), embeddings], dim=1)
        dots = model.interaction(vectors).detach()
        dots.requires_grad_(True)
        logits = model.top(torch.cat([dots] if x is None else [x, dots], dim=1)).squeeze(1)
        (grad,) = torch.autograd.grad(logits.sum(), dots)
    centred = dots.detach() - dots.detach().mean(0)
    score = (centred * grad).abs().mean(0).double().cpu().numpy()
    num_vectors = model.interaction.num_features
    strength = np.zeros((num_vectors, num_vectors))
    rows, cols = torch.triu_indices(
        num_vectors, num_vectors, offset=0 if model.interaction.self_interaction else 1
    )
    strength[rows.numpy(), cols.numpy()] = score
    skip = num_vectors - model.num_sparse  # x's row and column, if any
    strength = strength[skip:, skip:]
    strength = strength + strength.T
    np.fill_diagonal(strength, 0.0)
    return strength


def _pilot(config: Config, steps: int, attribution_samples: int) -> tuple[DLRM, Batch]:
    """A DLRM of the config's shape trained for ``steps`` steps, and a held-out (eval) batch
    of ``attribution_samples`` samples."""
    pilot = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, name="dlrm", concat_embeddings=False),
        train=dataclasses.replace(config.train, steps=steps),
    )
    # The pilot's DLRM from the build layer's parts: build_run would resolve a learned
    # partition, which is what runs this pilot.
    source = build_source(pilot.data)
    device = torch.device("cpu")
    model = build_model(pilot, source.schema, device)
    optimizer = build_dense_optimizer(pilot.optimizer, model)
    fit_steps(model, optimizer, pilot, source.train_batches(pilot.train.batch_size), steps, device)
    count = min(attribution_samples, pilot.data.synthetic.eval_samples)
    held_out = next(iter(source.eval_batches(count)))
    return cast("DLRM", model), held_out  # built with model.name = "dlrm"


def learn_interaction_strength(
    config: Config, steps: int, *, attribution_samples: int = 8192
) -> np.ndarray:
    """Train a DLRM of the config's shape for ``steps`` steps, then ``pair_attribution``
    on ``attribution_samples`` held-out (eval) samples."""
    return pair_attribution(*_pilot(config, steps, attribution_samples))


def embedding_representations(model: DLRM, batch: Batch) -> np.ndarray:
    """``[T, D * D]``: each feature's pooled-embedding covariance over the batch's samples,
    scaled to unit norm, one flattened row per feature.

    Why the covariance: for two features' centred embeddings ``a`` and ``b`` drawn
    independently, ``E[(a . b)^2] = tr(C_a C_b)``, the inner product of these rows: features
    whose embeddings vary in the same directions are those whose dots can carry an
    interaction. The means are left out (a constant dot is a bias, not an interaction); the
    unit norm makes the row a direction (a feature's scale says nothing about its partners).
    """
    with torch.no_grad():
        embeddings = model.sparse(batch.sparse).stacked().double()  # [N, T, D]
    centred = embeddings - embeddings.mean(0)
    cov = torch.einsum("ntd,nte->tde", centred, centred) / max(len(centred) - 1, 1)
    rows = cov.reshape(cov.shape[0], -1)
    norm = rows.norm(dim=1, keepdim=True)
    return cast(np.ndarray, (rows / norm.clamp_min(1e-300)).cpu().numpy())


def learn_feature_representations(
    config: Config, steps: int, *, attribution_samples: int = 8192
) -> np.ndarray:
    """Train a DLRM of the config's shape for ``steps`` steps (the pilot of
    ``learn_interaction_strength``), then ``embedding_representations`` on
    ``attribution_samples`` held-out (eval) samples: ``[F, D * D]``."""
    return embedding_representations(*_pilot(config, steps, attribution_samples))


def learn_pilot_signals(
    config: Config, steps: int, *, attribution_samples: int = 8192
) -> tuple[np.ndarray, np.ndarray]:
    """Both partitioners' inputs from one pilot run: the interaction strength ``[F, F]``
    and the feature representations ``[F, D * D]``."""
    model, held_out = _pilot(config, steps, attribution_samples)
    return pair_attribution(model, held_out), embedding_representations(model, held_out)


def resolve_partition(config: Config, schema: DataSchema) -> list[list[str]]:
    """The feature groups of ``model.dmt.partition``: learned by a pilot run for ``auto``
    (interaction strength) and ``embedding`` (clustered embeddings), else as
    ``models.partition_groups`` gives them."""
    dmt = config.model.dmt
    if dmt.partition not in LEARNED_PARTITIONS:
        return partition_groups(config, schema)
    names = schema.sparse_names
    if dmt.num_towers > len(names):
        raise ValueError(
            f"model.dmt.num_towers = {dmt.num_towers} but the data has only {len(names)} "
            f"categorical features; use num_towers <= {len(names)}"
        )
    stats = feature_stats(config, schema)
    costs = feature_costs(stats, dmt.memory_weight, dmt.count_weight)
    if dmt.partition == "embedding":
        log.info("tower partitioner: learning feature embeddings (%d pilot steps)", dmt.pilot_steps)
        vectors = on_first_rank(lambda: learn_feature_representations(config, dmt.pilot_steps))
        clustered = cluster_features(
            names,
            vectors,
            costs,
            dmt.num_towers,
            tolerance=dmt.balance_tolerance,
            seed=config.train.seed,
        )
        log.info(
            "tower partition %s (embedding clusters): %.1f%% of the embedding affinity inside "
            "towers, cost imbalance %.2f",
            clustered.groups,
            100 * clustered.intra_mass,
            clustered.imbalance,
        )
        return clustered.groups
    log.info("tower partitioner: learning feature interactions (%d pilot steps)", dmt.pilot_steps)
    strength = on_first_rank(lambda: learn_interaction_strength(config, dmt.pilot_steps))
    result = partition_features(
        names,
        strength,
        costs,
        dmt.num_towers,
        tolerance=dmt.balance_tolerance,
        seed=config.train.seed,
    )
    log.info(
        "tower partition %s: %.1f%% of the learned interaction inside towers, cost imbalance %.2f",
        result.groups,
        100 * result.intra_mass,
        result.imbalance,
    )
    return result.groups


def with_learned_partition(config: Config, schema: DataSchema) -> Config:
    """``config`` with a DMT's learned (``auto`` or ``embedding``) partition replaced by the
    groups its pilot run learns (``build_model`` builds explicit partitions only); other
    configs unchanged."""
    if not MODELS[config.model.name].towers or config.model.dmt.partition not in LEARNED_PARTITIONS:
        return config
    groups = resolve_partition(config, schema)
    dmt = dataclasses.replace(config.model.dmt, partition=tuple(tuple(g) for g in groups))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dmt=dmt))
