"""Jagged (variable-length) batches of categorical ids.

``KeyedJaggedTensor`` has TorchRec's memory layout: for T keys (features) and a
batch of B samples, ``lengths`` holds T*B counts, key-major, and ``values`` the
ids of every (key, sample) bag laid end to end in the same order::

    keys     = ["user", "genre"]                   T = 2, B = 3
    lengths  = [ 1,  1,  1 | 2,  0,  3 ]           lengths[t*B + b]
    values   = [ 7,  3,  9 | 4, 1,   5, 2, 8 ]     ids of bag (t, b) in order
    offsets  = [0, 1, 2, 3, 5, 5, 8]               T*B + 1 prefix sums
    weights  = optional float per id, same length as values

``KeyedTensor`` is the pooled result: one row per sample, the keys' embeddings
side by side, ``values[B, sum(D_t)]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

__all__ = ["Jagged", "KeyedJaggedTensor", "KeyedTensor", "can_pin_memory"]

_ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Jagged:
    """One key of a ``KeyedJaggedTensor``: ``values`` grouped by ``lengths[B]``."""

    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None

    def offsets(self) -> torch.Tensor:
        return _offsets_from_lengths(self.lengths)

    def to_padded(self, pad_value: int = 0) -> torch.Tensor:
        """Dense ``[B, max_length]`` view of the bags, padded with ``pad_value``."""
        lengths = self.lengths.long()
        batch = lengths.numel()
        width = int(lengths.max()) if batch else 0
        out = torch.full((batch, width), pad_value, dtype=self.values.dtype)
        if width:
            mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
            out[mask] = self.values
        return out


def can_pin_memory() -> bool:
    """Whether page-locked host memory is available (it needs an accelerator)."""
    return torch.accelerator.is_available()


def _offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


class KeyedJaggedTensor:
    """A batch of jagged categorical features with TorchRec's layout (see module doc).

    Construction checks the layout and raises ``ValueError`` naming the problem;
    code that builds tensors it already trusts (permutes, splits, collectives)
    passes ``validate=False`` to skip the O(N) checks.
    """

    __slots__ = ("_keys", "_length_per_key", "_lengths", "_offsets", "_values", "_weights")

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        *,
        offsets: torch.Tensor | None = None,
        validate: bool = True,
    ) -> None:
        self._keys = list(keys)
        self._values = values
        self._lengths = lengths
        self._weights = weights
        self._offsets = offsets
        self._length_per_key: list[int] | None = None
        if validate:
            self._validate()

    # ---------------------------------------------------------------- checks
    def _validate(self) -> None:
        keys, values, lengths, weights = self._keys, self._values, self._lengths, self._weights
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"KeyedJaggedTensor keys must be unique; repeated: {dup}")
        if not isinstance(values, torch.Tensor) or values.dtype not in _ID_DTYPES:
            got = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(
                f"KeyedJaggedTensor values must be an int32 or int64 tensor of ids, got {got}; "
                "convert categorical ids with .long()"
            )
        if not isinstance(lengths, torch.Tensor) or lengths.dtype not in _ID_DTYPES:
            got = lengths.dtype if isinstance(lengths, torch.Tensor) else type(lengths).__name__
            raise ValueError(
                f"KeyedJaggedTensor lengths must be an int32 or int64 tensor, got {got}"
            )
        if values.dim() != 1 or lengths.dim() != 1:
            raise ValueError(
                f"values and lengths must be 1-D, got shapes {tuple(values.shape)} and "
                f"{tuple(lengths.shape)}"
            )
        num_keys = len(keys)
        if num_keys == 0:
            if lengths.numel() or values.numel():
                raise ValueError(
                    "a KeyedJaggedTensor with no keys must have empty values and lengths"
                )
        elif lengths.numel() % num_keys:
            raise ValueError(
                f"lengths has {lengths.numel()} entries, not a multiple of the {num_keys} keys; "
                "it must hold keys x batch_size counts, key-major"
            )
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError(f"lengths must be non-negative, found {int(lengths.min())}")
        total = int(lengths.sum()) if lengths.numel() else 0
        if total != values.numel():
            raise ValueError(
                f"lengths sum to {total} but there are {values.numel()} values; each bag's "
                "length must count its ids"
            )
        if values.numel() and int(values.min()) < 0:
            position = int((values < 0).nonzero()[0])
            raise ValueError(
                f"negative id {int(values[position])} at value position {position}; ids must be "
                ">= 0 (map missing values to a reserved id instead)"
            )
        if weights is not None:
            if not weights.is_floating_point():
                raise ValueError(f"weights must be a floating-point tensor, got {weights.dtype}")
            if weights.shape != values.shape:
                raise ValueError(
                    f"weights shape {tuple(weights.shape)} must match values shape "
                    f"{tuple(values.shape)}"
                )
        if self._offsets is not None and self._offsets.numel() != lengths.numel() + 1:
            raise ValueError("offsets must have len(lengths) + 1 entries")

    # ------------------------------------------------------------- accessors
    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def offsets(self) -> torch.Tensor:
        """``[T*B + 1]`` int64 prefix sums of ``lengths`` (computed once, cached)."""
        if self._offsets is None:
            self._offsets = _offsets_from_lengths(self._lengths)
        return self._offsets

    def stride(self) -> int:
        """Batch size B."""
        return self._lengths.numel() // len(self._keys) if self._keys else 0

    def length_per_key(self) -> list[int]:
        """Number of ids of each key over the whole batch (cached)."""
        if self._length_per_key is None:
            if not self._keys:
                self._length_per_key = []
            else:
                per_key = self._lengths.view(len(self._keys), -1).sum(dim=1)
                self._length_per_key = per_key.tolist()
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> Jagged:
        try:
            index = self._keys.index(key)
        except ValueError:
            raise KeyError(f"no key {key!r}; keys are {self._keys}") from None
        batch = self.stride()
        starts = self.offset_per_key()
        lo, hi = starts[index], starts[index + 1]
        weights = self._weights[lo:hi] if self._weights is not None else None
        return Jagged(
            self._values[lo:hi], self._lengths[index * batch : (index + 1) * batch], weights
        )

    def to_dict(self) -> dict[str, Jagged]:
        return {key: self[key] for key in self._keys}

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        weighted = ", weighted" if self._weights is not None else ""
        return (
            f"KeyedJaggedTensor(keys={self._keys}, batch={self.stride()}, "
            f"ids={self._values.numel()}{weighted}, device={self._values.device})"
        )

    # ----------------------------------------------------------- transforms
    def _like(
        self,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        offsets: torch.Tensor | None = None,
    ) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            self._keys, values, lengths, weights, offsets=offsets, validate=False
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        @overload
        def move(t: torch.Tensor) -> torch.Tensor: ...
        @overload
        def move(t: None) -> None: ...
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        moved = self._like(
            move(self._values), move(self._lengths), move(self._weights), move(self._offsets)
        )
        moved._length_per_key = self._length_per_key
        return moved

    def pin_memory(self) -> KeyedJaggedTensor:
        """Page-locked copy for fast host-to-device transfer; unchanged where no
        accelerator is present (pinning needs one)."""
        if not can_pin_memory():
            return self

        @overload
        def pin(t: torch.Tensor) -> torch.Tensor: ...
        @overload
        def pin(t: None) -> None: ...
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        pinned = self._like(
            pin(self._values), pin(self._lengths), pin(self._weights), pin(self._offsets)
        )
        pinned._length_per_key = self._length_per_key
        return pinned

    def permute(self, indices: Sequence[int]) -> KeyedJaggedTensor:
        """Keys reordered (or selected) as ``[keys[i] for i in indices]``."""
        indices = list(indices)
        if indices == list(range(len(self._keys))):
            return self
        for i in indices:
            if not 0 <= i < len(self._keys):
                raise IndexError(f"permute index {i} out of range for {len(self._keys)} keys")
        batch = self.stride()
        starts = self.offset_per_key()
        lengths = self._lengths.view(len(self._keys), batch)[indices].reshape(-1)
        values = (
            torch.cat([self._values[starts[i] : starts[i + 1]] for i in indices])
            if indices
            else self._values[:0]
        )
        weights = None
        if self._weights is not None:
            weights = (
                torch.cat([self._weights[starts[i] : starts[i + 1]] for i in indices])
                if indices
                else self._weights[:0]
            )
        out = KeyedJaggedTensor(
            [self._keys[i] for i in indices], values, lengths, weights, validate=False
        )
        lpk = self.length_per_key()
        out._length_per_key = [lpk[i] for i in indices]
        return out

    def select(self, keys: Sequence[str]) -> KeyedJaggedTensor:
        """The given keys, in the given order."""
        index = {k: i for i, k in enumerate(self._keys)}
        missing = [k for k in keys if k not in index]
        if missing:
            raise KeyError(f"keys {missing} are not in this batch; it has {self._keys}")
        return self.permute([index[k] for k in keys])

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Consecutive groups of keys: ``segments=[2, 3]`` gives keys[0:2] and keys[2:5]."""
        if sum(segments) != len(self._keys) or any(s < 0 for s in segments):
            raise ValueError(
                f"split segments {list(segments)} must be non-negative and sum to the "
                f"{len(self._keys)} keys"
            )
        batch = self.stride()
        starts = self.offset_per_key()
        lpk = self.length_per_key()
        out, key_start = [], 0
        for size in segments:
            key_end = key_start + size
            lo, hi = starts[key_start], starts[key_end]
            weights = self._weights[lo:hi] if self._weights is not None else None
            part = KeyedJaggedTensor(
                self._keys[key_start:key_end],
                self._values[lo:hi],
                self._lengths[key_start * batch : key_end * batch],
                weights,
                validate=False,
            )
            part._length_per_key = lpk[key_start:key_end]
            out.append(part)
            key_start = key_end
        return out

    @staticmethod
    def concat(parts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Keys of several batches of the same size side by side."""
        if not parts:
            raise ValueError("concat needs at least one KeyedJaggedTensor")
        strides = {p.stride() for p in parts if p.keys()}
        if len(strides) > 1:
            raise ValueError(f"cannot concat batches of different sizes {sorted(strides)}")
        weighted = {p.weights_or_none() is not None for p in parts if p.keys()}
        if len(weighted) > 1:
            raise ValueError("cannot concat weighted and unweighted batches")
        keys = [k for p in parts for k in p.keys()]  # noqa: SIM118 (a method, not a dict)
        values = torch.cat([p.values() for p in parts])
        lengths = torch.cat([p.lengths() for p in parts])
        weights = torch.cat([p.weights() for p in parts]) if weighted == {True} else None
        return KeyedJaggedTensor(
            keys, values, lengths, weights, validate=len(set(keys)) != len(keys)
        )

    @staticmethod
    def from_jagged_dict(features: dict[str, Jagged]) -> KeyedJaggedTensor:
        keys = list(features)
        if not keys:
            empty = torch.zeros(0, dtype=torch.int64)
            return KeyedJaggedTensor([], empty, empty)
        parts = [features[k] for k in keys]
        weights = None
        if any(p.weights is not None for p in parts):
            if not all(p.weights is not None for p in parts):
                raise ValueError("either every key has weights or none does")
            weights = torch.cat([p.weights for p in parts if p.weights is not None])
        return KeyedJaggedTensor(
            keys,
            torch.cat([p.values for p in parts]),
            torch.cat([p.lengths for p in parts]),
            weights,
        )

    # ----------------------------------------------------------- torchrec
    def to_torchrec(self) -> Any:
        """The same batch as ``torchrec.sparse.jagged_tensor.KeyedJaggedTensor``."""
        try:
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT
        except ImportError as e:
            raise ImportError(
                "to_torchrec() needs torchrec; install it with "
                "`pip install --no-deps torchrec==1.8.0` (see README)"
            ) from e
        return TorchrecKJT(
            keys=list(self._keys),
            values=self._values,
            lengths=self._lengths,
            weights=self._weights,
            stride=self.stride(),
        )

    @staticmethod
    def from_torchrec(kjt: Any) -> KeyedJaggedTensor:
        """Copy-free view of a TorchRec ``KeyedJaggedTensor`` (validated)."""
        if kjt.variable_stride_per_key():
            raise ValueError("variable batch size per key is not supported; pad to one stride")
        return KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.lengths(), kjt.weights_or_none())


class KeyedTensor:
    """Pooled embeddings ``values[B, sum(D_t)]`` with the keys that own each column block."""

    __slots__ = ("_keys", "_length_per_key", "_values")

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor):
        if len(keys) != len(length_per_key):
            raise ValueError("keys and length_per_key must have the same length")
        if values.dim() != 2 or values.shape[1] != sum(length_per_key):
            raise ValueError(
                f"values must be [B, {sum(length_per_key)}] for dims {list(length_per_key)}, "
                f"got {tuple(values.shape)}"
            )
        self._keys = list(keys)
        self._length_per_key = list(length_per_key)
        self._values = values

    def keys(self) -> list[str]:
        return self._keys

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def values(self) -> torch.Tensor:
        return self._values

    def __getitem__(self, key: str) -> torch.Tensor:
        index = self._keys.index(key)
        start = sum(self._length_per_key[:index])
        return self._values[:, start : start + self._length_per_key[index]]

    def to_dict(self) -> dict[str, torch.Tensor]:
        parts = torch.split(self._values, self._length_per_key, dim=1)
        return dict(zip(self._keys, parts))

    def stacked(self) -> torch.Tensor:
        """``[B, T, D]`` when every key has the same dim D (a view, no copy)."""
        dims = set(self._length_per_key)
        if len(dims) != 1:
            raise ValueError(f"stacked() needs one common dim, keys have {sorted(dims)}")
        return self._values.view(self._values.shape[0], len(self._keys), dims.pop())

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, values={tuple(self._values.shape)})"
