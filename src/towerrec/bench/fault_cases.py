"""The cases of ``towerrec bench faults``: one fault each, injected into a real
``towerrec train --nproc N --hosts H --max-restarts K`` run.

==================  ===============================================================
case                fault
==================  ===============================================================
kill_step           SIGKILL of one rank at a random step (probe)
kill_checkpoint     SIGKILL of one rank right after it wrote its shard of a
                    checkpoint, before the checkpoint is complete (probe)
kill_eval           SIGKILL of one rank during an evaluation (probe)
torchrun_kill       SIGKILL of one rank at a random step of a run that torchrun
                    launched (``torchrun --max-restarts``, as on many hosts)
sigterm             SIGTERM to one rank at a random step (probe); then ``--resume``
stall               one rank sleeps longer than ``distributed.timeout_s`` (probe)
loader_worker       SIGKILL of a data-loader worker of one rank
                    (``data.loader.num_workers = 2``; probe)
link_down           two network namespaces of 2 ranks each (``bench/netns.py``,
                    torchrun per host); the link between them is set down for
                    ``link_down_s`` seconds (``ip link``; root)
enospc              the run directory on a tmpfs that holds one checkpoint and a
                    half: the second checkpoint fails for want of space; then the
                    tmpfs is enlarged and the run resumed with ``--resume``
==================  ===============================================================

The probe (``bench/probe.py``) fires a fault inside the rank at an exact step;
the network and the disk are changed from outside (``ip``, ``mount``). Each case
returns its row of the benchmark's table (``FaultBench.assess``).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from towerrec.bench.fault_runs import (
    TrainProcess,
    checkout_env,
    compare_states,
    error_line,
    final_state,
    python_train,
    read_jsonl,
    recovery,
    start_train,
    train_args,
    wait_all,
)
from towerrec.bench.probe import ProbeSpec

__all__ = ["CASES", "FaultBench", "FaultSettings"]


@dataclass(frozen=True)
class FaultSettings:
    steps: int = 60
    batch_size: int = 512
    checkpoint_every: int = 10
    eval_every: int = 20
    nproc: int = 4
    hosts: int = 2
    max_restarts: int = 2
    seed: int = 0
    timeout_s: float = 900.0
    stall_timeout_s: float = 30.0
    link_down_s: float = 30.0
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.checkpoint_every < 1 or self.steps < 4 * self.checkpoint_every:
            raise ValueError(
                f"--steps {self.steps} must be at least 4 x --checkpoint-every "
                f"{self.checkpoint_every} (>= 1): the faults fall between checkpoints"
            )
        if self.eval_every < 1 or self.eval_every >= self.steps:
            raise ValueError(f"--eval-every must be in [1, --steps), got {self.eval_every}")
        if self.nproc < 2 or self.nproc % self.hosts:
            raise ValueError(f"--nproc {self.nproc} must be >= 2 and a multiple of --hosts")


@dataclass
class FaultBench:
    """One benchmark's data, reference run and working directory."""

    settings: FaultSettings
    work: Path
    cache: Path
    site: Path  # the probe's sitecustomize
    rng: random.Random = field(default_factory=random.Random)
    reference: dict[str, Any] | None = None

    def overrides(self, *extra: str) -> list[str]:
        s = self.settings
        return [
            "data.source=criteo",
            f"data.path={self.cache}",
            f"train.steps={s.steps}",
            f"train.batch_size={s.batch_size}",
            f"train.eval_every={s.eval_every}",
            "train.eval_batch_size=256",
            f"train.checkpoint_every={s.checkpoint_every}",
            "train.keep_checkpoints=2",
            "train.log_every=10",
            "train.progress=false",
            f"optimizer.warmup_steps={max(1, s.steps // 10)}",
            *s.overrides,
            *extra,
        ]

    def launch_flags(self, resume: bool = False) -> list[str]:
        s = self.settings
        flags = ["--nproc", str(s.nproc), "--hosts", str(s.hosts)]
        flags += ["--max-restarts", str(s.max_restarts)]
        return flags + (["--resume"] if resume else [])

    def probe_env(self, spec: ProbeSpec) -> dict[str, str]:
        return checkout_env(self.site, spec.environ())

    def run_local(
        self,
        name: str,
        spec: ProbeSpec | None,
        extra: Sequence[str] = (),
        resume: bool = False,
        out: Path | None = None,
    ) -> tuple[Path, list[int] | None]:
        """``towerrec train`` on N local ranks into ``work/name`` (or ``out``); its exit code
        (None: killed after ``timeout_s``)."""
        out = out or self.work / name
        overrides = [] if resume else self.overrides(*extra)
        env = self.probe_env(spec) if spec else checkout_env()
        command = python_train(out, overrides, *self.launch_flags(resume))
        run = start_train(command, self.work / f"{name}.log", env, append=resume)
        return out, wait_all([run], self.settings.timeout_s)

    def random_step(self) -> int:
        """A step between checkpoints, past the first one and before the last."""
        s = self.settings
        choices = [k for k in range(s.checkpoint_every + 2, s.steps - 1) if k % s.checkpoint_every]
        return self.rng.choice(choices)

    def probe(self, name: str, fault: str = "", **kw: Any) -> ProbeSpec:
        directory = self.work / f"{name}.probe"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        return ProbeSpec(dir=str(directory), fault=fault, **kw)

    def assess(
        self, name: str, run: Path, codes: list[int] | None, fault_time: float | None
    ) -> dict[str, Any]:
        """The row of one case: outcome, equality with the reference, steps and seconds lost."""
        row: dict[str, Any] = {"exit_codes": codes}
        if codes is None:
            row.update(outcome="hang", ok=False)
            return row
        summary_path = run / "summary.json"
        completed = summary_path.exists() and json.loads(summary_path.read_text())["completed"]
        row["outcome"] = "completed" if completed and not any(codes) else "error"
        if any(codes):
            row["error"] = error_line(self.work / f"{name}.log")
        progress = read_jsonl(self.work / f"{name}.probe" / "progress.jsonl")
        if fault_time is not None:
            row.update(recovery(progress, fault_time))
        steps = _checkpoint_steps(run)
        row["checkpoints"] = steps
        try:
            state = final_state(run)
        except (OSError, ValueError) as e:
            row.update(loads=False, load_error=str(e)[:300])
            state = None
        if state is not None and completed:
            assert self.reference is not None
            row.update(compare_states(state, self.reference))
        if row["outcome"] == "completed":
            row["ok"] = bool(row.get("equal"))
        else:  # a clear error (the CLI's one line), and the last checkpoint still loads
            error = row.get("error", "")
            row["clear_error"] = error.startswith("error:") and "traceback" not in error.lower()
            row["ok"] = row["clear_error"] and bool(steps) and state is not None
        return row


