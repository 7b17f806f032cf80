"""ReplayBuffer: memory-mapped npz members, and every validation error it raises."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dpflow_core.errors import ConversionError, DatasetError
from dpflow_core.replay_buffer import ReplayBuffer
from tests.synthetic_dataset import synthetic_arrays, write_npz


@pytest.fixture
def arrays():
    return synthetic_arrays(n_episodes=3, episode_length=[10, 12, 7], image_size=(16, 12))


def test_members_are_memmaps_with_the_written_values(tmp_path, arrays):
    path = write_npz(tmp_path / "dataset.npz", arrays)
    rb = ReplayBuffer(path)
    assert rb.n_episodes == 3 and rb.n_steps == 29
    assert rb.episode_ends.tolist() == [10, 22, 29]
    assert rb.episode_lengths.tolist() == [10, 12, 7]
    assert rb.episode_starts.tolist() == [0, 10, 22]
    assert rb.frequency_hz == 10.0
    assert rb.metadata["image_size"] == [16, 12]
    assert set(rb) == {k[len("data__") :] for k in arrays if k.startswith("data__")}
    with np.load(path) as ref:
        for key in rb:
            assert isinstance(rb[key], np.memmap), key
            assert rb[key].dtype == ref["data__" + key].dtype
            np.testing.assert_array_equal(rb[key], ref["data__" + key])
    ep = rb.get_episode(1)
    np.testing.assert_array_equal(ep["robot0_eef_pos"], arrays["data__robot0_eef_pos"][10:22])
    with pytest.raises(KeyError):
        rb["camera9_rgb"]


def test_memmap_offsets_skip_zip64_extra_fields_and_fortran_order(tmp_path):
    arrays = synthetic_arrays(n_episodes=2, episode_length=5, image_size=(8, 8))
    # A string metadata member (0-d unicode) is accepted as well as uint8 bytes.
    arrays["meta__info_json"] = np.array(bytes(arrays["meta__info_json"]).decode())
    arrays["data__extra_fortran"] = np.asfortranarray(np.arange(40, dtype=np.float32).reshape(10, 4))
    path = write_npz(tmp_path / "d.npz", arrays)
    rb = ReplayBuffer(path)
    np.testing.assert_array_equal(rb["extra_fortran"], arrays["data__extra_fortran"])
    assert rb.metadata["n_episodes"] == 2


def test_compressed_member_is_rejected_naming_file_and_member(tmp_path, arrays):
    path = write_npz(tmp_path / "c.npz", arrays, compressed=True)
    with pytest.raises(DatasetError) as err:
        ReplayBuffer(path)
    assert "compressed" in err.value.reason and err.value.path == str(path)
    assert "data__" in err.value.reason or "meta__" in err.value.reason


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda a: a.pop("data__robot0_eef_pos"), ["data__robot0_eef_pos", "missing"]),
        (lambda a: a.pop("meta__episode_ends"), ["meta__episode_ends", "missing"]),
        (lambda a: a.pop("meta__info_json"), ["meta__info_json", "missing"]),
        (lambda a: a.update(data__robot0_gripper_width=a["data__robot0_gripper_width"][:-1]), ["inconsistent"]),
        (lambda a: a.update(meta__episode_ends=np.array([10, 10, 29])), ["strictly increasing"]),
        (lambda a: a.update(meta__episode_ends=np.array([10, 22, 28])), ["ends at 28", "29"]),
        (lambda a: a.update(data__robot0_eef_pos=a["data__robot0_eef_pos"].astype(np.float64)), ["dtype"]),
        (lambda a: a.update(data__robot0_eef_pos=np.zeros((29, 4), np.float32)), ["shape"]),
        (lambda a: a.update(meta__info_json=np.array("not json")), ["JSON"]),
        (lambda a: a.update(meta__info_json=np.array(json.dumps({"n_episodes": 3}))), ["frequency_hz"]),
        (
            lambda a: a.update(
                meta__info_json=np.array(json.dumps({"frequency_hz": 10.0, "n_episodes": 5, "image_size": [16, 12]}))
            ),
            ["n_episodes"],
        ),
        (
            lambda a: a.update(
                meta__info_json=np.array(json.dumps({"frequency_hz": 10.0, "n_episodes": 3, "image_size": [12, 16]}))
            ),
            ["image_size"],
        ),
        (
            lambda a: a.update(
                meta__info_json=np.array(json.dumps({"frequency_hz": 0, "n_episodes": 3, "image_size": [16, 12]}))
            ),
            ["frequency_hz"],
        ),
    ],
)
def test_invalid_buffers_raise_dataset_error(tmp_path, arrays, mutate, words):
    mutate(arrays)
    path = write_npz(tmp_path / "bad.npz", arrays)
    with pytest.raises(DatasetError) as err:
        ReplayBuffer(path)
    assert err.value.path == str(path)
    for word in words:
        assert word in err.value.reason, err.value.reason


def test_missing_and_non_zip_files(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        ReplayBuffer(tmp_path / "nope.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip at all")
    with pytest.raises(DatasetError, match="zip"):
        ReplayBuffer(bad)


def test_pickles_without_array_data(tmp_path, arrays):
    import pickle

    rb = ReplayBuffer(write_npz(tmp_path / "dataset.npz", arrays))
    _ = rb["camera0_rgb"]
    blob = pickle.dumps(rb)
    assert len(blob) < 20_000
    rb2 = pickle.loads(blob)
    np.testing.assert_array_equal(rb2["camera0_rgb"][3], arrays["data__camera0_rgb"][3])


def _frame_files(tmp_path, frames, cuts):
    """``frames`` saved as one ``.npy`` file per slice between ``cuts``: (path, data offset, bytes) each."""
    from dpflow_core.replay_buffer import writer

    out = []
    for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(frames)])):
        path = tmp_path / f"frames{k}.npy"
        np.save(path, frames[a:b])
        out.append((str(path), writer.npy_data_offset(str(path)), frames[a:b].nbytes))
    return out


def _members(arrays):
    from dpflow_core.replay_buffer import writer

    return [writer.NpzMember(name, a.shape, a.dtype, data=a.tobytes()) for name, a in arrays.items()
            if name != writer.FRAMES_MEMBER]


def test_npz_writer_puts_the_frames_first_and_numpy_zipfile_and_the_reader_read_it(tmp_path, arrays):
    """dpflow's npz writer (frames as pieces of .npy files, one with its CRC-32 given, one read for it):
    the frames member is the first in the file and in the central directory, the CRC-32s check
    (zipfile.testzip), numpy loads every member, the ReplayBuffer maps them, the SHA-256 and size
    are the file's, a scratch file marked for deletion is gone, and an existing output is refused."""
    import hashlib
    import zipfile
    import zlib

    from dpflow_core.replay_buffer import writer

    frames = arrays["data__camera0_rgb"]
    (a, a_off, a_n), (b, b_off, b_n) = _frame_files(tmp_path, frames, [20])
    out = writer.NpzStreamWriter(tmp_path / "out.npz", frames.shape[1:], sync_every=1)  # an fdatasync per piece
    out.append("a", a, a_off, a_n, zlib.crc32(frames[:20].tobytes()))
    out.append("b", b, b_off, b_n, drop=True)
    assert out.rows == len(frames)
    seen = []
    sha, size = out.finish(["a", "b"], _members(arrays), len(frames), lambda *p: seen.append(p))
    body = (tmp_path / "out.npz").read_bytes()
    assert sha == hashlib.sha256(body).hexdigest() and size == len(body) and seen == [("write", size, size)]
    assert Path(a).exists() and not Path(b).exists()
    with zipfile.ZipFile(tmp_path / "out.npz") as zf:
        assert zf.testzip() is None
        assert zf.namelist() == ["data__camera0_rgb.npy", *(f"{m}.npy" for m in arrays if m != "data__camera0_rgb")]
        assert zf.infolist()[0].header_offset == 0
    # the first frame starts right after the fixed-length headers
    assert body[out.head_bytes:out.head_bytes + frames[0].nbytes] == frames[0].tobytes()
    with np.load(tmp_path / "out.npz") as z:
        for name, value in arrays.items():
            np.testing.assert_array_equal(z[name], value)
    rb = ReplayBuffer(tmp_path / "out.npz")
    np.testing.assert_array_equal(rb["camera0_rgb"], frames)
    np.testing.assert_array_equal(rb.episode_ends, arrays["meta__episode_ends"])
    with pytest.raises(FileExistsError):
        writer.NpzStreamWriter(tmp_path / "out.npz", frames.shape[1:])
    assert (tmp_path / "out.npz").read_bytes() == body


