"""Smoke and training runs on the machines a lab.yaml names: one server, a Slurm cluster or several servers.

The steps under :mod:`dpflow_core.runs.recipe` (which ``dpflow smoke|train``, ``dpflow scale smoke|train``
and the ``smoke_run`` / ``train_run`` assets call) and the upload that ``dpflow upload``, ``dpflow scale``
and the ``remote_dataset`` asset share, so every front end drives every layout the same way. Takes the connected servers of a :class:`~dpflow_core.server.lab.LabServers` (one for
``single`` and ``slurm``, one per host in rank order for ``hosts``) and a
:class:`~dpflow_core.runs.spec.RunSpec`; gives a :class:`ScaleResult`, whose
:meth:`~ScaleResult.smoke_run` and :meth:`~ScaleResult.train_result` are the assets' typed values.

* :func:`upload_to_lab`: the dataset uploaded and verified by SHA-256 where the runs read it: on
  the one server, through the login node to the cluster's shared file system (``slurm``), or to
  every host (``hosts``).
* :func:`slurm_smoke` / :func:`slurm_train`: the Slurm preflight (partition, GPUs, the dataset
  from a compute node), then :func:`~dpflow_core.runs.slurm_checks.run_slurm_smoke`, or
  ``sbatch`` + :func:`~dpflow_core.runs.slurm.wait_job` + the natural-exit and release checks
  (:mod:`dpflow_core.runs.slurm_checks`); a job still running at the timeout is cancelled by its id.
* :func:`server_smoke` / :func:`server_train`: one server (a lab's ``single`` mode; the smoke run of
  ``hosts`` on the first host): :func:`~dpflow_core.runs.run_smoke`, or
  :func:`~dpflow_core.runs.launch_or_attach` + :func:`~dpflow_core.runs.monitor_run`.
* :func:`hosts_train`: the multi-machine run
  (:func:`~dpflow_core.runs.multihost.launch_multihost` + :func:`~dpflow_core.runs.multihost.follow_multihost`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from dpflow_core.errors import RemoteError, RunError
from dpflow_core.server import GpuServer, SlurmSettings
from dpflow_core.server.lab import LabServers
from dpflow_core.server.upload import ProgressCallback, RemoteDataset, UploadResult, upload_dataset
from dpflow_core.runs.slurm import JobState, SlurmJob, cancel_job, submit_run, wait_job
from dpflow_core.runs.slurm_checks import check_slurm_exit, check_slurm_released, run_slurm_smoke, slurm_preflight
from dpflow_core.runs.launch import launch_or_attach
from dpflow_core.runs.monitor import MonitorResult, ProgressCallback as LogProgressCallback, RankRun, ReportedCheck, TrainResult, monitor_run
from dpflow_core.runs.smoke import ResumeCheckSize, SmokeResult, SmokeRun, run_smoke
from dpflow_core.runs.natural_exit import NaturalExitReport, check_natural_exit
from dpflow_core.runs.settings import SCALED_TRAIN_TIMEOUT_S
from dpflow_core.runs.spec import CPU_CONFIG_NAME, GPU_CONFIG_NAME, RunSpec
from dpflow_core.runs.state import RunHandle

#: (name, passed, detail) of one check, in the order it ran.
Check = tuple[str, bool, str]
EventCallback = Callable[[str], None]


@dataclass(frozen=True)
class LabUpload:
    """The dataset on every machine of a lab.

    Attributes:
        results: each server's :class:`UploadResult` (rank order), each verified by SHA-256 there.
        sha256: the dataset's SHA-256 (the same on every machine).
    """

    results: tuple[UploadResult, ...]
    sha256: str

    @property
    def paths(self) -> tuple[str, ...]:
        """The dataset's path on each machine, rank order."""
        return tuple(r.remote_path for r in self.results)

    def remote_dataset(self, frequency_hz: float) -> RemoteDataset:
        """The dataset the runs read (``frequency_hz``: its measured frequency, Hz), each machine's copy in rank order."""
        return replace(self.results[0].to_remote_dataset(frequency_hz), remote_paths=self.paths)


