"""The training runs of ``towerrec bench dmt``: one ``towerrec train`` of 2 hosts x 2 ranks,
on loopback (``run_local``) or in two network namespaces (``run_netns``), and what its
run directory says (``read_summary``: samples/s after the warm-up, AUC, bytes, calls).

::

    --network local   towerrec train --nproc 4 --hosts 2     (loopback, no root)
    --network netns   host h = namespace h (bench/netns.py), shaped veth between them:
                        ip netns exec <ns h> python -m torch.distributed.run
                            --nnodes 2 --node-rank h --nproc-per-node 2
                            --master-addr <ns 0 address> -m towerrec.cli train ...
                        GLOO_SOCKET_IFNAME = the namespace's veth
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

import towerrec
from towerrec.bench.netns import TwoHostNetwork

__all__ = [
    "HOSTS",
    "RANKS_PER_HOST",
    "read_summary",
    "run_local",
    "run_netns",
    "steady_samples_per_s",
]

HOSTS, RANKS_PER_HOST = 2, 2


def _env(threads: int) -> dict[str, str]:
    """This process's environment with this checkout's package first on the path."""
    src = str(Path(towerrec.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": src + (os.pathsep + path if path else "")}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _train_args(overrides: Sequence[str], out: Path) -> list[str]:
    args = ["-m", "towerrec.cli", "train", "--out", str(out)]
    for item in overrides:
        args += ["--set", item]
    return args


def _wait(
    procs: list[subprocess.Popen],
    timeout_s: float,
    finished: Callable[[], bool] | None = None,
    grace_s: float = 30.0,
) -> tuple[list[int], bool]:
    """Exit codes of ``procs`` and whether the last were cut short; on timeout or
    interruption every one is killed first.

    One host's launcher can wait out torch's 300 s exit barrier after the run has
    finished when the launcher hosting the rendezvous store exits first (a race in
    torch elastic, pytorch/pytorch#69520). So once a launcher has exited 0 and
    ``finished()`` says the run completed, the others get ``grace_s`` to exit and are
    then stopped; the run counts, and its result says it was cut."""
    deadline = time.monotonic() + timeout_s
    first_done: float | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):  # one host failed: stop the rest
                return [c if c is not None else -signal.SIGKILL for c in codes], False
            if all(c == 0 for c in codes):
                return [0] * len(procs), False
            now = time.monotonic()
            if now > deadline:
                raise subprocess.TimeoutExpired(procs[0].args, timeout_s)
            if first_done is None and 0 in codes:
                first_done = now
            if (
                first_done is not None
                and now - first_done > grace_s
                and finished is not None
                and finished()
            ):
                return [0] * len(procs), True
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _failure(log: Path, codes: list[int]) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    # A worker's own error (the CLI's "error:" line, else the first exception line that is
    # not the launcher's ChildFailedError wrapper), not the launcher's summary of it.
    user = [ln for ln in lines if ln.startswith("error:")]
    raised = [ln for ln in lines if "Error" in ln and "ChildFailedError" not in ln]
    wrapped = [ln for ln in lines if "Error" in ln]
    found = user[-1:] or raised[:1] or wrapped[-1:] or lines[-1:]
    return f"exit codes {codes}: " + (found[0] if found else "")


def run_local(overrides: Sequence[str], out: Path, threads: int, timeout_s: float) -> dict:
    log = out.with_suffix(".log")
    cmd = [
        sys.executable,
        *_train_args(overrides, out),
        "--nproc",
        str(HOSTS * RANKS_PER_HOST),
        "--hosts",
        str(HOSTS),
    ]
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, env=_env(threads), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        codes, _ = _wait([proc], timeout_s)
    return read_summary(out, log, codes)


def run_netns(
    net: TwoHostNetwork,
    overrides: Sequence[str],
    out: Path,
    threads: int,
    timeout_s: float,
    port: int,
) -> dict:
    log = out.with_suffix(".log")
    procs = []
    with log.open("w") as f:
        for host in range(HOSTS):
            cmd = [
                *net.exec_prefix(host),
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={HOSTS}",
                f"--node-rank={host}",
                f"--nproc-per-node={RANKS_PER_HOST}",
                f"--master-addr={net.addresses[0]}",
                f"--master-port={port}",
                *_train_args(overrides, out),
            ]
            env = {**_env(threads), "GLOO_SOCKET_IFNAME": net.devices[host]}
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        codes, cut = _wait(procs, timeout_s, finished=lambda: _completed(out))
    summary = read_summary(out, log, codes)
    if cut and "error" not in summary:
        summary["launcher_exit_cut"] = True  # a launcher waited on torch's exit barrier
    return summary


def steady_samples_per_s(metrics: Path) -> float | None:
    """Samples/s over the train records after the first (warm-up) window of a run's
    ``metrics.jsonl``; None when it has fewer than two train records."""
    if not metrics.exists():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    samples = seconds = 0.0
    for before, record in itertools.pairwise(train):
        window = record["samples"] - before["samples"]
        samples += window
        seconds += window / record["samples_per_s"]
    return samples / seconds if seconds else None


def _completed(out: Path) -> bool:
    """Whether the run in ``out`` wrote a summary of all its steps."""
    try:
        return bool(json.loads((out / "summary.json").read_text()).get("completed"))
    except (OSError, ValueError):
        return False


def read_summary(out: Path, log: Path, codes: list[int]) -> dict:
    path = out / "summary.json"
    if any(codes) or not path.exists():
        return {"error": _failure(log, codes)}
    summary = json.loads(path.read_text())
    steady = steady_samples_per_s(out / "metrics.jsonl")
    if steady is not None:
        summary["samples_per_s_all_steps"] = summary["samples_per_s"]
        summary["samples_per_s"] = steady
    # the learned partition is only in the run's log (rank 0's "tower partition [[...]]")
    found = re.search(r"tower partition (\[\[.*?\]\])", log.read_text(errors="replace"))
    if found:
        summary["partition"] = found.group(1)
    resolved = out / "config.toml"  # what the run's auto settings became
    if resolved.exists():
        config = tomllib.loads(resolved.read_text())
        summary["precision"] = config.get("train", {}).get("precision")
        summary["backend"] = config.get("embedding", {}).get("backend")
    return summary
