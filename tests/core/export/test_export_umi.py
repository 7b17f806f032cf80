"""`dpflow export-umi`: the replay buffer as upstream UMI's zarr (format 2) ``dataset.zarr.zip``.

Read back in a fresh process the way UMI's ``ReplayBuffer.copy_from_store`` does (open the zip
store, register imagecodecs' numcodecs codecs, copy every array into an in-memory store, read
it), and compared with the npz: low-dimensional arrays exactly, frames within JPEG-XL's loss.
The zip is also read without zarr (its ``.zarray`` JSON and one chunk decoded with numcodecs),
each entry must appear once, and the sidecar's SHA-256 must be the file's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from synthetic_dataset import write_synthetic_dataset
from typer.testing import CliRunner

from dpflow_core.cli import app
from dpflow_core.errors import DatasetError
from dpflow_core.export.umi import UMI_DATA_KEYS, export_umi
from dpflow_core.files import sha256_file

REPO = Path(__file__).resolve().parents[3]

#: UMI's way of reading the file (diffusion_policy ReplayBuffer.copy_from_store into a MemoryStore), in zarr 3 calls.
READ_LIKE_UMI = r"""
import sys
import zipfile
import numpy as np
import zarr
from zarr.core.buffer import default_buffer_prototype
from imagecodecs.numcodecs import register_codecs

register_codecs()
# UMI copies the zip's entries, still encoded, into an in-memory store (no re-encoding), then reads
with zipfile.ZipFile(sys.argv[1]) as zf:
    raw = {name: default_buffer_prototype().buffer.from_bytes(zf.read(name)) for name in zf.namelist()}
mem = zarr.open_group(zarr.storage.MemoryStore(raw), mode="r", zarr_format=2)
out = {}
for group in ("data", "meta"):
    for name, arr in mem[group].arrays():
        out[f"{group}__{name}"] = arr[...]
np.savez(sys.argv[2], **out)
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("umi") / "dataset.npz", n_episodes=3,
                                   episode_length=[12, 9, 15], image_size=(48, 32))


