"""``towerrec config show``: the resolved run config as TOML."""

from __future__ import annotations

import argparse

from towerrec.build.resolve import resolve_run_config
from towerrec.build.sources import build_source
from towerrec.cli.common import add_config_args
from towerrec.config import config_to_toml, load_config

__all__ = ["add_commands"]


def _cmd_show(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    config, _ = resolve_run_config(config, build_source(config.data))
    print(config_to_toml(config), end="")
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
