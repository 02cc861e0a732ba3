"""Which kernel runs: FBGEMM where it has a fused kernel for the optimizer on the
device and the CPU is wide enough, the pure-PyTorch kernel elsewhere."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from towerrec.modules.kernels.base import Backend
from towerrec.optim.sparse import EmbeddingOptimizer

FBGEMM_OPTIMIZERS = {
    EmbeddingOptimizer.ROWWISE_ADAGRAD: "EXACT_ROWWISE_ADAGRAD",
    EmbeddingOptimizer.ADAGRAD: "EXACT_ADAGRAD",
    EmbeddingOptimizer.SGD: "EXACT_SGD",
    EmbeddingOptimizer.ADAM: "ADAM",
    EmbeddingOptimizer.PARTIAL_ROWWISE_ADAM: "PARTIAL_ROWWISE_ADAM",
}
FBGEMM_CUDA_ONLY = {EmbeddingOptimizer.ADAM, EmbeddingOptimizer.PARTIAL_ROWWISE_ADAM}


def fbgemm_available() -> bool:
    return importlib.util.find_spec("fbgemm_gpu") is not None


def fbgemm_has_kernel(
    optimizer: EmbeddingOptimizer, device_type: str, weight_decay: float = 0.0
) -> bool:
    """Whether FBGEMM has a fused kernel for ``optimizer`` on ``device_type``: its Adam
    kernels are generated for CUDA only (none in fbgemm-gpu-cpu), and its CPU kernels
    ignore ``weight_decay`` (row-wise Adagrad's included)."""
    if optimizer not in FBGEMM_OPTIMIZERS:
        return False
    if device_type == "cuda":
        return True
    return optimizer not in FBGEMM_CUDA_ONLY and not weight_decay


def auto_backend(
    device_type: str,
    cpu_capability: str,
    fbgemm_installed: bool,
    optimizer: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD,
    embedding_dims: Sequence[int] = (),
    weight_decay: float = 0.0,
) -> Backend:
    """The kernel ``auto`` stands for: FBGEMM on CUDA, and on CPUs with AVX-512
    (its CPU kernels are generated for 512-bit vectors); the pure-PyTorch kernel
    on narrower CPUs (AVX2: 1.25x faster in the full DLRM step, docs/benchmarks.md),
    without fbgemm_gpu, for an optimizer (or weight decay) FBGEMM has no kernel for
    on the device (``fbgemm_has_kernel``), or for tables whose dimension is not a
    multiple of 4 (FBGEMM's row alignment)."""
    if not fbgemm_installed or not fbgemm_has_kernel(optimizer, device_type, weight_decay):
        return Backend.TORCH
    if any(dim % 4 for dim in embedding_dims):
        return Backend.TORCH
    if device_type == "cpu" and not cpu_capability.upper().startswith("AVX512"):
        return Backend.TORCH
    return Backend.FBGEMM


def resolve_backend(
    backend: Backend | str,
    device: torch.device,
    optimizer: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD,
    embedding_dims: Sequence[int] = (),
    weight_decay: float = 0.0,
) -> Backend:
    """``auto`` resolves by ``auto_backend`` for this machine and these table dimensions;
    ``fbgemm`` needs fbgemm_gpu and its kernel for ``optimizer`` on ``device``."""
    backend = Backend(backend)
    device = torch.device(device)
    if backend is Backend.FBGEMM and not fbgemm_available():
        raise ValueError(
            "embedding backend 'fbgemm' needs fbgemm_gpu: install towerrec[cpu] "
            "(fbgemm-gpu-cpu) or towerrec[cuda] (fbgemm-gpu), or set embedding.backend = 'torch'"
        )
    if backend is Backend.FBGEMM and not fbgemm_has_kernel(optimizer, device.type, weight_decay):
        what = f"embedding optimizer {optimizer.value!r}"
        if optimizer in FBGEMM_OPTIMIZERS and optimizer not in FBGEMM_CUDA_ONLY:
            what += f" with weight decay {weight_decay}"  # the CPU kernels ignore it
        raise ValueError(
            f"FBGEMM has no {device.type} kernel for {what}: set embedding.backend = 'torch' "
            "(or 'auto', which picks the torch kernel for it)"
        )
    if backend is Backend.AUTO:
        return auto_backend(
            device.type,
            torch.backends.cpu.get_cpu_capability(),
            fbgemm_available(),
            optimizer,
            embedding_dims,
            weight_decay,
        )
    return backend