class UploadMismatch(RemoteError):
    """The dataset's SHA-256 on a server differs from the local one after upload; the file is quarantined there.

    Attributes:
        verification: both hashes and sizes (:class:`~dpflow_core.server.upload.Sha256Verification`).
    """

    code = "sha256_mismatch"

    def __init__(self, where: str, verification):
        self.verification = verification
        super().__init__(f"SHA-256 mismatch after upload to {where}: {verification.describe()}",
                         path=verification.remote_path)


def upload_to_lab(
    servers: Sequence[GpuServer],
    dataset: str | Path,
    *,
    task: str | None = None,
    expected_sha256: str | None = None,
    sidecar_path: str | Path | None = None,
    method: str = "auto",
    bwlimit_kbps: int | None = None,
    progress: ProgressCallback | None = None,
    with_preflight: bool = False,
    on_event: EventCallback | None = None,
) -> LabUpload:
    """Upload ``dataset`` to every server (resumable) and verify its SHA-256 on each: what ``dpflow upload``
    (one server), ``dpflow scale`` and the ``remote_dataset`` asset call.

    For ``slurm`` the one server is the login node (or this machine) and the path lies on the
    cluster's shared file system; the compute nodes' view is checked by :func:`slurm_preflight`.
    ``task``, ``method``, ``bwlimit_kbps`` (KiB/s) and ``progress`` (bytes done, total) are
    :func:`~dpflow_core.server.upload.upload_dataset`'s.

    Raises:
        UploadMismatch: the SHA-256 differs on a server (named; the file is quarantined there);
        everything :func:`~dpflow_core.server.upload.upload_dataset` raises.
    """
    if not servers:
        raise RemoteError("no server to upload to", code="bad_config")
    results = []
    for server in servers:
        result = upload_dataset(server, dataset, task=task, expected_sha256=expected_sha256, sidecar_path=sidecar_path,
                                method=method, bwlimit_kbps=bwlimit_kbps, progress=progress,
                                with_preflight=with_preflight)
        if not result.verified:
            raise UploadMismatch(server.config.describe(), result.verification)
        if on_event is not None:
            on_event(f"dataset on {server.config.describe()}: {result.remote_path} sha256 {result.sha256}")
        results.append(result)
    return LabUpload(results=tuple(results), sha256=results[0].sha256)


