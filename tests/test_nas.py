"""DNAS (towerrec nas): the supernet under a hard one-hot mask is the standalone model
bit for bit; the cost term steers the search; the written configs train; bad spaces fail
clearly."""

import itertools
import json

import pytest
import torch

from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.build.sources import build_source
from towerrec.cli.app import main
from towerrec.config import ConfigError, load_config
from towerrec.config.nas import SearchSpaceKind
from towerrec.train.step import train_step
from towerrec.workflows.nas.search import search
from towerrec.workflows.nas.supernet import build_supernet

SMALL = [
    "data.synthetic.num_embeddings=[600,300,80,40]",
    "data.synthetic.pooling_factors=[1,2,1,3]",
    "data.synthetic.num_dense=5",
    "data.synthetic.eval_samples=512",
    "model.embedding_dim=16",
    "model.bottom_mlp=[32,16]",
    "model.top_mlp=[32,16,1]",
    "train.batch_size=64",
    "train.progress=false",
]
SPACES = {
    "mlp": ["nas.mlp.bottom=[[48,24],[32,8,0]]", "nas.mlp.top=[[64,20],[32,16,0]]"],
    "emb_dim": ["nas.emb_dim.candidates=[4,8,16]", "nas.emb_dim.tables={cat_3=[2,16]}"],
    "emb_card": ["nas.emb_card.candidates=[1,3,8]"],
}


def _config(space, *extra):
    return load_config(None, [*SMALL, f"nas.space={space}", *SPACES[space], *extra])


def _choices(supernet):
    return itertools.product(*(range(len(d)) for d in supernet.decisions))


