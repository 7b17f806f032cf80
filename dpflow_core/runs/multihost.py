"""Several servers without a scheduler: one run over N machines with accelerate's multi-machine launch.

Takes one :class:`~dpflow_core.server.GpuServer` per machine (rank order: the first is the main
machine, which hosts the rendezvous) and a :class:`~dpflow_core.runs.spec.RunSpec`; gives a
:class:`MultiHostRun` (one :class:`~dpflow_core.runs.state.RunHandle` per machine) and, after
:func:`follow_multihost`, a :class:`MultiHostResult`.

Each machine gets the same run name, its own run directory under its own data root and a tmux
session named after the run, started by :func:`~dpflow_core.runs.launch.launch_run` with
``accelerate launch --num_machines N --machine_rank i --main_process_ip <main> --main_process_port
<port>`` (torch's static rendezvous underneath). Before anything starts, the dataset is verified
on every machine by SHA-256 computed there. Without GPUs each machine runs one CPU process (gloo);
``network_interface`` sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` when the machines
must talk over a particular interface.

One failed rank fails the run: as soon as one machine's run has ended with a non-zero status (or
vanished), the other machines' processes of this run, and only those (the run's token or its
live process group, :func:`~dpflow_core.runs.processes.cleanup_run`), are stopped; then every
machine is checked released. Natural exit is judged on the main machine, where the trainer logs
and saves, and every other machine must have exited 0.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Literal, Sequence

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.server import DetachedStatus, GpuServer
from dpflow_core.runs.command import MachineRank, default_main_process_port
from dpflow_core.runs.gpus import choose_gpus, require_gpus
from dpflow_core.runs.launch import launch_run
from dpflow_core.runs.monitor import describe_exit
from dpflow_core.runs.natural_exit import NaturalExitReport, check_natural_exit
from dpflow_core.runs.processes import CleanupReport, cleanup_run
from dpflow_core.runs.release import ReleaseReport, check_released, save_release_report
from dpflow_core.runs.spec import RunSpec
from dpflow_core.runs.state import RunHandle, load_handle


@dataclass(frozen=True)
class MultiHostRun:
    """A run launched on several machines.

    Attributes:
        spec: what was launched (the same on every machine).
        hosts: each machine as :meth:`ServerConfig.describe` names it, in rank order.
        main_address, port: the rendezvous (``--main_process_ip``, ``--main_process_port``).
        handles: each machine's launch, in rank order.
    """

    spec: RunSpec
    hosts: tuple[str, ...]
    main_address: str
    port: int
    handles: tuple[RunHandle, ...]


def verify_datasets(servers: Sequence[GpuServer], paths: Sequence[str], sha256: str) -> list[str]:
    """SHA-256 of ``paths[i]`` computed on machine i; the hashes, in rank order.

    Raises:
        DatasetError: ``not_found`` or ``sha256_mismatch``, naming the machine.
    """
    seen = []
    for server, path in zip(servers, paths, strict=True):
        if server.size(path) is None:
            raise DatasetError(f"dataset not found on {server.config.describe()}", path=path, code="not_found")
        digest = server.sha256(path)
        if digest != sha256:
            raise DatasetError(f"dataset SHA-256 on {server.config.describe()} is {digest}, expected {sha256}",
                               path=path, code="sha256_mismatch")
        seen.append(digest)
    return seen


def launch_multihost(
    servers: Sequence[GpuServer],
    spec: RunSpec,
    *,
    main_address: str | None = None,
    port: int | None = None,
    network_interface: str | None = None,
    dataset_paths: Sequence[str] | None = None,
    method: Literal["auto", "tmux", "setsid"] = "auto",
) -> MultiHostRun:
    """Launch ``spec`` on every machine under one run name (rank i on ``servers[i]``).

    The dataset (``spec.dataset_path`` on each machine) is verified by SHA-256 on each first; GPUs
    come from each machine's nvidia-smi now, and every machine must offer the same number. When
    launching on one machine fails, the machines already started are stopped again.

    Args:
        main_address: how the others reach the main machine (default: its configured host).
        port: the rendezvous port (default: derived from the run name).
        network_interface: the interface the processes talk over (``GLOO_SOCKET_IFNAME``).
        dataset_paths: the dataset's path on each machine (default: ``spec.dataset_path`` on all).

    Raises:
        RunError: ``bad_config`` (fewer than two machines, no dataset SHA-256, a smoke spec, unequal
            GPU counts), and everything :func:`launch_run` raises; DatasetError from :func:`verify_datasets`.
    """
    if len(servers) < 2:
        raise RunError(f"a multi-machine run needs at least two servers, got {len(servers)}", code="bad_config")
    if spec.kind != "train":
        raise RunError("a smoke run uses one machine: run it on the first server", code="bad_config")
    if not spec.dataset_sha256:
        raise RunError("a multi-machine run needs the dataset's SHA-256 to verify it on every machine", code="bad_config")
    paths = list(dataset_paths or [spec.dataset_path] * len(servers))
    verify_datasets(servers, paths, spec.dataset_sha256)
    inventories = [s.gpu_inventory() for s in servers]
    counts = []
    for server, inventory in zip(servers, inventories):
        require_gpus(server, inventory)
        counts.append(len(choose_gpus(inventory, spec.num_processes, spec.gpu_ids)))
    if len(set(counts)) != 1:
        raise RunError(f"every machine must offer the same number of free GPUs, got {counts} "
                       f"({', '.join(s.config.describe() for s in servers)})", code="bad_config")
    address = main_address or servers[0].config.host or "127.0.0.1"
    port = int(port or default_main_process_port(spec.name))
    env = {"GLOO_SOCKET_IFNAME": network_interface, "NCCL_SOCKET_IFNAME": network_interface} if network_interface else {}
    handles: list[RunHandle] = []
    try:
        for rank, (server, inventory) in enumerate(zip(servers, inventories)):
            machine = MachineRank(rank=rank, count=len(servers), main_address=address, port=port)
            local = dataclasses.replace(spec, dataset_path=paths[rank])
            handles.append(launch_run(server, local, method=method, inventory=inventory, machine=machine, extra_env=env))
    except BaseException:
        for server, handle in zip(servers, handles):
            cleanup_run(server, handle)
        raise
    return MultiHostRun(spec=spec, hosts=tuple(s.config.describe() for s in servers), main_address=address, port=port,
                        handles=tuple(handles))


@dataclass(frozen=True)
class MultiHostResult:
    """How a multi-machine run ended.

    Attributes:
        passed: every rank exited 0 on its own, the main machine's natural-exit check passed, and
            every machine is released.
        exit_codes: each rank's recorded exit status (None: none recorded), in rank order.
        failed_ranks: ranks that ended with a non-zero status or vanished first.
        stopped: the cleanup of each rank this run stopped because another failed (rank -> report).
        releases: each machine's release check.
        natural_exit: the main machine's natural-exit check (None when a rank failed).
        problems: every failed condition, naming the rank and its host.
    """

    passed: bool
    exit_codes: tuple[int | None, ...]
    failed_ranks: tuple[int, ...]
    stopped: dict[int, CleanupReport]
    releases: tuple[ReleaseReport, ...]
    natural_exit: NaturalExitReport | None
    problems: tuple[str, ...]


def _failed(status: DetachedStatus) -> bool:
    return status.vanished or (status.finished and not status.leader_alive and status.exit_code != 0)


def follow_multihost(
    servers: Sequence[GpuServer], run: MultiHostRun, *, timeout_s: float, poll_s: float = 1.0,
) -> MultiHostResult:
    """Wait for every rank; stop the others as soon as one fails; then check every machine released."""
    deadline = time.monotonic() + timeout_s
    problems: list[str] = []
    stopped: dict[int, CleanupReport] = {}
    while True:
        statuses = [s.detached_status(h.detached) for s, h in zip(servers, run.handles)]
        failed = [i for i, st in enumerate(statuses) if _failed(st)]
        done = all(st.finished and not st.leader_alive for st in statuses)
        timed_out = time.monotonic() >= deadline
        if failed or done or timed_out:
            break
        time.sleep(poll_s)
    for rank in failed:
        st = statuses[rank]
        what = "vanished without an exit status" if st.vanished else describe_exit(st.exit_code)
        problems.append(f"rank {rank} on {run.hosts[rank]} {what}: the run failed")
    if timed_out and not failed and not done:
        problems.append(f"the run did not finish within {timeout_s:.0f} s: every rank was stopped")
    if failed or (timed_out and not done):
        for rank, (server, handle) in enumerate(zip(servers, run.handles)):
            if rank not in failed:
                stopped[rank] = cleanup_run(server, handle)
        statuses = [s.detached_status(h.detached) for s, h in zip(servers, run.handles)]
    codes = tuple(st.exit_code for st in statuses)
    for rank, code in enumerate(codes):
        if rank not in failed and code != 0 and rank not in stopped:
            problems.append(f"rank {rank} on {run.hosts[rank]} {describe_exit(code)}")
    releases = []
    for rank, (server, handle) in enumerate(zip(servers, run.handles)):
        report = check_released(server, handle, cleanup=True)
        save_release_report(server, handle, report)
        releases.append(report)
        if not report.passed:
            problems.append(f"rank {rank} on {run.hosts[rank]} not released: {report.message}")
    natural = None
    if not failed and not stopped:
        natural = check_natural_exit(servers[0], run.handles[0])
        problems += [f"rank 0 on {run.hosts[0]}: {p}" for p in natural.problems]
    return MultiHostResult(passed=not problems, exit_codes=codes, failed_ranks=tuple(failed), stopped=stopped,
                           releases=tuple(releases), natural_exit=natural, problems=tuple(problems))


@dataclass(frozen=True)
class MultiHostExit:
    """A multi-machine run judged afterwards from each machine's launch record.

    Attributes:
        passed: every rank has ended with status 0, the main machine's natural-exit check passed,
            and no process of the run is left on any machine.
        exit_codes: each rank's recorded exit status (None: none recorded), rank order.
        natural_exit: the main machine's natural-exit check.
        releases: each machine's release check (now).
        problems: every failed condition, naming the rank and its host.
    """

    passed: bool
    exit_codes: tuple[int | None, ...]
    natural_exit: NaturalExitReport
    releases: tuple[ReleaseReport, ...]
    problems: tuple[str, ...]

    def metadata(self) -> dict:
        return {**self.natural_exit.metadata(), "exit_codes": ", ".join(map(str, self.exit_codes)),
                "released": ", ".join("yes" if r.passed else "no" for r in self.releases), "problems": "; ".join(self.problems)}


def check_multihost_exit(servers: Sequence[GpuServer], name: str, *, release_wait_s: float = 5.0) -> MultiHostExit:
    """Judge the finished multi-machine run ``name`` (rank i on ``servers[i]``): the same verdict as
    :func:`follow_multihost` gives at the end, from the records alone (rules 7 and 10).

    Raises:
        RunError: ``run_not_found`` when a machine has no launch of the run.
    """
    handles = [load_handle(server, name) for server in servers]
    problems: list[str] = []
    codes = []
    releases = []
    for rank, (server, handle) in enumerate(zip(servers, handles)):
        host = server.config.describe()
        status = server.detached_status(handle.detached)
        codes.append(status.exit_code)
        if status.vanished:
            problems.append(f"rank {rank} on {host} vanished without an exit status")
        elif not status.finished or status.leader_alive:
            problems.append(f"rank {rank} on {host} is still running")
        elif status.exit_code != 0:
            problems.append(f"rank {rank} on {host} {describe_exit(status.exit_code)}")
        release = check_released(server, handle, wait_s=release_wait_s)
        releases.append(release)
        if not release.passed:
            problems.append(f"rank {rank} on {host} not released: {release.message}")
    natural = check_natural_exit(servers[0], handles[0])
    problems += [f"rank 0 on {servers[0].config.describe()}: {p}" for p in natural.problems]
    return MultiHostExit(passed=not problems, exit_codes=tuple(codes), natural_exit=natural, releases=tuple(releases),
                         problems=tuple(problems))
