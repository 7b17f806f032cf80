"""Integrity without a sidecar (issue 28): the archive's own CRC-32s name a damaged member.

A real converted dataset; one byte flipped in one member at a time (the frames, a low-dimensional
member, the episode ends, the metadata JSON, a local header), with and without ``dataset.json``.
``dpflow validate`` must fail naming the member, ``upload`` must refuse it, and an intact file with
no recorded hash is never called "verified".
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpflow_core.cli import app
from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.errors import DatasetError
from dpflow_core.pairing import pair_recordings
from dpflow_core.replay_buffer.integrity import check_archive
from dpflow_core.server import GpuServer, ServerConfig
from dpflow_core.server.upload import upload_dataset
from recording_fixtures import write_small_task


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    base = tmp_path_factory.mktemp("integrity")
    write_small_task(base, episodes=2, seed=5)
    out = base / "ds" / "pick_place" / "dataset.npz"
    convert(pair_recordings(base / "pick_place"), out, ConversionSettings(image_size=(32, 24)), workers=1, cache=False)
    return out


def _member_data(path: Path, member: str) -> tuple[int, int]:
    """(offset of the member's first data byte, its byte count), from the zip's own records."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member + ".npy")
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


def _copy_with_flip(src: Path, dst_dir: Path, at: int, sidecar: bool) -> Path:
    dst_dir.mkdir(parents=True)
    dst = dst_dir / "dataset.npz"
    shutil.copyfile(src, dst)
    if sidecar:
        shutil.copyfile(src.with_suffix(".json"), dst.with_suffix(".json"))
    with open(dst, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x5A]))
    return dst


# member, where in its data (fraction of its bytes; 0.0 = the first byte of the .npy header)
FLIPS = [
    ("data__camera0_rgb", 0.73),       # a pixel deep in the frames
    ("data__camera0_rgb", 0.0),        # the frames' .npy magic
    ("data__robot0_eef_pos", 0.5),     # a low-dimensional value
    ("data__robot0_gripper_width", 0.99),
    ("meta__episode_ends", 0.9),
    ("meta__info_json", 0.4),          # a character of the metadata JSON
]


def test_intact_dataset_passes_and_names_every_member(dataset):
    check = check_archive(dataset)
    assert check.ok, check.describe()
    with zipfile.ZipFile(dataset) as zf:
        assert set(check.members) == {n.removesuffix(".npy") for n in zf.namelist()}
    import hashlib

    assert check.sha256 == hashlib.sha256(dataset.read_bytes()).hexdigest()
    res = CliRunner().invoke(app, ["validate", str(dataset)])
    assert res.exit_code == 0, res.output
    assert f"PASS  archive_crc32: CRC-32 of all {len(check.members)} members intact" in res.output


@pytest.mark.parametrize("sidecar", [False, True], ids=["no_sidecar", "sidecar"])
@pytest.mark.parametrize("member,where", FLIPS, ids=[f"{m}@{w}" for m, w in FLIPS])
def test_flipped_byte_fails_validate_and_upload_naming_the_member(dataset, tmp_path, member, where, sidecar):
    start, n = _member_data(dataset, member)
    bad = _copy_with_flip(dataset, tmp_path / "pick_place", start + int(where * (n - 1)), sidecar)

    check = check_archive(bad)
    assert [d.member for d in check.damaged] == [member], check.describe()
    assert "CRC-32" in check.damaged[0].reason

    res = CliRunner().invoke(app, ["validate", str(bad)])
    assert res.exit_code == 1, res.output
    line = next(x for x in res.output.splitlines() if "archive_crc32" in x)
    assert line.startswith("FAIL") and f"member {member!r}" in line
    assert "sha256_matches_sidecar" in res.output  # without a sidecar: a warning that the hash went unchecked
    assert ("WARN  sha256_matches_sidecar: no dataset.json beside the dataset" in res.output) == (not sidecar)

    expected = None
    if sidecar:
        from dpflow_core.dataset import recorded_sha256

        expected = recorded_sha256(bad)
    server_root = tmp_path / "server"
    with GpuServer(ServerConfig.local(data_root=str(server_root))) as server:
        with pytest.raises(DatasetError) as info:
            upload_dataset(server, bad, expected_sha256=expected, method="stream")
    assert info.value.code == ("sha256_changed" if sidecar else "archive_damaged")
    assert f"member {member!r}" in info.value.reason
    assert not list(server_root.rglob("dataset.npz*"))


def test_local_header_disagreeing_with_the_central_directory_is_named(dataset, tmp_path):
    with zipfile.ZipFile(dataset) as zf:
        info = zf.getinfo("data__robot0_eef_pos.npy")
    bad = _copy_with_flip(dataset, tmp_path / "pick_place", info.header_offset + 14, sidecar=False)  # its CRC field
    check = check_archive(bad)
    assert [d.member for d in check.damaged] == ["data__robot0_eef_pos"]
    assert "local header records CRC-32" in check.damaged[0].reason


def test_a_file_that_is_no_zip_is_refused(tmp_path):
    path = tmp_path / "pick_place" / "dataset.npz"
    path.parent.mkdir()
    path.write_bytes(b"\x00" * 5000)
    assert check_archive(path).error
    res = CliRunner().invoke(app, ["validate", str(path)])
    # every check fails for the one reason, on one line
    assert res.exit_code == 1 and "dataset does not open: not a readable .npz (zip) file" in res.output
    with GpuServer(ServerConfig.local(data_root=str(tmp_path / "server"))) as server:
        with pytest.raises(DatasetError) as info:
            upload_dataset(server, path)
    assert info.value.code == "archive_unreadable"


def test_upload_calls_verified_only_what_a_recorded_hash_vouches_for(dataset, tmp_path):
    bare = tmp_path / "bare" / "pick_place" / "dataset.npz"
    bare.parent.mkdir(parents=True)
    shutil.copyfile(dataset, bare)
    with_sidecar = tmp_path / "full" / "pick_place" / "dataset.npz"
    with_sidecar.parent.mkdir(parents=True)
    shutil.copyfile(dataset, with_sidecar)
    shutil.copyfile(dataset.with_suffix(".json"), with_sidecar.with_suffix(".json"))

    root = tmp_path / "server"
    res = CliRunner().invoke(app, ["upload", str(bare), "--remote-dir", str(root)])
    assert res.exit_code == 0, res.output
    assert "verified sha256" not in res.output
    assert res.output.strip().startswith("copied sha256 ") and "unverified: no SHA-256 was recorded" in res.output
    assert "members' own CRC-32s are intact" in res.output

    res = CliRunner().invoke(app, ["upload", str(with_sidecar), "--remote-dir", str(root)])
    assert res.exit_code == 0, res.output
    assert res.output.strip().startswith("verified sha256 ")
