"""``towerrec bench quality``: the JSON of a tiny run, the references' independence from
towerrec, their recipes (row-wise Adagrad, early stopping, the selection rules), their
architectures against towerrec's, and the synthetic data set's cache."""

import ast
import inspect
import json
import types

import numpy as np
import pytest
import torch
from conftest import run_cli

from towerrec.bench import quality_models, quality_reference
from towerrec.bench.quality import _architecture, _best_of_each, _reference_architecture
from towerrec.bench.quality_data import (
    movielens_overrides,
    plain_data,
    raw_units,
    unseen_id_rows,
    write_synthetic_cache,
)
from towerrec.bench.quality_models import Architecture, Bag, PlainData, build_reference_model
from towerrec.bench.quality_reference import (
    RECIPES,
    RowwiseAdagrad,
    selections,
    train_reference,
    with_overrides,
)
from towerrec.build.models import build_model
from towerrec.build.sources import build_source
from towerrec.config import load_config
from towerrec.data.synthetic import SyntheticSource


def test_tiny_run_json(tmp_path):
    result = run_cli(
        "bench", "quality", "--json", "--datasets", "criteo", "--models", "dlrm",
        "--seeds", "1", "--epochs", "2", "--criteo-files", "1", "--criteo-rows", "3000",
        "--criteo-num-embeddings", "500", "--data-dir", str(tmp_path),
        "--set", "train.batch_size=256", "--set", "train.epochs=2",
        "--unset", "optimizer.warmup_steps",
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)  # stdout holds nothing but the JSON
    # progress on stderr: each side's seed and epoch as it ends
    for side in ("towerrec", "fuxictr", "torchrec"):
        line = f"bench quality: criteo dlrm {side} seed 1/1, epoch 1: validation AUC 0."
        assert line in result.stderr, result.stderr[-3000:]
    assert "!optimizer.warmup_steps" in out["datasets"]["criteo"]["overrides"]  # --unset
    assert out["benchmark"] == "quality" and out["seeds"] == 1
    assert set(out["recipes"]) == {"fuxictr", "torchrec"}
    criteo = out["datasets"]["criteo"]
    assert criteo["batch_size"] == 256 and criteo["test_split"] == "test"
    assert criteo["train_rows"] + criteo["validation_rows"] + criteo["test_rows"] == 3000
    model = criteo["models"]["dlrm"]
    for side in ("towerrec", "fuxictr", "torchrec"):
        stats = model[side]
        (run,) = stats["per_seed"]
        assert run["seed"] == 0 and 1 <= run["epochs_trained"] <= 2
        for rule in ("by_logloss", "by_auc"):
            assert 0 <= stats[rule]["auc"] <= 1 and stats[rule]["logloss"] > 0
            assert stats[rule]["auc_std"] == 0
            epoch = run["selected"][rule[3:]]["epoch"]
            chosen = run["epochs"][epoch - 1]
            assert stats[rule]["auc"] == pytest.approx(chosen["test"]["auc"], abs=1e-5)
    assert len(model["towerrec"]["per_seed"][0]["epochs"]) == 2  # a validation each epoch
    # each reference at its recipe's own widths (the default), towerrec at its config's
    assert out["reference_widths"] == "published" and out["reference_dim"] is None
    dim = model["towerrec"]["bottom_mlp"][-1]
    assert {model[s]["embedding_dim"] for s in ("towerrec", *RECIPES)} == {dim}
    assert criteo["dnn"]["embedding_dim"] == dim
    assert model["fuxictr"]["top_mlp"] == [400, 400, 400, 1]
    assert model["fuxictr"]["bottom_mlp"] == model["towerrec"]["bottom_mlp"]
    assert model["torchrec"]["bottom_mlp"] == [512, 256, 64, dim]
    assert model["torchrec"]["top_mlp"] == [512, 256, 1]
    # the dense parameters follow the widths (the criteo recipe's top is FuxiCTR's too)
    sides = ("towerrec", "fuxictr", "torchrec")
    widths = {s: (tuple(model[s]["bottom_mlp"]), tuple(model[s]["top_mlp"])) for s in sides}
    params = {s: model[s]["num_dense_params"] for s in sides}
    assert min(params.values()) > 0
    for a in sides:
        for b in sides:
            assert (params[a] == params[b]) == (widths[a] == widths[b]), (widths, params)
    for rule in ("by_logloss", "by_auc"):
        verdict = model["verdict"][rule]
        best = verdict["better_reference"]
        assert model[best][rule]["auc"] == max(model[r][rule]["auc"] for r in RECIPES)
        diff = model["towerrec"][rule]["auc"] - model[best][rule]["auc"]
        assert verdict["auc_towerrec_minus_better_reference"] == pytest.approx(diff, abs=1e-5)
    # the plain DNN: the raw dense features and the embeddings into FuxiCTR's top MLP
    dnn = criteo["dnn"]
    assert dnn["recipe"] == "fuxictr" and dnn["bottom_mlp"] == []
    assert dnn["top_mlp"] == [400, 400, 400, 1]
    (run,) = dnn["per_seed"]
    assert 1 <= run["epochs_trained"] <= 2 and 0 <= dnn["by_auc"]["auc"] <= 1
    # towerrec's best model against the best plain one, both chosen by validation
    plain = {f"dlrm {r}": model[r] for r in RECIPES} | {"dnn fuxictr": dnn}
    for rule in ("by_logloss", "by_auc"):
        best = criteo["best_of_each"][rule]
        assert best["towerrec"]["model"] == "dlrm"
        sign = 1 if rule == "by_auc" else -1
        metric = f"validation_{rule[3:]}"
        chosen = max(plain, key=lambda name: sign * plain[name][rule][metric])
        assert best["plain"]["model"] == chosen
        diff = model["towerrec"][rule]["auc"] - plain[chosen][rule]["auc"]
        assert best["auc_towerrec_minus_plain"] == pytest.approx(diff, abs=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--datasets", "frappe"], "name another with --data NAME=PATH"),
        (["--data", "frappe"], "--data takes NAME=PATH"),
        (["--datasets", "frappe", "--data", "frappe=/nonexistent"], "neither a cache directory"),
        (["--datasets", "criteo", "--config", "movielens=configs/movielens.toml"], "not among"),
        (["--recipes", "keras"], "--recipes takes some of fuxictr, torchrec"),
        (["--reference-widths", "mine"], "invalid choice: 'mine'"),
        (["--reference-dim", "0"], "--reference-dim must be >= 1"),
    ],
)
def test_bad_arguments_are_refused(args, message):
    result = run_cli("bench", "quality", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def _imports(module) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


@pytest.mark.parametrize("module", [quality_models, quality_reference])
def test_references_import_nothing_from_towerrec(module):
    allowed = {quality_models.__name__}  # the reference trains the plain models
    imported = _imports(module)
    assert imported and not any(
        name.startswith("towerrec") and name not in allowed for name in imported
    ), imported
    for name, value in vars(module).items():  # nor a towerrec object in its globals
        if isinstance(value, types.ModuleType):
            owner = value.__name__
        else:
            owner = getattr(value, "__module__", None)
        if isinstance(owner, str) and owner not in (module.__name__, *allowed):
            assert not owner.startswith("towerrec"), (name, owner)


def test_selection_rules_pick_the_best_validation_epoch_of_each_metric():
    history = [
        {"epoch": 1, "validation": {"auc": 0.70, "logloss": 0.50}, "test": {}},
        {"epoch": 2, "validation": {"auc": 0.72, "logloss": 0.49}, "test": {}},
        {"epoch": 3, "validation": {"auc": 0.73, "logloss": 0.51}, "test": {}},
    ]
    chosen = selections(history)
    assert chosen["logloss"]["epoch"] == 2 and chosen["auc"]["epoch"] == 3


def _stats(test_auc: float, validation_auc: float, validation_logloss: float) -> dict:
    record = {
        "auc": test_auc,
        "auc_std": 0.001,
        "validation_auc": validation_auc,
        "validation_logloss": validation_logloss,
    }
    return {"by_auc": record, "by_logloss": record}


def test_best_of_each_chooses_each_side_s_model_by_validation_not_test():
    """Each side's best model is the one a user would keep, by validation; the DNN counts
    among the plain models. A higher test AUC behind a worse validation is not chosen."""
    result = {
        "models": {
            "dlrm": {
                "towerrec": _stats(0.70, 0.72, 0.45),
                "fuxictr": _stats(0.69, 0.71, 0.46),
                "verdict": {},
            },
            "dcn": {
                "towerrec": _stats(0.75, 0.71, 0.44),  # best test, worse validation AUC
                "fuxictr": _stats(0.68, 0.70, 0.47),
                "verdict": {},
            },
        },
        "dnn": _stats(0.71, 0.73, 0.48),
    }
    best = _best_of_each(result)
    by_auc, by_logloss = best["by_auc"], best["by_logloss"]
    assert by_auc["towerrec"]["model"] == "dlrm" and by_auc["plain"]["model"] == "dnn fuxictr"
    assert by_auc["auc_towerrec_minus_plain"] == pytest.approx(0.70 - 0.71)
    assert by_auc["towerrec_within_one_std_or_above"] is False  # -0.01 < -0.001
    # by log-loss the lowest validation log-loss wins on each side
    assert by_logloss["towerrec"]["model"] == "dcn"
    assert by_logloss["plain"]["model"] == "dlrm fuxictr"
    assert by_logloss["auc_towerrec_minus_plain"] == pytest.approx(0.75 - 0.69)
    assert by_logloss["towerrec_within_one_std_or_above"] is True
    # without plain models (--no-dnn, no recipes) only towerrec's choice is reported
    alone = _best_of_each({"models": {"dlrm": {"towerrec": _stats(0.7, 0.7, 0.5)}}})
    assert set(alone["by_auc"]) == {"towerrec"}


def test_rowwise_adagrad_follows_its_formula():
    weight = torch.nn.Parameter(torch.arange(12.0).view(4, 3))
    opt = RowwiseAdagrad([weight], lr=0.1, eps=1e-8)
    grad = torch.tensor([[1.0, 2.0, 2.0], [0.5, 0.5, 1.0]])
    before = weight.detach().clone()
    for _ in range(2):  # rows 1 and 3, twice
        weight.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), grad, (4, 3))
        opt.step()
    expected = before.clone()
    total = torch.zeros(4)
    for _ in range(2):
        for row, g in zip((1, 3), grad):
            total[row] += g.pow(2).mean()
            expected[row] -= 0.1 * g / (total[row].sqrt() + 1e-8)
    torch.testing.assert_close(weight.detach(), expected)
    assert torch.equal(weight.detach()[[0, 2]], before[[0, 2]])  # untouched rows stay


