"""``towerrec bench dmt``: flat DLRM vs Disaggregated Multi-Tower on 2 hosts x 2 ranks.

Every variant is one ordinary ``towerrec train`` run (``bench/dmt_runs.py``) on the
same data and shape (only the overrides below differ); its ``summary.json`` gives
samples/s (training steps after a warm-up of ``WARMUP_STEPS``: no start-up, pilot run
or evaluation), AUC, bytes per sample, intra- and cross-host, and rank 0's collective
calls per training step (``collective_calls_per_step``).

A *case* is one embedding dim (``--embedding-dim 16,64``) on one link: loopback
(``--network local``), or each rate of ``--link-gbit 1,0.5,0.2`` and the unshaped veth
(``--network netns``, root), the same two namespaces re-shaped between runs. The
unshaped case is the reference that flat's cross-host time is measured against
(``dmt_report.link_bounds``). Runs are interleaved, round by round, seed by seed
(``--seeds``: ``train.seed``), dim by dim, link by link, so that drift in the machine's
speed hits every variant alike. ``bench/dmt_report.py`` turns the summaries into the
report: one entry of ``cases`` per (dim, link), and ``link_bounds`` per shaped rate.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import tempfile
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from towerrec.bench.common import Benchmark, add_overrides_argument, comma_list
from towerrec.bench.dmt_report import ALLREDUCE_SEPARATOR, assemble_report, link_bounds
from towerrec.bench.dmt_runs import HOSTS, RANKS_PER_HOST, run_local, run_netns
from towerrec.bench.netns import LinkConfig, two_host_network
from towerrec.config import ModelConfig

__all__ = [
    "BENCHMARK",
    "NETWORKS",
    "VARIANTS",
    "WARMUP_STEPS",
    "bench_overrides",
    "run_dmt_benchmark",
]

# distributed.dense_allreduce kinds (distributed/dense_allreduce.py; bench/ may not import it)
DENSE_ALLREDUCE = ("ring", "hierarchical")
# The first steps pay one-off costs (connections of new process groups, allocator and
# DDP warm-up); samples/s is measured from the train records after this many steps.
WARMUP_STEPS = 5
NETWORKS = ("local", "netns")

# variant -> (layout, overrides); compressing towers: the model's defaults (`dot`, one
# D-vector per 4 of a tower's features: 2 and 1 for the 5 and 4 features of the 2 towers)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "flat_table_wise": (
        "flat_table_wise",
        ("model.name=dlrm", "distributed.sharding=table_wise"),
    ),
    "flat_table_row_wise": (
        "flat_table_row_wise",
        ("model.name=dlrm", "distributed.sharding=table_row_wise"),
    ),
    "dmt_identity": ("dmt", ("model.name=dmt", "model.dmt.tower=identity")),
    "dmt_partitioner": (
        "dmt",
        ("model.name=dmt", "model.dmt.tower=dot"),
    ),
    "dmt_random": (
        "dmt",
        (
            "model.name=dmt",
            "model.dmt.tower=dot",
            "model.dmt.partition=random",
        ),
    ),
}


def default_embedding_dim() -> int:
    """The model's default ``model.embedding_dim``: what ``bench dmt`` measures unless told."""
    return ModelConfig().embedding_dim


def bench_overrides(
    steps: int, batch_size: int, embedding_dim: int, threads: int, warmup: int = WARMUP_STEPS
) -> tuple[str, ...]:
    """The shape every variant trains: the synthetic default data (9 features), evaluation
    only at the end, a train record every ``warmup`` steps (the first one, warm-up, is left
    out of samples/s), fp32: ``train.precision = "auto"`` times each variant's own dense
    part and could give the layouts different precisions (each run's resolved precision
    and kernel are in its row, ``precision`` and ``backend``)."""
    return (
        f"train.steps={steps}",
        "train.precision=fp32",
        f"train.batch_size={batch_size}",
        f"train.threads={threads}",
        "train.eval_every=0",
        f"train.log_every={warmup}",
        "train.checkpoint_every=0",
        "train.progress=false",
        f"model.embedding_dim={embedding_dim}",
        f"model.bottom_mlp=[64, {embedding_dim}]",
        f"model.dmt.num_towers={HOSTS}",
    )


