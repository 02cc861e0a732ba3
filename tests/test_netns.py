"""The two-host network harness: namespaces, shaped veth, cleanup on every exit."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

from towerrec.bench import netns
from towerrec.bench.netns import (
    LinkConfig,
    check_netns_tools,
    list_namespaces,
    remove_stale_namespaces,
    two_host_network,
)

CAN_NETNS = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
needs_root = pytest.mark.skipif(not CAN_NETNS, reason="needs root with ip and tc (iproute2)")


def test_link_config_shapes_with_tbf_or_netem():
    tbf = LinkConfig(gbit=1.0).qdisc()
    assert tbf[:3] == ["tbf", "rate", "1000mbit"]
    netem = LinkConfig(gbit=0.5, delay_ms=2.0).qdisc()
    assert netem[:5] == ["netem", "rate", "500mbit", "delay", "2ms"]
    with pytest.raises(ValueError, match="--link-gbit must be > 0"):
        LinkConfig(gbit=-1.0)
    with pytest.raises(ValueError, match="--link-delay-ms must be >= 0"):
        LinkConfig(delay_ms=-1.0)


def test_missing_tools_or_root_name_the_fix(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/bin/ip")
    with pytest.raises(ValueError, match=r"needs tc \(iproute2\): install it .*--network local"):
        check_netns_tools()
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match=r"needs root: run it as root.*--network local"):
        check_netns_tools()
    with pytest.raises(ValueError, match="needs root"), two_host_network():
        pass


def _inside(net, host, *cmd):
    return subprocess.run(
        [*net.exec_prefix(host), *cmd], capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.slow
@needs_root
def test_network_is_built_shaped_and_removed():
    with two_host_network(LinkConfig(gbit=0.5)) as net:
        assert set(net.namespaces) <= set(list_namespaces())
        for host in (0, 1):
            addr = _inside(net, host, "ip", "-o", "-4", "addr", "show", "dev", net.devices[host])
            assert f"{net.addresses[host]}/24" in addr
            assert ",UP" in _inside(net, host, "ip", "link", "show", "lo")
            qdisc = _inside(net, host, "tc", "qdisc", "show", "dev", net.devices[host])
            assert "tbf" in qdisc and "500Mbit" in qdisc
        # re-shaped in place (bench dmt's rates, one network): another rate, then none
        net = net.reshape(LinkConfig(gbit=0.2))
        for host in (0, 1):
            qdisc = _inside(net, host, "tc", "qdisc", "show", "dev", net.devices[host])
            assert "tbf" in qdisc and "200Mbit" in qdisc
        net = net.reshape(None)
        assert net.link is None
        for host in (0, 1):
            assert "tbf" not in _inside(net, host, "tc", "qdisc", "show", "dev", net.devices[host])
        # the two hosts reach each other over the veth: a TCP connection from host 1 to 0
        server = subprocess.Popen(
            [*net.exec_prefix(0), sys.executable, "-c", _ECHO_SERVER, net.addresses[0]],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline().strip() == "listening"
            reply = _inside(net, 1, sys.executable, "-c", _ECHO_CLIENT, net.addresses[0])
            assert reply.strip() == "pong"
        finally:
            server.kill()
            server.wait()
    assert not set(net.namespaces) & set(list_namespaces())
    assert (
        net.devices[0] not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    )


_ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_server((sys.argv[1], 29399))
    print("listening", flush=True)
    conn, _ = s.accept()
    conn.sendall(b"pong" if conn.recv(4) == b"ping" else b"????")
    """
)
_ECHO_CLIENT = textwrap.dedent(
    """
    import socket, sys
    c = socket.create_connection((sys.argv[1], 29399), timeout=10)
    c.sendall(b"ping")
    print(c.recv(4).decode())
    """
)


@pytest.mark.slow
@needs_root
def test_network_is_removed_when_the_body_raises():
    with pytest.raises(RuntimeError, match="benchmark failed"), two_host_network() as net:
        names = net.namespaces
        assert set(names) <= set(list_namespaces())
        raise RuntimeError("benchmark failed")
    assert not set(names) & set(list_namespaces())


@pytest.mark.slow
@needs_root
def test_network_is_removed_on_sigterm_and_stale_ones_on_the_next_start():
    script = textwrap.dedent(
        """
        import time
        from towerrec.bench.netns import two_host_network
        with two_host_network() as net:
            print(" ".join(net.namespaces), flush=True)
            time.sleep(60)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    names = proc.stdout.readline().split()
    assert len(names) == 2 and set(names) <= set(list_namespaces())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not set(names) & set(list_namespaces())

    # a crashed run's namespace (its pid is gone) is removed by the next start
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{netns.NETNS_PREFIX}{dead.pid}-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        mine = f"{netns.NETNS_PREFIX}{os.getpid()}-h9"  # a live pid: left alone
        subprocess.run(["ip", "netns", "add", mine], check=True)
        try:
            assert stale in remove_stale_namespaces()
            assert stale not in list_namespaces() and mine in list_namespaces()
        finally:
            subprocess.run(["ip", "netns", "delete", mine])
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)
