"""Feature interactions over stacked embeddings ``[B, F, D]``.

::

    X [B, F, D] ──► G = X X^T [B, F, F] (one bmm) ──► upper triangle [B, P]
                                                      (one gather, row-major pairs)
    backward: grad [B, P] ──► S [B, F, F]: S[i,j] = S[j,i] = grad of pair (i,j)
              (one gather) ──► grad X = S X (one bmm, instead of two and a sum)

On the CPU, where the native extension ``_fused`` is built (``_fused.c``; ``pip install``
builds it where a C compiler is found) and D is a multiple of 16, both directions are
one fused call instead: the pairs' dot products straight into ``[B, P]`` and grad X
straight from grad, computed in float32 whatever the autocast dtype (the dots are
handed on in the autocast dtype, as the bmm's are), its threads the torch
intra-op threads where the batch is large enough to pay for them. A batched matmul of
[F, D] matrices this small runs far below the machine's peak on the CPU, and the gather
and scatter of the triangle cost as much again. Elsewhere (GPUs, float64, other dims,
no compiler, and under ``torch.export``, ``torch.compile`` and tracing, so that an
exported model holds only torch operators) the batched matmuls above serve.

DLRM's top MLP reads ``[x, dots, zeros]``: the bottom MLP's output, the dots of it and
the pooled embeddings, and the alignment zeros (``MLP.input_padding``). Where the fused
kernel applies, ``DotInteraction.joined`` builds that input from ``x`` and the pooled
``[B, T * D]`` in one native call (and its gradient in one), the dots rounded to bfloat16
there under bfloat16 autocast: the same values as stacking, the dots and the
concatenation, without their three passes over the batch and the casts between them.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, cast

import torch
from torch import nn

from towerrec.modules.native import fused

__all__ = ["DotInteraction", "native_dots_available"]

_native: ModuleType | None = fused  # None where not built: the batched matmuls serve

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def native_dots_available() -> bool:
    """Whether the fused CPU interaction (``_fused.c``) is built in this install."""
    return _native is not None


def _native_applies(x: torch.Tensor) -> bool:
    lanes = 16 if _native is None else int(_native.LANES)
    return (
        _native is not None
        and type(x) is torch.Tensor  # not a fake or traced tensor (export, compile)
        and not torch.jit.is_tracing()
        and not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype in _NATIVE_DTYPES
        and x.shape[2] % lanes == 0
        and x.shape[2] > 0
    )


def _columns(matrix: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``matrix[:, index]`` as one gather over an expanded index: the same values as
    ``index_select(1, index)``, 3x faster on CPU in bf16 (whose ``index_select`` along the
    second dimension takes a slow path) and no slower in fp32."""
    return torch.gather(matrix, 1, index.expand(matrix.shape[0], -1))


class _PairwiseDots(torch.autograd.Function):
    """Upper triangle of ``X X^T`` with a one-bmm backward (module picture)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        flat_index: torch.Tensor,
        pair_of_position: torch.Tensor,
        self_interaction: bool,
    ) -> torch.Tensor:
        batch, features, _ = x.shape
        ctx.save_for_backward(x, pair_of_position)
        ctx.self_interaction = self_interaction
        gram = torch.bmm(x, x.transpose(1, 2))
        return _columns(gram.view(batch, features * features), flat_index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        x, pair_of_position = ctx.saved_tensors
        batch, features, _ = x.shape
        # S[i, j] = S[j, i] = grad of pair (i, j), 0 (the appended column) where
        # no pair is: one gather of contiguous rows.
        padded = torch.nn.functional.pad(grad, (0, 1))
        symmetric = _columns(padded, pair_of_position).view(batch, features, features)
        if ctx.self_interaction:  # d(x_i . x_i)/dx_i = 2 x_i
            symmetric.diagonal(dim1=1, dim2=2).mul_(2)
        return torch.bmm(symmetric, x.to(symmetric.dtype)), None, None, None


class _NativePairwiseDots(torch.autograd.Function):
    """The fused CPU kernel (module doc): float32 ``x [B, F, D]`` -> ``[B, P]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        assert _native is not None
        batch, features, dim = x.shape
        pairs = rows.numel()
        x = x.detach().contiguous()
        out = x.new_empty(batch, pairs)
        threads = torch.get_num_threads()
        _native.forward(
            x.numpy(), rows.numpy(), cols.numpy(), out.numpy(), batch, features, dim, pairs, threads
        )
        ctx.save_for_backward(x, rows, cols)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        assert _native is not None
        x, rows, cols = ctx.saved_tensors
        batch, features, dim = x.shape
        grad = grad.detach().to(torch.float32).contiguous()
        gx = torch.empty_like(x)
        _native.backward(
            x.numpy(),
            rows.numpy(),
            cols.numpy(),
            grad.numpy(),
            gx.numpy(),
            batch,
            features,
            dim,
            rows.numel(),
            torch.get_num_threads(),
        )
        return gx, None, None


