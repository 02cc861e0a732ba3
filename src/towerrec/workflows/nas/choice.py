"""Architecture decisions and their per-example Gumbel-softmax masks.

A ``Decision`` is one choice among K candidates (a layer's width, a table's dim)
with logits ``alpha [K]``. Each forward draws a mask per example::

    g [B, K] = softmax((alpha + Gumbel noise [B, K]) / tau)

and the supernet mixes the K candidates' outputs with it. ``fix(k)`` replaces the
draw by the exact one-hot of candidate k (every example), under which the
supernet computes what the standalone model of that choice computes, bit for bit.

The logits are ``nn.Parameter``s held by this plain object, not by the model: the
model's ``parameters()`` (and so the weight optimizer) never see them; the search
gives them their own optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Decision", "temperature"]


class Decision:
    """One architecture choice (see module docstring); ``costs[k]``: candidate k's cost
    where it does not depend on other decisions (embedding tables), else empty."""

    def __init__(self, name: str, candidates: Sequence[int | float]) -> None:
        if not candidates:
            raise ValueError(f"{name}: an empty candidate list; give at least one choice")
        self.name = name
        self.candidates = list(candidates)
        self.logits = nn.Parameter(torch.zeros(len(candidates)))
        self.tau = 1.0
        self.fixed: int | None = None

    def __len__(self) -> int:
        return len(self.candidates)

    def probs(self) -> torch.Tensor:
        """``[K]``: the architecture distribution, softmax(alpha)."""
        return torch.softmax(self.logits, dim=0)

    def fix(self, index: int | None) -> None:
        """Use candidate ``index`` for every example (None: sample again)."""
        if index is not None and not 0 <= index < len(self):
            raise ValueError(f"{self.name}: no candidate {index} among {len(self)}")
        self.fixed = index

    def mask(self, batch: int, device: torch.device) -> torch.Tensor:
        """``[B, K]`` mixing weights: Gumbel-softmax draws, or the fixed one-hot."""
        if self.fixed is not None:
            out = torch.zeros(batch, len(self), device=device)
            out[:, self.fixed] = 1.0
            return out
        logits = self.logits.to(device).expand(batch, len(self))
        return F.gumbel_softmax(logits, tau=self.tau)

    def best(self) -> int:
        return int(self.logits.detach().argmax())

    def sample(self, generator: torch.Generator) -> int:
        return int(torch.multinomial(self.probs().detach().cpu(), 1, generator=generator))


def temperature(start: float, end: float, progress: float) -> float:
    """Geometric schedule from ``start`` (progress 0) to ``end`` (progress 1)."""
    progress = min(max(progress, 0.0), 1.0)
    return float(start * (end / start) ** progress)
