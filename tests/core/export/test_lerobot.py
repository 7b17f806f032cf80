"""LeRobot v2.1 writer and openpi norm stats: layout, values, fail-fast errors, no network.

The schema tests below check the documented v2.1 layout and the rules LeRobot's loader
enforces (timestamps 1/fps apart within 1e-4 s, video frames at those timestamps,
per-episode stats shapes); tests/core/export/test_lerobot_consumers.py reads the same kind of
dataset with lerobot 0.3.3 itself. openpi's norm stats are compared with
:func:`openpi_reference`, a transcription of openpi's ``compute_norm_stats``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy.spatial.transform import Rotation

from dpflow_core import export as lr
from dpflow_core.errors import ConversionError, DatasetError

REPO = Path(__file__).resolve().parents[3]


def synthetic_episode(n: int, seed: int, hw: tuple[int, int] = (48, 64)) -> tuple[np.ndarray, np.ndarray]:
    """(state (n, 7) float32, frames (n, H, W, 3) uint8) with smooth motion and textured frames."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)[:, None] / 30.0
    pos = 0.3 + 0.1 * np.sin(t * rng.uniform(0.5, 2.0, 3) + rng.uniform(0, 6, 3))
    rot = 0.4 * np.sin(t * rng.uniform(0.5, 2.0, 3) + rng.uniform(0, 6, 3))
    width = 0.05 + 0.03 * np.sin(t * 1.3 + seed)
    state = lr.episode_state(pos, rot, width)
    h, w = hw
    ys, xs = np.mgrid[0:h, 0:w]
    frames = np.empty((n, h, w, 3), dtype=np.uint8)
    for i in range(n):
        frames[i, ..., 0] = 128 + 100 * np.sin(xs / 7.0 + i / 5.0)
        frames[i, ..., 1] = 90 + 60 * np.cos(ys / 5.0 + seed)
        frames[i, ..., 2] = 160 + 80 * np.sin((xs + ys) / 9.0 - i / 7.0)
    return state, frames


def frame_times(n: int, hz: float, seed: int) -> np.ndarray:
    """(n,) float64 capture times at ``hz`` with 0.3 ms jitter, seconds."""
    jitter = np.random.default_rng(seed).normal(0, 3e-4, n)
    return np.arange(n) / hz + jitter - jitter[0]


def write_dataset(out: Path, lengths=(40, 33, 51), freqs=(29.97, 30.02, 29.99), rule="next_state", task="pick the cup",
                  version="v2.1", **writer_options):
    """Write a dataset; return (export result, states, frames, frame times)."""
    states, frames, times = [], [], []
    with lr.LeRobotWriter(out, task, rule, codebase_version=version, **writer_options) as writer:
        for k, (n, f) in enumerate(zip(lengths, freqs)):
            s, fr = synthetic_episode(n, k)
            t = frame_times(n, f, k)
            writer.add_episode(s, {lr.CAMERA_KEY: fr}, t, stem=f"ep{k}", record={"seed": k})
            states.append(s)
            frames.append(fr)
            times.append(t)
        result = writer.finish()
    return result, states, frames, times


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("lerobot") / "ds"
    return (out, *write_dataset(out)[:3])


# --------------------------------------------------------------------------- actions and stats


def test_next_state_actions_shift_by_one_and_hold_at_the_end():
    state, _ = synthetic_episode(10, 1)
    actions = lr.episode_actions(state, "next_state")
    assert actions.dtype == np.float32 and actions.shape == (10, 7)
    np.testing.assert_array_equal(actions[:-1], state[1:])
    np.testing.assert_array_equal(actions[-1], state[-1])


def test_delta_actions_compose_back_to_the_next_state():
    state, _ = synthetic_episode(12, 2)
    actions = lr.episode_actions(state, "delta")
    np.testing.assert_allclose(actions[:-1, :3], state[1:, :3] - state[:-1, :3], atol=1e-7)
    np.testing.assert_allclose(actions[:-1, 6], state[1:, 6] - state[:-1, 6], atol=1e-7)
    # R[t+1] = delta * R[t] (world frame)
    recomposed = Rotation.from_rotvec(actions[:-1, 3:6]) * Rotation.from_rotvec(state[:-1, 3:6])
    np.testing.assert_allclose(recomposed.as_rotvec(), state[1:, 3:6], atol=1e-5)
    np.testing.assert_array_equal(actions[-1], np.zeros(7, dtype=np.float32))
    with pytest.raises(ConversionError, match="unknown action rule"):
        lr.episode_actions(state, "velocity")


