"""The error every config section raises, and the check of a closed set of choices."""

from __future__ import annotations

__all__ = ["ConfigError", "choice"]


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message says which and how to fix it."""


def choice(value: str, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        raise ValueError(f"{key} = {value!r} is not one of {', '.join(map(repr, choices))}")
