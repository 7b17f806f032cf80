"""Temporaries from a killed run (issue 28): one naming scheme that records the owner's PID and start time,
one cleaner that every writer calls on its folder, and `dpflow clean`. A live run's file is never removed,
a dead PID's is, and so is a PID reused by another process (its start time differs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from dpflow_core.cli import app
from dpflow_core.files import (atomic_output, parse_temp_name, process_start_time, remove_stale_temporaries,
                               stale_temporaries, temp_name)
from dpflow_core.pairing import Manifest, write_manifest


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _start_ticks_from_psutil(pid: int) -> float:
    """The start time psutil reports (seconds since the epoch) as clock ticks after boot: an independent reading."""
    import psutil

    return (psutil.Process(pid).create_time() - psutil.boot_time()) * os.sysconf("SC_CLK_TCK")


def test_names_record_pid_and_start_time(tmp_path):
    me, start = os.getpid(), process_start_time(os.getpid())
    assert abs(start - _start_ticks_from_psutil(me)) <= 2 and start > 0
    with atomic_output(tmp_path / "out.json", "w") as fh:
        t = parse_temp_name(fh.name)
        assert (t.target, t.kind, t.pid, t.start_time) == ("out.json", "tmp", me, start) and t.owner_running
    assert temp_name("dataset.npz", "partial", unique=False) == f".dataset.npz.partial-{me}-s{start}"
    assert parse_temp_name(tmp_path / ".dataset.npz.partial-12x") is None  # not a PID suffix
    assert parse_temp_name(tmp_path / "dataset.npz.tmp-12") is None  # not hidden: not ours


def test_stale_removed_live_kept_reused_pid_removed(tmp_path):
    me, start = os.getpid(), process_start_time(os.getpid())
    dead = _dead_pid()
    stale = tmp_path / f".dataset.npz.partial-{dead}-s{start}"
    stale.write_bytes(b"PK\x03\x04 half a zip")
    stale_work = tmp_path / f".dataset.npz.work-{dead}"  # the older form, no start time
    (stale_work / "000000").mkdir(parents=True)
    live = tmp_path / temp_name("report.html")
    live.write_text("being written")
    live_old_form = tmp_path / f".x.npz.partial-{me}"  # no start time recorded: a live PID keeps it
    live_old_form.write_bytes(b"")
    reused = tmp_path / f".manifest.json.tmp-{me}-s{start - 1}-0a1b2c3d"  # this PID, another process's start
    reused.write_text("{")
    nested = tmp_path / "datasets" / "pick" / f".dataset.json.tmp-{dead}-s1-00ff00ff"
    nested.parent.mkdir(parents=True)
    nested.write_text("{")
    plain = tmp_path / "dataset.npz"
    plain.write_bytes(b"kept")

    assert {t.path for t in stale_temporaries(tmp_path)} == {stale, stale_work, reused}
    removed = remove_stale_temporaries(tmp_path, recursive=True)
    assert sorted(t.path for t in removed) == sorted([stale, stale_work, reused, nested])
    assert not any(p.exists() for p in (stale, stale_work, reused, nested))
    assert live.exists() and live_old_form.exists() and plain.exists()


def test_a_later_write_in_the_folder_cleans_it(tmp_path):
    left = tmp_path / f".manifest.json.tmp-{_dead_pid()}-s7-12345678"
    left.write_text('{"half')
    manifest = Manifest(root=tmp_path, task="pick", created_at="2026-01-01T00:00:00+00:00", topics={},
                        accepted=[], rejected=[])
    write_manifest(manifest, tmp_path / "other.json")
    assert not left.exists() and json.loads((tmp_path / "other.json").read_text())["task"] == "pick"


def test_clean_command_lists_then_removes(tmp_path):
    dead = _dead_pid()
    stale = tmp_path / "datasets" / f".dataset.npz.partial-{dead}-s99"
    stale.parent.mkdir()
    stale.write_bytes(b"x" * 1000)
    live = tmp_path / temp_name("dataset.npz", "partial", unique=False)
    live.write_bytes(b"mine")
    runner = CliRunner()
    dry = runner.invoke(app, ["clean", str(tmp_path), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert f"would remove {stale} (left by process {dead}, no longer running)" in dry.output
    assert "would remove 1 stale temporary" in dry.output and stale.exists()
    done = runner.invoke(app, ["clean", str(tmp_path), "--json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.output)
    assert [(r["path"], r["kind"], r["pid"], r["start_time"]) for r in doc["removed"]] == [(str(stale), "partial", dead, 99)]
    assert not stale.exists() and live.exists()
    again = runner.invoke(app, ["clean", str(tmp_path)])
    assert again.exit_code == 0 and "removed 0 stale temporaries" in again.output