def test_image_stats_are_exact_per_channel():
    _, frames = synthetic_episode(7, 3)
    stats = lr.image_stats(frames)
    for c in range(3):
        ch = frames[..., c].astype(np.float64)
        assert stats["mean"][c, 0, 0] == pytest.approx(ch.mean() / 255, rel=1e-12)
        assert stats["std"][c, 0, 0] == pytest.approx(ch.std() / 255, rel=1e-9)
        assert stats["min"][c, 0, 0] == ch.min() / 255 and stats["max"][c, 0, 0] == ch.max() / 255
    assert stats["count"].tolist() == [7]


def test_measured_fps_is_one_over_the_median_interval():
    times = [np.array([0.0, 0.1, 0.2, 0.35]), np.array([1.0, 1.1, 1.3])]  # intervals .1 .1 .15 .1 .2
    assert lr.measured_fps(times) == pytest.approx(10.0)
    with pytest.raises(ConversionError, match="no episode has two frames"):
        lr.measured_fps([np.array([0.0])])


def test_episodes_off_the_dataset_rate_are_left_out(tmp_path):
    out = tmp_path / "ds"
    with lr.LeRobotWriter(out, "task", codebase_version="v2.1") as writer:
        for k, hz in enumerate((30.0, 30.1, 15.0)):
            s, fr = synthetic_episode(20, k)
            writer.add_episode(s, {lr.CAMERA_KEY: fr}, frame_times(20, hz, k), stem=f"ep{k}")
        result = writer.finish(rate_policy="reject")
    assert result.stems == ["ep0", "ep1"] and result.n_episodes == 2
    assert set(result.skipped) == {"ep2"} and result.skipped["ep2"].startswith("frequency_mismatch: measured 15.0")
    record = json.loads((out / "meta/dpflow.json").read_text())
    assert record["skipped"] == result.skipped
    assert [e["stem"] for e in record["episodes"]] == ["ep0", "ep1"]
    assert sorted(p.name for p in (out / "videos/chunk-000/observation.images.camera0").iterdir()) == [
        "episode_000000.mp4", "episode_000001.mp4"]


# --------------------------------------------------------------------------- layout (schema test)


def test_info_json_follows_the_v21_layout(dataset):
    out, result, states, _ = dataset
    info = json.loads((out / "meta/info.json").read_text())
    assert info["codebase_version"] == "v2.1"
    assert info["total_episodes"] == 3 and result.n_episodes == 3
    assert info["total_frames"] == sum(len(s) for s in states) == result.total_frames
    assert info["total_tasks"] == 1 and info["total_videos"] == 3 and info["total_chunks"] == 1
    assert info["chunks_size"] == 1000
    assert info["splits"] == {"train": "0:3"}
    assert info["data_path"] == "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
    assert info["video_path"] == "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
    times = [frame_times(n, f, k) for k, (n, f) in enumerate(zip((40, 33, 51), (29.97, 30.02, 29.99)))]
    expected_fps = 1 / np.median(np.concatenate([np.diff(t) for t in times]))
    assert info["fps"] == pytest.approx(expected_fps, rel=1e-12) and result.fps == info["fps"]
    assert 29.9 < info["fps"] < 30.1
    feats = info["features"]
    assert set(feats) == {"observation.state", "action", "observation.images.camera0",
                          "timestamp", "frame_index", "episode_index", "index", "task_index"}
    for key in ("observation.state", "action"):
        assert feats[key] == {"dtype": "float32", "shape": [7], "names": list(lr.STATE_NAMES)}
    cam = feats["observation.images.camera0"]
    assert cam["dtype"] == "video" and cam["shape"] == [48, 64, 3]
    assert cam["names"] == ["height", "width", "channels"]
    assert cam["info"] == {
        "video.fps": info["fps"], "video.height": 48, "video.width": 64, "video.codec": "h264",
        "video.pix_fmt": "yuv420p", "video.is_depth_map": False, "video.channels": 3, "has_audio": False,
    }
    for key, dtype in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                       ("index", "int64"), ("task_index", "int64")):
        assert feats[key] == {"dtype": dtype, "shape": [1], "names": None}
    assert not any(p.name.startswith(".") for p in out.parent.iterdir()), "temporary folder left behind"


