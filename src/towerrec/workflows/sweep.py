"""A grid of training runs into one runs file, for scaling-law fits (``towerrec sweep``).

Each point of the grid (the product of every ``KEY=V1,V2,...`` axis) is one run
of ``train`` on the base config with the point's overrides, in
``OUT/point-NNN``, one after another: in this process, or with ``nproc > 1``
(or ``hosts > 1``) each as a multi-process run through the launcher, as
``towerrec train --nproc N --hosts H`` starts it. After each, one JSON line
goes to ``OUT/runs.jsonl``: the point's overrides, ``nproc`` and ``hosts``,
``status`` (``ok``; ``failed`` with the error: a failing point, a failing
worker included, is recorded and the sweep goes on; or ``stopped``: SIGINT or
SIGTERM stopped the run early, and the sweep there), and for a finished run
the axes a scaling fit reads::

    examples    training samples seen (steps x global batch)
    params      all parameters; dense_params, embedding_params apart
    flops       FLOPs per example of the forward pass (as the model counts them)
    compute     3 x flops x examples: forward and backward of every example
    ne, logloss, auc   the returned weights' validation metrics
    oracle_ne   on the synthetic data, the teacher's own NE: the floor of ne

Each line carries ``record_sha256``, the SHA-256 of its other keys
(``checksums.json_digest``): ``read_runs`` refuses a line that does not match it
(a changed metric), naming the file and line; lines without it, from earlier
versions or written by hand, are read.

A point already in the runs file with ``ok`` (at the same ``nproc`` and ``hosts``)
is skipped, so an interrupted sweep continues where it stopped.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from towerrec.checksums import sealed, unseal
from towerrec.config import Config, ConfigFiles, load_config
from towerrec.distributed.launch import WorkerError, launch
from towerrec.workflows.training import train
from towerrec.workflows.worker import train_worker

__all__ = ["parse_axis", "read_runs", "run_sweep", "sweep_points"]

log = logging.getLogger("towerrec")

RUNS_FILE = "runs.jsonl"
SELF_DIGEST = "record_sha256"  # a record's digest of its own other keys


def _split_values(values: str) -> list[str]:
    """Split at the commas outside brackets and quotes: ``[64,1],[256,128,1]`` is two values."""
    items, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(values):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(values[start:i])
            start = i + 1
    items.append(values[start:])
    if depth or quote:
        raise ValueError(f"a sweep axis has an unclosed bracket or quote: {values!r}")
    return [v.strip() for v in items if v.strip()]


def parse_axis(text: str) -> tuple[str, list[str]]:
    """``KEY=V1,V2,...`` -> (KEY, [V1, V2, ...]); values stay in TOML syntax, as ``--set``,
    so a value may be a list: ``model.top_mlp=[64,1],[256,128,1]``."""
    key, sep, values = text.partition("=")
    items = _split_values(values)
    if not sep or not key.strip() or not items:
        raise ValueError(
            f"a sweep axis is KEY=V1,V2,... (e.g. model.embedding_dim=8,16,32), got {text!r}"
        )
    return key.strip(), items


def sweep_points(axes: Sequence[str]) -> list[list[str]]:
    """The overrides (``KEY=VALUE`` strings) of every point of the grid, in order."""
    if not axes:
        raise ValueError("a sweep needs at least one --grid KEY=V1,V2,... axis")
    parsed = [parse_axis(a) for a in axes]
    keys = [k for k, _ in parsed]
    if len(set(keys)) != len(keys):
        raise ValueError(
            f"a sweep axis is given twice: {sorted(k for k in keys if keys.count(k) > 1)}"
        )
    return [
        [f"{k}={v}" for k, v in zip(keys, values)]
        for values in itertools.product(*(v for _, v in parsed))
    ]


def read_runs(path: str | Path) -> list[dict[str, Any]]:
    """The records of a runs file (a sweep's ``runs.jsonl``, or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / RUNS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `towerrec sweep --out DIR` first")
    records = []
    # Bytes, parsed line by line: a line that is not UTF-8 is named like one that is not JSON.
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:  # not JSON, or not UTF-8
            raise ValueError(f"{path}:{number} is not a JSON line: {e}") from e
        if not unseal(record, SELF_DIGEST):
            raise ValueError(
                f"{path}:{number} does not match its own {SELF_DIGEST}: the record is damaged "
                "or was edited (its metrics cannot be trusted); delete the line and run the "
                "sweep again to train that point anew"
            )
        records.append(record)
    return records


def _axes(summary: dict[str, Any]) -> dict[str, Any]:
    examples = summary["steps"] * summary["batch_size"]
    flops = summary["flops_per_sample"]
    return {
        "examples": examples,
        "params": summary["num_params"],
        "dense_params": summary["num_dense_params"],
        "embedding_params": summary["num_embedding_params"],
        "flops": flops,
        "compute": 3 * flops * examples,
        "ne": summary.get("ne"),
        "logloss": summary.get("logloss"),
        "auc": summary.get("auc"),
        "oracle_ne": summary.get("oracle_ne"),  # synthetic data: the floor of ne
    }


def _train_point(
    config: Config,
    config_path: ConfigFiles,
    overrides: list[str],
    out: Path,
    nproc: int,
    hosts: int,
) -> dict[str, Any]:
    """One point's run: here, or on ``nproc`` launched workers (rank 0's summary)."""
    if nproc == 1 and hosts == 1:
        return train(config, out)
    try:
        results = launch(train_worker, (config_path, overrides, out, False), nproc, hosts)
    except WorkerError as e:
        raise RuntimeError(f"a worker failed: {e}") from None
    summary: dict[str, Any] = results[0]
    return summary


def run_sweep(
    config_path: ConfigFiles,
    overrides: Sequence[str],
    axes: Sequence[str],
    out_dir: str | Path,
    nproc: int = 1,
    hosts: int = 1,
) -> list[dict[str, Any]]:
    """Run every point (module doc) on ``nproc`` processes standing for ``hosts`` hosts
    each; the records of this sweep, finished points included."""
    if nproc < 1 or hosts < 1 or nproc % hosts:
        raise ValueError(
            f"--nproc {nproc} and --hosts {hosts}: both must be >= 1 and the hosts must "
            "divide the processes (e.g. --nproc 4 --hosts 2)"
        )
    points = sweep_points(axes)
    # Every point's config is checked before the first run: a typo fails now, not at point 7.
    configs: list[Config] = [load_config(config_path, [*overrides, *p]) for p in points]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / RUNS_FILE
    done = {
        tuple(r["overrides"]): r
        for r in (read_runs(runs_file) if runs_file.exists() else [])
        if r.get("status") == "ok" and (r.get("nproc", 1), r.get("hosts", 1)) == (nproc, hosts)
    }
    records = []
    for index, (point, config) in enumerate(zip(points, configs)):
        if tuple(point) in done:
            log.info("sweep point %d/%d (%s): done before", index + 1, len(points), " ".join(point))
            records.append(done[tuple(point)])
            continue
        log.info("sweep point %d/%d: %s", index + 1, len(points), " ".join(point))
        run, attempt = f"point-{index:03d}", 1
        while (out / run).exists():  # a failed earlier attempt keeps its directory
            run, attempt = f"point-{index:03d}-{attempt}", attempt + 1
        record: dict[str, Any] = {
            "point": index,
            "overrides": point,
            "run": run,
            "nproc": nproc,
            "hosts": hosts,
        }
        try:
            summary = _train_point(
                config, config_path, [*overrides, *point], out / run, nproc, hosts
            )
            if not summary["completed"]:  # SIGINT/SIGTERM: the run stopped early
                record.update(
                    status="stopped",
                    error=f"stopped at step {summary['steps']} by a signal; run the sweep "
                    "again to train this point anew",
                )
            else:
                record.update(status="ok", **_axes(summary))
        except Exception as e:  # a failing point is recorded; the sweep goes on
            log.warning("sweep point %d failed: %s", index + 1, e)
            record.update(status="failed", error=f"{type(e).__name__}: {e}")
        with runs_file.open("a") as f:
            f.write(json.dumps(sealed(record, SELF_DIGEST)) + "\n")
        records.append(record)
        if record["status"] == "stopped":
            log.warning("sweep stopped at point %d of %d", index + 1, len(points))
            break
    return records
