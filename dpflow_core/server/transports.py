"""Transports: the three primitives (run a shell script, open a file, close) over SSH or locally.

SSH goes through Fabric (Paramiko underneath) with host keys checked against a known_hosts file;
the local machine through Invoke. Gives byte-range reads as :class:`FileChunk`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import shlex
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping

from dpflow_core.errors import RemoteError
from dpflow_core.server.config import ServerConfig


LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileChunk:
    """Bytes read by :meth:`GpuServer.read_from`.

    Attributes:
        data: the bytes read.
        offset: where they start in the file.
        next_offset: where the next incremental read should start.
        size: the file's size when read.
        restarted: the file was shorter than the requested offset (replaced or
            truncated), so reading restarted at 0.
    """

    data: bytes
    offset: int
    next_offset: int
    size: int
    restarted: bool = False


# --------------------------------------------------------------------- transports


class LocalTransport:
    """Runs on this machine through Invoke.

    Both transports offer the same methods, on absolute POSIX paths: ``run(script, timeout_s, env)``
    (a shell script; gives exit status, stdout, stderr, timed out), ``open``, ``stat_size`` (bytes, None when absent), ``put``/``get``
    (copy to/from the server), ``rename``, ``exists``, ``makedirs``, ``chmod``, ``remove``, ``home`` and
    ``close``. :class:`~dpflow_core.server.GpuServer` picks one by ``config.host`` and is their only user.
    """

    kind = "local"

    def __init__(self, config: ServerConfig):
        import invoke

        self._context = invoke.Context()

    def run(self, script: str, timeout_s: float | None, env: Mapping[str, str] | None):
        import invoke

        try:
            result = self._context.run(
                script, hide=True, warn=True, in_stream=False, pty=False,
                env=dict(env or {}), timeout=timeout_s,
            )
            return result.exited, result.stdout, result.stderr, False
        except invoke.CommandTimedOut as exc:
            return 124, exc.result.stdout, exc.result.stderr, True

    def open(self, path: str, mode: str) -> IO[bytes]:
        return open(path, mode)

    def stat_size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None

    def put(self, local: str, remote: str) -> None:
        shutil.copyfile(local, remote)

    def get(self, remote: str, local: str) -> None:
        shutil.copyfile(remote, local)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def makedirs(self, path: str, mode: int) -> None:
        os.makedirs(path, mode=mode, exist_ok=True)

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(path, mode)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def home(self) -> str:
        return os.path.expanduser("~")

    def close(self) -> None:
        pass


class _TrustOnFirstUse:
    """Paramiko missing-host-key policy: accept once, append the key to known_hosts."""

    def __init__(self, known_hosts: str):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        client.get_host_keys().add(hostname, key.get_name(), key)
        Path(self.known_hosts).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.known_hosts, "a") as fh:
            fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        LOG.warning("trusting new %s host key of %s (recorded in %s)", key.get_name(), hostname, self.known_hosts)


class SshTransport:
    """Runs on ``config.host`` through a Fabric connection (and its SFTP session)."""

    kind = "ssh"

    def __init__(self, config: ServerConfig):
        import fabric
        import paramiko

        self.config = config
        connect_kwargs: dict = {"banner_timeout": config.connect_timeout_s, "auth_timeout": config.connect_timeout_s}
        if config.key_filename:
            connect_kwargs.update(key_filename=os.path.expanduser(config.key_filename), look_for_keys=False, allow_agent=False)
        if config.key_passphrase:
            connect_kwargs["passphrase"] = config.key_passphrase
        # An explicit empty SSHConfig: no ~/.ssh/config or /etc/ssh/ssh_config rewrites host, port or keys.
        fabric_config = fabric.Config(ssh_config=paramiko.SSHConfig())
        self.connection = fabric.Connection(
            config.host, user=config.user, port=int(config.port), config=fabric_config,
            connect_timeout=max(1, int(config.connect_timeout_s)), connect_kwargs=connect_kwargs,
        )
        client = self.connection.client
        known_hosts = config.known_hosts_path
        if os.path.exists(known_hosts):
            client.load_host_keys(known_hosts)
        # Fabric's default is AutoAddPolicy (trust anything); replace it.
        client.set_missing_host_key_policy(
            _TrustOnFirstUse(known_hosts) if config.trust_on_first_use else paramiko.RejectPolicy()
        )
        self._sftp = None
        self._home: str | None = None

    def _open_connection(self) -> None:
        import paramiko

        if self.connection.is_connected:
            return
        where = self.config.describe()
        try:
            self.connection.open()
        except paramiko.BadHostKeyException as exc:
            raise RemoteError(
                f"host key of {where} does not match {self.config.known_hosts_path}: refusing to connect "
                "(a changed key can mean an impostor; remove the old line only when you know why it changed)",
                code="host_key_mismatch",
            ) from exc
        except paramiko.AuthenticationException as exc:
            raise RemoteError(f"authentication to {where} failed: {exc}", code="auth_failed") from exc
        except paramiko.SSHException as exc:
            if "known_hosts" in str(exc):
                raise RemoteError(
                    f"host key of {where} is not in {self.config.known_hosts_path}: refusing to connect "
                    "(add it with ssh-keyscan after checking its fingerprint, or opt in to trust on first use)",
                    code="unknown_host_key",
                ) from exc
            raise RemoteError(f"SSH to {where} failed: {exc}", code="ssh_failed") from exc
        except (OSError, socket.timeout) as exc:
            raise RemoteError(f"cannot reach {where}: {exc}", code="unreachable") from exc

    def run(self, script: str, timeout_s: float | None, env: Mapping[str, str] | None):
        import invoke

        self._open_connection()
        if env:
            # Inline, as Fabric does: sshd's AcceptEnv usually drops environment requests.
            exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
            script = f"sh -c {shlex.quote(exports + 'exec ' + script)}"
        try:
            result = self.connection.run(
                script, hide=True, warn=True, in_stream=False, pty=False, timeout=timeout_s
            )
            return result.exited, result.stdout, result.stderr, False
        except invoke.CommandTimedOut as exc:
            return 124, exc.result.stdout, exc.result.stderr, True

    @property
    def sftp(self):
        if self._sftp is None:
            self._open_connection()
            self._sftp = self.connection.sftp()
        return self._sftp

    def open(self, path: str, mode: str) -> IO[bytes]:
        fh = self.sftp.open(path, mode.replace("b", ""))
        if "w" in mode or "a" in mode:
            fh.set_pipelined(True)
        return fh

    def stat_size(self, path: str) -> int | None:
        try:
            return self.sftp.stat(path).st_size
        except FileNotFoundError:
            return None

    def put(self, local: str, remote: str) -> None:
        self.sftp.put(local, remote)

    def get(self, remote: str, local: str) -> None:
        self.sftp.get(remote, local)

    def rename(self, src: str, dst: str) -> None:
        self.sftp.posix_rename(src, dst)

    def exists(self, path: str) -> bool:
        try:
            self.sftp.lstat(path)
            return True
        except FileNotFoundError:
            return False

    def makedirs(self, path: str, mode: int) -> None:
        missing = []
        while path not in ("/", "") and not self.exists(path):
            missing.append(path)
            path = posixpath.dirname(path)
        for folder in reversed(missing):
            try:
                self.sftp.mkdir(folder, mode)
            except OSError:
                if not self.exists(folder):  # not a concurrent creation: a real error
                    raise

    def chmod(self, path: str, mode: int) -> None:
        self.sftp.chmod(path, mode)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.sftp.remove(path)

    def home(self) -> str:
        if self._home is None:
            self._home = self.sftp.normalize(".")
        return self._home

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        self.connection.close()
