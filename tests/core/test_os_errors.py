"""Every OS error names the path (issue 28): a full disk, a read-only file system or a denied permission
met by conversion, the report, the LeRobot export or the manifest write is a StorageError naming the output
and the OS's reason, and nothing half-written is left. The errors are injected where the kernel reports them
(a block copy, an fsync, a temporary's creation): as root, chmod would not stop the writes."""

from __future__ import annotations

import errno
import os
from dataclasses import replace

import pytest
from test_conversion import manifest_for

from dpflow_core import files
from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.errors import StorageError
from dpflow_core.export import ExportSettings, export_lerobot
from dpflow_core.pairing import Manifest, write_manifest
from dpflow_core.recordings import samples
from dpflow_core.report import write_report


def _oserror(code: int, filename=None) -> OSError:
    return OSError(code, os.strerror(code), *([str(filename)] if filename else []))


@pytest.fixture(scope="module")
def episode(tmp_path_factory):
    root = tmp_path_factory.mktemp("oserr") / "pick"
    spec = samples.SampleSpec(seconds=2.0, width=96, height=72, gop_size=15)
    return root, samples.write_episode(root, "pick_0000", spec, seed=71)


def _fail_after(monkeypatch, module, name, calls_ok, exc):
    real, seen = getattr(module, name), []

    def failing(*a, **k):
        seen.append(1)
        if len(seen) > calls_ok:
            raise exc
        return real(*a, **k)

    monkeypatch.setattr(module, name, failing)


def test_conversion_disk_full_names_the_output(episode, tmp_path, monkeypatch):
    from dpflow_core.replay_buffer import writer

    root, ep = episode
    out = tmp_path / "out" / "dataset.npz"
    _fail_after(monkeypatch, writer, "_copy_range", 0, _oserror(errno.ENOSPC))
    with pytest.raises(StorageError) as info:
        convert(manifest_for([ep], root), out, ConversionSettings(image_size=(32, 24), min_segment_frames=10),
                workers=1, cache=False)
    assert info.value.code == "no_space" and info.value.path == str(out)
    assert str(info.value) == f"{out}: writing the dataset failed: No space left on device (ENOSPC)"
    assert list(out.parent.iterdir()) == []  # no partial, no work folder, no sidecar


def test_conversion_scratch_disk_full_stops_instead_of_rejecting(episode, tmp_path, monkeypatch):
    """A worker's ENOSPC used to reject the episode as 'cannot read' (and lose it); now the run stops."""
    from dpflow_core.conversion import jobs

    root, ep = episode
    out = tmp_path / "dataset.npz"
    _fail_after(monkeypatch, jobs, "_write_part", 0, _oserror(errno.ENOSPC))
    with pytest.raises(StorageError, match=r"writing the scratch files of pick_0000 failed: No space left on device"):
        convert(manifest_for([ep], root), out, ConversionSettings(image_size=(32, 24), min_segment_frames=10),
                workers=1, cache=False)
    assert list(tmp_path.iterdir()) == []


def test_lerobot_export_read_only_names_the_folder(episode, tmp_path, monkeypatch):
    root, ep = episode
    out = tmp_path / "lerobot"
    _fail_after(monkeypatch, files, "_fsync_file", 0, _oserror(errno.EROFS))
    with pytest.raises(StorageError) as info:
        export_lerobot(manifest_for([ep], root), out, ExportSettings(image_size=(32, 24)), workers=1)
    assert info.value.code == "read_only_file_system" and info.value.path == str(out)
    assert "writing the LeRobot export failed: Read-only file system (EROFS)" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # neither the export nor its temporary folder


def test_report_disk_full_leaves_no_half_report(tmp_path, monkeypatch):
    manifest = {"manifest_version": 1, "root": str(tmp_path), "task": "pick", "created_at": "2026-01-01T00:00:00+00:00",
                "accepted": [], "rejected": [{"stem": "a", "path": "/x/a.mcap", "code": "failed_status", "reason": "failed"}]}
    out = tmp_path / "report"
    _fail_after(monkeypatch, files, "_fsync_file", 1, _oserror(errno.ENOSPC))  # quality.json written, report.html not
    with pytest.raises(StorageError) as info:
        write_report(manifest, out)
    assert info.value.code == "no_space" and info.value.path == str(out)
    assert not out.exists()
    monkeypatch.undo()
    assert write_report(manifest, out).html_path.is_file()  # nothing in the way of the next run


def test_manifest_permission_denied_names_the_manifest_not_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "manifests" / "pick.json"
    real = files.temp_path_for

    def denied(p, suffix=""):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(real(p, suffix)))

    monkeypatch.setattr(files, "temp_path_for", denied)
    manifest = Manifest(root=tmp_path, task="pick", created_at="2026-01-01T00:00:00+00:00", topics={},
                        accepted=[], rejected=[])
    with pytest.raises(StorageError) as info:
        write_manifest(manifest, path)
    assert info.value.code == "permission_denied"
    assert str(info.value) == f"{path}: writing the manifest failed: Permission denied (EACCES)"
