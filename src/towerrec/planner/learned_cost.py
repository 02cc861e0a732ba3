"""Learned device cost: a small network from a device's shards to its kernel time.

Tables on one device share fused kernels, so a device's time is not the sum of
its tables' times (NeuroShard, DreamShard). The model sees the set of shards::

    shard features [S, F]  (log rows, width, log ids, log bytes, log touched rows, hot shares)
        │  encoder MLP, per shard               [S, H]
        ▼  sum over the device's shards         [H]
    concat device features (kernels, shards) ─► head MLP ─► log seconds

It is trained on measured multi-table kernel times (``towerrec bench costmodel``
collects them with towerrec.calibration) by least squares on log time, so its
error is relative.

``weights_digest`` is the SHA-256 the planner's weights files (this model's, the
DreamShard/AutoShard and NeuroShard ones) carry under ``WEIGHTS_DIGEST``:
``torch.load`` does not check the zip's CRCs, so a flipped byte in a tensor would
otherwise load as a changed weight.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from towerrec.checksums import json_digest
from towerrec.planner.stats import TableStats

__all__ = [
    "WEIGHTS_DIGEST",
    "LearnedCostModel",
    "device_tensors",
    "shard_features",
    "weights_digest",
]

WEIGHTS_DIGEST = "weights_sha256"  # the key a weights file keeps its digest under

Shards = Sequence[tuple[TableStats, int, int]]  # (stats, rows, cols) on one device
NUM_SHARD_FEATURES = 8
NUM_DEVICE_FEATURES = 2


def shard_features(stats: TableStats, rows: int, cols: int, batch: int) -> list[float]:
    fraction = rows / stats.num_embeddings
    ids = stats.lookups(batch) * fraction
    touched = stats.distinct(batch, fraction)
    return [
        math.log1p(rows) / 17,
        cols / 128,
        math.log1p(ids) / 15,
        math.log1p(ids * cols) / 20,
        math.log1p(touched) / 15,
        math.log1p(touched * cols) / 20,
        stats.hot1_share,
        stats.hot10_share,
    ]


def device_tensors(
    devices: Sequence[Shards], batch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded shard features [N, S, F], mask [N, S] and device features [N, 2]."""
    most = max(len(d) for d in devices)
    feats = torch.zeros(len(devices), most, NUM_SHARD_FEATURES)
    mask = torch.zeros(len(devices), most)
    device = torch.zeros(len(devices), NUM_DEVICE_FEATURES)
    for n, shards in enumerate(devices):
        for s, (stats, rows, cols) in enumerate(shards):
            feats[n, s] = torch.tensor(shard_features(stats, rows, cols, batch))
            mask[n, s] = 1
        device[n] = torch.tensor([len({c for *_, c in shards}) / 8, len(shards) / 8])
    return feats, mask, device


class LearnedCostModel(nn.Module):
    def __init__(self, hidden: int = 32, batch: int = 2048) -> None:
        super().__init__()
        self.batch = batch
        self.encoder = nn.Sequential(
            nn.Linear(NUM_SHARD_FEATURES, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.head = nn.Sequential(
            nn.Linear(hidden + NUM_DEVICE_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(
        self, feats: torch.Tensor, mask: torch.Tensor, device: torch.Tensor
    ) -> torch.Tensor:
        """log seconds [N] of N devices."""
        pooled = (self.encoder(feats) * mask.unsqueeze(-1)).sum(dim=1)
        return cast(torch.Tensor, self.head(torch.cat([pooled, device], dim=1))).squeeze(-1)

    @torch.no_grad()
    def predict(self, devices: Sequence[Shards]) -> list[float]:
        """Predicted seconds of each device."""
        self.eval()
        return torch.exp(self(*device_tensors(devices, self.batch))).tolist()

    def fit(
        self,
        devices: Sequence[Shards],
        seconds: Sequence[float],
        steps: int = 1500,
        lr: float = 3e-3,
        seed: int = 0,
    ) -> float:
        """Train on measured ``seconds``; returns the final training loss (MSE of log time)."""
        if len(devices) != len(seconds) or not devices:
            raise ValueError("fit needs one measured time per device, and at least one device")
        if min(seconds) <= 0:
            raise ValueError("measured times must be > 0")
        torch.manual_seed(seed)
        for layer in [*self.encoder, *self.head]:
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        feats, mask, device = device_tensors(devices, self.batch)
        target = torch.log(torch.tensor(seconds, dtype=torch.float32))
        # Start the output at the mean log time: the network learns the differences.
        with torch.no_grad():
            cast(nn.Linear, self.head[-1]).bias.fill_(float(target.mean()))
        optimizer = torch.optim.Adam(self.parameters(), lr=lr, weight_decay=1e-5)
        self.train()
        loss = torch.tensor(0.0)
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.mean((self(feats, mask, device) - target) ** 2)
            loss.backward()
            optimizer.step()
        return float(loss.detach())

    def save(self, path: str | Path) -> None:
        data = {"batch": self.batch, "state": self.state_dict()}
        torch.save({**data, WEIGHTS_DIGEST: weights_digest(data)}, path)

    @staticmethod
    def load(path: str | Path) -> LearnedCostModel:
        data = torch.load(path, weights_only=True)
        if WEIGHTS_DIGEST in data and data.pop(WEIGHTS_DIGEST) != weights_digest(data):
            raise ValueError(
                f"{str(path)!r} does not match its own {WEIGHTS_DIGEST}: the file is damaged "
                "(its weights cannot be trusted); fit and save the model again"
            )
        hidden = data["state"]["encoder.0.weight"].shape[0]
        model = LearnedCostModel(hidden, data["batch"])
        model.load_state_dict(data["state"])
        return model


def weights_digest(data: Mapping[str, Any]) -> str:
    """SHA-256 of a weights file's dict: its plain values as canonical JSON, tensors
    standing in by name; then each tensor, by name in sorted order, as its name, dtype,
    shape and raw bytes. Names are key paths (``/state/encoder.0.weight``)."""
    tensors: dict[str, torch.Tensor] = {}

    def plain(value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[name] = value
            return {"tensor": name}
        if isinstance(value, Mapping):
            return {str(k): plain(v, f"{name}/{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v, f"{name}/{i}") for i, v in enumerate(value)]
        return value

    digest = hashlib.sha256(json_digest(plain(data, "")).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
