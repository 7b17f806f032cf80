"""A real OpenSSH server on 127.0.0.1 for tests (fixture ``sshd_server``).

Usage in a test module (``tests/`` is on ``sys.path`` under pytest's default
``prepend`` import mode, since it has no ``__init__.py``)::

    from sshd import sshd_server  # noqa: F401  (the fixture)

    def test_something(sshd_server):
        cfg = sshd_server.server_config(data_root=...)

pytest registers an imported fixture once per importing module, so each test
module that imports it gets its own server (starting one takes well under a
second), shared by all its tests.

The server is Debian's ``/usr/sbin/sshd`` started in the foreground (``-D``)
with its own host key, an authorized user key generated with ``ssh-keygen``
in a temporary folder, ``ListenAddress 127.0.0.1`` and a free port; it is
stopped by its PID when the session ends. ``known_hosts`` holds its host key
in the ``[127.0.0.1]:PORT`` form that OpenSSH and Paramiko look up. Tests
that need sshd skip only when the binary is absent, and fail then when ``CI`` is set
(:func:`conftest.require_service`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import TEST_THREAD_ENV, missing_executable, require_service

#: The sshd binary: ``$DPFLOW_TEST_SSHD``, else ``sshd`` on ``PATH`` (Debian: /usr/sbin), else ``None``.
SSHD = os.environ.get("DPFLOW_TEST_SSHD") or shutil.which("sshd")


@dataclass(frozen=True)
class SshdServer:
    """A running test sshd and the files to reach it."""

    host: str
    port: int
    user: str
    key_path: Path
    known_hosts: Path
    host_public_key: str
    pid: int
    log_path: Path
    root: Path

    def known_hosts_line(self) -> str:
        """The known_hosts entry of this server's host key."""
        return f"[{self.host}]:{self.port} {self.host_public_key}\n"

    def server_config(self, **overrides):
        """A :class:`dpflow_core.server.ServerConfig` for this server (known_hosts checked)."""
        from dpflow_core.server import ServerConfig

        values = dict(
            host=self.host, port=self.port, user=self.user, key_filename=str(self.key_path),
            known_hosts=str(self.known_hosts), connect_timeout_s=10,
        )
        values.update(overrides)
        return ServerConfig(**values)

    def cli_args(self) -> list[str]:
        """The ``dpflow`` connection flags for this server."""
        return [
            "--host", self.host, "--port", str(self.port), "--user", self.user,
            "--key", str(self.key_path), "--known-hosts", str(self.known_hosts),
        ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_banner(port: int, proc: subprocess.Popen, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                if sock.recv(64).startswith(b"SSH-"):
                    return True
        except OSError:
            time.sleep(0.05)
    return False


def _wait_for_log(log: Path, proc: subprocess.Popen, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if log.exists() and "Server listening on" in log.read_text():
            return True
        time.sleep(0.05)
    return False


def start_sshd(
    root: Path, address: str = "127.0.0.1", port: int | None = None, prefix: tuple[str, ...] = (),
) -> tuple[SshdServer, subprocess.Popen]:
    """Generate keys and a config under ``root`` and start sshd; return it and its process.

    ``address`` and ``port`` are where it listens (default: 127.0.0.1 and a free port); ``prefix``
    runs it through another command (``ip netns exec NS`` for a host in a network namespace, whose
    readiness is then read from sshd's log instead of a connection from here).
    """
    for name in ("host_ed25519", "id_ed25519"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"dpflow-test-{name}", "-f", str(root / name)],
            check=True,
        )
    (root / "authorized_keys").write_text((root / "id_ed25519.pub").read_text())
    os.chmod(root / "authorized_keys", 0o600)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege-separation folder
    user = pwd.getpwuid(os.getuid()).pw_name  # not $USER: CI may not set it
    sftp_server = next(
        (p for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server") if os.path.exists(p)),
        "internal-sftp",
    )
    port = port or _free_port()
    config = root / "sshd_config"
    config.write_text(
        "\n".join([
            f"ListenAddress {address}",
            f"Port {port}",
            f"HostKey {root / 'host_ed25519'}",
            f"PidFile {root / 'sshd.pid'}",
            f"AuthorizedKeysFile {root / 'authorized_keys'}",
            "StrictModes no",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            f"AllowUsers {user}",
            "MaxSessions 50",
            "MaxStartups 50:30:100",
            "LogLevel VERBOSE",
            # one torch/OpenMP thread per trainer the tests start over SSH, as tests/conftest.py sets locally
            f"SetEnv {' '.join(f'{k}={v}' for k, v in TEST_THREAD_ENV.items())}",
            f"Subsystem sftp {sftp_server}",
            "",
        ])
    )
    log = root / "sshd.log"
    proc = subprocess.Popen([*prefix, SSHD, "-D", "-f", str(config), "-E", str(log)], stdin=subprocess.DEVNULL)
    if not (_wait_for_log(log, proc) if prefix else _wait_for_banner(port, proc)):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
        raise RuntimeError(f"sshd did not start: {log.read_text() if log.exists() else ''}")
    host_pub = " ".join((root / "host_ed25519.pub").read_text().split()[:2])
    server = SshdServer(
        host=address, port=port, user=user, key_path=root / "id_ed25519",
        known_hosts=root / "known_hosts", host_public_key=host_pub, pid=proc.pid, log_path=log, root=root,
    )
    server.known_hosts.write_text(server.known_hosts_line())
    return server, proc


@pytest.fixture(scope="session")
def sshd_server():
    """A real sshd on 127.0.0.1 for the whole session (skipped, or failed under CI, when sshd is not installed)."""
    if not SSHD or not os.path.exists(SSHD):
        require_service("sshd", f"no sshd binary ({SSHD or 'not on PATH'}; DPFLOW_TEST_SSHD overrides)")
    require_service("sshd", missing_executable("ssh-keygen"))
    root = Path(tempfile.mkdtemp(prefix="dpflow-sshd-"))
    server, proc = start_sshd(root)
    try:
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)  # stop by its own PID
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)
