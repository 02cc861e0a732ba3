"""``train.temporal``: batch, incremental and fgd updates in ``towerrec replay``."""

import json
from dataclasses import replace

import pytest
import torch

from towerrec.bench.temporal import _NextPeriod
from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.cli.app import main
from towerrec.config import TemporalConfig, load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.train.metrics import auc
from towerrec.train.step import evaluate, train_step
from towerrec.workflows import training as trainer
from towerrec.workflows.pu.prior import resolve_objective
from towerrec.workflows.replay import replay as replay_module
from towerrec.workflows.replay.replay import run_replay
from towerrec.workflows.replay.temporal import FutureGradient, GeneratorNet, training_periods

SMALL = [
    "data.synthetic.num_embeddings=[40, 60, 90]",
    "data.synthetic.pooling_factors=[1, 1, 2]",
    "data.synthetic.num_dense=4",
    "data.synthetic.eval_samples=3000",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "train.batch_size=256",
    "train.progress=false",
    "optimizer.warmup_steps=2",
    "data.synthetic.periods=4",
    "data.synthetic.period_samples=600",
    "data.synthetic.drift=0.3",
    "data.synthetic.id_turnover=0.1",
]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_incremental_on_a_stationary_stream_ends_with_the_weights_of_plain_training(tmp_path):
    """As replay did before strategies: 3 periods of 512 are the plain stream's first
    6 batches, so incremental updates end where `towerrec train` with 6 steps ends."""
    stationary = [
        o for o in SMALL if "drift" not in o and "turnover" not in o and "period" not in o
    ]
    periods = ["data.synthetic.periods=3", "data.synthetic.period_samples=512"]
    config = load_config(None, [*stationary, *periods, "train.temporal.strategy=incremental"])
    model, _ = run_replay(config, progress=False)
    plain = trainer.train(
        load_config(None, [*stationary, "train.steps=6", "train.eval_every=0"]), tmp_path / "p"
    )
    metrics = evaluate(
        model, SyntheticSource(config.data.synthetic).eval_batches(3000), torch.device("cpu")
    )
    assert (metrics.auc, metrics.logloss) == (plain["auc"], plain["logloss"])


def test_training_periods_of_each_strategy():
    assert training_periods(TemporalConfig(), 3) == [3]
    assert training_periods(TemporalConfig(strategy="fgd"), 3) == [3]
    assert training_periods(TemporalConfig(strategy="batch"), 3) == [0, 1, 2, 3]
    assert training_periods(TemporalConfig(strategy="batch", window=2), 3) == [2, 3]
    assert training_periods(TemporalConfig(strategy="batch", window=2), 0) == [0]


@pytest.mark.parametrize("window", [0, 2])
def test_batch_trains_on_exactly_the_rows_of_its_window(monkeypatch, window):
    """Every training step's batch, recorded, is the concatenation of periods
    (t-window+1 or 0)..t, in order, at every period t."""
    seen: list[torch.Tensor] = []

    def recording_step(model, optimizer, batch, *args):
        seen.append(batch.dense.clone())
        return train_step(model, optimizer, batch, *args)

    monkeypatch.setattr(replay_module, "train_step", recording_step)
    overrides = [*SMALL, "train.temporal.strategy=batch", f"train.temporal.window={window}"]
    config = load_config(None, overrides)
    _, summary = run_replay(config, progress=False)
    source = SyntheticSource(config.data.synthetic)
    expected = []
    for t in range(4):
        for q in training_periods(config.train.temporal, t):
            expected += [b.dense for b in source.period_batches(q, 256)]
    assert len(seen) == len(expected) == summary["steps"]
    assert all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True))
    assert summary["trained_periods"][3] == ([0, 1, 2, 3] if window == 0 else [2, 3])


@pytest.mark.parametrize(
    "fgd",
    [
        ["train.temporal.fgd_generator=false"],
        ["train.temporal.fgd_generator=none"],
        ["train.temporal.fgd_meta_lr=0"],
        ["train.temporal.fgd_generator=mlp", "train.temporal.fgd_net_lr=0"],
    ],
)
def test_fgd_with_zero_generator_output_is_incremental_bit_for_bit(fgd):
    incremental, a = run_replay(load_config(None, SMALL), progress=False)
    overrides = [*SMALL, "train.temporal.strategy=fgd", *fgd]
    future, b = run_replay(load_config(None, overrides), progress=False)
    assert _same(_state(incremental), _state(future))
    assert [r["logloss"] for r in a["results"]] == [r["logloss"] for r in b["results"]]


def test_fgd_linear_learns_coefficients_and_changes_the_run():
    _, a = run_replay(load_config(None, SMALL), progress=False)
    _, b = run_replay(load_config(None, [*SMALL, "train.temporal.strategy=fgd"]), progress=False)
    coefficients = b["fgd_generator"]
    assert any(c != 0 for c in coefficients["a"]) and any(c != 0 for c in coefficients["b"])
    assert [r["logloss"] for r in a["results"]] != [r["logloss"] for r in b["results"]]