def test_episodes_tasks_and_episode_stats(dataset):
    out, _, states, frames = dataset
    episodes = [json.loads(x) for x in (out / "meta/episodes.jsonl").read_text().splitlines()]
    assert episodes == [{"episode_index": k, "tasks": ["pick the cup"], "length": len(s)} for k, s in enumerate(states)]
    tasks = [json.loads(x) for x in (out / "meta/tasks.jsonl").read_text().splitlines()]
    assert tasks == [{"task_index": 0, "task": "pick the cup"}]
    lines = [json.loads(x) for x in (out / "meta/episodes_stats.jsonl").read_text().splitlines()]
    info = json.loads((out / "meta/info.json").read_text())
    assert [x["episode_index"] for x in lines] == [0, 1, 2]
    for k, line in enumerate(lines):
        stats = line["stats"]
        assert set(stats) == set(info["features"])
        for key, s in stats.items():
            assert set(s) == {"min", "max", "mean", "std", "count"}
            assert s["count"] == [len(states[k])]
            shape = {"observation.state": (7,), "action": (7,), "observation.images.camera0": (3, 1, 1)}.get(key, (1,))
            for name in ("min", "max", "mean", "std"):
                assert np.asarray(s[name]).shape == shape, (key, name)
        np.testing.assert_allclose(stats["observation.state"]["mean"], states[k].astype(np.float64).mean(0), rtol=1e-12)
        np.testing.assert_allclose(stats["observation.state"]["std"], states[k].astype(np.float64).std(0), rtol=1e-9)
        assert stats["observation.state"]["min"] == states[k].min(0).tolist()
        img = np.asarray(stats["observation.images.camera0"]["mean"])[:, 0, 0]
        np.testing.assert_allclose(img, frames[k].reshape(-1, 3).mean(0) / 255, rtol=1e-12)
        assert stats["frame_index"]["max"] == [len(states[k]) - 1]
        assert stats["episode_index"]["min"] == stats["episode_index"]["max"] == [k]


def test_parquet_columns_and_timestamps_pass_lerobots_sync_rule(dataset):
    out, result, states, _ = dataset
    start = 0
    all_ts, all_ep = [], []
    for k, s in enumerate(states):
        table = pq.read_table(out / f"data/chunk-000/episode_{k:06d}.parquet")
        assert table.column_names == ["observation.state", "action", "timestamp", "frame_index",
                                      "episode_index", "index", "task_index"]
        # lerobot's datasets.Sequence(length=7, float32) is arrow's fixed_size_list<float32>[7]
        assert table.schema.field("observation.state").type == pa.list_(pa.float32(), 7)
        assert table.schema.field("timestamp").type == pa.float32()
        n = len(s)
        state = table.column("observation.state").combine_chunks().flatten().to_numpy().reshape(n, 7)
        np.testing.assert_array_equal(state, s)
        action = table.column("action").combine_chunks().flatten().to_numpy().reshape(n, 7)
        np.testing.assert_array_equal(action, lr.episode_actions(s, "next_state"))
        assert table.column("frame_index").to_pylist() == list(range(n))
        assert table.column("episode_index").to_pylist() == [k] * n
        assert table.column("index").to_pylist() == list(range(start, start + n))
        assert table.column("task_index").to_pylist() == [0] * n
        all_ts.append(table.column("timestamp").to_numpy())
        all_ep.append(np.full(n, k))
        start += n
    # LeRobot's check_timestamps_sync: within an episode, consecutive timestamps are 1/fps +- 1e-4 s apart
    ts = np.concatenate(all_ts).astype(np.float64)
    ep = np.concatenate(all_ep)
    inside = ep[1:] == ep[:-1]
    assert np.all(np.abs(np.diff(ts)[inside] - 1 / result.fps) <= 1e-4)
    assert all(t[0] == 0 for t in all_ts)


