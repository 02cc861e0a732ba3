"""The canonical names of a fused collection's tables in state dicts, and their loading.

A collection whose tables are not ``nn.Parameter``s (``EmbeddingBagCollection``,
``CachedEmbeddingBagCollection``) names them itself, the same for every backend and
store::

    state_dict()              embedding_bags.<table>.weight      [rows, dim]
    optimizer_state_dict()    embedding_bags.<table>.<state>     [rows] / [rows, dim] / []

``save_table_weights`` and ``load_table_weights`` are the table half of a module's
``_save_to_state_dict`` / ``_load_from_state_dict``; the module's own entries (none
but what a subclass registers) go through ``nn.Module`` as usual (``other_entries``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "TABLES_KEY",
    "check_keys",
    "copy_checked",
    "load_table_weights",
    "other_entries",
    "save_table_weights",
    "table_key",
    "table_states",
]

TABLES_KEY = "embedding_bags"


def table_key(prefix: str, table: str, name: str) -> str:
    """The state-dict key of ``table``'s ``name`` (``weight`` or an optimizer state)."""
    return f"{prefix}{TABLES_KEY}.{table}.{name}"


def table_states(state: Mapping[str, torch.Tensor], table: str) -> dict[str, torch.Tensor]:
    """``{state name: tensor}`` of ``table`` in an unprefixed optimizer state dict."""
    start = table_key("", table, "")
    return {k[len(start) :]: v for k, v in state.items() if k.startswith(start)}


def save_table_weights(
    destination: dict[str, Any], prefix: str, weights: Mapping[str, torch.Tensor]
) -> None:
    """Put ``{table: weight}`` into ``destination`` under their canonical keys."""
    for name, weight in weights.items():
        destination[table_key(prefix, name, "weight")] = weight


def other_entries(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries of ``state_dict`` that are not the tables' (for ``nn.Module``)."""
    ours = f"{prefix}{TABLES_KEY}."
    return {k: v for k, v in state_dict.items() if not k.startswith(ours)}


@torch.no_grad()
def load_table_weights(
    weights: Mapping[str, torch.Tensor],
    state_dict: Mapping[str, Any],
    prefix: str,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Copy the tables' entries of ``state_dict`` into ``weights`` (``{table: view}``),
    noting missing, unexpected and misshapen ones as ``_load_from_state_dict`` does."""
    ours = f"{prefix}{TABLES_KEY}."
    own = set()
    for name, weight in weights.items():
        key = table_key(prefix, name, "weight")
        own.add(key)
        if key not in state_dict:
            missing_keys.append(key)
            continue
        try:
            copy_checked(weight, state_dict[key], key)
        except ValueError as e:
            error_msgs.append(str(e))
    unexpected_keys.extend(k for k in state_dict if k.startswith(ours) and k not in own)


def check_keys(expected: Mapping[str, Any], got: Mapping[str, Any], what: str) -> None:
    """Refuse ``got`` unless it has exactly the keys of ``expected``, naming the difference."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{what} does not match the model: missing {missing[:5]}, unexpected {extra[:5]}; "
            "was it saved from a model with other tables or another optimizer?"
        )


def copy_checked(target: torch.Tensor, source: torch.Tensor, key: str) -> None:
    """``target.copy_(source)``, refusing another shape with a message naming ``key``."""
    if tuple(source.shape) != tuple(target.shape):
        raise ValueError(
            f"size mismatch for {key}: checkpoint has {tuple(source.shape)}, model has "
            f"{tuple(target.shape)}"
        )
    target.copy_(source)
