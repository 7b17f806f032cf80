"""Two test machines in network namespaces (fixture ``two_hosts``), each with its own sshd.

``ip netns add`` twice, a veth pair between them (both ends renamed ``dpf0`` inside their
namespaces, so one ``GLOO_SOCKET_IFNAME`` fits both), private addresses that exist inside the
namespaces only (10.231.N.1 and .2/24), loopback up. In each namespace a real OpenSSH server
(:func:`sshd.start_sshd`) with its own host key and user key listens on the namespace's address,
port 2222. ``known_hosts`` holds both host keys. The root namespace has no route to them: dpflow
is run inside the first namespace (``ip netns exec``), as on a lab machine that is one of the two
servers. sshd is stopped by its PID and both namespaces are deleted after the module.

Needs root and ``ip`` (iproute2); skipped without, failed when ``CI`` is set.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require_service
from sshd import SSHD, SshdServer, start_sshd

IFNAME = "dpf0"
PORT = 2222


@dataclass(frozen=True)
class NetnsHost:
    """One test machine: its namespace, address and sshd."""

    netns: str
    address: str
    sshd: SshdServer

    def exec_prefix(self) -> list[str]:
        """Run a command inside this machine's namespace."""
        return ["ip", "netns", "exec", self.netns]


@dataclass(frozen=True)
class TwoHosts:
    hosts: tuple[NetnsHost, NetnsHost]
    known_hosts: Path
    root: Path


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def two_hosts():
    """Two namespaced machines with sshd, linked by a veth pair; deleted afterwards."""
    if os.geteuid() != 0:
        require_service("netns", "network namespaces need root")
    if shutil.which("ip") is None:
        require_service("netns", "`ip` (iproute2) is not on PATH")
    if not SSHD or not os.path.exists(SSHD):
        require_service("sshd", f"no sshd binary ({SSHD or 'not on PATH'})")
    tag = f"dpf{os.getpid() % 100000}"
    names = (f"{tag}a", f"{tag}b")
    subnet = f"10.231.{os.getpid() % 250}"
    root = Path(tempfile.mkdtemp(prefix="dpflow-netns-"))
    procs: list[subprocess.Popen] = []
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")
        hosts = []
        for i, (name, end) in enumerate(zip(names, (f"{tag}x", f"{tag}y")), start=1):
            address = f"{subnet}.{i}"
            _ip("link", "set", end, "netns", name)
            _ip("-n", name, "link", "set", end, "name", IFNAME)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", IFNAME)
            _ip("-n", name, "link", "set", IFNAME, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            folder = root / name
            folder.mkdir()
            server, proc = start_sshd(folder, address=address, port=PORT, prefix=("ip", "netns", "exec", name))
            procs.append(proc)
            hosts.append(NetnsHost(netns=name, address=address, sshd=server))
        known = root / "known_hosts"
        known.write_text("".join(h.sshd.known_hosts_line() for h in hosts))
        yield TwoHosts(hosts=tuple(hosts), known_hosts=known, root=root)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)  # by its own PID
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for name in made:
            subprocess.run(["ip", "netns", "del", name], check=False)
        shutil.rmtree(root, ignore_errors=True)