def _planted(rows: int, seed: int) -> PlainData:
    """Click iff feature 0's id is even or the first dense feature is large."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (rows,), generator=g)
    other = torch.randint(0, 50, (rows * 2,), generator=g)  # a 2-hot noise feature
    dense = torch.randn(rows, 3, generator=g)
    labels = ((ids % 2 == 0) ^ (dense[:, 0] > 1.0)).float()
    return PlainData(
        dense,
        labels,
        (
            Bag(ids, torch.arange(rows + 1), 100),
            Bag(other, torch.arange(0, 2 * rows + 1, 2), 50),
        ),
    )


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("model", ["dlrm", "dcn", "wukong", "dnn"])
def test_each_recipe_learns_a_plain_signal(model, recipe, one_thread):
    arch = Architecture(model, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(32, 16, 1))
    result = train_reference(
        arch,
        _planted(6000, 0),
        _planted(2000, 1),
        _planted(2000, 2),
        recipe=RECIPES[recipe],
        epochs=4,
        batch_size=128,
        seed=0,
    )
    best = selections(result.epochs)["auc"]
    assert best["test"]["auc"] > 0.9, result.epochs


def test_fuxictr_s_recipe_with_adam_on_the_looked_up_rows_only_learns_the_signal(one_thread):
    """``sparse_adam``: Adam over the rows a batch looks up (as towerrec's and FBGEMM's row
    kernels), the recipe's L2 on rows refused with it (its gradient would be dense)."""
    with pytest.raises(ValueError, match="sparse_adam takes sparse gradients only"):
        with_overrides(RECIPES["fuxictr"], embedding_optimizer="sparse_adam")
    recipe = with_overrides(RECIPES["fuxictr"], embedding_optimizer="sparse_adam", embedding_l2=0.0)
    arch = Architecture("dnn", embedding_dim=8, bottom_mlp=(), top_mlp=(32, 16, 1))
    result = train_reference(
        arch, _planted(6000, 0), _planted(2000, 1), None, recipe=recipe, epochs=4,
        batch_size=128, seed=0,
    )  # fmt: skip
    assert selections(result.epochs)["auc"]["test"]["auc"] > 0.9, result.epochs


