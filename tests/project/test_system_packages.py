"""scripts/system-packages.sh: the Debian packages of the test services, installed only when missing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conftest import INSTALL, REPO

SCRIPT = REPO / "scripts" / "system-packages.sh"


def _run(*entries: str, as_nobody: bool = False) -> subprocess.CompletedProcess:
    head = ["bash", str(SCRIPT)]
    if as_nobody and os.getuid() == 0:
        head = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *head]
    return subprocess.run([*head, *entries], capture_output=True, text=True, timeout=60, cwd="/")


def test_the_list_holds_every_package_the_tests_name():
    listed = set(re.findall(r'^  "([a-z0-9.+-]+)\|', SCRIPT.read_text(), re.M))
    named = {p for line in INSTALL.values() for p in re.findall(r"apt-get install -y ([a-z0-9.+-]+)", line)}
    assert named and named <= listed, named - listed
    assert (REPO / "scripts" / "test.sh").read_text().count("scripts/system-packages.sh") == 1
    assert "scripts/system-packages.sh" in (REPO / ".ci" / "run").read_text()


def test_present_packages_are_skipped_without_a_word():
    proc = _run("tmux|command -v tmux", "coreutils|test -x /bin/ls")
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr


@pytest.mark.skipif(os.getuid() == 0 and not shutil.which("setpriv"), reason="needs setpriv to drop root")
def test_without_root_it_names_what_is_missing_and_how_to_install_it():
    proc = _run("tmux|command -v tmux", "dpflow-absent-a|false", "dpflow-absent-b|test -x /nonexistent", as_nobody=True)
    assert proc.returncode == 0, proc.stderr
    assert "missing dpflow-absent-a dpflow-absent-b; not root, so not installed." in proc.stderr
    assert "install them with: sudo apt-get install -y dpflow-absent-a dpflow-absent-b" in proc.stderr
    assert "installing" not in proc.stderr
