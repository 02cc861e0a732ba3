"""External distillation (ExFM students): the objective, its heads, checkpoints, export,
replay on two ranks, and the multi-domain synthetic stream."""

import json
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from towerrec.bench.streaming import recovered_share
from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.cli.app import main
from towerrec.config import ConfigError, config_to_toml, load_config
from towerrec.data.synthetic import SyntheticConfig, SyntheticSource
from towerrec.distributed.launch import launch
from towerrec.models.distill_heads import distill_heads
from towerrec.serve.export import export_run
from towerrec.serve.predict import predict
from towerrec.train.checkpoint import CheckpointManager, capture_rng
from towerrec.train.loss import BCE
from towerrec.train.step import train_step
from towerrec.workflows.distill.loss import Distillation, fit_adapter, grad_scale, with_distillation
from towerrec.workflows.distill.teacher import TeacherPeriods
from towerrec.workflows.replay import replay as replay_module
from towerrec.workflows.replay.replay import run_replay

SMALL = [
    "data.synthetic.num_embeddings=[40, 60, 90]",
    "data.synthetic.pooling_factors=[1, 1, 2]",
    "data.synthetic.num_dense=4",
    "data.synthetic.eval_samples=700",
    "data.synthetic.periods=3",
    "data.synthetic.period_samples=512",
    "data.synthetic.drift=0.2",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "train.batch_size=128",
    "train.progress=false",
    "optimizer.warmup_steps=2",
]
AUX = ["distill.weight=0.5", "distill.head=auxiliary", "distill.label_scale=1.5"]
AUX_ADAPTER = [
    *AUX,
    "distill.grad_scale=0.5",
    "distill.adapter=true",
    "distill.adapter_lr=0.01",
    "distill.adapter_features=true",
]


CPU = torch.device("cpu")


def with_teacher(config):
    """The periods of ``config``'s data, scored by a teacher: the same architecture with
    other weights (train.seed 77)."""
    other = load_config(None, [*SMALL, "train.seed=77"])
    teacher = build_model(other, SyntheticSource(other.data.synthetic).schema, CPU)
    return TeacherPeriods(SyntheticSource(config.data.synthetic), lambda _period: teacher)


def batches(config, count=6):
    periods = with_teacher(config)
    return list(periods.period_batches(0, 64))[:count]


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_weight_zero_trains_bit_for_bit_as_without_distillation():
    plain = load_config(None, SMALL)
    model, expected = run_replay(plain, progress=False)
    # w = 0 with other keys set, on batches that carry a teacher's logits
    with pytest.warns(UserWarning, match="distill.head, distill.label_scale ignored"):
        off = load_config(None, [*SMALL, "distill.head=shared", "distill.label_scale=3"])
    off_model, got = run_replay(off, progress=False, periods=with_teacher(off))
    assert got["results"] == expected["results"]
    assert distill_heads(off_model) is None
    for (name, a), b in zip(state(model).items(), state(off_model).values(), strict=True):
        assert torch.equal(a, b), name
    # and w > 0 does train differently
    on = load_config(None, [*SMALL, "distill.weight=0.5", "distill.head=shared"])
    _, changed = run_replay(on, progress=False, periods=with_teacher(on))
    assert changed["results"] != expected["results"]


def test_heads_do_not_change_the_students_initial_weights():
    plain = load_config(None, SMALL)
    config = load_config(None, [*SMALL, *AUX_ADAPTER])
    schema = SyntheticSource(plain.data.synthetic).schema
    a = state(build_model(plain, schema, CPU))
    b = state(build_model(config, schema, CPU))
    assert set(b) - set(a) and all(k.startswith("distill_heads.") for k in set(b) - set(a))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_grad_scale_scales_the_backbone_gradient_only():
    x = torch.randn(5, 3, requires_grad=True)
    (grad_scale(x, 0.25) * 2).sum().backward()
    assert torch.allclose(x.grad, torch.full((5, 3), 0.5))

    def distill_grads(beta):
        config = load_config(None, [*SMALL, *AUX, f"distill.grad_scale={beta}"])
        model = build_model(config, SyntheticSource(config.data.synthetic).schema, CPU)
        objective = Distillation(BCE, replace(config.distill, weight=1.0))
        batch = batches(config, 1)[0]
        _, terms = objective.forward(model, batch)
        loss = F.binary_cross_entropy_with_logits(terms.distill_logit, terms.soft_label)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return grads

    full, scaled = distill_grads(1.0), distill_grads(0.5)
    assert "bottom.0.weight" in full and "top.0.weight" not in full  # the serving head: none
    for name, g in full.items():
        factor = 1.0 if name.startswith("distill_heads.aux") else 0.5
        torch.testing.assert_close(scaled[name], factor * g, rtol=1e-5, atol=1e-7)