def test_videos_hold_every_frame_at_its_parquet_timestamp(dataset):
    out, result, states, frames = dataset
    for k, s in enumerate(states):
        path = out / f"videos/chunk-000/observation.images.camera0/episode_{k:06d}.mp4"
        ts = pq.read_table(out / f"data/chunk-000/episode_{k:06d}.parquet").column("timestamp").to_numpy()
        with av.open(str(path)) as c:
            stream = c.streams.video[0]
            assert stream.codec_context.name == "h264" and stream.pix_fmt == "yuv420p"
            decoded = [(float(f.pts * f.time_base), f.to_ndarray(format="rgb24")) for f in c.decode(stream)]
        assert len(decoded) == len(s)
        # LeRobot's video tolerance: decoded frame time within 1e-4 s of the query timestamp
        assert np.max(np.abs(np.array([t for t, _ in decoded]) - ts)) < 1e-4
        rgb = np.stack([f for _, f in decoded]).astype(np.float64)
        mse = np.mean((rgb - frames[k]) ** 2)
        assert 10 * np.log10(255**2 / mse) > 25, "decoded frames do not match the input"


def test_writer_refuses_an_existing_folder_and_cleans_up_on_error(tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    with pytest.raises(ConversionError, match="already exists"):
        lr.LeRobotWriter(out, "task")
    out2 = tmp_path / "ds2"
    state, frames = synthetic_episode(5, 0)
    t = frame_times(5, 30, 0)
    with pytest.raises(ConversionError, match="camera"):
        with lr.LeRobotWriter(out2, "task", codebase_version="v2.1") as writer:
            writer.add_episode(state, {lr.CAMERA_KEY: frames}, t)
            writer.add_episode(state, {lr.CAMERA_KEY: frames[:, :32]}, t)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    with pytest.raises(ConversionError, match="empty"):
        lr.LeRobotWriter(tmp_path / "ds3", "task").finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_chunks_follow_chunks_size(tmp_path):
    out = tmp_path / "ds"
    result, *_ = write_dataset(out, lengths=(5, 6, 7), freqs=(30, 30, 30), chunks_size=2)
    info = json.loads((out / "meta/info.json").read_text())
    assert info["chunks_size"] == 2 and info["total_chunks"] == 2
    assert (out / "data/chunk-001/episode_000002.parquet").is_file()
    assert (out / "videos/chunk-001/observation.images.camera0/episode_000002.mp4").is_file()
    assert lr.compute_openpi_norm_stats(out, batch_size=4)["state"].mean.shape == (7,)


# --------------------------------------------------------------------------- norm stats


def assert_stats_close(got: dict, reference: dict) -> None:
    """norm_stats.json content (key -> mean/std/q01/q99 lists) equal within float32 rounding."""
    assert set(got) == set(reference)
    for key, stats in reference.items():
        assert set(got[key]) == set(stats), key
        for name, values in stats.items():
            np.testing.assert_allclose(got[key][name], values, rtol=1e-6, atol=1e-9, err_msg=f"{key}.{name}")


class _ReferenceRunningStats:
    """openpi's ``RunningStats`` (openpi/shared/normalize.py) transcribed: running mean and mean of
    squares, 5000-bin histograms re-binned by left edges when the range widens, quantile = the left
    edge of the bin where the cumulative count reaches q * count."""

    def __init__(self):
        self.n = 0

    def update(self, batch):
        batch = batch.reshape(-1, batch.shape[-1])
        if self.n == 0:
            self.mean, self.sq = batch.mean(0), (batch ** 2).mean(0)
            self.lo, self.hi = batch.min(0), batch.max(0)
            self.hist = [np.zeros(5000) for _ in range(batch.shape[1])]
            self.edges = [np.linspace(self.lo[i] - 1e-10, self.hi[i] + 1e-10, 5001) for i in range(batch.shape[1])]
        else:
            lo, hi = np.minimum(self.lo, batch.min(0)), np.maximum(self.hi, batch.max(0))
            changed = np.any(hi > self.hi) or np.any(lo < self.lo)
            self.lo, self.hi = lo, hi
            if changed:
                for i in range(len(self.hist)):
                    new = np.linspace(lo[i] - 1e-10, hi[i] + 1e-10, 5001)
                    self.hist[i] = np.histogram(self.edges[i][:-1], bins=new, weights=self.hist[i])[0]
                    self.edges[i] = new
        self.n += len(batch)
        self.mean += (batch.mean(0) - self.mean) * (len(batch) / self.n)
        self.sq += ((batch ** 2).mean(0) - self.sq) * (len(batch) / self.n)
        for i in range(batch.shape[1]):
            self.hist[i] += np.histogram(batch[:, i], bins=self.edges[i])[0]

    def result(self):
        q = [[float(e[np.searchsorted(np.cumsum(h), p * self.n)]) for h, e in zip(self.hist, self.edges)] for p in (0.01, 0.99)]
        return {"mean": self.mean.tolist(), "std": np.sqrt(np.maximum(0, self.sq - self.mean ** 2)).tolist(),
                "q01": q[0], "q99": q[1]}


def openpi_reference(states, actions, horizon=50, batch_size=32, mask=None) -> dict[str, dict[str, list[float]]]:
    """openpi's compute_norm_stats on per-episode float32 arrays: frames in order, each with its state and
    the actions of frames t .. t+horizon-1 (clamped to the episode's last frame, as lerobot pads),
    ``DeltaActions(mask)`` applied, batches of ``batch_size`` frames, the last partial batch dropped."""
    frames = []
    for s, a in zip(states, actions):
        for t in range(len(s)):
            chunk = np.stack([a[min(t + k, len(s) - 1)] for k in range(horizon)]).astype(np.float32)
            if mask is not None:
                m = np.asarray(mask)
                chunk[:, :len(m)] -= np.where(m, s[t, :len(m)], 0).astype(np.float32)
            frames.append((s[t].astype(np.float32), chunk))
    stats = {"state": _ReferenceRunningStats(), "actions": _ReferenceRunningStats()}
    for b in range(len(frames) // batch_size):
        batch = frames[b * batch_size:(b + 1) * batch_size]
        stats["state"].update(np.stack([f[0] for f in batch]))
        stats["actions"].update(np.stack([f[1] for f in batch]))
    return {k: v.result() for k, v in stats.items()}


def test_openpi_norm_stats_equal_the_numpy_reference(dataset, tmp_path):
    out, _, states, _ = dataset
    path = lr.write_openpi_norm_stats(out, tmp_path / "assets")
    assert path == tmp_path / "assets" / "norm_stats.json"
    data = json.loads(path.read_text())
    assert set(data) == {"norm_stats"} and set(data["norm_stats"]) == {"state", "actions"}
    reference = openpi_reference(states, [lr.episode_actions(s, "next_state") for s in states])
    assert_stats_close(data["norm_stats"], reference)
    mtime = path.stat().st_mtime_ns
    assert lr.write_openpi_norm_stats(out, path) == path and path.stat().st_mtime_ns == mtime  # same content kept
    path.write_text(path.read_text().replace("1", "2"))
    with pytest.raises(DatasetError, match="different norm stats file already exists"):
        lr.write_openpi_norm_stats(out, path)
    lr.write_openpi_norm_stats(out, path, overwrite=True)
    assert_stats_close(json.loads(path.read_text())["norm_stats"], reference)


def test_norm_stats_never_open_a_video(dataset, tmp_path):
    out, *_ = dataset
    copy = tmp_path / "ds"
    shutil.copytree(out, copy)
    for mp4 in copy.rglob("*.mp4"):
        mp4.write_bytes(b"not a video")
    shutil.rmtree(copy / "videos" / "chunk-000")
    assert lr.compute_openpi_norm_stats(copy)["actions"].q99.tolist() == lr.compute_openpi_norm_stats(out)["actions"].q99.tolist()


def test_delta_rule_dataset_stats(tmp_path):
    out = tmp_path / "ds"
    _, states, _, _ = write_dataset(out, lengths=(20, 25), freqs=(30, 30), rule="delta")
    stats = lr.compute_openpi_norm_stats(out, action_horizon=4, batch_size=5)
    reference = openpi_reference(states, [lr.episode_actions(s, "delta") for s in states], horizon=4, batch_size=5)
    assert_stats_close({k: v.to_json() for k, v in stats.items()}, reference)


def test_openpi_style_feature_names_are_accepted(dataset, tmp_path):
    out, *_ = dataset
    copy = tmp_path / "ds"
    shutil.copytree(out, copy)
    info_path = copy / "meta/info.json"
    info = json.loads(info_path.read_text())
    info["features"]["state"] = info["features"].pop("observation.state")
    info["features"]["actions"] = info["features"].pop("action")
    info_path.write_text(json.dumps(info))
    for p in (copy / "data").rglob("*.parquet"):
        t = pq.read_table(p)
        pq.write_table(t.rename_columns(["state" if c == "observation.state" else "actions" if c == "action" else c
                                         for c in t.column_names]), p)
    a, b = lr.compute_openpi_norm_stats(copy), lr.compute_openpi_norm_stats(out)
    assert a["state"].std.tolist() == b["state"].std.tolist()


# --------------------------------------------------------------------------- fail fast


def _copy_with_info(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    info_path = dst / "meta/info.json"
    info = json.loads(info_path.read_text())
    edit(info)
    info_path.write_text(json.dumps(info))
    return dst


def test_unconverted_folder_fails_at_once_naming_info_json(tmp_path):
    raw = tmp_path / "pick_place"
    raw.mkdir()
    (raw / "pick_place_0000.mcap").write_bytes(b"\x89MCAP0\r\n")
    with pytest.raises(DatasetError) as exc:
        lr.compute_openpi_norm_stats(raw)
    assert exc.value.code == "missing_metadata"
    assert str(raw / "meta" / "info.json") in str(exc.value) and "export-lerobot" in str(exc.value)
    with pytest.raises(DatasetError, match="dataset folder not found"):
        lr.compute_openpi_norm_stats(tmp_path / "nothing")


def test_other_codebase_version_names_both_versions(dataset, tmp_path):
    out, *_ = dataset
    copy = _copy_with_info(out, tmp_path / "ds", lambda i: i.update(codebase_version="v2.0"))
    with pytest.raises(DatasetError) as exc:
        lr.compute_openpi_norm_stats(copy)
    assert exc.value.code == "version_mismatch"
    assert "'v2.0'" in exc.value.reason and "'v2.1'" in exc.value.reason
    assert lr.compute_openpi_norm_stats(copy, expected_version="v2.0")["state"].mean.shape == (7,)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda i: i["features"].pop("action"), r"features has none of \['action', 'actions'\]"),
        (lambda i: i["features"]["observation.state"].update(shape=[6]), "shape \\[6\\] but 7 names"),
        (lambda i: i["features"]["observation.state"].update(shape=[6], names=None), r"vectors of length \[7\], feature shape is \[6\]"),
        (lambda i: i["features"]["action"].update(dtype="video"), "dtype 'video'"),
        (lambda i: i.update(total_frames=i["total_frames"] + 1), "total_frames"),
        (lambda i: i.pop("data_path"), "'data_path' is missing"),
    ],
)
def test_inconsistent_features_fail_with_the_field(dataset, tmp_path, edit, match):
    out, *_ = dataset
    copy = _copy_with_info(out, tmp_path / "ds", edit)
    with pytest.raises(DatasetError, match=match):
        lr.compute_openpi_norm_stats(copy)


