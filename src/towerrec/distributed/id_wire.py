"""Wire format of the id payloads that input_dist and the tower transform send: the
lengths and ids of K keys (features) over B samples for one destination, as bytes.

::

    payload (uint8) = [ header int32 [1 + 3K] | ids of key 0 | key 1 | ... | lengths [K, B]
                        | inverse index of key 0 | key 1 | ... ]

    header   length bytes; then per key: id bytes, index bytes (0: not deduplicated),
             ids sent (the unique ids when deduplicated, else every occurrence)
    ids      deduplicated key: its unique ids once (sorted); else every occurrence,
             in the order the KeyedJaggedTensor holds them
    lengths  bag lengths, key-major
    inverse  deduplicated keys only: for each occurrence, the position of its id
             among the key's unique ids (ids[inverse] restores the occurrences)

Every integer section travels as the narrowest type that holds its largest value
(1, 2, 4 or 8 bytes: uint8, int16, int32, int64), chosen per key for ids and
indexes: ids of tables under 2^31 rows are int32 or narrower, a table of at most 256
rows sends one byte per id, bag lengths usually take one byte. With ``dedup`` a key
is deduplicated only where that makes its part smaller (unique ids plus a narrow
index against every occurrence); the header says which. Decoding restores the
lengths and the occurrences exactly, in their order, so per-id weights (sent beside,
one per occurrence) still follow their ids, and the lookup, its pooling and its
gradients are the same with and without deduplication.

Shapes: ``lengths [K, B]`` integer, ``values [n]`` integer with ``n = lengths.sum()``,
keys contiguous (key-major).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["IdWire", "narrowest_itemsize"]

_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LIMITS = ((1, 2**8 - 1), (2, 2**15 - 1), (4, 2**31 - 1))


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
    """How id payloads are encoded (module doc); ``dedup``: send a key's unique ids once
    with an inverse index (``distributed.dedup_ids``), only where that makes its part
    smaller unless ``where_smaller`` is False (then for every key with ids)."""

    dedup: bool = True
    where_smaller: bool = True

    def _encode_key(self, v: torch.Tensor) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """One key's (header entries, ids bytes, index bytes or None)."""
        id_size = narrowest_itemsize(_largest(v))
        if self.dedup and v.numel() > 1:
            unique, inverse = torch.unique(v, return_inverse=True)
            index_size = narrowest_itemsize(unique.numel() - 1)
            smaller = unique.numel() * id_size + v.numel() * index_size < v.numel() * id_size
            if smaller or not self.where_smaller:
                unique_size = narrowest_itemsize(_largest(unique))
                return (
                    [unique_size, index_size, unique.numel()],
                    _as_bytes(unique, unique_size),
                    _as_bytes(inverse, index_size),
                )
        return [id_size, 0, v.numel()], _as_bytes(v, id_size), None

    def encode(self, lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``lengths [K, B]``, ``values [n]`` (key-major) -> the payload, uint8 ``[bytes]``;
        empty when K = 0."""
        if lengths.shape[0] == 0:
            return torch.zeros(0, dtype=torch.uint8, device=values.device)
        length_size = narrowest_itemsize(_largest(lengths))
        header, ids, indexes = [length_size], [], []
        for v in values.split(lengths.sum(dim=1).tolist()):
            entries, id_bytes, index_bytes = self._encode_key(v)
            header += entries
            ids.append(id_bytes)
            if index_bytes is not None:
                indexes.append(index_bytes)
        head = _as_bytes(torch.tensor(header, device=values.device), 4)
        return torch.cat([head, *ids, _as_bytes(lengths.reshape(-1), length_size), *indexes])

    def decode(
        self, payload: torch.Tensor, num_keys: int, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A payload of ``num_keys`` keys over ``batch`` samples -> ``lengths [K, B]`` and
        ``values [n]``, int64, exactly as encoded."""
        if num_keys == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=payload.device)
            return empty.view(0, batch), empty
        header = _read(payload, 0, 1 + 3 * num_keys, 4).tolist()
        length_size, keys = header[0], [header[1 + 3 * k : 4 + 3 * k] for k in range(num_keys)]
        position = 4 * len(header)
        ids = []
        for id_size, _, count in keys:
            ids.append(_read(payload, position, count, id_size))
            position += count * id_size
        lengths = _read(payload, position, num_keys * batch, length_size).view(num_keys, batch)
        position += num_keys * batch * length_size
        values = []
        for (_, index_size, _), key_ids, n in zip(keys, ids, lengths.sum(dim=1).tolist()):
            if not index_size:
                values.append(key_ids)
                continue
            values.append(key_ids[_read(payload, position, n, index_size)])
            position += n * index_size
        return lengths, torch.cat(values)

    def decode_all(
        self, received: torch.Tensor, sizes: Sequence[int], num_keys: int, batches: Sequence[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The payloads of every source, back to back in ``received`` (``sizes[r]`` bytes
        from source r, ``batches[r]`` samples each) -> (lengths, values) per source."""
        blocks = received.split(list(sizes))
        return [self.decode(block, num_keys, b) for block, b in zip(blocks, batches)]