def test_adapter_learns_from_labels_and_its_target_is_a_stop_gradient():
    config = load_config(None, [*SMALL, *AUX_ADAPTER])
    model = build_model(config, SyntheticSource(config.data.synthetic).schema, CPU)
    objective = with_distillation(BCE, config.distill)
    batch = batches(config, 1)[0]
    logits, terms = objective.forward(model, batch)
    heads = distill_heads(model)
    # at the start the adapter is the identity: the target is the teacher's own
    torch.testing.assert_close(terms.adapter_logit, batch.teacher_logits)
    torch.testing.assert_close(terms.soft_label, torch.sigmoid(1.5 * batch.teacher_logits))
    objective.loss(logits, terms, batch.labels).backward()
    adapter_grads = [p.grad.clone() for p in heads.adapter.parameters()]
    model.zero_grad()
    only_labels = F.binary_cross_entropy_with_logits(
        heads.adapter(batch.teacher_logits, batch.dense), batch.labels
    )
    only_labels.backward()
    for got, expected in zip(adapter_grads, heads.adapter.parameters(), strict=True):
        torch.testing.assert_close(got, expected.grad)
    optimizer = build_dense_optimizer(config.optimizer, model)
    assert [g.get("base_lr") for g in optimizer.param_groups] == [None, 0.01]


