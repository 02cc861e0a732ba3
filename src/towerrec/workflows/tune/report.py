"""What ``towerrec tune`` leaves besides the runs: the table of trials (``trials.csv``
and printed), the metric over trials (``trials.png``) and the best trial's config
(``best.toml``, a complete config that ``towerrec train --config`` takes)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from towerrec.config import config_to_toml, load_config
from towerrec.train.run_dir import RunDir
from towerrec.workflows.tune.space import Space
from towerrec.workflows.tune.study import StudyRun, decoded

__all__ = ["format_table", "trial_rows", "write_best_config", "write_plot", "write_table"]


def trial_rows(study: Any, run: StudyRun) -> list[dict[str, Any]]:
    """One row per trial: number, state, value, validations reported, the last one,
    seconds, the test split's metric (when the data has one), the drawn values, the run
    directory and the error of a failed trial."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        steps = sorted(t.intermediate_values)
        seconds = None
        if t.datetime_start is not None and t.datetime_complete is not None:
            seconds = round((t.datetime_complete - t.datetime_start).total_seconds(), 1)
        values = decoded(run.space, t.params) if len(t.params) == len(run.space.params) else {}
        summary = run.trial_dir(t.number) / "summary.json"
        test = RunDir(summary.parent).read_summary().get("test") if summary.is_file() else None
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name.lower(),
                "value": t.value,
                "validations": len(steps),
                "last_validation": t.intermediate_values[steps[-1]] if steps else None,
                "seconds": seconds,
                # the test split's metric of the run's weights: reported, never searched on
                "test": test.get(run.space.study.metric) if test else None,
                **{p.key: values.get(p.key) for p in run.space.params},
                "run": str(run.trial_dir(t.number)),
                "error": t.user_attrs.get("error", ""),
            }
        )
    return rows


def write_table(rows: list[dict[str, Any]], path: Path) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.5g}"
    return str(value)


def format_table(rows: list[dict[str, Any]], space: Space) -> str:
    """The trials as aligned text columns (the metric, state and drawn values)."""
    test = ["test"] if any(r["test"] is not None for r in rows) else []
    columns = ["trial", "state", "value", *test, "validations", *[p.key for p in space.params]]
    names = {"value": space.study.metric, "test": f"test {space.study.metric}"}
    header = [names.get(c, c) for c in columns]
    cells = [header, *[[_cell(r[c]) for c in columns] for r in rows]]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in cells)


def write_plot(rows: list[dict[str, Any]], space: Space, path: Path) -> None:
    """Each finished trial's metric (pruned ones at their last validation, crosses) and
    the best so far, over trial numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    maximize = space.study.direction == "maximize"
    done = [r for r in rows if r["state"] == "complete"]
    pruned = [r for r in rows if r["state"] == "pruned" and r["last_validation"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([r["trial"] for r in done], [r["value"] for r in done], label="complete")
    ax.scatter(
        [r["trial"] for r in pruned],
        [r["last_validation"] for r in pruned],
        marker="x",
        color="grey",
        label="pruned (last validation)",
    )
    best, xs, ys = None, [], []
    for r in done:
        if best is None or (r["value"] > best if maximize else r["value"] < best):
            best = r["value"]
        xs.append(r["trial"])
        ys.append(best)
    ax.step(xs, ys, where="post", color="C1", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(f"validation {space.study.metric}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_best_config(study: Any, run: StudyRun, path: Path) -> Path | None:
    """The best complete trial's config as a complete TOML file; None without one."""
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if not complete:
        return None
    best = study.best_trial
    values = decoded(run.space, best.params)
    config = load_config(run.config_files, [*run.overrides, *run.space.overrides(values)])
    header = [
        f"# towerrec tune: trial {best.number} of {run.out}, validation "
        f"{run.space.study.metric} {best.value:.5f} (of {len(complete)} complete trials)",
        *[f"#   {line}" for line in run.space.overrides(values)],
        f"# towerrec train --config {path}",
        "",
    ]
    path.write_text("\n".join(header) + config_to_toml(config))
    return path
