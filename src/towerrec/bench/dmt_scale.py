"""``towerrec bench dmt-scale``: the analytic scale model of flat DLRM vs DMT, as JSON and a plot.

Predictions, not measurements: ``towerrec.planner.dmt_scale`` for 16 to 512
accelerators (8 per host) at each cross-host bandwidth given. With ``--measured``
(``towerrec bench dmt`` reports), the links' constants (latency per peer message
inside and across hosts, the host's bandwidth, the cross-host link's efficiency
against its nominal rate) are fitted to the measured steps
(``planner.dmt_scale.fit_link_constants``) and replace the assumed ones; the
result carries the fit and its residuals: the model against every measured run.

``--paper``: the same model on the DMT paper's hardware (``planner/dmt_hardware.py``:
V100, A100, H100 hosts of 8, every constant with its source) at the paper's scales,
beside the speed-ups the paper reports (``paper`` in the JSON; ``--paper-plot``);
``--gpu-steps`` takes a JSON of measured GPU steps for the dense efficiency.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from towerrec.bench.common import Benchmark
from towerrec.data.synthetic import SyntheticConfig
from towerrec.planner.dmt_hardware import (
    ASSUMED,
    PAPER,
    compare_with_paper,
    measured_efficiency,
    spec_table,
)
from towerrec.planner.dmt_scale import (
    Cluster,
    MeasuredStep,
    Workload,
    evaluate_fit,
    fit_link_constants,
    predict_step,
    scale_sweep,
)

__all__ = [
    "BENCHMARK",
    "measured_steps",
    "plot_sweeps",
    "run_scale_model",
    "synthetic_traffic",
]


def measured_steps(paths: Sequence[Path]) -> list[MeasuredStep]:
    """Every variant row with a measured step in ``towerrec bench dmt`` reports."""
    steps = []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            network, hosts, local = report["network"], report["hosts"], report["ranks_per_host"]
            # one case per (dim, link); reports before cases were one case at the top
            cases = [
                (c["link_gbit"], c["variants"], c.get("embedding_dim", 16))
                for c in report.get("cases", [report])
            ]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"--measured {path}: not a towerrec bench dmt --json report ({err}); give the "
                "JSON that bench dmt printed"
            ) from err
        for gbit, rows, dim in cases:
            rate = gbit if network == "netns" else None
            steps += _case_steps(rows, network, hosts, local, rate, dim)
    return steps


def _case_steps(
    rows: Sequence[dict], network: str, hosts: int, local: int, rate: float | None, dim: int
) -> list[MeasuredStep]:
    """The measured steps of one case's variant rows (``rate``: its link, None unshaped)."""
    steps = []
    for row in rows:
        if not row.get("step_ms") or row.get("total_cross_host_bytes_per_sample") is None:
            continue  # a variant whose runs all failed, or a report from before the counts
        steps.append(
            MeasuredStep(
                variant=row["variant"],
                layout=row["layout"],
                hosts=hosts,
                ranks_per_host=local,
                batch_size=row["batch_size"],
                step_s=row["step_ms"] / 1e3,
                cross_bytes_per_sample=row["total_cross_host_bytes_per_sample"],
                intra_bytes_per_sample=row["total_intra_host_bytes_per_sample"],
                calls_per_step=row.get("collective_calls_per_step", {}),
                link_bytes_per_s=rate * 1e9 / 8 if rate else None,
                network=network,
                embedding_dim=dim,
            )
        )
    return steps


def run_scale_model(
    *,
    accelerators: tuple[int, ...] = (16, 32, 64, 128, 256, 512),
    cross_host_gbs: tuple[float, ...] = (25.0, 50.0),
    intra_host_gbs: float = 300.0,
    ranks_per_host: int = 8,
    compression: float = 4.0,
    plot: Path | None = None,
    measured: Sequence[Path] = (),
    paper: bool = False,
    paper_plot: Path | None = None,
    gpu_steps: Path | None = None,
    validate: Sequence[Path] = (),
) -> dict:
    """The sweep at each cross-host bandwidth (GB/s per accelerator); with ``measured``
    reports, the links' constants fitted to them (module doc), the cross-host bandwidth
    then the nominal rate times the fitted link efficiency."""
    work = Workload(compression=compression)
    fit = fit_link_constants(measured_steps(measured)) if measured else None
    sweeps = {}
    for bw in cross_host_gbs:
        links: dict[str, float] = {
            "intra_host_bw": intra_host_gbs * 1e9,
            "cross_host_bw": bw * 1e9,
        }
        if fit is not None:
            links = _fitted_links(fit["constants"], bw * 1e9)
        cluster = Cluster(ranks_per_host=ranks_per_host, **links)
        sweeps[f"{bw:g}GB/s"] = scale_sweep(accelerators, cluster, work)
    result: dict[str, Any] = {
        "benchmark": "dmt-scale",
        "kind": "analytic prediction" + (", links fitted to measured steps" if fit else ""),
        "synthetic_default_2x2": synthetic_traffic(),
        "sweeps": sweeps,
    }
    if fit is not None:
        result["fit"] = {**fit, "measured": [str(p) for p in measured]}
    if validate:
        if fit is None:
            raise ValueError(
                "--validate evaluates the links fitted to --measured reports: give those"
            )
        held_out = evaluate_fit(fit, measured_steps(validate))
        result["validation"] = {**held_out, "reports": [str(p) for p in validate]}
    if plot is not None:
        plot_sweeps(sweeps, plot, fitted=fit is not None)
        result["plot"] = str(plot)
    if paper or paper_plot is not None or gpu_steps is not None:
        comparison = _paper(work, gpu_steps)
        if paper_plot is not None:
            plot_paper(comparison, paper_plot)
            comparison["plot"] = str(paper_plot)
        result["paper"] = comparison
    return result