def test_early_stopping_stops_after_patience_epochs_without_improvement(one_thread):
    """A learning rate of 0 never improves after the first epoch: the run stops after
    1 + patience epochs, its choice the first."""
    arch = Architecture("dlrm", embedding_dim=4, bottom_mlp=(4,), top_mlp=(4, 1))
    frozen = with_overrides(RECIPES["torchrec"], dense_lr=0.0, embedding_lr=0.0, patience=2)
    data = _planted(500, 0)
    result = train_reference(
        arch, data, data, None, recipe=frozen, epochs=10, batch_size=100, seed=0
    )
    assert result.stopped_epoch == 3 and result.best_epoch == 1
    assert result.epochs[0]["test"] == result.epochs[0]["validation"]  # no test split


def _small_config(num_dense: int, *overrides: str):
    bottom = [] if num_dense == 0 else [32, 16]
    return load_config(
        None,
        [
            "data.synthetic.num_embeddings=[30,20,10]",
            "data.synthetic.pooling_factors=[]",
            f"data.synthetic.num_dense={num_dense}",
            f"model.bottom_mlp={bottom}",
            *overrides,
        ],
    )


def _dense_parameters(config, arch: Architecture, num_dense: int) -> tuple[int, int]:
    """towerrec's model of ``config`` and the reference model of ``arch``: their dense
    parameters."""
    schema = SyntheticSource(config.data.synthetic).schema
    towerrec = build_model(config, schema, torch.device("cpu"))
    sizes = [f.num_embeddings for f in schema.sparse]
    reference = build_reference_model(arch, num_dense, sizes)
    ours = sum(p.numel() for n, p in reference.named_parameters() if not n.startswith("tables."))
    return towerrec.num_dense_parameters(), ours


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.name=dlrm", "model.concat_embeddings=true", "model.self_interaction=true"],
        ["model.name=dlrm", "model.dropout=0.2", "model.batch_norm=true"],
        ["model.name=dcn", "model.dcn.rank=4"],
        ["model.name=dcn", "model.bottom_mlp=[]"],  # the dense features as they are
        ["model.name=dcn", "model.dcn.num_layers=0", "model.bottom_mlp=[]"],
        ["model.name=wukong", "model.wukong.num_fm=0"],
        ["model.name=wukong", "model.dropout=0.1", "model.wukong.fm_mlp=[32,16]"],
    ],
)
@pytest.mark.parametrize("num_dense", [13, 0])
def test_reference_architecture_has_towerrec_s_dense_parameters(overrides, num_dense):
    config = _small_config(num_dense, *overrides)
    towerrec, reference = _dense_parameters(config, _architecture(config), num_dense)
    assert reference == towerrec


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("num_dense", [13, 0])
@pytest.mark.parametrize("dim", [None, 24])
def test_a_reference_at_its_own_widths_has_towerrec_s_parameters_at_those_widths(
    recipe, num_dense, dim
):
    """``--reference-widths published`` (the default) changes the MLPs' widths and nothing
    else: towerrec's model at the recipe's widths has the reference's dense parameters;
    ``config`` keeps towerrec's widths. ``--reference-dim`` changes the embedding dim and
    the bottom MLP's last width with it."""
    config = _small_config(num_dense)
    if dim is None:
        assert _reference_architecture(config, RECIPES[recipe], "config") == _architecture(config)
    arch = _reference_architecture(config, RECIPES[recipe], "published", dim)
    assert arch != _architecture(config)
    assert arch.top_mlp == RECIPES[recipe].top_mlp
    assert arch.embedding_dim == (dim or config.model.embedding_dim)
    if num_dense == 0:
        assert arch.bottom_mlp == ()
    else:
        assert arch.bottom_mlp[-1] == arch.embedding_dim
    widths = _small_config(
        num_dense,
        f"model.embedding_dim={arch.embedding_dim}",
        f"model.bottom_mlp={list(arch.bottom_mlp)}",
        f"model.top_mlp={list(arch.top_mlp)}",
    )
    towerrec, reference = _dense_parameters(widths, arch, num_dense)
    assert reference == towerrec


