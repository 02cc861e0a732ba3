"""``towerrec bench qnewton``: progressive-batching L-BFGS and DANCE against their
full-data forms and Adam, in per-sample gradient evaluations and data passes.

Two finite-sum problems (``--rows``/``--chunk``, ``--dlrm-rows``/``--dlrm-chunk``):

- ``logistic``: logistic regression on planted dense data (``--dim`` Gaussian
  features, labels drawn from a planted linear model), float64.
- ``dlrm_dense``: DLRM's dense part (bottom MLP, dot interaction, top MLP) on the
  synthetic source, its pooled embeddings computed once by the randomly
  initialised tables and then held fixed: the embeddings are not what these
  optimizers train.

Per problem and seed (the data and initial weights come from the seed):

- full-batch L-BFGS (``ProgressiveBatchLBFGS`` with every chunk in the sample, so
  the same line search and pairs) runs ``--lbfgs-iterations``; its final loss F_L.
  PB-L-BFGS from 2 chunks runs until its full-data loss is within ``--tolerance``
  of F_L (or the budget ends). Reported: per-sample gradient evaluations each
  needed to first come within the tolerance of F_L, and their ratio.
- full-data Newton-CG (``Dance`` with every chunk in its one stage, so the same
  damped step, safeguard and CG) runs ``--newton-iterations`` on R_N; its final R_N.
  DANCE from 1 chunk runs until within the tolerance. Reported: data passes
  ((gradient + Hessian-vector + safeguard forward samples) / N) each needed, and
  their ratio.
- Adam on mini-batches of one chunk, given full-batch L-BFGS's gradient budget:
  its final loss.

"Loss" is always the full-data objective at the iterate (measured, not counted).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from towerrec.bench.common import (
    Benchmark,
    comma_list,
    keeps_process_settings,
    machine_info,
    set_threads,
)
from towerrec.build.models import build_model
from towerrec.build.sources import build_source
from towerrec.config import load_config
from towerrec.models.dlrm import DLRM
from towerrec.optim.dance import Dance, DanceSettings
from towerrec.optim.pb_lbfgs import PBLBFGSSettings, ProgressiveBatchLBFGS
from towerrec.optim.sampled import TensorSamples

__all__ = ["BENCHMARK"]


@dataclass
class Problem:
    """A finite sum: per-sample losses of rows as a function of ``params``."""

    params: list[torch.nn.Parameter]
    loss: Callable[[torch.Tensor], torch.Tensor]  # rows [n] -> per-sample losses [n]
    rows: int

    def full_loss(self, l2: float = 0.0) -> float:
        with torch.no_grad():
            value = float(self.loss(torch.arange(self.rows)).mean())
            if l2:
                value += 0.5 * l2 * sum(float((p * p).sum()) for p in self.params)
        return value

    def reset(self, initial: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, p0 in zip(self.params, initial):
                p.copy_(p0)


def logistic_problem(rows: int, dim: int, seed: int) -> Problem:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=generator, dtype=torch.float64)
    truth = torch.randn(dim, generator=generator, dtype=torch.float64) * 2 / dim**0.5
    y = torch.bernoulli(torch.sigmoid(x @ truth), generator=generator)
    w = torch.nn.Parameter(torch.zeros(dim, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))

    def loss(index: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(x[index] @ w + b, y[index], reduction="none")

    return Problem([w, b], loss, rows)


def dlrm_dense_problem(rows: int, seed: int) -> Problem:
    """DLRM's dense part on synthetic data with fixed pooled embeddings (module doc)."""
    config = load_config(
        None,
        [
            f"train.seed={seed}",
            f"data.synthetic.seed={seed}",
            "model.embedding_dim=8",
            "model.bottom_mlp=[32, 8]",
            "model.top_mlp=[32, 16, 1]",
        ],
    )
    source = build_source(config.data)
    model = build_model(config, source.schema, torch.device("cpu"))
    assert isinstance(model, DLRM)
    assert model.bottom is not None and not model.concat_embeddings
    dense, embedded, labels = [], [], []
    with torch.no_grad():
        for batch in source.train_batches(1024):
            dense.append(batch.dense)
            embedded.append(model.sparse(batch.sparse).stacked())  # [B, T, D], held fixed
            labels.append(batch.labels)
            if sum(len(d) for d in dense) >= rows:
                break
    x, e, y = (torch.cat(t)[:rows] for t in (dense, embedded, labels))
    bottom, interaction, top = model.bottom, model.interaction, model.top

    def loss(index: torch.Tensor) -> torch.Tensor:
        # DLRM.forward after the lookup (dot interaction, bottom output concatenated)
        h = bottom(x[index])
        parts = [h, interaction(torch.cat([h.unsqueeze(1), e[index]], dim=1))]
        if top.input_padding:
            parts.append(h.new_zeros(len(index), top.input_padding))
        logits = top(torch.cat(parts, dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, y[index], reduction="none")

    params = [p for m in (bottom, interaction, top) for p in m.parameters()]
    return Problem(params, loss, rows)


def _first_within(trace: list[tuple[float, float]], target: float) -> float | None:
    """The cost at which the (cost, loss) trace first reaches ``target``."""
    return next((cost for cost, loss in trace if loss <= target), None)


def _run_lbfgs(
    problem: Problem,
    chunk: int,
    settings: PBLBFGSSettings,
    iterations: int,
    budget: float,
    seed: int,
    target: float = -1.0,
) -> list[tuple[float, float]]:
    """(gradient samples, full loss) after each iteration, until ``iterations``, the
    ``budget`` of gradient samples, or a loss at or below ``target``."""
    samples = TensorSamples(problem.loss, problem.params, problem.rows, chunk, seed=seed)
    optimizer = ProgressiveBatchLBFGS(problem.params, settings=settings)
    trace: list[tuple[float, float]] = []
    for _ in range(iterations):
        report = optimizer.iterate(samples)
        trace.append((report["grad_samples"], problem.full_loss()))
        if report["grad_samples"] >= budget or trace[-1][1] <= target:
            break
    return trace


def _run_dance(
    problem: Problem,
    chunk: int,
    settings: DanceSettings,
    iterations: int,
    budget: float,
    seed: int,
    target: float = -1.0,
) -> tuple[list[tuple[float, float]], list[dict[str, float]]]:
    """(data passes, full R_N) after each iteration, until ``iterations``, the ``budget``
    of passes, or R_N at or below ``target``; and the finished stages."""
    samples = TensorSamples(problem.loss, problem.params, problem.rows, chunk, seed=seed)
    optimizer = Dance(problem.params, settings=settings)
    l2 = settings.regularization * problem.rows**-settings.accuracy_exponent
    trace: list[tuple[float, float]] = []
    for _ in range(iterations):
        report = optimizer.iterate(samples)
        work = report["grad_samples"] + report["hvp_samples"] + report["loss_samples"]
        passes = work / problem.rows
        trace.append((passes, problem.full_loss(l2)))
        if passes >= budget or trace[-1][1] <= target:
            break
    return trace, optimizer.stages


def _run_adam(problem: Problem, chunk: int, lr: float, budget: float, seed: int) -> float:
    optimizer = torch.optim.Adam(problem.params, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    seen = 0.0
    while seen < budget:
        for index in torch.randperm(problem.rows, generator=generator).split(chunk):
            optimizer.zero_grad()
            problem.loss(index).mean().backward()
            optimizer.step()
            seen += len(index)
            if seen >= budget:
                break
    return problem.full_loss()


def _compare(problem: Problem, chunk: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    initial = [p.detach().clone() for p in problem.params]
    total = -(-problem.rows // chunk)
    big = 10**9

    full = _run_lbfgs(
        problem, chunk, PBLBFGSSettings(initial_chunks=total, max_chunks=total),
        args.lbfgs_iterations, big, seed,
    )  # fmt: skip
    final = full[-1][1]
    target = final + args.tolerance
    full_cost = _first_within(full, target)
    pb_runs = {}
    for theta in args.theta:
        problem.reset(initial)
        pb_settings = PBLBFGSSettings(initial_chunks=2, max_chunks=total, theta=theta)
        pb = _run_lbfgs(
            problem, chunk, pb_settings, 10 * args.lbfgs_iterations, full[-1][0], seed, target
        )
        cost = _first_within(pb, target)
        pb_runs[f"theta={theta:g}"] = {
            "last_loss": pb[-1][1],
            "grad_samples_to_final": cost,
            "vs_lbfgs": cost / full_cost if cost and full_cost else None,
            "grad_samples_total": pb[-1][0],
        }
    problem.reset(initial)
    adam = _run_adam(problem, chunk, args.adam_lr, full[-1][0], seed)

    problem.reset(initial)
    newton_settings = DanceSettings(initial_chunks=total, max_chunks=total)
    newton, _ = _run_dance(problem, chunk, newton_settings, args.newton_iterations, big, seed)
    newton_final = newton[-1][1]
    newton_cost = _first_within(newton, newton_final + args.tolerance)
    problem.reset(initial)
    dance_settings = DanceSettings(initial_chunks=1, max_chunks=total)
    dance, stages = _run_dance(
        problem, chunk, dance_settings, 10 * args.newton_iterations, newton[-1][0], seed,
        newton_final + args.tolerance,
    )  # fmt: skip
    dance_cost = _first_within(dance, newton_final + args.tolerance)
    problem.reset(initial)
    return {
        "lbfgs_final_loss": final,
        "lbfgs_grad_samples_to_final": full_cost,
        "lbfgs_grad_samples_total": full[-1][0],
        "pb_lbfgs": pb_runs,
        "adam_loss_at_lbfgs_budget": adam,
        "newton_cg_final_loss": newton_final,
        "newton_cg_passes_to_final": newton_cost,
        "newton_cg_passes_total": newton[-1][0],
        "dance_last_loss": dance[-1][1],
        "dance_passes_to_final": dance_cost,
        "dance_vs_newton_cg": dance_cost / newton_cost if dance_cost and newton_cost else None,
        "dance_stages": stages,
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-seed results and, per ratio, its mean and worst over the seeds (None when
    a seed never came within the tolerance)."""
    ratios = {"dance_vs_newton_cg": [r["dance_vs_newton_cg"] for r in runs]}
    for theta in runs[0]["pb_lbfgs"]:
        ratios[f"pb_lbfgs_{theta}_vs_lbfgs"] = [r["pb_lbfgs"][theta]["vs_lbfgs"] for r in runs]
    out: dict[str, Any] = {}
    for key, values in ratios.items():
        out[f"{key}_mean"] = statistics.mean(values) if None not in values else None
        out[f"{key}_max"] = max(values) if None not in values else None
    out["seeds"] = runs
    return out


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--problems", default="logistic,dlrm_dense", help="comma list")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1 << 20, help="samples of logistic")
    parser.add_argument("--dlrm-rows", type=int, default=65536, help="samples of dlrm_dense")
    parser.add_argument(
        "--dlrm-chunk", type=int, default=1024, help="samples per chunk of dlrm_dense"
    )
    parser.add_argument("--dim", type=int, default=20, help="features of logistic")
    parser.add_argument("--chunk", type=int, default=4096, help="samples per chunk")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument(
        "--theta",
        type=lambda text: [float(v) for v in comma_list(text)],
        default=[PBLBFGSSettings().theta, 0.1],
        help="PB-L-BFGS inner-product test thetas to compare (comma list)",
    )
    parser.add_argument("--lbfgs-iterations", type=int, default=15)
    parser.add_argument("--newton-iterations", type=int, default=10)
    parser.add_argument("--adam-lr", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=None)


@keeps_process_settings
def _run(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    result: dict[str, Any] = {"machine": machine_info(), "settings": vars(args).copy()}
    result["settings"].pop("func", None)
    for name in args.problems.split(","):
        runs = []
        for seed in range(args.seeds):
            if name == "logistic":
                problem = logistic_problem(args.rows, args.dim, seed)
            elif name == "dlrm_dense":
                problem = dlrm_dense_problem(args.dlrm_rows, seed)
            else:
                raise ValueError(f"--problems: unknown problem {name!r}; use logistic, dlrm_dense")
            chunk = args.chunk if name == "logistic" else args.dlrm_chunk
            runs.append(_compare(problem, chunk, args, seed))
        result[name] = _summary(runs)
    return result


BENCHMARK = Benchmark(
    help="PB-L-BFGS and DANCE vs full-batch L-BFGS / Newton-CG and Adam: gradient evaluations, data passes",
    add_arguments=_add_arguments,
    run=_run,
)
