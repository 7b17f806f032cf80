"""Smoke run: a short run on the real dataset that must exit 0 by itself and write a checkpoint.

Takes a server and a smoke :class:`~dpflow_core.runs.spec.RunSpec`; gives a :class:`SmokeResult`
(exit code, checkpoints written, steps logged, wall time in s).
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import dataclass
from typing import Any, Callable

from dpflow_core.errors import RunError
from dpflow_core.logs import LogProgress, LogTailer, is_finite_number
from dpflow_core.results import StageResult
from dpflow_core.server import GpuServer
from dpflow_core.runs.launch import launch_run
from dpflow_core.runs.monitor import describe_exit, last_error_line, read_log_records, read_output_tail
from dpflow_core.runs.oom import is_out_of_memory, oom_advice
from dpflow_core.runs.processes import cleanup_run
from dpflow_core.runs.records import finalize_record
from dpflow_core.runs.release import ReleaseReport, check_released, save_release_report
from dpflow_core.runs.spec import CHECKPOINT_DIR, RunSpec
from dpflow_core.runs.state import RunHandle


# ------------------------------------------------------------------------ smoke run


@dataclass(frozen=True)
class SmokeResult:
    """Outcome of :func:`run_smoke`.

    Attributes:
        handle: the launch.
        passed: exit status 0 on its own, at least one finite ``train_loss`` and no checkpoint.
        exit_code: the wrapper's record (None when it timed out or vanished).
        timed_out: the run exceeded the timeout and was ended.
        finite_losses: finite ``train_loss`` values in ``logs.json.txt``.
        checkpoints: checkpoint files found (must be none).
        problems: why it did not pass.
        release: the release check (processes, GPU memory) right after the run.
        oom_advice: steps to try when the output shows CUDA out of memory.
        output_tail: the end of the process output.
        seconds: wall-clock duration.
        progress: the last log figures.
    """

    handle: RunHandle
    passed: bool
    exit_code: int | None
    timed_out: bool
    finite_losses: int
    checkpoints: tuple[str, ...]
    problems: tuple[str, ...]
    release: ReleaseReport
    oom_advice: tuple[str, ...]
    output_tail: str
    seconds: float
    progress: LogProgress

    def metadata(self) -> dict[str, Any]:
        out = {**self.handle.metadata(), **self.progress.to_metadata()}
        out.update(
            passed=self.passed, exit_code=self.exit_code if self.exit_code is not None else -1,
            exit=describe_exit(self.exit_code), timed_out=self.timed_out, finite_losses=self.finite_losses,
            checkpoints_written=len(self.checkpoints), seconds=round(self.seconds, 2),
            released=self.release.passed, release=self.release.message,
        )
        if self.problems:
            out["problems"] = "; ".join(self.problems)
        return out


@dataclass(frozen=True)
class ResumeCheckSize(StageResult):
    """How long the resume-continuity check's runs are: ``epochs`` (>= 2) of ``steps`` batches each."""

    epochs: int
    steps: int


@dataclass(frozen=True)
class SmokeRun(StageResult):
    """A smoke run that passed: the value of the ``smoke_run`` asset (``to_dict``/``from_dict``), one type
    for every layout (one server, a Slurm cluster; several hosts smoke on the first host as on one server).

    :class:`SmokeResult` is the run's whole outcome (processes, release, output); this is what the
    checks after it need to find the run again and to repeat it for the resume check.

    Attributes:
        run_name, run_dir: the run and its directory on the server (Slurm: on the cluster's shared file system).
        host: the server's host (None for the local machine).
        config_name, train_command: the trainer config and command template it ran.
        dataset_remote_path, dataset_sha256: the dataset on the server and its SHA-256 (hex).
        frequency_hz: the dataset frequency passed to the trainer, Hz.
        spec: the full :class:`RunSpec`.
        resume_check: the size of the resume-continuity check's runs.
        gpu_ids: the GPU it used (empty: CPU, and a Slurm job, whose GPUs Slurm chose).
        launch_index: the launch it was (0 for a new run; None: the latest, as values stored before had it).
        scheduler: ``single`` (one server, or the first of several hosts) or ``slurm``.
        slurm_job_id, slurm_state, slurm_exit_code: the Slurm job, its final state (``COMPLETED``, ...) and
            ``status:signal`` from ``sacct`` (None without Slurm, or when unknown).
        dataset_local_path: the same dataset on this machine.

    ``from_dict`` needs the ten fields from ``run_name`` to ``resume_check`` (what ``smoke_run`` stored
    before its value was typed, in either layout); the others then take their defaults. Made by
    :meth:`of` (one server) and :meth:`dpflow_core.runs.scale.ScaleResult.smoke_run` (Slurm).
    """

    run_name: str
    run_dir: str
    host: str | None
    config_name: str
    train_command: str
    dataset_remote_path: str
    dataset_sha256: str | None
    frequency_hz: float
    spec: RunSpec
    resume_check: ResumeCheckSize
    gpu_ids: tuple[int, ...] = ()
    launch_index: int | None = None
    scheduler: str = "single"
    slurm_job_id: str | None = None
    slurm_state: str | None = None
    slurm_exit_code: str | None = None
    dataset_local_path: str | None = None

    @classmethod
    def of(
        cls, spec: RunSpec, result: SmokeResult, host: str | None, resume_check: ResumeCheckSize,
        dataset_local_path: str | None = None,
    ) -> "SmokeRun":
        """The smoke run ``spec`` that gave ``result`` (:func:`run_smoke`) on ``host``."""
        return cls(
            run_name=spec.name, run_dir=result.handle.run_dir, host=host, config_name=spec.config_name,
            train_command=spec.train_command, dataset_remote_path=spec.dataset_path,
            dataset_sha256=spec.dataset_sha256, frequency_hz=spec.frequency_hz, spec=spec, resume_check=resume_check,
            gpu_ids=tuple(result.handle.gpu_ids), launch_index=result.handle.launch_index,
            dataset_local_path=dataset_local_path,
        )