def test_missing_parquet_and_wrong_row_count(dataset, tmp_path):
    out, *_ = dataset
    copy = tmp_path / "ds"
    shutil.copytree(out, copy)
    p = copy / "data/chunk-000/episode_000001.parquet"
    pq.write_table(pq.read_table(p).slice(0, 10), p)
    with pytest.raises(DatasetError, match="10 rows, but meta/episodes.jsonl says length 33"):
        lr.compute_openpi_norm_stats(copy)
    p.unlink()
    with pytest.raises(DatasetError, match="parquet file of episode 1 not found") as exc:
        lr.compute_openpi_norm_stats(copy)
    assert exc.value.path == str(p)


def test_rows_of_another_episode_are_found_and_the_file_named(dataset, tmp_path):
    out, *_ = dataset
    copy = tmp_path / "ds"
    shutil.copytree(out, copy)
    p = copy / "data/chunk-000/episode_000002.parquet"
    t = pq.read_table(p)
    t = t.set_column(t.column_names.index("episode_index"), "episode_index", pa.array([1] * t.num_rows, pa.int64()))
    pq.write_table(t, p)
    with pytest.raises(DatasetError, match=r"episode_index column holds \[1\], expected \[2\]") as exc:
        lr.compute_openpi_norm_stats(copy)
    assert exc.value.path == str(p)


