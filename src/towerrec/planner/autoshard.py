"""AutoShard (Zha et al., KDD 2022): a neural multi-table cost model, and a recurrent
policy that visits the tables in sequence, trained by policy gradient with the cost
model as its environment.

Cost model (one device's fused kernel)::

    shard features [S, F] ─► MLP per shard ─► sum ─► MLP ─► softplus ─► ms

Policy (shards in descending single-shard estimated cost, one decision each)::

    step t: [encoding of shard t, t / T] ─► GRU cell ─► h_t [H]
    device d: [its shards' encodings summed, cost_d, cost_d with shard t]
               (costs over the largest of the last) ─► MLP ─► a_d [H]
    logit_d = MLP([h_t, a_d]) (devices with room);  value = MLP([h_t, max_d a_d])

The reward of step t is minus the growth of the estimated max device cost, over the
task's balanced cost (sum of single-shard costs / devices): the rewards of an episode
add up to minus its final estimated cost, and each decision sees what it added.
Advantage actor-critic (the value head as baseline, an entropy bonus). Memory does
not bind in training; in planning, devices without room are masked (algorithms.py's
placing loop). Planning is greedy; like DreamShard's, the policy scores each device on its own and so runs on
any number of devices.
"""

from __future__ import annotations

from collections.abc import Sequence
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

__all__ = [
    "AutoShardPlacer",
    "MultiTableCost",
    "SequencePolicy",
    "Session",
    "networks",
    "rollout",
    "train_autoshard",
]


