"""A test that needs a service fails under CI when the service is missing, and skips locally.

Runs a real sshd-needing test of this suite in a child pytest with ``PATH`` stripped of every
folder holding ``sshd`` (and no ``DPFLOW_TEST_SSHD`` override), once with ``CI=true`` and once
without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, require_service

SSH_TEST = "tests/core/server/test_remote.py::test_unknown_host_key_is_refused"


def _run_without_sshd(ci: str | None) -> subprocess.CompletedProcess:
    path = [d for d in os.environ["PATH"].split(os.pathsep) if d and not os.path.exists(os.path.join(d, "sshd"))]
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "DPFLOW_TEST_SSHD", "PYTEST_ADDOPTS")}
    env["PATH"] = os.pathsep.join(path)
    if ci is not None:
        env["CI"] = ci
    assert shutil.which("sshd", path=env["PATH"]) is None
    return subprocess.run(
        [sys.executable, "-m", "pytest", SSH_TEST, "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )


def test_missing_sshd_fails_under_ci():
    proc = _run_without_sshd("true")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 error" in out and "skipped" not in out
    assert "CI is set, so a missing service fails the test instead of skipping it" in out
    assert "apt-get install -y openssh-server" in out


def test_missing_sshd_skips_locally_with_the_install_line():
    proc = _run_without_sshd(None)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 skipped" in out and "apt-get install -y openssh-server" in out


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("1", pytest.fail.Exception),
                                         ("", pytest.skip.Exception), ("false", pytest.skip.Exception)])
def test_require_service_follows_the_ci_variable(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match=r"tmux is not available: gone \(install: apt-get install -y tmux\)"):
        require_service("tmux", "gone")
    require_service("tmux", None)  # present: nothing happens
