"""Monitoring: follow a launched run's ``logs.json.txt`` until it exits, and read its output.

Takes a server and a :class:`~dpflow_core.runs.state.RunHandle`; gives a :class:`MonitorResult`
(exit code, last progress, OOM advice) and the one-line description of an exit status.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable, Literal

from dpflow_core.errors import RemoteError
from dpflow_core.logs import LogProgress, LogTailer, parse_log_text
from dpflow_core.results import StageResult
from dpflow_core.server import GpuServer
from dpflow_core.runs.processes import CleanupReport, cleanup_run
from dpflow_core.runs.state import RunHandle


log = logging.getLogger(__name__)
_SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}


# -------------------------------------------------------------------------- monitor


@dataclass(frozen=True)
class MonitorResult:
    """How monitoring ended.

    Attributes:
        status: ``finished`` (exit status recorded), ``vanished`` (processes gone without
            one), ``nan`` (non-finite loss), ``stalled`` (no new log line in time),
            ``timeout`` (gave up waiting; the run may still go on).
        exit_code: the recorded exit status, if any.
        progress: the last log figures.
        message: one line for humans.
        stopped: processes ended because of nan/stall (``CleanupReport``), if any.
    """

    status: Literal["finished", "vanished", "nan", "stalled", "timeout"]
    exit_code: int | None
    progress: LogProgress
    message: str
    stopped: CleanupReport | None = None

    @property
    def ok(self) -> bool:
        return self.status == "finished" and self.exit_code == 0


@dataclass(frozen=True)
class ReportedCheck(StageResult):
    """A check the trainer ran itself and reported (e.g. over Dagster Pipes): its verdict and figures."""

    passed: bool
    metadata: dict[str, Any]


@dataclass(frozen=True)
class RankRun(StageResult):
    """One machine's part of a run over several hosts (``gpu_server.hosts``), in :class:`TrainResult`.

    Attributes:
        rank: the machine rank (0: the main process's machine).
        host: that server's host (None for the local machine).
        run_dir: the run directory there.
        exit_code: the exit status its wrapper recorded (None: none recorded).
        failed: this rank failed (a non-zero exit, or vanished); stopped: ended by dpflow because another rank failed.
        released: its release check passed (no process left, GPU memory back).
    """

    rank: int
    host: str | None
    run_dir: str
    exit_code: int | None
    failed: bool
    stopped: bool
    released: bool


@dataclass(frozen=True)
class TrainResult(StageResult):
    """A followed training run: the value of the ``train_run`` asset (``to_dict``/``from_dict``), one type for
    every layout (one server, a Slurm cluster, several hosts).

    Attributes:
        run_name, run_dir: the run and its directory on the server (several hosts: rank 0's);
            launch_index: 0, or k for the k-th resume.
        host: the server's host (None for the local machine; several hosts: the first's).
        exit_code: the exit status the run's wrapper recorded on one server (None when none was recorded,
            and on a Slurm cluster or several hosts: see ``slurm_exit_code`` and ``ranks``).
        global_step, epoch: the last logged figures, steps and epochs (None before the first);
            train_loss: the last logged training loss (None before the first; not followed on a cluster).
        dataset_sha256: SHA-256 (hex) of the dataset it trained on; dataset_local_path: that dataset here.
        in_run_check: the trainer's own completion check, when it reported one (Dagster Pipes, one server).
        scheduler: ``single`` (one server), ``slurm`` or ``hosts``.
        dataset_remote_path: the dataset on the server (several hosts: the first's copy);
            frequency_hz: the dataset frequency passed to the trainer, Hz (None in values stored before).
        slurm_job_id, slurm_state, slurm_exit_code: the Slurm job, its final state (``COMPLETED``, ...) and
            ``status:signal`` from ``sacct`` (None without Slurm, or when unknown).
        ranks: several hosts: each machine's part, rank order (empty otherwise).

    ``from_dict`` needs the ten fields from ``run_name`` to ``dataset_local_path`` (what ``train_run``
    stored before its value was typed, in every layout); the others then take their defaults. A value
    stored by ``train_run`` on a Slurm cluster before carried Slurm's ``status:signal`` string as
    ``exit_code``: it is read as ``slurm_exit_code``. Made by :meth:`of` (one server) and
    :meth:`dpflow_core.runs.scale.ScaleResult.train_result` (Slurm, several hosts).
    """

    run_name: str
    run_dir: str
    launch_index: int
    host: str | None
    exit_code: int | None
    global_step: int | None
    epoch: int | None
    train_loss: float | None
    dataset_sha256: str
    dataset_local_path: str | None
    in_run_check: ReportedCheck | None = None
    scheduler: str = "single"
    dataset_remote_path: str | None = None
    frequency_hz: float | None = None
    slurm_job_id: str | None = None
    slurm_state: str | None = None
    slurm_exit_code: str | None = None
    ranks: tuple[RankRun, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainResult":
        """The result ``data`` describes (:meth:`StageResult.from_dict`), a Slurm value stored before included.

        Raises:
            ResultError: as :meth:`StageResult.from_dict`, naming ``TrainResult`` and the field.
        """
        if isinstance(data, Mapping) and isinstance(data.get("exit_code"), str):
            data = {**data, "exit_code": None, "slurm_exit_code": data.get("slurm_exit_code") or data["exit_code"]}
        return super().from_dict(data)

    @classmethod
    def of(
        cls, handle: RunHandle, monitored: MonitorResult, *, host: str | None, dataset_sha256: str,
        dataset_local_path: str | None, in_run_check: ReportedCheck | None = None,
        dataset_remote_path: str | None = None, frequency_hz: float | None = None,
    ) -> "TrainResult":
        """The run ``handle`` on one server as monitoring left it (``monitored``, :func:`monitor_run`)."""
        return cls(
            run_name=handle.name, run_dir=handle.run_dir, launch_index=handle.launch_index, host=host,
            exit_code=monitored.exit_code, global_step=monitored.progress.global_step, epoch=monitored.progress.epoch,
            train_loss=monitored.progress.train_loss, dataset_sha256=dataset_sha256,
            dataset_local_path=dataset_local_path, in_run_check=in_run_check,
            dataset_remote_path=dataset_remote_path, frequency_hz=frequency_hz,
        )


ProgressCallback = Callable[[LogProgress, list[dict[str, Any]]], None]


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What a dropped SSH connection raises: ours, socket errors, and Paramiko's own."""
    errors: tuple[type[BaseException], ...] = (RemoteError, OSError, EOFError)
    try:
        import paramiko

        errors += (paramiko.SSHException,)
    except ImportError:
        pass
    return errors


_CONNECTION_ERRORS = _connection_errors()


def monitor_run(
    server: GpuServer,
    handle: RunHandle,
    *,
    poll_s: float = 5.0,
    stall_timeout_s: float = 900.0,
    timeout_s: float | None = None,
    on_progress: ProgressCallback | None = None,
    on_poll: Callable[[], None] | None = None,
    stop_on_failure: bool = True,
    reconnect_attempts: int = 5,
) -> MonitorResult:
    """Follow a run until it ends: tail ``logs.json.txt``, detect NaN and stalls.

    The log is read incrementally from the start (so a re-attached monitor sees the
    whole history). A dropped SSH connection is re-opened (up to
    ``reconnect_attempts`` times in a row). With ``stop_on_failure`` a run with a
    NaN loss or a stall is ended (:func:`cleanup_run`: its own processes only).
    ``on_poll`` (a reader of the run's Pipes messages, say) is called on every poll, inside
    the same reconnect handling, and once more after the run ended, so it sees the last lines.
    """
    tailer = LogTailer(server, handle.log_path)
    started = time.monotonic()
    failures = 0
    while True:
        try:
            new = tailer.poll()
            if new and on_progress is not None:
                # inside the reconnect handling: a callback that reads the server may meet the drop too
                on_progress(tailer.progress, new)
            if on_poll is not None:
                on_poll()
            status = server.detached_status(handle.detached)
            failures = 0
        except _CONNECTION_ERRORS as exc:
            transient = not isinstance(exc, RemoteError) or exc.code in ("unreachable", "ssh_failed", "command_failed")
            if not transient or failures >= reconnect_attempts:
                raise
            failures += 1
            log.warning("lost the server while monitoring %s (%s); reconnecting (%d/%d)", handle.name, exc, failures, reconnect_attempts)
            server.close()
            time.sleep(min(30.0, poll_s * failures))
            continue
        p = tailer.progress
        if p.nonfinite is not None and not status.finished:
            stopped = cleanup_run(server, handle) if stop_on_failure else None
            return MonitorResult("nan", None, p, f"non-finite loss at global_step {p.nonfinite.get('global_step')}: {p.nonfinite}", stopped)
        if status.finished and not status.leader_alive:
            tailer.poll()
            if on_poll is not None:
                on_poll()
            p = tailer.progress
            return MonitorResult("finished", status.exit_code, p, describe_exit(status.exit_code))
        if status.vanished:
            tailer.poll()
            return MonitorResult("vanished", None, tailer.progress,
                                 "the run's processes are gone but no exit status was recorded (killed with the wrapper: SIGKILL, OOM killer or reboot)")
        if tailer.stalled(stall_timeout_s):
            stopped = cleanup_run(server, handle) if stop_on_failure else None
            return MonitorResult("stalled", None, p, f"no new log line for {stall_timeout_s:.0f} s after global_step {p.global_step}", stopped)
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            return MonitorResult("timeout", None, p, f"still running after {timeout_s:.0f} s of monitoring")
        time.sleep(poll_s)


def describe_exit(code: int | None) -> str:
    """``exit status 0``, ``exit status 143 (killed by SIGTERM)``, ..."""
    if code is None:
        return "no exit status recorded"
    if code > 128 and code - 128 in _SIGNAL_NAMES:
        return f"exit status {code} (killed by {_SIGNAL_NAMES[code - 128]})"
    if code < 0 and -code in _SIGNAL_NAMES:
        return f"exit status {code} (killed by {_SIGNAL_NAMES[-code]})"
    return f"exit status {code}"


def read_log_records(server: GpuServer, path: str) -> list[dict[str, Any]]:
    """Every complete record of the run log ``path`` (``logs.json.txt``) on ``server``, oldest first.

    Returns ``[]`` when the file does not exist yet (a run that died before its first step);
    a trailing partial line is left out (:func:`dpflow_core.logs.parse_log_text`).

    Raises:
        RemoteError: the server could not be read (other than the file being absent).
    """
    if server.size(path) is None:
        return []
    return parse_log_text(server.read_text(path))


def read_output_tail(server: GpuServer, path: str, n_bytes: int = 16 * 1024) -> str:
    """The last ``n_bytes`` bytes of a process output file on ``server`` as text (invalid UTF-8
    replaced), or ``""`` when it cannot be read: it only feeds error messages, which must not fail."""
    try:
        return server.tail(path, n_bytes)
    except RemoteError:
        return ""


def read_output_head(server: GpuServer, path: str, n_bytes: int = 64 * 1024) -> str:
    """The first ``n_bytes`` bytes of a process output file on ``server`` as text, or ``""`` when it
    cannot be read (the start-up lines, such as the batch sizes the trainer chose, fall out of the tail)."""
    try:
        return server.read_from(path, 0, n_bytes).data.decode("utf-8", "replace")
    except RemoteError:
        return ""


def last_error_line(output: str) -> str:
    """The line of a process ``output`` that best names its failure, at most 300 characters.

    The last line that starts with ``error:`` (the trainer's own one-line message, argparse's), else the last that
    contains ``Error``/``error`` (a traceback's final line), unless that is only the launcher's
    ``subprocess.CalledProcessError`` about the trainer it ran (accelerate's traceback ends so, below the
    trainer's own message); else the last non-blank line; ``"(no output)"`` for none.
    Carriage returns (progress bars) count as line breaks.
    """
    lines = [ln.strip() for ln in output.replace("\r", "\n").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln[:300]
    for ln in reversed(lines):
        if ("Error" in ln or "error" in ln) and not ln.startswith("subprocess.CalledProcessError"):
            return ln[:300]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "(no output)"
