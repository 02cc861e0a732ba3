"""DreamShard (Zha et al., NeurIPS 2022): a cost network and a placement policy trained
by REINFORCE on the MDP that the cost network estimates, without executing anything.

Cost network::

    shard features [S, F] ─► encoder MLP (per shard) ─► [S, H]
        sum over a device's shards (fused kernel)   ─► device embedding e_d [H]
        forward head(e_d), backward head(e_d)       ─► computation ms of device d
    max over devices of e_d ─► communication head   ─► the step's all-to-all ms
    device cost_d = forward_d + backward_d + communication; overall = max_d cost_d

Policy (one shard at a time, shards in descending single-shard cost)::

    current shard's features ─► encoder ─► t [H]
    per device d: its shards' encodings summed [H], and the cost network's
        (forward, backward, cost, cost if the shard went there) / max of the last
        ─► MLP ─► c_d [H]
    score MLP([t, sum_d, c_d]) ─► logit_d; softmax over the devices with room

Training alternates, as the paper: cost-network updates on the measured devices
(and, when a ``measure`` function is given, devices of the current policy's
plans measured as they come, the paper's data collection), then policy updates on
batches of episodes of one training task, rewarded by minus the estimated overall
cost (REINFORCE, the batch mean as baseline, an entropy bonus). Planning is greedy
(argmax). The network scores each device on its own, so it runs on any number
of devices, more than it was trained for included.

Without communication measurements in the cost data (the kernel-only data of
``towerrec bench costmodel``), the communication head is off (``extra.comm``
false) and forward plus backward are fitted to the measured total.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from towerrec.planner.learned_policy import (
    NUM_FEATURES,
    CostSamples,
    PolicyPlacer,
    PolicySession,
    PolicyWeights,
    Shards,
    Task,
    by_descending_cost,
    load_networks,
    log_relative_loss,
    mlp,
    ms,
    padded_features,
    task_features,
    trained_weights,
)
from towerrec.planner.placement import Item
from towerrec.planner.stats import TableStats

__all__ = [
    "CostNetwork",
    "DreamShardPlacer",
    "PolicyNetwork",
    "Session",
    "estimated_cost",
    "networks",
    "rollout",
    "train_dreamshard",
]

Measure = Callable[[Shards], float]


class CostNetwork(nn.Module):
    def __init__(self, hidden: int = 32, comm: bool = False) -> None:
        super().__init__()
        self.encoder = mlp(NUM_FEATURES, 64, hidden)
        self.forward_head = mlp(hidden, 32, 1, last_relu=False)
        self.backward_head = mlp(hidden, 32, 1, last_relu=False)
        self.comm_head = mlp(2, 32, 1, last_relu=False)
        self.comm = comm

    def embed(self, feats: torch.Tensor) -> torch.Tensor:
        """Shard encodings [..., H] of shard features [..., F]."""
        return cast(torch.Tensor, self.encoder(feats))

    def compute(self, device_emb: torch.Tensor) -> torch.Tensor:
        """(forward, backward) ms [..., 2] of devices with embeddings [..., H]."""
        fwd = F.softplus(self.forward_head(device_emb))
        bwd = F.softplus(self.backward_head(device_emb))
        return torch.cat([fwd, bwd], dim=-1)

    def communication(self, dims: torch.Tensor, world: int) -> torch.Tensor:
        """Each device's all-to-all ms [..., D] from its pooled output dims [..., D]."""
        if not self.comm or world < 2:
            return torch.zeros_like(dims)
        x = torch.stack([dims / 128, torch.full_like(dims, math.log2(world) / 8)], dim=-1)
        return F.softplus(self.comm_head(x)).squeeze(-1)

    def device_embeddings(self, feats: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Sum-reduced embeddings [N, H] of N devices: padded features [N, S, F], mask [N, S]."""
        return (self.embed(feats) * mask.unsqueeze(-1)).sum(dim=1)

    def device_costs(self, device_emb: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
        """Device costs ms [..., D]: sum-reduced embeddings [..., D, H], output dims [..., D]."""
        world = device_emb.shape[-2]
        return self.compute(device_emb).sum(-1) + self.communication(dims, world)

    def overall(self, device_emb: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
        """Estimated step ms [...] of plans: the max over devices of the device cost (the
        all-to-all waits for the device with the most output, so max-reduce for it too)."""
        return self.device_costs(device_emb, dims).max(dim=-1).values


class PolicyNetwork(nn.Module):
    NUM_COST_FEATURES = 4

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.table_encoder = mlp(NUM_FEATURES, 64, hidden)
        self.cost_encoder = mlp(self.NUM_COST_FEATURES, 32, hidden)
        self.score = mlp(3 * hidden, 64, 1, last_relu=False)

    def logits(
        self, table: torch.Tensor, device_tables: torch.Tensor, cost_feats: torch.Tensor
    ) -> torch.Tensor:
        """Logits [N, D]: current shard [N, H], devices' encodings [N, D, H], cost features
        [N, D, 4]."""
        n, d, h = device_tables.shape
        x = torch.cat(
            [table.unsqueeze(1).expand(n, d, h), device_tables, self.cost_encoder(cost_feats)], -1
        )
        return cast(torch.Tensor, self.score(x)).squeeze(-1)


def _cost_features(
    cost: CostNetwork, sums: torch.Tensor, dims: torch.Tensor, shard: torch.Tensor, cols: float
) -> torch.Tensor:
    """[N, D, 4]: forward, backward, device cost now and with the shard (encoding [H],
    ``cols`` output dims) added, over the largest of the last (scale-free, any number
    of devices)."""
    now = cost.compute(sums)
    world = sums.shape[-2]
    total = now.sum(-1) + cost.communication(dims, world)
    after = cost.compute(sums + shard).sum(-1) + cost.communication(dims + cols, world)
    feats = torch.cat([now, total.unsqueeze(-1), after.unsqueeze(-1)], dim=-1)
    return feats / after.max(dim=-1, keepdim=True).values.clamp_min(1e-9).unsqueeze(-1)


def rollout(
    cost: CostNetwork,
    policy: PolicyNetwork,
    feats: torch.Tensor,
    devices: int,
    episodes: int,
    generator: torch.Generator | None,
    memory: torch.Tensor | None = None,
    capacity: float = float("inf"),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``episodes`` placements of shards ``feats`` [T, F] (in that order) on ``devices``
    in the estimated MDP; ``generator`` None: greedy. Returns actions [N, T], summed
    log-probabilities [N], mean entropy and the estimated cost [N] (ms)."""
    with torch.no_grad():
        ce = cost.embed(feats)
    pe = policy.table_encoder(feats)
    hidden = ce.shape[-1]
    cols = feats[:, 1] * 128  # FEATURE_LAYOUT: cols / 128
    sums = torch.zeros(episodes, devices, hidden)
    tables = torch.zeros(episodes, devices, hidden)
    dims = torch.zeros(episodes, devices)
    used = torch.zeros(episodes, devices)
    mem = torch.zeros(len(feats)) if memory is None else memory
    actions, logps, entropies = [], [], []
    for t in range(len(feats)):
        with torch.no_grad():
            cf = _cost_features(cost, sums, dims, ce[t], float(cols[t]))
        logits = policy.logits(pe[t].expand(episodes, hidden), tables, cf)
        ok = used + mem[t] <= capacity
        ok = ok | ~ok.any(dim=1, keepdim=True)  # nowhere fits: the estimate goes on
        logits = logits.masked_fill(~ok, float("-inf"))
        log_probs = torch.log_softmax(logits, dim=-1)
        if generator is None:
            a = logits.argmax(dim=-1)
        else:
            a = torch.multinomial(log_probs.exp().detach(), 1, generator=generator).squeeze(1)
        logps.append(log_probs.gather(1, a[:, None]).squeeze(1))
        p = log_probs.exp()
        entropies.append(-(p * log_probs.masked_fill(~ok, 0.0)).sum(-1))
        onehot = F.one_hot(a, devices).to(torch.float32).unsqueeze(-1)
        sums = sums + onehot * ce[t]
        tables = tables + onehot * pe[t]
        used = used + onehot.squeeze(-1) * mem[t]
        dims = dims + onehot.squeeze(-1) * cols[t]
        actions.append(a)
    with torch.no_grad():
        total = cost.overall(sums, dims)
    return (
        torch.stack(actions, 1),
        torch.stack(logps, 1).sum(1),
        torch.stack(entropies).mean(),
        total,
    )


def _order(cost: CostNetwork, feats: torch.Tensor) -> list[int]:
    """Descending single-shard estimated cost (ties by index)."""
    with torch.no_grad():
        return by_descending_cost(cost.compute(cost.embed(feats)).sum(-1).tolist())


def estimated_cost(
    cost: CostNetwork, feats: torch.Tensor, assignment: Sequence[int], devices: int
) -> float:
    """The cost network's overall ms of shards ``feats`` placed by ``assignment``."""
    with torch.no_grad():
        ce = cost.embed(feats)
        where = torch.tensor(assignment)
        sums = torch.zeros(devices, ce.shape[-1]).index_add(0, where, ce)
        dims = torch.zeros(devices).index_add(0, where, feats[:, 1] * 128)
        return float(cost.overall(sums, dims))


def _fit_cost(
    cost: CostNetwork,
    optimizer: torch.optim.Optimizer,
    data: CostSamples,
    steps: int,
) -> float:
    """Fit forward + backward (each apart where the data has them) and communication."""
    feats, mask = padded_features(data.devices, data.batch)
    target = ms(data.seconds)
    split = ms([t for fb in data.split for t in fb]).view(-1, 2) if data.split else None
    comm = [(torch.tensor(dims, dtype=torch.float32), ms([t])[0]) for dims, t in data.comm]
    loss = torch.tensor(0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        predicted = cost.compute(cost.device_embeddings(feats, mask))
        loss = log_relative_loss(predicted.sum(-1), target)
        if split is not None:
            loss = loss + log_relative_loss(predicted, split)
        if comm:
            worst = torch.stack([cost.communication(d, len(d)).max() for d, _ in comm])
            loss = loss + log_relative_loss(worst, torch.stack([t for _, t in comm]))
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def train_dreamshard(
    devices: Sequence[Shards],
    seconds: Sequence[float],
    tasks: Sequence[Task],
    *,
    seed: int = 0,
    split: Sequence[tuple[float, float]] = (),
    comm: Sequence[tuple[tuple[int, ...], float]] = (),
    batch: int = 2048,
    hidden: int = 32,
    iterations: int = 4,
    cost_steps: int = 300,
    policy_batches: int = 75,
    episodes: int = 16,
    lr: float = 3e-3,
    entropy_weight: float = 1e-3,
    measure: Measure | None = None,
    collect: int = 4,
) -> PolicyWeights:
    """Train DreamShard on measured ``devices`` / ``seconds`` (forward + backward;
    ``split``: the two apart; ``comm``: all-to-alls, output dims per rank and seconds)
    and training ``tasks`` ((tables, devices) pairs); deterministic given ``seed``.
    ``measure`` (optional) times a device's shards: each iteration after the first then
    measures the devices of ``collect`` plans of the current policy and adds them to
    the cost data, as the paper's data collection."""
    if not tasks:
        raise ValueError("train_dreamshard needs at least one training task")
    data = CostSamples(list(devices), list(seconds), list(split), list(comm), batch)
    if measure is not None and data.split:
        raise ValueError("measure adds totals only: train with split times or measure, not both")
    torch.manual_seed(seed)
    rng = np.random.default_rng([seed, 5])
    generator = torch.Generator().manual_seed(seed)
    cost, policy = CostNetwork(hidden, comm=bool(data.comm)), PolicyNetwork(hidden)
    cost_opt = torch.optim.Adam(cost.parameters(), lr=3e-3)
    policy_opt = torch.optim.Adam(policy.parameters(), lr=lr)
    task_feats = [task_features(tables, batch) for tables, _ in tasks]
    history: list[float] = []
    cost_loss = 0.0
    for iteration in range(iterations):
        if measure is not None and iteration > 0:
            for k in rng.choice(len(tasks), min(collect, len(tasks)), replace=False):
                tables, count = tasks[int(k)]
                order = _order(cost, task_feats[int(k)])
                with torch.no_grad():
                    actions, *_ = rollout(
                        cost, policy, task_feats[int(k)][order], count, 1, generator
                    )
                on: list[list[tuple[TableStats, int, int]]] = [[] for _ in range(count)]
                for pos, a in zip(order, actions[0].tolist()):
                    s = tables[pos]
                    on[a].append((s, s.num_embeddings, s.embedding_dim))
                for shards in on:
                    if shards:
                        data.devices.append(shards)
                        data.seconds.append(measure(shards))
        cost_loss = _fit_cost(cost, cost_opt, data, cost_steps)
        for _ in range(policy_batches):
            k = int(rng.integers(len(tasks)))
            feats = task_feats[k][_order(cost, task_feats[k])]
            _, logp, ent, total = rollout(cost, policy, feats, tasks[k][1], episodes, generator)
            reward = -total
            advantage = (reward - reward.mean()) / (reward.std() + 1e-8)
            loss = -(advantage * logp).mean() / len(feats) - entropy_weight * ent
            policy_opt.zero_grad()
            loss.backward()
            policy_opt.step()
            history.append(float(total.mean()))
    extra = {
        "comm": bool(data.comm),
        "cost_data_devices": len(data.devices),
        "cost_fit_mse_log": cost_loss,
        "mean_estimated_ms": history,
    }
    return trained_weights("dreamshard", cost, policy, tasks, data, hidden, seed, extra)


def networks(weights: PolicyWeights) -> tuple[CostNetwork, PolicyNetwork]:
    """The cost and policy networks of ``weights`` (eval mode)."""
    cost = CostNetwork(weights.hidden, bool(weights.extra.get("comm", False)))
    return load_networks(weights, cost, PolicyNetwork(weights.hidden))


class Session(PolicySession[CostNetwork, PolicyNetwork]):
    """One task's greedy (argmax) placement; also keeps each device's output dims."""

    def __init__(
        self,
        cost: CostNetwork,
        policy: PolicyNetwork,
        batch: int,
        items: Sequence[Item],
        world: int,
    ) -> None:
        super().__init__(cost, policy, batch, items, world)
        self.cols = (self.feats[:, 1] * 128).tolist()
        self.dims = torch.zeros(world)

    def order(self, items: Sequence[Item]) -> list[int]:
        return _order(self.cost, self.feats)

    def add(self, device: int, index: int) -> None:
        super().add(device, index)
        self.dims[device] += self.cols[index]

    def scores(self, index: int) -> torch.Tensor:
        cf = _cost_features(
            self.cost,
            self.sums.unsqueeze(0),
            self.dims.unsqueeze(0),
            self.ce[index],
            self.cols[index],
        )
        return self.policy.logits(self.pe[index : index + 1], self.tables.unsqueeze(0), cf)[0]


class DreamShardPlacer(PolicyPlacer[CostNetwork, PolicyNetwork]):
    """Greedy (argmax) placement by trained DreamShard weights; one ``start`` per task."""

    def __init__(self, weights: PolicyWeights) -> None:
        super().__init__(weights, networks, Session)
