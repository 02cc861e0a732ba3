"""Multi-layer perceptron.

A linear layer of 64 inputs or more whose width is not a multiple of 8 (a DLRM
top MLP over 16 + 351 interaction outputs) runs its matmuls on operands
zero-padded to the next multiple of 8: row strides that are not a multiple of
the vector width slow the BLAS kernels by up to 1.5x on CPU (docs/benchmarks.md,
speed notes). The zeros add nothing to the result; the weight keeps its shape.

On the CPU, a plain MLP (no dropout, no batch norm) runs its layers as one autograd
node (``_LayerStack``): the same operators in the same order as the layer-by-layer
path (each weight and bias cast to the autocast dtype, ``addmm``, ReLU in place;
backward the ReLU's mask, the bias sums and two matmuls a layer, the gradients cast
back to the parameters' dtype), so the same bits, without the dozen autograd nodes
and autocast casts a layer costs as separate operators (docs/benchmarks.md, the
training step's profile). In bfloat16, a layer with a ReLU runs as one oneDNN call
with the ReLU fused (``mkldnn._linear_pointwise``, where a check on the first call of
each shape finds it gives ``addmm`` and ``relu_``'s bits: 2x faster on the Criteo-Kaggle
bottom MLP's first layer, 1.05x on its widest), and its backward's mask is one native pass
(``_fused.c``: ``relu_grad``, threshold_backward's bits, 2.8x faster than ATen's on
[2048, 512] bfloat16).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from towerrec.modules.native import fused

__all__ = ["MLP", "aligned_linear", "padded_linear", "padding_for"]

ALIGN = 8


MIN_PADDED = 64


def padding_for(in_features: int) -> int:
    """Zero columns that take ``in_features`` to a multiple of 8; 0 below 64 inputs,
    where the extra columns would add up to 2x work to a layer that costs little."""
    if in_features < MIN_PADDED:
        return 0
    return -in_features % ALIGN


def aligned_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)`` for ``x`` of ``[B, in]``, or ``[B, in + padding_for(in)]`` whose
    last columns are already zero; the matmul runs on 8-aligned operands."""
    return padded_linear(x, layer.weight, layer.bias)


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``aligned_linear`` for a weight ``[out, in]`` that need not be a layer's own (a
    block of a supernet's weight computes exactly what a layer of that shape does)."""
    in_features = weight.shape[1]
    pad = padding_for(in_features)
    if pad == 0:
        return F.linear(x, weight, bias)
    if x.shape[-1] == in_features:
        x = F.pad(x, (0, pad))
    return F.linear(x, F.pad(weight, (0, pad)), bias)


# (batch, weight shape) -> whether the fused call gives relu(addmm)'s bits for that shape
_FUSED_RELU_BITS: dict[tuple[int, ...], bool] = {}


