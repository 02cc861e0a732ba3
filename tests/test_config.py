import dataclasses
import re
import tomllib
import typing
from pathlib import Path
from typing import Any, cast

import pytest

from towerrec.config import (
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    load_config,
)
from towerrec.modules.kernels import Backend


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 77\n[model]\nembedding_dim = 8\nbottom_mlp = [32, 8]\n")
    cfg = load_config(
        path,
        [
            "train.steps=5",
            "embedding.backend=torch",
            "data.synthetic.num_embeddings=[10, 20]",
            "data.synthetic.pooling_factors=[1, 2]",
        ],
    )
    assert cfg.train.steps == 5  # --set wins over the file
    assert cfg.model.embedding_dim == 8 and cfg.model.bottom_mlp == (32, 8)
    assert cfg.embedding.backend is Backend.TORCH
    assert cfg.data.synthetic.num_embeddings == (10, 20)
    assert cfg.train.batch_size == Config().train.batch_size


def test_config_files_layer_in_order_under_the_overrides(tmp_path):
    data, tiers = tmp_path / "data.toml", tmp_path / "tiers.toml"
    data.write_text(
        "[train]\nsteps = 77\nbatch_size = 64\n[model]\nembedding_dim = 8\nbottom_mlp = [32, 8]\n"
    )
    tiers.write_text("[train]\nsteps = 9\n[embedding]\ncache_fraction = 0.2\n")
    cfg = load_config([data, tiers], ["train.batch_size=32"])
    assert cfg.train.steps == 9  # the later file wins
    assert cfg.model.embedding_dim == 8 and cfg.embedding.cache_fraction == 0.2
    assert cfg.train.batch_size == 32  # --set wins over both
    assert load_config([tiers, data]).train.steps == 77
    assert load_config(str(data)) == load_config([data]) == load_config((data,))
    assert load_config([]) == load_config(None) == Config()
    with pytest.raises(ConfigError, match=r"nope\.toml"):
        load_config([data, tmp_path / "nope.toml"])


def test_config_flag_repeats_on_the_command_line(tmp_path):
    from conftest import run_cli

    data, tiers = tmp_path / "data.toml", tmp_path / "tiers.toml"
    data.write_text("[train]\nsteps = 77\n[model]\nembedding_dim = 8\nbottom_mlp = [32, 8]\n")
    tiers.write_text("[train]\nsteps = 9\n")
    result = run_cli("config", "show", "--config", str(data), "--config", str(tiers))
    assert result.returncode == 0, result.stderr
    shown = tomllib.loads(result.stdout)
    assert shown["train"]["steps"] == 9 and shown["model"]["embedding_dim"] == 8