@pytest.mark.parametrize("generator", ["linear", "mlp"])
def test_meta_update_leaves_the_model_as_it_was(generator):
    """The look-ahead steps the dense weights and computes gradients; afterwards every
    weight, embeddings included (fused update in backward), is bit for bit the same,
    and the generator has learned."""
    overrides = [*SMALL, "train.temporal.strategy=fgd", f"train.temporal.fgd_generator={generator}"]
    config = load_config(None, overrides)
    source = SyntheticSource(config.data.synthetic)
    model = build_model(config, source.schema, torch.device("cpu"))
    optimizer = build_dense_optimizer(config.optimizer, model)
    fgd = FutureGradient(optimizer, config.train.temporal)
    for t in range(3):
        for batch in source.period_batches(t, 256):
            fgd.step(model, optimizer, batch, None, _objective(config))
        fgd.end_period()
    assert (fgd.drift is not None) == (generator == "linear")
    net = [] if fgd.net is None else [w.detach().clone() for w in fgd.net.parameters()]
    before = _state(model)
    used = fgd.meta_update(
        model,
        source.period_batches(1, 256),
        source.period_batches(2, 256),
        0.05,
        torch.device("cpu"),
        None,
        _objective(config),
        before=source.period_batches(0, 256),
    )
    assert used == 3  # 600 rows: 3 batch pairs, fewer than fgd_meta_batches
    assert _same(before, _state(model))
    if generator == "linear":
        assert any(c != 0 for c in fgd.a)
    else:
        assert fgd.trained and fgd.drift is not None
        assert fgd.net is not None
        assert not all(torch.equal(a, b) for a, b in zip(net, fgd.net.parameters()))


def test_mlp_generator_at_init_forecasts_the_current_gradient_exactly():
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (1,), (4, 2, 2)]
    grads = [torch.randn(s) for s in shapes]
    drift = [torch.randn(s) for s in shapes]
    weights = [torch.randn(s) for s in shapes]
    net = GeneratorNet(hidden=16, bound=2.0)
    for out in (net(grads, drift, weights), net(grads, None, weights)):
        assert all(torch.equal(a, b) for a, b in zip(out, grads, strict=True))
    # Once the output layer has weights, the forecast moves, at most 2 RMS of g.
    torch.nn.init.normal_(net.out.weight)
    out = net(grads, drift, weights)
    assert not all(torch.equal(a, b) for a, b in zip(out, grads))
    assert all(
        float((a - g).abs().max()) <= 2.0 * float(g.pow(2).mean().sqrt()) + 1e-6
        for a, g in zip([x.detach() for x in out], grads)
    )


def test_mlp_meta_update_lowers_the_look_ahead_loss_on_a_planted_trend():
    """Weights theta, past loss |theta - a_k|^2 / 2, future loss |theta - b_k|^2 / 2 with
    b_k = a_k + trend: the future gradient is the past one minus the trend, and the drift
    feature (mean future minus mean past gradient, at theta) is -trend. With a look-ahead
    step of 1 the forecast g + drift brings the future loss to 0; Adam on the network must
    get most of the way there. A network that learns nothing, or the wrong sign, fails."""
    torch.manual_seed(0)
    theta = torch.nn.Parameter(torch.zeros(64))
    temporal = TemporalConfig(strategy="fgd", fgd_generator="mlp", fgd_net_lr=0.05)
    fgd = FutureGradient(torch.optim.SGD([theta], lr=0.1), temporal)
    trend = torch.randn(64) * 0.5
    pairs = []
    for _ in range(8):
        a = torch.randn(64)
        b = a + trend

        def future(step, b=b):
            at = theta.detach() - step[0]
            return float(0.5 * (at - b).pow(2).sum()), [at - b]

        pairs.append(([theta.detach() - a], future))
    drift = [-trend]
    assert all(f([g[0] + drift[0]])[0] < 1e-9 for g, f in pairs)  # the ideal forecast
    first = fgd.look_ahead(pairs, drift, lr=1.0)
    for _ in range(10):
        last = fgd.look_ahead(pairs, drift, lr=1.0)
    assert last < 0.25 * first, (first, last)
    assert torch.equal(theta.detach(), torch.zeros(64))


