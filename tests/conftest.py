"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

#: How to install each service a test may need (Debian 12), named in the skip or failure reason.
INSTALL = {
    "sshd": "apt-get install -y openssh-server",
    "postgresql": "apt-get install -y postgresql",
    "chromium": "apt-get install -y chromium && pip install -e '.[dev]' (playwright)",
    "docker compose": "apt-get install -y docker-compose",
    "tmux": "apt-get install -y tmux",
    "rsync": "apt-get install -y rsync",
    "slurm": "apt-get install -y slurm-wlm munge (the tests start their own cluster as root)",
    "netns": "apt-get install -y iproute2, and run the tests as root",
    "lerobot 0.4.4": "scripts/setup-lerobot.sh (makes .venv-lerobot-0.4)",
    "lerobot 0.3.3": "scripts/setup-lerobot.sh (makes .venv-lerobot-0.3)",
}


def require_service(service: str, missing: str | None) -> None:
    """Stop a test that needs ``service`` when ``missing`` (why it cannot run) is not ``None``.

    Locally the test is skipped, with the install line in the reason. When the ``CI``
    environment variable is set (to anything but ``""``, ``0`` or ``false``) it fails instead:
    a CI run must not pass by skipping what it was meant to test.
    """
    if missing is None:
        return
    reason = f"{service} is not available: {missing} (install: {INSTALL[service]})"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI is set, so a missing service fails the test instead of skipping it: {reason}", pytrace=False)
    pytest.skip(reason)


def missing_executable(name: str) -> str | None:
    """``None`` when ``name`` is on ``PATH``, else why not."""
    return None if shutil.which(name) else f"`{name}` is not on PATH"


@pytest.fixture(autouse=True)
def _venv_on_path(monkeypatch):
    """Subprocesses (dpflow, accelerate, dagster) resolve to this venv's scripts."""
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
