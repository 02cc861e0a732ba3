"""Early stopping, the best step and the plateau LR schedule, from validation metrics.

At each validation, with ``value = metrics[train.early_stopping.metric]``::

    improves on the best by more than min_delta  ->  best = (step, value, metrics),
                                                     since_best = 0 (the trainer saves
                                                     the weights to <run>/best/)
    else                                         ->  since_best += 1;
        decay "plateau", since_best a multiple of plateau_patience
                                                 ->  lr_scale *= plateau_factor
                                                     (not below optimizer.min_lr_ratio)
        patience > 0 and since_best >= patience  ->  stop

``state_dict()`` is JSON: the trainer saves it in each checkpoint's meta.json, so a
resumed run continues with the same best, count and LR scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from towerrec.config import Config

__all__ = ["EarlyStopping"]

# Direction of each metric the early-stopping config may name: +1 higher is better.
_SIGN = {"auc": 1.0, "logloss": -1.0}


@dataclass
class EarlyStopping:
    metric: str = "logloss"
    patience: int = 0  # 0: never stop early
    min_delta: float = 0.0
    plateau_factor: float | None = None  # None: no plateau schedule
    plateau_patience: int = 1
    min_lr_scale: float = 0.0
    best_step: int | None = None
    best_value: float | None = None
    best_metrics: dict[str, Any] | None = None
    since_best: int = 0
    lr_scale: float = 1.0
    stopped: bool = False

    @classmethod
    def from_config(cls, config: Config) -> EarlyStopping:
        stop, opt = config.train.early_stopping, config.optimizer
        return cls(
            metric=stop.metric,
            patience=stop.patience,
            min_delta=stop.min_delta,
            plateau_factor=opt.plateau_factor if opt.decay == "plateau" else None,
            plateau_patience=opt.plateau_patience,
            min_lr_scale=opt.min_lr_ratio,
        )

    @property
    def keeps_best(self) -> bool:
        """Whether the best weights are saved and restored at the end (early stopping on)."""
        return self.patience > 0

    def improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best_value is None:
            return True
        return _SIGN[self.metric] * (value - self.best_value) > self.min_delta

    def update(self, step: int, metrics: dict[str, Any]) -> bool:
        """Record the validation ``metrics`` of ``step``; True when they are the new best."""
        if self.metric not in metrics:
            raise ValueError(
                f"train.early_stopping.metric = {self.metric!r} is not among the validation "
                f"metrics {sorted(metrics)}"
            )
        value = float(metrics[self.metric])
        if self.improves(value):
            self.best_step, self.best_value, self.best_metrics = step, value, dict(metrics)
            self.since_best = 0
            return True
        self.since_best += 1
        if self.plateau_factor is not None and self.since_best % self.plateau_patience == 0:
            self.lr_scale = max(self.lr_scale * self.plateau_factor, self.min_lr_scale)
        if self.patience and self.since_best >= self.patience:
            self.stopped = True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_step": self.best_step,
            "best_value": self.best_value,
            "best_metrics": self.best_metrics,
            "since_best": self.since_best,
            "lr_scale": self.lr_scale,
            "stopped": self.stopped,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue from ``state``; None (a checkpoint of an earlier version) keeps the
        fresh state."""
        if not state:
            return
        self.best_step = state["best_step"]
        self.best_value = state["best_value"]
        self.best_metrics = state["best_metrics"]
        self.since_best = int(state["since_best"])
        self.lr_scale = float(state["lr_scale"])
        self.stopped = bool(state["stopped"])
