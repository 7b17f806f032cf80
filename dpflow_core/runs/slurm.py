"""Runs on a Slurm cluster: submit with ``sbatch``, follow with ``squeue``/``sacct``, cancel by job id.

Takes a server whose :attr:`~dpflow_core.server.ServerConfig.scheduler` is ``slurm`` (a login node
over SSH, or the local machine) and a :class:`~dpflow_core.runs.spec.RunSpec`; gives a
:class:`SlurmJob` (recorded in ``<run_dir>/dpflow/launch-<k>/slurm.json``, job id included), the
job's :class:`JobState`, and the reports of the exit, release and preflight checks.

The run's identity is the same as on one server (:mod:`dpflow_core.runs`): one run name, which is
also the job's ``--job-name``; the run directory on the cluster's shared file system; the job's
output (``--output``) in the launch's state folder. The batch script, run on the first node:

1. checks the dataset's SHA-256 on every node (``srun`` one task per node, ``sha256sum -c``); a
   mismatch or a missing file ends the job with status 3 before anything trains;
2. reads the main node's address from Slurm (``scontrol show hostnames $SLURM_JOB_NODELIST``, then
   that node's ``NodeAddr``) and runs, through ``srun --ntasks-per-node=1 --kill-on-bad-exit=1``,
   one ``accelerate launch --num_machines $SLURM_NNODES --machine_rank $SLURM_NODEID
   --main_process_ip <addr> --main_process_port <port>`` per node (accelerate's multi-node launch,
   torch's static rendezvous underneath). Without GPUs each node runs one CPU process (gloo).

Only this run's job is ever signalled: :func:`cancel_job` calls ``scancel`` with the recorded job id
alone, after ``squeue`` confirms that job id still carries the run's name; a job of another user or
another run with the same name is never touched (names are not identities).

Natural exit (:func:`check_slurm_exit`) is ``sacct`` state ``COMPLETED`` with exit code ``0:0``
plus the trainer's own evidence (:func:`~dpflow_core.runs.natural_exit.judge_completion`). Release
(:func:`check_slurm_released`) is: the job no longer in ``squeue``, no step of it left
(``squeue --steps``), no process with the run's token on the submitting machine. ``sacct`` is
asked normally first; on a cluster without an accounting database (``jobcomp/filetxt`` only) it
falls back to ``sacct --completion``. States and exit codes are Slurm's (``sacct(1)``, "JOB STATE
CODES"; ``ExitCode`` is ``status:signal``). The checks live in :mod:`~dpflow_core.runs.slurm_checks`.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import shlex
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.server import GpuServer, SlurmSettings
from dpflow_core.runs.command import default_main_process_port, render_train_command
from dpflow_core.runs.records import launch_record, probe_checkpoint
from dpflow_core.runs.spec import (
    CHECKPOINT_DIR, LATEST_CKPT, LOG_NAME, OUTPUT_LOG, RECORD_NAME, RunSpec, run_environment, run_dir_for, utc_now,
)
from dpflow_core.runs.state import launch_indices, launch_state_dir, mkdir_exclusive


SLURM_RECORD = "slurm.json"
JOB_SCRIPT = "job.sbatch"
#: Slurm's states of a job that has ended (``sacct(1)``), and what dpflow reports for each.
FINAL_STATES = {
    "COMPLETED": "completed",
    "CANCELLED": "cancelled (scancel, by a user or an administrator)",
    "FAILED": "failed (non-zero exit of the batch script)",
    "TIMEOUT": "timed out (reached its time limit: raise slurm.time_limit, or resume from latest.ckpt)",
    "PREEMPTED": "pre-empted by a job of higher priority (resume from latest.ckpt)",
    "OUT_OF_MEMORY": "killed for exceeding its memory (Slurm's OUT_OF_MEMORY)",
    "NODE_FAIL": "ended by a node failure",
    "BOOT_FAIL": "its nodes failed to boot",
    "DEADLINE": "reached its deadline",
    "REVOKED": "revoked (federation)",
}
#: The batch script's exit status when a node's copy of the dataset fails its SHA-256 check.
DATASET_MISMATCH_EXIT = 3
#: slurmstepd's line when the cgroup OOM killer hit a step (task/cgroup, Slurm 22.05: "Detected 1 oom-kill
#: event(s) in StepId=4.1. Some of your processes may have been killed by the cgroup out-of-memory handler.").
_OOM_EVENT = re.compile(r"Detected \d+ oom-kill event\(s\) in StepId=(\d+\.(?:\d+|batch|extern))")


@dataclass(frozen=True)
class JobState:
    """A Slurm job as ``squeue`` (while it is known to the controller) or ``sacct`` reports it.

    Attributes:
        job_id: the job id.
        name: the job name.
        state: Slurm's state word (``PENDING``, ``RUNNING``, ``COMPLETED``, ``CANCELLED``, ...).
        exit_code: ``status:signal`` from ``sacct`` (None from ``squeue``).
        reason: ``squeue``'s reason (pending jobs), else empty.
        source: ``squeue`` or ``sacct``.
    """

    job_id: str
    name: str
    state: str
    exit_code: str | None = None
    reason: str = ""
    source: str = "squeue"

    @property
    def finished(self) -> bool:
        """True for a state in :data:`FINAL_STATES`."""
        return self.state in FINAL_STATES

    def describe(self) -> str:
        text = FINAL_STATES.get(self.state, self.state.lower())
        code = f", exit code {self.exit_code}" if self.exit_code else ""
        return f"job {self.job_id} {self.state}: {text}{code}"


@dataclass(frozen=True)
class SlurmJob:
    """A run submitted to Slurm, as recorded in ``<state_dir>/slurm.json``.

    Attributes:
        spec: what was submitted.
        run_dir, state_dir: the run directory and this launch's state folder (on the shared file system).
        launch_index: 0 for the first launch, k for the k-th resume.
        job_id: the id ``sbatch --parsable`` printed.
        token: ``DPFLOW_RUN_TOKEN`` of the run's processes.
        settings: the :class:`SlurmSettings` the job was submitted with.
        nodes, gpus_per_node, num_processes: the job's size (processes = nodes x max(1, GPUs per node)).
        command: the ``srun`` line of the batch script.
        script_path, output_path: the batch script and the job's output (``--output``).
        submitted_at: UTC ISO time.
    """

    spec: RunSpec
    run_dir: str
    state_dir: str
    launch_index: int
    job_id: str
    token: str
    settings: SlurmSettings
    nodes: int
    gpus_per_node: int
    num_processes: int
    command: str
    script_path: str
    output_path: str
    submitted_at: str

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log_path(self) -> str:
        return posixpath.join(self.run_dir, LOG_NAME)

    @property
    def checkpoint_dir(self) -> str:
        return posixpath.join(self.run_dir, CHECKPOINT_DIR)

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        """Per-node GPU indices as Slurm assigns them (empty: CPU)."""
        return tuple(range(self.gpus_per_node))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["spec"] = self.spec.to_dict()
        data["settings"] = dataclasses.asdict(self.settings)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SlurmJob":
        values = dict(data)
        values["spec"] = RunSpec.from_dict(values["spec"])
        settings = dict(values["settings"])
        settings["extra_sbatch"] = tuple(settings.get("extra_sbatch") or ())
        values["settings"] = SlurmSettings(**settings)
        return cls(**values)


def slurm_settings(server: GpuServer) -> SlurmSettings:
    """The ``slurm:`` settings of ``server``'s configuration.

    Raises:
        RunError: ``bad_config`` when the server is not configured with ``scheduler: slurm``.
    """
    if server.config.scheduler != "slurm" or server.config.slurm is None:
        raise RunError(f"{server.config.describe()} is not configured with scheduler: slurm", code="bad_config")
    return server.config.slurm


def launcher_line(server: GpuServer, nodes: int, gpus_per_node: int, port: int, train: str) -> str:
    """The per-node ``accelerate launch`` command (a shell fragment; ``$SLURM_*`` expand on each node).

    ``--num_machines $SLURM_NNODES --machine_rank $SLURM_NODEID --main_process_ip $DPFLOW_MAIN_ADDR``;
    ``--multi_gpu`` whenever more than one process takes part (CPU processes then use gloo, with
    ``ACCELERATE_USE_CPU`` set by the batch script); one process without GPUs is ``--cpu``.
    """
    python = " ".join(shlex.quote(w) for w in shlex.split(server.config.python))
    per_node = max(1, int(gpus_per_node))
    total = int(nodes) * per_node
    if total == 1 and not gpus_per_node:
        args = "--cpu --num_processes 1 --num_machines 1"
    else:
        args = (f"--num_processes {total} --num_machines \"$SLURM_NNODES\" --machine_rank \"$SLURM_NODEID\" "
                f"--main_process_ip \"$DPFLOW_MAIN_ADDR\" --main_process_port {int(port)}"
                + (" --multi_gpu" if total > 1 else ""))
    line = f"exec {python} -m accelerate.commands.launch {args} --mixed_precision no --dynamo_backend no {train}"
    return f"{server.config.activate} && {line}" if server.config.activate else line


def job_script(server: GpuServer, job: SlurmJob, overrides: list[str]) -> str:
    """The batch script of ``job`` (``#SBATCH`` header, dataset check on every node, ``srun`` launch)."""
    s, spec = job.settings, job.spec
    header = [
        f"--job-name={spec.name}", f"--output={job.output_path}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
        f"--chdir={server.config.repo_path or job.run_dir}",
    ]
    if s.partition:
        header.append(f"--partition={s.partition}")
    if s.account:
        header.append(f"--account={s.account}")
    if job.gpus_per_node:
        header.append(f"--gpus-per-node={job.gpus_per_node}")
    if s.cpus_per_task:
        header.append(f"--cpus-per-task={int(s.cpus_per_task)}")
    if s.time_limit:
        header.append(f"--time={s.time_limit}")
    header += list(s.extra_sbatch)
    env = run_environment(job.run_dir, job.token, spec)
    if not job.gpus_per_node:
        env["ACCELERATE_USE_CPU"] = "true"
    q = shlex.quote
    lines = ["#!/bin/sh", f"# dpflow run {spec.name}"] + [f"#SBATCH {h}" for h in header]
    lines += [f"export {k}={q(v)}" for k, v in env.items()]
    if spec.dataset_sha256:
        check = f"echo {q(spec.dataset_sha256 + '  ' + spec.dataset_path)} | sha256sum -c --quiet --strict"
        check += ' || { echo "dpflow: dataset SHA-256 mismatch or missing on $(hostname)" >&2; exit 1; }'
        # the batch shell says it too: srun may end the other nodes' tasks before it relays the failing node's line
        lines.append(f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 sh -c {q(check)} || "
                     f"{{ echo 'dpflow: dataset SHA-256 check failed on a node' >&2; exit {DATASET_MISMATCH_EXIT}; }}")
    lines += [
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'addr=$(scontrol show node "$first" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
        'export DPFLOW_MAIN_ADDR="${addr:-$first}"',
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 sh -c {q(job.command)}",
    ]
    return "\n".join(lines) + "\n"


def submit_run(server: GpuServer, spec: RunSpec) -> SlurmJob:
    """Submit a run (new, or an explicit resume) to the cluster with ``sbatch``.

    A new run creates its run directory exclusively (an existing one is refused); a resume needs
    the directory, no job of an earlier launch still queued or running, and a complete
    ``latest.ckpt``. A smoke run uses one node. The job record goes to ``<state_dir>/slurm.json``.

    Raises:
        RunError: ``bad_config`` (no Slurm scheduler), ``run_exists``, ``run_not_found``,
            ``checkpoint_incomplete``, ``already_running``, ``submit_failed`` (sbatch's message).
        DatasetError: ``not_found`` when the dataset is not on the cluster's file system.
    """
    settings = slurm_settings(server)
    run_dir = run_dir_for(server, spec.name)
    if server.size(spec.dataset_path) is None:
        raise DatasetError("dataset not found on the cluster", path=server.abspath(spec.dataset_path), code="not_found")
    if spec.resume:
        if not server.exists(run_dir):
            raise RunError("resume requested but the run directory does not exist", path=run_dir, code="run_not_found")
        probe = probe_checkpoint(server, posixpath.join(run_dir, CHECKPOINT_DIR, LATEST_CKPT))
        if not probe.loadable:
            raise RunError(f"cannot resume: {probe.describe()}", path=probe.path, code="checkpoint_incomplete")
        indices = launch_indices(server, run_dir)
        if indices:
            previous = load_job(server, spec.name, indices[-1])
            state = job_state(server, previous.job_id)
            if state is not None and not state.finished:
                raise RunError(f"run {spec.name!r} still has {state.describe()}", path=run_dir, code="already_running")
        index = (indices[-1] + 1) if indices else 0
        state_dir = launch_state_dir(run_dir, index)
        if not mkdir_exclusive(server, state_dir):
            raise RunError("another launch of this run is being prepared", path=state_dir, code="already_running")
    else:
        if not mkdir_exclusive(server, run_dir):
            raise RunError("the run directory exists already: choose a new run name, or resume explicitly",
                           path=run_dir, code="run_exists")
        index = 0
        state_dir = launch_state_dir(run_dir, index)
        server.mkdir(state_dir)
    nodes = 1 if spec.kind == "smoke" else int(settings.nodes)
    gpus = min(1, settings.gpus_per_node) if spec.kind == "smoke" else int(settings.gpus_per_node)
    overrides = spec.overrides(run_dir)
    train = render_train_command(
        spec.train_command, run_dir=run_dir, dataset=spec.dataset_path, overrides=overrides,
        num_processes=nodes * max(1, gpus), gpu_ids=tuple(range(gpus)), config_name=spec.config_name,
    )
    port = settings.main_process_port or default_main_process_port(spec.name)
    job = SlurmJob(
        spec=spec, run_dir=run_dir, state_dir=state_dir, launch_index=index, job_id="",
        token=f"{spec.name}.{uuid.uuid4().hex[:16]}", settings=settings, nodes=nodes, gpus_per_node=gpus,
        num_processes=nodes * max(1, gpus), command=launcher_line(server, nodes, gpus, port, train),
        script_path=posixpath.join(state_dir, JOB_SCRIPT), output_path=posixpath.join(state_dir, OUTPUT_LOG),
        submitted_at=utc_now(),
    )
    server.write_text(job.script_path, job_script(server, job, overrides), mode=0o700)
    result = server.run(["sbatch", "--parsable", job.script_path], timeout_s=120)
    job_id = result.stdout.strip().split(";")[0]
    if not result.ok or not job_id.isdigit():
        raise RunError(f"sbatch refused run {spec.name!r}: {(result.stderr or result.stdout).strip()[-400:]}",
                       path=job.script_path, code="submit_failed")
    job = dataclasses.replace(job, job_id=job_id)
    server.write_text(posixpath.join(state_dir, SLURM_RECORD), json.dumps(job.to_dict(), indent=2) + "\n")
    server.write_text(posixpath.join(state_dir, RECORD_NAME), json.dumps(slurm_record(server, job), indent=2) + "\n")
    return job


def slurm_record(server: GpuServer, job: SlurmJob) -> dict[str, Any]:
    """The reproducibility record of a submitted job (the Slurm counterpart of
    :func:`~dpflow_core.runs.records.reproducibility_record`), written as ``record.json`` beside ``slurm.json``.

    Repository state (``git`` in ``repo_path`` on the submitting machine, which shares the file system
    with the nodes), dataset path, SHA-256 and frequency, the training interpreter's ``pip freeze``
    (run where the job was submitted: the nodes run the same interpreter from the shared file system),
    the ``srun`` command, overrides, the job id and its Slurm settings, the submission time (UTC ISO
    8601). :func:`finalize_slurm_record` adds the job's final state, exit code and end time.
    """
    return {
        **launch_record(server, job.spec, run_dir=job.run_dir, launch_index=job.launch_index, command=job.command,
                        overrides=job.spec.overrides(job.run_dir), started_at=job.submitted_at),
        "scheduler": "slurm",
        "slurm_job_id": job.job_id,
        "slurm": {"job_id": job.job_id, "nodes": job.nodes, "gpus_per_node": job.gpus_per_node,
                  "num_processes": job.num_processes, "settings": dataclasses.asdict(job.settings)},
        "slurm_state": None,
    }


def finalize_slurm_record(server: GpuServer, job: SlurmJob) -> dict[str, Any] | None:
    """Add the job's final ``sacct`` state and exit code (``status:signal``) and the time it was seen
    ended (UTC) to its ``record.json``; return the record (None: a launch submitted before records existed)."""
    path = posixpath.join(job.state_dir, RECORD_NAME)
    if server.size(path) is None:
        return None
    record = json.loads(server.read_text(path))
    if record.get("slurm_state") is None:
        state = job_state(server, job.job_id)
        if state is not None and state.finished:
            record.update(slurm_state=state.state, exit_code=state.exit_code, ended_at=utc_now())
            server.write_text(path, json.dumps(record, indent=2) + "\n")
    return record


def load_job(server: GpuServer, name: str, launch_index: int | None = None) -> SlurmJob:
    """The job record of run ``name`` (its latest launch by default): re-attaching after a dropped connection.

    Raises:
        RunError: ``run_not_found`` when the run was never submitted.
    """
    run_dir = run_dir_for(server, name)
    indices = launch_indices(server, run_dir)
    if not indices:
        raise RunError(f"run {name!r} was never submitted", path=run_dir, code="run_not_found")
    index = indices[-1] if launch_index is None else int(launch_index)
    path = posixpath.join(launch_state_dir(run_dir, index), SLURM_RECORD)
    if server.size(path) is None:
        raise RunError(f"launch {index} of run {name!r} has no Slurm job record", path=path, code="run_not_found")
    return SlurmJob.from_dict(json.loads(server.read_text(path)))


def job_state(server: GpuServer, job_id: str) -> JobState | None:
    """The job's state: ``squeue`` while the controller knows it, else ``sacct`` (None: neither knows it)."""
    job_id = str(int(job_id))
    q = server.run(["squeue", "-h", "-j", job_id, "-o", "%i|%j|%T|%r"], timeout_s=60)
    for line in q.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0] == job_id and parts[2] not in FINAL_STATES and parts[2] != "COMPLETING":
            return JobState(job_id, parts[1], parts[2], reason=parts[3] if parts[3] != "None" else "")
    fields = ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,JobName,State,ExitCode"]
    for args in (fields, fields[:1] + ["--completion"] + fields[1:]):
        result = server.run(args, timeout_s=60)
        for line in result.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 4 and parts[0] == job_id:
                # sacct writes "CANCELLED by 0": the first word is the state
                return JobState(job_id, parts[1], parts[2].split()[0], exit_code=parts[3], source="sacct")
    for line in q.stdout.splitlines():  # COMPLETING: ended, steps still being cleaned up
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0] == job_id:
            return JobState(job_id, parts[1], parts[2])
    return None