def _paper(work: Workload, gpu_steps: Path | None) -> dict:
    """The model on the paper's hardware beside its reported speed-ups, with every
    constant's source; the dense efficiency measured on a GPU where ``gpu_steps`` says."""
    measured = measured_efficiency(gpu_steps) if gpu_steps is not None else None
    comparison = compare_with_paper(work, measured["dense_efficiency"] if measured else None)
    return {
        "paper": PAPER,
        "hardware": spec_table(),
        "assumed": {k: {"value": v, "why": why} for k, (v, why) in ASSUMED.items()},
        "dense_efficiency_from": "measured" if measured else "assumed",
        **({"gpu_steps": {**measured, "path": str(gpu_steps)}} if measured else {}),
        **comparison,
    }


def _fitted_links(constants: dict[str, float], cross_host_bw: float) -> dict[str, float]:
    """``Cluster``'s link constants from a fit; a term the fit held at zero keeps the
    assumed constant (the data could not tell it apart), which the fit's terms show."""
    default = Cluster()
    intra_bw = constants["intra_host_bw"]
    efficiency = constants["link_efficiency"]
    return {
        "intra_latency": constants["intra_latency"] or default.intra_latency,
        "cross_latency": constants["cross_latency"] or default.cross_latency,
        "intra_host_bw": intra_bw if intra_bw != float("inf") else default.intra_host_bw,
        "cross_host_bw": cross_host_bw * efficiency
        if efficiency != float("inf")
        else cross_host_bw,
    }


def synthetic_traffic(tower_outputs: int = 1, num_towers: int = 2) -> dict:
    """Bytes per sample of the synthetic default (9 features, dim 16, int64 ids, fp32
    values) on 2 hosts x 2 ranks: flat table-wise vs DMT with ``tower_outputs`` vectors
    per tower."""
    data = SyntheticConfig()
    features = data.num_tables
    pooling = sum(data.pooling(t) for t in range(features)) / features
    work = Workload(
        num_features=features,
        embedding_dim=16,
        pooling_factor=pooling,
        id_bytes=8,
        value_bytes=4,
        compression=features / (num_towers * tower_outputs),
    )
    point = predict_step(4, Cluster(ranks_per_host=2), work)
    keep = ("cross_host_bytes_per_sample", "intra_host_bytes_per_sample", "peers_per_collective")
    return {
        "compression": work.compression,
        "flat_table_wise": {k: point["flat"][k] for k in keep},
        "dmt": {k: point["dmt"][k] for k in keep},
        "cross_host_bytes_ratio": point["cross_host_bytes_ratio"],
    }