def test_the_adapters_loss_leaves_the_backbone_gradients_alone():
    config = load_config(None, [*SMALL, *AUX_ADAPTER])
    model = build_model(config, SyntheticSource(config.data.synthetic).schema, CPU)
    objective = with_distillation(BCE, config.distill)
    batch = batches(config, 1)[0]
    logits, terms = objective.forward(model, batch)
    assert terms.soft_label.grad_fn is None  # the target: a stop-gradient of the adapter
    adapter_loss = F.binary_cross_entropy_with_logits(terms.adapter_logit, batch.labels)
    adapter = {id(p) for p in distill_heads(model).adapter.parameters()}
    backbone = [p for p in model.parameters() if p.requires_grad and id(p) not in adapter]
    assert len(backbone) > 4
    grads = torch.autograd.grad(adapter_loss, backbone, allow_unused=True)
    assert all(g is None for g in grads)  # no path from the adapter's loss into the student
    # while the student's own losses do reach the backbone
    student_loss = objective.loss(logits, replace(terms, adapter_logit=None), batch.labels)
    grads = torch.autograd.grad(student_loss, backbone, allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


def test_adapter_order_first_fits_the_adapter_alone_on_the_labels(monkeypatch):
    config = load_config(None, [*SMALL, *AUX_ADAPTER, "distill.adapter_order=first"])
    model = build_model(config, SyntheticSource(config.data.synthetic).schema, CPU)
    optimizer = build_dense_optimizer(config.optimizer, model)
    data = batches(config, 6)
    heads = distill_heads(model)

    def adapter_loss():
        with torch.no_grad():
            return sum(
                F.binary_cross_entropy_with_logits(
                    heads.adapter(b.teacher_logits, b.dense), b.labels
                ).item()
                for b in data
            )

    before, start, lrs = adapter_loss(), state(model), [g["lr"] for g in optimizer.param_groups]
    for _ in range(3):
        assert fit_adapter(model, optimizer, data, CPU, factor=0.5) == 6
    after = state(model)
    assert adapter_loss() < before
    for name, value in start.items():  # only the adapter moved
        assert torch.equal(value, after[name]) != name.startswith("distill_heads.adapter"), name
    assert [g["lr"] for g in optimizer.param_groups] == lrs  # its learning rate restored
    adapter_ids = {id(p) for p in heads.adapter.parameters()}
    assert all(id(p) in adapter_ids for p in optimizer.state)  # no state for the others
    # replay: one pass over each period before the student trains on it
    calls = []

    def spy(model, optimizer, batches, device, factor):
        calls.append(factor)
        return fit_adapter(model, optimizer, batches, device, factor)

    monkeypatch.setattr(replay_module, "fit_adapter", spy)
    short = replace(
        config,
        data=replace(config.data, synthetic=replace(config.data.synthetic, period_samples=256)),
    )
    run_replay(short, progress=False, periods=with_teacher(short))
    assert len(calls) == 3 and calls[0] == 1.0  # no warm-up factor: the decay's only


def test_adapter_order_first_refuses_several_ranks(monkeypatch):
    config = load_config(None, [*SMALL, *AUX_ADAPTER, "distill.adapter_order=first"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="adapter_order = 'first' runs on one process"):
        run_replay(config, progress=False, periods=with_teacher(config))


def test_recovered_share_is_the_part_of_the_stale_loss_won_back():
    ne = {
        "auxiliary": np.array([0.90, 0.92]),
        "stale": np.array([0.95, 0.97]),
        "stale_adapter": np.array([0.93, 0.94]),
    }
    assert recovered_share(ne) == pytest.approx(0.5)  # (0.96 - 0.935) / (0.96 - 0.91)
    assert recovered_share({**ne, "auxiliary": ne["stale"]}) is None  # nothing lost


def test_distillation_without_teacher_logits_names_the_service():
    config = load_config(None, [*SMALL, *AUX])
    with pytest.raises(ValueError, match="towerrec distill serve"):
        run_replay(config, progress=False)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["distill.head=both"], "distill.head = 'both' is not one of"),
        (["distill.weight=-1"], "distill.weight = -1.0 must be a finite number >= 0"),
        (["distill.label_scale=0"], "distill.label_scale = 0.0 must be > 0"),
        (["distill.adapter=true"], "distill.adapter = true with distill.weight = 0"),
        (
            ["distill.weight=1", "distill.head=shared", "distill.grad_scale=0.5"],
            "acts on the auxiliary head's gradient",
        ),
        (["distill.weight=1", "model.name=dcn"], "needs a model with a representation"),
        (["distill.adapter_width=0"], "distill.adapter_width must be >= 1"),
        (
            ["distill.weight=1", "distill.adapter=true", "distill.adapter_order=before"],
            "distill.adapter_order = 'before' is not one of",
        ),
        (
            ["distill.weight=1", "distill.adapter_order=first"],
            "distill.adapter_order = 'first' orders the adapter's training, but distill.adapter",
        ),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_checkpoint_holds_the_heads_and_resumes_exactly(tmp_path):
    config = load_config(None, [*SMALL, *AUX_ADAPTER])
    schema = SyntheticSource(config.data.synthetic).schema
    objective = with_distillation(BCE, config.distill)
    data = batches(config, 6)

    def fresh():
        model = build_model(config, schema, CPU)
        return model, build_dense_optimizer(config.optimizer, model)

    model, optimizer = fresh()
    for batch in data[:3]:
        train_step(model, optimizer, batch, objective=objective)
    train = {"step": 3, "samples": 0, "train_s": 0.0, "rng": {}}
    path = CheckpointManager(tmp_path).save(3, model, optimizer, train)
    for batch in data[3:]:
        train_step(model, optimizer, batch, objective=objective)
    resumed, resumed_optimizer = fresh()
    CheckpointManager(tmp_path).load(path, resumed, resumed_optimizer, dict(train))
    for batch in data[3:]:
        train_step(resumed, resumed_optimizer, batch, objective=objective)
    expected, got = state(model), state(resumed)
    assert any(k.startswith("distill_heads.adapter") for k in got)
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name


def test_export_of_a_distilled_student_carries_the_serving_head_only(tmp_path):
    config = load_config(None, [*SMALL, *AUX_ADAPTER])
    model, _ = run_replay(config, progress=False, periods=with_teacher(config))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(config_to_toml(config))
    optimizer = build_dense_optimizer(config.optimizer, model)  # one step: optimizer state
    train_step(
        model, optimizer, batches(config, 1)[0], objective=with_distillation(BCE, config.distill)
    )
    CheckpointManager(run / "checkpoint").save(
        12, model, optimizer, {"step": 12, "samples": 0, "train_s": 0.0, "rng": capture_rng()}
    )
    (run / "summary.json").write_text(json.dumps({"completed": True, "steps": 12}))
    artefact = tmp_path / "artefact"
    export_run(run, artefact)
    preds = tmp_path / "preds.parquet"
    predict(artefact, out=preds, progress=False)
    got = pq.read_table(preds)["prediction"].to_numpy()
    source = SyntheticSource(config.data.synthetic)
    model.eval()
    with torch.no_grad():
        expected = torch.cat(
            [torch.sigmoid(model(b.dense, b.sparse)) for b in source.eval_batches(300)]
        ).numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    program = torch.export.load(artefact / "program.pt2")
    assert not any("distill" in name for name in program.state_dict)


def _two_rank_replay(overrides):
    config = load_config(None, overrides)
    model, summary = run_replay(config, progress=False, periods=with_teacher(config))
    dense = ("distill_heads.", "top.", "bottom.")  # replicated: whole on every rank
    return summary, {k: v for k, v in state(model).items() if k.startswith(dense)}


@pytest.mark.multiprocess
def test_two_ranks_distil_like_one_process():
    overrides = [*SMALL, *AUX_ADAPTER, "train.eval_batch_size=96"]
    two = launch(_two_rank_replay, (overrides,), nproc=2)
    one_summary, one_state = _two_rank_replay(overrides)
    two_summary, two_state = two[0]
    assert two_summary["ranks"] == 2 and two_summary["steps"] == one_summary["steps"]
    for a, b in zip(two_summary["results"], one_summary["results"], strict=True):
        assert a["logloss"] == pytest.approx(b["logloss"], rel=1e-3)
    assert two_state.keys() == one_state.keys()
    assert "distill_heads.aux.0.weight" in two_state
    assert "distill_heads.adapter.mlp.0.weight" in two_state
    for name, value in one_state.items():
        torch.testing.assert_close(two_state[name], value, rtol=1e-3, atol=1e-4)


def test_one_domain_is_the_single_stream_bit_for_bit():
    default = SyntheticSource(SyntheticConfig(periods=3, period_samples=300, drift=0.3))
    one = SyntheticSource(
        SyntheticConfig(periods=3, period_samples=300, drift=0.3, domains=1, domain_shared=0.2)
    )
    for p in range(3):
        a, b = default.period_oracle(p), one.period_oracle(p)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert default.schema == one.schema


def test_domains_share_part_of_their_teacher():
    def probs(domain, shared):
        cfg = SyntheticConfig(domains=3, domain=domain, domain_shared=shared, eval_samples=4000)
        source = SyntheticSource(cfg)
        return source.samples("eval", 0, 4000)[0]

    b0, b1 = probs(0, 0.7), probs(1, 0.7)
    assert b0.sparse.keys()[-1] == "domain"
    assert set(b0.sparse["domain"].values.tolist()) == {0}
    assert set(b1.sparse["domain"].values.tolist()) == {1}
    assert not torch.equal(b0.dense, b1.dense)  # each domain draws its own samples
    # domain 1's teacher scored on domain 0's samples: correlated with domain 0's, more
    # so the larger the shared part
    source = SyntheticSource(SyntheticConfig(domains=3, domain=1, domain_shared=0.7))
    teacher = source._stream_teacher(0)
    same_samples = SyntheticSource(SyntheticConfig(domains=3, domain=0, domain_shared=0.7))
    raw = same_samples._raw_block("eval", 0, teacher=teacher)[2]
    other = raw @ teacher.weights + teacher.shift
    own = same_samples._raw_block("eval", 0, teacher=same_samples._stream_teacher(0))[2]
    own = own @ teacher.weights + teacher.shift
    corr = np.corrcoef(other, own)[0, 1]
    assert 0.2 < corr < 0.95


@pytest.mark.slow
def test_bench_streaming_runs_every_variant(capsys):
    args = ["bench", "streaming", "--seeds", "1", "--domains", "2", "--periods", "2"]
    args += ["--warmup", "2", "--stale", "1", "--period-samples", "600", "--skip-temporal"]
    args += ["--student-seeds", "2"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["students"]["mean_ne"]) == {
        "none",
        "shared",
        "auxiliary",
        "stale",
        "stale_adapter",
    }
    assert result["students"]["runs_per_variant"] == 4
    assert len(result["adapter_recovered_per_seed"]) == 1
    assert len(result["students"]["ne_per_run"]["stale"]) == 4
    assert np.isfinite(result["fm_mean_ne"])