@pytest.mark.parametrize("num_dense", [13, 0])
def test_the_plain_dnn_is_towerrec_s_dcn_without_cross_layers_or_bottom_mlp(num_dense):
    config = _small_config(
        num_dense, "model.name=dcn", "model.dcn.num_layers=0", "model.bottom_mlp=[]"
    )
    arch = Architecture("dnn", config.model.embedding_dim, (), tuple(config.model.top_mlp))
    towerrec, reference = _dense_parameters(config, arch, num_dense)
    assert reference == towerrec


@pytest.mark.parametrize("model", ["dlrm", "wukong"])
def test_a_reference_whose_interaction_needs_a_dense_vector_refuses_raw_dense(model):
    arch = Architecture(model, embedding_dim=8, bottom_mlp=(), top_mlp=(4, 1))
    with pytest.raises(ValueError, match="3 dense features need a bottom MLP"):
        build_reference_model(arch, 3, [10, 20])


def test_synthetic_cache_holds_the_stream_s_rows(tmp_path):
    config = load_config(
        None, ["data.synthetic.num_embeddings=[30,20,10]", "data.synthetic.pooling_factors=[1,1,3]"]
    )
    write_synthetic_cache(config, tmp_path, train_rows=300, held_out_rows=100)
    at = ["data.source=cache", f"data.path={json.dumps(str(tmp_path))}"]
    cached = load_config(None, at)
    train, valid, test = plain_data(cached)
    assert (train.rows, valid.rows, test.rows) == (300, 100, 100)
    source = SyntheticSource(config.data.synthetic)
    stream = source.samples("train", 0, 400)[0]
    as_held = load_config(None, [*at, "data.loader.dense=none"])
    in_order = build_source(as_held.data).gather_train(np.arange(300))  # plain_data shuffles
    np.testing.assert_array_equal(in_order.labels.numpy(), stream.labels[:300].numpy())
    np.testing.assert_array_equal(in_order.dense.numpy(), stream.dense[:300].numpy())
    # the plain references standardise the dense columns by the training rows' statistics
    first = stream.dense[:300].double()
    scaled = (stream.dense[300:] - first.mean(0).float()) / first.std(0, unbiased=False).float()
    np.testing.assert_allclose(test.dense.numpy(), scaled.numpy(), rtol=1e-5, atol=1e-6)
    multi = stream.sparse.to_dict()["cat_2"]
    assert torch.equal(test.bags[2].values, multi.values[int(multi.offsets()[300]) :].long())
    held_out = source.samples("eval", 0, 100)[0]
    np.testing.assert_array_equal(valid.labels.numpy(), held_out.labels.numpy())


