"""``towerrec ARGS...`` for the tests, in a fresh process each time without paying for
torch's import each time (about 2-3 s on 2 cores, most of a short command's run).

A server process (``python -c`` of this file's ``serve``, started on first use) imports
torch and the command line's modules once and never runs a torch operator, so libgomp's
threads, which a fork does not carry over, do not exist in it yet (the threads its imports
start, OpenBLAS's and jemalloc's, are made for forks: the fork server of ``spawn_world``
forks its ranks from the same imports). For each command it forks a
child, which takes the caller's directory, environment and argument list, points its
descriptors 0, 1 and 2 at ``/dev/null`` and two files, and runs ``towerrec.cli`` as
``python -m`` would (``runpy``, ``__main__``, ``sys.path[0]`` the directory); it ends as
an interpreter does (non-daemon threads joined, ``atexit`` run, streams flushed), with
the status ``python -m towerrec.cli`` would have.

What a child cannot take from the caller is what the interpreter and its libraries read
while they load: OpenMP's and the allocator's variables (``OMP_NUM_THREADS`` among them),
``PYTHON*``, ``LD_*``. So there is one server for each set of those variables a caller
asks for, started with them; any other variable is the child's own.

``run`` returns what ``subprocess.run(capture_output=True, text=True)`` would.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

# Read while the interpreter and its libraries load, so fixed for a server's children.
_LOAD_TIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "MALLOC_", "LD_", "PYTHON", "CUDA")
# What the server imports once: torch and what a command goes on to import.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "towerrec.cli.app",
    "towerrec.config",
    "towerrec.workflows.training",
)


def _load_time(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_LOAD_TIME)))


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import runpy; runpy.run_path({__file__!r}, run_name='serve')"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.send: IO[str] = self.proc.stdin
        self.receive: IO[str] = self.proc.stdout
        self.lock = threading.Lock()  # one command at a time on the channel

    def run(self, request: dict[str, Any], timeout: float) -> int:
        """The child's status (``-N``: ended by signal N); ``TimeoutExpired`` after
        ``timeout`` s, the child killed."""
        with self.lock:
            self.send.write(json.dumps(request) + "\n")
            pid = self._reply()
            timer = _Timer(timeout, pid)
            try:
                status = self._reply()
            finally:
                timer.cancel()
        if timer.fired:
            raise subprocess.TimeoutExpired(request["argv"], timeout)
        return status

    def _reply(self) -> int:
        line = self.receive.readline()
        if not line:
            raise RuntimeError("the test command server ended; its error is above")
        return int(line)

    def close(self) -> None:
        self.send.close()
        self.proc.wait(timeout=30)


class _Timer:
    """Kills ``pid`` after ``timeout`` s unless cancelled."""

    def __init__(self, timeout: float, pid: int) -> None:
        self.fired = False
        self._timer = threading.Timer(timeout, self._fire, (pid,))
        self._timer.daemon = True
        self._timer.start()

    def _fire(self, pid: int) -> None:
        self.fired = True
        with contextlib.suppress(ProcessLookupError):  # it ended just now
            os.kill(pid, signal.SIGKILL)

    def cancel(self) -> None:
        self._timer.cancel()


_SERVERS: dict[tuple[tuple[str, str], ...], _Server] = {}


def run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -m towerrec.cli ARGS`` from ``cwd`` with exactly ``env``, captured."""
    key = _load_time(env)
    if key not in _SERVERS or _SERVERS[key].proc.poll() is not None:  # none yet, or it ended
        _SERVERS[key] = _Server(env)
    argv = [sys.executable, "-m", "towerrec.cli", *args]
    with tempfile.TemporaryDirectory(prefix="towerrec-cli-") as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        request = {
            "args": args,
            "argv": argv,
            "cwd": str(cwd),
            "env": env,
            "out": str(out),
            "err": str(err),
        }
        status = _SERVERS[key].run(request, timeout)
        return subprocess.CompletedProcess(
            argv, status, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


@atexit.register
def _close_all() -> None:
    for server in _SERVERS.values():
        try:
            server.close()
        except Exception:
            server.proc.kill()
    _SERVERS.clear()


# ---------------------------------------------------------------- the server's side
def _serve() -> None:
    import importlib

    # The requests' own channel, away from descriptors 0 and 1, which the children take.
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    for name in _PRELOAD:
        importlib.import_module(name)
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _child(request)  # never returns
        replies.write(f"{pid}\n")
        _, status = os.waitpid(pid, 0)
        replies.write(f"{os.waitstatus_to_exitcode(status)}\n")


def _child(request: dict[str, Any]) -> None:
    import runpy
    import traceback

    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["out"]), (2, request["err"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = ["-m", *request["args"]]  # runpy sets argv[0] to the module's file
        sys.path[0] = request["cwd"]  # as ``python -m`` from that directory
        try:
            runpy.run_module("towerrec.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


if __name__ == "serve":
    _serve()
