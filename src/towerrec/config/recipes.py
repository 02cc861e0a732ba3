"""The recommended configs shipped inside the package, and which one fits a cache.

The TOML files in ``recipes/`` beside this module are package data: an installed
towerrec has them, not only a checkout (the repository's ``configs/`` links to them).
``--config NAME`` takes one by name:

    towerrec train --config criteo --set data.path=DIR

``resolve_config_file`` says what a ``--config`` value names. A value with a path
separator or a ``.toml`` suffix, or a file that exists, is a path, read as it is. A bare
name is ``./NAME.toml`` when that file exists (a file of the user's shadows the recipe),
else the packaged recipe ``NAME``; an unknown name is an error listing the recipes.

``recipe_for_cache`` picks the recipe a converter prints for the cache it wrote (the
rule and its evidence are in its docstring).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from towerrec.config.errors import ConfigError

__all__ = [
    "CONTEXT_MAX_ROWS",
    "CRITEO",
    "FEW_LOOKUPS_PER_ROW",
    "RECIPES_DIR",
    "CacheRecipe",
    "large_vocabulary",
    "recipe_for_cache",
    "recipe_names",
    "recipe_path",
    "recipe_summary",
    "resolve_config_file",
]

RECIPES_DIR = Path(__file__).with_name("recipes")

# The largest table of a small vocabulary (``recipe_for_cache``; the ``context`` recipe's
# limit): about five times the largest table the small-vocabulary recipes were measured on
# (9,743 movies of the gen-context set and MovieLens), below the hashed tables of
# Criteo-style data (100,000 per table by default in `towerrec data criteo`, millions in
# Avazu or Criteo libFM exports), which take the large-vocabulary recipe.
CONTEXT_MAX_ROWS = 50_000


def recipe_names() -> tuple[str, ...]:
    """The packaged recipes, by name (the file names without ``.toml``), sorted."""
    return tuple(sorted(p.stem for p in RECIPES_DIR.glob("*.toml")))


def recipe_path(name: str) -> Path:
    """The packaged recipe ``name``; a ``ConfigError`` listing the recipes if none is."""
    path = RECIPES_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(
            f"--config {name}: no file {name!r} here and no packaged recipe of that name; "
            f"the recipes are {', '.join(recipe_names())} (`towerrec config recipes` says "
            "what each is for), or give the path of a TOML file"
        )
    return path


def recipe_summary(name: str) -> str:
    """What recipe ``name`` is for: the first line of its header comment, up to a colon."""
    for line in recipe_path(name).read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").split(":")[0].strip()
    return ""


def _is_path(text: str) -> bool:
    separators = {"/", os.sep, *([os.altsep] if os.altsep else [])}
    return any(s in text for s in separators) or text.endswith(".toml") or text in (".", "..")


def resolve_config_file(value: str | Path) -> Path:
    """The TOML file a ``--config`` value names: a path as it is (an existing file, or a
    value with a path separator or a ``.toml`` suffix), else ``./NAME.toml`` when it
    exists, else the packaged recipe ``NAME``."""
    path = Path(value)
    text = str(value)
    if path.is_file() or _is_path(text) or not text:
        return path
    local = Path(f"{text}.toml")
    if local.is_file():
        return local
    return recipe_path(text)


@dataclass(frozen=True)
class CacheRecipe:
    """The recipe for a converted cache (``None``: the built-in defaults) and why."""

    name: str | None
    reason: str


# What the Criteo TSV converter prints: Adam 1e-3 on rows started normal 1e-4, 0.020 test
# AUC above the defaults on Criteo-format data (docs/benchmarks.md "Embedding initialisation").
CRITEO = CacheRecipe("criteo", "Criteo TSV data")


# Fewer training lookups than this per table row, on average over the tables, is a large
# vocabulary for its data: most rows are seen a few times. Measured between 11 (the planted
# data with tables of 5,000 to 40,000 rows, where the `criteo` rule won by 0.040) and 98
# (gen-context, where row-wise Adagrad 0.5 won by 0.017).
FEW_LOOKUPS_PER_ROW = 30


def large_vocabulary(
    sizes: Sequence[int], pooling: Sequence[float], train_rows: int | None
) -> str | None:
    """Why tables of ``sizes`` rows (a mean of ``pooling`` ids a sample each) trained on
    ``train_rows`` rows (None: unknown) are a large vocabulary, or None when they are not:
    a table above ``CONTEXT_MAX_ROWS`` rows, or fewer than ``FEW_LOOKUPS_PER_ROW`` training
    lookups per table row."""
    if not sizes:
        return None
    largest = max(sizes)
    if largest > CONTEXT_MAX_ROWS:
        return f"a table of {largest:,} rows, above {CONTEXT_MAX_ROWS:,}"
    if train_rows:
        per_row = train_rows * sum(pooling) / sum(sizes)
        if per_row < FEW_LOOKUPS_PER_ROW:
            return (
                f"{per_row:.1f} training lookups per table row ({train_rows:,} rows over "
                f"{sum(sizes):,} table rows), fewer than {FEW_LOOKUPS_PER_ROW}"
            )
    return None


def recipe_for_cache(schema: Mapping[str, Any], train_rows: int | None = None) -> CacheRecipe:
    """The recommended config for a cache of ``schema`` (its manifest's ``schema``:
    ``num_dense`` and the ``sparse`` fields with ``num_embeddings``, ``pooling_factor`` and
    ``multi_hot``) with ``train_rows`` training rows (None: unknown) from a converter of no
    fixed format (libFM, Parquet, CSV; Criteo TSV's is ``CRITEO``):

    - A large vocabulary (``large_vocabulary``: a table above ``CONTEXT_MAX_ROWS`` rows,
      or fewer than ``FEW_LOOKUPS_PER_ROW`` training lookups per table row): ``criteo``
      (FuxiCTR's embedding rule, Adam 1e-3 on rows started normal 1e-4, with the wider
      top MLP). Where most rows are seen a few times, the defaults' row-wise Adagrad at
      0.5 fits the rare rows' noise: on the planted data with tables of 50,000 to 500,000
      rows it scored 0.018 test AUC below a plain-PyTorch DLRM on FuxiCTR's recipe, and
      this recipe above it; with tables of 5,000 to 40,000 rows (11 lookups a row) the
      recipe was 0.040 above the defaults (docs/benchmarks.md, "Large vocabularies"). The
      converter drops the recipe's bottom MLP for data without dense features.
    - No dense features, every field one-hot and a small vocabulary: ``context``, the
      small-vocabulary recipe (the shape of Frappe-like context data and of the
      gen-context set it was measured on; row-wise Adagrad 0.5, which beat Adam there by
      0.017, with no bottom MLP).
    - A small vocabulary with dense features or multi-hot bags: the defaults, which no
      measured recipe beats on such data (MovieLens, the planted data).
    """
    sparse: Sequence[Mapping[str, Any]] = schema.get("sparse", ())
    if not sparse:
        return CacheRecipe(None, "no categorical fields")
    num_dense = int(schema.get("num_dense", 0))
    multi_hot = [f["name"] for f in sparse if f.get("multi_hot")]
    sizes = [int(f["num_embeddings"]) for f in sparse]
    pooling = [float(f.get("pooling_factor", 1.0)) for f in sparse]
    large = large_vocabulary(sizes, pooling, train_rows)
    if large is not None:
        return CacheRecipe("criteo", f"large-vocabulary data: {large}")
    if num_dense == 0 and not multi_hot:
        return CacheRecipe(
            "context",
            f"small-vocabulary data: {len(sparse)} one-hot fields, no dense features, tables "
            f"of at most {max(sizes):,} rows (<= {CONTEXT_MAX_ROWS:,})",
        )
    why = (
        f"{num_dense} dense feature(s)"
        if num_dense
        else f"multi-hot field(s) {', '.join(multi_hot)}"
    )
    return CacheRecipe(
        None, f"small tables (at most {max(sizes):,} rows) with {why}: the defaults' data"
    )
