"""`kill -9` of `dpflow convert`: no process of it survives, and the next run removes its work folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpflow_core.pairing import pair_recordings, write_manifest
from recording_fixtures import write_small_task

REPO = Path(__file__).resolve().parents[1]


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` now (from /proc/<pid>/task/*/children)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo.extend(kids - out)
            out |= kids
    return out


def _running(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie (a dead child not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    base = tmp_path_factory.mktemp("kill")
    write_small_task(base, episodes=6, seed=9)
    path = base / "manifest.json"
    write_manifest(pair_recordings(base / "pick_place"), path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.4, 1.2])
def test_sigkill_leaves_no_process_and_the_next_run_cleans_up(manifest, tmp_path, delay_s):
    out = tmp_path / "dataset.npz"
    cmd = [sys.executable, "-c", "from dpflow_core.cli import main; main()", "convert", str(manifest), "-o", str(out),
           "--image-size", "32,24", "-j", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work = None
    seen: set[int] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        seen |= _children(proc.pid)
        found = list(tmp_path.glob(".dataset.npz.work-*"))
        if found and len(seen) >= 3:  # forkserver (or resource tracker) and workers are up
            work = found[0]
            break
        time.sleep(0.02)
    assert work is not None and proc.poll() is None, "the conversion ended before it could be killed"
    stop = time.monotonic() + delay_s
    while time.monotonic() < stop:
        seen |= _children(proc.pid)
        time.sleep(0.02)
    seen |= _children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in seen):
        time.sleep(0.05)
    assert not [p for p in seen if _running(p)], f"processes of the killed conversion still run: {sorted(seen)}"
    assert work.exists() and not out.exists()

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"removed stale {work.name}" in again.stdout
    assert not work.exists() and out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
