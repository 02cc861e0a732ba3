"""``towerrec plan --profile PROFILE``: each table's memory tier and cache fraction.

    towerrec data profile CACHE_DIR                         the locality profile first
    towerrec plan --profile CACHE_DIR --host-memory 64 --ssd-capacity 512
    towerrec plan --profile p.json --write-config tiers.toml --backing-path /mnt/ssd/x

Capacities: ``--device-memory`` (GiB per rank; default ``plan.device_memory_gib``
or the topology preset's), ``--host-memory`` and ``--ssd-capacity`` (GiB per
host; 0 = no SSD), ``plan.hosts`` hosts. Speeds: the preset's, or the
``storage`` section of the calibration (``--calibrate`` measures it in
``--ssd-path``). Prints one line per table (planner/tiers.py), the hosts the model
needs with and without the SSD tier, and the config keys of the cache as TOML.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from towerrec.build.planning import build_cost_model
from towerrec.config import Config
from towerrec.data.profile import LocalityProfile
from towerrec.planner.tier_spec import TierSpec, tier_spec_for
from towerrec.planner.tiers import TierPlan, hosts_needed, plan_tiers
from towerrec.planner.topology import GiB

__all__ = ["TIER_ONLY", "add_tier_arguments", "run_tiers"]

MiB = float(1 << 20)
# Options that mean something only with --profile (None when not given).
TIER_ONLY = (
    "device_memory", "host_memory", "ssd_capacity", "ssd_io_depth", "batch_size", "write_config",
)  # fmt: skip


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
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
    topology = build_cost_model(config, world_size).topology
    storage = None
    if config.plan.calibration:
        data = json.loads(Path(config.plan.calibration).read_text())
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
    c = build_cost_model(config, world_size).constants
    dim = config.model.embedding_dim
    return dim * (c.bytes_per_value + c.optimizer_bytes_per_value) + c.optimizer_bytes_per_row


def _hosts(value: int | None) -> str:
    return "more than 65536" if value is None else str(value)


def tier_table(plan: TierPlan, needed: dict[str, Any], budget_ms: float) -> str:
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


def run_tiers(config: Config, args: argparse.Namespace) -> int:
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
    print(tier_table(plan, needed, args.step_budget_ms))
    print()
    print(toml, end="")
    if args.write_config:
        print(f"\nconfig keys written to {args.write_config}")
    return 0
