"""NeuroShard (Zha et al., MLSys 2023): pre-trained neural cost models, then search.

::

    cost data (towerrec plan collect-costs: random table combinations, column splits)
        │  pre-train (towerrec plan train-policy --planner neuroshard)
        ▼
    compute model   two LearnedCostModels (shard-set encoder, sum pooling): a device's
                    shards -> forward seconds, backward + fused update seconds
    comm model      linear (the data is 2-rank gloo all-to-alls only, too thin for an MLP):
                    a device's all-to-all seconds = latency + s_per_byte * (bytes it sends
                    + bytes it receives), fwd outputs and bwd gradients
        │
        ▼  search (neuroshard_search.py), plans scored by max over devices of compute + comm

Both models see one device at a time (its shards; its own and the total output
dims), so a policy trained on any data plans for any number of devices. The
compute model is trained at the cost data's batch ``B``; a task whose devices see
``G`` samples per iteration gets ``G / B`` times its prediction (kernel time grows
with the batch; the features stay where the model was trained).

The weights file (``torch.save``) records its format, version and feature
layout, and the SHA-256 of the rest (``weights_sha256``, tensors' bytes included);
loading one written for another layout, or one that does not match its digest, is
refused with the command that writes a current one (files without the digest, from
earlier versions, load). The default weights ship in ``planner/weights/``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from towerrec.planner.costdata import CommSample, CostData, file_digest
from towerrec.planner.learned_cost import (
    NUM_DEVICE_FEATURES,
    NUM_SHARD_FEATURES,
    WEIGHTS_DIGEST,
    LearnedCostModel,
    shard_features,
    weights_digest,
)
from towerrec.planner.stats import TableStats

__all__ = [
    "DEFAULT_WEIGHTS",
    "CommModel",
    "NeuroShardPolicy",
    "load_policy",
    "train_neuroshard",
    "write_policy",
]

WEIGHTS_FORMAT = "towerrec-neuroshard"
WEIGHTS_VERSION = 1
LAYOUT = {
    "shard_features": NUM_SHARD_FEATURES,
    "device_features": NUM_DEVICE_FEATURES,
    "comm": ["latency_s", "s_per_byte"],
}
DEFAULT_WEIGHTS = Path(__file__).parent / "weights" / "neuroshard.pt"
_RETRAIN = "towerrec plan train-policy --planner neuroshard --cost-data FILE --out DIR"

Shards = Sequence[tuple[TableStats, int, int]]


@dataclass(frozen=True)
class CommModel:
    """Per-device all-to-all seconds from per-device total output dims (4-byte values)."""

    latency_s: float
    s_per_byte: float

    @staticmethod
    def device_bytes(dims: np.ndarray, batch: int) -> np.ndarray:
        """Bytes each device sends and receives: its pooled outputs for the other ranks'
        samples, and the others' outputs for its own ``batch`` samples."""
        world = len(dims)
        return cast(np.ndarray, 4.0 * batch * ((world - 1) * dims + (dims.sum() - dims)))

    def predict(self, dims: Sequence[int] | np.ndarray, batch: int) -> np.ndarray:
        dims = np.asarray(dims, dtype=np.float64)
        if len(dims) < 2:
            return np.zeros(len(dims))
        return self.latency_s + self.s_per_byte * self.device_bytes(dims, batch)

    @staticmethod
    def fit(samples: Sequence[CommSample]) -> CommModel:
        """Least squares of relative error, both coefficients >= 0; a measured sample is
        the slowest rank's time."""
        if not samples:
            raise ValueError(
                f"the cost data holds no all-to-all samples; collect some (--comm N) with "
                f"`towerrec plan collect-costs`, then run `{_RETRAIN}`"
            )
        x = np.array(
            [CommModel.device_bytes(np.array(s.dims, float), s.batch).max() for s in samples]
        )
        y = np.array([s.seconds for s in samples])
        a = np.stack([1 / y, x / y], axis=1)
        best, best_loss = (0.0, 0.0), math.inf
        for cols in ([0, 1], [0], [1]):
            coef, *_ = np.linalg.lstsq(a[:, cols], np.ones_like(y), rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(2)
            full[cols] = coef
            loss = float(np.sum((a @ full - 1) ** 2))
            if loss < best_loss:
                best, best_loss = (float(full[0]), float(full[1])), loss
        return CommModel(*best)


def _layers(model: LearnedCostModel) -> list[np.ndarray]:
    """The model's weights as float64 arrays: enc W1 b1 W2 b2, head W1 b1 W2 b2."""
    linear = [m for m in [*model.encoder, *model.head] if isinstance(m, torch.nn.Linear)]
    out = []
    for m in linear:
        out += [m.weight.detach().double().numpy().copy(), m.bias.detach().double().numpy().copy()]
    return out


class _FastNet:
    """A LearnedCostModel in numpy, split so a device's pooled encoding is kept and
    updated as shards are added (sum pooling)."""

    def __init__(self, model: LearnedCostModel) -> None:
        w1, b1, w2, b2, h1, hb1, h2, hb2 = _layers(model)
        hidden = w1.shape[0]
        self.enc = (w1.T, b1, w2.T, b2)
        self.head_pooled, self.head_device = h1[:, :hidden].T, h1[:, hidden:].T
        self.head_b1, self.head_w2, self.head_b2 = hb1, h2[0], float(hb2[0])
        self.hidden = hidden

    def encode(self, feats: np.ndarray) -> np.ndarray:
        """[S, F] shard features -> [S, H] encodings."""
        w1, b1, w2, b2 = self.enc
        return cast(np.ndarray, np.maximum(np.maximum(feats @ w1 + b1, 0) @ w2 + b2, 0))

    def seconds(self, pooled: np.ndarray, device: np.ndarray) -> np.ndarray:
        """[N, H] pooled encodings and [N, 2] device features -> [N] seconds."""
        h = np.maximum(pooled @ self.head_pooled + device @ self.head_device + self.head_b1, 0)
        return cast(np.ndarray, np.exp(h @ self.head_w2 + self.head_b2))


class NeuroShardPolicy:
    """The pre-trained cost models and what they were trained on."""

    def __init__(
        self,
        forward: LearnedCostModel,
        backward: LearnedCostModel,
        comm: CommModel,
        batch: int,
        info: dict[str, Any] | None = None,
    ) -> None:
        self.forward, self.backward, self.comm = forward, backward, comm
        self.batch = batch
        self.info = dict(info or {})
        self.fast = (_FastNet(forward), _FastNet(backward))

    # ------------------------------------------------------------ predictions
    def features(self, shards: Shards) -> np.ndarray:
        """[S, F] shard features at the training batch."""
        return np.array([shard_features(s, r, c, self.batch) for s, r, c in shards]).reshape(
            len(shards), NUM_SHARD_FEATURES
        )

    def device_seconds(self, devices: Sequence[Shards]) -> list[float]:
        """Predicted forward + backward seconds of each device at the training batch."""
        out = []
        for shards in devices:
            if not shards:
                out.append(0.0)
                continue
            feats = self.features(shards)
            device = np.array([[len({c for *_, c in shards}) / 8, len(shards) / 8]])
            out.append(
                float(
                    sum(net.seconds(net.encode(feats).sum(0)[None], device)[0] for net in self.fast)
                )
            )
        return out

    # ------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        data = {
            "format": WEIGHTS_FORMAT,
            "version": WEIGHTS_VERSION,
            "layout": LAYOUT,
            "batch": self.batch,
            "forward": self.forward.state_dict(),
            "backward": self.backward.state_dict(),
            "comm": [self.comm.latency_s, self.comm.s_per_byte],
            "info": json.dumps(self.info),
        }
        torch.save({**data, WEIGHTS_DIGEST: weights_digest(data)}, path)

    @staticmethod
    def load(path: str | Path) -> NeuroShardPolicy:
        path = Path(path)
        where = f"neuroshard weights {str(path)!r}"
        if not path.is_file():
            raise FileNotFoundError(f"{where} do not exist; write them with `{_RETRAIN}`")
        try:
            data = torch.load(path, weights_only=True)
        except Exception as e:  # torch raises several types for a file that is not its own
            raise ValueError(
                f"{where} cannot be read as torch weights ({type(e).__name__}); write them "
                f"with `{_RETRAIN}`"
            ) from None
        if not isinstance(data, dict) or data.get("format") != WEIGHTS_FORMAT:
            raise ValueError(
                f"{where} are not a {WEIGHTS_FORMAT} file; write them with `{_RETRAIN}`"
            )
        if data.get("version") != WEIGHTS_VERSION or data.get("layout") != LAYOUT:
            raise ValueError(
                f"{where} were trained for version {data.get('version')} with feature layout "
                f"{data.get('layout')}, this towerrec needs version {WEIGHTS_VERSION} with "
                f"{LAYOUT}; retrain them with `{_RETRAIN}`"
            )
        if WEIGHTS_DIGEST in data and data.pop(WEIGHTS_DIGEST) != weights_digest(data):
            raise ValueError(
                f"{where} do not match their own {WEIGHTS_DIGEST}: the file is damaged (its "
                f"weights cannot be trusted); restore it from a copy or retrain with `{_RETRAIN}`"
            )
        models = []
        for key in ("forward", "backward"):
            hidden = data[key]["encoder.0.weight"].shape[0]
            model = LearnedCostModel(hidden, int(data["batch"]))
            model.load_state_dict(data[key])
            models.append(model)
        return NeuroShardPolicy(
            models[0],
            models[1],
            CommModel(*data["comm"]),
            int(data["batch"]),
            json.loads(data["info"]),
        )


