"""Wire format of the id payloads that input_dist and the tower transform send: the
lengths and ids of K keys over B samples for one destination, as bytes.

::

    payload (uint8) = [ header int32 [3 (+ K)] | ids | lengths [K, B] | inverse index [n] ]

    header   id bytes, length bytes, index bytes (0: not deduplicated),
             then, deduplicated, the number of unique ids of each key
    ids      deduplicated: each key's unique ids once (sorted), key after key;
             else every occurrence, key-major, as the KeyedJaggedTensor holds them
    lengths  bag lengths, key-major
    inverse  deduplicated only: for each occurrence, the position of its id among
             its key's unique ids; ids[key start + inverse] restores the occurrences

Every integer section travels as the narrowest type that holds its largest value
(1, 2, 4 or 8 bytes: uint8, int16, int32, int64), so ids of tables under 2^31 rows
are int32 (or narrower), bag lengths are usually one byte, and the header says
which types the receiver reads. With ``dedup`` a payload is deduplicated only when
that makes it smaller (its header says which; ``where_smaller=False`` always does). Decoding restores the lengths and
the occurrences exactly, in their order, so per-id weights (sent beside, one per
occurrence) still follow their ids and the lookup, its pooling and its gradients
are the same with and without deduplication.

Shapes: ``lengths [K, B]`` integer, ``values [n]`` integer with ``n = lengths.sum()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["IdWire", "narrowest_itemsize"]

_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LIMITS = ((1, 2**8 - 1), (2, 2**15 - 1), (4, 2**31 - 1))
_HEADER = 3  # id bytes, length bytes, index bytes


def narrowest_itemsize(largest: int) -> int:
    """Bytes of the narrowest of uint8, int16, int32, int64 that holds 0..``largest``."""
    for size, limit in _LIMITS:
        if largest <= limit:
            return size
    return 8


def _largest(x: torch.Tensor) -> int:
    return int(x.max()) if x.numel() else 0


def _as_bytes(x: torch.Tensor, itemsize: int) -> torch.Tensor:
    return x.to(_DTYPES[itemsize]).contiguous().view(torch.uint8)


def _read(payload: torch.Tensor, start: int, count: int, itemsize: int) -> torch.Tensor:
    """``count`` integers of ``itemsize`` bytes from byte ``start`` of ``payload``, as int64
    (copied first: the slice of a received buffer need not be aligned for a wider type)."""
    raw = payload[start : start + count * itemsize].clone()
    return raw.view(_DTYPES[itemsize]).long()


@dataclass(frozen=True)
class IdWire:
    """How id payloads are encoded (module doc); ``dedup``: send each key's unique ids
    once with an inverse index (``distributed.dedup_ids``), only where that makes the
    payload smaller unless ``where_smaller`` is False (then whenever there are ids)."""

    dedup: bool = True
    where_smaller: bool = True

    def encode(self, lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``lengths [K, B]``, ``values [n]`` (key-major) -> the payload, uint8 ``[bytes]``;
        empty when K = 0."""
        num_keys = lengths.shape[0]
        if num_keys == 0:
            return torch.zeros(0, dtype=torch.uint8, device=values.device)
        length_size = narrowest_itemsize(_largest(lengths))
        id_size = narrowest_itemsize(_largest(values))
        plain = values.numel() * id_size
        if self.dedup and values.numel() > 1:
            per_key = lengths.sum(dim=1).tolist()
            uniques, inverses = [], []
            for v in values.split(per_key):
                unique, inverse = torch.unique(v, return_inverse=True)
                uniques.append(unique)
                inverses.append(inverse)
            counts = [u.numel() for u in uniques]
            index_size = narrowest_itemsize(max(counts) - 1)
            deduped = 4 * num_keys + sum(counts) * id_size + values.numel() * index_size
            if deduped < plain or not self.where_smaller:
                header = torch.tensor([id_size, length_size, index_size, *counts])
                return torch.cat(
                    [
                        _as_bytes(header.to(values.device), 4),
                        _as_bytes(torch.cat(uniques), id_size),
                        _as_bytes(lengths.reshape(-1), length_size),
                        _as_bytes(torch.cat(inverses), index_size),
                    ]
                )
        header = torch.tensor([id_size, length_size, 0], device=values.device)
        return torch.cat(
            [
                _as_bytes(header, 4),
                _as_bytes(values, id_size),
                _as_bytes(lengths.reshape(-1), length_size),
            ]
        )

    def decode(
        self, payload: torch.Tensor, num_keys: int, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A payload of ``num_keys`` keys over ``batch`` samples -> ``lengths [K, B]`` and
        ``values [n]``, int64, exactly as encoded."""
        if num_keys == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=payload.device)
            return empty.view(0, batch), empty
        id_size, length_size, index_size = _read(payload, 0, _HEADER, 4).tolist()
        position = 4 * _HEADER
        if not index_size:
            lengths_at = payload.numel() - num_keys * batch * length_size
            values = _read(payload, position, (lengths_at - position) // id_size, id_size)
            lengths = _read(payload, lengths_at, num_keys * batch, length_size)
            return lengths.view(num_keys, batch), values
        counts = _read(payload, position, num_keys, 4)
        position += 4 * num_keys
        total = int(counts.sum())
        uniques = _read(payload, position, total, id_size)
        position += total * id_size
        lengths = _read(payload, position, num_keys * batch, length_size).view(num_keys, batch)
        position += num_keys * batch * length_size
        per_key = lengths.sum(dim=1)
        n = int(per_key.sum())
        inverse = _read(payload, position, n, index_size)
        starts = torch.cumsum(counts, 0) - counts
        inverse = inverse + torch.repeat_interleave(starts, per_key, output_size=n)
        return lengths, uniques[inverse]

    def decode_all(
        self, received: torch.Tensor, sizes: Sequence[int], num_keys: int, batches: Sequence[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The payloads of every source, back to back in ``received`` (``sizes[r]`` bytes
        from source r, ``batches[r]`` samples each) -> (lengths, values) per source."""
        blocks = received.split(list(sizes))
        return [self.decode(block, num_keys, b) for block, b in zip(blocks, batches)]
