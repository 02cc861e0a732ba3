"""``towerrec config show``: the resolved run config as TOML; ``towerrec config reference``:
every key as Markdown (docs/config.md); ``towerrec config recipes``: the packaged
recommended configs that ``--config NAME`` takes."""

from __future__ import annotations

import argparse
from pathlib import Path

from towerrec.cli.common import add_config_args

__all__ = ["add_commands"]


def _cmd_show(args: argparse.Namespace) -> int:
    from towerrec.build.resolve import resolve_run_config
    from towerrec.build.sources import build_source
    from towerrec.config import config_to_toml, load_config

    config = load_config(args.config, args.overrides)
    config, _ = resolve_run_config(config, build_source(config.data))
    print(config_to_toml(config), end="")
    return 0


def _cmd_reference(args: argparse.Namespace) -> int:
    from towerrec.config import ConfigError
    from towerrec.config.recipes import recipe_path
    from towerrec.config.reference import config_reference

    defaults = recipe_path("default") if args.defaults is None else args.defaults
    if not defaults.is_file():
        raise ConfigError(
            f"{defaults} does not exist: pass --defaults PATH to a commented defaults file "
            "such as configs/default.toml, or leave it out for the packaged one"
        )
    page = config_reference(defaults.read_text(encoding="utf-8"))
    if args.out is None:
        print(page, end="")
    else:
        args.out.write_text(page, encoding="utf-8")
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from towerrec.config.recipes import recipe_names, recipe_path, recipe_summary

    if args.name is not None:
        print(recipe_path(args.name).read_text(encoding="utf-8"), end="")
        return 0
    names = recipe_names()
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {recipe_summary(name)}")
    print(
        "use one with `towerrec train --config NAME`; print it with `towerrec config recipes NAME`"
    )
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="the resolved run config")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show",
        help="print the resolved config as TOML (what `towerrec train` writes as config.toml)",
    )
    add_config_args(show)
    show.set_defaults(func=_cmd_show)
    reference = config_sub.add_parser(
        "reference", help="every config key, its default and meaning, as Markdown (docs/config.md)"
    )
    reference.add_argument(
        "--defaults",
        type=Path,
        default=None,
        help="the commented defaults whose comments say what each key means "
        "(default: the packaged default.toml, which configs/default.toml links to)",
    )
    reference.add_argument("--out", type=Path, help="write the page here (default: stdout)")
    reference.set_defaults(func=_cmd_reference)
    recipes = config_sub.add_parser(
        "recipes",
        help="the recommended configs shipped with towerrec (`--config NAME` takes them)",
    )
    recipes.add_argument("name", nargs="?", help="print this recipe's TOML")
    recipes.set_defaults(func=_cmd_recipes)
