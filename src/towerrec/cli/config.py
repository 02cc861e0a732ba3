"""``towerrec config show``: the resolved run config as TOML; ``towerrec config reference``:
every key as Markdown (docs/config.md)."""

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
    from towerrec.config.reference import config_reference

    if not args.defaults.is_file():
        raise ConfigError(
            f"{args.defaults} does not exist: run from the repository root or pass "
            "--defaults PATH/configs/default.toml"
        )
    page = config_reference(args.defaults.read_text(encoding="utf-8"))
    if args.out is None:
        print(page, end="")
    else:
        args.out.write_text(page, encoding="utf-8")
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
        default=Path("configs/default.toml"),
        help="the commented defaults whose comments say what each key means "
        "(default: configs/default.toml)",
    )
    reference.add_argument("--out", type=Path, help="write the page here (default: stdout)")
    reference.set_defaults(func=_cmd_reference)
