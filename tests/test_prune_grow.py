"""Growth and pruning (``train.prune_grow``): the surgery on an MLP and its optimizer
state, the schedule's errors, and training runs (resume, two ranks) against the plain
ones."""

import copy
import json

import pytest
import torch
from test_trainer import final_state, quick_config
from torch import nn

from towerrec.config import ConfigError, config_from_dict, load_config
from towerrec.modules.mlp import MLP
from towerrec.modules.mlp_width import hidden_widths, keep_by_score, unit_scores
from towerrec.workflows import training as trainer
from towerrec.workflows.prune_grow import PruneGrow

SCHEDULE = {"mlps": ["top"], "keep": 0.5, "prune_at": [4], "grow_at": [8], "unit": "step"}


class _Model(nn.Module):
    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.top = MLP(12, [16, 8, 1], final_activation=False, batch_norm=batch_norm)


def _config(optimizer: str = "adam", **schedule):
    return config_from_dict(
        {
            "optimizer": {"name": optimizer},
            "train": {"steps": 12, "prune_grow": {**SCHEDULE, **schedule}},
        }
    )


def _optimizer(name: str, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _train(model, optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 12, generator=g)
        y = torch.rand(32, generator=g).round()
        loss = nn.functional.binary_cross_entropy_with_logits(model.top(x).squeeze(1), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _linears(mlp):
    return [m for m in mlp if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("name", ["adam", "adagrad", "sgd"])
def test_a_prune_grow_cycle_keeps_surviving_weights_and_state(name):
    model = _Model()
    optimizer = _optimizer(name, model.parameters())
    _train(model, optimizer, 3)
    pg = PruneGrow(_config(name), 12, model, optimizer)
    keeps = [keep_by_score(unit_scores(model.top, i), k) for i, k in enumerate([8, 4])]
    before = {
        p: (p.detach().clone(), copy.deepcopy(optimizer.state[p])) for p in model.parameters()
    }
    weights = [(m.weight, m.bias) for m in _linears(model.top)]

    def kept(i):  # what survives of linear i: rows kept by hidden layer i, columns by i - 1
        w, b = (before[p][0] for p in weights[i])
        states = [before[p][1] for p in weights[i]]
        rows = keeps[i] if i < 2 else torch.arange(w.shape[0])
        cols = keeps[i - 1] if i > 0 else torch.arange(w.shape[1])
        return (w[rows][:, cols], b[rows]), [
            {
                k: v[rows][:, cols] if v.dim() == 2 else v[rows] if v.dim() else v
                for k, v in s.items()
            }
            for s in states
        ]

    expected = [kept(i) for i in range(3)]
    assert not pg.before_step(4, optimizer)  # step 4 still trains full
    assert pg.before_step(5, optimizer)
    assert hidden_widths(model.top) == [8, 4]
    for i, ((w, b), states) in enumerate(expected):
        linear = _linears(model.top)[i]
        assert torch.equal(linear.weight, w) and torch.equal(linear.bias, b), i
        for param, state in zip((linear.weight, linear.bias), states):
            got = optimizer.state[param]
            assert got.keys() == state.keys()
            for key in state:
                assert torch.equal(got[key], state[key]), (i, key)
    x = torch.randn(5, 12)
    pruned_out = model.top(x)
    assert pg.before_step(9, optimizer)  # grown: full size, the survivors first
    assert hidden_widths(model.top) == [16, 8]
    assert torch.allclose(model.top(x), pruned_out, atol=1e-6)  # zero outgoing: same function
    for i, ((w, b), states) in enumerate(expected):
        linear = _linears(model.top)[i]
        rows, cols = w.shape
        assert torch.equal(linear.weight[:rows, :cols], w)
        assert torch.equal(linear.bias[:rows], b)
        if i > 0:  # the survivors of the next layer see nothing of the new units yet
            assert not linear.weight[:rows, cols:].any()
        for param, state in zip((linear.weight, linear.bias), states):
            for key, value in state.items():
                got = optimizer.state[param][key]
                if value.dim() == 0:
                    assert torch.equal(got, value)
                    continue
                assert torch.equal(got[tuple(slice(0, n) for n in value.shape)], value)
                old = tuple(slice(0, n) for n in value.shape)
                new = torch.ones_like(got, dtype=torch.bool)
                new[old] = False
                assert not got[new].any(), key  # the new entries' state is zero
    _train(model, optimizer, 2)  # and the grown model trains


@pytest.mark.parametrize("batch_norm", [False, True])
def test_a_pruned_forward_equals_the_full_one_with_those_units_masked(batch_norm):
    model = _Model(batch_norm)
    optimizer = _optimizer("adam", model.parameters())
    _train(model, optimizer, 3)
    model.eval()  # batch norm with the (sliced) running statistics
    masked = copy.deepcopy(model.top)
    keeps = [keep_by_score(unit_scores(model.top, i), k) for i, k in enumerate([8, 4])]
    with torch.no_grad():
        for i, keep in enumerate(keeps):
            outgoing = _linears(masked)[i + 1].weight
            drop = torch.ones(outgoing.shape[1], dtype=torch.bool)
            drop[keep] = False
            outgoing[:, drop] = 0  # the pruned units' contributions are gone
    PruneGrow(_config(), 12, model, optimizer).before_step(5, optimizer)
    x = torch.randn(7, 12)
    assert torch.allclose(model.top(x), masked(x), atol=1e-6)


def test_units_are_ranked_by_incoming_times_outgoing_norm():
    model = _Model()
    with torch.no_grad():
        first, second = _linears(model.top)[:2]
        first.weight[3].mul_(100)  # unit 3: strong in, weak out -> the product decides
        second.weight[:, 3].div_(1000)
        first.weight[5].zero_()
        first.bias[5] = 0
        second.weight[:, 5].mul_(100)  # unit 5: nothing comes in, so nothing goes out
    scores = unit_scores(model.top, 0)
    assert scores[5] == 0 and scores[3] < scores.max()
    assert 5 not in keep_by_score(scores, 8).tolist()
    assert keep_by_score(torch.tensor([1.0, 2.0, 2.0, 0.5]), 2).tolist() == [1, 2]  # ties: lower


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"prune_at": [0.2, 0.6], "grow_at": [0.4], "unit": "fraction"}, "ends? full-size"),
        ({"keep": 0.0}, r"keep = 0.0 must lie in \(0, 1\]"),
        ({"keep": 1.5}, r"keep = 1.5 must lie in \(0, 1\]"),
        ({"mlps": ["middle"]}, "'middle' is not one of 'top', 'bottom'"),
        ({"prune_at": [0.5], "grow_at": [0.3], "unit": "fraction"}, "alternate in increasing"),
        ({"prune_at": [0.5], "grow_at": [1.0], "unit": "fraction"}, r"lie in \(0, 1\)"),
        ({"prune_at": [4], "grow_at": [12]}, "the run would end pruned"),
        ({"mlps": [], "prune_at": [4], "grow_at": [8]}, "mlps is empty"),
    ],
)
def test_bad_schedules_are_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        _config(**settings)


