"""Process ownership and cleanup: which processes on the server are a run's, and stopping exactly those.

Takes a server and a :class:`~dpflow_core.runs.state.RunHandle`; gives the run's processes (proved by
the ``DPFLOW_RUN_TOKEN`` in ``/proc/<pid>/environ`` or by the live group leader) and a
:class:`CleanupReport` after TERM, a grace period (s) and KILL of those still proven.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass

from dpflow_core.server import GpuServer, ProcessInfo
from dpflow_core.runs.spec import TOKEN_ENV
from dpflow_core.runs.state import RunHandle


# ---------------------------------------------------------------------- processes


def describe_process(p: ProcessInfo) -> str:
    """``pid 123 (python -m ...)``: PID and command line (or short name) of a process."""
    cmd = " ".join(p.cmdline)[:160] if p.cmdline else p.comm
    return f"pid {p.pid} ({cmd})"


def token_pids(server: GpuServer, token: str) -> set[int]:
    """PIDs whose environment holds ``DPFLOW_RUN_TOKEN=<token>`` exactly (own processes only are readable)."""
    pattern = shlex.quote(f"{TOKEN_ENV}={token}")
    result = server.run(f"grep -l -z -x -F -e {pattern} /proc/[0-9]*/environ 2>/dev/null; true")
    out = set()
    for line in result.stdout.splitlines():
        m = re.fullmatch(r"/proc/(\d+)/environ", line.strip())
        if m:
            out.add(int(m.group(1)))
    return out


def run_processes(server: GpuServer, handle: RunHandle) -> list[ProcessInfo]:
    """Live processes proven to be this run's (see the module docstring), with command lines.

    A process qualifies when its environment holds the run's token, or when it
    shares the run's process group or session while the wrapper (PID, start time,
    command line recorded at launch) is alive. Processes started before the
    wrapper never qualify.
    """
    leader = handle.detached.leader
    current = server.process_info(leader.pid)
    leader_alive = current is not None and current.alive and current.same_process(leader)
    candidates = set(token_pids(server, handle.token))
    if leader_alive:
        candidates |= {p.pid for p in server.list_processes() if p.alive and (p.pgid == leader.pgid or p.sid == leader.sid)}
    out = []
    for pid in sorted(candidates):
        info = server.process_info(pid)
        if info is None or not info.alive:
            continue
        if leader.start_ticks and info.start_ticks < leader.start_ticks:
            continue
        out.append(info)
    return out


@dataclass(frozen=True)
class CleanupReport:
    """What :func:`cleanup_run` signalled.

    Attributes:
        terminated: processes sent TERM (``describe_process`` strings).
        killed: processes sent KILL because TERM did not end them.
        remaining: processes of the run still alive afterwards.
    """

    terminated: tuple[str, ...] = ()
    killed: tuple[str, ...] = ()
    remaining: tuple[str, ...] = ()


def cleanup_run(server: GpuServer, handle: RunHandle, *, grace_s: float = 10.0, poll_s: float = 0.25) -> CleanupReport:
    """End this run's processes only: TERM each proven one, wait, KILL those TERM did not end.

    Every signal goes through :meth:`GpuServer.signal_process`, which re-reads the
    PID's start time and command line and refuses a process that is not the one
    found; before KILL, membership is proven again.
    """
    targets = run_processes(server, handle)
    terminated = [describe_process(p) for p in targets if server.signal_process(p, "TERM")]
    deadline = time.monotonic() + grace_s
    left = targets
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        proven = {p.pid: p for p in run_processes(server, handle)}
        left = [p for p in targets if p.pid in proven and proven[p.pid].same_process(p)]
    killed = []
    if left:
        proven = {p.pid: p for p in run_processes(server, handle)}
        for p in left:
            if p.pid in proven and proven[p.pid].same_process(p) and server.signal_process(p, "KILL"):
                killed.append(describe_process(p))
        time.sleep(0.5)
    remaining = [describe_process(p) for p in run_processes(server, handle)]
    return CleanupReport(tuple(terminated), tuple(killed), tuple(remaining))
