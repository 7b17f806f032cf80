"""/proc parsing: a process's identity on a Linux server.

Takes a ``/proc/<pid>/stat`` line; gives PID, command and fields, and the :class:`ProcessInfo`
(PID, start time in clock ticks since boot, command line) that must match before a signal is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpflow_core.errors import RemoteError


# --------------------------------------------------------------------- processes


@dataclass(frozen=True)
class ProcessInfo:
    """A process on the server, read from ``/proc/<pid>/stat`` and ``/proc/<pid>/cmdline``.

    Attributes:
        pid, ppid, pgid, sid: process, parent, process group and session ids.
        state: one-letter state (``R``, ``S``, ``Z`` for zombie, ...).
        start_ticks: start time in clock ticks since boot (field 22 of ``stat``);
            with ``pid`` and ``cmdline`` it identifies the process across PID reuse.
        start_time_s: the same as a UNIX time in seconds (``btime + ticks / CLK_TCK``).
        comm: the kernel's short name.
        cmdline: the argument vector (empty for kernel threads and zombies).
    """

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    start_ticks: int
    start_time_s: float
    comm: str
    cmdline: tuple[str, ...] = ()

    @property
    def alive(self) -> bool:
        """True unless the process is a zombie (exited, not yet reaped)."""
        return self.state not in ("Z", "X")

    def same_process(self, other: "ProcessInfo") -> bool:
        """True when ``other`` is this very process (PID, start time and command line)."""
        return (self.pid, self.start_ticks, self.cmdline) == (other.pid, other.start_ticks, other.cmdline)


def parse_stat_line(line: str) -> tuple[int, str, list[str]] | None:
    """Split one ``/proc/<pid>/stat`` line into (pid, comm, the fields after comm), or None when it is
    not one. ``comm`` may hold spaces and parentheses, so it ends at the last ``)`` (proc(5))."""
    head, sep, tail = line.rpartition(")")
    if not sep or " (" not in head:
        return None
    pid_text, comm = head.split(" (", 1)
    try:
        return int(pid_text), comm, tail.split()
    except ValueError:
        return None


_SIGNALS = {"TERM", "KILL", "INT", "HUP", "QUIT", "USR1", "USR2", "CONT", "STOP"}


def validate_signal(sig: str) -> str:
    """The signal's bare name for ``kill -s`` (``"sigterm"`` -> ``"TERM"``).

    Raises:
        RemoteError: ``bad_signal`` for a signal outside TERM, KILL, INT, HUP, QUIT, USR1, USR2, CONT, STOP.
    """
    sig = str(sig).upper().removeprefix("SIG")
    if sig not in _SIGNALS:
        raise RemoteError(f"unsupported signal {sig!r}", code="bad_signal")
    return sig