def _check_args(
    network: str,
    steps: int,
    batch_size: int,
    embedding_dims: Sequence[int],
    rounds: int,
    variants,
    dense_allreduce: Sequence[str] = ("ring",),
    link_gbits: Sequence[float] = (1.0,),
    seeds: Sequence[int] = (),
) -> None:
    bad = [k for k in dense_allreduce if k not in DENSE_ALLREDUCE]
    if bad or not dense_allreduce or len(set(dense_allreduce)) < len(dense_allreduce):
        raise ValueError(
            f"--dense-allreduce {','.join(dense_allreduce)!r}: give distinct kinds from "
            f"{', '.join(DENSE_ALLREDUCE)}"
        )
    if network not in NETWORKS:
        raise ValueError(f"--network {network!r}: use one of {', '.join(NETWORKS)}")
    if steps <= 2 * WARMUP_STEPS:
        raise ValueError(
            f"--steps must be > {2 * WARMUP_STEPS}: the first {WARMUP_STEPS} are warm-up, "
            f"left out of samples/s; got {steps}"
        )
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    world = HOSTS * RANKS_PER_HOST
    if batch_size < world or batch_size % world:
        raise ValueError(
            f"--batch-size {batch_size} is the global batch of {world} ranks: use a multiple "
            f"of {world}"
        )
    if not embedding_dims or any(d < 1 for d in embedding_dims):
        raise ValueError(
            f"--embedding-dim must be >= 1 (a comma list: 16,64), got {list(embedding_dims)}"
        )
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"--seeds must be distinct, got {list(seeds)}")
    if network == "netns":
        if not link_gbits or len(set(link_gbits)) < len(link_gbits):
            raise ValueError(
                f"--link-gbit: give distinct rates (a comma list: 1,0.5,0.2), got {link_gbits}"
            )
        for gbit in link_gbits:
            LinkConfig(gbit)  # the rate's own check
    if (
        any(VARIANTS[v][0] == "dmt" for v in variants if v in VARIANTS)
        and not has_tower_transform()
    ):
        raise ValueError(
            "the DMT variants need the multi-process tower transform "
            "(towerrec.distributed.towers), which this installation lacks; run the flat "
            "variants only: --variants flat_table_wise,flat_table_row_wise"
        )
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(
            f"--variants: unknown {unknown or 'none given'}; choose from {', '.join(VARIANTS)}"
        )


def has_tower_transform() -> bool:
    """Whether this installation can run a DMT across hosts (else ``towerrec train`` would
    shard the DMT's tables like a flat model's, and the comparison would be meaningless)."""
    return importlib.util.find_spec("towerrec.distributed.towers") is not None


def _links(network: str, link_gbits: Sequence[float]) -> list[tuple[str, float | None]]:
    """The cases' links: (name, rate in Gbit/s or None)."""
    if network == "local":
        return [("loopback", None)]
    return [*((f"{g:g} Gbit/s", g) for g in link_gbits), ("unshaped", None)]


