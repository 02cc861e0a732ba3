"""A config file's ``[for_model.NAME]`` settings: applied when model.name is NAME, over the
file's own sections and under ``--set``; every model's table checked whichever is chosen."""

import pytest

from towerrec.config import ConfigError, load_config

BASE = """
[model]
name = "dlrm"

[embedding]
lr = 0.05
init = "normal_scale"

[optimizer]
lr = 0.002

[for_model.dcn.embedding]
init = "uniform_rows"
lr = 0.1

[for_model.dcn.optimizer]
lr = 0.001

[for_model.wukong.embedding]
optimizer = "adam"
"""


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.toml"
    path.write_text(BASE)
    return path


def test_the_chosen_models_settings_apply_and_only_its(recipe):
    dlrm = load_config(recipe)
    assert (dlrm.embedding.lr, dlrm.embedding.init, dlrm.optimizer.lr) == (
        0.05,
        "normal_scale",
        0.002,
    )
    dcn = load_config(recipe, ["model.name=dcn"])
    assert (dcn.embedding.lr, dcn.embedding.init, dcn.optimizer.lr) == (0.1, "uniform_rows", 0.001)
    assert dcn.embedding.optimizer == dlrm.embedding.optimizer  # untouched keys stay the file's
    wukong = load_config(recipe, ["model.name=wukong"])
    assert (wukong.embedding.optimizer, wukong.embedding.lr) == ("adam", 0.05)


def test_set_and_unset_still_win_over_the_models_settings(recipe):
    dcn = load_config(recipe, ["model.name=dcn", "embedding.lr=0.3"])
    assert dcn.embedding.lr == 0.3
    dcn = load_config(recipe, ["model.name=dcn", "!optimizer.lr"])
    assert dcn.optimizer.lr == load_config().optimizer.lr  # back to the default
    # the model chosen by a later file or by --set, whichever comes last
    assert load_config(recipe, ["model.name=dcn", "model.name=dlrm"]).embedding.lr == 0.05


def test_a_later_file_adds_to_a_models_settings(recipe, tmp_path):
    more = tmp_path / "more.toml"
    more.write_text('[model]\nname = "dcn"\n\n[for_model.dcn.embedding]\nlr = 0.2\n')
    dcn = load_config([recipe, more])
    assert (dcn.model.name, dcn.embedding.lr, dcn.embedding.init) == ("dcn", 0.2, "uniform_rows")


def test_the_movielens_recipe_carries_dcn_and_wukong_settings():
    dlrm, dcn = load_config("movielens"), load_config("movielens", ["model.name=dcn"])
    assert dcn.embedding.init != dlrm.embedding.init and dcn.model.name == "dcn"
    assert load_config("movielens", ["model.name=wukong"]).embedding.optimizer == "adam"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[for_model.transformer.embedding]\nlr = 0.1\n",
            r"\[for_model.transformer\] names no model",
        ),
        ("[for_model]\ndcn = 3\n", r"one table of sections per model"),
        ('[for_model.dcn.model]\nname = "wukong"\n', r"cannot set model.name"),
        ("[for_model.wukong.embedding]\nlr = -1.0\n", r"\[for_model.wukong\]: .*embedding.lr"),
        ("[for_model.dcn.embeding]\nlr = 0.1\n", r"\[for_model.dcn\]: .*embeding"),
    ],
)
def test_a_bad_models_table_is_refused_even_for_another_model(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)  # model.name is dlrm: the other model's table is still checked


def test_the_built_in_defaults_carry_each_models_own_and_default_toml_equals_them(tmp_path):
    plain, dcn = load_config(), load_config(None, ["model.name=dcn"])
    assert dcn.embedding.init == "uniform_rows" != plain.embedding.init
    assert load_config("default", ["model.name=dcn"]) == dcn  # --config default = no --config
    # a config file's own sections replace the built-in model settings
    own = tmp_path / "own.toml"
    own.write_text('[model]\nname = "dcn"\n')
    assert load_config(own).embedding.init == plain.embedding.init


def test_a_resumed_runs_saved_config_is_not_changed_by_the_models_defaults(tmp_path):
    from towerrec.config import config_to_toml

    saved = tmp_path / "config.toml"
    ran = load_config(None, ["model.name=dcn", "embedding.lr=0.3"])
    saved.write_text(config_to_toml(ran))
    assert load_config(None, [], base=saved) == ran


def test_an_error_of_the_files_own_settings_is_not_blamed_on_a_models_table(tmp_path):
    path = tmp_path / "own.toml"
    path.write_text("[train]\nstepz = 3\n\n[for_model.dcn.embedding]\nlr = 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz'") as raised:
        load_config(path)
    assert "for_model" not in str(raised.value)


def test_a_file_that_leaves_a_setting_to_set_loads_with_its_models_tables(tmp_path):
    """A recipe for converted data names no data.path (the user's --set gives it): the file
    alone does not load, so its models' tables are checked with the overrides, in a run's
    order."""
    path = tmp_path / "criteo.toml"
    path.write_text('[data]\nsource = "criteo"\n\n[for_model.wukong.optimizer]\nlr = 0.001\n')
    with pytest.raises(ConfigError, match=r"needs data.path"):
        load_config(path)  # without it the file cannot run, and says why
    run = load_config(path, [f"data.path={tmp_path}", "model.name=wukong"])
    assert run.optimizer.lr == 0.001
    assert load_config(path, [f"data.path={tmp_path}"]).optimizer.lr == load_config().optimizer.lr
    # and the packaged criteo recipe, the command its converter prints
    assert (
        load_config("criteo", [f"data.path={tmp_path}", "model.name=wukong"]).optimizer.lr == 0.001
    )


def test_a_set_that_another_models_table_would_contradict_still_loads():
    """The movielens recipe's Wukong starts its rows normal with std 1e-4 (init_scale): a
    DLRM run that switches the rows to uniform_rows and unsets init_scale loads, and so
    does the same for Wukong, whose table comes before the overrides."""
    overrides = ["embedding.init=uniform_rows", "!embedding.init_scale"]
    dlrm = load_config("movielens", overrides)
    assert dlrm.embedding.init == "uniform_rows"
    wukong = load_config("movielens", [*overrides, "model.name=wukong"])
    assert (wukong.embedding.init, wukong.embedding.optimizer) == ("uniform_rows", "adam")
