"""``towerrec data gen-context --out DIR``: the small-vocabulary, context-aware click data
set built from MovieLens, as libFM files (``data/context_gen.py``), and the command that
converts them.

    towerrec data gen-context --out ctx                  from the bundled ml-latest-small
    towerrec data libfm ctx/train.libfm ctx/validation.libfm ctx/test.libfm \\
        --fields ctx/fields.txt --validation-files ctx/validation.libfm \\
        --test-files ctx/test.libfm --out ctx-cache      (as printed)
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

__all__ = ["add_commands"]


def _cmd_gen_context(args: argparse.Namespace) -> int:
    from towerrec.data.context_gen import ContextOptions, generate_context_files
    from towerrec.data.movielens import bundled_movielens_path

    source = args.movielens or bundled_movielens_path()
    options = ContextOptions(min_rating=args.min_rating, negatives=args.negatives, seed=args.seed)
    rows = generate_context_files(source, args.out, options)
    counts = ", ".join(f"{n:,} {split}" for split, n in rows.items())
    print(
        f"wrote {args.out}: train.libfm, validation.libfm, test.libfm ({counts} rows), fields.txt"
    )
    files = {split: shlex.quote(str(args.out / f"{split}.libfm")) for split in rows}
    cache = shlex.quote(f"{args.out}-cache")
    print(
        f"convert with: towerrec data libfm {' '.join(files.values())} --fields "
        f"{shlex.quote(str(args.out / 'fields.txt'))} --validation-files "
        f"{files['validation']} --test-files {files['test']} --out {cache}"
    )
    return 0


def add_commands(data_sub: argparse._SubParsersAction) -> None:
    gen = data_sub.add_parser(
        "gen-context",
        help="a small-vocabulary context-aware click data set from MovieLens, as libFM files",
    )
    gen.add_argument("--out", type=Path, required=True, help="directory for the libFM files")
    gen.add_argument(
        "--movielens", type=Path, help="a MovieLens directory (default: the bundled one)"
    )
    gen.add_argument(
        "--min-rating", type=float, default=4.0, help="a rating at least this is a positive"
    )
    gen.add_argument("--negatives", type=int, default=2, help="sampled negatives per positive")
    gen.add_argument("--seed", type=int, default=0, help="the negatives and the split")
    gen.set_defaults(func=_cmd_gen_context)
