"""``towerrec data ...``: real data into the binary cache, and what the data holds.

towerrec data criteo day_0 day_1 ... --out DIR      Criteo TSV (plain or .gz) -> cache
towerrec data libfm train.libfm --fields fields.txt --out DIR
towerrec data table a.parquet --label click --categorical user:1000 --out DIR
towerrec data gen-criteo --out DIR --files 2 --rows 100000
towerrec data info DIR                              manifest summary (and checksum check)
                                                    (these five: convert.py)
towerrec data pu-prior DATA_OR_CONFIG               class prior of positive-unlabeled data
                                                    (pu_prior.py)
towerrec data profile DATA                          locality of each table's ids (profile.py)
towerrec data periods OUT_DIR --config FILE         a config's periods, with example ids
                                                    (periods.py)
towerrec data gen-context --out DIR                 a small-vocabulary libFM data set built
                                                    from MovieLens (context.py)
"""

from __future__ import annotations

import argparse

from towerrec.cli.data import context, convert, periods, profile, pu_prior

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """``towerrec data ...`` (``towerrec bench data`` is in cli/bench.py)."""
    data = sub.add_parser("data", help="preprocess real data into the binary cache")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    for commands in (convert, context, pu_prior, profile, periods):
        commands.add_commands(data_sub)
