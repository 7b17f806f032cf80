"""Server configuration: how to reach the GPU server and what a command run there returned.

Takes host, user, port, key and paths (from the CLI, Dagster resources or defaults); gives a validated
:class:`ServerConfig` and the :class:`CommandResult` (exit code, stdout, stderr, seconds) of a command.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dpflow_core.errors import RemoteError
from dpflow_core.names import validate_name


#: The project checkout this package runs from (used for the local defaults).
PROJECT_ROOT = Path(__file__).resolve().parents[2]
_HOST_PATTERN = re.compile(r"^[A-Za-z0-9_.:\[\]%-]{1,253}$")
_USER_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]{0,63}$")
_SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")


def default_local_data_root() -> str:
    """Data root of the local transport: ``$DPFLOW_SERVER_ROOT``, else ``<work folder>/server`` (the work
    folder of :func:`dpflow_core.files.default_workdir`, where the CLI and the demo write everything else)."""
    from dpflow_core.files import default_workdir

    return os.environ.get("DPFLOW_SERVER_ROOT") or str(default_workdir() / "server")


def default_local_repo() -> str | None:
    """The dpflow checkout itself when it is a git work tree (the local server's repository)."""
    return str(PROJECT_ROOT) if (PROJECT_ROOT / ".git").exists() else None


@dataclass(frozen=True)
class ServerConfig:
    """How to reach the GPU server and where things live on it.

    Attributes:
        host: SSH host name or address; ``None`` selects the local transport.
        port: SSH port.
        user: SSH user; ``None`` means the local user name.
        key_filename: private key file; with it, no agent and no other key is tried.
        key_passphrase: passphrase of ``key_filename`` (never printed; rsync is then
            not used since it cannot ask for it).
        known_hosts: known_hosts file checked for the host key (default ``~/.ssh/known_hosts``).
        trust_on_first_use: accept an unknown host key once and append it to ``known_hosts``.
            A key that differs from a recorded one is refused regardless.
        repo_path: the training repository on the server (preflight reports its git state).
        python: the interpreter command on the server, split like a shell would
            (``python3``, ``/opt/conda/envs/dp/bin/python``, ``conda run -n dp python``);
            each word is quoted again, so it cannot smuggle shell syntax.
        activate: an optional shell line run before Python commands (for example
            ``. /opt/conda/etc/profile.d/conda.sh && conda activate dp``). It is trusted
            configuration like a command in a Makefile, never built from names.
        data_root: where datasets and runs go on the server (``~`` = remote home).
        nvidia_smi: the ``nvidia-smi`` command (a path when it is not on ``PATH``).
        expect_gpu: whether the server must have a working GPU: then a missing or failing
            ``nvidia-smi``, or one listing no GPU, fails preflight and refuses every launch.
            ``None`` (the default) means True over SSH and False locally; see :attr:`gpu_expected`.
        tmux_socket: tmux socket name (``tmux -L``); ``None`` uses the default server.
        connect_timeout_s: TCP/SSH connect timeout, seconds.

    Raises:
        RemoteError: for a port outside 1..65535, or a host or user containing
            characters that could be read as options or shell syntax.
    """

    host: str | None = None
    port: int = 22
    user: str | None = None
    key_filename: str | None = None
    key_passphrase: str | None = field(default=None, repr=False)
    known_hosts: str | None = None
    trust_on_first_use: bool = False
    repo_path: str | None = None
    python: str = "python3"
    activate: str | None = None
    data_root: str = "~/dpflow-data"
    nvidia_smi: str = "nvidia-smi"
    expect_gpu: bool | None = None
    tmux_socket: str | None = None
    connect_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if not 1 <= int(self.port) <= 65535:
            raise RemoteError(f"invalid SSH port {self.port!r}: must be 1..65535", code="bad_config")
        if self.host is not None and (not _HOST_PATTERN.match(self.host) or self.host.startswith("-")):
            raise RemoteError(f"invalid host {self.host!r}", code="bad_config")
        if self.user is not None and not _USER_PATTERN.match(self.user):
            raise RemoteError(f"invalid SSH user {self.user!r}", code="bad_config")
        if self.tmux_socket is not None:
            validate_name(self.tmux_socket, "tmux socket")
        if not shlex.split(self.python):
            raise RemoteError("python command is empty", code="bad_config")

    @classmethod
    def local(cls, **overrides) -> "ServerConfig":
        """The embedded default: this machine, this interpreter, this checkout, ``outputs/server``."""
        values = {
            "host": None,
            "python": sys.executable,
            "repo_path": default_local_repo(),
            "data_root": default_local_data_root(),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def transport(self) -> Literal["ssh", "local"]:
        """``"ssh"`` when a host is configured, else ``"local"``."""
        return "local" if self.host is None else "ssh"

    @property
    def gpu_expected(self) -> bool:
        """:attr:`expect_gpu` when set, else True for the SSH transport and False for the local one."""
        return self.transport == "ssh" if self.expect_gpu is None else bool(self.expect_gpu)

    @property
    def known_hosts_path(self) -> str:
        """The known_hosts file actually used."""
        return os.path.expanduser(self.known_hosts or "~/.ssh/known_hosts")

    def describe(self) -> str:
        """``user@host:port`` or ``local`` (never a key path or passphrase)."""
        if self.host is None:
            return "local"
        user = f"{self.user}@" if self.user else ""
        return f"{user}{self.host}:{self.port}"


@dataclass(frozen=True)
class CommandResult:
    """Outcome of :meth:`GpuServer.run`.

    Attributes:
        command: the command as given (without environment values).
        exit_code: exit status; 124 when the timeout stopped it (coreutils ``timeout``).
        stdout, stderr: captured output, decoded as UTF-8 (invalid bytes replaced).
        duration_s: wall-clock seconds.
        timed_out: True when ``timeout_s`` elapsed before the command ended.
    """

    command: str
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """True for exit status 0."""
        return self.exit_code == 0

    def check(self) -> "CommandResult":
        """Return self when the command succeeded, else raise :class:`RemoteError`."""
        if not self.ok:
            what = "timed out" if self.timed_out else f"exited with status {self.exit_code}"
            tail = (self.stderr or self.stdout).strip()[-600:]
            raise RemoteError(f"command {self.command!r} {what}: {tail}", code="command_failed")
        return self


def is_sha256(value: str) -> bool:
    """True for 64 lowercase hex digits."""
    return bool(_SHA256_PATTERN.match(value or ""))
