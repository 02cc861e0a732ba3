import re
import tomllib

import pytest

from towerrec.config import Config, ConfigError, config_from_dict, config_to_toml, load_config
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
        load_config(path)


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
