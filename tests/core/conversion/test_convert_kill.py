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

REPO = Path(__file__).resolve().parents[3]


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
    write_small_task(base, episodes=8, seed=9)
    path = base / "manifest.json"
    write_manifest(pair_recordings(base / "pick_place"), path)
    return path


#: When to kill, as a condition on the output folder: the work folder exists (workers
#: starting), two episodes are aligned (workers busy), the npz is being written.
MOMENTS = {
    "started": lambda d: list(d.glob(".dataset.npz.work-*")),
    "aligning": lambda d: len(list(d.glob(".dataset.npz.work-*/*/robot0_eef_pos.npy"))) >= 2,
    "writing": lambda d: list(d.glob(".dataset.npz.partial-*")),
}


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_sigkill_leaves_no_process_and_the_next_run_cleans_up(manifest, tmp_path, moment):
    out = tmp_path / "dataset.npz"
    cmd = [sys.executable, "-c", "from dpflow_core.cli import main; main()", "convert", str(manifest), "-o", str(out),
           "--image-size", "160,120", "-j", "2", "--no-cache"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not (seen and MOMENTS[moment](tmp_path)):
        seen |= _children(proc.pid)
        time.sleep(0.005)
    seen |= _children(proc.pid)
    assert proc.poll() is None, f"the conversion ended before the moment {moment!r}"
    work = list(tmp_path.glob(".dataset.npz.work-*"))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert seen, "no child process was seen"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in seen):
        time.sleep(0.05)
    assert not [p for p in seen if _running(p)], f"processes of the killed conversion still run: {sorted(seen)}"
    assert work and work[0].exists() and not out.exists()

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"removed stale {work[0].name}" in again.stdout
    assert not work[0].exists() and out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
