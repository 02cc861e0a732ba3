"""Running ``towerrec train`` under a benchmark and reading what it left behind: the
helpers of ``towerrec bench faults`` and ``towerrec bench soak``.

- ``start_train``: one ``towerrec train`` command in its own session (so that a hung
  run is killed whole), with this checkout's package and the probe
  (``bench/probe.py``) on its path, output to a log file;
- ``wait_all``: exit codes, or None for a run that ran past its time (then killed);
- ``recovery``: from the probe's ``progress.jsonl`` and the fault's time, the step
  a restarted run resumed from, the steps trained again and the seconds lost;
- ``final_state`` and ``compare_states``: a run's last checkpoint loaded into a
  fresh single-process model, and two of them compared value for value, as the
  tests compare an interrupted run with an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import towerrec

__all__ = [
    "TrainProcess",
    "checkout_env",
    "compare_states",
    "error_line",
    "final_state",
    "make_criteo_cache",
    "read_jsonl",
    "recovery",
    "start_train",
    "train_args",
    "wait_all",
]


def checkout_env(site: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``site`` (the probe's sitecustomize) and this
    checkout's package first on the path."""
    src = str(Path(towerrec.__file__).resolve().parent.parent)
    parts = [str(site)] if site is not None else []
    parts.append(src)
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(parts), **(extra or {})}


def make_criteo_cache(work: Path, files: int, rows: int, num_embeddings: int) -> Path:
    """``towerrec data gen-criteo`` then ``towerrec data criteo``, as a user makes a cache:
    ``files`` files of ``rows`` rows hashed into ``num_embeddings`` rows per table."""
    tsv, cache = work / "tsv", work / "cache"
    env = checkout_env()
    cli = [sys.executable, "-m", "towerrec.cli", "data"]
    gen = [*cli, "gen-criteo", "--out", str(tsv), "--files", str(files), "--rows", str(rows)]
    subprocess.run(gen, check=True, env=env, capture_output=True)
    inputs = [str(tsv / f"day_{i}") for i in range(files)]
    convert = [*cli, "criteo", *inputs, "--out", str(cache), "--no-progress"]
    convert += ["--num-embeddings", str(num_embeddings)]
    subprocess.run(convert, check=True, env=env, capture_output=True)
    return cache


def train_args(out: Path, overrides: Sequence[str]) -> list[str]:
    """``-m towerrec.cli train --out OUT --set ...``"""
    args = ["-m", "towerrec.cli", "train", "--out", str(out)]
    for item in overrides:
        args += ["--set", item]
    return args


@dataclass
class TrainProcess:
    proc: subprocess.Popen
    log: Path
    started: float


