"""Shampoo against explicit full-matrix arithmetic, blocking, resume, and its
distributed form against the single-process one."""

import json
import re

import numpy as np
import pytest
import torch
from conftest import run_cli
from scipy.linalg import fractional_matrix_power

from towerrec.config import load_config
from towerrec.distributed.launch import spawn_world
from towerrec.optim.shampoo import Shampoo, ShampooSettings, block_slices
from towerrec.workflows import training as trainer

EPS = 1e-6
GRAFT_EPS = 1e-8


def _gradients(shape, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(steps)]


# The explicit arithmetic below: Adagrad grafting on the raw gradient, summed factors.
ADAGRAD = {"grafting": "adagrad", "beta1": 0.0, "beta2": 1.0}


def _run(param, grads, lr=0.1, **settings):
    param = torch.nn.Parameter(param.clone())
    optimizer = Shampoo([param], lr=lr, settings=ShampooSettings(**{**ADAGRAD, **settings}))
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
    return param.detach()


def _explicit_matrix(w0, grads, lr):
    """Full-matrix arithmetic: the preconditioner as one Kronecker product over vec(G)."""
    w = w0.numpy().copy()
    m, n = w.shape
    left, right, acc = np.zeros((m, m)), np.zeros((n, n)), np.zeros((m, n))
    for g in (g.numpy() for g in grads):
        left += g @ g.T
        right += g.T @ g
        acc += g * g
        full = np.kron(
            fractional_matrix_power(left + EPS * np.eye(m), -0.25),
            fractional_matrix_power(right + EPS * np.eye(n), -0.25),
        ).real
        direction = (full @ g.reshape(-1)).reshape(m, n)
        graft = g / (np.sqrt(acc) + GRAFT_EPS)
        w -= lr * direction * np.linalg.norm(graft) / np.linalg.norm(direction)
    return torch.from_numpy(w)


def test_one_matrix_block_equals_the_explicit_kronecker_preconditioner():
    w0 = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    grads = _gradients((5, 3), 6)
    got = _run(w0, grads, epsilon=EPS, start_preconditioning_step=1, precondition_frequency=1)
    torch.testing.assert_close(got, _explicit_matrix(w0, grads, 0.1), rtol=1e-7, atol=1e-8)


def test_a_vector_takes_the_inverse_square_root_of_its_one_factor():
    w0 = torch.zeros(4, dtype=torch.float64)
    grads = _gradients((4,), 3, seed=1)
    got = _run(w0, grads, epsilon=EPS, start_preconditioning_step=1, precondition_frequency=1)
    w, factor, acc = np.zeros(4), np.zeros((4, 4)), np.zeros(4)
    for g in (g.numpy() for g in grads):
        factor += np.outer(g, g)
        acc += g * g
        direction = fractional_matrix_power(factor + EPS * np.eye(4), -0.5).real @ g
        graft = g / (np.sqrt(acc) + GRAFT_EPS)
        w -= 0.1 * direction * np.linalg.norm(graft) / np.linalg.norm(direction)
    torch.testing.assert_close(got, torch.from_numpy(w), rtol=1e-7, atol=1e-8)


def test_blocks_are_preconditioned_independently():
    w0 = torch.randn(5, 3, dtype=torch.float64)
    grads = _gradients((5, 3), 4, seed=2)
    settings = dict(
        start_preconditioning_step=2, precondition_frequency=2, max_preconditioner_dim=2
    )
    got = _run(w0, grads, **settings)
    blocks = block_slices((5, 3), 2)
    assert len(blocks) == 6  # rows 0:2, 2:4, 4:5 x columns 0:2, 2:3
    for block in blocks:
        alone = _run(w0[block], [g[block] for g in grads], **settings)
        torch.testing.assert_close(got[block], alone, rtol=0, atol=0)


