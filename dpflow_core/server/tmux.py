"""Detached processes: the record of a command started in a tmux session (fallback: ``setsid``).

Gives :class:`DetachedProcess` (session, wrapper PID, state files) as saved at start, and
:class:`DetachedStatus` (finished, exit code, vanished) as read back later by
:meth:`~dpflow_core.server.gpu_server.GpuServer.detached_status`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Mapping

from dpflow_core.server.procfs import ProcessInfo


@dataclass(frozen=True)
class DetachedProcess:
    """A command started by :meth:`GpuServer.start_detached`.

    Attributes:
        name: the run name the session and state files are named after.
        method: ``"tmux"`` or ``"setsid"``.
        tmux_session: tmux session name (``name`` with ``.`` replaced by ``_``), or None.
        leader: the wrapper process (leader of the run's process group and session).
        command: the command as given.
        state_dir: folder of the state files on the server.
        pid_path, exit_path, log_path, launch_path, script_path: state files; ``exit_path``
            holds the command's exit status once it has ended.
    """

    name: str
    method: Literal["tmux", "setsid"]
    tmux_session: str | None
    leader: ProcessInfo
    command: str
    state_dir: str
    pid_path: str
    exit_path: str
    log_path: str
    launch_path: str
    script_path: str

    @property
    def pid(self) -> int:
        """PID of the wrapper (== process group id == session id)."""
        return self.leader.pid

    def to_dict(self) -> dict:
        """Plain JSON-serialisable form (as written to ``launch_path``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> "DetachedProcess":
        """Inverse of :meth:`to_dict`."""
        values = dict(data)
        leader = dict(values.pop("leader"))
        leader["cmdline"] = tuple(leader.get("cmdline", ()))
        return cls(leader=ProcessInfo(**leader), **values)


@dataclass(frozen=True)
class DetachedStatus:
    """Where a detached process stands.

    Attributes:
        exit_code: the command's exit status once the wrapper recorded it, else None.
        leader_alive: the wrapper (same PID, start time, command line) still runs.
        members: PIDs still in the run's process group (wrapper included).
    """

    exit_code: int | None
    leader_alive: bool
    members: tuple[int, ...]

    @property
    def finished(self) -> bool:
        """The command ended and recorded its exit status."""
        return self.exit_code is not None

    @property
    def vanished(self) -> bool:
        """Nothing of the run is left, but no exit status was recorded (killed)."""
        return self.exit_code is None and not self.leader_alive and not self.members
