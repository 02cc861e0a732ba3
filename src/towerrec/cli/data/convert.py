"""``towerrec data criteo | libfm | table | gen-criteo | info``: preprocess real data into
the binary cache, generate test files, summarise a cache.

    towerrec data criteo day_0 day_1 ... --out DIR      Criteo TSV (plain or .gz) -> cache
    towerrec data libfm train.libfm --fields fields.txt --out DIR
    towerrec data table a.parquet --label click --categorical user:1000 --out DIR
    towerrec data gen-criteo --out DIR --files 2 --rows 100000
    towerrec data info DIR                              manifest summary (and checksum check)

Each converter prints the command that trains on the cache it wrote, with the packaged
recipe that fits the data (``towerrec train --config criteo --set data.path=DIR``;
``config/recipes.py`` says which and why), else the defaults.
Every converter takes a validation and a test split as whole files
(``--validation-files``, ``--test-files``) or seeded fractions of the rows
(``--validation-fraction``, ``--test-fraction``; ``data/splits.py``); ``--eval-*``
are the validation options' earlier names. Given no validation option, a
converter holds out a seeded ``DEFAULT_EVAL_FRACTION`` of the rows for
validation (training validates) and says so.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from towerrec.config import Config
    from towerrec.config.recipes import CacheRecipe
    from towerrec.data.splits import Split

__all__ = ["DEFAULT_EVAL_FRACTION", "add_commands"]

# The eval share a converter holds out when given no split option: training ends
# with an evaluation, so a cache without eval rows could not be trained on.
DEFAULT_EVAL_FRACTION = 0.1


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a table size or a comma-separated list of 26 of them"
        ) from None


def _split(args: argparse.Namespace) -> Split:
    """The split options; with no validation option, the default validation fraction
    (said so)."""
    from towerrec.data.splits import Split

    fraction = args.eval_fraction
    if fraction is None and args.eval_files:
        fraction = 0.0
    elif fraction is None:
        given = "validation" if args.test_files or args.test_fraction else "split"
        print(
            f"no {given} option given: holding out a seeded {DEFAULT_EVAL_FRACTION:.0%} of the "
            f"rows for validation (as --validation-fraction {DEFAULT_EVAL_FRACTION} "
            f"--seed {args.seed})"
        )
        fraction = DEFAULT_EVAL_FRACTION
    return Split(
        eval_fraction=fraction,
        seed=args.seed,
        test_fraction=args.test_fraction,
        eval_files=tuple(args.eval_files),
        test_files=tuple(args.test_files),
    )


def _rows_line(rows: dict[str, int]) -> str:
    return (
        f"{rows['train']:,} train, {rows['validation']:,} validation and {rows['test']:,} test rows"
    )


def _print_next_step(
    rows: dict[str, int], out: Path, split_options: str, schema: dict, recipe: CacheRecipe
) -> None:
    """The command that trains on the cache, or why there is none: the packaged
    ``recipe`` that fits the data (``config/recipes.py``), else the defaults (without a
    bottom MLP for data without dense features); over kv stores when the tables do not
    fit this machine's memory at that config's embedding."""
    from towerrec.config import load_config

    if rows["validation"] == 0:
        print(
            "no validation rows: `towerrec train` validates and cannot use this cache; "
            f"convert again with {split_options}"
        )
        return
    path = shlex.quote(f"data.path={out}")
    at_path = [f"data.path={json.dumps(str(out))}"] if recipe.name else []
    config = load_config(recipe.name, at_path)
    # data without dense features: no bottom MLP (the recipe's or the defaults')
    drop_bottom = not schema["num_dense"] and config.model.bottom_mlp
    no_bottom = " --set 'model.bottom_mlp=[]'" if drop_bottom else ""
    if recipe.name is None:
        print(f"recipe: none, the defaults ({recipe.reason})")
        command = f"--set data.source=cache --set {path}{no_bottom}"
    else:
        print(
            f"recipe: {recipe.name}, for {recipe.reason}; `towerrec config recipes "
            f"{recipe.name}` prints it"
        )
        command = f"--config {recipe.name} --set {path}{no_bottom}"
    sizes = [f["num_embeddings"] for f in schema["sparse"]]
    kv = _kv_settings(config, sizes, out)
    print(f"train with: towerrec train {command}{kv}")


KV_CACHE_SLOTS = 1_000_000  # rows a table's cache holds in the printed kv command


def _kv_settings(config: Config, sizes: list[int], out: Path) -> str:
    """The settings that put tables of ``sizes`` rows in caches over kv stores beside
    ``out``, when at ``config``'s embedding they would not fit this machine's memory held
    whole (``towerrec train`` refuses those); empty otherwise (or when memory is unknown)."""
    from towerrec.memory import physical_memory_bytes
    from towerrec.modules.compact import full_table_bytes
    from towerrec.modules.tables import TableConfig

    if not sizes:
        return ""
    dim = config.model.embedding_dim
    tables = [TableConfig(f"t{i}", n, dim) for i, n in enumerate(sizes)]
    need = full_table_bytes(tables, config.embedding.optimizer_config())
    limit = physical_memory_bytes()
    if limit is None or need <= limit:
        return ""
    print(
        f"the tables need {need / 2**30:,.1f} GiB held whole at embedding dim {dim}, more "
        f"than this machine's {limit / 2**30:,.1f} GiB: train them as caches of "
        f"{KV_CACHE_SLOTS:,} rows over kv stores, which hold only the rows training touches"
    )
    store = shlex.quote(f"embedding.backing_path={out}-kv")
    return (
        " --set embedding.memory=cached --set embedding.backing=kv "
        f"--set embedding.cache_slots={KV_CACHE_SLOTS} --set {store}"
    )


def _cmd_criteo(args: argparse.Namespace) -> int:
    from towerrec.config.recipes import CRITEO
    from towerrec.data.criteo import CriteoOptions, preprocess_criteo

    split = _split(args)
    options = CriteoOptions(
        num_embeddings=args.num_embeddings,
        min_count=args.min_count,
        eval_fraction=split.eval_fraction,
        eval_files=split.eval_files,
        test_fraction=split.test_fraction,
        test_files=split.test_files,
        seed=args.seed,
        strict=args.strict,
        threads=args.threads,
    )
    start = time.perf_counter()
    manifest = preprocess_criteo(args.inputs, args.out, options, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    input_bytes = sum(Path(p).stat().st_size for p in args.inputs)
    report = manifest["report"]
    print(
        f"wrote {args.out}: {_rows_line(manifest['rows'])}, "
        f"{input_bytes / 1e6:,.1f} MB of input in {seconds:.1f} s "
        f"({input_bytes / 1e6 / seconds:,.1f} MB/s)"
    )
    if report["malformed"]:
        print(f"skipped {report['malformed']} malformed rows {report['by_reason']}; first ones:")
        for where in report["first"]:
            print(f"  {where}")
    print(f"table sizes: {[f['num_embeddings'] for f in manifest['schema']['sparse']]}")
    unseen = {k: n for k, n in report.get("out_of_vocabulary", {}).items() if n}
    if unseen:
        print(f"values outside the training vocabulary (the reserved id 0), per split: {unseen}")
    _print_next_step(
        manifest["rows"],
        args.out,
        "--validation-fraction F (0 < F < 1) or --validation-files FILE...",
        manifest["schema"],
        CRITEO,
    )
    return 0


def _named_sizes(text: str) -> dict[str, int]:
    try:
        return {
            name: int(size)
            for name, size in (item.rsplit(":", 1) for item in text.split(",") if item)
        }
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected name:size[,name:size...], e.g. user:100000,item:50000"
        ) from None


def _print_manifest(manifest: dict, out: Path) -> None:
    from towerrec.config.recipes import recipe_for_cache

    rows, report = manifest["rows"], manifest["report"]
    print(f"wrote {out}: {_rows_line(rows)}")
    if report["malformed"]:
        print(f"skipped {report['malformed']} malformed rows {report['by_reason']}; first ones:")
        for where in report["first"]:
            print(f"  {where}")
    _print_next_step(
        rows,
        out,
        "--validation-fraction F (0 < F < 1) or --validation-files FILE...",
        manifest["schema"],
        recipe_for_cache(manifest["schema"], manifest["rows"]["train"]),
    )


def _cmd_libfm(args: argparse.Namespace) -> int:
    from towerrec.data.libfm import infer_field_map, preprocess_libfm, write_field_map

    if args.infer_fields:
        fields = infer_field_map(args.inputs)
        write_field_map(fields, args.infer_fields)
        kinds = ", ".join(f"{fields.kinds.count(k)} {k}" for k in sorted(set(fields.kinds)))
        inputs = " ".join(shlex.quote(str(p)) for p in args.inputs)
        print(f"wrote {args.infer_fields}: {len(fields.names)} fields ({kinds}); review it, then")
        print(f"convert with: towerrec data libfm {inputs} --fields {args.infer_fields} --out DIR")
        return 0
    if args.fields is None or args.out is None:
        raise ValueError(
            "towerrec data libfm needs --fields FILE and --out DIR (or --infer-fields FILE to "
            "write a field map for review first)"
        )
    manifest = preprocess_libfm(
        args.inputs, args.out, args.fields, strict=args.strict, split=_split(args)
    )
    _print_manifest(manifest, args.out)
    return 0


def _cmd_table(args: argparse.Namespace) -> int:
    from towerrec.data.tabular import TableSchema, preprocess_table

    schema = TableSchema(
        label=args.label,
        dense=tuple(c for c in args.dense.split(",") if c),
        categorical=args.categorical,
        multi_hot=args.multi_hot,
        list_delimiter=args.list_delimiter,
    )
    manifest = preprocess_table(
        args.inputs, args.out, schema, strict=args.strict, split=_split(args)
    )
    _print_manifest(manifest, args.out)
    return 0


def _cmd_gen_criteo(args: argparse.Namespace) -> int:
    from towerrec.data.criteo_gen import generate_criteo_files

    paths = generate_criteo_files(
        args.out,
        args.files,
        args.rows,
        seed=args.seed,
        gzip_output=args.gzip,
        cardinality_scale=args.cardinality_scale,
    )
    total = sum(p.stat().st_size for p in paths)
    print(
        f"wrote {len(paths)} file(s), {args.rows:,} rows each, {total / 1e6:,.1f} MB in {args.out}"
    )
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from towerrec.data.cache import open_cache
    from towerrec.data.splits import SPLITS

    store = open_cache(args.cache, verify="never" if args.no_verify else "always")
    manifest = store.manifest
    print(
        json.dumps(
            {
                "source": manifest.get("source"),
                "rows": {s: store.rows(s) for s in SPLITS},
                "num_dense": store.schema.num_dense,
                "tables": {f.name: f.num_embeddings for f in store.schema.sparse},
                "report": manifest.get("report"),
                "checksums": "not checked" if args.no_verify else "ok",
            },
            indent=1,
        )
    )
    return 0


def _add_split_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--validation-fraction",
        "--eval-fraction",
        dest="eval_fraction",
        type=float,
        default=None,
        help="share of rows drawn into validation (seeded; default: "
        f"{DEFAULT_EVAL_FRACTION} without --validation-files, else 0)",
    )
    parser.add_argument(
        "--validation-files",
        "--eval-files",
        dest="eval_files",
        nargs="+",
        default=[],
        metavar="FILE",
        help="input files that form validation",
    )
    parser.add_argument(
        "--test-fraction",
        type=float,
        default=0.0,
        help="share of rows drawn into test (seeded; scored once, at the end of training)",
    )
    parser.add_argument(
        "--test-files", nargs="+", default=[], metavar="FILE", help="input files that form test"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the row fractions")


def add_commands(data_sub: argparse._SubParsersAction) -> None:
    criteo = data_sub.add_parser("criteo", help="Criteo Kaggle/Terabyte TSV (plain or gzip)")
    criteo.add_argument("inputs", nargs="+", help="TSV files, e.g. day_0 ... day_23 (or .gz)")
    criteo.add_argument("--out", type=Path, required=True, help="cache directory")
    criteo.add_argument(
        "--num-embeddings",
        type=_sizes,
        default=(100_000,),
        metavar="N[,N...]",
        help="hashing: rows per table, one for all or 26 (default 100000; id 0 = missing)",
    )
    criteo.add_argument(
        "--min-count",
        type=int,
        default=0,
        help="> 0: a vocabulary of values seen at least this often in the training files "
        "instead of hashing (rarer values share id 0 with missing ones)",
    )
    _add_split_options(criteo)
    criteo.add_argument(
        "--strict", action="store_true", help="stop at the first malformed row (file:line)"
    )
    criteo.add_argument("--threads", type=int, default=2, help="chunks parsed in parallel")
    criteo.add_argument("--no-progress", action="store_true")
    criteo.set_defaults(func=_cmd_criteo)

    libfm = data_sub.add_parser("libfm", help="libFM 'label idx:val ...' files with a field map")
    libfm.add_argument("inputs", nargs="+")
    libfm.add_argument("--out", type=Path, help="cache directory")
    libfm.add_argument("--fields", type=Path, help="field map: lines 'name first last [kind]'")
    libfm.add_argument(
        "--infer-fields",
        type=Path,
        metavar="FILE",
        help="derive a field map from the data (one token per field per line), write it to "
        "FILE for review, and stop",
    )
    table = data_sub.add_parser("table", help="Parquet or CSV files with a declared schema")
    table.add_argument("inputs", nargs="+", help=".parquet files or CSV files with a header")
    table.add_argument("--out", type=Path, required=True, help="cache directory")
    table.add_argument("--label", required=True, help="label column (0/1)")
    table.add_argument("--dense", default="", help="comma-separated float columns")
    table.add_argument(
        "--categorical", type=_named_sizes, default={}, metavar="COL:SIZE,...",
        help="categorical columns hashed into SIZE rows",
    )  # fmt: skip
    table.add_argument(
        "--multi-hot", type=_named_sizes, default={}, metavar="COL:SIZE,...",
        help="list columns (CSV: delimited strings) hashed into SIZE rows",
    )  # fmt: skip
    table.add_argument("--list-delimiter", default="|")
    for p, func in ((libfm, _cmd_libfm), (table, _cmd_table)):
        _add_split_options(p)
        p.add_argument("--strict", action="store_true", help="stop at the first malformed row")
        p.set_defaults(func=func)

    gen = data_sub.add_parser("gen-criteo", help="generate Criteo-format TSV test files")
    gen.add_argument("--out", type=Path, required=True, help="directory for day_<i> files")
    gen.add_argument("--files", type=int, default=2)
    gen.add_argument("--rows", type=int, default=100_000, help="rows per file")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--gzip", action="store_true", help="write day_<i>.gz")
    gen.add_argument(
        "--cardinality-scale",
        type=float,
        default=0.01,
        help="scale of the large columns' cardinalities relative to Criteo Kaggle",
    )
    gen.set_defaults(func=_cmd_gen_criteo)

    info = data_sub.add_parser("info", help="summarise a cache and check its checksums")
    info.add_argument("cache", type=Path)
    info.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    info.set_defaults(func=_cmd_info)