@dataclass(frozen=True)
class ScaleResult:
    """How a smoke or training run on one server, a cluster or several servers went.

    Attributes:
        mode: ``single``, ``slurm`` or ``hosts``.
        kind: ``smoke`` or ``train``.
        run_name: the run's name (the Slurm job name, each host's tmux session).
        passed: every check passed.
        checks: (name, passed, detail) of each check in order: preflight, the run, natural exit, release.
        run_dir: the run directory (the first host's for ``hosts``).
        job_id: the Slurm job id (None for ``hosts``).
        state, exit_code: Slurm's final state and ``status:signal`` (None for ``hosts`` or when unknown).
        problems: every failed condition.
        release: the release check's message (Slurm; each rank's in ``checks`` for ``hosts``).
        oom_advice: what to change after an out-of-memory end.
        job: the Slurm job record (None for ``hosts`` and for a refused preflight).
        epoch, global_step: the last ones the trainer logged (training runs; None when unknown).
        hosts: ``hosts`` only: ``run_dirs``, ``exit_codes``, ``failed_ranks``, ``stopped_ranks``,
            ``tokens`` and ``released`` (one per rank).
        launch_index: the launch that ran (0, or k for the k-th resume; None when nothing ran).
        smoke: a smoke run on one server or the first host: its :class:`~dpflow_core.runs.smoke.SmokeResult`.
        handle, attached, monitor: a training run on one server: its launch, whether it was running already
            (re-attached), and how following it ended (None with ``detach``).
        natural_exit: a training run on one server: the natural-exit check after it (None when not judged).
    """

    mode: str
    kind: str
    run_name: str
    passed: bool
    checks: tuple[Check, ...]
    run_dir: str | None = None
    job_id: str | None = None
    state: str | None = None
    exit_code: str | None = None
    problems: tuple[str, ...] = ()
    release: str | None = None
    oom_advice: tuple[str, ...] = ()
    job: SlurmJob | None = field(default=None, repr=False)
    hosts: dict[str, Any] = field(default_factory=dict)
    epoch: int | None = None
    global_step: int | None = None
    launch_index: int | None = None
    smoke: SmokeResult | None = field(default=None, repr=False)
    handle: RunHandle | None = field(default=None, repr=False)
    attached: bool = False
    monitor: MonitorResult | None = field(default=None, repr=False)
    natural_exit: NaturalExitReport | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready summary (``dpflow scale --json``)."""
        out: dict[str, Any] = {"mode": self.mode, "kind": self.kind, "run_name": self.run_name, "passed": self.passed,
                               "run_dir": self.run_dir, "problems": list(self.problems),
                               "checks": [list(c) for c in self.checks]}
        if self.mode == "slurm":
            out.update(job_id=self.job_id, state=self.state, exit_code=self.exit_code, release=self.release,
                       oom_advice=list(self.oom_advice))
        out.update(self.hosts)
        return out

    def smoke_run(self, spec: RunSpec, host: str | None, resume_check: ResumeCheckSize,
                  dataset_local_path: str | None = None) -> SmokeRun:
        """The value of the ``smoke_run`` asset for this smoke run ``spec`` on a Slurm cluster (:func:`slurm_smoke`)
        or on the first of several hosts (:func:`server_smoke`, as on one server); ``host``: that machine's host.

        Raises:
            RunError: ``not_submitted``: nothing ran (the Slurm preflight refused).
        """
        if self.smoke is not None:
            return SmokeRun.of(spec, self.smoke, host, resume_check, dataset_local_path)
        if self.job is None:
            raise RunError(f"smoke run {spec.name}: no Slurm job ran: {'; '.join(self.problems)}", code="not_submitted")
        return SmokeRun(
            run_name=self.run_name, run_dir=self.run_dir or self.job.run_dir, host=host, config_name=spec.config_name,
            train_command=spec.train_command, dataset_remote_path=spec.dataset_path, dataset_sha256=spec.dataset_sha256,
            frequency_hz=spec.frequency_hz, spec=spec, resume_check=resume_check, launch_index=self.job.launch_index,
            scheduler=self.mode, slurm_job_id=self.job_id, slurm_state=self.state, slurm_exit_code=self.exit_code,
            dataset_local_path=dataset_local_path,
        )

    def train_result(self, spec: RunSpec, *, host: str | None, dataset_sha256: str, dataset_local_path: str | None,
                     hosts: Sequence[str | None] = (), in_run_check: ReportedCheck | None = None) -> TrainResult:
        """The value of the ``train_run`` asset for this training run ``spec``; ``host``: the server's, the
        login node's or the first host's; ``hosts``: each machine's host, rank order; ``in_run_check``: the
        trainer's own verdict (one server, Dagster Pipes).

        Raises:
            RunError: ``not_submitted``: nothing ran (the Slurm preflight refused); ``bad_config``: a run of
                one server that was not followed (``detach``).
        """
        if self.mode == "single":
            if self.handle is None or self.monitor is None:
                raise RunError(f"training {spec.name}: not followed to its end", code="bad_config")
            return TrainResult.of(self.handle, self.monitor, host=host, dataset_sha256=dataset_sha256,
                                  dataset_local_path=dataset_local_path, in_run_check=in_run_check,
                                  dataset_remote_path=spec.dataset_path, frequency_hz=spec.frequency_hz)
        if self.launch_index is None:
            raise RunError(f"training {spec.name}: nothing ran: {'; '.join(self.problems)}", code="not_submitted")
        ranks: tuple[RankRun, ...] = ()
        if self.mode == "hosts" and self.hosts:
            h = self.hosts
            ranks = tuple(
                RankRun(rank=i, host=hosts[i] if i < len(hosts) else None, run_dir=run_dir, exit_code=h["exit_codes"][i],
                        failed=i in h["failed_ranks"], stopped=i in h["stopped_ranks"], released=bool(h["released"][i]))
                for i, run_dir in enumerate(h["run_dirs"])
            )
        return TrainResult(
            run_name=self.run_name, run_dir=self.run_dir or "", launch_index=self.launch_index, host=host, exit_code=None,
            global_step=self.global_step, epoch=self.epoch, train_loss=None, dataset_sha256=dataset_sha256,
            dataset_local_path=dataset_local_path, scheduler=self.mode, dataset_remote_path=spec.dataset_path,
            frequency_hz=spec.frequency_hz, slurm_job_id=self.job_id, slurm_state=self.state,
            slurm_exit_code=self.exit_code, ranks=ranks,
        )


def slurm_config_name(config_name: str, settings: SlurmSettings) -> str:
    """The trainer config of a run on the cluster: ``config_name`` unless ``auto``, which picks the GPU config
    when the jobs ask for GPUs (``slurm.gpus_per_node``) and the CPU config otherwise (the login node's own
    nvidia-smi says nothing about the compute nodes)."""
    if config_name and config_name != "auto":
        return config_name
    return GPU_CONFIG_NAME if settings.gpus_per_node else CPU_CONFIG_NAME


def _preflight(server: GpuServer, spec: RunSpec) -> list[Check]:
    pre = slurm_preflight(server, spec.dataset_path, spec.dataset_sha256 or "")
    return [(f"preflight {name}", ok, detail) for name, ok, detail in pre.checks]


def slurm_smoke(server: GpuServer, spec: RunSpec, *, timeout_s: float = 900.0) -> ScaleResult:
    """Preflight on the cluster, then the smoke run as a one-node job, judged and checked released."""
    checks = _preflight(server, spec)
    if not all(c[1] for c in checks):
        return ScaleResult("slurm", "smoke", spec.name, False, tuple(checks), problems=tuple(c[2] for c in checks if not c[1]))
    smoke = run_slurm_smoke(server, spec, timeout_s=timeout_s)
    state = smoke.state
    checks.append((f"smoke run (job {smoke.job.job_id})", smoke.passed, "; ".join(smoke.problems) or
                   f"{state.describe() if state else 'unknown'}, {smoke.finite_losses} finite train_loss, no checkpoint"))
    checks.append(("released", smoke.release.passed, smoke.release.message))
    return ScaleResult("slurm", "smoke", spec.name, smoke.passed and smoke.release.passed, tuple(checks),
                       run_dir=smoke.job.run_dir, job_id=smoke.job.job_id, state=state.state if state else None,
                       exit_code=state.exit_code if state else None, problems=smoke.problems, release=smoke.release.message,
                       job=smoke.job, launch_index=smoke.job.launch_index)


def slurm_train(
    server: GpuServer,
    spec: RunSpec,
    *,
    timeout_s: float = 86400.0,
    on_event: EventCallback | None = None,
    on_state: Callable[[JobState | None], None] | None = None,
    poll_s: float = 0.5,
) -> ScaleResult:
    """Preflight, ``sbatch``, follow the job until it ends (cancelled by its id after ``timeout_s``), then
    judge natural exit (``sacct`` COMPLETED 0:0 plus the trainer's evidence) and release.

    Raises:
        RunError: from :func:`~dpflow_core.runs.slurm.submit_run` (``run_exists``, ``submit_failed``, ...).
    """
    checks = _preflight(server, spec)
    if not all(c[1] for c in checks):
        return ScaleResult("slurm", "train", spec.name, False, tuple(checks), problems=tuple(c[2] for c in checks if not c[1]))
    job = submit_run(server, spec)
    if on_event is not None:
        on_event(f"submitted {spec.name} as job {job.job_id} ({job.nodes} node(s)); output {job.output_path}")
    wait_job(server, job, timeout_s=timeout_s, poll_s=poll_s, on_state=on_state)
    report = check_slurm_exit(server, job)
    if report.state is not None and not report.state.finished:
        cancel_job(server, job)
    release = check_slurm_released(server, job)
    trainer = report.trainer
    checks.append(("natural exit", report.passed, "; ".join(report.problems) or
                   f"{report.state.describe()}, epoch {trainer.last_epoch}, global_step {trainer.last_global_step}"))
    checks.append(("released", release.passed, release.message))
    state = report.state
    return ScaleResult("slurm", "train", spec.name, report.passed and release.passed, tuple(checks), run_dir=job.run_dir,
                       job_id=job.job_id, state=state.state if state else None, exit_code=state.exit_code if state else None,
                       problems=report.problems, release=release.message, oom_advice=report.oom_advice, job=job,
                       epoch=trainer.last_epoch, global_step=trainer.last_global_step, launch_index=job.launch_index)


@dataclass(frozen=True)
class RunHooks:
    """What a front end adds to a run on one server (or the first host): ``extra_env`` for the run's environment,
    ``on_poll`` called while it runs (a reader of its Dagster Pipes messages), ``on_launch(handle, attached)``
    once launched, ``on_progress(progress, new_records)`` on each new log line of a training run."""

    extra_env: dict[str, str] | None = None
    on_poll: Callable[[], None] | None = None
    on_launch: Callable[[RunHandle, bool], None] | None = None
    on_progress: LogProgressCallback | None = None


def server_smoke(server: GpuServer, spec: RunSpec, *, mode: str = "single", timeout_s: float = 900.0,
                 hooks: RunHooks = RunHooks()) -> ScaleResult:
    """The smoke run on one server (for ``hosts``: the first host, rule 6), then its release check."""
    smoke = run_smoke(server, spec, timeout_s=timeout_s, extra_env=hooks.extra_env, on_poll=hooks.on_poll)
    checks = ((f"smoke run on {server.config.describe()}", smoke.passed, "; ".join(smoke.problems)),
              ("released", smoke.release.passed, smoke.release.message))
    return ScaleResult(mode, "smoke", spec.name, smoke.passed and smoke.release.passed, checks,
                       run_dir=smoke.handle.run_dir, problems=smoke.problems, release=smoke.release.message,
                       launch_index=smoke.handle.launch_index, smoke=smoke, handle=smoke.handle)


def server_train(server: GpuServer, spec: RunSpec, *, inventory=None, timeout_s: float | None = None,
                 poll_s: float = 5.0, stall_timeout_s: float = 900.0, detach: bool = False,
                 judge_exit: bool = True, hooks: RunHooks = RunHooks()) -> ScaleResult:
    """Launch the training run on one server (or re-attach to it, :func:`launch_or_attach`) and follow it until it
    ends (:func:`monitor_run`; at most ``timeout_s``, the run then keeps running); with ``detach``, return once
    launched. Then, with ``judge_exit``, the natural-exit check (:func:`~dpflow_core.runs.check_natural_exit`;
    the ``train_run`` asset leaves it to its blocking check). Passes unless following saw NaN, a stall or the
    timeout, or the natural-exit check failed."""
    handle, attached = launch_or_attach(server, spec, inventory=inventory, extra_env=hooks.extra_env)
    if hooks.on_launch is not None:
        hooks.on_launch(handle, attached)
    common = dict(run_dir=handle.run_dir, launch_index=handle.launch_index, handle=handle, attached=attached)
    if detach:
        return ScaleResult("single", "train", spec.name, True, (("launched", True, handle.run_dir),), **common)
    monitored = monitor_run(server, handle, poll_s=poll_s, stall_timeout_s=stall_timeout_s, timeout_s=timeout_s,
                            on_progress=hooks.on_progress, on_poll=hooks.on_poll)
    ok = monitored.status not in ("nan", "stalled", "timeout")
    checks = [("monitor", ok, f"{monitored.status}: {monitored.message}")]
    problems = [] if ok else [f"{monitored.status}: {monitored.message}"]
    report = check_natural_exit(server, handle) if judge_exit else None
    if report is not None:
        checks.append(("natural exit", report.passed, "; ".join(report.problems) or
                       f"exit 0, epoch {report.last_epoch}, global_step {report.last_global_step}"))
        problems += report.problems
    return ScaleResult("single", "train", spec.name, ok and (report is None or report.passed), tuple(checks),
                       problems=tuple(problems), epoch=monitored.progress.epoch, global_step=monitored.progress.global_step,
                       oom_advice=tuple(report.oom_advice) if report is not None else (), monitor=monitored,
                       natural_exit=report, **common)


def hosts_train(
    servers: Sequence[GpuServer],
    lab: LabServers,
    spec: RunSpec,
    paths: Sequence[str],
    *,
    timeout_s: float = 86400.0,
    on_event: EventCallback | None = None,
) -> ScaleResult:
    """One run over every host (rank i on ``servers[i]``, the dataset at ``paths[i]``), followed until it
    ends; one failed rank stops the others; every host checked released."""
    from dpflow_core.runs.multihost import follow_multihost, launch_multihost

    run = launch_multihost(servers, spec, main_address=lab.main_address, network_interface=lab.network_interface,
                           dataset_paths=list(paths))
    if on_event is not None:
        on_event(f"launched {spec.name} on {len(servers)} machines ({', '.join(run.hosts)}); "
                 f"rendezvous {run.main_address}:{run.port}")
        for server, handle in zip(servers, run.handles):
            on_event(f"  {server.config.describe()}: {handle.run_dir} (tmux {handle.detached.tmux_session}, "
                     f"pid {handle.detached.pid})")
    result = follow_multihost(servers, run, timeout_s=timeout_s)
    checks = [("multi-machine run", result.passed,
               "; ".join(result.problems) or f"every rank exited 0 ({list(result.exit_codes)})")]
    checks += [(f"released rank {rank}", r.passed, r.message) for rank, r in enumerate(result.releases)]
    hosts = {"run_dirs": [h.run_dir for h in run.handles], "exit_codes": list(result.exit_codes),
             "failed_ranks": list(result.failed_ranks), "stopped_ranks": sorted(result.stopped),
             "tokens": [h.token for h in run.handles], "released": [r.passed for r in result.releases]}
    natural = result.natural_exit
    return ScaleResult("hosts", "train", spec.name, result.passed, tuple(checks), run_dir=run.handles[0].run_dir,
                       problems=result.problems, hosts=hosts, epoch=natural.last_epoch if natural else None,
                       global_step=natural.last_global_step if natural else None, launch_index=run.handles[0].launch_index)


def run_on_lab(
    servers: Sequence[GpuServer],
    lab: LabServers,
    spec: RunSpec,
    paths: Sequence[str],
    *,
    timeout_s: float | None,
    on_event: EventCallback | None = None,
    on_state: Callable[[JobState | None], None] | None = None,
    hooks: RunHooks = RunHooks(),
    **single: Any,
) -> ScaleResult:
    """The smoke or training run ``spec`` (by its kind) on the lab's one server, cluster or hosts.

    ``timeout_s``: seconds before the run is ended (a training run on one server: before following
    stops, None: until it ends). ``on_event`` gets progress lines (submitted, launched); ``on_state``
    each state a Slurm training job is polled in (for progress reports); ``hooks`` go to a run on one
    server or the first host (:class:`RunHooks`), and ``single`` to :func:`server_train` (``inventory``,
    ``poll_s``, ``stall_timeout_s``, ``detach``, ``judge_exit``).
    """
    if lab.mode == "single" or (lab.mode == "hosts" and spec.kind == "smoke"):
        if spec.kind == "smoke":
            return server_smoke(servers[0], spec, mode=lab.mode, timeout_s=timeout_s or 900.0, hooks=hooks)
        return server_train(servers[0], spec, timeout_s=timeout_s, hooks=hooks, **single)
    timeout_s = timeout_s or SCALED_TRAIN_TIMEOUT_S
    if lab.mode == "slurm":
        if spec.kind == "smoke":
            return slurm_smoke(servers[0], spec, timeout_s=timeout_s)
        return slurm_train(servers[0], spec, timeout_s=timeout_s, on_event=on_event, on_state=on_state)
    return hosts_train(servers, lab, spec, paths, timeout_s=timeout_s, on_event=on_event)