def test_export_reads_back_in_a_fresh_process_like_umi(dataset, tmp_path):
    out = tmp_path / "dataset.zarr.zip"
    result = CliRunner().invoke(app, ["export-umi", str(dataset), "-o", str(out), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["sha256"] == sha256_file(out) and summary["size_bytes"] == out.stat().st_size
    sidecar = json.loads((tmp_path / "dataset.zarr.zip.json").read_text())
    assert sidecar["sha256"] == sha256_file(out) and sidecar["n_steps"] == 36 and sidecar["n_episodes"] == 3

    with zipfile.ZipFile(out) as zf:
        names = zf.namelist()
        assert len(names) == len(set(names))  # each entry written once
        zarray = json.loads(zf.read("data/camera0_rgb/.zarray"))
        assert zarray["zarr_format"] == 2 and zarray["shape"] == [36, 32, 48, 3] and zarray["chunks"] == [1, 32, 48, 3]
        assert zarray["compressor"]["id"] == "imagecodecs_jpegxl" and zarray["compressor"]["level"] == 80
        assert zarray["compressor"]["lossless"] is False  # the level applies (the codec's default is lossless)
        assert zarray["dtype"] == "|u1"
        assert json.loads(zf.read("meta/episode_ends/.zarray"))["dtype"] == "<i8"
        assert {n.split("/")[1] for n in names if n.startswith("data/") and n.count("/") >= 2} == set(UMI_DATA_KEYS)
        # one frame decoded without zarr: numcodecs' registry and the codec named in .zarray
        import numcodecs
        from imagecodecs.numcodecs import register_codecs

        register_codecs()
        frame = numcodecs.get_codec(zarray["compressor"]).decode(zf.read("data/camera0_rgb/5.0.0.0"))

    back = tmp_path / "back.npz"
    proc = subprocess.run([sys.executable, "-c", READ_LIKE_UMI, str(out), str(back)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    read = np.load(back)
    original = np.load(dataset)
    assert sorted(read.files) == sorted([f"data__{k}" for k in UMI_DATA_KEYS] + ["meta__episode_ends"])
    np.testing.assert_array_equal(read["meta__episode_ends"], [12, 21, 36])
    for key in UMI_DATA_KEYS[1:]:
        assert read[f"data__{key}"].dtype == original[f"data__{key}"].dtype
        np.testing.assert_array_equal(read[f"data__{key}"], original[f"data__{key}"])
    frames, truth = read["data__camera0_rgb"], original["data__camera0_rgb"]
    assert frames.shape == truth.shape and frames.dtype == np.uint8
    err = np.abs(frames.astype(np.int16) - truth.astype(np.int16))
    assert err.mean() < 3.0 and np.percentile(err, 99) <= 40, (err.mean(), np.percentile(err, 99))
    np.testing.assert_array_equal(np.asarray(frame).reshape(32, 48, 3), frames[5])


def test_upload_keeps_the_zarr_zip_name_on_the_server(dataset, tmp_path):
    from dpflow_core.server import GpuServer, ServerConfig
    from dpflow_core.server.upload import upload_dataset

    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.runs import dataset_frequency

    out = export_umi(dataset, tmp_path / "dataset.zarr.zip")
    with GpuServer(ServerConfig.local(data_root=str(tmp_path / "server"))) as server:
        result = upload_dataset(server, out.path, task="pick_cup", expected_sha256=out.sha256, method="stream")
        # the run spec's task.dataset_frequeny comes from the zip on the server (its root .zattrs), as for an npz
        frequency = dataset_frequency(server, result.remote_path)
    assert frequency == ReplayBuffer(dataset).metadata["frequency_hz"] > 0
    with zipfile.ZipFile(out.path) as zf:
        assert json.loads(zf.read(".zattrs")) == {"frequency_hz": frequency}
    assert result.verified
    assert result.remote_path == str(tmp_path / "server" / "pick_cup" / out.sha256[:16] / "dataset.zarr.zip")
    assert sha256_file(result.remote_path) == out.sha256


def test_existing_output_is_refused_and_levels_are_checked(dataset, tmp_path):
    out = tmp_path / "dataset.zarr.zip"
    export_umi(dataset, out, jpegxl_level=95, jpegxl_effort=1)
    before = sha256_file(out)
    with pytest.raises(DatasetError) as exists:
        export_umi(dataset, out)
    assert exists.value.code == "exists" and exists.value.path == str(out) and sha256_file(out) == before
    with pytest.raises(DatasetError) as bad:
        export_umi(dataset, tmp_path / "other.zarr.zip", jpegxl_level=101)
    assert bad.value.code == "bad_config" and "0..100" in bad.value.reason
    assert not (tmp_path / "other.zarr.zip").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset.zarr.zip", "dataset.zarr.zip.json"]  # no temporaries


def test_export_never_clobbers_and_leaves_no_temporary_file(dataset, tmp_path, monkeypatch):
    import dpflow_core.export.umi as umi

    out = tmp_path / "x" / "dataset.zarr.zip"
    first = export_umi(dataset, out)
    with pytest.raises(DatasetError, match="exists already"):
        export_umi(dataset, out)
    assert sha256_file(out) == first.sha256
    assert export_umi(dataset, out, overwrite=True).sha256 == first.sha256  # the same bytes again

    def unreadable(path):
        raise OSError(f"{path}: read error")

    monkeypatch.setattr(umi, "sha256_file", unreadable)  # fails after the zip is written, before it is installed
    other = tmp_path / "x" / "other.zarr.zip"
    with pytest.raises(OSError, match="read error"):
        export_umi(dataset, other)
    assert sorted(p.name for p in out.parent.iterdir()) == ["dataset.zarr.zip", "dataset.zarr.zip.json"]
