"""The in-process probe of ``towerrec bench faults`` and ``towerrec bench soak``.

The library never imports this module. A benchmark that wants it writes a
``sitecustomize.py`` (``write_sitecustomize``) into a directory of its own, puts
that directory first on the ``PYTHONPATH`` of the run it starts and sets
``TOWERREC_BENCH_PROBE`` to a JSON ``ProbeSpec``; every Python process of the run
(the launcher, each rank, a torchrun worker in a network namespace) then loads
the probe at start-up. Without the variable nothing here runs.

The probe wraps a few functions when their module is first imported
(``PATCH_POINTS``; a test keeps the names in step with the library):

- ``towerrec.train.loop.lr_factor``, called at the start of every training
  step with the step number: each rank notes its pid (``pids/``), rank 0
  appends ``(time, step, restart)`` to ``progress.jsonl``, ``sample_every``
  takes a resource sample (``samples_rank<R>.jsonl``), and a step fault
  (``kill``, ``term``, ``stall``, ``kill_loader_worker``) fires on its rank;
- ``towerrec.train.loop.evaluate``: ``kill_in_eval`` SIGKILLs its rank when
  it reads the first batch of the first evaluation at or after its step;
- ``_FileSystemWriter.write_data`` of ``torch.distributed.checkpoint``:
  ``kill_in_checkpoint`` SIGKILLs its rank right after the rank's shard file of
  the checkpoint of its step is written, before the checkpoint is complete.

A fault fires once per benchmark case (a marker file ``fault.json``, created
exclusively, also records when it fired), and only in the first attempt of a
run (an elastic restart does not fire it again).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ENV",
    "FAULT_KINDS",
    "PATCH_POINTS",
    "ProbeSpec",
    "install",
    "process_sample",
    "write_sitecustomize",
]

ENV = "TOWERREC_BENCH_PROBE"
# fault kind -> where it fires
FAULT_KINDS = {
    "kill": "step",  # SIGKILL at the start of the step
    "term": "step",  # SIGTERM at the start of the step (a graceful stop)
    "stall": "step",  # sleep `stall_s` at the start of the step
    "kill_loader_worker": "step",  # SIGKILL one data-loader worker of the rank
    "kill_in_eval": "eval",
    "kill_in_checkpoint": "checkpoint",
}
# module -> attributes wrapped when the module is imported
PATCH_POINTS: dict[str, tuple[str, ...]] = {
    "towerrec.train.loop": ("lr_factor", "evaluate"),
    "torch.distributed.checkpoint.filesystem": ("_FileSystemWriter.write_data",),
}


@dataclass(frozen=True)
class ProbeSpec:
    """What the probe does in a run: where it writes, which fault (``fault``: a key of
    ``FAULT_KINDS`` or ""), on which rank at which step, and how often it samples."""

    dir: str
    fault: str = ""
    rank: int = 0
    step: int = 0
    stall_s: float = 0.0
    sample_every: int = 0
    progress: bool = True
    disk_dir: str = ""  # the run directory whose size the samples include (rank 0)

    def __post_init__(self) -> None:
        if self.fault and self.fault not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.fault!r}; one of {sorted(FAULT_KINDS)}")

    def environ(self) -> dict[str, str]:
        return {ENV: json.dumps(asdict(self))}


def write_sitecustomize(directory: Path) -> Path:
    """A ``sitecustomize.py`` in ``directory`` that installs the probe when ``ENV`` is set;
    put ``directory`` first on the run's ``PYTHONPATH``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sitecustomize.py"
    path.write_text(
        "import os\n"
        f"if os.environ.get({ENV!r}):\n"
        "    from towerrec.bench.probe import install\n\n"
        "    install()\n"
    )
    return path


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _restart() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:  # one short write per line: whole lines under O_APPEND
        f.write(json.dumps(record) + "\n")


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with suppress(FileNotFoundError):  # a checkpoint being renamed or deleted
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def process_sample(pid: int | str = "self") -> dict[str, float]:
    """Resident memory (MiB), open descriptors and threads of process ``pid``."""
    proc = Path("/proc") / str(pid)
    status = dict(
        line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line
    )
    return {
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
        "fds": len(os.listdir(proc / "fd")),
        "threads": int(status["Threads"]),
    }


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in (Path("/proc") / str(pid) / "task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


class _Probe:
    def __init__(self, spec: ProbeSpec) -> None:
        self.spec = spec
        self.dir = Path(spec.dir)
        self.step = 0
        self.evaluations = 0
        self.noted_pid = False

    def _mine(self, where: str) -> bool:
        s = self.spec
        return (
            bool(s.fault)
            and FAULT_KINDS[s.fault] == where
            and _rank() == s.rank
            and _restart() == 0
            and self.step >= s.step
        )

    def _claim(self, **detail: Any) -> bool:
        """Whether this process fires the case's one fault (and records when)."""
        try:
            fd = os.open(self.dir / "fault.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        record = {"fault": self.spec.fault, "rank": _rank(), "step": self.step, **detail}
        os.write(fd, json.dumps({"time": time.time(), **record}).encode())
        os.close(fd)
        return True

    def on_step(self, step: int) -> None:
        self.step = step
        rank, s = _rank(), self.spec
        if not self.noted_pid:
            self.noted_pid = True
            (self.dir / "pids").mkdir(exist_ok=True)
            (self.dir / "pids" / f"rank{rank}.restart{_restart()}").write_text(str(os.getpid()))
        if rank == 0 and s.progress:
            _append(
                self.dir / "progress.jsonl",
                {"time": time.time(), "step": step, "restart": _restart()},
            )
        if s.sample_every and step % s.sample_every == 0:
            sample = {"step": step, "time": time.time(), **process_sample()}
            if rank == 0 and s.disk_dir:
                sample["disk_mb"] = _dir_bytes(Path(s.disk_dir)) / 2**20
            _append(self.dir / f"samples_rank{rank}.jsonl", sample)
        if not self._mine("step"):
            return
        if s.fault == "kill_loader_worker":
            workers = _children(os.getpid())
            if not workers or not self._claim(pid=workers[0]):
                return
            os.kill(workers[0], signal.SIGKILL)
        elif self._claim():
            if s.fault == "stall":
                time.sleep(s.stall_s)
            else:
                os.kill(os.getpid(), signal.SIGKILL if s.fault == "kill" else signal.SIGTERM)

    def on_eval_batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        self.evaluations += 1
        for batch in batches:
            if self._mine("eval") and self._claim(evaluation=self.evaluations):
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch

    def on_checkpoint_written(self, path: str) -> None:
        name = Path(path).name  # step_<N>.partial
        step = int(name.split("_")[1].split(".")[0]) if name.startswith("step_") else -1
        if step >= self.spec.step and self._mine("checkpoint") and self._claim(checkpoint=step):
            os.kill(os.getpid(), signal.SIGKILL)


def _patch(module: Any, probe: _Probe) -> None:
    name = module.__name__
    if name == "towerrec.train.loop":
        lr_factor, evaluate = module.lr_factor, module.evaluate

        def lr_factor_probed(config: Any, step: int, steps: int) -> float:
            probe.on_step(step)
            return lr_factor(config, step, steps)

        def evaluate_probed(model: Any, batches: Iterable[Any], *args: Any, **kw: Any) -> Any:
            return evaluate(model, probe.on_eval_batches(batches), *args, **kw)

        module.lr_factor, module.evaluate = lr_factor_probed, evaluate_probed
    elif name == "torch.distributed.checkpoint.filesystem":
        writer = module._FileSystemWriter
        write_data = writer.write_data

        def write_data_probed(self: Any, plan: Any, planner: Any) -> Any:
            future = write_data(self, plan, planner)
            future.wait()
            probe.on_checkpoint_written(str(self.path))
            return future

        writer.write_data = write_data_probed


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``_patch`` on each module of ``PATCH_POINTS`` right after it is executed."""

    def __init__(self, probe: _Probe) -> None:
        self.probe = probe

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in PATCH_POINTS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, probe = spec.loader, self.probe
        execute: Callable[[Any], None] = loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _patch(module, probe)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Start the probe of ``ENV``'s spec in this process (``sitecustomize`` calls this)."""
    spec = ProbeSpec(**json.loads(os.environ[ENV]))
    probe = _Probe(spec)
    for name in PATCH_POINTS:
        if name in sys.modules:  # already imported: patch it in place
            _patch(sys.modules[name], probe)
    sys.meta_path.insert(0, _PatchOnImport(probe))