def run_dmt_benchmark(
    network: str = "local",
    steps: int = 300,
    batch_size: int = 4096,
    embedding_dims: Sequence[int] = (),
    threads: int = 1,
    link_gbits: Sequence[float] = (1.0,),
    link_delay_ms: float = 0.0,
    rounds: int = 1,
    variants: Sequence[str] = tuple(VARIANTS),
    overrides: Sequence[str] = (),
    work_dir: Path | None = None,
    timeout_s: float = 1800.0,
    dense_allreduce: Sequence[str] = ("ring",),
    seeds: Sequence[int] = (),
) -> dict[str, Any]:
    """Train every variant ``rounds`` times per seed, dim and link (interleaved, module
    doc); the report of ``bench/dmt_report.py`` per case, and the link bounds. With
    several ``dense_allreduce`` kinds every variant runs under each
    (``distributed.dense_allreduce``); the first kind's keep their names, the others' are
    ``<variant>+<kind>``. ``embedding_dims`` empty: the model's default dim; ``seeds``
    empty: the config's ``train.seed``."""
    dims = list(embedding_dims) or [default_embedding_dim()]
    _check_args(
        network, steps, batch_size, dims, rounds, list(variants), dense_allreduce,
        link_gbits, seeds,
    )  # fmt: skip
    kinds = list(dense_allreduce)
    # run name -> (variant, its all-reduce override, or none for the default ring alone)
    named: dict[str, tuple[str, tuple[str, ...]]] = {}
    for kind in kinds:
        for v in variants:
            name = v if kind == kinds[0] else f"{v}{ALLREDUCE_SEPARATOR}{kind}"
            extra = () if kinds == ["ring"] else (f"distributed.dense_allreduce={kind}",)
            named[name] = (v, extra)
    links = _links(network, link_gbits)
    seed_list: list[int | None] = list(seeds) or [None]
    # (dim, link name) -> run name -> the runs' summaries
    runs: dict[tuple[int, str], dict[str, list[dict]]] = {
        (d, link): {name: [] for name in named} for d in dims for link, _ in links
    }
    plan = itertools.product(range(rounds), seed_list, dims, links, named.items())
    network_context = (
        two_host_network(LinkConfig(link_gbits[0], link_delay_ms))
        if network == "netns"
        else nullcontext()
    )
    with tempfile.TemporaryDirectory(prefix="towerrec-bench-dmt-") as tmp, network_context as net:
        root = Path(work_dir) if work_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for i, (r, seed, dim, (link, gbit), (name, (variant, extra))) in enumerate(plan):
            shape = (*bench_overrides(steps, batch_size, dim, threads), *overrides)
            seeded = () if seed is None else (f"train.seed={seed}",)
            cfg = (*shape, *VARIANTS[variant][1], *extra, *seeded)
            where = link.replace(" Gbit/s", "g")
            out = root / f"{name}-d{dim}-{where}{'' if seed is None else f'-s{seed}'}-{r}"
            print(f"bench dmt: {out.name} ({network})", file=sys.stderr, flush=True)
            if net is None:
                run = run_local(cfg, out, threads, timeout_s)
            else:
                shaped = net.reshape(LinkConfig(gbit, link_delay_ms) if gbit else None)
                run = run_netns(shaped, cfg, out, threads, timeout_s, 29400 + i)
            if seed is not None:
                run["seed"] = seed
            runs[(dim, link)][name].append(run)
    settings = {
        "network": network,
        "link_gbit": list(link_gbits) if network == "netns" else None,
        "link_delay_ms": link_delay_ms if network == "netns" else None,
        "steps": steps,
        "batch_size": batch_size,
        "embedding_dims": dims,
        "threads": threads,
        "rounds": rounds,
        "seeds": list(seeds),
        "dense_allreduce": kinds,
        "overrides": list(overrides),
    }
    layouts = {name: VARIANTS[variant][0] for name, (variant, _) in named.items()}
    cases = [
        assemble_report(
            runs[(dim, link)],
            layouts,
            HOSTS,
            RANKS_PER_HOST,
            {"embedding_dim": dim, "link": link, "link_gbit": gbit},
            gbit,
        )
        for dim in dims
        for link, gbit in links
    ]
    report: dict[str, Any] = {
        **settings,
        "hosts": HOSTS,
        "ranks_per_host": RANKS_PER_HOST,
        "cases": cases,
    }
    if network == "netns":
        report["link_bounds"] = link_bounds(cases)
    return report


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--network",
        default="local",
        help="local: 4 processes on loopback; netns: 2 namespaces of 2 ranks, shaped veth (root)",
    )
    parser.add_argument(
        "--link-gbit",
        default="1",
        help="netns link rates, Gbit/s each way, comma list (each a case; an unshaped case "
        "is added as the reference of the link bound)",
    )
    parser.add_argument("--link-delay-ms", type=float, default=0.0, help="netns one-way link delay")
    parser.add_argument("--steps", type=int, default=300, help="training steps per variant")
    parser.add_argument("--batch-size", type=int, default=4096, help="global batch (4 ranks)")
    parser.add_argument(
        "--embedding-dim",
        default="",
        help="comma list of embedding dims, each a case (default: the model's default, "
        f"{default_embedding_dim()})",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (0: default)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of every variant, interleaved")
    parser.add_argument(
        "--seeds",
        default="",
        help="comma list of train.seed values: every variant runs under each; the AUC "
        "difference is the mean of the per-seed differences (default: the config's seed)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of " + ", ".join(VARIANTS),
    )
    parser.add_argument(
        "--dense-allreduce",
        default="ring",
        help="comma list of distributed.dense_allreduce kinds (ring, hierarchical): every "
        "variant runs under each, interleaved; the later kinds' rows are <variant>+<kind>",
    )
    add_overrides_argument(parser)
    parser.add_argument("--work-dir", type=Path, help="keep the runs' directories here")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per training run")


def _numbers(text: str, kind: type, flag: str) -> list:
    try:
        return [kind(v) for v in comma_list(text)]
    except ValueError as err:
        raise ValueError(f"{flag} {text!r}: give a comma list of numbers ({err})") from err


def _run(args: argparse.Namespace) -> dict:
    return run_dmt_benchmark(
        network=args.network,
        steps=args.steps,
        batch_size=args.batch_size,
        embedding_dims=_numbers(args.embedding_dim, int, "--embedding-dim"),
        threads=args.threads,
        link_gbits=_numbers(args.link_gbit, float, "--link-gbit"),
        link_delay_ms=args.link_delay_ms,
        rounds=args.rounds,
        variants=list(comma_list(args.variants)),
        overrides=args.overrides,
        work_dir=args.work_dir,
        timeout_s=args.timeout_s,
        dense_allreduce=list(comma_list(args.dense_allreduce)),
        seeds=_numbers(args.seeds, int, "--seeds"),
    )


BENCHMARK = Benchmark(
    "flat DLRM vs DMT on 2 hosts x 2 ranks: bytes, peers, AUC, samples/s, the link's bound "
    "(--network netns: two network namespaces over a shaped link; root)",
    _add_arguments,
    _run,
)
