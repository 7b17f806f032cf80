"""ReplayBuffer: memory-mapped npz members, and every validation error it raises."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpflow_core.errors import DatasetError
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


def test_streamed_npz_writer_hashes_what_it_writes_and_numpy_reads_it(tmp_path, monkeypatch):
    """dpflow's npz writer (pieces of .npy files copied in chunks, SHA-256 on a helper thread):
    the returned SHA-256 and size are those of the file, numpy loads every member, a copied
    scratch file marked for deletion is gone, and an existing output is never overwritten."""
    import hashlib

    from dpflow_core.replay_buffer import writer

    monkeypatch.setattr(writer, "_COPY_CHUNK", 4096)  # many chunks through the hash queue
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(37, 12, 16, 3), dtype=np.uint8)
    ts = np.arange(37, dtype=np.float64) / 10
    np.save(tmp_path / "a.npy", frames[:20])
    np.save(tmp_path / "b.npy", frames[20:])
    row = 12 * 16 * 3
    pieces = [(str(tmp_path / "a.npy"), writer.npy_data_offset(str(tmp_path / "a.npy")), 20 * row, False),
              (str(tmp_path / "b.npy"), writer.npy_data_offset(str(tmp_path / "b.npy")), 17 * row, True)]
    ends = np.array([20, 37], dtype=np.int64)
    info = json.dumps({"image_size": [16, 12]}).encode()
    members = [
        writer.NpzMember("meta__episode_ends", ends.shape, np.dtype(np.int64), data=ends.tobytes()),
        writer.NpzMember("data__timestamp", ts.shape, np.dtype(np.float64), data=ts.tobytes()),
        writer.NpzMember("data__camera0_rgb", frames.shape, np.dtype(np.uint8), pieces),
        writer.NpzMember("meta__info_json", (len(info),), np.dtype(np.uint8), data=info),
    ]
    seen = []
    sha, size = writer.write_npz(tmp_path / "out.npz", members, lambda stage, done, total: seen.append(done))
    body = (tmp_path / "out.npz").read_bytes()
    assert sha == hashlib.sha256(body).hexdigest() and size == len(body)
    # progress counts payload bytes, reported while pieces are copied
    assert seen == sorted(seen) and seen[-1] == ends.nbytes + ts.nbytes + frames.nbytes
    assert (tmp_path / "a.npy").exists() and not (tmp_path / "b.npy").exists()
    with np.load(tmp_path / "out.npz") as z:
        np.testing.assert_array_equal(z["data__camera0_rgb"], frames)
        np.testing.assert_array_equal(z["data__timestamp"], ts)
        assert z["meta__episode_ends"].tolist() == [20, 37]
    with pytest.raises(FileExistsError):
        writer.write_npz(tmp_path / "out.npz", members[:2], None)
