"""``towerrec plan``: plan a sharding, print it per device, write the JSON and a chart;
with ``--profile``, plan memory tiers; ``plan collect-costs | train-policy``, the
learned planners' data and weights.

Tables come from the run config's data source (statistics measured on a few
batches), a statistics JSON (``--stats``) or a synthetic DLRM-like suite
(``--suite N``); the topology from the ``plan`` config section and
``--world-size``. ``--calibrate`` first measures this machine's kernels and
collectives (and the SSD and host memory, for tiers) and plans with the measured
constants.

Memory tiers (``--profile PROFILE``): each table's memory tier and cache fraction::

    towerrec data profile CACHE_DIR                         the locality profile first
    towerrec plan --profile CACHE_DIR --host-memory 64 --ssd-capacity 512
    towerrec plan --profile p.json --write-config tiers.toml --backing-path /mnt/ssd/x

Capacities: ``--device-memory`` (GiB per rank; default ``plan.device_memory_gib``
or the topology preset's), ``--host-memory`` and ``--ssd-capacity`` (GiB per
host; 0 = no SSD), ``plan.hosts`` hosts. Speeds: the preset's, or the
``storage`` section of the calibration (``--calibrate`` measures it in
``--ssd-path``). Prints one line per table (planner/tiers.py), the hosts the model
needs with and without the SSD tier, and the config keys of the cache as TOML.

The learned planners' data and weights::

    towerrec plan collect-costs --out costs.json --devices 400 --seed 0
        measure random multi-table devices (forward, backward + update) and
        all-to-alls on this machine: the cost-data file (planner/costdata.py)
    towerrec plan train-policy --planner neuroshard --cost-data costs.json --out DIR --seed 0
        pre-train the planner's cost models on it: DIR/<planner>.pt + DIR/<planner>.json
        (dreamshard, autoshard: the cost network, then the placement policy trained on
        its estimates: DIR/<planner>.pt)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from towerrec.cli.common import add_config_args

if TYPE_CHECKING:
    from towerrec.config import Config
    from towerrec.planner.tier_spec import TierSpec
    from towerrec.planner.tiers import TierPlan

__all__ = ["add_commands"]

log = logging.getLogger("towerrec")


def add_commands(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan", help="shard embedding tables over devices: per-device table, plan JSON, chart"
    )
    add_config_args(parser)
    parser.add_argument("--world-size", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument(
        "--planner",
        help="override plan.planner (search, lpt, greedy_*, random, neuroshard, dreamshard, "
        "autoshard)",
    )
    tables = parser.add_mutually_exclusive_group()
    tables.add_argument("--stats", type=Path, help="table statistics JSON instead of the data")
    tables.add_argument(
        "--suite", type=int, metavar="N", help="a synthetic DLRM-like suite of N tables"
    )
    parser.add_argument("--save-stats", type=Path, help="write the table statistics used here")
    parser.add_argument("--out", type=Path, default=Path("plan.json"), help="plan JSON to write")
    parser.add_argument("--png", type=Path, help="bar chart (default: --out with .png)")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's kernels and collectives (and the SSD at --ssd-path, host "
        "memory copies) first and plan with the result",
    )
    parser.add_argument(
        "--calibration-out",
        type=Path,
        default=Path("calibration.json"),
        help="where --calibrate writes the constants (plan.calibration reads them)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary, not the table")
    _add_tier_arguments(parser)
    parser.set_defaults(func=_cmd_plan)
    _add_learned_commands(
        parser.add_subparsers(
            dest="plan_command", title="learned planners' data and weights", required=False
        )
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from towerrec import calibration
    from towerrec.build.planning import plan_source
    from towerrec.build.sources import build_source
    from towerrec.config import load_config
    from towerrec.planner.report import device_table, write_bar_chart
    from towerrec.planner.stats import load_stats, save_stats, stats_from_source
    from towerrec.planner.suites import dlrm_like_suite

    config = load_config(args.config, args.overrides)
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    if args.planner:
        config = replace(config, plan=replace(config.plan, planner=args.planner))
    if args.calibrate:
        report = calibration.calibrate()
        # The SSD and host memory speeds the tier planner uses (a few seconds).
        storage_path = args.ssd_path or Path(args.calibration_out).resolve().parent
        report["storage"] = calibration.measure_storage(storage_path)
        Path(args.calibration_out).write_text(json.dumps(report, indent=2) + "\n")
        log.info("calibration written to %s", args.calibration_out)
        config = replace(config, plan=replace(config.plan, calibration=str(args.calibration_out)))
    if args.profile:
        ignored = [name for name in ("stats", "suite", "save_stats", "png", "planner")
                   if vars(args)[name]]  # fmt: skip
        if ignored:
            log.warning(
                "--profile plans memory tiers, not a sharding: ignoring %s",
                ", ".join("--" + name.replace("_", "-") for name in ignored),
            )
        return _run_tiers(config, args)
    tier_only = [name for name in TIER_ONLY if vars(args)[name] is not None]
    if tier_only:
        log.warning(
            "%s only apply to tier planning: add --profile PROFILE (ignored now)",
            ", ".join("--" + name.replace("_", "-") for name in tier_only),
        )
    source = None
    if args.stats:
        stats = load_stats(args.stats)
    elif args.suite:
        stats = dlrm_like_suite(args.suite, batch_size=config.train.batch_size)
    else:
        source = build_source(config.data)
        stats = None
    result = plan_source(config, source, args.world_size, stats)
    if args.save_stats:
        save_stats(
            stats
            or stats_from_source(
                source,
                config.model.embedding_dim,
                config.plan.stats_batch_size,
                config.plan.stats_batches,
            ),
            args.save_stats,
        )
    result.plan.save(args.out)
    png = args.png or Path(args.out).with_suffix(".png")
    write_bar_chart(result, png)
    if args.json:
        print(json.dumps({**result.summary(), "plan": str(args.out), "chart": str(png)}, indent=2))
    else:
        print(device_table(result))
        print(f"plan written to {args.out}, chart to {png}")
    return 0


# Memory tiers: `towerrec plan --profile PROFILE`.

MiB = float(1 << 20)
# Options that mean something only with --profile (None when not given).
TIER_ONLY = (
    "device_memory", "host_memory", "ssd_capacity", "ssd_io_depth", "batch_size", "write_config",
)  # fmt: skip


def _add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    tiers = parser.add_argument_group("memory tiers (with --profile)")
    tiers.add_argument(
        "--profile",
        type=Path,
        help="plan memory tiers from a locality profile (`towerrec data profile`; a file, or a "
        "cache directory holding one) instead of a sharding",
    )
    tiers.add_argument("--device-memory", type=float, metavar="GIB", help="per rank")
    tiers.add_argument("--host-memory", type=float, metavar="GIB", help="per host")
    tiers.add_argument(
        "--ssd-capacity", type=float, metavar="GIB", help="per host (0: no SSD tier)"
    )
    tiers.add_argument("--ssd-io-depth", type=int, help="random SSD reads in flight (default 32)")
    tiers.add_argument(
        "--batch-size", type=int, help="global batch of a step (default: the profile's)"
    )
    tiers.add_argument(
        "--step-budget-ms",
        type=float,
        default=10.0,
        help="time a step may spend moving missed rows, for the hosts-needed estimate",
    )
    tiers.add_argument(
        "--backing-path", default="", help="embedding.tables.<t>.backing_path of SSD tables"
    )
    tiers.add_argument("--write-config", type=Path, help="write the tiers' config keys (TOML)")
    tiers.add_argument(
        "--ssd-path",
        type=Path,
        help="folder on the SSD that --calibrate times (default: --calibration-out's folder)",
    )


def _spec(config: Config, args: argparse.Namespace, world_size: int) -> TierSpec:
    from towerrec.build.planning import build_cost_model
    from towerrec.planner.cost import read_calibration
    from towerrec.planner.tier_spec import tier_spec_for
    from towerrec.planner.topology import GiB

    topology = build_cost_model(config, world_size).topology
    storage = None
    if config.plan.calibration:
        data = read_calibration(Path(config.plan.calibration))
        storage = data.get("storage") if isinstance(data, dict) else None
    if args.device_memory is not None:
        topology = replace(topology, device_memory=args.device_memory * GiB)
    if args.host_memory is not None:
        topology = replace(topology, host_memory=args.host_memory * GiB)
    spec = tier_spec_for(topology, storage)
    if args.ssd_capacity is not None:
        spec = replace(spec, ssd_capacity=args.ssd_capacity * GiB)
    if args.ssd_io_depth is not None:
        spec = replace(spec, ssd_io_depth=args.ssd_io_depth)
    return spec


def _row_bytes(config: Config, world_size: int) -> int:
    from towerrec.build.planning import build_cost_model

    c = build_cost_model(config, world_size).constants
    dim = config.model.embedding_dim
    return dim * (c.bytes_per_value + c.optimizer_bytes_per_value) + c.optimizer_bytes_per_row


def _hosts(value: int | None) -> str:
    return "more than 65536" if value is None else str(value)


def _tier_table(plan: TierPlan, needed: dict[str, Any], budget_ms: float) -> str:
    from towerrec.planner.topology import GiB

    lines = [
        f"{'table':<14} {'rows':>12} {'MiB':>9} {'memory':>7} {'backing':>7} {'fraction':>9} "
        f"{'cache rows':>11} {'hit rate':>8} {'misses/step':>11} {'ms/step':>8}"
    ]
    for t in plan.tables:
        lines.append(
            f"{t.name[:14]:<14} {t.num_embeddings:>12,} {t.table_bytes / MiB:>9.1f} "
            f"{t.memory:>7} {t.backing or '-':>7} {t.cache_fraction:>9.4f} {t.cache_rows:>11,} "
            f"{t.hit_rate:>8.1%} {t.misses_per_step:>11,.0f} {t.seconds_per_step * 1e3:>8.3f}"
        )
    spec = plan.spec
    used = ", ".join(
        f"{tier} {plan.used(tier) / GiB:.3g} of {cap / GiB:.3g} GiB"
        for tier, cap in (
            ("device", spec.device_memory),
            ("host", spec.host_memory),
            ("ssd", spec.ssd_capacity),
        )
    )
    lines.append(
        f"{plan.hosts} host(s), batch {plan.batch_size}: {used}; predicted "
        f"{plan.step_seconds * 1e3:.3f} ms/step moving missed rows (speeds: {spec.source})"
    )
    w, s2 = needed["without_ssd"], needed["with_ssd"]
    lines.append(
        f"hosts needed: without SSD {_hosts(w['capacity'])} to hold the model, "
        f"{_hosts(w['hosts'])} to also move its misses within {budget_ms:g} ms/step; with SSD "
        f"{_hosts(s2['capacity'])} and {_hosts(s2['hosts'])}"
    )
    return "\n".join(lines)


def _run_tiers(config: Config, args: argparse.Namespace) -> int:
    from towerrec.data.profile import LocalityProfile
    from towerrec.planner.tiers import hosts_needed, plan_tiers

    profile = LocalityProfile.load(args.profile)
    spec = _spec(config, args, args.world_size)
    per_row = _row_bytes(config, args.world_size)
    row_bytes = {t.name: per_row for t in profile.tables}
    batch = args.batch_size or profile.batch_size
    tables = list(profile.tables)
    plan = plan_tiers(tables, row_bytes, spec, batch, config.plan.hosts)
    budget = args.step_budget_ms / 1e3
    if not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"--step-budget-ms must be > 0, got {args.step_budget_ms}")
    needed = hosts_needed(tables, row_bytes, spec, batch, budget)
    toml = plan.to_toml(args.backing_path)
    if args.write_config:
        Path(args.write_config).write_text(toml)
    if args.json:
        out = {**plan.as_dict(), "hosts_needed": needed, "step_budget_ms": args.step_budget_ms}
        out["config"] = str(args.write_config) if args.write_config else None
        print(json.dumps(out, indent=2))
        return 0
    print(_tier_table(plan, needed, args.step_budget_ms))
    print()
    print(toml, end="")
    if args.write_config:
        print(f"\nconfig keys written to {args.write_config}")
    return 0


# The learned planners' data and weights: `towerrec plan collect-costs | train-policy`.


def _add_learned_commands(actions: argparse._SubParsersAction) -> None:
    collect = actions.add_parser(
        "collect-costs",
        help="measure multi-table kernel and all-to-all costs for the learned planners",
    )
    collect.add_argument("--out", type=Path, required=True, help="cost-data JSON to write")
    collect.add_argument(
        "--devices", type=int, default=400, help="random devices to time (default 400)"
    )
    collect.add_argument(
        "--comm", type=int, default=60, help="random all-to-alls to time (default 60)"
    )
    collect.add_argument(
        "--batch",
        type=int,
        default=2048,
        help="samples a device's kernel processes, and each rank's in the all-to-all (2048)",
    )
    collect.add_argument(
        "--reps", type=int, default=5, help="timed runs per sample, the fastest kept (5)"
    )
    collect.add_argument("--seed", type=int, default=0, help="draws the samples (default 0)")
    collect.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "torch", "fbgemm"),
        help="embedding kernel to time (default auto: this machine's choice)",
    )
    collect.set_defaults(func=_cmd_collect)

    train = actions.add_parser(
        "train-policy", help="pre-train a learned planner's models on a cost-data file"
    )
    train.add_argument(
        "--planner", required=True, choices=tuple(TRAINERS), help="which planner to train"
    )
    train.add_argument(
        "--cost-data", type=Path, required=True, help="from `towerrec plan collect-costs`"
    )
    train.add_argument(
        "--out", type=Path, required=True, help="directory for <planner>.pt and <planner>.json"
    )
    train.add_argument("--seed", type=int, default=0, help="initialisation and split (0)")
    train.add_argument(
        "--steps", type=int, default=1500, help="optimizer steps per model (neuroshard)"
    )
    train.set_defaults(func=_cmd_train_policy)


def _cmd_collect(args: argparse.Namespace) -> int:
    from towerrec.calibration.cost_data import collect_cost_data

    if args.devices < 0 or args.comm < 0:
        raise ValueError(f"--devices ({args.devices}) and --comm ({args.comm}) must be >= 0")
    data = collect_cost_data(
        args.devices, args.comm, args.batch, args.reps, args.seed, args.backend
    )
    data.save(args.out)
    print(
        f"cost data written to {args.out}: {len(data.compute)} devices, "
        f"{len(data.comm)} all-to-alls, {data.kernel} kernel"
    )
    return 0


def _train_neuroshard(args: argparse.Namespace) -> Path:
    from towerrec.planner.costdata import CostData
    from towerrec.planner.neuroshard import train_neuroshard, write_policy

    data = CostData.load(args.cost_data)
    policy = train_neuroshard(data, seed=args.seed, steps=args.steps)
    info = policy.info
    log.info(
        "neuroshard: held-out median relative error %.3f (compute), %.3f (all-to-all fit)",
        info["compute_held_out_median_rel_error"],
        info["comm_median_rel_error"],
    )
    return write_policy(policy, data, args.cost_data, args.out)


def _train_placement_policy(args: argparse.Namespace) -> Path:
    """DreamShard or AutoShard: the policy trained on the cost network's estimates."""
    from towerrec.planner.learned_planners import train_policy

    args.out.mkdir(parents=True, exist_ok=True)
    return train_policy(args.planner, args.cost_data, args.out, seed=args.seed)


TRAINERS = {
    "neuroshard": _train_neuroshard,
    "dreamshard": _train_placement_policy,
    "autoshard": _train_placement_policy,
}


def _cmd_train_policy(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    weights = TRAINERS[args.planner](args)
    record = weights.with_suffix(".json")
    also = f" (and {record})" if record.exists() else ""
    print(f"{args.planner} weights written to {weights}{also}")
    return 0
