"""Starting worker processes: torch.distributed's elastic launcher, and a small spawner.

- ``launch(entry, args, nproc, hosts)``: what ``towerrec train --nproc N`` does:
  N local workers through ``torch.distributed.elastic`` (the engine behind
  ``torchrun``), with ``--max-restarts`` elastic restarts. A worker that raises
  makes the agent stop every other worker and report the first error.
- ``spawn_world(fn, world_size, hosts, *args)``: N gloo processes on a free
  port for tests and benchmarks; ``fn(topology, *args)`` runs in each, and the
  per-rank return values come back. When one rank raises, the others are
  terminated and the error is raised here, so a failure never hangs.
"""

from __future__ import annotations

import os
import socket
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from towerrec.distributed.mesh import HOSTS_ENV, Topology

__all__ = ["WorkerError", "free_port", "launch", "spawn_world"]


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(
    rank: int, fn, world_size: int, hosts: int, port: int, timeout_s: float, results, args
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        **{HOSTS_ENV: str(hosts)},
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    try:
        results[rank] = fn(Topology(world_size, hosts, rank), *args)
    except Exception as e:
        results[rank] = WorkerError(
            f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        )
        raise
    finally:
        dist.destroy_process_group()


def spawn_world(
    fn: Callable[..., Any],
    world_size: int,
    hosts: int = 1,
    *args: Any,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(topology, *args)`` on ``world_size`` gloo ranks; their return values.

    ``fn`` must be importable (a module-level function). Collectives wait at
    most ``timeout_s`` for a peer.
    """
    manager = mp.Manager()
    results = manager.dict()
    try:
        mp.spawn(
            _spawned,
            args=(fn, world_size, hosts, free_port(), timeout_s, results, args),
            nprocs=world_size,
            join=True,
        )
    except mp.ProcessRaisedException as e:
        errors = [v for v in results.values() if isinstance(v, WorkerError)]
        raise WorkerError(str(errors[0]) if errors else str(e)) from None
    except mp.ProcessExitedException as e:
        raise WorkerError(f"a worker exited: {e}") from None
    finally:
        out = [results.get(r) for r in range(world_size)]
        manager.shutdown()
    return out


def launch(
    entry: Callable[..., Any],
    args: tuple,
    nproc: int,
    hosts: int = 1,
    max_restarts: int = 0,
    run_id: str | None = None,
) -> dict[int, Any]:
    """Run ``entry(*args)`` on ``nproc`` local workers with torch.distributed's elastic
    launcher (a c10d rendezvous on a free local port); per-rank return values.

    A failing worker stops all the others; after ``max_restarts`` restarts the
    launcher raises ``WorkerError`` with the first failure's message.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if nproc % hosts:
        raise ValueError(f"--hosts {hosts} must divide --nproc {nproc}")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id or uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
    )
    os.environ[HOSTS_ENV] = str(hosts)
    try:
        return elastic_launch(config, entry)(*args)
    except ChildFailedError as e:
        raise WorkerError(_root_failure(e.failures)) from None


def _root_failure(failures: dict) -> str:
    """The message of the failure that caused the others: the earliest one, preferring
    a worker's own error over a peer's lost connection or a kill signal."""

    def describe(rank, failure) -> str:
        line = _error_line(failure.message)
        if not line:
            line = f"exit code {failure.exitcode}"
            if failure.exitcode < 0:
                line += f" (signal {failure.signal_name()})"
        return f"rank {rank}: {line}"

    def secondary(failure) -> bool:
        text = str(failure.message)
        return not text or "closed by peer" in text or "Connection reset" in text

    ordered = sorted(failures.items(), key=lambda kv: (secondary(kv[1]), kv[1].timestamp))
    return describe(*ordered[0])


def _error_line(message: object) -> str:
    """The error of a worker as its traceback's last line (``Type: text``)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message).strip()
    return text.splitlines()[-1] if text else ""