def test_a_piece_cut_out_after_appending_gives_the_bytes_of_never_appending_it(tmp_path, arrays, monkeypatch):
    """Episodes appended and then rejected (frequency_mismatch is known only once all are aligned):
    cutting the middle and the last piece out gives the very bytes of a file written from the
    kept pieces alone (write_npz), through copy_file_range and through plain reads and writes."""
    import errno
    import zipfile

    from dpflow_core.replay_buffer import writer

    monkeypatch.setattr(writer, "_COPY_CHUNK", 1000)  # the moves run in many chunks
    frames = arrays["data__camera0_rgb"]
    ends = arrays["meta__episode_ends"].tolist()  # [10, 22, 29]
    pieces = _frame_files(tmp_path, frames, ends[:2])
    kept = frames[: ends[0]]
    rest = {**arrays, "data__camera0_rgb": kept}
    members = _members({k: (v[: ends[0]] if k.startswith("data__") else v) for k, v in rest.items()})
    expected = writer.write_npz(tmp_path / "expected.npz", [
        writer.NpzMember("data__camera0_rgb", kept.shape, kept.dtype, [(*pieces[0], False)]), *members], None)

    for name, copy_range in (("kernel", os.copy_file_range), ("plain", None)):
        if copy_range is None:
            def no_copy_range(*args):
                raise OSError(errno.EXDEV, "cross-device")
            monkeypatch.setattr(writer.os, "copy_file_range", no_copy_range)
        out = writer.NpzStreamWriter(tmp_path / f"{name}.npz", frames.shape[1:])
        for k, (path, offset, n) in enumerate(pieces):
            out.append(k, path, offset, n)
        with pytest.raises(ValueError, match="order"):
            out.finish([2, 0], members, len(kept))
        with pytest.raises(ConversionError, match="declares 11"):
            out.finish([0], members, 11)
        assert out.finish([0], members, len(kept)) == expected
        assert (tmp_path / f"{name}.npz").read_bytes() == (tmp_path / "expected.npz").read_bytes()
        with zipfile.ZipFile(tmp_path / f"{name}.npz") as zf:
            assert zf.testzip() is None
    # and the first piece cut out, the others kept: the frames move down over it
    out = writer.NpzStreamWriter(tmp_path / "tail.npz", frames.shape[1:])
    for k, (path, offset, n) in enumerate(pieces):
        out.append(k, path, offset, n)
    tail = {k: (v[ends[0]:] if k.startswith("data__") else v) for k, v in arrays.items()}
    out.finish([1, 2], _members(tail), len(tail["data__camera0_rgb"]))
    with np.load(tmp_path / "tail.npz") as z, zipfile.ZipFile(tmp_path / "tail.npz") as zf:
        assert zf.testzip() is None
        np.testing.assert_array_equal(z["data__camera0_rgb"], frames[ends[0]:])


