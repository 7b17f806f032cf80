"""The embedded instance's run handling, for real under ``dagster dev``: a run whose worker dies is
marked failed with the reason and retried once; a run whose asset fails is failed with the asset's
message and never retried. No run is left in STARTED.

``dagster dev`` runs with the project's ``dagster_home/dagster.yaml`` over a small code location
written by the test (an asset that sleeps on its first attempt, one that fails), so the worker's
PID is known: the test kills that process, one it started itself, by its PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import textwrap
import time

import pytest

from browser import REPO, start_dagster_dev, stop_dagster_dev

CODE = '''
import os
import time
from pathlib import Path

import dagster as dg

STATE = Path(os.environ["RUN_TEST_STATE"])


@dg.asset
def slow() -> int:
    """Sleeps on the first attempt (recording the run worker's PID), returns at once on a retry."""
    first = STATE / "first_attempt_pid"
    if not first.exists():
        first.write_text(str(os.getpid()))
        time.sleep(600)
    return 1


@dg.asset
def failing() -> None:
    raise dg.Failure(description="the asset failed on purpose")


defs = dg.Definitions(
    assets=[slow, failing],
    jobs=[dg.define_asset_job("slow_job", "slow"), dg.define_asset_job("failing_job", "failing")],
    executor=dg.in_process_executor,  # the asset runs in the run worker itself
)
'''

RUN_QUERY = """
query($id: ID!) { runOrError(runId: $id) { ... on Run { runId status tags { key value }
  eventConnection { events { __typename ... on MessageEvent { message }
    ... on ExecutionStepFailureEvent { failureMetadata { description } } } } } } }
"""


@pytest.fixture
def dev(tmp_path):
    project = tmp_path / "project"
    (project / "dagster_home").mkdir(parents=True)
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", project / "dagster_home" / "dagster.yaml")
    (project / "run_test_defs.py").write_text(textwrap.dedent(CODE))
    (project / "workspace.yaml").write_text(
        "load_from:\n  - python_file:\n      relative_path: run_test_defs.py\n      working_directory: .\n"
    )
    state = tmp_path / "state"
    state.mkdir()
    server = start_dagster_dev(tmp_path, {"RUN_TEST_STATE": str(state)}, project=project)
    server.state = state
    try:
        yield server
    finally:
        stop_dagster_dev(server)


def _launch(dev, job: str) -> str:
    (location,) = dev.location_status()
    data = dev.graphql(
        """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename
           ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }""",
        {"p": {"selector": {"repositoryLocationName": location, "repositoryName": "__repository__", "jobName": job}}},
    )
    assert data["launchRun"]["__typename"] == "LaunchRunSuccess", data
    return data["launchRun"]["run"]["runId"]


def _run(dev, run_id: str) -> dict:
    run = dev.graphql(RUN_QUERY, {"id": run_id})["runOrError"]
    run["tags"] = {t["key"]: t["value"] for t in run["tags"]}
    events = run["eventConnection"]["events"]
    run["messages"] = [e["message"] for e in events if e.get("message")]
    run["failures"] = [(e.get("failureMetadata") or {}).get("description") for e in events
                       if e["__typename"] == "ExecutionStepFailureEvent"]
    return run


def _wait(what: str, predicate, dev, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n{dev.log_tail()}")


def _failed_and_retry_decided(dev, run_id: str) -> dict | None:
    """The run once it shows FAILURE and carries ``dagster/will_retry``, else ``None``."""
    run = _run(dev, run_id)
    return run if run["status"] == "FAILURE" and "dagster/will_retry" in run["tags"] else None


@pytest.mark.slow
def test_a_dead_run_worker_fails_the_run_with_the_reason_and_it_is_retried_once(dev):
    run_id = _launch(dev, "slow_job")
    pid_file = dev.state / "first_attempt_pid"
    pid = int(_wait("the run worker to start the asset", lambda: pid_file.exists() and pid_file.read_text(), dev))
    assert _run(dev, run_id)["status"] == "STARTED"
    os.kill(pid, signal.SIGKILL)  # the run worker that this test's dagster dev started

    # The daemon marks the run FAILURE before it decides on the retry and sets the tag:
    # wait (bounded) for both, not for the status alone.
    failed = _wait("the run to be marked failed and its retry decided", lambda: _failed_and_retry_decided(dev, run_id), dev)
    assert any(f"Run execution process for {run_id} was terminated by signal 9 (SIGKILL)" in m for m in failed["messages"])
    assert failed["tags"]["dagster/will_retry"] == "true"

    def retry():
        children = [r for r in dev.runs() if r["tags"].get("dagster/parent_run_id") == run_id]
        return children and children[0]["status"] in ("SUCCESS", "FAILURE", "CANCELED") and children[0]

    child = _wait("the retry to finish", retry, dev)
    assert child["status"] == "SUCCESS" and child["tags"]["dagster/retry_number"] == "1"

    # an asset's own failure is a verdict, not a crash: its message is kept and nothing retries it
    failing_id = _launch(dev, "failing_job")
    failing = _wait("the failing run and its retry decision", lambda: _failed_and_retry_decided(dev, failing_id), dev)
    assert failing["failures"] == ["the asset failed on purpose"]
    assert failing["tags"]["dagster/will_retry"] == "false"
    assert not [r for r in dev.runs() if r["status"] in ("STARTED", "STARTING", "QUEUED")]
