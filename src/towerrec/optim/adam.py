"""``Adam``: ``torch.optim.Adam`` whose fused CPU step skips torch's per-step Python.

``torch.optim.Adam(fused=True)`` updates every parameter in one kernel call. Around that
call, each step it checks every parameter, makes its lists, and groups the tensors by
device and dtype. Within the steps of ``towerrec train``'s default model (ten tensors,
two threads of a 2-core CPU), torch's step took 0.39-0.44 ms, the kernel itself 0.07-0.09
of them; this one takes 0.32-0.35 ms (docs/benchmarks.md, the training step's profile).
What remains is the same kernel, the step counters' increment, torch's step hooks and
this module's checks, which run several times slower inside the step than alone.

``Adam.step`` hands the same kernel the same arguments itself where a group allows it:

- the group is fused, without amsgrad, capturable or differentiable, and its
  hyper-parameters are numbers;
- its parameters with a gradient all lie on the CPU in one dtype;
- each parameter is a plain tensor whose gradient is a dense tensor of its dtype;
- each parameter's state was made by an earlier step.

The kernel is ``torch._fused_adam_`` (``torch._fused_adamw_`` with decoupled weight
decay). It runs on the same lists in the same order, after the same increment of each
``step``, so the result is torch's step bit for bit.

Anything else goes to torch's own step: the first step, which makes the state; a
closure; AMP's gradient scaling (``grad_scale``, ``found_inf``); tensor
hyper-parameters; other devices; sharded parameters. Every group is checked before any
is stepped, so a step never runs partly on each path. The state tensors are read afresh
each step: growth and pruning replace them in place (``optim/reshape.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Adam"]

# (kernel, parameters, gradients, first moments, second moments, steps, keyword arguments)
_Call = tuple[Callable[..., Any], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
              list[torch.Tensor], list[torch.Tensor], dict[str, Any]]  # fmt: skip


def _torch_step(optimizer: torch.optim.Adam, closure: Callable[[], Any] | None) -> Any:
    """torch's own ``Adam.step``, without the step hooks when torch has wrapped it in them
    (``Optimizer._patch_step_function``): the subclass's own step already ran them."""
    step = torch.optim.Adam.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__  # type: ignore[attr-defined]  # functools.wraps sets it
    return step(optimizer, closure)


def _is_number(value: object) -> bool:
    return type(value) in (float, int)


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` with its fused CPU step's Python cut short (module doc); the
    same arguments, state and results."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        calls = self._short_calls() if closure is None else None
        if calls is None:
            return _torch_step(self, closure)
        with torch.no_grad():
            for kernel, params, grads, avgs, squares, steps, kwargs in calls:
                torch._foreach_add_(steps, 1)
                kernel(params, grads, avgs, squares, [], steps, **kwargs)
        return None

    def _short_calls(self) -> list[_Call] | None:
        """One kernel call per group with parameters to step, or None where any group
        needs torch's own step (module doc)."""
        if getattr(self, "grad_scale", None) is not None:
            return None
        if getattr(self, "found_inf", None) is not None:
            return None
        calls: list[_Call] = []
        for group in self.param_groups:
            if (
                group["fused"] is not True
                or group["amsgrad"]
                or group["capturable"]
                or group["differentiable"]
            ):
                return None
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, decay = group["eps"], group["weight_decay"]
            if not all(_is_number(v) for v in (lr, beta1, beta2, eps, decay)):
                return None
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            dtype = params[0].dtype
            grads, avgs, squares, steps = [], [], [], []
            for p in params:
                grad, state = p.grad, self.state.get(p)
                if (
                    not state
                    or type(grad) is not torch.Tensor
                    or type(p.data) is not torch.Tensor  # not a DTensor's shard
                    or type(state["step"]) is not torch.Tensor
                    or p.device.type != "cpu"
                    or p.dtype != dtype
                    or grad.dtype != dtype
                    or grad.layout != torch.strided
                    or grad.device.type != "cpu"
                ):
                    return None
                grads.append(grad)
                avgs.append(state["exp_avg"])
                squares.append(state["exp_avg_sq"])
                steps.append(state["step"])
            kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
            kwargs = {
                "amsgrad": False,
                "lr": lr,
                "beta1": beta1,
                "beta2": beta2,
                "weight_decay": decay,
                "eps": eps,
                "maximize": group["maximize"],
                "grad_scale": None,
                "found_inf": None,
            }
            calls.append((kernel, params, grads, avgs, squares, steps, kwargs))
        return calls
