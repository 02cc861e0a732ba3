"""Data without dense features (libFM, ``data.synthetic.num_dense = 0``): no bottom MLP,
the interaction over the embeddings alone; and DLRM's ``model.concat_embeddings``."""

import json
import random

import pytest
import torch
from conftest import run_cli as towerrec
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from towerrec.build.models import build_model
from towerrec.config import load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.models.dlrm import DLRM
from towerrec.models.dmt import DMT
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.tables import TableConfig
from towerrec.sparse import KeyedJaggedTensor

MODELS = ("dlrm", "dcn", "wukong", "dmt")
NO_DENSE = [
    "data.synthetic.num_dense=0",
    "data.synthetic.num_embeddings=[20, 30, 40]",
    "data.synthetic.pooling_factors=[]",
    "data.synthetic.eval_samples=256",
    "embedding.backend=torch",
    "model.bottom_mlp=[]",
    "model.dmt.partition=contiguous",
]
QUICK = [
    "train.steps=4",
    "train.batch_size=128",
    "train.eval_every=0",
    "train.log_every=2",
    "train.progress=false",
    "optimizer.warmup_steps=2",
    "model.dmt.pilot_steps=3",  # the DMT's default partition learns from a DLRM pilot
]


def sets(*overrides):
    return [x for s in overrides for x in ("--set", s)]


@pytest.fixture(scope="module")
def libfm_cache(tmp_path_factory):
    """A small libFM cache: three categorical fields, no dense features."""
    root = tmp_path_factory.mktemp("libfm")
    rng = random.Random(0)
    lines = []
    for _ in range(1500):
        user, item, ctx = rng.randrange(50), rng.randrange(50, 150), rng.randrange(150, 160)
        label = int((user + item) % 3 == 0 or rng.random() < 0.1)
        lines.append(f"{label} {user}:1 {item}:1 {ctx}:1")
    (root / "train.libfm").write_text("\n".join(lines) + "\n")
    (root / "fields.txt").write_text("user 0 49\nitem 50 149\nctx 150 159 multi\n")
    cache = root / "cache"
    result = towerrec(
        "data",
        "libfm",
        *map(str, (root / "train.libfm",)),
        "--fields",
        str(root / "fields.txt"),
        "--out",
        str(cache),
    )
    assert result.returncode == 0, result.stderr
    assert "--set 'model.bottom_mlp=[]'" in result.stdout  # the printed train command
    return cache


@pytest.mark.parametrize("name", MODELS)
def test_every_model_trains_on_libfm_data_without_warnings(name, libfm_cache, tmp_path):
    out = tmp_path / "run"
    result = towerrec(
        "train",
        "--out",
        str(out),
        *sets("data.source=cache", f"data.path={libfm_cache}", "model.bottom_mlp=[]"),
        *sets(f"model.name={name}", *QUICK),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr  # no Python warning of any kind
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and 0 <= summary["auc"] <= 1


@pytest.mark.parametrize("name", MODELS)
def test_no_dense_features_no_bottom_mlp(name):
    config = load_config(None, [*NO_DENSE, f"model.name={name}"])
    source = SyntheticSource(config.data.synthetic)
    assert source.schema.num_dense == 0
    model = build_model(config, source.schema, torch.device("cpu"))
    assert model.bottom is None
    assert all(m.in_features > 0 for m in model.modules() if isinstance(m, nn.Linear))
    batch = next(iter(source.train_batches(8)))
    assert batch.dense.shape == (8, 0)
    with FlopCounterMode(display=False) as counter:
        logits = model(batch.dense, batch.sparse)
    assert logits.shape == (8,)
    measured = counter.get_total_flops() / 8
    assert measured <= model.flops_per_sample() <= 1.08 * measured
    logits.sum().backward()
    assert all(p.grad is not None for _, p in dense_parameters(model))


def test_a_bottom_mlp_for_data_without_dense_features_is_refused():
    result = towerrec("train", *sets("data.synthetic.num_dense=0", "train.steps=2"))
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert "no dense features" in error and "set model.bottom_mlp = []" in error, error
    result = towerrec("train", *sets("model.bottom_mlp=[]", "train.steps=2"))
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert "13 dense features but bottom_mlp = []" in error and "[64, 16]" in error, error


def test_tower_dense_without_dense_features_is_refused():
    config = load_config(None, [*NO_DENSE, "model.name=dmt", "model.dmt.tower_dense=true"])
    source = SyntheticSource(config.data.synthetic)
    with pytest.raises(ValueError, match=r"set model\.dmt\.tower_dense = false"):
        build_model(config, source.schema, torch.device("cpu"))


def make_ebc():
    return EmbeddingBagCollection([TableConfig(f"t{i}", 10, 4) for i in range(4)], backend="torch")


def test_identity_dmt_from_a_dlrm_without_dense_features_computes_the_same():
    torch.manual_seed(0)
    dlrm = DLRM(make_ebc(), 0, [], [8, 1])
    dmt = DMT.from_dlrm(dlrm, [["t2", "t0"], ["t3", "t1"]], sparse=make_ebc())
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 3, (4 * 16,), generator=gen)
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=gen)
    sparse = KeyedJaggedTensor([f"t{i}" for i in range(4)], values, lengths)
    dense = torch.zeros(16, 0)
    torch.testing.assert_close(dmt(dense, sparse), dlrm(dense, sparse))


@pytest.mark.parametrize("num_dense", [0, 13])
def test_concat_embeddings_widens_the_top_mlp(num_dense):
    bottom = "model.bottom_mlp=[]" if num_dense == 0 else "model.bottom_mlp=[64, 16]"
    base = [*NO_DENSE, f"data.synthetic.num_dense={num_dense}", bottom]
    config = load_config(None, base)
    source = SyntheticSource(config.data.synthetic)
    plain = build_model(config, source.schema, torch.device("cpu"))
    concat = build_model(
        load_config(None, [*base, "model.concat_embeddings=true"]),
        source.schema,
        torch.device("cpu"),
    )
    assert concat.top.in_features == plain.top.in_features + 3 * 16  # T * D more inputs
    assert concat.flops_per_sample() > plain.flops_per_sample()
    batch = next(iter(source.train_batches(8)))
    assert concat(batch.dense, batch.sparse).shape == (8,)


def test_concat_embeddings_trains_through_the_cli(libfm_cache, tmp_path):
    result = towerrec(
        "train",
        "--out",
        str(tmp_path / "run"),
        *sets("data.source=cache", f"data.path={libfm_cache}", "model.bottom_mlp=[]"),
        *sets("model.concat_embeddings=true", *QUICK),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = (tmp_path / "run" / "config.toml").read_text()
    assert "concat_embeddings = true" in config


def test_concat_embeddings_on_another_model_warns_that_it_is_ignored():
    with pytest.warns(UserWarning, match="model.concat_embeddings is ignored"):
        load_config(None, ["model.name=dcn", "model.concat_embeddings=true"])
