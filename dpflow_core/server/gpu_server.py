""":class:`GpuServer`, the one interface to the training machine over either transport
(how the transports, quoting, process identity and GPU inventory work: :mod:`dpflow_core.server`).

This module is over 500 lines on purpose: :class:`GpuServer` is the
one facade every stage uses (paths, commands, files, hashes, processes, detached processes, GPUs),
each method a few lines over the transport; splitting the class would scatter one API over mixins.
Its parts live beside it: :mod:`~dpflow_core.server.transports`, :mod:`~dpflow_core.server.procfs`,
:mod:`~dpflow_core.server.tmux`, :mod:`~dpflow_core.server.nvidia_smi`, :mod:`~dpflow_core.server.config`.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import shlex
import time
import uuid
from pathlib import Path
from typing import IO, Iterator, Literal, Mapping, Sequence

from dpflow_core.errors import RemoteError
from dpflow_core.files import atomic_path
from dpflow_core.names import validate_name
from dpflow_core.server.config import CommandResult, ServerConfig, is_sha256
from dpflow_core.server.nvidia_smi import (
    GPU_APPS_QUERY_ARGS, GPU_QUERY_ARGS, GpuInventory, parse_compute_apps, parse_gpu_query,
)
from dpflow_core.server.procfs import ProcessInfo, parse_stat_line, validate_signal
from dpflow_core.server.tmux import DetachedProcess, DetachedStatus
from dpflow_core.server.transports import FileChunk, LocalTransport, SshTransport


_ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ----------------------------------------------------------------------- server


class GpuServer:
    """The machine that trains. Use as a context manager (closes the SSH connection).

    Connection happens lazily on the first operation. Paths may start with ``~``
    (the server's home); relative paths are taken from the home directory over
    SSH and from the current directory locally.

    Raises (from every method):
        RemoteError: ``code`` tells why: ``unknown_host_key``, ``host_key_mismatch``,
            ``auth_failed``, ``unreachable``, ``command_failed``, ``not_found``, ...
        InvalidNameError: for a run name that is not a safe name.
    """

    def __init__(self, config: ServerConfig):
        self.config = config
        self._transport = LocalTransport(config) if config.host is None else SshTransport(config)
        self._commands: dict[str, bool] = {}

    # -- lifecycle
    def __enter__(self) -> "GpuServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (a later call reconnects)."""
        self._transport.close()

    @property
    def transport(self) -> str:
        """``"ssh"`` or ``"local"``."""
        return self._transport.kind

    @property
    def host(self) -> str | None:
        """The configured host (None for the local transport)."""
        return self.config.host

    # -- paths
    def abspath(self, path: str) -> str:
        """Absolute, normalised server path (``~`` and relative paths resolved)."""
        if path == "~" or path.startswith("~/"):
            path = self._transport.home() + path[1:]
        elif not path.startswith("/"):
            base = self._transport.home() if self.transport == "ssh" else os.getcwd()
            path = posixpath.join(base, path)
        return posixpath.normpath(path)

    @property
    def data_root(self) -> str:
        """Absolute data root on the server."""
        return self.abspath(self.config.data_root)

    # -- commands
    def run(
        self,
        cmd: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        check: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> CommandResult:
        """Run a command on the server and capture its output.

        Args:
            cmd: an argument list (each item quoted here) or a shell command string
                (POSIX ``sh``; the caller quotes what it interpolates).
            timeout_s: stop the command (TERM, then KILL 5 s later, whole process group)
                after this many seconds; the result then has exit code 124.
            check: raise :class:`RemoteError` unless the exit status is 0.
            env: extra environment variables (names must be identifiers).
            cwd: working directory on the server.

        Returns:
            CommandResult with exit code, stdout, stderr and duration.
        """
        command = cmd if isinstance(cmd, str) else shlex.join(str(c) for c in cmd)
        for name in env or {}:
            if not _ENV_NAME_PATTERN.match(name):
                raise RemoteError(f"invalid environment variable name {name!r}", code="bad_env")
        script = command if cwd is None else f"cd -- {shlex.quote(self.abspath(cwd))} && {command}"
        script = f"sh -c {shlex.quote(script)}"
        if timeout_s is not None:
            script = f"timeout -k 5 {float(timeout_s):.3f} {script}"
        start = time.monotonic()
        exit_code, stdout, stderr, killed = self._transport.run(
            script, None if timeout_s is None else timeout_s + 15, env
        )
        result = CommandResult(
            command=command, exit_code=exit_code, stdout=stdout, stderr=stderr,
            duration_s=time.monotonic() - start,
            timed_out=killed or (timeout_s is not None and exit_code in (124, 137)),
        )
        return result.check() if check else result

    def python_command(self, args: Sequence[str]) -> str:
        """Shell string running the configured Python (after ``activate``) with quoted ``args``."""
        words = [shlex.quote(w) for w in shlex.split(self.config.python)] + [shlex.quote(a) for a in args]
        line = " ".join(words)
        return f"{self.config.activate} && {line}" if self.config.activate else line

    def has_command(self, name: str) -> bool:
        """True when ``name`` resolves on the server (``command -v``; remembered per connection)."""
        if name not in self._commands:
            self._commands[name] = self.run(f"command -v {shlex.quote(name)} >/dev/null 2>&1").ok
        return self._commands[name]

    # -- files
    @contextlib.contextmanager
    def open(self, path: str, mode: str = "rb") -> Iterator[IO[bytes]]:
        """Open a server file (binary modes: ``rb``, ``wb``, ``ab``, ``r+b``)."""
        full = self.abspath(path)
        try:
            fh = self._transport.open(full, mode)
        except FileNotFoundError as exc:
            raise RemoteError("no such file on the server", path=full, code="not_found") from exc
        except PermissionError as exc:
            raise RemoteError("permission denied on the server", path=full, code="permission_denied") from exc
        with fh:
            yield fh

    def size(self, path: str) -> int | None:
        """Size in bytes, or None when the file does not exist."""
        return self._transport.stat_size(self.abspath(path))

    def exists(self, path: str) -> bool:
        """True when ``path`` exists on the server (file, folder, link or other)."""
        return self._transport.exists(self.abspath(path))

    def mkdir(self, path: str, mode: int = 0o755) -> str:
        """Create a folder and its parents (no error when it exists); return its absolute path.

        Raises:
            RemoteError: ``mkdir_failed`` when it cannot be created (permissions, a file in the way).
        """
        full = self.abspath(path)
        try:
            self._transport.makedirs(full, mode)
        except OSError as exc:
            raise RemoteError(f"cannot create folder: {exc}", path=full, code="mkdir_failed") from exc
        return full

    def rename(self, src: str, dst: str) -> None:
        """Atomically rename within one file system (replaces ``dst``)."""
        self._transport.rename(self.abspath(src), self.abspath(dst))

    def remove(self, path: str) -> None:
        """Delete one file (not a folder); no error when it is already gone."""
        self._transport.remove(self.abspath(path))

    def listdir(self, path: str) -> list[str]:
        """Names in a server folder, sorted (empty when the folder does not exist)."""
        result = self.run(f"ls -1A -- {shlex.quote(self.abspath(path))} 2>/dev/null")
        return sorted(line for line in result.stdout.splitlines() if line) if result.ok else []

    def _temp_name(self, path: str) -> str:
        return f"{path}.tmp-{uuid.uuid4().hex[:12]}"

    def put(self, local: str | Path, remote: str, *, overwrite: bool = False) -> str:
        """Copy a local file to the server (temp name in the same folder, then rename).

        Returns the absolute remote path.

        Raises:
            RemoteError: ``exists`` when ``remote`` exists and ``overwrite`` is False;
                ``not_found`` when the local file is missing.
        """
        if not Path(local).is_file():
            raise RemoteError("local file to upload does not exist", path=local, code="not_found")
        full = self.abspath(remote)
        if not overwrite and self.exists(full):
            raise RemoteError("remote file exists (pass --overwrite (overwrite=True from Python) to replace it)", path=full, code="exists")
        self.mkdir(posixpath.dirname(full))
        tmp = self._temp_name(full)
        self._transport.put(str(local), tmp)
        self._transport.rename(tmp, full)
        return full

    def get(self, remote: str, local: str | Path, *, overwrite: bool = False) -> Path:
        """Copy a server file here (temp name in the same folder, then rename).

        Raises:
            RemoteError: ``exists`` when ``local`` exists and ``overwrite`` is False;
                ``not_found`` when the remote file is missing.
        """
        full = self.abspath(remote)
        local = Path(local)
        if local.exists() and not overwrite:
            raise RemoteError("local file exists (pass --overwrite (overwrite=True from Python) to replace it)", path=local, code="exists")
        if self.size(full) is None:
            raise RemoteError("no such file on the server", path=full, code="not_found")
        local.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(local) as tmp:
            self._transport.get(full, str(tmp))
        return local

    def write_text(self, path: str, text: str, *, mode: int = 0o644) -> str:
        """Write a text file atomically (temp name, chmod, rename; parents created); return its path."""
        full = self.abspath(path)
        self.mkdir(posixpath.dirname(full))
        tmp = self._temp_name(full)
        with self.open(tmp, "wb") as fh:
            fh.write(text.encode("utf-8"))
        self._transport.chmod(tmp, mode)
        self._transport.rename(tmp, full)
        return full

    def read_text(self, path: str) -> str:
        """Whole file as UTF-8 text (invalid bytes replaced)."""
        with self.open(path, "rb") as fh:
            return fh.read().decode("utf-8", "replace")

    def read_from(self, path: str, offset: int = 0, max_bytes: int = 1 << 20) -> FileChunk:
        """Read new bytes of a growing file (a log) from ``offset``.

        Returns an empty chunk (``next_offset == offset``) when nothing was added,
        and restarts at 0 when the file became shorter than ``offset``.

        Raises:
            RemoteError: ``not_found`` when the file does not exist.
        """
        full = self.abspath(path)
        size = self.size(full)
        if size is None:
            raise RemoteError("no such file on the server", path=full, code="not_found")
        restarted = size < offset
        start = 0 if restarted else offset
        if start >= size:
            return FileChunk(b"", start, start, size, restarted)
        with self.open(full, "rb") as fh:
            fh.seek(start)
            data = fh.read(min(max_bytes, size - start))
        return FileChunk(data, start, start + len(data), size, restarted)

    def read_lines(self, path: str, offset: int = 0, max_bytes: int = 1 << 20) -> tuple[list[str], int]:
        """Complete lines added since ``offset``, and the offset after the last complete line.

        A trailing partial line (a writer mid-line) is left for the next call.
        """
        chunk = self.read_from(path, offset, max_bytes)
        end = chunk.data.rfind(b"\n")
        if end < 0:
            return [], chunk.offset
        lines = chunk.data[: end + 1].decode("utf-8", "replace").splitlines()
        return lines, chunk.offset + end + 1

    def tail(self, path: str, n_bytes: int = 64 * 1024) -> str:
        """The last ``n_bytes`` of a file as text (for error reports)."""
        size = self.size(path)
        if size is None:
            raise RemoteError("no such file on the server", path=self.abspath(path), code="not_found")
        return self.read_from(path, max(0, size - n_bytes), n_bytes).data.decode("utf-8", "replace")

    # -- hashes and disk
    def sha256(self, path: str, *, tool: Literal["auto", "sha256sum", "python"] = "auto") -> str:
        """SHA-256 (hex) of a server file, computed on the server.

        ``sha256sum`` when present (``auto``), else the configured Python's hashlib.

        Raises:
            RemoteError: ``not_found`` for a missing file, ``command_failed`` otherwise.
        """
        full = self.abspath(path)
        if self.size(full) is None:
            raise RemoteError("no such file on the server", path=full, code="not_found")
        py = self.python_command([
            "-c",
            "import hashlib,sys\nh=hashlib.sha256()\nwith open(sys.argv[1],'rb') as f:\n"
            "    for b in iter(lambda: f.read(1<<20), b''): h.update(b)\nprint(h.hexdigest())",
            full,
        ])
        if tool == "sha256sum":
            script = f"sha256sum -- {shlex.quote(full)}"
        elif tool == "python":
            script = py
        else:
            script = f"if command -v sha256sum >/dev/null 2>&1; then sha256sum -- {shlex.quote(full)}; else {py}; fi"
        out = self.run(script, check=True).stdout.split()
        digest = out[0].lower() if out else ""
        if not is_sha256(digest):
            raise RemoteError(f"unexpected SHA-256 output {out[:2]!r}", path=full, code="command_failed")
        return digest

    def free_disk(self, path: str) -> int:
        """Bytes available to this user on the file system holding ``path``.

        ``path`` may not exist yet: its nearest existing ancestor is measured.
        """
        full = self.abspath(path)
        script = (
            f"p={shlex.quote(full)}; while [ ! -e \"$p\" ]; do p=$(dirname -- \"$p\"); done; "
            "df -P -k -- \"$p\" | tail -n 1"
        )
        fields = self.run(script, check=True).stdout.split()
        try:
            return int(fields[3]) * 1024
        except (IndexError, ValueError) as exc:
            raise RemoteError(f"unexpected df output {fields!r}", path=full, code="command_failed") from exc

    # -- processes
    def process_info(self, pid: int) -> ProcessInfo | None:
        """The process with this PID, or None when there is none (zombies are returned)."""
        pid = int(pid)
        script = (
            f"s=$(cat /proc/{pid}/stat 2>/dev/null) || exit 3; "
            f"c=$(tr '\\000' '\\037' < /proc/{pid}/cmdline 2>/dev/null); "
            "b=$(awk '/^btime/ {print $2}' /proc/stat); t=$(getconf CLK_TCK); "
            "printf '%s\\n%s\\n%s\\n%s' \"$s\" \"$b\" \"$t\" \"$c\""
        )
        result = self.run(script)
        if result.exit_code == 3:
            return None
        result.check()
        # Four parts: the stat line, btime, CLK_TCK, then the command line (args
        # separated by \x1f, which keeps newlines inside arguments intact).
        stat_line, btime, clk_tck, args = (result.stdout.split("\n", 3) + ["", "", ""])[:4]
        parsed = parse_stat_line(stat_line)
        if parsed is None:
            return None
        _, comm, fields = parsed
        cmdline = tuple(a for a in args.split("\x1f") if a)
        return self._process_from_fields(pid, comm, fields, int(btime), int(clk_tck), cmdline)

    @staticmethod
    def _process_from_fields(pid, comm, fields, btime, clk_tck, cmdline=()) -> ProcessInfo:
        # fields[0] is field 3 of stat (state); start time is field 22.
        start_ticks = int(fields[19])
        return ProcessInfo(
            pid=pid, ppid=int(fields[1]), pgid=int(fields[2]), sid=int(fields[3]), state=fields[0],
            start_ticks=start_ticks, start_time_s=btime + start_ticks / clk_tck, comm=comm,
            cmdline=tuple(cmdline),
        )

    def list_processes(self) -> list[ProcessInfo]:
        """Every process on the server (without command lines), by PID."""
        script = (
            "awk '/^btime/ {print $2}' /proc/stat; getconf CLK_TCK; "
            "cat /proc/[0-9]*/stat 2>/dev/null; true"
        )
        lines = self.run(script, check=True).stdout.splitlines()
        btime, clk_tck = int(lines[0]), int(lines[1])
        processes = []
        for line in lines[2:]:
            parsed = parse_stat_line(line)
            if parsed is not None:
                pid, comm, fields = parsed
                with contextlib.suppress(IndexError, ValueError):
                    processes.append(self._process_from_fields(pid, comm, fields, btime, clk_tck))
        return sorted(processes, key=lambda p: p.pid)

    def pid_alive(self, pid: int) -> bool:
        """True when the PID exists and is not a zombie."""
        info = self.process_info(pid)
        return info is not None and info.alive

    def group_members(self, pgid: int) -> list[int]:
        """PIDs of the live (non-zombie) processes in process group ``pgid``."""
        return [p.pid for p in self.list_processes() if p.pgid == int(pgid) and p.alive]

    def signal_process(self, expected: ProcessInfo, sig: str = "TERM") -> bool:
        """Send ``sig`` to ``expected.pid`` only when it is still the same process.

        The PID, start time and command line are read again and compared with
        ``expected``; a reused PID is never signalled.

        Returns:
            True when the signal was sent, False when the process is gone or is another one.
        """
        sig = validate_signal(sig)
        current = self.process_info(expected.pid)
        if current is None or not current.alive or not current.same_process(expected):
            return False
        return self.run(["kill", "-s", sig, "--", str(expected.pid)]).ok

    def signal_group(self, leader: ProcessInfo, sig: str = "TERM") -> bool:
        """Send ``sig`` to the whole process group led by ``leader``, after proving its identity.

        Only when the leader (PID == PGID) is alive and still the same process
        (PID, start time, command line). When the leader is gone, signal the
        remaining members one by one with :meth:`signal_process`.

        Returns:
            True when the signal was sent.
        """
        sig = validate_signal(sig)
        if leader.pgid != leader.pid:
            raise RemoteError(f"process {leader.pid} does not lead its process group", code="not_group_leader")
        current = self.process_info(leader.pid)
        if current is None or not current.alive or not current.same_process(leader):
            return False
        return self.run(["kill", "-s", sig, "--", f"-{leader.pgid}"]).ok

    # -- detached processes
    def _tmux(self) -> list[str]:
        return ["tmux"] + (["-L", self.config.tmux_socket] if self.config.tmux_socket else [])

    def tmux_session_exists(self, session: str) -> bool:
        """True when the tmux session exists (exact name)."""
        return self.run(self._tmux() + ["has-session", "-t", f"={session}"]).ok

    def start_detached(
        self,
        name: str,
        command: str | Sequence[str],
        *,
        state_dir: str,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        method: Literal["auto", "tmux", "setsid"] = "auto",
        start_timeout_s: float = 15.0,
    ) -> DetachedProcess:
        """Start ``command`` detached from this connection, named after the run.

        A wrapper script ``<state_dir>/<name>.sh`` (mode 0700) writes its PID to
        ``<name>.pid``, runs the command with stdin from /dev/null and stdout and
        stderr appended to ``log_path`` (default ``<state_dir>/<name>.log``), then
        writes the command's exit status to ``<name>.exit``. It ignores nothing:
        TERM sent to the group ends the command, whose status (143) is recorded.
        The launch record (:meth:`DetachedProcess.to_dict`) goes to ``<name>.launch.json``.

        Args:
            name: the run name (validated; the tmux session is ``name`` with ``.`` -> ``_``).
            command: argument list (quoted here) or shell command string.
            state_dir: folder for the wrapper and state files (created).
            cwd, env: working directory and extra environment of the command.
            method: ``tmux`` (session named after the run), ``setsid`` (new session,
                no terminal), or ``auto`` (tmux when installed).
            start_timeout_s: how long to wait for the wrapper to record its PID.

        Raises:
            InvalidNameError: for an unsafe name.
            RemoteError: ``already_started`` when this run name was launched in
                ``state_dir`` before or its tmux session exists; ``start_failed``
                when the wrapper did not start.
        """
        validate_name(name, "run name")
        for key in env or {}:
            if not _ENV_NAME_PATTERN.match(key):
                raise RemoteError(f"invalid environment variable name {key!r}", code="bad_env")
        command_text = command if isinstance(command, str) else shlex.join(str(c) for c in command)
        state_dir = self.mkdir(state_dir)
        base = posixpath.join(state_dir, name)
        paths = {
            "pid_path": base + ".pid",
            "exit_path": base + ".exit",
            "launch_path": base + ".launch.json",
            "script_path": base + ".sh",
            "log_path": self.abspath(log_path) if log_path else base + ".log",
        }
        if method == "auto":
            method = "tmux" if self.has_command("tmux") else "setsid"
        session = name.replace(".", "_") if method == "tmux" else None
        for key in ("pid_path", "exit_path", "launch_path"):
            if self.size(paths[key]) is not None:
                raise RemoteError(f"run {name!r} was already started here", path=paths[key], code="already_started")
        if session and self.tmux_session_exists(session):
            raise RemoteError(f"tmux session {session!r} already exists", code="already_started")

        q = {k: shlex.quote(v) for k, v in paths.items()}
        lines = [
            "#!/bin/sh",
            f"# dpflow detached run {name}",
            f"echo $$ > {q['pid_path']}.tmp && mv -f {q['pid_path']}.tmp {q['pid_path']}",
            # A handler (not ignore) so the command, which gets default dispositions,
            # receives TERM/INT/HUP while this shell survives to record the status.
            "trap 'true' HUP INT TERM",
            # A signal ignored when this shell started cannot be trapped or reset (POSIX): a launch from a
            # process that ignores TERM (an in-process Dagster materialisation does) would pass that on to the
            # command, which a TERM then never stops. env --default-signal (coreutils 8.31+) resets them.
            "defaults=''; env --default-signal=TERM true 2>/dev/null && defaults='env --default-signal=HUP,INT,TERM'",
        ]
        if cwd is not None:
            lines.append(
                f"cd -- {shlex.quote(self.abspath(cwd))} || {{ echo 126 > {q['exit_path']}.tmp; "
                f"mv -f {q['exit_path']}.tmp {q['exit_path']}; exit 126; }}"
            )
        lines += [f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items()]
        lines += [
            f"$defaults sh -c {shlex.quote(command_text)} < /dev/null >> {q['log_path']} 2>&1",
            "rc=$?",
            f"echo \"$rc\" > {q['exit_path']}.tmp && mv -f {q['exit_path']}.tmp {q['exit_path']}",
            "exit \"$rc\"",
        ]
        self.write_text(paths["script_path"], "\n".join(lines) + "\n", mode=0o700)

        wrapper = f"exec sh {q['script_path']}"
        if method == "tmux":
            launch = self.run(self._tmux() + ["new-session", "-d", "-s", session, wrapper])
        else:
            launch = self.run(
                f"setsid -f sh {q['script_path']} < /dev/null > /dev/null 2>&1"
            )
        if not launch.ok:
            raise RemoteError(
                f"could not start run {name!r} with {method}: {launch.stderr.strip()[-400:]}", code="start_failed"
            )
        leader = self._wait_for_leader(paths["pid_path"], start_timeout_s)
        if leader is None:
            raise RemoteError(f"run {name!r} did not record its PID within {start_timeout_s} s",
                              path=paths["pid_path"], code="start_failed")
        proc = DetachedProcess(
            name=name, method=method, tmux_session=session, leader=leader, command=command_text,
            state_dir=state_dir, **paths,
        )
        self.write_text(paths["launch_path"], json.dumps(proc.to_dict(), indent=2) + "\n")
        return proc

    def _wait_for_leader(self, pid_path: str, timeout_s: float) -> ProcessInfo | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.size(pid_path):
                text = self.read_text(pid_path).strip()
                if text.isdigit():
                    info = self.process_info(int(text))
                    if info is not None:
                        return info
                    # Exited already: a short command. Identity from the PID alone.
                    return ProcessInfo(int(text), 0, int(text), int(text), "X", 0, 0.0, "sh")
            time.sleep(0.05)
        return None

    def load_detached(self, state_dir: str, name: str) -> DetachedProcess:
        """Read the launch record of run ``name`` written by :meth:`start_detached`.

        Raises:
            RemoteError: ``not_found`` when the run was never started there.
        """
        validate_name(name, "run name")
        return DetachedProcess.from_dict(json.loads(self.read_text(posixpath.join(state_dir, name + ".launch.json"))))

    def detached_status(self, proc: DetachedProcess) -> DetachedStatus:
        """Exit status (once recorded), whether the wrapper still runs, and the group's members."""
        # Liveness first, exit file second: the wrapper writes the file before it
        # exits, so a dead wrapper seen here has its status on disk already.
        current = self.process_info(proc.pid)
        leader_alive = current is not None and current.alive and current.same_process(proc.leader)
        members = tuple(self.group_members(proc.leader.pgid))
        if not leader_alive and current is not None and current.alive and not current.same_process(proc.leader):
            # Another process holds the PID now, so the group with that id is not this run's.
            members = ()
        exit_code = None
        if self.size(proc.exit_path):
            text = self.read_text(proc.exit_path).strip()
            exit_code = int(text) if text.lstrip("-").isdigit() else None
        return DetachedStatus(exit_code=exit_code, leader_alive=leader_alive, members=members)

    def wait_detached(self, proc: DetachedProcess, timeout_s: float, poll_s: float = 0.5) -> DetachedStatus:
        """Poll until the run recorded its exit status or vanished, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.detached_status(proc)
            if status.finished and not status.leader_alive or status.vanished or time.monotonic() >= deadline:
                return status
            time.sleep(poll_s)

    # -- GPUs
    def gpu_inventory(self, *, timeout_s: float = 60.0) -> GpuInventory:
        """GPUs and compute processes from ``nvidia-smi`` now (see :class:`GpuInventory`).

        Exit status 127 (the shell found no such command) is ``no_gpu``; any other
        non-zero status is ``error``; an answer without GPU lines is ``no_gpu``. Each
        message names the command, its exit status and what it printed.
        """
        smi = " ".join(shlex.quote(w) for w in shlex.split(self.config.nvidia_smi))
        gpu_cmd = " ".join([smi, *GPU_QUERY_ARGS])
        gpus = self.run(gpu_cmd, timeout_s=timeout_s)

        def failed(result, what: str) -> tuple[str, str]:
            output = (result.stderr.strip() or result.stdout.strip())[-400:]
            how = "timed out" if result.timed_out else f"exited with status {result.exit_code}"
            return f"{what}: `{result.command}` {how}: {output or '(no output)'}", output

        if not gpus.ok:
            if gpus.exit_code == 127:
                message, output = failed(gpus, f"no GPU: {self.config.nvidia_smi!r} not found on the server")
                return GpuInventory("no_gpu", message=message, command=gpu_cmd, exit_code=127, stderr=output)
            message, output = failed(gpus, "nvidia-smi failed")
            return GpuInventory("error", message=message, command=gpu_cmd, exit_code=gpus.exit_code, stderr=output)
        rows = parse_gpu_query(gpus.stdout)
        if not rows:
            return GpuInventory(
                "no_gpu", message=f"no GPU: `{gpu_cmd}` exited with status 0 and lists none",
                command=gpu_cmd, exit_code=0, stderr=gpus.stderr.strip()[-400:],
            )
        apps_cmd = " ".join([smi, *GPU_APPS_QUERY_ARGS])
        apps = self.run(apps_cmd, timeout_s=timeout_s)
        if not apps.ok:
            message, output = failed(apps, "nvidia-smi process query failed")
            return GpuInventory("error", rows, message=message, command=apps_cmd, exit_code=apps.exit_code, stderr=output)
        return GpuInventory("ok", rows, parse_compute_apps(apps.stdout), command=apps_cmd, exit_code=0)