@pytest.mark.parametrize("space", sorted(SPACES))
def test_a_hard_one_hot_mask_gives_the_standalone_model_bit_for_bit(space):
    """Forward and two training steps (dense Adam; embedding SGD: row-wise Adagrad's row
    statistic would span the full width of the emb_dim supernet's table)."""
    config = _config(space, "embedding.optimizer=sgd", "optimizer.name=adam")
    source = build_source(config.data)
    supernet = build_supernet(config, source.schema, torch.device("cpu"))
    choices = list(_choices(supernet))
    choice = list(choices[len(choices) // 3])  # a mixed one: not all widest, not all least
    supernet.fix(choice)
    arch = supernet.config_for(choice)
    standalone = build_model(arch, source.schema, torch.device("cpu"))
    standalone.load_state_dict(supernet.standalone_state(choice, standalone), strict=True)
    batches = source.train_batches(64)
    first = next(batches)
    assert torch.equal(
        supernet.model(first.dense, first.sparse), standalone(first.dense, first.sparse)
    )
    opt_super = build_dense_optimizer(config.optimizer, supernet.model)
    opt_alone = build_dense_optimizer(arch.optimizer, standalone)
    for batch in (first, next(batches)):
        assert torch.equal(
            train_step(supernet.model, opt_super, batch), train_step(standalone, opt_alone, batch)
        )
    after = supernet.standalone_state(choice, standalone)
    for key, value in standalone.state_dict().items():
        assert torch.equal(after[key], value), key
    # and the mask matters: another choice computes something else
    other = list(choices[-1])
    supernet.fix(other)
    assert not torch.equal(
        supernet.model(first.dense, first.sparse), standalone(first.dense, first.sparse)
    )


@pytest.mark.parametrize("space", sorted(SPACES))
def test_an_extreme_cost_weight_picks_the_cheapest_architecture(space, tmp_path):
    config = _config(
        space,
        "nas.cost_weight=1000",
        "nas.warmup=0",
        "nas.arch_lr=0.2",
        "train.steps=15",
        "nas.samples=2",
    )
    report = search(config, tmp_path / "out", progress=False)
    supernet = build_supernet(config, build_source(config.data).schema, torch.device("cpu"))
    cheapest = min(supernet.cost_of(c) for c in _choices(supernet))
    best = report["architectures"][0]
    assert best["cost"] == cheapest
    assert report["history"][-1]["expected_cost"] < report["history"][0]["expected_cost"]


def test_without_a_cost_weight_the_search_keeps_costlier_choices(tmp_path):
    """The control of the test above: the cost term, not the loss, made the choice."""
    config = _config(
        "emb_dim", "nas.cost_weight=0", "nas.warmup=0", "nas.arch_lr=0.2", "train.steps=15"
    )
    report = search(config, tmp_path / "out", progress=False)
    supernet = build_supernet(config, build_source(config.data).schema, torch.device("cpu"))
    cheapest = min(supernet.cost_of(c) for c in _choices(supernet))
    assert report["architectures"][0]["cost"] > cheapest


@pytest.mark.parametrize("space", sorted(SPACES))
def test_the_written_config_loads_and_trains(space, tmp_path):
    out = tmp_path / "search"
    sets = [*SMALL, *SPACES[space], "train.steps=6", "nas.samples=2"]
    args = [
        "nas",
        "search",
        "--space",
        space,
        "--out",
        str(out),
        *(x for s in sets for x in ("--set", s)),
    ]
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert [a["file"] for a in report["architectures"]] == ["arch-0.toml", "arch-1.toml"]
    assert len(report["history"]) >= 2 and report["history"][0]["step"] == 0
    assert (out / "report.png").stat().st_size > 0
    for arch in report["architectures"]:  # each sample's cost is its standalone model's
        config = load_config(out / arch["file"], [])
        source = build_source(config.data)
        model = build_model(config, source.schema, torch.device("cpu"))
        if space == "mlp":
            measured = model.bottom.flops_per_sample() + model.top.flops_per_sample()
        else:
            measured = model.sparse.num_embedding_parameters
        assert measured == arch["cost"], arch
    run = tmp_path / "run"
    assert (
        main(
            [
                "nas",
                "retrain",
                str(out / "arch-0.toml"),
                "--set",
                "train.steps=3",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert (
        main(
            [
                "train",
                "--config",
                str(out / "arch-1.toml"),
                "--set",
                "train.steps=2",
                "--out",
                str(tmp_path / "t"),
            ]
        )
        == 0
    )


@pytest.mark.slow
def test_emb_dim_search_on_movielens_and_mlp_search_on_criteo_files(tmp_path):
    """The real sources: the bundled MovieLens (emb_dim) and a Criteo-format cache (mlp)."""
    movielens = [
        "--config",
        "configs/movielens.toml",
        "--set",
        "train.steps=8",
        "--set",
        "train.progress=false",
    ]
    assert (
        main(["nas", "search", "--space", "emb_dim", "--out", str(tmp_path / "ml"), *movielens])
        == 0
    )
    assert main(["nas", "retrain", str(tmp_path / "ml" / "arch-0.toml"), "--set", "train.steps=4",
                 "--out", str(tmp_path / "ml-run")]) == 0  # fmt: skip
    raw, cache = tmp_path / "raw", tmp_path / "cache"
    assert main(["data", "gen-criteo", "--out", str(raw), "--files", "2", "--rows", "1500"]) == 0
    assert main(["data", "criteo", str(raw / "day_0"), str(raw / "day_1"), "--out", str(cache),
                 "--validation-files", "day_1", "--num-embeddings", "300", "--no-progress"]) == 0  # fmt: skip
    criteo = ["--config", "configs/criteo.toml", "--set", f"data.path={cache}", "--set", "train.batch_size=256",
              "--set", "nas.epochs=1",
              "--set", "nas.mlp.top=[[64,16],[32,0]]", "--set", "train.progress=false"]  # fmt: skip
    assert main(["nas", "search", "--space", "mlp", "--out", str(tmp_path / "cr"), *criteo]) == 0
    assert main(["nas", "retrain", str(tmp_path / "cr" / "arch-0.toml"), "--set", "train.epochs=0.5",
                 "--out", str(tmp_path / "cr-run")]) == 0  # fmt: skip


# ---------------------------------------------------------------------- bad input
def test_a_space_naming_an_unknown_table_is_refused():
    config = load_config(None, [*SMALL, "nas.space=emb_dim", "nas.emb_dim.tables={user=[4,8]}"])
    with pytest.raises(ValueError, match=r"nas.emb_dim.tables names \['user'\].*cat_0, cat_1"):
        build_supernet(config, build_source(config.data).schema, torch.device("cpu"))
    config = load_config(None, [*SMALL, "nas.space=emb_card", "nas.emb_card.tables={nope=[2]}"])
    with pytest.raises(ValueError, match=r"nas.emb_card.tables names \['nope'\]"):
        build_supernet(config, build_source(config.data).schema, torch.device("cpu"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("nas.emb_dim.candidates=[]", "nas.emb_dim.candidates is an empty candidate list"),
        ("nas.emb_dim.tables={cat_0=[]}", "nas.emb_dim.tables.cat_0 is an empty candidate list"),
        ("nas.mlp.top=[[64,32],[]]", r"nas.mlp.top\[1\] is an empty candidate list"),
        ("nas.emb_card.candidates=[0.5,2]", "has candidates below 1"),
        ("nas.emb_dim.candidates=[8,8]", "repeats a candidate"),
    ],
)
def test_bad_candidate_lists_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_candidates_wider_than_the_table_and_other_backbones_are_refused():
    config = load_config(None, [*SMALL, "nas.space=emb_dim", "nas.emb_dim.candidates=[8,32]"])
    with pytest.raises(ValueError, match=r"exceed model\.embedding_dim = 16"):
        build_supernet(config, build_source(config.data).schema, torch.device("cpu"))
    config = load_config(None, [*SMALL, "model.name=dcn"])
    with pytest.raises(ValueError, match=r"set model\.name = 'dlrm'"):
        build_supernet(config, build_source(config.data).schema, torch.device("cpu"))
    config = load_config(None, [*SMALL, "nas.space=mlp", "nas.mlp.top=[[0],[16]]"])
    with pytest.raises(ValueError, match="every candidate skips the layer"):
        build_supernet(config, build_source(config.data).schema, torch.device("cpu"))


# ------------------------------------------------------- embedding.tables.<t>.dim
def test_a_per_table_dim_stores_the_table_narrower_and_projects_it():
    config = load_config(None, [*SMALL, "embedding.tables={cat_0={dim=4}}"])
    source = build_source(config.data)
    model = build_model(config, source.schema, torch.device("cpu"))
    full = build_model(load_config(None, SMALL), source.schema, torch.device("cpu"))
    assert (
        full.sparse.num_embedding_parameters - model.sparse.num_embedding_parameters
        == 600 * 16 - (600 * 4 + 4 * 16)
    )
    batch = next(source.train_batches(8))
    assert model(batch.dense, batch.sparse).shape == (8,)
    with pytest.raises(ValueError, match="wider than the model's embedding_dim 16"):
        build_model(
            load_config(None, [*SMALL, "embedding.tables={cat_0={dim=32}}"]),
            source.schema,
            torch.device("cpu"),
        )
    with pytest.raises(ConfigError, match="sets dim, which a 'hash' table does not use"):
        load_config(None, ["embedding.tables={cat_0={kind='hash',dim=4}}"])


def test_bench_nas_refuses_an_unknown_space_before_training():
    import argparse

    from towerrec.bench import nas as bench_nas

    assert set(bench_nas.SPACES) == {space.value for space in SearchSpaceKind}
    with pytest.raises(ValueError, match=r"--spaces emb_rows: unknown; choose from emb_dim"):
        bench_nas.run(argparse.Namespace(spaces=("emb_card", "emb_rows")))
