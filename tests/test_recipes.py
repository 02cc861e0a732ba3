"""The packaged recipes: shipped with the package, taken by ``--config NAME``, printed by
the converters for the data they fit."""

import json
import random
import shlex
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT
from conftest import run_cli as towerrec

from towerrec.config import ConfigError, load_config
from towerrec.config.recipes import (
    CONTEXT_MAX_ROWS,
    FEW_LOOKUPS_PER_ROW,
    RECIPES_DIR,
    recipe_for_cache,
    recipe_names,
    recipe_path,
    resolve_config_file,
)

RECOMMENDED = ("context", "criteo", "default", "movielens")


def test_the_recommended_configs_are_packaged_and_the_repository_configs_are_them():
    assert set(RECOMMENDED) <= set(recipe_names())
    repo = {p.stem: p for p in (ROOT / "configs").glob("*.toml")}
    assert set(repo) == set(recipe_names())  # one set of files, not two that drift
    for name, path in repo.items():
        assert path.read_bytes() == recipe_path(name).read_bytes(), name


def test_the_wheel_and_sdist_carry_the_recipes():
    """setuptools ships package data the package-data globs match: every recipe must match
    one (checked by building both once: `pip wheel .` and `setup.py sdist` list them)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["towerrec.config"]
    package = RECIPES_DIR.parent
    shipped = {p for g in globs for p in package.glob(g)}
    assert {RECIPES_DIR / f"{n}.toml" for n in recipe_names()} <= shipped


def test_a_bare_name_is_a_recipe_a_local_file_or_path_is_read_as_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_config_file("criteo") == recipe_path("criteo")
    assert load_config("movielens") == load_config(recipe_path("movielens"))
    # A directory of that name (a cache written with --out criteo) is no config file.
    (tmp_path / "criteo").mkdir()
    assert resolve_config_file("criteo") == recipe_path("criteo")
    # The user's own NAME.toml here shadows the recipe; a path is a path.
    (tmp_path / "movielens.toml").write_text("[train]\nsteps = 7\n")
    assert resolve_config_file("movielens").resolve() == tmp_path / "movielens.toml"
    assert load_config("movielens").train.steps == 7
    assert resolve_config_file("sub/context") == Path("sub/context")
    with pytest.raises(ConfigError, match=r"'sub/context' does not exist.*recipe: context"):
        load_config("sub/context")
    with pytest.raises(ConfigError, match=r"'context\.toml' does not exist"):
        load_config("context.toml")  # a file name, not a recipe's


def test_an_unknown_recipe_is_refused_with_the_list(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_config(["criteo", "critero"], ["data.path=x"])
    message = str(error.value)
    assert "--config critero: no file 'critero' here and no packaged recipe" in message
    assert "context, criteo, default, movielens" in message


def test_the_cli_takes_a_recipe_by_name_outside_the_repository(tmp_path):
    shown = towerrec("config", "show", "--config", "quick", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert tomllib.loads(shown.stdout)["train"]["steps"] == 60
    listed = towerrec("config", "recipes", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()[:-1]] == list(recipe_names())
    printed = towerrec("config", "recipes", "context", cwd=tmp_path)
    assert printed.stdout == recipe_path("context").read_text()
    unknown = towerrec("train", "--config", "nope", "--out", "run", cwd=tmp_path)
    assert unknown.returncode == 2 and "the recipes are context, criteo" in unknown.stderr
    assert not (tmp_path / "run").exists()


def test_config_reference_outside_the_repository_reads_the_packaged_defaults(tmp_path):
    page = towerrec("config", "reference", cwd=tmp_path)
    assert page.returncode == 0, page.stderr
    assert page.stdout == (ROOT / "docs" / "config.md").read_text(encoding="utf-8")


def _schema(sizes, num_dense=0, multi_hot=()):
    return {
        "num_dense": num_dense,
        "sparse": [
            {"name": f"f{i}", "num_embeddings": n, "multi_hot": f"f{i}" in multi_hot}
            for i, n in enumerate(sizes)
        ],
    }


@pytest.mark.parametrize(
    ("schema", "name", "why"),
    [
        (_schema([611, 9743, 20, 3]), "context", "4 one-hot fields"),
        (_schema([3, CONTEXT_MAX_ROWS]), "context", f"{CONTEXT_MAX_ROWS:,} rows"),
        (_schema([3, CONTEXT_MAX_ROWS + 1]), "criteo", "a table of 50,001 rows, above 50,000"),
        (_schema([3, 10], num_dense=2), None, "2 dense feature(s)"),
        (_schema([3, 10], multi_hot=("f1",)), None, "multi-hot field(s) f1"),
        (_schema([100_000] * 26, num_dense=13), "criteo", "large-vocabulary data"),
        (_schema([3, 10**6], multi_hot=("f1",)), "criteo", "a table of 1,000,000 rows"),
        (_schema([]), None, "no categorical fields"),
    ],
)
def test_the_recipe_a_cache_gets_follows_its_shape(schema, name, why):
    recipe = recipe_for_cache(schema)
    assert recipe.name == name and why in recipe.reason, recipe


@pytest.mark.parametrize(
    ("schema", "train_rows", "name", "why"),
    [
        # the planted data with tables of 5,000 to 40,000 rows: 11 lookups a row
        (_schema([20_000] * 9, num_dense=13), 200_000, "criteo", "10.0 training lookups per"),
        (_schema([20_000] * 9, num_dense=13), 600_000, None, "13 dense feature(s)"),
        # gen-context's shape: 98 lookups a row
        (_schema([611, 9743, 20, 3]), 102_018, "context", "4 one-hot fields"),
        (_schema([611, 9743, 20, 3]), 60_000, "criteo", f"fewer than {FEW_LOOKUPS_PER_ROW}"),
    ],
)
def test_few_training_lookups_per_table_row_are_a_large_vocabulary(schema, train_rows, name, why):
    recipe = recipe_for_cache(schema, train_rows)
    assert recipe.name == name and why in recipe.reason, recipe


def convert_and_train(tmp_path, items: int):
    """A libFM file of two one-hot fields (5 weekdays, ``items`` items) converted, and the
    printed train command run for an epoch: (the converter's output, the printed command,
    the run's saved config)."""
    rng = random.Random(0)
    lines = [
        f"{rng.randint(0, 1)} {rng.randrange(5)}:1 {rng.randrange(5, 5 + items)}:1"
        for _ in range(1500)
    ]
    (tmp_path / "train.libfm").write_text("\n".join(lines) + "\n")
    (tmp_path / "fields.txt").write_text(f"weekday 0 4\nitem 5 {4 + items}\n")
    convert = ["data", "libfm", "train.libfm", "--fields", "fields.txt", "--out", "c"]
    result = towerrec(*convert, cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("train with: ")]
    short = ["--set", "train.epochs=1", "--set", "train.progress=false", "--out", "run"]
    args = shlex.split(line.removeprefix("train with: towerrec "))
    trained = towerrec(*args, *short, cwd=tmp_path, OMP_NUM_THREADS="1")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] >= 1
    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    return result.stdout, line, saved