def load_policy(path: str | Path | None = None) -> NeuroShardPolicy:
    """The policy at ``path``, or the shipped default weights."""
    return NeuroShardPolicy.load(path or DEFAULT_WEIGHTS)


# ------------------------------------------------------------------ training
def _fit_pair(
    devices: list[Shards], data: CostData, picks: Sequence[int], seed: int, steps: int, hidden: int
) -> tuple[LearnedCostModel, LearnedCostModel]:
    out = []
    for which in ("forward_s", "backward_s"):
        model = LearnedCostModel(hidden, data.batch)
        model.fit(
            [devices[i] for i in picks],
            [getattr(data.compute[i], which) for i in picks],
            steps=steps,
            seed=seed,
        )
        out.append(model)
    return out[0], out[1]


def train_neuroshard(
    data: CostData, seed: int = 0, steps: int = 1500, hidden: int = 32, held_out: float = 0.2
) -> NeuroShardPolicy:
    """Pre-train on ``data``: first on all but a ``held_out`` share (its median relative
    error of forward + backward is recorded in ``info``), then on everything."""
    if len(data.compute) < 5:
        raise ValueError(
            f"the cost data holds {len(data.compute)} device samples; NeuroShard needs at "
            "least 5 (collect more with `towerrec plan collect-costs --devices N`)"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights on every machine for a seed
    try:
        devices: list[Shards] = [list(c.shards) for c in data.compute]
        order = np.random.default_rng(seed).permutation(len(devices))
        cut = max(1, int(len(devices) * held_out))
        test, train = order[:cut].tolist(), order[cut:].tolist()
        forward, backward = _fit_pair(devices, data, train, seed, steps, hidden)
        trial = NeuroShardPolicy(forward, backward, CommModel(0, 0), data.batch)
        predicted = np.array(trial.device_seconds([devices[i] for i in test]))
        truth = np.array([data.compute[i].seconds for i in test])
        held_out_error = float(np.median(np.abs(predicted - truth) / truth))
        forward, backward = _fit_pair(devices, data, range(len(devices)), seed, steps, hidden)
    finally:
        torch.set_num_threads(threads)
    comm = CommModel.fit(data.comm)
    comm_truth = np.array([c.seconds for c in data.comm])
    comm_pred = np.array([comm.predict(c.dims, c.batch).max() for c in data.comm])
    info = {
        "seed": seed,
        "steps": steps,
        "hidden": hidden,
        "kernel": data.kernel,
        "compute_held_out_median_rel_error": held_out_error,
        "compute_held_out_devices": len(test),
        "comm_model": "linear (latency + bytes sent and received / bandwidth)",
        "comm_median_rel_error": float(np.median(np.abs(comm_pred - comm_truth) / comm_truth)),
        "comm_worlds": sorted({c.world for c in data.comm}),
    }
    return NeuroShardPolicy(forward, backward, comm, data.batch, info)


def write_policy(
    policy: NeuroShardPolicy, data: CostData, cost_data: str | Path, out_dir: str | Path
) -> Path:
    """``out_dir``/neuroshard.pt and neuroshard.json (which data, machine, fit errors);
    ``data`` was read from the file ``cost_data``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    policy.info["cost_data"] = {
        "file": Path(cost_data).name,
        "bytes": Path(cost_data).stat().st_size,
        "sha256": file_digest(cost_data),
        "compute_samples": len(data.compute),
        "comm_samples": len(data.comm),
        "batch": data.batch,
        "kernel": data.kernel,
        "machine": data.machine,
    }
    weights = out_dir / "neuroshard.pt"
    policy.save(weights)
    record = {
        "planner": "neuroshard",
        "format": WEIGHTS_FORMAT,
        "version": WEIGHTS_VERSION,
        "layout": LAYOUT,
        "command": (
            f"towerrec plan train-policy --planner neuroshard --cost-data {Path(cost_data).name} "
            f"--out DIR --seed {policy.info.get('seed', 0)}"
        ),
        "comm": {"latency_s": policy.comm.latency_s, "s_per_byte": policy.comm.s_per_byte},
        **policy.info,
    }
    (out_dir / "neuroshard.json").write_text(json.dumps(record, indent=2) + "\n")
    return weights
