"""The physical bounds a training step is held against, measured on the machine at hand.

A step's roofline time is the time of its two kinds of work at their measured peaks::

    roofline_s = dense FLOPs / matmul peak (of the dtype the dense part runs in)
               + embedding bytes / memory bandwidth

- ``matmul_peak(device, dtype)``: the best FLOP/s of dense matmuls of MLP-like shapes
  (``[M, K] @ [K, N]``, M the batch) in ``dtype``; by wall clock, or per CPU second of
  this process (``clock=time.process_time``: with one intra-op thread, one core's peak
  however busy the machine is).
- ``memory_bandwidth(device)``: bytes per second of a large copy (each byte read once
  and written once; 256 MiB, beyond the caches), wall clock or per CPU second.
- ``embedding_step_bytes``: the bytes one training step of fused embedding tables moves:
  the looked-up rows gathered in forward, and each touched row's weights and optimizer
  state read and written back by the update.
- ``Roofline``: the two peaks of one device and dtype; ``seconds(flops, bytes)``.
- ``layer_matmul_seconds(layers, batch, dtype)``: the matmuls of one training step of a
  model's linear layers, each timed alone at its own shape: what the BLAS does at those
  shapes, where the peak is what it does at its best shapes. Small layers (a few dozen
  inputs or outputs) run far below the peak, so this is the tighter of the two bounds on
  a step's dense part; a benchmark reports it beside the roofline.

Both peaks run on whatever ``device`` is given (CPU, or CUDA with the timing
synchronised), so a benchmark on either compares its rows with the same bounds.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MATMUL_SHAPES",
    "Roofline",
    "embedding_step_bytes",
    "layer_matmul_seconds",
    "layer_matmuls",
    "matmul_peak",
    "measure_roofline",
    "memory_bandwidth",
]

# [M, K] @ [K, N] of a DLRM's MLPs at batch 2,048 and 4,096.
MATMUL_SHAPES: tuple[tuple[int, int, int], ...] = (
    (2048, 512, 512),
    (2048, 1024, 1024),
    (4096, 1024, 1024),
)
Clock = Callable[[], float]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_rate(
    work: Callable[[], object], amount: float, device: torch.device, seconds: float, clock: Clock
) -> float:
    """The rate ``amount / (seconds per call of work)``, calls repeated for ``seconds``."""
    work()  # warm up (allocations, the library's first-call set-up)
    _sync(device)
    reps, start = 0, clock()
    while True:
        work()
        reps += 1
        _sync(device)
        if (elapsed := clock() - start) >= seconds:
            return amount * reps / elapsed


def matmul_peak(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seconds: float = 1.0,
    clock: Clock = time.perf_counter,
    shapes: Sequence[tuple[int, int, int]] = MATMUL_SHAPES,
) -> float:
    """Best measured FLOP/s of ``torch.mm`` in ``dtype`` on ``device`` over ``shapes``
    (``seconds`` in all)."""
    device = torch.device(device)
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        work = functools.partial(torch.mm, a, b)
        rate = _best_rate(work, 2 * m * k * n, device, seconds / len(shapes), clock)
        best = max(best, rate)
    return best


def layer_matmuls(
    layers: Sequence[tuple[int, int, bool]],
    batch: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """The matmuls one training step of linear layers runs, as calls on random operands:
    for each layer ``(in_features, out_features, input_grad)``, the forward ``x W^T + b``
    (``addmm``), the weight's gradient ``g^T x`` and, where ``input_grad``, the input's
    ``g W``, in ``dtype`` at ``batch`` rows, on the zero-padded widths the step's MLP runs
    (``mlp.padding_for``). Each comes with a name, ``layer <i> <in>x<out> <part>``."""
    from towerrec.modules.mlp import padding_for  # the step's own widths

    device = torch.device(device)
    ops: list[tuple[str, Callable[[], torch.Tensor]]] = []
    for i, (fan_in, fan_out, input_grad) in enumerate(layers):
        width = fan_in + padding_for(fan_in)
        x = torch.randn(batch, width, device=device).to(dtype)
        weight = torch.randn(fan_out, width, device=device).to(dtype)
        bias = torch.randn(fan_out, device=device).to(dtype)
        grad = torch.randn(batch, fan_out, device=device).to(dtype)
        name = f"layer {i} {fan_in}x{fan_out}"
        ops.append((f"{name} forward", functools.partial(torch.addmm, bias, x, weight.t())))
        ops.append((f"{name} weight grad", functools.partial(torch.mm, grad.t(), x)))
        if input_grad:
            ops.append((f"{name} input grad", functools.partial(torch.mm, grad, weight)))
    return ops


def layer_matmul_seconds(
    layers: Sequence[tuple[int, int, bool]],
    batch: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seconds: float = 1.0,
    clock: Clock = time.perf_counter,
) -> float:
    """Seconds of ``layer_matmuls(layers, batch, dtype, device)``, each call timed alone
    (repeated for its share of ``seconds``) and the times summed."""
    ops = layer_matmuls(layers, batch, dtype, device)
    device = torch.device(device)
    share = seconds / max(len(ops), 1)
    return sum(1.0 / _best_rate(work, 1.0, device, share, clock) for _, work in ops)


def memory_bandwidth(
    device: torch.device | str = "cpu",
    seconds: float = 0.5,
    clock: Clock = time.perf_counter,
    nbytes: int = 256 * 2**20,
) -> float:
    """Bytes per second of copying ``nbytes`` (counted twice: read and written)."""
    device = torch.device(device)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return _best_rate(functools.partial(dst.copy_, src), 2 * src.nbytes, device, seconds, clock)


def embedding_step_bytes(
    lookups: int, unique_rows: int, dim: int, state_floats_per_row: int, bytes_per_float: int = 4
) -> int:
    """Bytes one training step of fused tables moves: ``lookups`` rows of ``dim`` floats
    gathered in forward, and each of the ``unique_rows`` touched rows' weights and
    optimizer state (``state_floats_per_row``: 1 for row-wise Adagrad, ``dim`` for Adagrad)
    read and written back by the update."""
    forward = lookups * dim * bytes_per_float
    update = 2 * unique_rows * (dim + state_floats_per_row) * bytes_per_float
    return forward + update


@dataclass(frozen=True)
class Roofline:
    """One device's measured bounds for one dtype of the dense part."""

    device: str
    dtype: str
    matmul_flops: float  # FLOP/s
    bandwidth: float  # bytes/s

    def seconds(self, flops: float, nbytes: float) -> float:
        """The roofline time of ``flops`` of dense work and ``nbytes`` of memory traffic."""
        return flops / self.matmul_flops + nbytes / self.bandwidth

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "matmul_peak_gflops": round(self.matmul_flops / 1e9, 1),
            "memory_bandwidth_gbs": round(self.bandwidth / 1e9, 2),
        }


def measure_roofline(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seconds: float = 1.0,
    clock: Clock = time.perf_counter,
) -> Roofline:
    """``Roofline`` of ``device`` for ``dtype``: ``matmul_peak`` and ``memory_bandwidth``."""
    device = torch.device(device)
    return Roofline(
        str(device),
        str(dtype).removeprefix("torch."),
        matmul_peak(device, dtype, seconds, clock),
        memory_bandwidth(device, seconds / 2, clock),
    )
