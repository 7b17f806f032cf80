"""Every OS error of the exporters names the path (issue 28): the UMI zarr export, openpi's norm stats and the
LeRobot export's video writes turn a full disk, a read-only file system or a denied permission into a StorageError
naming their output, leave nothing half-written, and remove a killed run's temporaries. The errors are injected
where the kernel or FFmpeg reports them (an fsync, a temporary's creation, FFmpeg opening its output): as root,
chmod would not stop the writes."""

from __future__ import annotations

import errno
import os

import av
import pytest
from synthetic_dataset import write_synthetic_dataset
from test_conversion import manifest_for
from test_lerobot import frame_times, synthetic_episode

from dpflow_core import export as lr
from dpflow_core import files
from dpflow_core.errors import StorageError
from dpflow_core.export import video
from dpflow_core.export.umi import export_umi
from dpflow_core.recordings import samples


def _oserror(code: int, filename=None) -> OSError:
    return OSError(code, os.strerror(code), *([str(filename)] if filename else []))


def _stale(folder, name: str, kind: str):
    """A temporary of a run that is gone: this PID with another start time (a reused PID)."""
    path = folder / f".{name}.{kind}-{os.getpid()}-s1"
    path.mkdir(parents=True)
    (path / "store").write_bytes(b"x" * 1000)
    return path


def test_umi_export_disk_full_names_the_zip_and_a_killed_runs_store_is_removed(tmp_path, monkeypatch):
    dataset = write_synthetic_dataset(tmp_path / "in" / "dataset.npz", n_episodes=2, episode_length=[6, 5],
                                      image_size=(16, 16))
    out = tmp_path / "umi" / "dataset.zarr.zip"
    stale = _stale(out.parent, out.name, "work")
    real = files._fsync_file
    monkeypatch.setattr(files, "_fsync_file", lambda p: (_ for _ in ()).throw(_oserror(errno.ENOSPC))
                        if str(p).endswith(".zip") or ".zarr.zip.tmp-" in str(p) else real(p))
    with pytest.raises(StorageError) as info:
        export_umi(dataset, out)
    assert info.value.code == "no_space" and info.value.path == str(out)
    assert str(info.value) == f"{out}: writing the UMI replay buffer failed: No space left on device (ENOSPC)"
    assert list(out.parent.iterdir()) == []  # neither the zip, its sidecar, the work folder nor the stale store
    assert not stale.exists()
    monkeypatch.undo()
    assert export_umi(dataset, out).n_steps == 11 and sorted(p.name for p in out.parent.iterdir()) == [
        "dataset.zarr.zip", "dataset.zarr.zip.json"]


@pytest.fixture(scope="module")
def lerobot_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("lr") / "ds"
    with lr.LeRobotWriter(out, "task") as writer:
        for k, n in enumerate((12, 10)):
            state, frames = synthetic_episode(n, k, (16, 16))
            writer.add_episode(state, {lr.CAMERA_KEY: frames}, frame_times(n, 30.0, k), stem=f"ep{k}")
        writer.finish()
    return out


@pytest.mark.parametrize("code,name", [(errno.EACCES, "permission_denied"), (errno.EROFS, "read_only_file_system")])
def test_norm_stats_write_names_the_file_not_the_temporary(lerobot_dataset, tmp_path, monkeypatch, code, name):
    out = tmp_path / "assets" / "norm_stats.json"
    stale = out.parent / f".norm_stats.json.tmp-{os.getpid()}-s1"
    out.parent.mkdir()
    stale.write_text("{}")
    real = files.temp_path_for
    monkeypatch.setattr(files, "temp_path_for", lambda p, suffix="": (_ for _ in ()).throw(
        _oserror(code, real(p, suffix))))
    with pytest.raises(StorageError) as info:
        lr.write_openpi_norm_stats(lerobot_dataset, out, batch_size=4)
    assert info.value.code == name and info.value.path == str(out)
    assert str(info.value) == f"{out}: writing the openpi norm stats failed: {os.strerror(code)} ({errno.errorcode[code]})"
    assert not stale.exists()


class _FullDiskAv:
    """PyAV as video.py sees it, except that FFmpeg opening an output for writing meets a full disk."""

    def __getattr__(self, name):
        return getattr(av, name)

    @staticmethod
    def open(path, mode="r", **kw):
        if mode == "w":
            raise av.error.OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return av.open(path, mode, **kw)


def test_lerobot_export_video_disk_full_is_a_storage_error_not_a_bad_video(tmp_path, monkeypatch):
    """PyAV's ENOSPC used to end as ConversionError 'video encoding failed' (a bad video, not a full disk)."""
    spec = samples.SampleSpec(seconds=2.0, width=64, height=48, gop_size=15)
    root = tmp_path / "rec" / "pick"
    ep = samples.write_episode(root, "pick_0000", spec, seed=3)
    out = tmp_path / "out" / "lerobot"
    monkeypatch.setattr(video, "av", _FullDiskAv())
    with pytest.raises(StorageError) as info:
        lr.export_lerobot(manifest_for([ep], root), out, workers=1)
    assert info.value.code == "no_space" and info.value.path == str(out)
    assert "writing the LeRobot export failed: No space left on device (ENOSPC)" in str(info.value)
    assert list(out.parent.iterdir()) == []
