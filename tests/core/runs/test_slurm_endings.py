"""Slurm ending dpflow's jobs the ways a real cluster does: time limit, pre-emption, memory.

A private cluster (:func:`slurm_cluster.slurm_limits_cluster`: memory enforced by task/cgroup, a
higher-priority partition that pre-empts) runs real dpflow training jobs submitted with
:func:`~dpflow_core.runs.slurm.submit_run`; Slurm itself ends each one:

* TIMEOUT: the job's time limit lowered below its run time with ``scontrol update`` (an
  administrator's change; slurmctld tests time limits every 30 s, so this takes 30 s at most,
  not a wall-clock minute of limit);
* PREEMPTED: a job in the ``urgent`` partition asks for the node exclusively;
* OUT_OF_MEMORY: the job asks for less memory (``--mem``) than the trainer needs to import torch;
  the kernel's cgroup OOM killer ends it and Slurm records the OOM event.

Ground truth is Slurm's own record (``sacct -c``); dpflow must name the state, give the OOM
advice for the memory case, and never call any of them a natural exit.
"""

from __future__ import annotations

import sys
import time

from slurm_cluster import URGENT, slurm_limits_cluster  # noqa: F401  (the fixture)
from test_slurm import _sacct, _server, _train_spec, dataset, repo  # noqa: F401  (fixtures)

from dpflow_core.runs.slurm import job_state, submit_run, wait_job
from dpflow_core.runs.slurm_checks import check_slurm_exit, check_slurm_released


def _long(name, dataset):
    return _train_spec(name, dataset, epochs=1000, max_train_steps=1000)


def _wait_training(cluster, job, timeout_s: float = 60.0) -> None:
    """Until the job's training step (the batch script's second ``srun``, after the dataset check) runs."""
    deadline = time.monotonic() + timeout_s
    while f"{job.job_id}.1" not in cluster.run("squeue", "-h", "--steps", "-j", job.job_id, "-o", "%i").stdout.split():
        assert time.monotonic() < deadline, cluster.run("squeue", "-h", "--steps", "-j", job.job_id).stdout
        time.sleep(0.2)


def _ended(server, job, state: str, timeout_s: float = 60.0):
    final = wait_job(server, job, timeout_s=timeout_s, poll_s=0.3)
    output = server.read_text(job.output_path) if server.exists(job.output_path) else "(no output)"
    assert final is not None and final.state == state, f"{final}: {output[-3000:]}"
    return final


def test_a_job_past_its_time_limit_is_reported_as_timed_out(slurm_limits_cluster, tmp_path, repo, dataset):
    with _server(tmp_path, repo, time_limit="30") as server:
        job = submit_run(server, _long("slurm-timeout", dataset))
        _wait_training(slurm_limits_cluster, job)
        # the administrator lowers the limit below the time the job has run: it is over its limit now
        slurm_limits_cluster.run("scontrol", "update", f"JobId={job.job_id}", "TimeLimit=0")
        _ended(server, job, "TIMEOUT", timeout_s=75)  # slurmctld's time-limit pass runs every 30 s
        assert _sacct(slurm_limits_cluster, job.job_id, "JobName,State") == "slurm-timeout|TIMEOUT"
        report = check_slurm_exit(server, job)
        assert not report.passed and report.state.state == "TIMEOUT"
        assert report.problems[0].startswith(f"job {job.job_id} TIMEOUT: timed out (reached its time limit: "
                                             "raise slurm.time_limit, or resume from latest.ckpt)")
        assert report.oom_advice == ()
        assert check_slurm_released(server, job).passed


def test_a_preempted_job_is_reported_as_preempted(slurm_limits_cluster, tmp_path, repo, dataset):
    with _server(tmp_path, repo) as server:
        job = submit_run(server, _long("slurm-preempted", dataset))
        _wait_training(slurm_limits_cluster, job)
        node = slurm_limits_cluster.run("squeue", "-h", "-j", job.job_id, "-o", "%N").stdout.strip()
        urgent = slurm_limits_cluster.run("sbatch", "--parsable", "-p", URGENT, "--exclusive", f"--nodelist={node}",
                                          "--job-name=urgent", "-o", "/dev/null", "--wrap", "sleep 1").stdout.strip()
        try:
            _ended(server, job, "PREEMPTED")
            assert _sacct(slurm_limits_cluster, job.job_id, "JobName,State") == "slurm-preempted|PREEMPTED"
            report = check_slurm_exit(server, job)
            assert not report.passed
            assert report.problems[0].startswith(f"job {job.job_id} PREEMPTED: pre-empted by a job of higher priority "
                                                 "(resume from latest.ckpt)")
            assert report.oom_advice == ()
            assert check_slurm_released(server, job).passed
            deadline = time.monotonic() + 60  # the urgent job got the node dpflow's job held
            while (state := job_state(server, urgent)) is None or not state.finished:
                assert time.monotonic() < deadline, state
                time.sleep(0.3)
            assert _sacct(slurm_limits_cluster, urgent, "State,ExitCode,NodeList") == f"COMPLETED|0:0|{node}"
        finally:
            slurm_limits_cluster.run("scancel", urgent, check=False)  # the test's own job, by its id


def test_a_job_killed_for_memory_is_reported_out_of_memory_with_advice(slurm_limits_cluster, tmp_path, repo, dataset):
    with _server(tmp_path, repo, extra_sbatch=("--mem=120M",)) as server:
        job = submit_run(server, _train_spec("slurm-oom", dataset))
        # the training step is OOM-killed; the batch script then exits 1, so Slurm's job record is FAILED
        _ended(server, job, "FAILED")
        assert _sacct(slurm_limits_cluster, job.job_id, "JobName,State,ExitCode") == "slurm-oom|FAILED|1:0"
        report = check_slurm_exit(server, job)
        assert not report.passed and report.oom_steps == (f"{job.job_id}.1",)
        assert (f"step {job.job_id}.1 was killed for exceeding its memory (Slurm's OUT_OF_MEMORY: the cgroup OOM killer)"
                in report.problems), report.problems
        advice = report.oom_advice
        assert advice[0] == "Slurm ended the job for exceeding its memory: ask for more (extra_sbatch --mem=...), or"
        assert any("dataloader.batch_size=2 (now 4)" in step for step in advice), advice  # the spec's batch of 4, halved
        assert check_slurm_released(server, job).passed

        # a job whose batch step itself is OOM-killed: the job's own state is OUT_OF_MEMORY
        hog = slurm_limits_cluster.run("sbatch", "--parsable", "-p", "debug", "--mem=50M", "-o", "/dev/null", "--wrap",
                                       f"{sys.executable} -c 'bytearray(400 * 2 ** 20)'").stdout.strip()
        deadline = time.monotonic() + 60
        while (state := job_state(server, hog)) is None or not state.finished:
            assert time.monotonic() < deadline, state
            time.sleep(0.3)
        assert _sacct(slurm_limits_cluster, hog, "State") == "OUT_OF_MEMORY"
        assert state.describe().startswith(f"job {hog} OUT_OF_MEMORY: killed for exceeding its memory (Slurm's OUT_OF_MEMORY)")
