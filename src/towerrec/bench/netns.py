"""Two simulated hosts on one machine: network namespaces joined by a shaped veth link.

::

    namespace towerrec-<pid>-h0                 namespace towerrec-<pid>-h1
    ┌──────────────────────────────┐           ┌──────────────────────────────┐
    │ rank 0   rank 1   (lo: fast) │           │ rank 2   rank 3   (lo: fast) │
    │   trv<pid>a  10.231.S.1/24 ──┼── veth ───┼── 10.231.S.2/24  trv<pid>b   │
    │   tc: <rate>, <delay>        │  shaped   │   tc: <rate>, <delay>        │
    └──────────────────────────────┘  both     └──────────────────────────────┘
                                      ways

Traffic between two ranks of one namespace goes to a local address and so
over that namespace's loopback; traffic between namespaces crosses the veth
pair, whose both ends are shaped with ``tc`` (``tbf`` for a rate alone,
``netem`` when a delay is added). Gloo binds to the veth device
(``GLOO_SOCKET_IFNAME``), so a 2 x 2 gloo job sees exactly the topology of two
hosts of two accelerators with a slow link between them.

Only ``ip`` and ``tc`` (iproute2) are used, as subprocesses; creating
namespaces needs root. ``two_host_network`` removes what it made on exit,
exception or SIGTERM/SIGINT/SIGHUP, and first removes namespaces left behind
by earlier runs that died (ours carry the ``towerrec-<pid>-`` prefix, and the
pid is no longer alive).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace

__all__ = [
    "NETNS_PREFIX",
    "LinkConfig",
    "TwoHostNetwork",
    "check_netns_tools",
    "list_namespaces",
    "remove_stale_namespaces",
    "two_host_network",
]

NETNS_PREFIX = "towerrec-"
_NAME = re.compile(rf"^{NETNS_PREFIX}(\d+)-h\d+$")


@dataclass(frozen=True)
class LinkConfig:
    """The cross-host link: rate in Gbit/s each way, optional one-way delay, subnet."""

    gbit: float = 1.0
    delay_ms: float = 0.0
    subnet: int = 231  # addresses 10.<subnet>.<pid % 250 + 1>.{1,2}/24

    def __post_init__(self) -> None:
        if not self.gbit > 0:
            raise ValueError(f"--link-gbit must be > 0 (Gbit/s each way), got {self.gbit}")
        if not self.delay_ms >= 0:
            raise ValueError(f"--link-delay-ms must be >= 0, got {self.delay_ms}")
        if not 0 < self.subnet < 255:
            raise ValueError(f"the link subnet must be in 1..254, got {self.subnet}")

    def qdisc(self) -> list[str]:
        """``tc qdisc add dev X root`` arguments for this link."""
        rate = f"{self.gbit * 1000:g}mbit"
        if self.delay_ms > 0:
            # netem queues up to `limit` packets: a bandwidth-delay product with headroom
            bdp = self.gbit * 1e9 / 8 * (self.delay_ms / 1e3) / 1500
            limit = max(1000, int(4 * bdp))
            return ["netem", "rate", rate, "delay", f"{self.delay_ms:g}ms", "limit", str(limit)]
        # token bucket: 1 ms of tokens (at least 64 KiB, one GSO packet), 50 ms of queue
        burst = max(64 * 1024, int(self.gbit * 1e9 / 8 * 1e-3))
        return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


@dataclass(frozen=True)
class TwoHostNetwork:
    """What ``two_host_network`` made: host h is ``namespaces[h]`` with ``addresses[h]``
    on ``devices[h]``."""

    namespaces: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str]
    link: LinkConfig | None  # None: unshaped

    def exec_prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def reshape(self, link: LinkConfig | None) -> TwoHostNetwork:
        """Shape both veth ends as ``link`` says, or remove the shaping (None: the veth's
        own speed); the network as it now is. The namespaces and addresses stay."""
        for h in (0, 1):
            inside = [*self.exec_prefix(h), "tc", "qdisc"]
            if link is None:
                # no root qdisc to delete is fine: unshaped already
                subprocess.run(
                    [*inside, "del", "dev", self.devices[h], "root"], capture_output=True
                )
            else:
                _run([*inside, "replace", "dev", self.devices[h], "root", *link.qdisc()])
        return replace(self, link=link)


def _run(args: Sequence[str]) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def check_netns_tools() -> None:
    """Raise ``ValueError`` naming the fix unless this process can build namespaces."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ValueError(
            f"--network netns needs {' and '.join(missing)} (iproute2): install it "
            "(apt-get install iproute2), or use --network local"
        )
    if os.geteuid() != 0:
        raise ValueError(
            "--network netns creates network namespaces and needs root: run it as root "
            "(sudo), or use --network local (4 processes on loopback, no shaping)"
        )


def list_namespaces() -> list[str]:
    """Names of the network namespaces that exist now."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete our namespaces whose creating process is gone (a crashed run's); their names."""
    removed = []
    for name in list_namespaces():
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            removed.append(name)
    return removed


def _delete(namespaces: Sequence[str]) -> None:
    # deleting a namespace destroys the veth end inside it, and with it the peer
    for name in namespaces:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _build(link: LinkConfig, pid: int) -> TwoHostNetwork:
    ns = (f"{NETNS_PREFIX}{pid}-h0", f"{NETNS_PREFIX}{pid}-h1")
    devices = (f"trv{pid}a", f"trv{pid}b")
    third = pid % 250 + 1
    addresses = (f"10.{link.subnet}.{third}.1", f"10.{link.subnet}.{third}.2")
    for name in ns:
        _run(["ip", "netns", "add", name])
    _run(["ip", "link", "add", devices[0], "type", "veth", "peer", "name", devices[1]])
    for h in (0, 1):
        _run(["ip", "link", "set", devices[h], "netns", ns[h]])
        inside = ["ip", "netns", "exec", ns[h]]
        _run([*inside, "ip", "addr", "add", f"{addresses[h]}/24", "dev", devices[h]])
        _run([*inside, "ip", "link", "set", "lo", "up"])
        _run([*inside, "ip", "link", "set", devices[h], "up"])
        _run([*inside, "tc", "qdisc", "add", "dev", devices[h], "root", *link.qdisc()])
    return TwoHostNetwork(ns, devices, addresses, link)


@contextmanager
def two_host_network(link: LinkConfig | None = None) -> Iterator[TwoHostNetwork]:
    """Two namespaces joined by a shaped veth pair, removed again on any exit.

    SIGTERM and SIGHUP (SIGINT already raises) become ``SystemExit(128 + signal)``
    here, so the ``finally`` runs and the namespaces go; the previous handlers
    come back afterwards.
    """
    link = link or LinkConfig()
    check_netns_tools()
    remove_stale_namespaces()
    pid = os.getpid()
    names = (f"{NETNS_PREFIX}{pid}-h0", f"{NETNS_PREFIX}{pid}-h1")
    existing = set(list_namespaces())
    if existing & set(names):  # this very process already holds a network
        raise ValueError(f"namespaces {names} already exist; one two-host network per process")

    def interrupt(signum, frame):
        raise SystemExit(128 + signum)

    previous = {}
    handled = (signal.SIGTERM, signal.SIGHUP)
    for sig in handled:
        with suppress(ValueError):  # not the main thread: rely on try/finally alone
            previous[sig] = signal.signal(sig, interrupt)
    try:
        yield _build(link, pid)
    finally:
        _delete(names)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