def test_toml_roundtrip():
    cfg = load_config(None, ["optimizer.lr=0.01", "embedding.optimizer=adagrad"])
    again = config_from_dict(tomllib.loads(config_to_toml(cfg)))
    assert again == cfg


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["train.stepz=3"], r"unknown config key 'train.stepz' \(did you mean 'steps'\?\)"),
        (["trian.steps=3"], r"unknown config key 'trian' \(did you mean 'train'\?\)"),
        (["train.steps=abc"], "train.steps must be an integer, got 'abc'"),
        (["train.steps=0"], "train.steps must be >= 1"),
        (["embedding.backend=cuda_magic"], "embedding.backend = 'cuda_magic' is not one of"),
        (["model.bottom_mlp=[64, 8]"], "must end at model.embedding_dim = 16"),
        (["model.top_mlp=[64, 2]"], "must end in 1"),
        (["optimizer.name=lamb"], "optimizer.name = 'lamb' is not one of 'adam', 'adagrad', 'sgd'"),
        (["train.progress=yes"], "train.progress must be true or false"),
        (["train.steps"], "expected section.key=value"),
        (
            ["data.source=criteo", "data.path=c", "train.steps=100", "train.epochs=2"],
            r"train.steps = 100 and train.epochs = 2 are both set; set one of them",
        ),
        (["train.epochs=0"], "train.epochs must be > 0"),
        (["train.epochs=1"], "'synthetic' is an endless stream; set train.steps instead"),
        (["data.synthetic.ctr=2"], r"ctr must lie in \(0, 1\)"),
        (
            ["data.synthetic.num_embeddings=[5, 6]"],
            r"has 9 entries for 2 tables.*pooling_factors = \[\]",
        ),
    ],
)
def test_bad_keys_and_values(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_example_configs_load():
    from pathlib import Path

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
    assert configs
    for path in configs:
        # A config for a converted cache names its directory on the command line, as its
        # header says (--set data.path=DIR); the rest must load as shipped.
        needs_path = tomllib.loads(path.read_text())["data"].get("source") in ("criteo", "cache")
        load_config(path, ["data.path=cache"] if needs_path else [])


def test_unset_puts_a_key_back_to_its_default_in_order_with_set(tmp_path):
    from towerrec.cli.common import UNSET_MARK
    from towerrec.config.files import UNSET_PREFIX

    assert UNSET_MARK == UNSET_PREFIX  # the CLI's --unset and the loader agree
    layered = tmp_path / "c.toml"
    layered.write_text('[train]\nlog_every = 20\n[embedding.tables.cat_2]\nkind = "qr"\n')
    assert load_config(layered).train.log_every == 20
    default = Config().train.log_every
    assert load_config(layered, ["!train.log_every"]).train.log_every == default
    assert load_config(layered, ["!train.log_every", "train.log_every=3"]).train.log_every == 3
    assert (
        load_config(layered, ["train.log_every=3", "!train.log_every"]).train.log_every == default
    )
    assert load_config(layered, ["!embedding.tables.cat_2"]).embedding.tables == {}
    assert load_config(None, ["!model.dcn.rank"]) == load_config(None)  # unset: nothing to drop
    for text, message in (
        ("!train.epoch", "train has no key 'epoch' (did you mean 'epochs'?)"),
        ("!train.epochs.x", "train.epochs is a value, not a section"),
        ("!", "expected section.key"),
        ("!train.epochs=3", "expected section.key"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(layered, [text])


def test_unset_on_the_command_line(tmp_path):
    from conftest import run_cli

    layered = tmp_path / "c.toml"
    layered.write_text("[train]\nepochs = 20\nbatch_size = 64\n")
    args = ["config", "show", "--config", str(layered), "--set", "train.steps=5"]
    shown = run_cli(*args, "--unset", "train.epochs", "--unset", "train.batch_size")
    assert shown.returncode == 0, shown.stderr
    train = tomllib.loads(shown.stdout)["train"]
    assert "epochs" not in train and train["batch_size"] == Config().train.batch_size
    typo = run_cli(*args, "--unset", "train.epoch")
    assert typo.returncode == 2 and "did you mean 'epochs'" in typo.stderr


def test_resume_config_keeps_the_saved_values_and_refuses_conflicts(tmp_path):
    from towerrec.config import resume_changes

    saved = tmp_path / "config.toml"
    original = load_config(None, ["embedding.lr=0.3", "train.steps=40"])
    saved.write_text(config_to_toml(original))
    same = load_config(None, ["train.log_every=7"], base=saved)
    assert same.embedding.lr == 0.3 and same.train.steps == 40  # the saved run's, not defaults
    assert resume_changes(original, same) == {"train.log_every": {"from": 50, "to": 7}}
    layout = load_config(None, ["plan.strategy=auto", "distributed.sharding=row_wise"], base=saved)
    assert set(resume_changes(original, layout)) == {"plan.strategy", "distributed.sharding"}
    for overrides, key in (
        (["embedding.lr=0.5"], "embedding.lr = 0.5 (the run has 0.3)"),
        (["model.top_mlp=[16, 1]", "train.steps=50"], "model.top_mlp"),
        (["data.loader.seed=3"], "data.loader.seed"),
    ):
        with pytest.raises(ConfigError, match=f"cannot change {re.escape(key)}"):
            resume_changes(original, load_config(None, overrides, base=saved))


# ------------------------------------------------------------------ configs/default.toml
DEFAULT_TOML = Path(__file__).parent.parent / "configs" / "default.toml"


def _dataclass_defaults(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of the config dataclasses under ``cls``, with its default."""
    hints = typing.get_type_hints(cls)
    instance = cls()
    keys: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys.update(_dataclass_defaults(cast(type, hint), f"{prefix}{f.name}."))
        else:
            keys[f"{prefix}{f.name}"] = getattr(instance, f.name)
    return keys


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _commented_keys(text: str) -> set[str]:
    """``section.key`` of each commented-out ``# key = value`` line, and the name of each
    commented-out section header ``# [section.name]``."""
    keys, section = set(), ""
    for line in text.splitlines():
        if header := re.match(r"\[([\w.]+)\]", line):
            section = header.group(1)
        elif header := re.match(r"#\s*\[([\w.]+)\]", line):
            keys.add(header.group(1))
        elif key := re.match(r"#\s*(\w+)\s*=", line):
            keys.add(f"{section}.{key.group(1)}")
    return keys


def _default_toml_problems(text: str) -> list[str]:
    """What keeps ``text`` from being the config reference: keys missing, unknown, unset
    keys not shown as commented lines, values other than the defaults, keys without a
    comment."""
    data = tomllib.loads(text)
    data.pop("for_model", None)  # each model's own defaults: tests/test_config_for_model.py
    written = _flat(data)
    defaults = _dataclass_defaults(Config)
    unset = {key for key, value in defaults.items() if value is None or value == {}}
    commented = _commented_keys(text)
    expected = _flat(config_to_dict(Config()))
    problems = [f"missing {key}" for key in sorted(defaults.keys() - unset - written.keys())]
    problems += [f"unknown {key}" for key in sorted(written.keys() - defaults.keys())]
    problems += [
        f"{key} = {value!r}, the default is {expected[key]!r}"
        for key, value in written.items()
        if key in expected and value != expected[key]
    ]
    problems += [
        f"{key} is unset by default: add it as a commented line"
        for key in sorted(unset)
        if not (key in commented or any(c.startswith(f"{key}.") for c in commented))
    ]
    problems += [
        f"no comment: {line}"
        for line in text.splitlines()
        if re.match(r"\w+\s*=", line) and "#" not in line
    ]
    return problems


def test_default_toml_lists_every_key_with_its_default():
    assert _default_toml_problems(DEFAULT_TOML.read_text()) == []
    assert load_config(DEFAULT_TOML) == Config()  # --config default.toml equals no --config


@pytest.mark.parametrize(
    "old, new, problem",
    [
        ("eval_batch_size = 16384", "", "missing train.eval_batch_size"),
        ("rank = 0 ", "rank = 2 ", "model.dcn.rank = 2, the default is 0"),
        ("[model.dcn]\n", "[model.dcn]\nwidth = 3  # new\n", "unknown model.dcn.width"),
        ("# steps = 2500", "", "train.steps is unset by default"),
        ("# [embedding.tables.cat_2]", "", "embedding.tables is unset by default"),
        ("seed = 0                    # the shuffle", "seed = 0", "no comment: seed = 0"),
    ],
)
def test_default_toml_check_catches_drift(old, new, problem):
    text = DEFAULT_TOML.read_text()
    assert old in text
    assert any(problem in p for p in _default_toml_problems(text.replace(old, new, 1)))


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"train": {"prune_grow": {"mlps": ["top"], "prune_at": [0.2], "grow_at": [0.5]}}},
            "train.prune_grow with optimizer.name = 'pb_lbfgs'",
        ),
        ({"loss": {"kind": "pu_bce", "class_prior": 0.3}}, "loss.kind = 'pu_bce' with optimizer"),
        ({"distributed": {"dense": "fsdp"}}, "distributed.dense = 'fsdp' with optimizer"),
    ],
)
def test_an_optimizer_drawing_its_own_samples_refuses_what_it_cannot_combine(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({"optimizer": {"name": "pb_lbfgs"}, **extra})
