"""Starting worker processes: torch.distributed's elastic launcher, and a small spawner.

- ``launch(entry, args, nproc, hosts)``: what ``towerrec train --nproc N`` does:
  N local workers through ``torch.distributed.elastic`` (the engine behind
  ``torchrun``), with ``--max-restarts`` elastic restarts. A worker that raises
  makes the agent stop every other worker and report the first error.
- ``spawn_world(fn, world_size, hosts, *args)``: N gloo processes on a free
  port for tests and benchmarks; ``fn(topology, *args)`` runs in each, and the
  per-rank return values come back. When one rank raises, the others are
  terminated and the error is raised here, so a failure never hangs.

How ``spawn_world`` tells a rank's end (``RankEnd``):

- ``clean``: it returned its value and its process exited with code 0;
- ``teardown crash``: it returned its value, then its process died (a
  signal, a non-zero exit: e.g. a C++ ``std::terminate`` in gloo's teardown)
  or was still running ``TEARDOWN_GRACE_S`` after every rank had returned.
  The values count, but a teardown crash is a bug, never a pass: it is
  reported as a ``TeardownCrashWarning`` naming the rank and its exit code or
  signal, and appended as a JSON line to the file ``$TOWERREC_TEARDOWN_LOG``
  names when set (the test suite sets it and fails a test whose worlds, in
  its own process or in ones it started, wrote to it);
- ``failed``: it raised, died before returning, or exited without a value;
  ``WorkerError`` is raised.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import wait as connection_wait
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from towerrec.distributed.mesh import HOSTS_ENV, Topology

__all__ = [
    "TEARDOWN_LOG_ENV",
    "RankEnd",
    "TeardownCrashWarning",
    "WorkerError",
    "free_port",
    "launch",
    "rank_end",
    "spawn_world",
]

TEARDOWN_GRACE_S = 30.0  # how long a rank may tear down after every rank has returned
TEARDOWN_LOG_ENV = "TOWERREC_TEARDOWN_LOG"  # a file every teardown crash is appended to


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its error."""


class TeardownCrashWarning(RuntimeWarning):
    """A rank returned its value, then crashed or hung tearing down (module doc)."""


@dataclass(frozen=True)
class RankEnd:
    """How one rank of ``spawn_world`` ended: ``clean``, ``teardown crash`` or ``failed``.
    ``exitcode``: its process's (negative: the signal that ended it; None: still running
    after the grace period, then stopped)."""

    rank: int
    kind: str
    exitcode: int | None

    def describe(self) -> str:
        if self.kind == "clean":
            return f"rank {self.rank} returned its value and exited cleanly"
        if self.exitcode is None:
            how = f"hung (still running {TEARDOWN_GRACE_S:g} s after every rank returned)"
        elif self.exitcode < 0:
            how = f"was killed by {_signal_name(-self.exitcode)} (exit code {self.exitcode})"
        else:
            how = f"exited with code {self.exitcode}"
        if self.kind == "teardown crash":
            return f"rank {self.rank} returned its value, then {how} in teardown"
        return f"rank {self.rank} failed: it {how} without returning its value"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def rank_end(rank: int, exitcode: int | None, returned: bool) -> RankEnd:
    """Classify a rank's end from its exit code (None: stopped after the grace period)
    and whether it wrote its return value."""
    if not returned:
        return RankEnd(rank, "failed", exitcode)
    return RankEnd(rank, "clean" if exitcode == 0 else "teardown crash", exitcode)