def oom_killed_steps(server: GpuServer, job_id: str, output: str = "") -> tuple[str, ...]:
    """The steps of job ``job_id`` that Slurm saw killed for exceeding their memory.

    A job whose training step (``srun``) was OOM-killed ends ``FAILED`` when its batch script goes
    on to exit non-zero: only the step is ``OUT_OF_MEMORY``. The step is found in ``sacct``'s step
    rows (an accounting database) or, without one (``jobcomp/filetxt`` keeps no steps), in
    slurmstepd's "Detected N oom-kill event(s) in StepId=J.S" line of the job's output.

    Returns:
        step ids such as ``"4.1"``, in the order found (empty: none).
    """
    job_id = str(int(job_id))
    steps = [m.group(1) for m in _OOM_EVENT.finditer(output or "") if m.group(1).split(".")[0] == job_id]
    result = server.run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State"], timeout_s=60)
    for line in result.stdout.splitlines() if result.ok else ():
        parts = line.strip().split("|")
        if len(parts) == 2 and "." in parts[0] and parts[1].split()[0] == "OUT_OF_MEMORY":
            steps.append(parts[0])
    return tuple(dict.fromkeys(steps))


def wait_job(
    server: GpuServer,
    job: SlurmJob,
    *,
    timeout_s: float,
    poll_s: float = 0.5,
    on_state: Callable[[JobState | None], None] | None = None,
) -> JobState | None:
    """Poll :func:`job_state` until the job has ended (a final state) or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = job_state(server, job.job_id)
        if on_state is not None:
            on_state(state)
        if (state is not None and state.finished) or time.monotonic() >= deadline:
            return state
        time.sleep(poll_s)


def cancel_job(server: GpuServer, job: SlurmJob) -> bool:
    """``scancel <job id>`` of this run's job only, after ``squeue`` confirms the id still carries the run's name.

    Returns:
        True when scancel was called; False when the job had ended or the id belongs to another name.
    """
    state = job_state(server, job.job_id)
    if state is None or state.finished or state.name != job.name:
        return False
    return server.run(["scancel", "--", str(int(job.job_id))], timeout_s=60).ok
