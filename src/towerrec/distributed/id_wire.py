"""Wire format of the id payloads that input_dist and the tower transform send: the
lengths and ids of K keys (features) over B samples for one destination, and
optionally the ids' per-id weights, as bytes.

::

    payload (uint8) = [ header int32 [3 + 3K] | ids of key 0 | key 1 | ... | lengths [K, B]
                        | inverse index of key 0 | key 1 | ... | weights [n] ]

    header   format version (``WIRE_VERSION``), length bytes, weight bytes (0: no
             weights; 4: float32, 8: float64); then per key: id bytes, index bytes
             (0: not deduplicated), ids sent (the unique ids when deduplicated, else
             every occurrence)
    ids      deduplicated key: its unique ids once (sorted); else every occurrence,
             in the order the KeyedJaggedTensor holds them
    lengths  bag lengths, key-major
    inverse  deduplicated keys only: for each occurrence, the position of its id
             among the key's unique ids (ids[inverse] restores the occurrences)
    weights  one per occurrence (never deduplicated), in the order of the occurrences:
             ids and their weights travel in one message

Every integer section travels as the narrowest type that holds its largest value
(1, 2, 4 or 8 bytes: uint8, int16, int32, int64), chosen per key for ids and
indexes: ids of tables under 2^31 rows are int32 or narrower, a table of at most 256
rows sends one byte per id, bag lengths usually take one byte. With ``dedup`` a key
is deduplicated only where that makes its part smaller (unique ids plus a narrow
index against every occurrence); the header says which. Decoding restores the
lengths and the occurrences exactly, in their order, so per-id weights (in the
payload's weights section, or sent beside) still follow their ids, and the lookup,
its pooling and its gradients are the same with and without deduplication. A
payload of another version is refused (both ends must run the same towerrec).

Shapes: ``lengths [K, B]`` integer, ``values [n]`` integer with ``n = lengths.sum()``,
keys contiguous (key-major).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["WIRE_VERSION", "IdWire", "narrowest_itemsize"]

WIRE_VERSION = 2  # 1: header [length bytes, per key ...], no weights section

_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOATS = {4: torch.float32, 8: torch.float64}
_HEAD = 3  # header words before the per-key entries
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

    def encode(
        self, lengths: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``lengths [K, B]``, ``values [n]`` (key-major) and optionally ``weights [n]``
        (float32 or float64, one per id) -> the payload, uint8 ``[bytes]``; empty when K = 0."""
        if lengths.shape[0] == 0:
            return torch.zeros(0, dtype=torch.uint8, device=values.device)
        weight_size = 0
        if weights is not None:
            if weights.dtype not in _FLOATS.values():
                raise ValueError(
                    f"per-id weights of dtype {weights.dtype} cannot go on the id wire; give "
                    "float32 (or float64) weights"
                )
            if weights.numel() != values.numel():
                raise ValueError(
                    f"{weights.numel()} per-id weights for {values.numel()} ids; give one "
                    "weight per id"
                )
            weight_size = weights.element_size()
        length_size = narrowest_itemsize(_largest(lengths))
        header, ids, indexes = [WIRE_VERSION, length_size, weight_size], [], []
        for v in values.split(lengths.sum(dim=1).tolist()):
            entries, id_bytes, index_bytes = self._encode_key(v)
            header += entries
            ids.append(id_bytes)
            if index_bytes is not None:
                indexes.append(index_bytes)
        head = _as_bytes(torch.tensor(header, device=values.device), 4)
        weight_bytes = [] if weights is None else [weights.contiguous().view(torch.uint8)]
        lengths_bytes = _as_bytes(lengths.reshape(-1), length_size)
        return torch.cat([head, *ids, lengths_bytes, *indexes, *weight_bytes])

    def decode(
        self, payload: torch.Tensor, num_keys: int, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A payload of ``num_keys`` keys over ``batch`` samples -> ``lengths [K, B]`` and
        ``values [n]``, int64, exactly as encoded (a weights section is not read)."""
        lengths, values, _ = self.decode_weighted(payload, num_keys, batch)
        return lengths, values

    def decode_weighted(
        self, payload: torch.Tensor, num_keys: int, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``decode`` and the payload's per-id weights ``[n]`` (None when it has none)."""
        if num_keys == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=payload.device)
            return empty.view(0, batch), empty, None
        version = int(_read(payload, 0, 1, 4))
        if version != WIRE_VERSION:
            raise ValueError(
                f"id payload of wire version {version}, this towerrec reads version "
                f"{WIRE_VERSION}; run the same towerrec on every rank"
            )
        header = _read(payload, 0, _HEAD + 3 * num_keys, 4).tolist()
        length_size, weight_size = header[1], header[2]
        keys = [header[_HEAD + 3 * k : _HEAD + 3 + 3 * k] for k in range(num_keys)]
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
        ids_out = torch.cat(values)
        weights = None
        if weight_size:
            raw = payload[position : position + ids_out.numel() * weight_size].clone()
            weights = raw.view(_FLOATS[weight_size])
        return lengths, ids_out, weights

    def decode_all(
        self, received: torch.Tensor, sizes: Sequence[int], num_keys: int, batches: Sequence[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The payloads of every source, back to back in ``received`` (``sizes[r]`` bytes
        from source r, ``batches[r]`` samples each) -> (lengths, values) per source."""
        blocks = received.split(list(sizes))
        return [self.decode(block, num_keys, b) for block, b in zip(blocks, batches)]

    def decode_all_weighted(
        self, received: torch.Tensor, sizes: Sequence[int], num_keys: int, batches: Sequence[int]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """``decode_all`` and the weights of every source back to back (source-major, as
        the ids), or None when no payload has weights; every payload with ids must carry
        weights, or none."""
        blocks = received.split(list(sizes))
        decoded = [self.decode_weighted(block, num_keys, b) for block, b in zip(blocks, batches)]
        parts = [(lengths, values) for lengths, values, _ in decoded]
        weights = [w for _, values, w in decoded if values.numel() or w is not None]
        if all(w is None for w in weights):
            return parts, None
        if any(w is None for w in weights):
            raise ValueError(
                "some ranks' id payloads carry per-id weights and some do not; give every "
                "rank weighted features or none"
            )
        return parts, torch.cat([w for w in weights if w is not None])