def list_checkpoints(server: GpuServer, run_dir: str) -> list[str]:
    """``*.ckpt`` file names in ``<run_dir>/checkpoints`` (temporary files excluded)."""
    return [n for n in server.listdir(posixpath.join(run_dir, CHECKPOINT_DIR)) if n.endswith(".ckpt") and not n.startswith(".")]


def run_smoke(
    server: GpuServer,
    spec: RunSpec,
    *,
    timeout_s: float = 900.0,
    release_wait_s: float = 10.0,
    cleanup: bool = True,
    extra_env: dict[str, str] | None = None,
    on_poll: Callable[[], None] | None = None,
    poll_s: float = 0.5,
) -> SmokeResult:
    """Run a smoke run in the foreground and judge it (rules 6 and 7).

    The run is launched detached in its own session (PID and process group recorded
    at launch) and waited for; after ``timeout_s`` its processes are ended. Then the
    release check runs (and, with ``cleanup``, ends leftovers proven to be the
    run's); its report is stored with the launch for the blocking asset check.
    ``extra_env`` goes to the run's environment (:func:`launch_run`); ``on_poll`` is called every
    ``poll_s`` seconds while it runs and once after it ended (a reader of its Pipes messages).
    """
    if spec.kind != "smoke":
        raise RunError(f"run_smoke needs a smoke spec, got kind {spec.kind!r}", code="bad_config")
    started = time.monotonic()
    handle = launch_run(server, spec, method="setsid", extra_env=extra_env)
    if on_poll is None:
        status = server.wait_detached(handle.detached, timeout_s)
    else:
        deadline = time.monotonic() + timeout_s
        while True:
            on_poll()
            status = server.detached_status(handle.detached)
            if status.finished or status.vanished or time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        on_poll()
    timed_out = not status.finished and not status.vanished
    if timed_out:
        cleanup_run(server, handle)
        status = server.detached_status(handle.detached)
    records = read_log_records(server, handle.log_path)
    finite = sum(1 for r in records if not r.get("epoch_summary") and is_finite_number(r.get("train_loss")))
    ckpts = tuple(list_checkpoints(server, handle.run_dir))
    output = read_output_tail(server, handle.output_path)
    problems = []
    if timed_out:
        problems.append(f"did not finish within {timeout_s:.0f} s (its processes were ended)")
    elif status.exit_code is None:
        problems.append("no exit status recorded: the run was killed")
    elif status.exit_code != 0:
        problems.append(f"{describe_exit(status.exit_code)}: {last_error_line(output)}")
    if finite == 0:
        problems.append(f"no finite train_loss in {handle.log_path}")
    if ckpts:
        problems.append(f"checkpoints were written although disabled: {', '.join(ckpts)}")
    release = check_released(server, handle, wait_s=release_wait_s, cleanup=cleanup)
    save_release_report(server, handle, release)
    finalize_record(server, handle)
    progress = LogTailer(server, handle.log_path)
    progress.poll()
    advice = tuple(oom_advice(handle, inventory=server.gpu_inventory() if handle.gpu_ids else None)) if is_out_of_memory(output) else ()
    return SmokeResult(
        handle=handle, passed=not problems, exit_code=status.exit_code, timed_out=timed_out, finite_losses=finite,
        checkpoints=ckpts, problems=tuple(problems), release=release, oom_advice=advice, output_tail=output[-4000:],
        seconds=time.monotonic() - started, progress=progress.progress,
    )
