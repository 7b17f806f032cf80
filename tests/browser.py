"""`dagster dev` on a loopback port and Debian's Chromium driven by Playwright, for UI tests.

``dagster dev`` runs with a temporary ``DAGSTER_HOME`` (a copy of
``dagster_home/dagster.yaml``, so the embedded SQLite instance) and the
``DPFLOW_RECORDINGS_ROOT`` / ``DPFLOW_WORKDIR`` given by the test. It is started
as ``env --default-signal=INT,TERM dagster dev ...``: a process started in the
background inherits ignored interrupts, and Dagster maps TERM to its interrupt
handler, so without resetting them it would ignore TERM. It is stopped by its
PID (TERM, then a wait; KILL to its own process group only if TERM failed).

The browser is the system's ``chromium`` (``.ci/run`` installs Debian's package);
Playwright only drives it and never downloads a browser.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require_service

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("DPFLOW_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-quic",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DagsterDev:
    """A running ``dagster dev``.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        home: its ``DAGSTER_HOME``.
        pid: the ``dagster dev`` process (leader of its own process group).
        log: file receiving its stdout and stderr.
    """

    url: str
    home: Path
    pid: int
    log: Path
    proc: subprocess.Popen

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the server log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def graphql(self, query: str, variables: dict | None = None, timeout: float = 30) -> dict:
        """POST a GraphQL query to the webserver; returns ``data`` (raises on errors)."""
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = json.loads(resp.read())
        if payload.get("errors"):
            raise RuntimeError(f"GraphQL errors: {payload['errors']}")
        return payload["data"]

    def location_status(self) -> dict[str, str]:
        """Code location name -> load status (``LOADING`` / ``LOADED``) or the load error."""
        data = self.graphql(
            "{ workspaceOrError { __typename ... on Workspace { locationEntries { name loadStatus "
            "locationOrLoadError { __typename ... on PythonError { message } } } } } }"
        )
        out = {}
        for entry in data["workspaceOrError"].get("locationEntries", []):
            err = entry["locationOrLoadError"]
            out[entry["name"]] = err["message"] if err and err["__typename"] == "PythonError" else entry["loadStatus"]
        return out

    def runs(self) -> list[dict]:
        """Runs of the instance, newest first: ``runId``, ``status``, ``assetSelection``, ``tags`` (a dict)."""
        data = self.graphql(
            "{ runsOrError { __typename ... on Runs { results { runId status jobName "
            "assetSelection { path } tags { key value } } } } }"
        )
        runs = data["runsOrError"]["results"]
        for run in runs:
            run["tags"] = {t["key"]: t["value"] for t in run["tags"]}
        return runs


def start_dagster_dev(
    tmp_dir: Path, env: dict[str, str] | None = None, timeout: float = 180, project: Path = REPO
) -> DagsterDev:
    """Start ``dagster dev -w workspace.yaml`` on a free loopback port and wait until it answers.

    Args:
        tmp_dir: folder for ``dagster_home/`` and the log.
        env: extra environment (e.g. ``DPFLOW_RECORDINGS_ROOT``, ``DPFLOW_WORKDIR``).
        timeout: seconds to wait for ``/server_info`` and the code location to load.
        project: the folder holding ``workspace.yaml`` (the repository by default).

    Raises:
        RuntimeError: the process exited, or did not answer / load in time (with the log tail).
    """
    home = tmp_dir / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(project / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    port = free_port()
    log = tmp_dir / "dagster_dev.log"
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["DAGSTER_HOME"] = str(home)
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    cmd = ["env", "--default-signal=INT,TERM", "dagster", "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=project, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    dev = DagsterDev(url=f"http://127.0.0.1:{port}", home=home, pid=proc.pid, log=log, proc=proc)
    try:
        _wait_until_ready(dev, timeout)
    except BaseException:
        stop_dagster_dev(dev)
        raise
    return dev


def _wait_until_ready(dev: DagsterDev, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    answered = False
    last = ""
    while time.monotonic() < deadline:
        if dev.proc.poll() is not None:
            raise RuntimeError(f"dagster dev exited with {dev.proc.returncode}:\n{dev.log_tail()}")
        try:
            if not answered:
                with urllib.request.urlopen(f"{dev.url}/server_info", timeout=5) as resp:
                    answered = resp.status == 200
            if answered:
                status = dev.location_status()
                last = str(status)
                if status and all(v == "LOADED" for v in status.values()):
                    return
                if any(v not in ("LOADED", "LOADING") for v in status.values()):
                    raise RuntimeError(f"code location failed to load: {status}\n{dev.log_tail()}")
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"dagster dev not ready after {timeout:.0f} s (last status {last}):\n{dev.log_tail()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_dagster_dev(dev: DagsterDev, timeout: float = 30) -> int | None:
    """TERM the ``dagster dev`` PID and wait; KILL its process group only if TERM did not work.

    Returns the exit status (``None`` if it had to be killed).
    """
    if dev.proc.poll() is None:
        dev.proc.send_signal(signal.SIGTERM)
        try:
            return dev.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # the group was created for this process (start_new_session), so it holds only its children
        os.killpg(dev.pid, signal.SIGKILL)
        dev.proc.wait(10)
        return None
    return dev.proc.returncode


def chromium_missing_reason() -> str | None:
    """Why the browser cannot run here, or ``None`` when it can."""
    if not Path(CHROMIUM).is_file():
        return f"{CHROMIUM} not found (.ci/run installs Debian's chromium package)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install -e '.[dev]')"
    return None


@pytest.fixture
def chromium_page(tmp_path):
    """A Playwright page in headless Debian Chromium (1400 x 900), closed after the test."""
    reason = chromium_missing_reason()
    if reason:
        require_service("chromium", reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            page = context.new_page()
            page.set_default_timeout(60_000)
            yield page
            context.close()
        finally:
            browser.close()