@pytest.mark.parametrize(
    ("sizes", "num_dense", "recipe", "no_bottom"),
    [
        ([60_000, 30], 0, "criteo", True),  # large vocabulary, no dense features
        ([60_000, 30], 2, "criteo", False),
        ([300, 30], 0, "context", False),  # the context recipe has no bottom MLP
        ([300, 30], 2, None, False),  # small tables with dense features: the defaults
    ],
)
def test_a_data_cache_trains_with_the_recipe_its_converter_prints(
    tmp_path, sizes, num_dense, recipe, no_bottom
):
    """towerrec's side of a ``--data`` cache: the config ``towerrec data`` prints for it
    (``recipe_for_cache``), without the bottom MLP where the cache has no dense features;
    a ``--config`` for it, or a recipe of its name, still wins."""
    from towerrec.bench.quality import QualitySettings, _data_set
    from towerrec.config.recipes import recipe_path
    from towerrec.data.cache import CacheError, write_manifest

    sparse = [
        {"name": f"f{i}", "num_embeddings": n, "pooling_factor": 1.0, "multi_hot": False}
        for i, n in enumerate(sizes)
    ]
    schema = {"num_dense": num_dense, "sparse": sparse}
    rows = {"train": 100_000}  # many lookups a table row
    write_manifest(tmp_path, {"schema": schema, "parts": [], "rows": rows})
    settings = QualitySettings(datasets=("mine",), data={"mine": tmp_path})
    expected = recipe_path(recipe) if recipe else None
    assert settings.config_of("mine") == expected
    data = _data_set("mine", settings, tmp_path)
    assert data.config == expected
    assert ("model.bottom_mlp=[]" in data.overrides) is no_bottom
    assert list(data.load().model.bottom_mlp) == (
        [] if no_bottom or recipe == "context" else [64, 16]
    )
    mine = {"mine": tmp_path}
    chosen = QualitySettings(datasets=("mine",), data=mine, configs={"mine": tmp_path})
    assert chosen.config_of("mine") == tmp_path
    named = QualitySettings(datasets=("context",), data={"context": tmp_path})
    assert named.config_of("context") == recipe_path("context")
    # a damaged manifest is refused as the loader refuses it, not read as it is
    manifest = tmp_path / "manifest.json"
    manifest.write_text(manifest.read_text().replace(str(sizes[0]), str(sizes[0] + 1), 1))
    with pytest.raises(CacheError, match="damaged"):
        settings.config_of("mine")


