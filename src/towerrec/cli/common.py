"""What several commands share: the config arguments, and the config a data argument names."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from towerrec.config import Config

__all__ = [
    "UNSET_MARK",
    "add_config_args",
    "add_override_args",
    "config_of",
    "unset_override",
]

# The override form of `--unset KEY` (config/files.py: UNSET_PREFIX; a test keeps the two
# equal; the parser is built without importing the library).
UNSET_MARK = "!"


def unset_override(key: str) -> str:
    """``--unset KEY`` as the override ``!KEY``, in order with the ``--set`` ones."""
    return f"{UNSET_MARK}{key}"


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and repeatable ``--set SECTION.KEY=VALUE`` (into ``overrides``)."""
    parser.add_argument(
        "--config",
        type=Path,
        action="append",
        help="TOML config file, or the name of a packaged recipe (criteo, movielens, context, "
        "...: `towerrec config recipes`); repeat to layer them, each later one overriding the "
        "earlier ones (e.g. a data config, then a plan's tiers.toml)",
    )
    add_override_args(parser)


def add_override_args(
    parser: argparse.ArgumentParser, example: str = "train.steps=200", what: str = "config value"
) -> None:
    """Repeatable ``--set SECTION.KEY=VALUE`` and ``--unset SECTION.KEY``, in order, into
    ``overrides``."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=f"override one {what}, e.g. --set {example} (repeatable)",
    )
    parser.add_argument(
        "--unset",
        dest="overrides",
        action="append",
        type=unset_override,
        metavar="SECTION.KEY",
        help="put one key back to its default, whatever a --config file set, e.g. --unset "
        "train.epochs (repeatable; applied in order with --set)",
    )


def config_of(target: Path, overrides: list[str]) -> Config:
    """The run config ``target`` names: a TOML config file, a packaged recipe's name, a
    cache directory (with a manifest) or a MovieLens directory (with ratings.csv); then
    ``overrides``."""
    from towerrec.config import load_config
    from towerrec.config.recipes import recipe_names

    if target.is_file():
        return load_config(target, overrides)
    if not target.exists() and str(target) in recipe_names():
        return load_config(str(target), overrides)
    if (target / "ratings.csv").is_file():
        return load_config(None, ["data.source=movielens", f"data.path={target}", *overrides])
    if (target / "manifest.json").is_file():
        return load_config(None, ["data.source=cache", f"data.path={target}", *overrides])
    raise FileNotFoundError(
        f"{target} is neither a config file, a recipe ({', '.join(recipe_names())}), a cache "
        "directory (with manifest.json, from `towerrec data`) nor a MovieLens directory (with "
        "ratings.csv)"
    )