def _raw(t: torch.Tensor) -> Any:
    """A CPU tensor's buffer for the native calls (bfloat16 as its 16-bit patterns)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class _NativeJoined(torch.autograd.Function):
    """The fused CPU kernel of DLRM's top MLP input (``DotInteraction.joined``): ``x [B,
    D]`` (float32 or bfloat16) and ``e [B, T * D]`` (float32) -> ``[x, dots, zeros]``."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        e: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        assert _native is not None
        x, e = x.detach().contiguous(), e.detach().contiguous()
        batch, dim = x.shape
        out = x.new_empty(batch, width)
        _native.concat_forward(
            _raw(x),
            e.numpy(),
            rows.numpy(),
            cols.numpy(),
            _raw(out),
            batch,
            e.shape[1] // dim,
            dim,
            rows.numel(),
            width,
            x.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        ctx.save_for_backward(x, e, rows, cols)
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        assert _native is not None
        x, e, rows, cols = ctx.saved_tensors
        batch, dim = x.shape
        grad = grad.detach().to(x.dtype).contiguous()
        gx, ge = torch.empty_like(x), torch.empty_like(e)
        _native.concat_backward(
            _raw(x),
            e.numpy(),
            rows.numpy(),
            cols.numpy(),
            _raw(grad),
            _raw(gx),
            ge.numpy(),
            batch,
            e.shape[1] // dim,
            dim,
            rows.numel(),
            grad.shape[1],
            x.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        return gx, ge, None, None, None


class DotInteraction(nn.Module):
    """Pairwise dot products of F vectors: the upper triangle of ``X X^T``.

    ``[B, F, D] -> [B, F(F-1)/2]`` (``[B, F(F+1)/2]`` with ``self_interaction``),
    pairs in row-major order (0,1), (0,2), ..., (1,2), ...; one batched matmul
    and one gather forward, one batched matmul backward, or the fused CPU kernel
    (module doc).
    """

    flat_index: torch.Tensor
    pair_of_position: torch.Tensor
    pair_rows: torch.Tensor
    pair_cols: torch.Tensor

    def __init__(self, num_features: int, self_interaction: bool = False) -> None:
        super().__init__()
        if num_features < 2 and not self_interaction:
            raise ValueError("dot interaction needs at least 2 features (or self_interaction)")
        self.num_features = num_features
        self.self_interaction = self_interaction
        rows, cols = torch.triu_indices(
            num_features, num_features, offset=0 if self_interaction else 1
        )
        self.register_buffer("flat_index", rows * num_features + cols, persistent=False)
        self.register_buffer("pair_rows", rows.contiguous(), persistent=False)
        self.register_buffer("pair_cols", cols.contiguous(), persistent=False)
        # For backward: position (i, j) of the F x F grid -> its pair, or the
        # number of pairs (a zero column) on the diagonal without self pairs.
        pairs = torch.arange(rows.numel())
        pair_of_position = torch.full((num_features * num_features,), rows.numel())
        pair_of_position[rows * num_features + cols] = pairs
        pair_of_position[cols * num_features + rows] = pairs
        self.register_buffer("pair_of_position", pair_of_position, persistent=False)

    @property
    def out_features(self) -> int:
        return self.flat_index.numel()

    def flops_per_sample(self, dim: int) -> int:
        return 2 * self.num_features * self.num_features * dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = torch.is_autocast_enabled(x.device.type)
        if _native_applies(x):
            dots = cast(
                torch.Tensor,
                _NativePairwiseDots.apply(  # type: ignore[no-untyped-call]  # torch leaves it untyped
                    x.float(), self.pair_rows, self.pair_cols
                ),
            )
            # under autocast the next layer reads the autocast dtype, as from the bmm
            return dots.to(torch.get_autocast_dtype(x.device.type)) if autocast else dots
        if autocast:
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return _PairwiseDots.apply(x, self.flat_index, self.pair_of_position, self.self_interaction)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves Function.apply untyped

    def joined(
        self, x: torch.Tensor, embeddings: torch.Tensor, padding: int
    ) -> torch.Tensor | None:
        """``cat([x, self(cat([x[:, None], E], 1)), zeros(B, padding)], 1)`` for ``x [B,
        D]`` and the pooled ``embeddings [B, T * D]`` (``E`` their ``[B, T, D]`` view):
        DLRM's top MLP input, in one native call each way where the fused CPU kernel
        applies (``x`` float32, or bfloat16 under bfloat16 autocast, the embeddings
        float32), the same values as the stacked path; None elsewhere (the caller
        concatenates)."""
        if x.dim() != 2 or not _native_applies(x.unsqueeze(1)):
            return None
        batch, dim = x.shape
        if embeddings.dtype != torch.float32 or embeddings.shape != (
            batch,
            (self.num_features - 1) * dim,
        ):
            return None
        autocast = torch.is_autocast_enabled(x.device.type)
        wanted = torch.get_autocast_dtype(x.device.type) if autocast else torch.float32
        if x.dtype != wanted or wanted not in (torch.float32, torch.bfloat16):
            return None
        width = dim + self.out_features + padding
        return cast(
            torch.Tensor,
            _NativeJoined.apply(x, embeddings, self.pair_rows, self.pair_cols, width),  # type: ignore[no-untyped-call]  # torch leaves it untyped
        )