def test_shampoo_and_missing_layers_are_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"shampoo.*use adam, adagrad or sgd"):
        _config("shampoo")
    with pytest.raises(ConfigError, match=r"distributed.dense = 'fsdp'.*use distributed.dense"):
        config_from_dict(
            {
                "train": {"steps": 12, "prune_grow": SCHEDULE},
                "distributed": {"dense": "fsdp"},
            }
        )
    schedule = ["train.prune_grow.prune_at=[0.3]", "train.prune_grow.grow_at=[0.6]"]
    no_hidden = quick_config(
        "train.steps=10", 'train.prune_grow.mlps=["top"]', "model.top_mlp=[1]", *schedule
    )
    with pytest.raises(ValueError, match="'top', whose MLP has no hidden layer"):
        trainer.train(no_hidden, tmp_path / "a")
    dcn = quick_config(
        "train.steps=10", 'train.prune_grow.mlps=["top"]', "model.name=dcn", *schedule
    )
    with pytest.raises(ValueError, match="this DCN has no top MLP"):
        trainer.train(dcn, tmp_path / "b")
    short = quick_config("train.steps=2", 'train.prune_grow.mlps=["top"]', *schedule)
    with pytest.raises(ValueError, match="leave a phase without steps"):
        trainer.train(short, tmp_path / "c")


PRUNE_GROW = [
    'train.prune_grow.mlps=["top", "bottom"]',
    "train.prune_grow.keep=0.5",
    "train.prune_grow.prune_at=[0.25, 0.6]",
    "train.prune_grow.grow_at=[0.45, 0.8]",
]


