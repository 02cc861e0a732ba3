"""``towerrec bench temporal``: next-period log-loss of the ``train.temporal``
strategies (batch, incremental, fgd) on drifting and stationary synthetic streams.

Streams (``--streams``): ``drifting`` (``drift_mode`` random: towards a fresh teacher
each period), ``trend`` (``drift_mode`` trend: along one fixed direction; both with
``--drift`` and ``--id-turnover``), ``stationary`` and ``movielens`` (the bundled
ratings by timestamp in ``--periods`` periods of equal count; the seed varies the
model only). Strategies: ``batch``,
``incremental``, ``fgd`` (the config's generator) and ``fgd-mlp``, ``fgd-linear`` (fgd
with that generator). Each (stream, seed, strategy) is one ``run_replay`` (train
through period t, score period t+1); the result holds every period's log-loss, the
mean over periods and seeds, the wall time (batch's grows with the periods), and each
fgd's relative difference to the others: ``fgd / other - 1`` of the mean next-period
log-loss (negative: fgd better). The spec's target: <= -2 % against batch on drifting
streams, within 0.2 % on the stationary one.

``foresight`` (synthetic streams) is a reference, not a strategy a user can run: at
period t it trains one pass, as incremental, on fresh rows of period t+1's own
distribution (another draw of the stream, ``stream_seed`` + 1, with period t+1's teacher
and ids), then is scored on period t+1 as the others are. It is what knowing the next
period would give at incremental's data and steps: the gain a perfect forecast of the
next period's gradient could aim at (a forecast could still do better by being less
noisy than one pass over a sample). ``foresight_relative`` is its difference to the
others.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from towerrec.bench.common import Benchmark, add_overrides_argument, comma_list, machine_info
from towerrec.config import Config, load_config
from towerrec.data.batch import Batch, DataSchema
from towerrec.data.synthetic import SyntheticSource
from towerrec.workflows.replay.replay import run_replay

__all__ = ["BENCHMARK"]

STRATEGIES = ("batch", "incremental", "fgd", "foresight", "fgd-mlp", "fgd-linear")
STREAMS = ("drifting", "trend", "stationary", "movielens")
DEFAULT_STRATEGIES = STRATEGIES[:4]  # batch, incremental, fgd, foresight


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=3, help="seeds per stream and strategy")
    parser.add_argument("--periods", type=int, default=6)
    parser.add_argument("--period-samples", type=int, default=20_000)
    parser.add_argument("--drift", type=float, default=0.2, help="the drifting stream's drift")
    parser.add_argument(
        "--id-turnover", type=float, default=0.05, help="the drifting stream's id turnover"
    )
    parser.add_argument(
        "--strategies",
        type=comma_list,
        default=DEFAULT_STRATEGIES,
        help=f"comma-separated, of {', '.join(STRATEGIES)}",
    )
    parser.add_argument(
        "--streams",
        type=comma_list,
        default=STREAMS,
        help=f"comma-separated, of {', '.join(STREAMS)}",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_overrides_argument(parser)


def _run(args: argparse.Namespace) -> dict:
    if args.seeds < 1 or args.periods < 2:
        raise ValueError("--seeds must be >= 1 and --periods >= 2")
    for name in args.strategies:
        if name not in STRATEGIES:
            raise ValueError(f"--strategies: {name!r} is not one of {', '.join(STRATEGIES)}")
    for name in args.streams:
        if name not in STREAMS:
            raise ValueError(f"--streams: {name!r} is not one of {', '.join(STREAMS)}")
    moving = [
        f"data.synthetic.drift={args.drift}",
        f"data.synthetic.id_turnover={args.id_turnover}",
    ]
    every = {
        "drifting": [*moving, "data.synthetic.drift_mode=random"],
        "trend": [*moving, "data.synthetic.drift_mode=trend"],
        "stationary": ["data.synthetic.drift=0", "data.synthetic.id_turnover=0"],
        "movielens": ["data.source=movielens", f"data.movielens.periods={args.periods}"],
    }
    streams = {name: every[name] for name in args.streams}
    base = [
        f"data.synthetic.periods={args.periods}",
        f"data.synthetic.period_samples={args.period_samples}",
        f"train.threads={args.threads}",
        "train.progress=false",
        *args.overrides,
    ]
    result: dict = {
        "machine": machine_info(),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }
    for stream, drift in streams.items():
        runs: dict[str, list[dict]] = {}
        for strategy in args.strategies:
            if strategy == "foresight" and stream == "movielens":
                continue  # no second draw of a period's ratings
            for seed in range(args.seeds):
                overrides = [
                    *base,
                    *drift,
                    f"data.synthetic.seed={seed}",
                    f"train.seed={seed}",
                    *_strategy(strategy),
                ]
                _, summary = _replay(load_config(None, overrides), strategy)
                runs.setdefault(strategy, []).append(
                    {
                        "seed": seed,
                        "logloss": [r["logloss"] for r in summary["results"]],
                        "auc": [r["auc"] for r in summary["results"]],
                        "mean_logloss": summary["mean"]["logloss"],
                        "mean_auc": summary["mean"]["auc"],
                        "steps": summary["steps"],
                        "wall_s": summary["wall_s"],
                        **(
                            {"fgd_generator": summary["fgd_generator"]}
                            if strategy.startswith("fgd")
                            else {}
                        ),
                    }
                )
        means = {s: statistics.fmean(r["mean_logloss"] for r in rs) for s, rs in runs.items()}
        out: dict = {"mean_logloss": means, "runs": runs}
        fgds = [s for s in means if s.startswith("fgd")]
        out["fgd_relative"] = {
            f: {f"vs_{s}": means[f] / means[s] - 1 for s in means if s != f} for f in fgds
        }
        if "foresight" in means:
            out["foresight_relative"] = {
                f"vs_{s}": means["foresight"] / means[s] - 1 for s in means if s != "foresight"
            }
        out["fgd_relative_per_seed"] = {
            f: {
                f"vs_{s}": [
                    a["mean_logloss"] / b["mean_logloss"] - 1
                    for a, b in zip(runs[f], runs[s], strict=True)
                ]
                for s in means
                if s != f
            }
            for f in fgds
        }
        result[stream] = out
    result["target"] = "fgd vs batch: <= -2 % on drifting and trend, |.| <= 0.2 % on stationary"
    return result


class _NextPeriod:
    """Period t is fresh rows of period t+1's distribution (the last period: its own),
    from another draw of the same synthetic stream (the module docstring's foresight)."""

    def __init__(self, draw: SyntheticSource) -> None:
        self.draw = draw

    @property
    def schema(self) -> DataSchema:
        return self.draw.schema

    @property
    def num_periods(self) -> int:
        return self.draw.num_periods

    def _next(self, period: int) -> int:
        return min(period + 1, self.num_periods - 1)

    def period_rows(self, period: int) -> int:
        return self.draw.period_rows(self._next(period))

    def period_batches(
        self, period: int, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]:
        return self.draw.period_batches(self._next(period), batch_size, rank, world_size)

    def period_oracle(self, period: int) -> tuple[np.ndarray, np.ndarray] | None:
        return None


def _replay(config: Config, strategy: str) -> tuple[object, dict]:
    """``run_replay`` of ``config`` (``strategy``'s overrides applied); the foresight
    reference trains on ``_NextPeriod`` of another draw of the stream."""
    if strategy != "foresight":
        return run_replay(config, progress=False)
    synthetic = config.data.synthetic
    draw = SyntheticSource(replace(synthetic, stream_seed=synthetic.stream_seed + 1))
    return run_replay(config, progress=False, train_periods=_NextPeriod(draw))


def _strategy(name: str) -> list[str]:
    """The overrides of a strategy of ``--strategies``."""
    if name == "foresight":
        return ["train.temporal.strategy=incremental"]
    if name.startswith("fgd-"):
        return ["train.temporal.strategy=fgd", f"train.temporal.fgd_generator={name[4:]}"]
    return [f"train.temporal.strategy={name}"]


BENCHMARK = Benchmark(
    help="next-period log-loss of batch, incremental and fgd updates on drifting (random "
    "and trend) and stationary synthetic periods",
    add_arguments=_add_arguments,
    run=_run,
)