def test_the_large_vocabulary_planted_data_trains_with_the_recipe_its_cache_gets(tmp_path):
    """``synthetic-large``: the planted stream with ``LARGE_TABLES`` written to a cache;
    towerrec's side is the recipe a converter prints for it (``criteo``), the data the same
    stream as ``synthetic`` but for the tables' sizes (whose 12,000 rows are enough lookups
    a table row for the defaults)."""
    from towerrec.bench.quality import QualitySettings, _data_set
    from towerrec.bench.quality_data import LARGE_TABLES
    from towerrec.config.recipes import recipe_path

    settings = QualitySettings(
        datasets=("synthetic", "synthetic-large"), synthetic_rows=12_000, synthetic_held_out=100
    )
    large = _data_set("synthetic-large", settings, tmp_path)
    small = _data_set("synthetic", settings, tmp_path)
    assert large.config == recipe_path("criteo") and small.config is None
    sizes = {
        name: [f.num_embeddings for f in build_source(data.load().data).schema.sparse]
        for name, data in (("large", large), ("small", small))
    }
    assert sizes["large"] == list(LARGE_TABLES)
    assert max(sizes["small"]) < min(LARGE_TABLES)
    train, _, test = plain_data(large.load())
    assert (train.rows, test.rows) == (12_000, 100) and train.dense.shape[1] == 13
    config = load_config(recipe_path("criteo"), list(large.overrides))
    assert large.load().train.batch_size == config.train.batch_size  # the recipe's own
    assert large.load().model.bottom_mlp == config.model.bottom_mlp  # dense features kept