class MultiTableCost(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.encoder = mlp(NUM_FEATURES, 64, hidden)
        self.head = mlp(hidden, 64, 1, last_relu=False)

    def embed(self, feats: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.encoder(feats))

    def cost(self, device_emb: torch.Tensor) -> torch.Tensor:
        """ms [...] of devices with summed encodings [..., H]."""
        return F.softplus(self.head(device_emb)).squeeze(-1)


class SequencePolicy(nn.Module):
    NUM_DEVICE_FEATURES = 2

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.hidden = hidden
        self.table_encoder = mlp(NUM_FEATURES, 64, hidden)
        self.cell = nn.GRUCell(hidden + 1, hidden)
        self.device_net = mlp(hidden + self.NUM_DEVICE_FEATURES, 64, hidden)
        self.score = mlp(2 * hidden, 64, 1, last_relu=False)
        self.value = mlp(2 * hidden, 64, 1, last_relu=False)

    def step(
        self, h: torch.Tensor, device_feats: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [N, D] and values [N] from the state h [N, H] and device features
        [N, D, H + 2]."""
        n, d, _ = device_feats.shape
        a = self.device_net(device_feats)
        logits = self.score(torch.cat([h.unsqueeze(1).expand(n, d, self.hidden), a], -1))
        value = self.value(torch.cat([h, a.max(dim=1).values], -1))
        return logits.squeeze(-1), value.squeeze(-1)


def _device_feats(
    cost: MultiTableCost,
    sums: torch.Tensor,
    tables: torch.Tensor,
    shard: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device features [N, D, H + 2] and the current costs [N, D]."""
    with torch.no_grad():
        now = cost.cost(sums) * (sums.abs().sum(-1) > 0)
        after = cost.cost(sums + shard)
        scale = after.max(dim=-1, keepdim=True).values.clamp_min(1e-9)
        extra = torch.stack([now / scale, after / scale], dim=-1)
    return torch.cat([tables, extra], dim=-1), now


def rollout(
    cost: MultiTableCost,
    policy: SequencePolicy,
    feats: torch.Tensor,
    devices: int,
    episodes: int,
    generator: torch.Generator | None,
) -> dict[str, torch.Tensor]:
    """``episodes`` placements of shards ``feats`` [T, F] in order on ``devices`` with the
    cost model as environment; ``generator`` None: greedy. Returns actions [N, T],
    log-probabilities, values and rewards [N, T], entropy (mean) and the final estimated
    max device cost [N] (ms)."""
    with torch.no_grad():
        ce = cost.embed(feats)
        balanced = float(cost.cost(ce).sum()) / devices
    pe = policy.table_encoder(feats)
    hidden, steps = ce.shape[-1], len(feats)
    sums = torch.zeros(episodes, devices, hidden)
    tables = torch.zeros(episodes, devices, hidden)
    h = torch.zeros(episodes, hidden)
    before = torch.zeros(episodes)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("a", "logp", "v", "r", "ent")}
    for t in range(steps):
        x = torch.cat([pe[t].expand(episodes, hidden), torch.full((episodes, 1), t / steps)], -1)
        h = policy.cell(x, h)
        dfeats, _ = _device_feats(cost, sums, tables, ce[t])
        logits, value = policy.step(h, dfeats)
        log_probs = torch.log_softmax(logits, dim=-1)
        if generator is None:
            a = logits.argmax(dim=-1)
        else:
            a = torch.multinomial(log_probs.exp().detach(), 1, generator=generator).squeeze(1)
        onehot = F.one_hot(a, devices).to(torch.float32).unsqueeze(-1)
        sums = sums + onehot * ce[t]
        tables = tables + onehot * pe[t]
        with torch.no_grad():
            after = (cost.cost(sums) * (sums.abs().sum(-1) > 0)).max(dim=-1).values
        out["r"].append(-(after - before) / max(balanced, 1e-9))
        before = after
        out["a"].append(a)
        out["logp"].append(log_probs.gather(1, a[:, None]).squeeze(1))
        out["v"].append(value)
        out["ent"].append(-(log_probs.exp() * log_probs).sum(-1))
    result = {k: torch.stack(v, 1) for k, v in out.items()}
    result["ent"] = result["ent"].mean()
    result["cost"] = before
    return result


def _order(cost: MultiTableCost, feats: torch.Tensor) -> list[int]:
    with torch.no_grad():
        return by_descending_cost(cost.cost(cost.embed(feats)).tolist())


def _fit_cost(
    cost: MultiTableCost,
    devices: Sequence[Shards],
    seconds: Sequence[float],
    batch: int,
    steps: int,
) -> float:
    feats, mask = padded_features(devices, batch)
    target = ms(seconds)
    optimizer = torch.optim.Adam(cost.parameters(), lr=3e-3)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        predicted = cost.cost((cost.embed(feats) * mask.unsqueeze(-1)).sum(1))
        loss = log_relative_loss(predicted, target)
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def train_autoshard(
    devices: Sequence[Shards],
    seconds: Sequence[float],
    tasks: Sequence[Task],
    *,
    seed: int = 0,
    batch: int = 2048,
    hidden: int = 32,
    cost_steps: int = 900,
    policy_batches: int = 300,
    episodes: int = 16,
    lr: float = 3e-3,
    entropy_weight: float = 1e-3,
    value_weight: float = 0.5,
) -> PolicyWeights:
    """Train AutoShard's cost model on measured ``devices`` / ``seconds``, then its policy
    on the training ``tasks`` ((tables, devices) pairs); deterministic given ``seed``."""
    if not tasks:
        raise ValueError("train_autoshard needs at least one training task")
    data = CostSamples(list(devices), list(seconds), batch=batch)
    torch.manual_seed(seed)
    rng = np.random.default_rng([seed, 7])
    generator = torch.Generator().manual_seed(seed)
    cost, policy = MultiTableCost(hidden), SequencePolicy(hidden)
    cost_loss = _fit_cost(cost, devices, seconds, batch, cost_steps)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    task_feats = [task_features(tables, batch) for tables, _ in tasks]
    history: list[float] = []
    for _ in range(policy_batches):
        k = int(rng.integers(len(tasks)))
        feats = task_feats[k][_order(cost, task_feats[k])]
        out = rollout(cost, policy, feats, tasks[k][1], episodes, generator)
        returns = out["r"].flip(1).cumsum(1).flip(1)  # reward to go
        advantage = (returns - out["v"]).detach()
        loss = (
            -(advantage * out["logp"]).mean()
            + value_weight * ((returns - out["v"]) ** 2).mean()
            - entropy_weight * out["ent"]
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(float(out["cost"].mean()))
    extra = {"cost_fit_mse_log": cost_loss, "mean_estimated_ms": history}
    return trained_weights("autoshard", cost, policy, tasks, data, hidden, seed, extra)


def networks(weights: PolicyWeights) -> tuple[MultiTableCost, SequencePolicy]:
    """The cost model and policy of ``weights`` (eval mode)."""
    return load_networks(weights, MultiTableCost(weights.hidden), SequencePolicy(weights.hidden))


class Session(PolicySession[MultiTableCost, SequencePolicy]):
    """One task's greedy placement: the GRU steps through the shards in order."""

    def __init__(
        self,
        cost: MultiTableCost,
        policy: SequencePolicy,
        batch: int,
        items: Sequence[Item],
        world: int,
    ) -> None:
        super().__init__(cost, policy, batch, items, world)
        self.h = torch.zeros(1, self.ce.shape[-1])
        self.step = 0
        self.steps = len(items)

    def order(self, items: Sequence[Item]) -> list[int]:
        return _order(self.cost, self.feats)

    def scores(self, index: int) -> torch.Tensor:
        x = torch.cat([self.pe[index : index + 1], torch.tensor([[self.step / self.steps]])], -1)
        self.h = self.policy.cell(x, self.h)
        dfeats, _ = _device_feats(
            self.cost, self.sums.unsqueeze(0), self.tables.unsqueeze(0), self.ce[index]
        )
        logits, _ = self.policy.step(self.h, dfeats)
        self.step += 1
        return logits[0]


class AutoShardPlacer(PolicyPlacer[MultiTableCost, SequencePolicy]):
    """Greedy placement by trained AutoShard weights; one ``start`` per task."""

    def __init__(self, weights: PolicyWeights) -> None:
        super().__init__(weights, networks, Session)
