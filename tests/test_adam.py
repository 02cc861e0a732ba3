"""towerrec's Adam (optim/adam.py) against torch.optim.Adam(fused=True), bit for bit, on
its short path and on every case that takes torch's own step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from towerrec.build.optimizers import build_dense_optimizer
from towerrec.config import OptimizerConfig
from towerrec.optim.adam import Adam


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _same(a: torch.optim.Optimizer, b: torch.optim.Optimizer, ma: nn.Module, mb: nn.Module):
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)
        sa, sb = a.state[pa], b.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


def _pair(dtype: torch.dtype = torch.float32, **kwargs):
    ours_model, torch_model = _model(dtype=dtype), _model(dtype=dtype)
    kwargs.setdefault("fused", True)
    ours = Adam(ours_model.parameters(), **kwargs)
    ref = torch.optim.Adam(torch_model.parameters(), **kwargs)
    return ours, ref, ours_model, torch_model


def _train(ours, ref, ours_model, torch_model, steps: range) -> None:
    """Both optimizers stepped on the same gradients, then compared."""
    for step in steps:
        _grads(ours_model, step)
        _grads(torch_model, step)
        ours.step()
        ref.step()
    _same(ours, ref, ours_model, torch_model)


def _short_steps(optimizer: Adam) -> list[int]:
    """Count the steps that took the short path (the kernel called by Adam itself)."""
    taken: list[int] = []
    short = optimizer._short_calls

    def counted():
        calls = short()
        if calls is not None:
            taken.append(1)
        return calls

    optimizer._short_calls = counted  # type: ignore[method-assign]
    return taken


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 1e-2},
        {"lr": 3e-3, "weight_decay": 0.1, "decoupled_weight_decay": True},
        {"lr": 3e-3, "weight_decay": 0.1},  # L2 in the gradient
        {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "maximize": True},
    ],
)
def test_steps_match_torch_bit_for_bit(kwargs):
    ours, ref, ours_model, torch_model = _pair(**kwargs)
    taken = _short_steps(ours)
    for step in range(6):
        _grads(ours_model, step)
        _grads(torch_model, step)
        if step == 3:  # a schedule's change, read at the next step
            for opt in (ours, ref):
                opt.param_groups[0]["lr"] *= 0.5
        ours.step()
        ref.step()
        _same(ours, ref, ours_model, torch_model)
    assert len(taken) == 5  # every step after the first, which made the state


def test_bfloat16_parameters_match_torch():
    pair = _pair(torch.bfloat16, lr=1e-2)
    taken = _short_steps(pair[0])
    _train(*pair, range(4))
    assert len(taken) == 3


def test_parameters_without_gradients_and_groups():
    ours_model, torch_model = _model(), _model()
    groups = lambda m: [  # noqa: E731
        {"params": list(m[0].parameters())},
        {"params": list(m[2].parameters()), "lr": 5e-3},
    ]
    ours = Adam(groups(ours_model), lr=1e-2, fused=True)
    ref = torch.optim.Adam(groups(torch_model), lr=1e-2, fused=True)
    taken = _short_steps(ours)
    for step in range(5):
        _grads(ours_model, step)
        _grads(torch_model, step)
        if step >= 2:  # the first layer's weight frozen: no gradient, not stepped
            ours_model[0].weight.grad = None
            torch_model[0].weight.grad = None
        ours.step()
        ref.step()
        _same(ours, ref, ours_model, torch_model)
    assert len(taken) == 4


def test_a_parameter_without_state_takes_torchs_step():
    """A parameter's first gradient (its state not made yet) sends the whole step to
    torch's: the others are not stepped twice, the new one's state is made."""
    ours, ref, ours_model, torch_model = _pair(lr=1e-2)
    for step in range(4):
        _grads(ours_model, step)
        _grads(torch_model, step)
        if step < 2:
            ours_model[2].bias.grad = None
            torch_model[2].bias.grad = None
        ours.step()
        ref.step()
        _same(ours, ref, ours_model, torch_model)


def test_hooks_run_once_on_either_path():
    ours, _, ours_model, _ = _pair(lr=1e-2)
    seen: list[str] = []
    ours.register_step_pre_hook(lambda *_: seen.append("pre"))
    ours.register_step_post_hook(lambda *_: seen.append("post"))
    torch.optim.Adam([nn.Parameter(torch.zeros(1))], fused=True)  # torch's own step hooked
    taken = _short_steps(ours)
    for step in range(3):
        _grads(ours_model, step)
        ours.step()
    assert len(taken) == 2
    assert seen == ["pre", "post"] * 3


def test_closure_and_state_dict_round_trip():
    ours, ref, ours_model, torch_model = _pair(lr=1e-2, weight_decay=0.01)
    _train(ours, ref, ours_model, torch_model, range(3))
    # a resume: our state into a fresh one of ours, and torch's into torch's
    resumed_model = copy.deepcopy(ours_model)
    resumed = Adam(resumed_model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    resumed.load_state_dict(ours.state_dict())
    taken = _short_steps(resumed)
    _train(resumed, ref, resumed_model, torch_model, range(3, 6))
    assert len(taken) == 3
    loss = resumed.step(lambda: torch.tensor(1.5))  # a closure: torch's step, its loss
    ref.step()
    assert loss == 1.5
    _same(resumed, ref, resumed_model, torch_model)


def test_unfused_and_amsgrad_take_torchs_step():
    for kwargs in ({"fused": False}, {"fused": True, "amsgrad": True}):
        pair = _pair(lr=1e-2, **kwargs)
        taken = _short_steps(pair[0])
        _train(*pair, range(3))
        assert taken == []


def test_the_dense_optimizer_is_this_adam():
    model = _model()
    optimizer = build_dense_optimizer(OptimizerConfig(name="adam"), model)
    assert type(optimizer) is Adam
    assert all(group["fused"] for group in optimizer.param_groups)
