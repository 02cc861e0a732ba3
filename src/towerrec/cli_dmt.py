"""``towerrec bench dmt``: flat DLRM vs DMT on two (simulated) hosts, JSON on stdout."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["add_bench_dmt_command"]


def _cmd_bench_dmt(args: argparse.Namespace) -> int:
    from towerrec.bench.dmt import run_dmt_benchmark

    result = run_dmt_benchmark(
        network=args.network,
        steps=args.steps,
        batch_size=args.batch_size,
        embedding_dim=args.embedding_dim,
        threads=args.threads,
        link_gbit=args.link_gbit,
        link_delay_ms=args.link_delay_ms,
        rounds=args.rounds,
        variants=[v for v in args.variants.split(",") if v],
        overrides=args.overrides,
        work_dir=args.work_dir,
        timeout_s=args.timeout_s,
    )
    print(json.dumps(result, indent=2))
    return 0


def add_bench_dmt_command(bench_sub: argparse._SubParsersAction) -> None:
    from towerrec.bench.dmt import VARIANTS

    b = bench_sub.add_parser(
        "dmt",
        help="flat DLRM vs DMT on 2 hosts x 2 ranks: bytes, peers, AUC, samples/s "
        "(--network netns: two network namespaces over a shaped link; root)",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object (always on)")
    b.add_argument(
        "--network",
        default="local",
        help="local: 4 processes on loopback; netns: 2 namespaces of 2 ranks, shaped veth (root)",
    )
    b.add_argument("--link-gbit", type=float, default=1.0, help="netns link rate, Gbit/s each way")
    b.add_argument("--link-delay-ms", type=float, default=0.0, help="netns one-way link delay")
    b.add_argument("--steps", type=int, default=300, help="training steps per variant")
    b.add_argument("--batch-size", type=int, default=4096, help="global batch (4 ranks)")
    b.add_argument("--embedding-dim", type=int, default=64)
    b.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: default)")
    b.add_argument("--rounds", type=int, default=1, help="runs of every variant, interleaved")
    b.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of " + ", ".join(VARIANTS),
    )
    b.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="config override for every variant",
    )
    b.add_argument("--work-dir", type=Path, help="keep the runs' directories here")
    b.add_argument("--timeout-s", type=float, default=1800.0, help="per training run")
    b.set_defaults(func=_cmd_bench_dmt)
