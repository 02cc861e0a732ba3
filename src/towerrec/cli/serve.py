"""``towerrec export`` (a finished run as an inference artefact) and ``towerrec predict``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from towerrec.cli.choices import EXPORT_TABLE_DTYPES, PREDICT_SPLITS

__all__ = ["add_commands"]


def _cmd_export(args: argparse.Namespace) -> int:
    from towerrec.serve.export import export_run

    manifest = export_run(args.run, args.out, args.tables, verify=not args.no_verify)
    tables = manifest["tables"]
    print(
        f"exported {manifest['model']} (step {manifest['step']}) of {args.run} to {args.out}/: "
        f"program.pt2, {len(manifest['schema']['sparse'])} features' tables in "
        f"{tables['dtype']} ({tables['bytes']:,} bytes), manifest.json, checksums.json"
    )
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    import torch

    from towerrec.serve.predict import predict

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    result = predict(
        args.artefact,
        args.data,
        args.out,
        split=args.split,
        batch_size=args.batch_size,
        progress=not args.no_progress,
        verify=not args.no_verify,
    )
    print(json.dumps(result, indent=2))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export", help="write a finished run as a self-contained inference artefact"
    )
    export.add_argument("run", type=Path, help="run directory of towerrec train")
    export.add_argument("--out", type=Path, required=True, help="artefact directory to write")
    export.add_argument(
        "--tables",
        choices=EXPORT_TABLE_DTYPES,
        default=EXPORT_TABLE_DTYPES[0],
        help="table storage: fp32, fp16, or int8 (row-wise: per-row scale and bias)",
    )
    export.add_argument(
        "--no-verify",
        action="store_true",
        help="load the run's checkpoint without checking its checksums (a checkpoint of a "
        "towerrec before checksums, or a very large one)",
    )
    export.set_defaults(func=_cmd_export)

    pred = sub.add_parser("predict", help="score data with an exported artefact (parquet out)")
    pred.add_argument("artefact", type=Path, help="artefact directory of towerrec export")
    pred.add_argument(
        "data",
        type=Path,
        nargs="*",
        help="a cache or MovieLens directory, or Criteo TSV files (default: the run's own "
        "data, as its config names it)",
    )
    pred.add_argument("--out", type=Path, help="parquet file: prediction (and label) columns")
    pred.add_argument(
        "--split", choices=PREDICT_SPLITS, default="validation", help="which split of DATA to score"
    )
    pred.add_argument("--batch-size", type=int, default=8192, help="samples per forward")
    pred.add_argument(
        "--threads", type=int, help="intra-op threads for scoring (default: torch's choice)"
    )
    pred.add_argument("--no-progress", action="store_true", help="no progress bar")
    pred.add_argument(
        "--no-verify",
        action="store_true",
        help="load the artefact without checking its checksums (one exported by a towerrec "
        "before checksums)",
    )
    pred.set_defaults(func=_cmd_predict)