@functools.cache
def _fused_relu_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pointwise_relu(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return cast(torch.Tensor, torch.ops.mkldnn._linear_pointwise(h, weight, bias, "relu", [], ""))


def relu_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``relu_(addmm(bias, h, weight.t()))``, as one oneDNN call with the ReLU fused on
    bfloat16 where the first call of the shape finds the two give the same bits (module
    doc); the two operators elsewhere, and where oneDNN has no bfloat16 kernel for the
    CPU (without AVX-512 it refuses the call)."""
    if h.dtype != torch.bfloat16 or not _fused_relu_available():
        return torch.relu_(torch.addmm(bias, h, weight.t()))
    key = (h.shape[0], *weight.shape)
    same = _FUSED_RELU_BITS.get(key)
    if same is False:
        return torch.relu_(torch.addmm(bias, h, weight.t()))
    if same is None:
        plain = torch.relu_(torch.addmm(bias, h, weight.t()))
        try:
            out = _pointwise_relu(h, weight, bias)
        except RuntimeError:  # no primitive for this CPU, dtype or shape
            _FUSED_RELU_BITS[key] = False
        else:
            _FUSED_RELU_BITS[key] = torch.equal(out.view(torch.int16), plain.view(torch.int16))
        return plain
    return _pointwise_relu(h, weight, bias)


def relu_backward(grad: torch.Tensor, out: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``threshold_backward(grad, out, 0)``: the gradient through a ReLU of output
    ``out``; on bfloat16 in one native pass (``_fused.c``: ``relu_grad``) where the
    extension is built, the same bits, written over ``grad`` with ``in_place`` (a
    gradient the caller made itself: no fresh buffer to fault into the caches)."""
    if (
        fused is None
        or grad.dtype != torch.bfloat16
        or out.dtype != torch.bfloat16
        or grad.shape != out.shape
        or not grad.is_contiguous()
        or not out.is_contiguous()
    ):
        return cast(torch.Tensor, torch.ops.aten.threshold_backward(grad, out, 0))
    dst = grad if in_place else torch.empty_like(grad)
    fused.relu_grad(
        grad.view(torch.int16).numpy(),
        out.view(torch.int16).numpy(),
        dst.view(torch.int16).numpy(),
        grad.numel(),
    )
    return dst


class _LayerStack(torch.autograd.Function):
    """A plain MLP's layers in one node (module doc): ``x`` and each layer's weight and
    bias in; the layers' matmuls run in ``dtype`` (the autocast dtype, or the weights'
    own), as ``padded_linear`` runs them."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, relu_last: bool, dtype: torch.dtype, *params: torch.Tensor
    ) -> torch.Tensor:
        layers = len(params) // 2
        h = x.to(dtype)
        inputs, outputs, weights = [], [], []
        for i in range(layers):
            weight, bias = params[2 * i], params[2 * i + 1]
            pad = padding_for(weight.shape[1])
            if pad:
                weight = F.pad(weight, (0, pad))
                if h.shape[1] != weight.shape[1]:
                    h = F.pad(h, (0, pad))
            weight = weight.to(dtype)
            inputs.append(h)
            if i < layers - 1 or relu_last:
                h = relu_linear(h, weight, bias.to(dtype))
            else:
                h = torch.addmm(bias.to(dtype), h, weight.t())
            outputs.append(h)
            weights.append(weight)
        ctx.save_for_backward(*inputs, *outputs, *weights)
        ctx.layers, ctx.relu_last = layers, relu_last
        ctx.x_dtype, ctx.x_width = x.dtype, x.shape[1]
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.in_widths = [params[2 * i].shape[1] for i in range(layers)]
        return h

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layers = ctx.layers
        saved = ctx.saved_tensors
        inputs, outputs, weights = (
            saved[:layers],
            saved[layers : 2 * layers],
            saved[2 * layers :],
        )
        g = grad.to(outputs[-1].dtype)
        grads: list[torch.Tensor | None] = [None] * (2 * layers)
        for i in reversed(range(layers)):
            if i < layers - 1 or ctx.relu_last:
                g = relu_backward(g, outputs[i], in_place=g is not grad)
            weight_grad = g.t().mm(inputs[i])[:, : ctx.in_widths[i]]
            grads[2 * i] = weight_grad.to(ctx.param_dtypes[2 * i])
            grads[2 * i + 1] = g.sum(0).to(ctx.param_dtypes[2 * i + 1])
            if i == 0 and not ctx.needs_input_grad[0]:
                break
            g = g.mm(weights[i])
            width = outputs[i - 1].shape[1] if i > 0 else ctx.x_width
            if g.shape[1] != width:  # the zeros padded onto the input
                g = g[:, :width]
        x_grad = g.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return (x_grad, None, None, *grads)


class MLP(nn.Sequential):
    """``in_features -> layer_sizes[0] -> ... -> layer_sizes[-1]``, ReLU between layers.

    ``final_activation=False`` leaves the last layer linear (a logit head).
    Every layer with a ReLU gets, with ``batch_norm``, a ``BatchNorm1d`` between
    its linear map and the ReLU, and with ``dropout > 0`` dropout after the ReLU
    in training mode (a function in ``forward``, not a module: a model's
    ``state_dict`` names do not depend on it); a linear head gets neither. At
    the defaults the MLP is the plain one, module for module.
    ``forward`` takes ``[B, in_features]``, or ``[B, in_features + input_padding]``
    with zeros in the last ``input_padding`` columns (a caller that concatenates
    its input anyway appends them there and saves a copy).
    """

    def __init__(
        self,
        in_features: int,
        layer_sizes: Sequence[int],
        *,
        final_activation: bool = True,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        if not layer_sizes:
            raise ValueError("an MLP needs at least one layer size")
        if any(s < 1 for s in layer_sizes):
            raise ValueError(f"MLP layer sizes must be >= 1, got {list(layer_sizes)}")
        if not 0 <= dropout < 1:
            raise ValueError(f"MLP dropout must lie in [0, 1), got {dropout}")
        layers: list[nn.Module] = []
        width = in_features
        for i, size in enumerate(layer_sizes):
            layers.append(nn.Linear(width, size))
            if final_activation or i < len(layer_sizes) - 1:
                if batch_norm:
                    layers.append(nn.BatchNorm1d(size))
                layers.append(nn.ReLU())
            width = size
        super().__init__(*layers)
        self.in_features = in_features
        self.out_features = width
        self.input_padding = padding_for(in_features)
        self.dropout, self.batch_norm = dropout, batch_norm

    def flops_per_sample(self) -> int:
        """Multiply-adds x2 of the linear layers' forward pass, per sample (batch norm
        and dropout are elementwise and left out, as torch's FlopCounterMode does)."""
        return sum(2 * m.in_features * m.out_features for m in self if isinstance(m, nn.Linear))

    def _stack_plan(self, x: torch.Tensor) -> tuple[torch.dtype, list[torch.Tensor], bool] | None:
        """What the one-node path (``_LayerStack``) runs: the dtype of the layers'
        matmuls, the weights and biases in order, and whether a ReLU ends the MLP; None
        where the layer-by-layer path serves: off the CPU, with dropout or batch norm, for
        export, compilation and tracing (a graph of torch operators), and for weights
        not all of one floating dtype."""
        if (
            x.device.type != "cpu"
            or x.dim() != 2
            or self.dropout
            or self.batch_norm
            or type(x) is not torch.Tensor
            or torch.jit.is_tracing()
            or torch.jit.is_scripting()
            or torch.compiler.is_compiling()
        ):
            return None
        params: list[torch.Tensor] = []
        after_linear = False
        for layer in self._modules.values():  # Linear layers, each maybe with a ReLU after
            if type(layer) is nn.Linear and layer.bias is not None:
                params += (layer.weight, layer.bias)
                after_linear = True
            elif type(layer) is nn.ReLU and after_linear:
                after_linear = False
            else:
                return None
        dtype = params[0].dtype if params else None
        if dtype is None or not dtype.is_floating_point or any(p.dtype != dtype for p in params):
            return None
        if torch.is_autocast_enabled("cpu"):  # autocast lowers float32 alone
            if dtype != torch.float32:
                return None
            dtype = torch.get_autocast_dtype("cpu")
        elif x.dtype != dtype:
            return None
        return dtype, params, not after_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self._stack_plan(x)
        if plan is not None:
            dtype, params, relu_last = plan
            with torch.autocast("cpu", enabled=False):  # the casts are the node's own
                out = _LayerStack.apply(x, relu_last, dtype, *params)  # type: ignore[no-untyped-call]  # torch leaves it untyped
            return cast(torch.Tensor, out)
        for layer in self:
            if isinstance(layer, nn.Linear):
                x = aligned_linear(x, layer)
            elif isinstance(layer, nn.ReLU):
                x = torch.relu_(x)  # in place on the fresh linear output: one buffer less
                if self.dropout and self.training:
                    x = F.dropout(x, self.dropout)
            else:
                x = layer(x)
        return x
