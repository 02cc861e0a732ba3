"""Id maps of memory-efficient tables: hashing and complementary partitions.

Compositional embeddings (Shi et al., 2020) give every id of a table of ``n``
rows a unique combination of rows of P smaller tables. The P partitions are
*complementary*: no two ids < n fall into the same row of every table::

    quotient-remainder (P = 2, m = ceil(n / c)):   id ─► (id mod m, id div m)
        tables of m and ceil(n / m) rows: about n / c + c rows instead of n

    mixed radix (P > 2, radices m_1 .. m_P):       id ─► (id mod m_1,
                                                          (id div m_1) mod m_2, ...,
                                                          id div (m_1 ... m_{P-1}))
    Chinese remainder (pairwise coprime m_j):      id ─► (id mod m_1, ..., id mod m_P)

    hashing trick (baseline, one table of m rows): id ─► id mod m   (collisions!)

Ids stay int64 end to end (``torch.remainder`` and floor ``torch.div`` on
integers): no float rounding, so ids beyond 2^24 (or 2^53) map exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

import torch

__all__ = [
    "PartitionScheme",
    "count_collisions",
    "crt_moduli",
    "hash_rows",
    "partition_ids",
    "partition_sizes",
    "quotient_remainder_radices",
]


class PartitionScheme(StrEnum):
    QUOTIENT_REMAINDER = "quotient_remainder"  # mixed radix; P = 2 is QR
    CRT = "crt"  # Chinese remainder: pairwise coprime moduli


def hash_rows(num_embeddings: int, compression: float) -> int:
    """Rows of a hashed table ``compression`` times smaller (at least 1)."""
    return max(1, math.ceil(num_embeddings / compression))


def quotient_remainder_radices(
    num_embeddings: int, compression: float, num_partitions: int = 2
) -> list[int]:
    """Radices ``[m_1, ..., m_P]`` with ``m_1 = ceil(n / c)`` and product >= n.

    The remainder table holds ``n / c`` rows; the quotient range ``ceil(n / m_1)``
    is split evenly over the other P - 1 tables.
    """
    if num_partitions < 2:
        raise ValueError(f"complementary partitions need >= 2 tables, got {num_partitions}")
    if not compression > 1:
        raise ValueError(f"compression must be > 1 (rows are divided by it), got {compression}")
    first = hash_rows(num_embeddings, compression)
    quotient = math.ceil(num_embeddings / first)
    rest = num_partitions - 1
    radix = max(1, round(quotient ** (1 / rest)))
    while radix**rest < quotient:  # the smallest radix whose power covers the quotient range
        radix += 1
    while radix > 1 and (radix - 1) ** rest >= quotient:
        radix -= 1
    radices = [first] + [radix] * (rest - 1)
    covered = math.prod(radices)
    radices.append(max(1, math.ceil(num_embeddings / covered)))
    assert math.prod(radices) >= num_embeddings
    return radices


def crt_moduli(num_embeddings: int, compression: float, num_partitions: int = 2) -> list[int]:
    """Pairwise coprime moduli with product >= n, the first about ``n / c``."""
    moduli: list[int] = []
    for m in quotient_remainder_radices(num_embeddings, compression, num_partitions):
        m = max(m, 2) if num_partitions > 1 else m
        while any(math.gcd(m, other) != 1 for other in moduli):
            m += 1
        moduli.append(m)
    # Raising moduli only grows the product, so it still covers n.
    assert math.prod(moduli) >= num_embeddings
    return moduli


def partition_sizes(
    scheme: PartitionScheme | str, num_embeddings: int, compression: float, num_partitions: int
) -> list[int]:
    """Rows of each of the P tables of a complementary partition."""
    if PartitionScheme(scheme) is PartitionScheme.CRT:
        return crt_moduli(num_embeddings, compression, num_partitions)
    return quotient_remainder_radices(num_embeddings, compression, num_partitions)


def partition_ids(
    ids: torch.Tensor, scheme: PartitionScheme | str, sizes: Sequence[int]
) -> list[torch.Tensor]:
    """The row of each partition's table for every id (int64, exact integer arithmetic)."""
    if ids.is_floating_point():
        raise TypeError("ids must be an integer tensor; float ids lose exactness above 2^24")
    ids = ids.long()
    if PartitionScheme(scheme) is PartitionScheme.CRT:
        return [torch.remainder(ids, m) for m in sizes]
    out, rest = [], ids
    for m in sizes[:-1]:
        out.append(torch.remainder(rest, m))
        rest = torch.div(rest, m, rounding_mode="floor")
    out.append(rest)
    return out


def count_collisions(ids: torch.Tensor, num_buckets: int) -> int:
    """Distinct ids that share a hashed row (``id mod num_buckets``) with another distinct id:
    ``#distinct ids - #distinct rows``."""
    unique = torch.unique(ids.long())
    return int(unique.numel() - torch.unique(torch.remainder(unique, num_buckets)).numel())