def test_synthetic_raw_holds_the_dense_columns_in_units_of_their_own(tmp_path):
    config = load_config(
        None, ["data.synthetic.num_embeddings=[30,20,10]", "data.synthetic.pooling_factors=[]"]
    )
    write_synthetic_cache(config, tmp_path, train_rows=200, held_out_rows=50, raw=True)
    at = ["data.source=cache", f"data.path={json.dumps(str(tmp_path))}"]
    held = build_source(load_config(None, [*at, "data.loader.dense=none"]).data)
    stream = SyntheticSource(config.data.synthetic).samples("train", 0, 200)[0]
    dense = held.gather_train(np.arange(200)).dense.numpy()
    np.testing.assert_array_equal(dense, raw_units(stream.dense.numpy()))
    assert dense.min() > 0 and dense[:, -1].mean() > 100 * dense[:, 0].mean()
    # towerrec's loader reads them standardised, the skewed amounts logged first
    source = build_source(load_config(None, at).data)
    assert source.dense_transform is not None and all(source.dense_transform.log)


def test_unseen_id_rows_against_python_sets():
    """The share of held-out rows with an id absent from training, per feature, against
    sets: one-hot, multi-hot with empty bags, and a feature whose every id was seen."""
    gen = np.random.default_rng(0)

    def data(rows, names_sizes):
        bags, lists = [], {}
        for name, size in names_sizes:
            lengths = gen.integers(0, 3, rows) if name == "multi" else np.ones(rows, int)
            values = gen.integers(0, size, int(lengths.sum()))
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            bags.append(Bag(torch.from_numpy(values), torch.from_numpy(offsets), size, name))
            lists[name] = [values[offsets[i] : offsets[i + 1]].tolist() for i in range(rows)]
        return PlainData(torch.zeros(rows, 0), torch.zeros(rows), tuple(bags)), lists

    features = [("one", 500), ("multi", 300), ("small", 4)]
    train, train_lists = data(200, features)
    held, held_lists = data(150, features)
    got = unseen_id_rows(train, held)
    for name, _ in features:
        seen = {i for ids in train_lists[name] for i in ids}
        expected = np.mean([any(i not in seen for i in ids) for ids in held_lists[name]])
        assert got[name] == round(float(expected), 4), name
    assert 0 < got["one"] < 1 and 0 < got["multi"] < 1 and got["small"] == 0.0


def test_fuxictr_rows_on_sparse_adam():
    """``--fuxictr-embedding-optimizer sparse_adam``: the looked-up rows alone, and
    without the L2 (it needs dense gradients) unless one is asked, which is refused."""
    import argparse

    from towerrec.bench.quality import _add_arguments, _recipes

    parser = argparse.ArgumentParser()
    _add_arguments(parser)
    (fuxictr,) = _recipes(parser.parse_args(["--recipes", "fuxictr"]))
    assert (fuxictr.embedding_optimizer, fuxictr.embedding_l2) == ("adam", 1e-6)
    args = ["--recipes", "fuxictr", "--fuxictr-embedding-optimizer", "sparse_adam"]
    (lazy,) = _recipes(parser.parse_args(args))
    assert (lazy.embedding_optimizer, lazy.embedding_l2) == ("sparse_adam", 0.0)
    with pytest.raises(ValueError, match="sparse_adam takes sparse gradients only"):
        _recipes(parser.parse_args([*args, "--fuxictr-l2", "1e-6"]))


def test_towerrec_side_runs_at_the_references_threads(monkeypatch, tmp_path):
    """towerrec's runs take ``--threads`` as the references do (not the machine's cores),
    so that their bits do not depend on the machine."""
    from towerrec.bench import quality

    seen = {}

    def fake_train(config, out, hooks):
        seen["threads"] = config.train.threads
        return {"num_dense_params": 1}

    monkeypatch.setattr(quality, "train", fake_train)
    overrides = list(movielens_overrides(None, ""))
    config = load_config(None, overrides)
    quality._towerrec_run(config, 1000, 0, tmp_path, "label", 3)
    assert seen["threads"] == 3
