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


_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:=+-]{1,128}$")
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


@dataclass(frozen=True)
class SlurmSettings:
    """Where and how a Slurm cluster runs dpflow's jobs (``server.slurm`` of a lab.yaml).

    Attributes:
        partition: ``--partition`` (None: the cluster's default partition).
        account: ``--account`` (None: the user's default).
        nodes: ``--nodes`` of a training job; each node runs one ``accelerate launch`` through ``srun``.
            A smoke run always uses one node.
        gpus_per_node: ``--gpus-per-node`` and the processes per node; 0 runs one CPU process per node (gloo).
        cpus_per_task: ``--cpus-per-task`` (None: the cluster's default).
        time_limit: ``--time`` in Slurm's format (``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``; None: the partition's).
        extra_sbatch: further ``#SBATCH`` lines, each an option such as ``--qos=high`` or ``--mem=64G``.
        main_process_port: the rendezvous port on the first node (None: derived from the run name).

    Raises:
        RemoteError: ``bad_config`` for a value that is not a plain Slurm word, a bad time limit, nodes < 1,
            GPUs < 0, or an extra line that is not a single ``--option``.
    """

    partition: str | None = None
    account: str | None = None
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    time_limit: str | None = None
    extra_sbatch: tuple[str, ...] = ()
    main_process_port: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_sbatch", tuple(self.extra_sbatch))
        for key in ("nodes", "gpus_per_node", "cpus_per_task", "main_process_port"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                if not (isinstance(value, str) and value.strip().isdigit()):
                    raise RemoteError(f"slurm.{key} must be a whole number, got {value!r}", code="bad_config")
                object.__setattr__(self, key, int(value))
        for key in ("partition", "account"):
            value = getattr(self, key)
            if value is not None and not _SLURM_WORD.match(str(value)):
                raise RemoteError(f"slurm.{key} {value!r} is not a Slurm name", code="bad_config")
        if int(self.nodes) < 1:
            raise RemoteError(f"slurm.nodes must be >= 1, got {self.nodes!r}", code="bad_config")
        if int(self.gpus_per_node) < 0:
            raise RemoteError(f"slurm.gpus_per_node must be >= 0, got {self.gpus_per_node!r}", code="bad_config")
        if self.cpus_per_task is not None and int(self.cpus_per_task) < 1:
            raise RemoteError(f"slurm.cpus_per_task must be >= 1, got {self.cpus_per_task!r}", code="bad_config")
        if self.time_limit is not None and not _SLURM_TIME.match(str(self.time_limit)):
            raise RemoteError(
                f"slurm.time_limit {self.time_limit!r} is not a Slurm time (MM, HH:MM:SS or D-HH:MM:SS)", code="bad_config"
            )
        if self.main_process_port is not None and not 1024 <= int(self.main_process_port) <= 65535:
            raise RemoteError(f"slurm.main_process_port must be 1024..65535, got {self.main_process_port!r}", code="bad_config")
        for line in self.extra_sbatch:
            if not re.match(r"^--[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:=@%/+-]+)?$", str(line)):
                raise RemoteError(
                    f"slurm.extra_sbatch line {line!r} must be one option like --qos=high (no spaces or shell syntax)",
                    code="bad_config",
                )


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
        scheduler: ``none`` (start runs in tmux on this server) or ``slurm`` (this server is a login
            node, or the local machine, where ``sbatch`` submits runs to the cluster in :attr:`slurm`).
        slurm: the Slurm settings (defaults when ``scheduler`` is ``slurm`` and none are given).

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
    scheduler: Literal["none", "slurm"] = "none"
    slurm: SlurmSettings | None = None

    def __post_init__(self) -> None:
        if self.scheduler not in ("none", "slurm"):
            raise RemoteError(f"scheduler must be 'none' or 'slurm', got {self.scheduler!r}", code="bad_config")
        if self.scheduler == "slurm" and self.slurm is None:
            object.__setattr__(self, "slurm", SlurmSettings())
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