def test_vectors_of_the_wrong_length_name_the_file(dataset, tmp_path):
    out, *_ = dataset
    copy = tmp_path / "ds"
    shutil.copytree(out, copy)
    p = copy / "data/chunk-000/episode_000001.parquet"
    t = pq.read_table(p)
    short = pa.array([row[:6] for row in t.column("action").to_pylist()], pa.list_(pa.float32()))
    pq.write_table(t.set_column(t.column_names.index("action"), "action", short), p)
    with pytest.raises(DatasetError, match=r"column 'action' holds vectors of length \[6\], feature shape is \[7\]") as exc:
        lr.compute_openpi_norm_stats(copy)
    assert exc.value.path == str(p)


def test_empty_dataset_fails(dataset, tmp_path):
    out, *_ = dataset
    copy = _copy_with_info(out, tmp_path / "ds", lambda i: i.update(total_episodes=0, total_frames=0))
    (copy / "meta/episodes.jsonl").write_text("")
    with pytest.raises(DatasetError, match="dataset is empty") as exc:
        lr.compute_openpi_norm_stats(copy)
    assert exc.value.code == "empty_dataset"


# --------------------------------------------------------------------------- no network, CLI

_NO_NETWORK_CHILD = textwrap.dedent(
    """
    import json, socket, sys
    attempts = []
    class NoSocket(socket.socket):
        def __init__(self, *a, **k):
            attempts.append(a)
            raise OSError("network disabled in this test")
    socket.socket = NoSocket
    socket.create_connection = lambda *a, **k: (attempts.append(a), NoSocket())[1]
    from dpflow_core.export import compute_openpi_norm_stats
    stats = compute_openpi_norm_stats(sys.argv[1])
    print(json.dumps({"attempts": len(attempts), "state_mean": stats["state"].mean.tolist(),
                      "actions_q99": stats["actions"].q99.tolist()}))
    """
)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0


def test_norm_stats_finish_without_network(dataset):
    out, _, states, _ = dataset
    cmd = [sys.executable, "-c", _NO_NETWORK_CHILD, str(out)]
    if _unshare_works():
        cmd = ["unshare", "-rn", *cmd]  # a network namespace with no interface but lo (down)
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["attempts"] == 0
    reference = openpi_reference(states, [lr.episode_actions(s, "next_state") for s in states])
    assert result["state_mean"] == pytest.approx(reference["state"]["mean"], rel=1e-6)
    assert result["actions_q99"] == pytest.approx(reference["actions"]["q99"], rel=1e-6)


@pytest.mark.parametrize("command", [["norm-stats", "--format", "openpi"], ["lerobot-norm-stats"]])
def test_cli_norm_stats_openpi(dataset, tmp_path, command):
    out, *_ = dataset
    dest = tmp_path / "norm_stats.json"
    proc = subprocess.run(["dpflow", *command, str(out), "-o", str(dest)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(dest)
    assert json.loads(dest.read_text()) == {"norm_stats": {k: v.to_json() for k, v in lr.compute_openpi_norm_stats(out).items()}}
    proc = subprocess.run(["dpflow", *command, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "meta/info.json not found" in proc.stderr
