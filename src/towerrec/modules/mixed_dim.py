"""Mixed-dimension embeddings (Ginart et al., 2021): popular tables get wider rows.

Table i, whose rows are accessed with probability p_i each, gets dim::

    d_i = clamp(round_to * round(lambda * p_i^alpha / round_to), min_dim, max_dim)

with temperature ``alpha`` (0: every table at ``max_dim``; larger: a steeper
fall-off for rarely used rows) and ``lambda`` set either by a base dim (the
most popular table gets ``max_dim``) or by a parameter budget
(``sum_i n_i d_i <= budget``, found by bisection). Without measured
popularities, a table's row popularity is ``1 / n_i`` (the table-level rule of
the paper). A projection ``[d_i -> D]`` after each narrower table brings every
feature back to the common dim D the interaction needs.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["mixed_dimensions"]


def _dims(
    scale: float,
    popularity: Sequence[float],
    alpha: float,
    max_dim: int,
    min_dim: int,
    round_to: int,
) -> list[int]:
    out = []
    for p in popularity:
        raw = scale * p**alpha
        rounded = round_to * round(raw / round_to)
        out.append(int(min(max(rounded, min_dim), max_dim)))
    return out


def mixed_dimensions(
    num_embeddings: Sequence[int],
    alpha: float,
    max_dim: int,
    *,
    popularity: Sequence[float] | None = None,
    budget: int = 0,
    min_dim: int = 1,
    round_to: int = 1,
) -> list[int]:
    """Per-table dims ``d_i`` (see module docstring); ``budget = 0``: base-dim rule."""
    if not num_embeddings:
        raise ValueError("mixed_dimensions needs at least one table")
    if alpha < 0:
        raise ValueError(f"mixed-dimension alpha must be >= 0, got {alpha}")
    if not 1 <= min_dim <= max_dim:
        raise ValueError(f"need 1 <= min_dim <= max_dim, got min_dim={min_dim}, max_dim={max_dim}")
    if round_to < 1:
        raise ValueError(f"round_to must be >= 1, got {round_to}")
    if popularity is None:
        popularity = [1.0 / n for n in num_embeddings]
    if len(popularity) != len(num_embeddings) or min(popularity) <= 0:
        raise ValueError("give one positive popularity per table")
    top = max(popularity) ** alpha
    if not budget:
        return _dims(max_dim / top, popularity, alpha, max_dim, min_dim, round_to)
    floor = sum(n * min_dim for n in num_embeddings)
    if budget < floor:
        raise ValueError(
            f"a budget of {budget:,} parameters is below the {floor:,} that min_dim = {min_dim} "
            "needs; raise the budget or lower min_dim"
        )

    def cost(scale: float) -> int:
        dims = _dims(scale, popularity, alpha, max_dim, min_dim, round_to)
        return sum(n * d for n, d in zip(num_embeddings, dims))

    lo, hi = 0.0, max_dim / min(popularity) ** alpha * 2  # cost(hi) = every table at max_dim
    for _ in range(100):
        mid = (lo + hi) / 2
        if cost(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return _dims(lo, popularity, alpha, max_dim, min_dim, round_to)