def _checkpoint_steps(run: Path) -> list[int]:
    from towerrec.train.checkpoint import CheckpointManager

    return CheckpointManager(run / "checkpoint").steps()


def _fault_time(spec: ProbeSpec) -> float | None:
    path = Path(spec.dir) / "fault.json"
    return json.loads(path.read_text())["time"] if path.exists() else None


def _probe_case(
    bench: FaultBench, name: str, fault: str, step: int, extra: Sequence[str] = (), **kw: Any
) -> dict[str, Any]:
    rank = bench.rng.randrange(bench.settings.nproc)
    spec = bench.probe(name, fault, rank=rank, step=step, **kw)
    run, codes = bench.run_local(name, spec, extra)
    row = {"rank": rank, "at_step": step, **bench.assess(name, run, codes, _fault_time(spec))}
    row["fired"] = _fault_time(spec) is not None
    row["ok"] = row["ok"] and row["fired"]
    return row


def kill_step(bench: FaultBench) -> dict[str, Any]:
    return _probe_case(bench, "kill_step", "kill", bench.random_step())


def kill_checkpoint(bench: FaultBench) -> dict[str, Any]:
    return _probe_case(
        bench, "kill_checkpoint", "kill_in_checkpoint", 2 * bench.settings.checkpoint_every
    )


def kill_eval(bench: FaultBench) -> dict[str, Any]:
    s = bench.settings
    step = s.eval_every if s.eval_every % s.checkpoint_every else s.eval_every + s.eval_every
    return _probe_case(bench, "kill_eval", "kill_in_eval", min(step, s.steps - 1))


def stall(bench: FaultBench) -> dict[str, Any]:
    s = bench.settings
    row = _probe_case(
        bench,
        "stall",
        "stall",
        bench.random_step(),
        extra=[f"distributed.timeout_s={s.stall_timeout_s}"],
        stall_s=s.stall_timeout_s + 15,
    )
    row["timeout_s"] = s.stall_timeout_s
    return row


def loader_worker(bench: FaultBench) -> dict[str, Any]:
    return _probe_case(
        bench, "loader_worker", "kill_loader_worker", bench.random_step(),
        extra=["data.loader.num_workers=2"],
    )  # fmt: skip


def torchrun_kill(bench: FaultBench) -> dict[str, Any]:
    """SIGKILL of one rank at a random step of a run launched by torchrun (one launcher
    for the N ranks, ``--max-restarts``), as multi-host users launch."""
    s, name, step = bench.settings, "torchrun_kill", bench.random_step()
    rank = bench.rng.randrange(s.nproc)
    spec = bench.probe(name, "kill", rank=rank, step=step)
    run = bench.work / name
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={s.nproc}", f"--max-restarts={s.max_restarts}",
        *train_args(run, bench.overrides()), "--hosts", str(s.hosts),
    ]  # fmt: skip
    process = start_train(command, bench.work / f"{name}.log", bench.probe_env(spec))
    codes = wait_all([process], s.timeout_s)
    row = {"rank": rank, "at_step": step, **bench.assess(name, run, codes, _fault_time(spec))}
    row["fired"] = _fault_time(spec) is not None
    row["ok"] = row["ok"] and row["fired"]
    return row