def test_a_failed_background_sync_is_raised_by_finish(tmp_path, arrays, monkeypatch):
    """The fdatasync calls run on their own thread; an I/O error of one (which the final fsync would
    no longer report) fails the write instead of being lost."""
    import errno

    from dpflow_core.replay_buffer import writer

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(writer.os, "fdatasync", failing)
    frames = arrays["data__camera0_rgb"]
    out = writer.NpzStreamWriter(tmp_path / "out.npz", frames.shape[1:], sync_every=1)
    for k, (path, offset, n) in enumerate(_frame_files(tmp_path, frames, [20])):
        out.append(k, path, offset, n)
    with pytest.raises(OSError, match="Input/output error"):
        out.finish([0, 1], _members(arrays), len(frames))
    out.close()


@pytest.mark.parametrize("frame_shape", [(48, 64, 3), (224, 224, 3), (1300, 1600, 3), (8192, 8192, 3)])
def test_the_bytes_before_the_frames_have_one_length_for_any_frame_count(frame_shape):
    """What is reserved before the first frame (zip local header with ZIP64 sizes, .npy v1.0 header)
    fits every T from 0 to 10^12 frames: numpy pads the header for a first axis of up to 21 digits."""
    from dpflow_core.replay_buffer import writer

    lengths = {len(writer.npy_header((t, *frame_shape), np.uint8)) for t in (0, 1, 999, 10**6, 10**9, 10**12)}
    assert lengths == {128}