def start_train(
    command: Sequence[str], log: Path, env: dict[str, str], append: bool = False
) -> TrainProcess:
    """Start ``command`` (``[*prefix, python, *train_args, ...]``) in a session of its own."""
    with log.open("a" if append else "w") as f:
        proc = subprocess.Popen(
            list(command), env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    return TrainProcess(proc, log, time.time())


def python_train(out: Path, overrides: Sequence[str], *flags: str) -> list[str]:
    return [sys.executable, *train_args(out, overrides), *flags]


def wait_all(
    runs: Sequence[TrainProcess],
    timeout_s: float,
    poll: Callable[[], None] | None = None,
    grace_s: float = 60.0,
) -> list[int] | None:
    """Exit codes of ``runs``; None when they ran past ``timeout_s`` (every one is then
    killed). ``poll`` runs about every 0.1 s meanwhile (a benchmark's fault injection).
    When one run fails, the others get ``grace_s`` to end before they are killed."""
    deadline = time.time() + timeout_s
    failed_at: float | None = None
    try:
        while True:
            codes = [r.proc.poll() for r in runs]
            if all(c is not None for c in codes):
                return [int(c) for c in codes if c is not None]
            now = time.time()
            if now > deadline:
                return None
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is not None and now - failed_at > grace_s:
                return [c if c is not None else -int(signal.SIGKILL) for c in codes]
            if poll is not None:
                poll()
            time.sleep(0.1)
    finally:
        for r in runs:
            if r.proc.poll() is None:
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()


def error_line(log: Path) -> str:
    """The run's error as a user sees it: the CLI's ``error:`` line, else the last line
    naming an error, else the log's last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    user = [ln for ln in lines if ln.startswith("error:")]
    raised = [ln for ln in lines if "Error" in ln or "Exception" in ln]
    found = user[-1:] or raised[-1:] or lines[-1:]
    return found[0] if found else ""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The whole lines of a JSON-lines file that may still be being written."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line still being written
    return records


def recovery(progress: list[dict[str, Any]], fault_time: float) -> dict[str, Any]:
    """How a run came back from a fault at ``fault_time``, from the probe's progress records
    of rank 0 (time, step, restart).

    When the run restarted: ``fault_step``, the last step the failed attempt began (a
    fault may take effect a few steps late: a dead loader worker's batches were queued);
    ``resumed_from``, the checkpoint's step; ``steps_redone``, steps trained twice;
    ``restart_s``, seconds from the fault to the first step of the restarted attempt;
    ``recovery_s``, to the first step past ``fault_step``. When it did not restart:
    ``stall_s``, seconds from the fault to the next step begun."""
    before = [r for r in progress if r["time"] <= fault_time]
    if not before:
        return {"fault_step": None}
    attempt = before[-1]["restart"]
    failed = [r for r in progress if r["restart"] == attempt]
    later = [r for r in progress if r["restart"] > attempt]
    if not later:
        after = [r for r in progress if r["time"] > fault_time]
        stall = round(after[0]["time"] - fault_time, 2) if after else None
        return {
            "fault_step": before[-1]["step"],
            "restarts": 0,
            "steps_redone": 0,
            "stall_s": stall,
        }
    fault_step = failed[-1]["step"]
    resumed_from = later[0]["step"] - 1
    past = [r for r in later if r["step"] > fault_step]
    return {
        "fault_step": fault_step,
        "restarts": later[-1]["restart"] - attempt,
        "resumed_from": resumed_from,
        "steps_redone": max(0, fault_step - resumed_from),
        "restart_s": round(later[0]["time"] - fault_time, 2),
        "recovery_s": round(past[0]["time"] - fault_time, 2) if past else None,
    }


def final_state(run: Path) -> dict[str, Any]:
    """Weights and optimizer states of ``run``'s last checkpoint, loaded into a fresh
    single-process model of the run's own config.toml."""
    import torch

    from towerrec.build.models import build_model
    from towerrec.build.optimizers import build_dense_optimizer
    from towerrec.build.sources import build_source
    from towerrec.config import load_config
    from towerrec.train.checkpoint import CheckpointManager, embedding_optimizer_state_dict

    config = load_config(base=run / "config.toml")
    source = build_source(config.data)
    model = build_model(config, source.schema, torch.device("cpu"))
    optimizer = build_dense_optimizer(config.optimizer, model)
    manager = CheckpointManager(run / "checkpoint")
    latest = manager.latest()
    if latest is None:
        raise FileNotFoundError(f"{run} holds no checkpoint")
    train = {"step": 0, "samples": 0, "train_s": 0.0, "rng": {}}
    train = manager.load(latest, model, optimizer, train)
    state: dict[str, Any] = {k: v.clone() for k, v in model.state_dict().items()}
    state.update(
        {f"emb_opt/{k}": v.clone() for k, v in embedding_optimizer_state_dict(model).items()}
    )
    for i, s in enumerate(optimizer.state_dict()["state"].values()):
        state.update({f"opt/{i}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    state["train/step"] = torch.tensor(train["step"])
    state["train/samples"] = torch.tensor(train["samples"])
    return state


def compare_states(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``equal``: the same keys and every value bit for bit; ``max_abs_diff`` over them."""
    import torch

    if a.keys() != b.keys():
        return {"equal": False, "max_abs_diff": None, "keys_differ": sorted(a.keys() ^ b.keys())}
    equal, worst = True, 0.0
    for key, value in a.items():
        other = b[key]
        if value.shape != other.shape:
            return {"equal": False, "max_abs_diff": None, "shape_differs": key}
        if not torch.equal(value, other):
            equal = False
            worst = max(worst, float((value.double() - other.double()).abs().max()))
    return {"equal": equal, "max_abs_diff": worst}
