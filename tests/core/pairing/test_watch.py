"""The incremental recordings scan behind the sensor (dpflow_core.pairing.watch), on real folders.

mtimes are set explicitly (os.utime, in ns) so that the tests do not depend on the clock
or on the file system's timestamp granularity; "unchanged-looking" folders are made by
putting a folder's mtime back to the value a scan recorded, which is what a file system
with coarse timestamps does by itself when a file lands in the same granule.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dpflow_core.pairing.watch import RACY_WINDOW_NS, FolderState, scan_tick, states_from_json, states_to_json

S = 1_000_000_000
T0 = 1_700_000_000 * S  # file mtimes (ns)
NOW = 1_800_000_000 * S  # the scans' clock (ns)
OLD_DIR = T0 + 1000 * S  # a folder mtime long before NOW: trusted


def _write_stem(folder: Path, stem: str, mtime_ns: int, status: str = "success") -> None:
    """A recording as the scan sees it: three files (tiny: the scan only stats the MCAPs)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.mcap").write_bytes(b"raw")
    (folder / f"{stem}_vio.mcap").write_bytes(b"vio")
    (folder / f"{stem}_vio.json").write_text(json.dumps({"status": status}))
    for name in (f"{stem}.mcap", f"{stem}_vio.mcap", f"{stem}_vio.json"):
        os.utime(folder / name, ns=(mtime_ns, mtime_ns))


def _set_dir_mtime(folder: Path, mtime_ns: int) -> None:
    os.utime(folder, ns=(mtime_ns, mtime_ns))


class Root:
    """One task folder and its cursor state, ticked with an explicit clock."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.states: dict[str, FolderState] = {}
        self.now = NOW

    def tick(self, **kw):
        self.now += 30 * S
        result = scan_tick({"task": self.folder}, self.states, now_ns=self.now, **kw)
        # through the cursor's JSON, as the sensor stores it
        self.states = states_from_json(json.loads(json.dumps(states_to_json({t: r.state for t, r in result.folders.items()}))))
        return result

    def ready(self, **kw) -> list[str]:
        return [s.stem for s in self.tick(**kw).folders["task"].ready]


@pytest.fixture
def settled(tmp_path) -> Root:
    """Two recordings requested already; the folder's mtime long past (trusted)."""
    folder = tmp_path / "task"
    _write_stem(folder, "ep_0000", T0)
    _write_stem(folder, "ep_0001", T0 + S)
    _set_dir_mtime(folder, OLD_DIR)
    root = Root(folder)
    assert root.ready() == []  # first sight
    assert root.ready() == ["ep_0000", "ep_0001"]
    assert root.states["task"].dir_mtime_ns == OLD_DIR
    return root


def test_unchanged_folder_is_not_listed_and_only_new_status_files_are_parsed(settled):
    quiet = settled.tick(audit_files=0)
    assert (quiet.scanned, quiet.files_statted, quiet.json_parsed) == (0, 0, 0)
    assert quiet.folders["task"].ready == []
    # a new recording: the folder's mtime moves, the folder is listed, one status file is read
    _write_stem(settled.folder, "ep_0002", T0 + 5 * S)
    _set_dir_mtime(settled.folder, OLD_DIR + S)
    seen = settled.tick(audit_files=0)
    assert (seen.scanned, seen.files_statted, seen.json_parsed) == (1, 9, 1)
    assert settled.states["task"].waiting_names == ["ep_0002"]
    # unchanged on the second look: ready, and its status file is not read again
    second = settled.tick(audit_files=0)
    assert [s.stem for s in second.folders["task"].ready] == ["ep_0002"] and second.json_parsed == 0
    assert second.folders["task"].ready[0].files["vio_json"] == (
        (settled.folder / "ep_0002_vio.json").stat().st_size, (T0 + 5 * S) / 1e9)
    assert settled.states["task"].max_mtime_ns == T0 + 5 * S
    assert settled.tick(audit_files=0).scanned == 0


def test_file_added_in_the_same_mtime_granule_is_found(tmp_path):
    """The folder's mtime was too recent to trust when it was read: the next tick lists it again,
    though its mtime has not moved (a new file in the same granule)."""
    folder = tmp_path / "task"
    _write_stem(folder, "ep_0000", T0)
    root = Root(folder)
    racy = root.now + 30 * S - RACY_WINDOW_NS // 2  # half the racy window before the coming scan
    _set_dir_mtime(folder, racy)
    assert root.ready(audit_files=0) == [] and root.states["task"].dir_mtime_ns is None
    _write_stem(folder, "ep_0001", T0 + S)
    _set_dir_mtime(folder, racy)  # same granule: the folder looks unchanged
    second = root.tick(audit_files=0)
    assert second.scanned == 1 and [s.stem for s in second.folders["task"].ready] == ["ep_0000"]
    assert root.states["task"].waiting_names == ["ep_0001"]
    assert root.ready(audit_files=0) == ["ep_0001"]
    assert root.states["task"].dir_mtime_ns == racy  # old enough by now


