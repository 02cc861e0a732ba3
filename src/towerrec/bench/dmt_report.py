"""The ``towerrec bench dmt`` report: per-variant rows, peers per collective, ratios, targets.

Pure: run summaries (``summary.json`` of each variant's training run) in, a
JSON-ready dict out, so the arithmetic is tested without training anything.

Peers per collective on ``N`` hosts of ``L`` ranks (``W = N * L``), the
embedding traffic of one step:

==================  =====================================  =========================
layout              collectives                            peers (of them cross-host)
==================  =====================================  =========================
flat table-wise     all-to-all over the world              W - 1  (W - L)
flat table-row-wise ids: all-to-all over the world;        W - 1  (W - L)
                    sums: intra-host reduce, then one      L - 1  (0), N - 1 (N - 1)
                    peer per host
DMT                 peer all-to-all (rank l of each host)  N - 1  (N - 1)
                    + the tower's lookup inside the host   L - 1  (0)
==================  =====================================  =========================
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ALLREDUCE_SEPARATOR",
    "BASELINE",
    "DMT",
    "TARGETS",
    "assemble_report",
    "link_bounds",
    "peers_per_collective",
]

BASELINE = "flat_table_wise"
DMT = "dmt_partitioner"  # the DMT the targets and the link bound are about
# "<variant>+<kind>": a variant run under another dense all-reduce (bench dmt
# --dense-allreduce); it is compared with "flat_table_wise+<kind>" where that ran
ALLREDUCE_SEPARATOR = "+"
TARGETS = {
    "cross_bytes_reduction": 4.0,  # flat table-wise / DMT compressing (partitioner)
    "auc_within": 0.002,  # |DMT compressing - flat table-wise|
    "speedup": 1.5,  # DMT compressing samples/s over flat table-wise's
    "fraction_of_link_bound": 0.9,  # DMT's speed-up over the bound the link allows (below)
}


def peers_per_collective(layout: str, hosts: int, ranks_per_host: int) -> list[dict[str, Any]]:
    """The embedding collectives of one step under ``layout`` (``flat_<sharding>`` or ``dmt``):
    name, peers each rank talks to, and how many of them are on other hosts."""
    if hosts < 1 or ranks_per_host < 1:
        raise ValueError(f"hosts ({hosts}) and ranks_per_host ({ranks_per_host}) must be >= 1")
    world = hosts * ranks_per_host
    world_a2a = {
        "collective": "all_to_all",
        "peers": world - 1,
        "cross_host_peers": world - ranks_per_host,
    }
    if layout == "dmt":
        return [
            {"collective": "peer_all_to_all", "peers": hosts - 1, "cross_host_peers": hosts - 1},
            {"collective": "intra_host", "peers": ranks_per_host - 1, "cross_host_peers": 0},
        ]
    if layout == "flat_table_row_wise":
        return [
            {**world_a2a, "collective": "input_all_to_all"},
            {
                "collective": "output_host_reduce",
                "peers": ranks_per_host - 1,
                "cross_host_peers": 0,
            },
            {"collective": "output_cross_host", "peers": hosts - 1, "cross_host_peers": hosts - 1},
        ]
    if layout.startswith("flat_"):
        return [world_a2a]
    raise ValueError(f"unknown layout {layout!r}: use 'dmt' or 'flat_<sharding>'")


def _row(
    name: str,
    layout: str,
    runs: Sequence[Mapping[str, Any]],
    hosts: int,
    ranks_per_host: int,
    link_gbit: float | None = None,
) -> dict[str, Any]:
    """One variant's row from its runs (rounds); medians of samples/s, the last run's rest."""
    errors = [r["error"] for r in runs if "error" in r]
    good = [r for r in runs if "error" not in r]
    row: dict[str, Any] = {"variant": name, "layout": layout}
    if errors:
        row["errors"] = errors
    if not good:
        return row
    last = good[-1]
    rates = [r["samples_per_s"] for r in good if r.get("samples_per_s")]
    peers = peers_per_collective(layout, hosts, ranks_per_host)
    # runs of several seeds (``--seeds``): each seed's AUC (its last round), and their mean
    by_seed = {r["seed"]: r.get("auc") for r in good if "seed" in r}
    aucs = [a for a in by_seed.values() if a is not None]
    if by_seed:
        row["auc_by_seed"] = by_seed
    row.update(
        samples_per_s=statistics.median(rates) if rates else None,
        samples_per_s_runs=rates,
        auc=statistics.fmean(aucs) if aucs else last.get("auc"),
        logloss=last.get("logloss"),
        oracle_auc=last.get("oracle_auc"),
        cross_host_bytes_per_sample=last.get("comm_bytes_per_sample_cross"),
        intra_host_bytes_per_sample=last.get("comm_bytes_per_sample_intra"),
        # all training traffic: the embedding collectives plus DDP's gradient all-reduces
        dense_cross_host_bytes_per_sample=last.get("dense_allreduce_bytes_per_sample_cross"),
        dense_intra_host_bytes_per_sample=last.get("dense_allreduce_bytes_per_sample_intra"),
        total_cross_host_bytes_per_sample=last.get("total_bytes_per_sample_cross"),
        total_intra_host_bytes_per_sample=last.get("total_bytes_per_sample_intra"),
        max_peers_per_collective=max(c["peers"] for c in peers),
        max_cross_host_peers_per_collective=max(c["cross_host_peers"] for c in peers),
        collectives=peers,
    )
    calls = last.get("comm_calls_per_step")
    if calls:  # one rank's collective calls per training step (embedding and dense)
        row["collective_calls_per_step"] = calls
        row["collective_calls_per_step_total"] = sum(calls.values())
    for key in (
        "partition",
        "train_s",
        "steps",
        "batch_size",
        "samples_per_s_all_steps",
        "precision",
        "backend",
    ):
        if key in last:
            row[key] = last[key]
    batch = last.get("batch_size")
    if batch and row["samples_per_s"]:
        row["step_ms"] = 1000.0 * batch / row["samples_per_s"]
    cross = row["total_cross_host_bytes_per_sample"] or row["cross_host_bytes_per_sample"]
    if link_gbit and batch and cross is not None:
        # the two hosts send alike: half the step's cross-host bytes each way, at the rate
        row["link_ms_per_step"] = 1000.0 * cross * batch / 2 / (link_gbit * 1e9 / 8)
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def assemble_report(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    layouts: Mapping[str, str],
    hosts: int,
    ranks_per_host: int,
    settings: Mapping[str, Any] | None = None,
    link_gbit: float | None = None,
) -> dict[str, Any]:
    """The JSON report: ``runs[variant]`` are its rounds' summaries (or ``{"error": ...}``),
    ``layouts[variant]`` its layout. Ratios are against ``flat_table_wise`` when it ran.
    With ``link_gbit`` (a shaped link), each row adds ``link_ms_per_step``: the time its
    cross-host bytes need on that link alone, beside ``step_ms``, the measured step."""
    rows = {
        name: _row(name, layouts[name], rs, hosts, ranks_per_host, link_gbit)
        for name, rs in runs.items()
    }
    for name, row in rows.items():
        base = rows.get(_baseline_of(name), {})
        if "auc" not in row or "auc" not in base:
            continue
        row["vs_flat_table_wise"] = {
            **_auc_deltas(row, base),
            "cross_host_bytes_reduction": _ratio(
                base["cross_host_bytes_per_sample"], row["cross_host_bytes_per_sample"]
            ),
            "total_cross_host_bytes_reduction": _ratio(
                base["total_cross_host_bytes_per_sample"],
                row["total_cross_host_bytes_per_sample"],
            ),
            "speedup": _ratio(row["samples_per_s"], base["samples_per_s"]),
        }
    kinds = sorted({n.partition(ALLREDUCE_SEPARATOR)[2] for n in rows} - {""})
    by_kind = {kind: _targets(rows, ALLREDUCE_SEPARATOR + kind) for kind in kinds}
    return {
        **(dict(settings) if settings else {}),
        "hosts": hosts,
        "ranks_per_host": ranks_per_host,
        "variants": list(rows.values()),
        "targets": _targets(rows),
        **({"targets_by_dense_allreduce": by_kind} if by_kind else {}),
    }


def _auc_deltas(row: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """``auc_delta``: the row's AUC minus flat table-wise's; with seeds, the mean of the
    per-seed differences (``auc_delta_by_seed``, paired: same seed, same data order)."""
    mine, theirs = row.get("auc_by_seed", {}), base.get("auc_by_seed", {})
    paired = {
        seed: mine[seed] - theirs[seed]
        for seed in mine
        if seed in theirs and mine[seed] is not None and theirs[seed] is not None
    }
    if paired:
        deltas = list(paired.values())
        return {
            "auc_delta": statistics.fmean(deltas),
            "auc_delta_by_seed": paired,
            "auc_delta_stdev": statistics.stdev(deltas) if len(deltas) > 1 else None,
        }
    if row["auc"] is None or base["auc"] is None:
        return {"auc_delta": None}
    return {"auc_delta": row["auc"] - base["auc"]}


def _baseline_of(name: str) -> str:
    """The flat table-wise row that ``name`` is compared with: the one under the same
    dense all-reduce (``ALLREDUCE_SEPARATOR``)."""
    _, sep, kind = name.partition(ALLREDUCE_SEPARATOR)
    return BASELINE + sep + kind


def _targets(rows: Mapping[str, Mapping[str, Any]], suffix: str = "") -> dict[str, Any]:
    """Each target with the measured value and whether it is met (None: not measured),
    for the rows named with ``suffix`` (another dense all-reduce's)."""
    dmt = rows.get(DMT + suffix, {})
    vs = dmt.get("vs_flat_table_wise")
    out: dict[str, Any] = {}
    if vs:
        reduction, speedup, delta = (
            vs["cross_host_bytes_reduction"],
            vs["speedup"],
            vs["auc_delta"],
        )
        target = TARGETS["cross_bytes_reduction"]
        out["cross_host_bytes_reduction"] = {
            "value": reduction,
            "target": target,
            "met": None if reduction is None else reduction >= target,
        }
        total = vs["total_cross_host_bytes_reduction"]
        out["total_cross_host_bytes_reduction"] = {
            "value": total,
            "target": target,
            "met": None if total is None else total >= target,
        }
        out["auc_delta"] = {
            "value": delta,
            "target": TARGETS["auc_within"],
            "met": None if delta is None else abs(delta) <= TARGETS["auc_within"],
        }
        out["speedup"] = {
            "value": speedup,
            "target": TARGETS["speedup"],
            "met": None if speedup is None else speedup >= TARGETS["speedup"],
        }
    random_row = rows.get("dmt_random" + suffix, {})
    if dmt.get("auc") is not None and random_row.get("auc") is not None:
        out["partitioner_vs_random_auc"] = {
            "value": dmt["auc"] - random_row["auc"],
            "target": 0.0,
            "met": dmt["auc"] >= random_row["auc"],
        }
    return out


def link_bounds(cases: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What the link allows, per shaped case (``link_gbit`` set), against the unshaped case
    of the same embedding dim (``link == "unshaped"``, the same namespaces and veth):

    - flat's cross-host time ``t_f``: its step over the shaped link minus its step over
      the unshaped one (measured; the veth's own time is in both);
    - DMT's cross-host time at its bytes ``t_d = t_f * bytes_DMT / bytes_flat``: flat's
      measured seconds per byte on this link, times DMT's bytes (all traffic);
    - the bound of any layout with flat's compute and DMT's bytes:
      ``S_flat / (S_flat - t_f + t_d)`` (``S_flat`` flat's step at this rate);
    - DMT's measured speed-up (samples/s over flat's) as a fraction of that bound.

    ``bound_nominal`` is the same with both link times from the bytes at the nominal rate
    (``link_ms_per_step``) instead of the measured ``t_f``.
    """
    unshaped = {c["embedding_dim"]: c for c in cases if c.get("link") == "unshaped"}
    out = []
    for case in cases:
        if case.get("link_gbit") is None:
            continue
        head = {"embedding_dim": case["embedding_dim"], "link_gbit": case["link_gbit"]}
        rows = {r["variant"]: r for r in case["variants"]}
        reference = unshaped.get(case["embedding_dim"])
        ref_rows = {r["variant"]: r for r in reference["variants"]} if reference else {}
        flat, dmt = rows.get(BASELINE, {}), rows.get(DMT, {})
        ref_flat, ref_dmt = ref_rows.get(BASELINE, {}), ref_rows.get(DMT, {})
        needed = (flat, dmt, ref_flat)
        if not all(r.get("step_ms") and r.get("total_cross_host_bytes_per_sample") for r in needed):
            out.append({**head, "error": f"needs {BASELINE} and {DMT} here and unshaped"})
            continue
        flat_step = flat["step_ms"]
        flat_link = flat_step - ref_flat["step_ms"]
        share = dmt["total_cross_host_bytes_per_sample"] / flat["total_cross_host_bytes_per_sample"]
        dmt_link = flat_link * share
        bound = flat_step / (flat_step - flat_link + dmt_link)
        speedup = dmt["samples_per_s"] / flat["samples_per_s"]
        nominal = flat_step / (flat_step - flat["link_ms_per_step"] + dmt["link_ms_per_step"])
        fraction = speedup / bound
        target = TARGETS["fraction_of_link_bound"]
        out.append(
            {
                **head,
                "flat_step_ms": flat_step,
                "flat_unshaped_step_ms": ref_flat["step_ms"],
                "flat_cross_host_ms": flat_link,
                "flat_link_ms_nominal": flat["link_ms_per_step"],
                "dmt_cross_host_ms_at_its_bytes": dmt_link,
                "dmt_step_ms": dmt["step_ms"],
                "dmt_unshaped_step_ms": ref_dmt.get("step_ms"),
                "cross_host_bytes_flat": flat["total_cross_host_bytes_per_sample"],
                "cross_host_bytes_dmt": dmt["total_cross_host_bytes_per_sample"],
                "bound": bound,
                "bound_nominal": nominal,
                "dmt_speedup": speedup,
                "fraction_of_bound": fraction,
                "target": target,
                "met": fraction >= target,
            }
        )
    return out
