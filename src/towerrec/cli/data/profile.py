"""``towerrec data profile [DATA]``: the locality of each table's ids, for tier planning.

    towerrec data profile CACHE_DIR                a cache written by ``towerrec data``
    towerrec data profile ML_DIR                   a MovieLens directory (ratings.csv, ...)
    towerrec data profile configs/x.toml           the config's data source
    towerrec data profile                          the default config's (synthetic) stream

Reads one epoch of the training split in training order (an endless stream: the
run's ``train.steps`` batches, or ``--samples``) at the run's batch size
(``--batch-size``), and reports per table the distinct ids per batch, the LRU
reuse-distance histogram and the predicted hit rate against cache size
(data/profile.py, data/locality.py). Writes the profile JSON (into the cache
directory, else ``locality_profile.json`` here; ``--out``) that ``towerrec plan
--profile`` reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from towerrec.cli.choices import PROFILE_MAX_IDS, PROFILE_NAME
from towerrec.cli.common import add_override_args, config_of

if TYPE_CHECKING:
    from towerrec.config import Config
    from towerrec.data.profile import LocalityProfile

__all__ = ["add_commands"]


def _config(target: Path | None, overrides: list[str]) -> Config:
    from towerrec.config import load_config
    from towerrec.data.cache import read_manifest

    if target is None:
        return load_config(None, overrides)
    if target.is_dir() and not (target / "ratings.csv").is_file():
        read_manifest(target)  # a directory that is not a finished cache: say why
    return config_of(target, overrides)


def _save(profile: LocalityProfile, out: Path | None, cache_dir: Path | None) -> Path:
    """Write to ``out``; by default into the cache directory, or here when that is
    read-only (said so) or there is no cache."""
    if out is not None:
        try:
            return profile.save(out)
        except OSError as e:
            raise ValueError(
                f"cannot write the profile to {out} ({e}); choose another --out"
            ) from None
    if cache_dir is not None:
        try:
            return profile.save(cache_dir / PROFILE_NAME)
        except OSError as e:
            print(f"cannot write into the cache directory ({e}); writing ./{PROFILE_NAME}")
    return profile.save(PROFILE_NAME)


def _cmd_profile(args: argparse.Namespace) -> int:
    from towerrec.build.resolve import resolve_steps
    from towerrec.data.profile import profile_source, report_table, write_plot
    from towerrec.data.registry import SOURCES

    config = _config(args.target, args.overrides)
    data = config.data
    entry = SOURCES[data.source]
    # Profiling needs no validation split: the loader as training reads the train split.
    source = entry.build(data, require_eval=False)
    description = entry.describe(data)
    batch_size = args.batch_size or config.train.batch_size
    samples = args.samples
    if samples is None and source.train_rows is None:
        samples = resolve_steps(config, source)[0] * batch_size
    profile = profile_source(
        source,
        batch_size=batch_size,
        max_ids=args.max_ids,
        samples=samples,
        description=description,
        progress=not args.no_progress,
    )
    out = _save(profile, args.out, entry.cache_dir(data))
    if args.plot:
        write_plot(profile, args.plot)
    if args.json:
        print(json.dumps({**profile.as_dict(), "written": str(out)}, indent=1))
    else:
        print(report_table(profile))
        plot = f", plot {args.plot}" if args.plot else ""
        print(f"profile written to {out}{plot}; plan tiers with: towerrec plan --profile {out}")
    return 0


def add_commands(data_sub: argparse._SubParsersAction) -> None:
    p = data_sub.add_parser(
        "profile",
        help="locality of each table's ids: distinct per batch, reuse distances, LRU hit-rate "
        "curve (for tier planning)",
    )
    p.add_argument(
        "target",
        type=Path,
        nargs="?",
        metavar="DATA",
        help="cache directory, MovieLens directory or config file (default: the default "
        "config's data source)",
    )
    add_override_args(p, "data.synthetic.zipf_alpha=0.8")
    p.add_argument(
        "--batch-size", type=int, help="samples per batch (default: the config's train.batch_size)"
    )
    p.add_argument(
        "--max-ids",
        type=int,
        default=PROFILE_MAX_IDS,
        help="ids per table whose stack distances are computed: the first ones of the stream "
        f"(default {PROFILE_MAX_IDS:,})",
    )
    p.add_argument(
        "--samples",
        type=int,
        help="samples to read from an endless stream (default: the run's train.steps batches)",
    )
    p.add_argument("--out", type=Path, help=f"profile JSON (default: DATA/{PROFILE_NAME} for a "
                   f"cache, else ./{PROFILE_NAME})")  # fmt: skip
    p.add_argument("--plot", type=Path, help="PNG of the hit-rate curves and histograms")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_profile)
