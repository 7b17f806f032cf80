"""Checks of a Slurm run: natural exit, release, the smoke run and preflight on the cluster.

Takes a server configured with ``scheduler: slurm`` and a :class:`~dpflow_core.runs.slurm.SlurmJob`
(or, for preflight, the dataset's path and SHA-256); gives the reports. Natural exit is ``sacct``
state ``COMPLETED`` with exit code ``0:0`` plus the trainer's own evidence; release is the job gone
from ``squeue`` with no step left and no process of the run on the submitting machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from dpflow_core.errors import RunError
from dpflow_core.logs import is_finite_number
from dpflow_core.server import GpuServer
from dpflow_core.runs.monitor import last_error_line, read_log_records, read_output_tail
from dpflow_core.runs.natural_exit import NaturalExitReport, config_value, judge_completion, read_run_config
from dpflow_core.runs.oom import oom_advice
from dpflow_core.runs.processes import token_pids
from dpflow_core.runs.slurm import (
    DATASET_MISMATCH_EXIT, JobState, SlurmJob, slurm_settings, cancel_job, job_state, oom_killed_steps, submit_run, wait_job,
)
from dpflow_core.runs.smoke import list_checkpoints
from dpflow_core.runs.spec import RunSpec


@dataclass(frozen=True)
class SlurmExitReport:
    """Natural exit of a Slurm run: ``sacct`` COMPLETED and 0:0, plus the trainer's evidence.

    Attributes:
        passed: both hold.
        state: the job's final (or current) state.
        trainer: the trainer-side report (epochs, global_step, latest.ckpt).
        problems: every failed condition; a pre-empted, timed-out, cancelled or out-of-memory job
            is named as such, and so is a job that failed because a step of it was OOM-killed.
        oom_advice: steps to try when the job ran out of memory (Slurm's OUT_OF_MEMORY, of the job or
            of a step, or CUDA's).
        oom_steps: the steps Slurm saw killed for memory (:func:`~dpflow_core.runs.slurm.oom_killed_steps`).
    """

    passed: bool
    state: JobState | None
    trainer: NaturalExitReport
    problems: tuple[str, ...]
    oom_advice: tuple[str, ...] = ()
    oom_steps: tuple[str, ...] = ()

    def metadata(self) -> dict[str, Any]:
        return {"job": self.state.describe() if self.state else "unknown to squeue and sacct",
                **self.trainer.metadata(), "problems": "; ".join(self.problems),
                **({"oom_killed_steps": ", ".join(self.oom_steps)} if self.oom_steps else {})}


def check_slurm_exit(server: GpuServer, job: SlurmJob) -> SlurmExitReport:
    """Judge a Slurm run's completion (rule 10 on a cluster)."""
    state = job_state(server, job.job_id)
    output = read_output_tail(server, job.output_path) if server.size(job.output_path) is not None else ""
    running = state is not None and not state.finished
    exit_problems: list[str] = []
    status: int | None = None
    oom_steps: tuple[str, ...] = ()
    if state is None:
        exit_problems.append(f"job {job.job_id} is known to neither squeue nor sacct")
    elif running:
        exit_problems.append(f"the job is still {state.state.lower()}")
    else:
        status = int(state.exit_code.split(":")[0]) if state.exit_code and state.exit_code.split(":")[0].isdigit() else None
        if state.state != "COMPLETED" or state.exit_code != "0:0":
            exit_problems.append(f"{state.describe()}: {last_error_line(output)}")
            if status == DATASET_MISMATCH_EXIT and "dataset SHA-256" in output:
                exit_problems.append("the dataset's SHA-256 did not match on a node: nothing was trained")
            oom_steps = oom_killed_steps(server, job.job_id, output)
            if oom_steps and state.state != "OUT_OF_MEMORY":
                exit_problems.append(f"step {', '.join(oom_steps)} was killed for exceeding its memory "
                                     "(Slurm's OUT_OF_MEMORY: the cgroup OOM killer)")
    trainer = judge_completion(server, job, exit_code=status, running=running, output=output, problems=[])
    problems = tuple(exit_problems) + trainer.problems
    advice = trainer.oom_advice
    if state is not None and (state.state == "OUT_OF_MEMORY" or oom_steps) and not advice:
        cfg = read_run_config(server, job.run_dir)
        advice = ("Slurm ended the job for exceeding its memory: ask for more (extra_sbatch --mem=...), or",
                  *oom_advice(job, batch_size=config_value(cfg, "dataloader.batch_size"),
                              val_batch_size=config_value(cfg, "val_dataloader.batch_size"),
                              gradient_accumulate_every=config_value(cfg, "training.gradient_accumulate_every")))
    return SlurmExitReport(passed=not problems, state=state, trainer=trainer, problems=problems, oom_advice=tuple(advice),
                           oom_steps=oom_steps)


@dataclass(frozen=True)
class SlurmRelease:
    """Release of a Slurm run: the job gone from the queue, no step left, no process of the run here.

    Attributes:
        passed: all three hold.
        message: what was seen.
        steps: job steps still listed by ``squeue --steps``.
        leftover_pids: processes with the run's token on the submitting machine.
    """

    passed: bool
    message: str
    steps: tuple[str, ...] = ()
    leftover_pids: tuple[int, ...] = ()


def check_slurm_released(server: GpuServer, job: SlurmJob, *, wait_s: float = 30.0, poll_s: float = 0.5) -> SlurmRelease:
    """Wait up to ``wait_s`` for the job to leave the queue with no step left, then report (rule 7)."""
    deadline = time.monotonic() + wait_s
    while True:
        queued = [ln for ln in server.run(["squeue", "-h", "-j", job.job_id, "-o", "%i %T"]).stdout.splitlines() if ln.strip()]
        steps = tuple(ln.strip() for ln in server.run(["squeue", "-h", "--steps", "-j", job.job_id, "-o", "%i %j"]).stdout.splitlines()
                      if ln.strip())
        pids = tuple(sorted(token_pids(server, job.token)))
        if (not queued and not steps and not pids) or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    parts = []
    parts.append(f"job {job.job_id} still queued: {'; '.join(queued)}" if queued else f"job {job.job_id} has left the queue")
    parts.append(f"steps left: {'; '.join(steps)}" if steps else "no step left")
    parts.append(f"processes of the run left here: {list(pids)}" if pids else "no process of the run left here")
    return SlurmRelease(passed=not queued and not steps and not pids, message="; ".join(parts), steps=steps, leftover_pids=pids)


@dataclass(frozen=True)
class SlurmSmokeResult:
    """A smoke run on the cluster: exit, finite losses, no checkpoints, release."""

    job: SlurmJob
    passed: bool
    state: JobState | None
    finite_losses: int
    checkpoints: tuple[str, ...]
    problems: tuple[str, ...]
    release: SlurmRelease
    seconds: float


def run_slurm_smoke(server: GpuServer, spec: RunSpec, *, timeout_s: float = 900.0) -> SlurmSmokeResult:
    """Submit a smoke run, wait for it (cancelled by job id after ``timeout_s``), and judge it (rules 6, 7)."""
    if spec.kind != "smoke":
        raise RunError(f"run_slurm_smoke needs a smoke spec, got kind {spec.kind!r}", code="bad_config")
    started = time.monotonic()
    job = submit_run(server, spec)
    state = wait_job(server, job, timeout_s=timeout_s)
    problems = []
    if state is None or not state.finished:
        cancel_job(server, job)
        problems.append(f"did not finish within {timeout_s:.0f} s (job {job.job_id} cancelled)")
        state = wait_job(server, job, timeout_s=60)
    elif state.state != "COMPLETED" or state.exit_code != "0:0":
        problems.append(f"{state.describe()}: {last_error_line(read_output_tail(server, job.output_path))}")
    records = read_log_records(server, job.log_path)
    finite = sum(1 for r in records if not r.get("epoch_summary") and is_finite_number(r.get("train_loss")))
    if finite == 0:
        problems.append(f"no finite train_loss in {job.log_path}")
    ckpts = tuple(list_checkpoints(server, job.run_dir))
    if ckpts:
        problems.append(f"checkpoints were written although disabled: {', '.join(ckpts)}")
    release = check_slurm_released(server, job)
    return SlurmSmokeResult(job=job, passed=not problems, state=state, finite_losses=finite, checkpoints=ckpts,
                            problems=tuple(problems), release=release, seconds=time.monotonic() - started)


@dataclass(frozen=True)
class SlurmPreflight:
    """Preflight on a Slurm cluster.

    Attributes:
        passed: every check passed.
        checks: (name, passed, detail) of: the partition exists and is up; the GPUs asked for
            exist on its nodes (``sinfo`` GRES); the dataset present and its SHA-256 right as a
            compute node reads it (``srun ... sha256sum``).
    """

    passed: bool
    checks: tuple[tuple[str, bool, str], ...]


def slurm_preflight(server: GpuServer, dataset_path: str, dataset_sha256: str, *, timeout_s: float = 300.0) -> SlurmPreflight:
    """Check the partition (``sinfo``), its GPUs, and the dataset from a compute node's view."""
    settings = slurm_settings(server)
    checks: list[tuple[str, bool, str]] = []
    part = ["-p", settings.partition] if settings.partition else []
    info = server.run(["sinfo", "-h", *part, "-o", "%P|%a|%D|%G|%t"], timeout_s=60)
    rows = [ln.split("|") for ln in info.stdout.splitlines() if ln.count("|") == 4]
    label = settings.partition or "default partition"
    if not info.ok or not rows:
        checks.append(("partition", False, f"{label}: not found ({(info.stderr or info.stdout).strip()[-200:] or 'sinfo lists none'})"))
    else:
        up = [r for r in rows if r[1] == "up"]
        nodes = sum(int(r[2]) for r in up if r[2].isdigit() and r[4].rstrip("*~#") not in ("down", "drain", "fail"))
        ok = bool(up) and nodes >= settings.nodes
        checks.append(("partition", ok, f"{rows[0][0]}: {'up' if up else rows[0][1]}, {nodes} usable node(s), "
                                        f"{settings.nodes} asked"))
        if settings.gpus_per_node:
            most = 0
            for r in rows:
                for gres in r[3].split(","):
                    bits = gres.split("(")[0].split(":")
                    if bits[0] == "gpu" and bits[-1].isdigit():
                        most = max(most, int(bits[-1]))
            checks.append(("gpus", most >= settings.gpus_per_node,
                           f"at most {most} GPU(s) per node in {label} (sinfo GRES {sorted({r[3] for r in rows})}), "
                           f"{settings.gpus_per_node} asked"))
        else:
            checks.append(("gpus", True, "no GPU asked (CPU nodes)"))
    path = server.abspath(dataset_path)
    srun = ["srun", "-N1", "-n1", "--job-name=dpflow-preflight", *part, "sha256sum", "--", path]
    result = server.run(srun, timeout_s=timeout_s)
    seen = result.stdout.split()[0] if result.ok and result.stdout.split() else ""
    checks.append(("dataset", seen == dataset_sha256,
                   f"{path} on a compute node: " + (f"SHA-256 {seen}" + ("" if seen == dataset_sha256 else f" != {dataset_sha256}")
                                                    if seen else (result.stderr or result.stdout).strip()[-300:])))
    return SlurmPreflight(passed=all(c[1] for c in checks), checks=tuple(checks))