def plot_sweeps(sweeps: dict, path: Path, fitted: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (label, sweep), color in zip(sweeps.items(), ("tab:blue", "tab:orange", "tab:green")):
        points = sweep["points"]
        g = [p["accelerators"] for p in points]
        for kind, style in (("flat", "--"), ("dmt", "-")):
            ax_time.plot(
                g,
                [p[kind]["step_s"] * 1e3 for p in points],
                style,
                color=color,
                marker="o",
                label=f"{'flat DLRM' if kind == 'flat' else 'DMT'}, cross-host {label}",
            )
        ax_speed.plot(g, [p["speedup"] for p in points], "-", color=color, marker="o", label=label)
    for ax in (ax_time, ax_speed):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("accelerators (8 per host)")
        ax.grid(alpha=0.3)
    ax_time.set_ylabel("predicted step time (ms)")
    ax_time.set_title("flat DLRM (table-wise) vs DMT")
    ax_time.legend(fontsize=8)
    ax_speed.set_ylabel("predicted speedup of DMT over flat")
    ax_speed.set_title("speedup by cross-host bandwidth per accelerator")
    ax_speed.legend(fontsize=8)
    work = next(iter(sweeps.values()))["workload"]
    cluster = next(iter(sweeps.values()))["cluster"]
    links = (
        f"; links fitted to measured steps: {1e3 * cluster['cross_latency']:.2g} ms per "
        f"cross-host message, {1e3 * cluster['intra_latency']:.2g} ms inside, "
        f"{cluster['intra_host_bw'] / 1e9:.3g} GB/s inside"
        if fitted
        else ""
    )
    fig.suptitle(
        f"analytic model{links}\n{work['num_features']} features x dim {work['embedding_dim']}, "
        f"pooling {work['pooling_factor']:g}, batch {work['batch_per_rank']}/rank, "
        f"tower compression {work['compression']:g}x",
        fontsize=9,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_paper(paper: dict, path: Path) -> None:
    """Predicted speed-up of DMT over flat per GPU generation against GPUs, the paper's
    reported points beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = {"v100": "tab:green", "a100": "tab:blue", "h100": "tab:red"}
    for generation, sweep in paper["sweeps"].items():
        points = sweep["points"]
        color = colors.get(generation, "tab:gray")
        ax.plot(
            [p["accelerators"] for p in points],
            [p["speedup"] for p in points],
            "-o",
            color=color,
            label=f"model, {generation.upper()} (published peaks)",
        )
    for row in paper["comparison"]:
        if row["reported_speedup"] is not None:
            color = colors.get(row["generation"], "tab:gray")
            ax.plot(
                row["accelerators"],
                row["reported_speedup"],
                "*",
                markersize=14,
                color=color,
                label=f"paper, {row['generation'].upper()} ({row['reported_speedup']:g}x)",
            )
    at_most = paper["paper"]["speedup_at_most"]
    ax.axhline(at_most, ls=":", color="gray", label=f"paper: at most {at_most:g}x anywhere")
    ax.set_xscale("log", base=2)
    scales = [p["accelerators"] for p in next(iter(paper["sweeps"].values()))["points"]]
    ax.set_xticks(scales, [str(g) for g in scales])
    ax.set_xlabel("GPUs (8 per host)")
    ax.set_ylabel("speed-up of DMT over flat")
    work = paper["workload"]
    ax.set_title(
        f"scale model on the DMT paper's hardware; dense efficiency "
        f"{paper['dense_efficiency']:.2f} ({paper['dense_efficiency_from']})\n"
        f"{work['num_features']} features x dim {work['embedding_dim']}, "
        f"batch {work['batch_per_rank']}/GPU, tower compression {work['compression']:g}x",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cross-host-gbs", default="25,50", help="GB/s per accelerator, comma list"
    )
    parser.add_argument("--intra-host-gbs", type=float, default=300.0)
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument("--compression", type=float, default=4.0, help="DMT tower compression")
    parser.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    parser.add_argument(
        "--measured",
        type=Path,
        nargs="+",
        default=[],
        help="towerrec bench dmt --json reports (loopback and shaped links): fit the links' "
        "latency and bandwidth to their steps instead of the assumed constants",
    )
    parser.add_argument(
        "--validate",
        type=Path,
        nargs="+",
        default=[],
        help="more bench dmt reports: the model fitted to --measured predicts their steps "
        "(residuals), without fitting to them",
    )
    parser.add_argument(
        "--paper",
        action="store_true",
        help="also predict the DMT paper's configurations (V100, A100, H100 hosts of 8, "
        "published peaks) beside the speed-ups it reports",
    )
    parser.add_argument("--paper-plot", type=Path, help="write the paper comparison's plot here")
    parser.add_argument(
        "--gpu-steps",
        type=Path,
        help="JSON of measured GPU steps (bench train --device cuda --shapes): the dense "
        "efficiency of the paper comparison measured instead of assumed",
    )


def _run(args: argparse.Namespace) -> dict:
    return run_scale_model(
        cross_host_gbs=tuple(float(v) for v in args.cross_host_gbs.split(",")),
        intra_host_gbs=args.intra_host_gbs,
        ranks_per_host=args.ranks_per_host,
        compression=args.compression,
        plot=args.plot,
        measured=args.measured,
        paper=args.paper,
        paper_plot=args.paper_plot,
        gpu_steps=args.gpu_steps,
        validate=args.validate,
    )


BENCHMARK = Benchmark(
    "analytic step time of flat DLRM vs DMT, 16 to 512 accelerators", _add_arguments, _run
)