def test_a_run_ends_full_size_and_counts_its_mlp_flops(tmp_path):
    config = quick_config("train.steps=20", "embedding.backend=torch", *PRUNE_GROW)
    summary = trainer.train(config, tmp_path / "pg")
    plain = quick_config("train.steps=20", "embedding.backend=torch")
    dense = trainer.train(plain, tmp_path / "dense")
    assert summary["num_dense_params"] == dense["num_dense_params"]
    assert summary["flops_per_sample"] == dense["flops_per_sample"]
    a, b = final_state(tmp_path / "pg", config), final_state(tmp_path / "dense", plain)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    pg = summary["prune_grow"]
    assert pg["phases"] == [[5, 9], [12, 16]] and pg["pruned_steps"] == 8
    assert pg["hidden_widths"] == {"top.0": [64, 32], "top.1": [32, 16], "bottom.0": [64, 32]}
    # top 22 -> 64 -> 32 -> 1, bottom 13 -> 64 -> 16: per sample, full and pruned
    full = 2 * (22 * 64 + 64 * 32 + 32 + 13 * 64 + 64 * 16)
    narrow = 2 * (22 * 32 + 32 * 16 + 16 + 13 * 32 + 32 * 16)
    assert pg["mlp_train_flops"] == 3 * 256 * (12 * full + 8 * narrow)
    assert pg["dense_mlp_train_flops"] == 3 * 256 * 20 * full


@pytest.mark.parametrize("stop_after", [7, 9])  # inside a pruned phase; at its last step
def test_resume_in_a_pruned_phase_equals_uninterrupted(tmp_path, stop_after):
    config = quick_config("train.steps=14", "embedding.backend=torch", *PRUNE_GROW)
    full = trainer.train(config, tmp_path / "full")
    trainer.train(config, tmp_path / "split", stop_after=stop_after)
    resumed = trainer.train(config, tmp_path / "split", resume=True)
    a, b = final_state(tmp_path / "full", config), final_state(tmp_path / "split", config)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["auc"] == full["auc"] and resumed["prune_grow"] == full["prune_grow"]


MOVIELENS = [
    "data.source=movielens",
    "train.steps=12",
    "train.batch_size=512",
    "train.eval_every=0",
    "train.progress=false",
    "optimizer.warmup_steps=2",
    "embedding.backend=torch",
    'train.prune_grow.mlps=["top", "bottom"]',
    "train.prune_grow.prune_at=[0.25]",
    "train.prune_grow.grow_at=[0.6]",
]


def _train_movielens(out):
    from towerrec.workflows.training import train

    return train(load_config(None, MOVIELENS), out)


@pytest.mark.multiprocess
def test_two_ranks_follow_one_process_on_movielens(tmp_path):
    """MovieLens' splits are not multiples of the two ranks' batches; the pruned units are
    chosen on each rank from its replica of the weights, and DDP is rebuilt at each change."""
    from towerrec.distributed.launch import launch

    launch(_train_movielens, (tmp_path / "two",), nproc=2)
    one = _train_movielens(tmp_path / "one")
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["prune_grow"] == one["prune_grow"]
    config = load_config(None, MOVIELENS)
    a, b = _movielens_state(tmp_path / "one", config), _movielens_state(tmp_path / "two", config)
    for key in a:
        if key.startswith("embedding_bags") or "sparse" in key:
            continue  # the tables: sharded, tested elsewhere
        assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), key
    assert abs(two["logloss"] - one["logloss"]) < 1e-5


def _movielens_state(out_dir, config):
    from towerrec.build.models import build_model
    from towerrec.build.optimizers import build_dense_optimizer
    from towerrec.build.sources import build_source
    from towerrec.train.checkpoint import CheckpointManager

    model = build_model(config, build_source(config.data).schema, torch.device("cpu"))
    optimizer = build_dense_optimizer(config.optimizer, model)
    manager = CheckpointManager(out_dir / "checkpoint")
    manager.load(
        manager.latest(), model, optimizer, {"step": 0, "samples": 0, "train_s": 0.0, "rng": {}}
    )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(optimizer.state_dict()["state"].values()):
        state.update({f"opt/{i}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return state


@pytest.mark.slow
def test_the_benchmark_compares_a_pruned_run_with_a_dense_one(capsys):
    from towerrec.cli import main

    args = ["bench", "prune-grow", "--files", "1", "--rows", "3000", "--num-embeddings", "100"]
    args += ["--seeds", "0", "--rounds", "1", "--threads", "1"]
    args += ["--set", "train.batch_size=128", "--set", "model.top_mlp=[64, 32, 1]"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    (run,) = result["runs"]
    assert run["dense"]["prune_grow"] is None and run["prune_grow"]["prune_grow"]["pruned_steps"]
    assert run["dense"]["steps"] == run["prune_grow"]["steps"] == 19
    assert (
        result["mlp_train_flops_ratio"] == run["prune_grow"]["prune_grow"]["mlp_train_flops_ratio"]
    )
    assert 0 < result["mlp_train_flops_ratio"] < 1
    assert set(result["targets"]) and result["step_times"]["pruned_step_s"] > 0
