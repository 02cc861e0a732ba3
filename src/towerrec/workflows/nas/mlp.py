"""An MLP supernet: candidate widths per hidden layer, skip edges for depth.

::

    x [B, F] ─► layer 1: widths C_1 (0 = skip) ─► ... ─► layer L: C_L ─► last layer ─► [B, out]

Layer i holds one weight ``W_i [max C_i, max width that can reach it]``; candidate
width w reading an input of width v uses the block ``W_i[:w, :v]``. A layer's
output is kept as components ``(width, h [B, width], gate [B])`` whose gates sum to
one per example: candidate k of layer i gives ``relu(sum_j gate_j * W_i[:w_k, :v_j]
h_j + b)`` with gate ``g[:, k]``; the skip candidate passes the incoming components
on with their gates times ``g[:, skip]``. Each block is its own matmul over exactly
the widths the standalone model would use, so under a fixed one-hot choice the
supernet computes the standalone MLP bit for bit (a zero-padded matmul would not:
BLAS kernels sum a longer row in another order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from towerrec.modules.mlp import MLP, padded_linear, padding_for
from towerrec.workflows.nas.choice import Decision

__all__ = ["SearchableMLP"]

_Component = tuple[int, torch.Tensor, torch.Tensor | None]  # width, h [B, width], gate [B]


class SearchableMLP(nn.Module):
    """``in_features -> searchable hidden layers -> out_features`` (module docstring).

    Takes ``[B, in_features]`` or ``[B, in_features + input_padding]`` (zeros last),
    as ``MLP`` does, and gives ``[B, out_features]``.
    """

    def __init__(
        self,
        in_features: int,
        candidates: Sequence[Sequence[int]],
        out_features: int,
        *,
        final_activation: bool,
        name: str,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_padding = padding_for(in_features)
        self.final_activation = final_activation
        self.decisions = [
            Decision(f"{name}[{i}]", sorted(widths, reverse=True))
            for i, widths in enumerate(candidates)
        ]
        self.widths = [sorted(widths, reverse=True) for widths in candidates]  # per layer
        layers, reach = [], in_features  # reach: the widest input that can arrive
        for decision, widths in zip(self.decisions, self.widths):
            widest = widths[0]
            if widest == 0:
                raise ValueError(f"nas.mlp {decision.name}: every candidate skips the layer")
            layers.append(nn.Linear(reach, widest))
            reach = max(reach, widest) if 0 in widths else widest
        self.hidden: list[nn.Linear] = layers  # registered below, typed here
        self._hidden = nn.ModuleList(layers)
        self.last = nn.Linear(reach, out_features)

    def _mix(
        self, components: list[_Component], weight: torch.Tensor, bias: torch.Tensor, rows: int
    ) -> torch.Tensor:
        out: torch.Tensor | None = None
        for width, h, gate in components:
            y = padded_linear(h, weight[:rows, :width], bias[:rows])
            term = y if gate is None else gate.unsqueeze(1) * y
            out = term if out is None else out + term
        assert out is not None  # a layer always has an input
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, : self.in_features]
        batch = x.shape[0]
        components: list[_Component] = [(self.in_features, x, None)]
        for decision, widths, layer in zip(self.decisions, self.widths, self.hidden):
            g = decision.mask(batch, x.device)
            out: list[_Component] = []
            for k, width in enumerate(widths):
                gate = g[:, k]
                if width == 0:
                    out += [(w, h, gate if old is None else old * gate) for w, h, old in components]
                else:
                    h = torch.relu(self._mix(components, layer.weight, layer.bias, width))
                    out.append((width, h, gate))
            components = out
        y = self._mix(components, self.last.weight, self.last.bias, self.out_features)
        return torch.relu(y) if self.final_activation else y

    def choice_widths(self, choice: Sequence[int]) -> list[int]:
        """The layer sizes of the standalone MLP of ``choice`` (one index per decision),
        skipped layers left out, the last layer included."""
        picked = [widths[k] for widths, k in zip(self.widths, choice)]
        return [w for w in picked if w] + [self.out_features]

    def expected_flops(self, probs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Expected forward FLOPs per sample (2 x multiply-adds) under independent
        choices with probabilities ``probs[i] [K_i]``; a one-hot gives one MLP's."""
        width_in = torch.tensor(float(self.in_features))  # E[width reaching the layer]
        flops = torch.tensor(0.0)
        for candidates, p in zip(self.widths, probs):
            widths = torch.tensor([float(w) for w in candidates])
            expected_out = (p * widths).sum()
            flops = flops + 2 * width_in * expected_out
            skip = sum((p[k] for k, w in enumerate(candidates) if w == 0), torch.tensor(0.0))
            width_in = expected_out + skip * width_in
        return flops + 2 * width_in * self.out_features

    def standalone_state(self, choice: Sequence[int], mlp: MLP) -> dict[str, torch.Tensor]:
        """The weights of the standalone ``mlp`` (built with ``choice_widths``) that the
        supernet uses under ``choice``, named as ``mlp.state_dict()`` names them."""
        linears = [name for name, m in mlp.named_children() if isinstance(m, nn.Linear)]
        state, width, at = {}, self.in_features, 0
        picked = [(layer, widths[k]) for widths, k, layer in zip(self.widths, choice, self.hidden)]
        for layer, out in [*((m, w) for m, w in picked if w), (self.last, self.out_features)]:
            state[f"{linears[at]}.weight"] = layer.weight[:out, :width].detach().clone()
            state[f"{linears[at]}.bias"] = layer.bias[:out].detach().clone()
            width, at = out, at + 1
        return state