def _report_teardown_crashes(ends: Sequence[RankEnd], fn: Callable[..., Any]) -> None:
    crashed = [e for e in ends if e.kind == "teardown crash"]
    if not crashed:
        return
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    log = os.environ.get(TEARDOWN_LOG_ENV)
    if log:
        with open(log, "a") as f:
            for end in crashed:
                f.write(json.dumps({"fn": where, **asdict(end)}) + "\n")
    text = "; ".join(e.describe() for e in crashed)
    warnings.warn(
        f"spawn_world({where}): {text}. The values count, but a crash in teardown is a bug"
        " to find (a process group or thread not shut down, a C++ abort at exit)",
        TeardownCrashWarning,
        stacklevel=3,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    hosts: int,
    port: int,
    timeout_s: float,
    results_dir: str,
    args: tuple,
    environ: dict[str, str],
    cwd: str,
    stdio: _CallerStdio | None,
) -> None:
    # A rank forked from the fork server starts with that server's environment,
    # directory and output; it takes the caller's, as a spawned process would.
    if stdio is not None:
        stdio.use()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    # A fatal signal (the SIGABRT of a C++ std::terminate) prints every thread's Python
    # stack to stderr: whether a rank died inside destroy_process_group, or later (a
    # spawned rank's interpreter finalization: no stack, C++ static destructors at exit;
    # a forked one ends with ``os._exit`` once ``fn`` has returned).
    faulthandler.enable(all_threads=True)
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
        result: Any = fn(Topology(world_size, hosts, rank), *args)
    except Exception as e:
        _write_result(
            results_dir,
            rank,
            WorkerError(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"),
        )
        raise
    else:
        _write_result(results_dir, rank, result)
    finally:
        dist.destroy_process_group()


def _write_result(results_dir: str, rank: int, value: Any) -> None:
    """Each rank's return value goes to a file of its own (written whole, then renamed),
    so no shared server process is needed to collect them."""
    path = os.path.join(results_dir, f"rank{rank}.pt")
    torch.save(value, path + ".part")
    os.replace(path + ".part", path)


def _read_result(results_dir: str, rank: int) -> Any:
    path = os.path.join(results_dir, f"rank{rank}.pt")
    if not os.path.exists(path):
        return None
    return torch.load(path, weights_only=False)


def _returned(results_dir: str, rank: int) -> bool:
    """Whether ``rank`` wrote its return value (not an error): its work is done."""
    path = os.path.join(results_dir, f"rank{rank}.pt")
    return os.path.exists(path) and not isinstance(_read_result(results_dir, rank), WorkerError)


def _wait_for_workers(
    procs: Sequence[BaseProcess], results_dir: str, grace_s: float
) -> tuple[list[int], set[int]]:
    """Block until every process has ended or one has failed: the ranks in the order
    they failed (empty when none did), and the ranks stopped after the grace period.
    On a failure the others are terminated, so a rank waiting on a collective with a
    dead peer never hangs the caller. A rank that wrote its value before dying in
    teardown has not failed (module doc); once every rank has written its value, ranks
    still running after ``grace_s`` are stopped."""
    failed: list[int] = []
    stopped: set[int] = set()
    running = dict(enumerate(procs))
    returned: set[int] = set()
    all_returned_at: float | None = None
    while running and not failed:
        connection_wait([p.sentinel for p in running.values()], timeout=1.0)
        for rank, p in list(running.items()):
            if p.exitcode is not None:
                del running[rank]
                if not _returned(results_dir, rank):
                    failed.append(rank)
        if all_returned_at is None:
            returned |= {r for r in running if r not in returned and _returned(results_dir, r)}
            if returned.issuperset(running):
                all_returned_at = time.monotonic()
        elif time.monotonic() - all_returned_at > grace_s:
            for rank, p in running.items():
                p.terminate()
                p.join()
                stopped.add(rank)
            running.clear()
    return failed, stopped


# What the fork server imports once, so that a world's ranks start in milliseconds
# rather than each importing torch (1.5-2 s on 2 cores), and the parts of torch a
# training rank goes on to import (DTensor, FSDP, DCP: about 0.5 s more). ``__main__``
# first, as ``spawn`` would import it: a ``fn`` defined in the caller's script unpickles.
_PRELOAD = [
    "__main__",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "towerrec.distributed.launch",
]


class _CallerStdio:
    """The caller's standard output and error as they are when a rank starts. Pickled
    with a rank of the fork server, it sends the two descriptors along
    (``reduction.DupFd``), so the rank writes where the caller's output goes now (a
    pytest capture, a redirect), not where it went when the server started. A
    descriptor the caller has closed is closed in the rank too, and its stream is
    ``None``, as in a spawned process."""

    def __init__(self, fds: tuple[Any, Any] | None = None) -> None:
        self._fds = fds

    def __reduce__(self) -> tuple[type[_CallerStdio], tuple[tuple[Any, Any]]]:
        return _CallerStdio, ((_dup_for_rank(1), _dup_for_rank(2)),)

    def use(self) -> None:
        """In the rank: point descriptors 1 and 2 at the caller's."""
        if self._fds is None:
            return
        for target, fd in zip((1, 2), self._fds, strict=True):
            if fd is None:  # as in a spawned process: no descriptor, no stream
                with contextlib.suppress(OSError):
                    os.close(target)
                setattr(sys, "stdout" if target == 1 else "stderr", None)
                continue
            received = fd.detach()
            if received != target:
                os.dup2(received, target)
                os.close(received)


def _dup_for_rank(fd: int) -> Any:
    """``fd`` to send with the rank being started, or ``None`` when it is not open."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return reduction.DupFd(fd)


def _rank_context() -> ForkServerContext | SpawnContext:
    """The ``forkserver`` context where the platform has one (its server started fresh,
    never forked from a process with threads), with ``_PRELOAD`` imported by the server;
    ``spawn`` elsewhere. The preload takes effect when the server starts: the first
    world of the process starts it, unless something else already did."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def spawn_world(
    fn: Callable[..., Any],
    world_size: int,
    hosts: int = 1,
    *args: Any,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(topology, *args)`` on ``world_size`` gloo ranks; their return values.

    ``fn`` must be importable (a module-level function). Collectives wait at
    most ``timeout_s`` for a peer. The ranks are forked from a fork server
    that has imported torch (``_rank_context``; never forked from this process,
    which may already run torch's threads), each with this process's environment,
    directory and output, and return their values through files, not a manager
    process.
    """
    context = _rank_context()
    port = free_port()
    forked = context.get_start_method() == "forkserver"
    caller = (dict(os.environ), os.getcwd(), _CallerStdio() if forked else None)
    with tempfile.TemporaryDirectory(prefix="towerrec-world-") as results_dir:
        procs = [
            context.Process(
                target=_spawned,
                args=(rank, fn, world_size, hosts, port, timeout_s, results_dir, args, *caller),
                name=f"towerrec-rank{rank}",
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            failed, stopped = _wait_for_workers(procs, results_dir, TEARDOWN_GRACE_S)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join()
        results = [_read_result(results_dir, rank) for rank in range(world_size)]
        ends = [
            rank_end(r, None if r in stopped else p.exitcode, _returned(results_dir, r))
            for r, p in enumerate(procs)
        ]
    if failed:
        # A rank that died without an error file (a signal, an abort) is the cause: its
        # peers' errors are the collectives it left hanging, however fast they came.
        # Else the first rank that failed with an error of its own; a peer that died
        # waiting on it, or was terminated, has no error file or a secondary one.
        errors = [results[r] for r in failed if isinstance(results[r], WorkerError)]
        errors += [e for e in results if isinstance(e, WorkerError) and e not in errors]
        silent = [r for r in failed if not isinstance(results[r], WorkerError)]
        if silent:
            codes = ", ".join(f"rank {r}: exit code {procs[r].exitcode}" for r in silent)
            then = f"; then {errors[0]}" if errors else ""
            raise WorkerError(f"a worker exited without a result ({codes}){then}")
        raise WorkerError(str(errors[0]))
    _report_teardown_crashes(ends, fn)
    return results


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
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if nproc % hosts:
        raise ValueError(f"--hosts {hosts} must divide --nproc {nproc}")
    # The workers inherit the hosts through the environment; the launcher's process gets
    # its own environment back (the elastic agent adds variables of its own to it too).
    environ = dict(os.environ)
    os.environ[HOSTS_ENV] = str(hosts)
    try:
        with tempfile.TemporaryDirectory(prefix="towerrec-errors-") as errors_dir:
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
                # The agent's per-attempt folders, which it would leave in the temp folder
                # (``torchelastic_*``) after every run: removed with this one.
                logs_specs=DefaultLogsSpecs(log_dir=os.path.join(errors_dir, "agent")),
            )
            # torch's process start leaves a failed worker's pickled traceback
            # (``pytorch-errorfile-*``) in the temp folder: it goes with this one.
            saved_tempdir, tempfile.tempdir = tempfile.tempdir, errors_dir
            try:
                return elastic_launch(config, _recording_errors)(entry, errors_dir, *args)
            except ChildFailedError as e:
                raise WorkerError(_root_failure(e.failures, errors_dir)) from None
            finally:
                tempfile.tempdir = saved_tempdir
    finally:
        os.environ.clear()
        os.environ.update(environ)


def _recording_errors(entry: Callable[..., Any], errors_dir: str, *args: Any) -> Any:
    """``entry(*args)`` in a launched worker; an error it raises is also written to
    ``errors_dir`` (the agent may stop a failing rank's peers, whose lost connections it
    sees, before it sees the rank's own error)."""
    try:
        return entry(*args)
    except Exception as e:
        path = os.path.join(errors_dir, f"rank{os.environ.get('RANK', '0')}.txt")
        with open(path + ".part", "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        os.replace(path + ".part", path)
        raise


def _root_failure(failures: dict, errors_dir: str | None = None) -> str:
    """The message of the failure that caused the others: the earliest one, preferring
    a worker's own error over a peer's lost connection or a kill signal; when the agent
    saw only such secondary failures, the newest error a worker wrote to ``errors_dir``."""

    def describe(rank, failure) -> str:
        line = _error_line(failure.message)
        if not line:
            line = f"exit code {failure.exitcode}"
            if failure.exitcode < 0:
                line += f" (signal {failure.signal_name()})"
        return f"rank {rank}: {line}"

    def secondary(failure) -> bool:
        text = str(failure.message)
        return not text or _lost_peer(text)

    ordered = sorted(failures.items(), key=lambda kv: (secondary(kv[1]), kv[1].timestamp))
    if secondary(ordered[0][1]) and errors_dir is not None:
        written = [
            os.path.join(errors_dir, name)
            for name in os.listdir(errors_dir)
            if name.startswith("rank") and name.endswith(".txt")
        ]
        texts = {path: Path(path).read_text() for path in written}
        own = [p for p, text in texts.items() if text and not _lost_peer(text)]
        if own:
            newest = max(own, key=os.path.getmtime)
            rank = os.path.basename(newest)[len("rank") : -len(".txt")]
            return f"rank {rank}: {texts[newest].splitlines()[0]}"
    return describe(*ordered[0])


def _lost_peer(text: str) -> bool:
    """A collective's error when a peer went away: a consequence, not a cause."""
    return "closed by peer" in text or "Connection reset" in text


def _error_line(message: object) -> str:
    """The error of a worker as its traceback's last line (``Type: text``)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message).strip()
    return text.splitlines()[-1] if text else ""
