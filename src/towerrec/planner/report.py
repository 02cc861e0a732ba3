"""Human-readable views of a plan: the per-device table and a bar chart."""

from __future__ import annotations

from pathlib import Path

from towerrec.planner.search import PlanResult

__all__ = ["device_table", "write_bar_chart"]

GiB = float(1 << 30)
MiB = float(1 << 20)


def device_table(result: PlanResult, max_names: int = 6) -> str:
    """One line per device: rank, host, shards, memory, predicted cost; then the imbalance."""
    plan = result.plan
    lines = [f"{'rank':>4} {'host':>4} {'shards':>6} {'memory MiB':>10} {'cost ms':>9}  tables"]
    for rank, (names, memory, cost) in enumerate(
        zip(result.device_shards, result.device_memory, result.device_costs)
    ):
        shown = ", ".join(names[:max_names]) + (
            f", +{len(names) - max_names}" if len(names) > max_names else ""
        )
        lines.append(
            f"{rank:>4} {plan.host_of(rank):>4} {len(names):>6} {memory / MiB:>10.1f} "
            f"{cost * 1e3:>9.3f}  {shown}"
        )
    lines.append(
        f"planner {result.planner}: max {result.max_cost * 1e3:.3f} ms, mean "
        f"{result.mean_cost * 1e3:.3f} ms, imbalance (max/mean) {result.imbalance:.3f}, "
        f"planned in {result.seconds:.2f} s"
    )
    return "\n".join(lines)


def write_bar_chart(result: PlanResult, path: str | Path) -> None:
    """Predicted cost and memory per device, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = list(range(len(result.device_costs)))
    fig, (ax_cost, ax_mem) = plt.subplots(2, 1, figsize=(max(6, len(ranks) * 0.12 + 4), 6))
    ax_cost.bar(ranks, [c * 1e3 for c in result.device_costs], color="tab:blue")
    ax_cost.axhline(result.mean_cost * 1e3, color="k", linestyle="--", linewidth=1, label="mean")
    ax_cost.set_ylabel("predicted cost (ms / iteration)")
    ax_cost.set_title(f"{result.planner}: imbalance (max/mean) {result.imbalance:.3f}")
    ax_cost.legend()
    ax_mem.bar(ranks, [m / GiB for m in result.device_memory], color="tab:orange")
    ax_mem.set_ylabel("embedding memory (GiB)")
    ax_mem.set_xlabel("rank")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