def _objective(config):
    return resolve_objective(config)[0]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.temporal.strategy=lookahead", "train.temporal.strategy = 'lookahead'"),
        ("train.temporal.window=-1", "must be >= 0"),
        ("train.temporal.window=2", "applies to strategy = 'batch' only"),
        ("train.temporal.fgd_meta_lr=-0.1", "fgd_meta_lr must be >= 0"),
        ("train.temporal.fgd_max_coef=0", "fgd_max_coef must be > 0"),
        ("train.temporal.fgd_meta_batches=-1", "fgd_meta_batches must be >= 0"),
        ("train.temporal.fgd_generator=lstm", "fgd_generator = 'lstm' is not one of"),
        ("train.temporal.fgd_generator=true", "fgd_generator = True is not one of"),
        ("train.temporal.fgd_hidden=0", "fgd_hidden must be >= 1"),
        ("train.temporal.fgd_net_lr=-1", "fgd_net_lr must be >= 0"),
        ("train.temporal.fgd_lookahead_lr=-1", "fgd_lookahead_lr must be >= 0"),
    ],
)
def test_bad_temporal_configs_are_refused(override, message):
    with pytest.raises(ValueError, match=r"train\.temporal") as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_fgd_on_several_ranks_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="runs on one process: drop --nproc"):
        run_replay(load_config(None, [*SMALL, "train.temporal.strategy=fgd"]), progress=False)


def test_replay_cli_with_batch_updates(tmp_path, capsys):
    args = ["replay", "--out", str(tmp_path / "r"), "--set", "train.temporal.strategy=batch"]
    for item in SMALL:
        args += ["--set", item]
    assert main(args) == 0
    assert "mean over 3 periods" in capsys.readouterr().out


def test_bench_temporal_compares_the_strategies(capsys):
    small = [
        o for o in SMALL if not o.startswith(("data.synthetic.period", "data.synthetic.drift"))
    ]
    small = [o for o in small if "turnover" not in o]
    args = ["bench", "temporal", "--seeds", "1", "--periods", "3", "--period-samples", "600"]
    for item in small:
        args += ["--set", item]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"drifting", "trend", "stationary"} <= set(result)
    for stream in ("drifting", "trend", "stationary"):
        means = result[stream]["mean_logloss"]
        assert set(means) == {"batch", "incremental", "fgd", "foresight"}
        runs = result[stream]["runs"]
        assert runs["batch"][0]["steps"] == (1 + 2 + 3) * 3 and runs["incremental"][0]["steps"] == 9
        assert runs["foresight"][0]["steps"] == 9
        relative = result[stream]["fgd_relative"]["fgd"]
        assert relative["vs_batch"] == means["fgd"] / means["batch"] - 1
        ahead = result[stream]["foresight_relative"]
        assert ahead["vs_batch"] == means["foresight"] / means["batch"] - 1


def test_foresight_trains_on_the_next_period_and_is_scored_on_this_one():
    """``bench temporal``'s foresight reference: replay with ``train_periods`` trains on
    those batches only (its weights are a replay of them, bit for bit) and scores the
    data it was given; at period t it trains on period t+1 of another draw."""
    config = load_config(None, SMALL)
    scored = SyntheticSource(config.data.synthetic)
    draw = SyntheticSource(replace(config.data.synthetic, stream_seed=1))
    ahead = _NextPeriod(draw)
    for period in range(3):
        ours, theirs = (
            next(ahead.period_batches(period, 64)),
            next(draw.period_batches(period + 1, 64)),
        )
        assert torch.equal(ours.dense, theirs.dense) and torch.equal(ours.labels, theirs.labels)
    assert torch.equal(
        next(ahead.period_batches(3, 64)).dense, next(draw.period_batches(3, 64)).dense
    )
    model, summary = run_replay(config, progress=False, periods=scored, train_periods=ahead)
    alone, alone_summary = run_replay(config, progress=False, periods=ahead)
    trained, replayed = _state(model), _state(alone)
    assert trained.keys() == replayed.keys()
    for key, value in trained.items():
        assert torch.equal(value, replayed[key]), key
    # scored on the data it was given (its oracle known), not on what it trained on
    labels, probs = scored.period_oracle(1)
    assert summary["results"][0]["oracle_auc"] == auc(probs, labels)
    assert alone_summary["results"][0]["oracle_auc"] is None
    ours = [r["logloss"] for r in summary["results"]]
    assert all(a != b for a, b in zip(ours, [r["logloss"] for r in alone_summary["results"]]))
    with pytest.raises(ValueError, match="give both the same periods"):
        short = replace(config.data.synthetic, periods=3)
        run_replay(config, progress=False, periods=scored, train_periods=SyntheticSource(short))


def test_fgd_with_nproc_is_refused_before_workers_start(tmp_path, capsys):
    args = ["replay", "--nproc", "2", "--out", str(tmp_path / "r")]
    assert main([*args, "--set", "train.temporal.strategy=fgd"]) == 2
    assert "runs on one process: drop --nproc" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_towerrec_train_warns_that_it_ignores_train_temporal(tmp_path):
    stationary = [
        o for o in SMALL if "drift" not in o and "turnover" not in o and "period" not in o
    ]
    config = load_config(None, [*stationary, "train.steps=1", "train.temporal.strategy=batch"])
    with pytest.warns(UserWarning, match="towerrec train ignores it"):
        trainer.train(config, tmp_path / "t")