def sigterm(bench: FaultBench) -> dict[str, Any]:
    """A graceful stop: every rank stops after the same step with a checkpoint; the user
    continues with ``--resume``."""
    name, step = "sigterm", bench.random_step()
    rank = bench.rng.randrange(bench.settings.nproc)
    spec = bench.probe(name, "term", rank=rank, step=step)
    run, codes = bench.run_local(name, spec)
    stopped: dict[str, Any] = {"exit_codes": codes}
    summary = run / "summary.json"
    if codes == [0] and summary.exists():
        first = json.loads(summary.read_text())
        stopped.update(stopped_at=first["steps"], completed=first["completed"])
        stopped["checkpoints"] = _checkpoint_steps(run)
        _, codes = bench.run_local(name, spec, resume=True, out=run)
    row = bench.assess(name, run, codes, _fault_time(spec))
    return {"rank": rank, "at_step": step, "first_run": stopped, **row}


def enospc(bench: FaultBench) -> dict[str, Any]:
    """The run directory on a tmpfs too small for a second checkpoint."""
    name = "enospc"
    run = bench.work / name
    reference_ckpt = bench.work / "reference" / "checkpoint"
    latest = max(reference_ckpt.iterdir())
    checkpoint_kib = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()) // 1024
    size_kib = int(1.5 * checkpoint_kib) + 256  # one checkpoint, the logs, half another
    run.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(run)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode:
        return {"outcome": "skipped", "reason": f"mount tmpfs: {mounted.stderr.strip()}"}
    try:
        spec = bench.probe(name)
        _, codes = bench.run_local(name, spec, out=run)
        row = bench.assess(name, run, codes, None)
        row["tmpfs_kib"], row["checkpoint_kib"] = size_kib, checkpoint_kib
        row["partial_left"] = sorted(p.name for p in (run / "checkpoint").glob("*.partial"))
        if row["outcome"] == "error":  # free space, as a user would, and continue
            subprocess.run(
                ["mount", "-o", f"remount,size={8 * checkpoint_kib}k", str(run)], check=True
            )
            _, codes = bench.run_local(name, spec, resume=True, out=run)
            row["after_freeing_space"] = bench.assess(name, run, codes, None)
        return row
    finally:
        subprocess.run(["umount", "-l", str(run)], capture_output=True)


def link_down(bench: FaultBench) -> dict[str, Any]:
    """Host h = network namespace h (``bench/netns.py``); the veth between them goes down
    for ``link_down_s`` seconds at a random step and comes back."""
    from towerrec.bench.netns import LinkConfig, check_netns_tools, two_host_network

    s = bench.settings
    try:
        check_netns_tools()
    except ValueError as e:
        return {"outcome": "skipped", "reason": str(e)}
    name, step = "link_down", bench.random_step()
    spec = bench.probe(name)
    run = bench.work / name
    ranks_per_host = s.nproc // s.hosts
    if s.hosts != 2:
        return {"outcome": "skipped", "reason": "link_down needs --hosts 2"}
    events: dict[str, float] = {}
    with two_host_network(LinkConfig(gbit=1.0)) as net:

        def set_link(state: str) -> None:
            for h in (0, 1):
                cmd = [*net.exec_prefix(h), "ip", "link", "set", "dev", net.devices[h], state]
                subprocess.run(cmd, check=True, capture_output=True)

        def poll() -> None:
            if "down" not in events:
                progress = read_jsonl(Path(spec.dir) / "progress.jsonl")
                if progress and progress[-1]["step"] >= step:
                    set_link("down")
                    events["down"] = time.time()
            elif "up" not in events and time.time() - events["down"] >= s.link_down_s:
                set_link("up")
                events["up"] = time.time()

        procs: list[TrainProcess] = []
        for host in range(2):
            command = [
                *net.exec_prefix(host),
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={host}",
                f"--nproc-per-node={ranks_per_host}",
                f"--master-addr={net.addresses[0]}",
                "--master-port=29531",
                f"--max-restarts={s.max_restarts}",
                *train_args(run, bench.overrides()),
            ]
            env = {**bench.probe_env(spec), "GLOO_SOCKET_IFNAME": net.devices[host]}
            procs.append(start_train(command, bench.work / f"{name}.h{host}.log", env))
        codes = wait_all(procs, s.timeout_s, poll)
        if "down" in events and "up" not in events:
            set_link("up")
    shutil.copy(bench.work / f"{name}.h0.log", bench.work / f"{name}.log")
    row = bench.assess(name, run, codes, events.get("down"))
    row.update(at_step=step, link_down_s=s.link_down_s)
    if "up" in events:
        progress = read_jsonl(Path(spec.dir) / "progress.jsonl")
        later = [r["time"] for r in progress if r["time"] > events["up"]]
        row["first_step_after_link_up_s"] = round(later[0] - events["up"], 2) if later else None
    return row


# name -> the case; `towerrec bench faults` runs them in this order
CASES: dict[str, Callable[[FaultBench], dict[str, Any]]] = {
    "kill_step": kill_step,
    "kill_checkpoint": kill_checkpoint,
    "kill_eval": kill_eval,
    "torchrun_kill": torchrun_kill,
    "sigterm": sigterm,
    "stall": stall,
    "loader_worker": loader_worker,
    "link_down": link_down,
    "enospc": enospc,
}