def test_libfm_one_hot_small_tables_print_the_context_recipe_and_it_trains(tmp_path):
    stdout, line, saved = convert_and_train(tmp_path, items=40)
    assert "recipe: context, for small-vocabulary data: 2 one-hot fields" in stdout
    assert line == "train with: towerrec train --config context --set data.path=c"
    assert saved["embedding"]["init_scale"] == 0.01 and saved["model"]["bottom_mlp"] == []


def test_libfm_with_a_large_table_prints_the_large_vocabulary_recipe_and_it_trains(tmp_path):
    """A field of more than ``CONTEXT_MAX_ROWS`` ids: the criteo recipe (FuxiCTR's
    embedding rule), without its bottom MLP since libFM data has no dense features."""
    stdout, line, saved = convert_and_train(tmp_path, items=60_000)
    assert "recipe: criteo, for large-vocabulary data: a table of 60,001 rows" in stdout
    assert line == (
        "train with: towerrec train --config criteo --set data.path=c --set 'model.bottom_mlp=[]'"
    )
    assert saved["embedding"]["optimizer"] == "adam" and saved["embedding"]["init_scale"] == 1e-4
    assert saved["model"]["bottom_mlp"] == [] and saved["model"]["top_mlp"] == [400, 400, 400, 1]


def test_commands_that_take_data_or_a_config_take_a_recipe_name_and_unset(tmp_path, monkeypatch):
    from towerrec.cli.common import config_of

    monkeypatch.chdir(tmp_path)  # no file named like the recipe here
    quick = config_of(Path("quick"), ["!train.steps"])
    assert quick.model == load_config("quick").model
    assert quick.train.steps == load_config().train.steps  # put back to the default
    with pytest.raises(FileNotFoundError, match=r"neither a config file, a recipe \(.*movielens"):
        config_of(Path("no-such-recipe"), [])
    for argv in (["data", "pu-prior"], ["data", "profile"], ["nas", "retrain"]):
        assert "--unset" in towerrec(*argv, "--help").stdout


@pytest.mark.parametrize(
    ("sets", "largest", "warned"),
    [
        ([], CONTEXT_MAX_ROWS + 1, True),
        ([], CONTEXT_MAX_ROWS, False),  # a small vocabulary: the defaults' rule is its own
        (["embedding.optimizer=adam", "embedding.lr=0.001"], 10**6, False),
        (["embedding.lr=0.05"], 10**6, False),
        (["embedding.init_scale=0.0001"], 10**6, False),
    ],
)
def test_training_large_tables_with_the_defaults_embedding_rule_is_warned_about(
    sets, largest, warned
):
    from types import SimpleNamespace

    from towerrec.build.resolve import embedding_rule_warning

    config = load_config(None, ["data.source=cache", "data.path=somewhere", *sets])
    tables = [SimpleNamespace(num_embeddings=n, pooling_factor=1.0) for n in (12, largest)]
    schema = SimpleNamespace(sparse=tables)
    message = embedding_rule_warning(config, schema, 10**8)  # many lookups a row
    assert (message is not None) == warned
    if warned:
        assert f"a table of {largest:,} rows" in message and "--config criteo" in message
    # few training lookups per table row: a large vocabulary at any table size
    few = embedding_rule_warning(config, schema, largest)
    assert (few is not None) == (not sets)
    stream = load_config(None, [])  # the synthetic stream: not a cache
    assert embedding_rule_warning(stream, schema, None) is None