def test_before_the_start_step_only_the_graft_steps():
    w0 = torch.randn(6, 4, dtype=torch.float64)
    grads = _gradients((6, 4), 3, seed=3)
    got = _run(w0, grads, lr=0.05, start_preconditioning_step=10, graft_epsilon=1e-10)
    param = torch.nn.Parameter(w0.clone())
    adagrad = torch.optim.Adagrad([param], lr=0.05, eps=1e-10)
    for g in grads:
        param.grad = g.clone()
        adagrad.step()
    assert torch.equal(got, param.detach())  # the graft is Adagrad's arithmetic


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adam_grafting_before_the_start_step_is_adam_bit_for_bit(dtype):
    """Shampoo with Adam grafting and momentum, its start step beyond the run, takes
    torch's Adam steps exactly (decoupled weight decay too), on blocked parameters and
    a changing learning rate."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(7, 5), (5,), (3, 2, 4)]
    starts = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(12)]
    settings = ShampooSettings(
        beta1=0.9,
        grafting="adam",
        graft_beta2=0.999,
        graft_epsilon=1e-8,
        max_preconditioner_dim=3,
        start_preconditioning_step=len(grads) + 1,
    )
    ours = [torch.nn.Parameter(w.clone()) for w in starts]
    theirs = [torch.nn.Parameter(w.clone()) for w in starts]
    shampoo = Shampoo(ours, lr=0.01, settings=settings, weight_decay=0.1)
    adam = torch.optim.Adam(
        theirs,
        lr=0.01,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.1,
        decoupled_weight_decay=True,
        foreach=False,
    )
    for step, gs in enumerate(grads):
        for optimizer in (shampoo, adam):
            optimizer.param_groups[0]["lr"] = 0.01 * (step + 1) / len(grads)
        for a, b, g in zip(ours, theirs, gs):
            a.grad, b.grad = g.clone(), g.clone()
        shampoo.step()
        adam.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    # One step with the preconditioner moves it off Adam's path.
    shampoo.settings = ShampooSettings(
        **{**settings.__dict__, "start_preconditioning_step": 1, "precondition_frequency": 1}
    )
    for a, b, g in zip(ours, theirs, grads[0]):
        a.grad, b.grad = g.clone(), g.clone()
    shampoo.step()
    adam.step()
    assert not torch.equal(ours[0], theirs[0])


def test_adam_graft_and_filtered_gradient_run_and_decrease_a_quadratic():
    target = torch.randn(8, 5, generator=torch.Generator().manual_seed(4))
    param = torch.nn.Parameter(torch.zeros(8, 5))
    optimizer = Shampoo(
        [param],
        lr=0.05,
        settings=ShampooSettings(
            beta1=0.9, beta2=0.99, grafting="adam", start_preconditioning_step=3
        ),
    )
    first = None
    for _ in range(60):
        optimizer.zero_grad()
        loss = ((param - target) ** 2).sum()
        first = first if first is not None else float(loss.detach())
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.05 * first


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.ReLU(), torch.nn.Linear(9, 1))


def _batches(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 7, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(steps)
    ]


def _train(model, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


SETTINGS = ShampooSettings(
    beta1=0.5, start_preconditioning_step=2, precondition_frequency=3, max_preconditioner_dim=4
)


def test_resume_from_a_state_dict_is_bit_exact():
    batches = _batches(7)
    model = _model(0)
    optimizer = Shampoo(model.parameters(), lr=0.01, settings=SETTINGS, weight_decay=1e-3)
    _train(model, optimizer, batches)
    expected = [p.detach().clone() for p in model.parameters()]

    model = _model(0)
    optimizer = Shampoo(model.parameters(), lr=0.01, settings=SETTINGS, weight_decay=1e-3)
    _train(model, optimizer, batches[:4])  # stopped after step 4, with roots from step 2
    resumed = _model(1)
    resumed.load_state_dict(model.state_dict())
    again = Shampoo(resumed.parameters(), lr=0.01, settings=SETTINGS, weight_decay=1e-3)
    again.load_state_dict(optimizer.state_dict())
    _train(resumed, again, batches[4:])
    for p, e in zip(resumed.parameters(), expected):
        assert torch.equal(p.detach(), e)


def _distributed(topology, steps):
    from towerrec.distributed.block_exchange import GroupExchange

    model = _model(0)
    optimizer = Shampoo(model.parameters(), lr=0.01, settings=SETTINGS, exchange=GroupExchange())
    _train(model, optimizer, _batches(steps))  # every rank sees the same batches: replicas
    owned = sum(1 for (i, j), r in optimizer._owner.items() if r == topology.rank)
    held = sum(1 for state in optimizer.state.values() for key in state if key.endswith(".L0"))
    return [p.detach() for p in model.parameters()], owned, held


@pytest.mark.multiprocess
def test_blocks_dealt_over_ranks_take_the_single_process_steps_bit_for_bit():
    model = _model(0)
    optimizer = Shampoo(model.parameters(), lr=0.01, settings=SETTINGS)
    _train(model, optimizer, _batches(6))
    expected = [p.detach() for p in model.parameters()]
    results = spawn_world(_distributed, 2, 1, 6)
    for params, owned, held in results:
        for p, e in zip(params, expected):
            assert torch.equal(p, e)
        assert 0 < owned == held  # each rank keeps statistics for its own blocks only
    assert sum(r[1] for r in results) == len(optimizer._owner)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(grafting="rmsprop"), "grafting must be one of"),
        (dict(beta2=0.0), "beta2 must lie in"),
        (dict(max_preconditioner_dim=0), "max_preconditioner_dim must be >= 1"),
        (dict(epsilon=0.0), "epsilon"),
    ],
)
def test_bad_settings_are_refused_with_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        ShampooSettings(**settings)


def test_any_parameter_shape_is_blocked():
    for shape in [(), (3,), (2, 3, 4), (2000, 3)]:
        param = torch.nn.Parameter(torch.ones(shape))
        optimizer = Shampoo([param], lr=0.1, settings=ShampooSettings(start_preconditioning_step=1))
        param.grad = torch.full(shape, 0.5)
        optimizer.step()
        assert torch.isfinite(param).all() and not torch.equal(param, torch.ones(shape))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_movielens_with_shampoo_on_2_ranks_follows_one_process(tmp_path):
    overrides = [
        "optimizer.name=shampoo",
        "optimizer.shampoo.start_preconditioning_step=2",
        "optimizer.shampoo.precondition_frequency=2",
        "train.steps=6",
        "train.progress=false",
        "train.eval_batch_size=4096",
    ]
    sets = [x for s in overrides for x in ("--set", s)]
    result = run_cli(
        "train", "--config", "configs/movielens.toml", "--nproc", "2",
        "--out", str(tmp_path / "two"), *sets, OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    one = trainer.train(load_config("configs/movielens.toml", overrides), tmp_path / "one")
    assert two["completed"] and one["completed"]
    assert abs(two["auc"] - one["auc"]) < 1e-3
    assert abs(two["logloss"] - one["logloss"]) < 1e-3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_criteo_format_cache_with_shampoo_on_2_ranks_follows_one_process(tmp_path):
    from towerrec.data.criteo import CriteoOptions, preprocess_criteo
    from towerrec.data.criteo_gen import generate_criteo_files

    days = generate_criteo_files(tmp_path / "raw", files=2, rows_per_file=801, seed=3)
    cache = tmp_path / "cache"
    options = CriteoOptions(num_embeddings=(500,), eval_files=("day_1",))
    preprocess_criteo(days, cache, options, progress=False)
    overrides = [
        "data.source=criteo",
        f"data.path={cache}",
        "optimizer.name=shampoo",
        "optimizer.shampoo.start_preconditioning_step=2",
        "optimizer.shampoo.precondition_frequency=2",
        "optimizer.warmup_steps=2",
        "model.embedding_dim=8",
        "model.bottom_mlp=[16, 8]",
        "model.top_mlp=[16, 1]",
        "train.batch_size=128",
        "train.steps=6",
        "train.progress=false",
    ]
    sets = [x for s in overrides for x in ("--set", s)]
    result = run_cli(
        "train", "--nproc", "2", "--out", str(tmp_path / "two"), *sets, OMP_NUM_THREADS="1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    one = trainer.train(load_config(None, overrides), tmp_path / "one")
    assert two["eval_samples"] == one["eval_samples"] == 801  # uneven over 2 ranks
    assert abs(two["auc"] - one["auc"]) < 1e-3
    assert abs(two["logloss"] - one["logloss"]) < 1e-3


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("model", ["dlrm", "dmt"])
def test_a_2_rank_run_deals_blocks_and_resumes_exactly(tmp_path, model):
    """`towerrec train --nproc 2` deals Shampoo's blocks over the ranks (a DMT's tower
    blocks stay with their host). Stopped at step 6 and resumed to 12, it ends where an
    uninterrupted run ends, bit for bit; each rank saved its own blocks' statistics, and
    the checkpoint loads whole into one process."""
    from test_trainer import QUICK, final_state

    overrides = [
        *QUICK,
        f"model.name={model}",
        "optimizer.name=shampoo",
        "optimizer.shampoo.start_preconditioning_step=3",
        "optimizer.shampoo.precondition_frequency=4",  # roots at 3, 7, 11: the resume uses saved ones
        "optimizer.decay=none",  # the schedule does not depend on train.steps
    ]
    if model == "dmt":
        overrides.append("model.dmt.partition=contiguous")  # no pilot run
    hosts = ["--hosts", "2"] if model == "dmt" else []

    def launch(out, steps, *extra):
        sets = [x for s in [*overrides, f"train.steps={steps}"] for x in ("--set", s)]
        result = run_cli(
            "train", "--nproc", "2", *hosts, "--out", str(out), *sets, *extra,
            OMP_NUM_THREADS="1",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr

    log = launch(tmp_path / "full", 12)
    mine, total = map(int, re.search(r"preconditions (\d+) of (\d+) blocks", log).groups())
    assert 0 < mine < total  # rank 0 holds a share
    launch(tmp_path / "split", 6)
    launch(tmp_path / "split", 12, "--resume")
    config = load_config(None, [*overrides, "train.steps=12"])
    a, b = final_state(tmp_path / "full", config), final_state(tmp_path / "split", config)
    assert a.keys() == b.keys()
    assert any(".L0" in key for key in a)  # every block's statistics came back
    for key in a:
        assert torch.equal(a[key], b[key]), key