def test_hidden_changes_in_a_trusted_folder_are_found_by_the_audit(settled):
    """A recording added behind a folder mtime put back, or rewritten in place: invisible to the
    folder mtime, found by the audit (within its stat budget, or by age when too large for it)."""
    _write_stem(settled.folder, "ep_0002", T0 + 5 * S)
    _set_dir_mtime(settled.folder, OLD_DIR)
    assert settled.tick(audit_files=0, audit_interval_s=1e9).scanned == 0  # no audit: not seen
    audit = settled.tick(audit_files=8)  # the folder held 6 files at its last scan: it fits
    assert audit.audited == ["task"] and settled.states["task"].waiting_names == ["ep_0002"]
    assert settled.ready(audit_files=0) == ["ep_0002"]  # a recording waiting keeps its folder scanned
    # re-recorded in place: new content and mtime, same names, the folder's mtime unchanged
    (settled.folder / "ep_0000_vio.mcap").write_bytes(b"vio, second run")
    os.utime(settled.folder / "ep_0000_vio.mcap", ns=(T0 + 9 * S, T0 + 9 * S))
    _set_dir_mtime(settled.folder, OLD_DIR)
    assert settled.tick(audit_files=5, audit_interval_s=1e9).audited == []  # 9 files do not fit in 5
    by_age = settled.tick(audit_files=5, audit_interval_s=60)  # last scanned 60 s ago: scanned alone
    assert by_age.audited == ["task"] and settled.states["task"].waiting_names == ["ep_0000"]
    assert settled.ready(audit_files=0) == ["ep_0000"]


def test_status_rewritten_in_place_is_seen_without_an_audit(settled):
    _write_stem(settled.folder, "ep_0002", T0 + 5 * S, status="running")
    _set_dir_mtime(settled.folder, OLD_DIR + S)
    assert settled.ready(audit_files=0) == []
    assert settled.states["task"].watch == {"ep_0002": [3 + 3 + len('{"status": "running"}'), T0 + 5 * S]}
    quiet = settled.tick(audit_files=0)
    assert (quiet.scanned, quiet.files_statted, quiet.json_parsed) == (0, 3, 0)  # watched by name only
    status = settled.folder / "ep_0002_vio.json"
    status.write_text(json.dumps({"status": "success"}))  # in place: the folder's mtime does not move
    os.utime(status, ns=(T0 + 6 * S, T0 + 6 * S))
    _set_dir_mtime(settled.folder, OLD_DIR + S)
    seen = settled.tick(audit_files=0)
    assert seen.scanned == 1 and seen.json_parsed == 1 and settled.states["task"].watch == {}
    assert settled.ready(audit_files=0) == ["ep_0002"]


def test_a_changed_recording_resets_the_wait_and_incomplete_ones_are_counted(settled):
    _write_stem(settled.folder, "ep_0002", T0 + 5 * S)
    _write_stem(settled.folder, "ep_0003", T0 + 5 * S)
    (settled.folder / "ep_0004.mcap").write_bytes(b"raw only")  # an orphan: VIO never ran
    os.utime(settled.folder / "ep_0004.mcap", ns=(T0 + 5 * S, T0 + 5 * S))
    assert settled.ready() == []
    (settled.folder / "ep_0003_vio.mcap").write_bytes(b"vio, longer now")
    os.utime(settled.folder / "ep_0003_vio.mcap", ns=(T0 + 7 * S, T0 + 7 * S))
    assert settled.ready() == []  # one of the two changed: both look again
    assert settled.ready() == ["ep_0002", "ep_0003"]
    state = settled.states["task"]
    assert (state.waiting_n, state.waiting_names, state.pending_n) == (1, ["ep_0004"], 0)


def test_cursor_size_does_not_grow_with_the_recordings(tmp_path):
    sizes = {}
    for n in (30, 300):  # both above the 10 waiting names the cursor keeps
        folder = tmp_path / f"task{n}"
        for i in range(n):
            _write_stem(folder, f"ep_{i:04d}", T0 + i * S)
        _set_dir_mtime(folder, OLD_DIR)
        root = Root(folder)
        root.tick()
        first = len(json.dumps(states_to_json(root.states)))
        assert root.states["task"].pending_n == n
        assert len(root.ready()) == n
        sizes[n] = (first, len(json.dumps(states_to_json(root.states))))
    assert abs(sizes[300][0] - sizes[30][0]) <= 4 and abs(sizes[300][1] - sizes[30][1]) <= 4, sizes
    assert max(max(v) for v in sizes.values()) < 800


def test_vanished_folder_and_bad_arguments(tmp_path, settled):
    shutil.rmtree(settled.folder)
    assert settled.tick(audit_files=0).folders == {}
    with pytest.raises(ValueError, match="audit_files and audit_interval_s must be >= 0"):
        scan_tick({}, {}, audit_files=-1)
    with pytest.raises(ValueError, match="not a version-2 recordings cursor"):
        states_from_json({"tasks": {}})
