"""LeRobot v3.0 layout facts, fail-fast metadata errors, and openpi norm stats of both formats.

The values themselves are proven by lerobot in tests/core/export/test_lerobot_consumers.py; here: the files
lerobot 0.4 expects, each missing or malformed piece of metadata giving an immediate error that
names the file and the field, and openpi's statistics (with and without its delta-action
transform) against :func:`test_lerobot.openpi_reference` on 3 episodes of different gripper ranges.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpflow_core import export as lr
from dpflow_core.errors import DatasetError
from test_lerobot import assert_stats_close, frame_times, openpi_reference, synthetic_episode

#: Gripper ranges (m) of the 3 episodes: each widens the histogram range of the one before.
GRIPPER = ((0.040, 0.050), (0.010, 0.030), (0.070, 0.095))


def _episodes():
    out = []
    for k, ((lo, hi), n) in enumerate(zip(GRIPPER, (45, 38, 52))):
        state, frames = synthetic_episode(n, k, hw=(32, 32))
        state[:, 6] = lo + (hi - lo) * (0.5 + 0.5 * np.sin(np.arange(n) / 4.0 + k))
        out.append((state, frames, frame_times(n, 30.0, k)))
    return out


def _write(out, version, rule="next_state"):
    with lr.LeRobotWriter(out, "pick the cup", rule, codebase_version=version) as writer:
        for k, (s, f, t) in enumerate(_episodes()):
            writer.add_episode(s, {lr.CAMERA_KEY: f}, t, stem=f"ep{k}")
        return writer.finish()


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    base = tmp_path_factory.mktemp("lerobot_v30")
    return {v: (_write(base / v, v), base / v) for v in ("v3.0", "v2.1")}


def test_v30_layout_and_info(datasets):
    result, out = datasets["v3.0"]
    info = json.loads((out / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and result.codebase_version == "v3.0"
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 45 + 38 + 52, 1)
    assert (info["chunks_size"], info["data_files_size_in_mb"], info["video_files_size_in_mb"]) == (1000, 100, 200)
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert info["splits"] == {"train": "0:3"} and info["robot_type"] == lr.ROBOT_TYPE
    assert info["features"][lr.CAMERA_KEY]["info"]["video.codec"] == "h264"
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["data/chunk-000/file-000.parquet", "meta/dpflow.json", "meta/episodes/chunk-000/file-000.parquet",
                     "meta/info.json", "meta/stats.json", "meta/tasks.parquet",
                     f"videos/{lr.CAMERA_KEY}/chunk-000/file-000.mp4"]
    episodes = pq.read_table(out / "meta/episodes/chunk-000/file-000.parquet")
    assert episodes.column("tasks").to_pylist() == [["pick the cup"]] * 3
    assert episodes.column("dataset_from_index").to_pylist() == [0, 45, 83]
    gripper_max = [row[6] for row in episodes.column("stats/observation.state/max").to_pylist()]
    np.testing.assert_allclose(gripper_max, [hi for _, hi in GRIPPER], atol=2e-4)


@pytest.mark.parametrize("version", ["v3.0", "v2.1"])
@pytest.mark.parametrize("mask", [None, [True] * 6 + [False]], ids=["no transform", "delta actions 6,-1"])
def test_openpi_norm_stats_equal_openpis_method(datasets, version, mask):
    _, out = datasets[version]
    states = [e[0] for e in _episodes()]
    actions = [lr.episode_actions(s) for s in states]
    got = lr.compute_openpi_norm_stats(out, action_horizon=10, batch_size=8, delta_action_mask=mask)
    assert_stats_close({k: v.to_json() for k, v in got.items()},
                       openpi_reference(states, actions, horizon=10, batch_size=8, mask=mask))
    if mask is not None:  # the gripper stays absolute: its action range is the union of the episodes' ranges
        assert got["actions"].q01[6] >= GRIPPER[1][0] - 1e-3 and got["actions"].q99[6] <= GRIPPER[2][1] + 1e-3


def test_both_formats_give_the_same_norm_stats_and_the_cli_takes_the_mask(datasets, tmp_path):
    stats = [lr.compute_openpi_norm_stats(datasets[v][1], delta_action_mask=[True] * 6 + [False]) for v in ("v3.0", "v2.1")]
    assert {k: v.to_json() for k, v in stats[0].items()} == {k: v.to_json() for k, v in stats[1].items()}
    dest = tmp_path / "norm_stats.json"
    proc = subprocess.run(["dpflow", "norm-stats", "--format", "openpi", str(datasets["v3.0"][1]), "-o", str(dest),
                           "--delta-actions", "6,-1"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(dest.read_text())["norm_stats"] == {k: v.to_json() for k, v in stats[0].items()}
    bad = subprocess.run(["dpflow", "lerobot-norm-stats", str(datasets["v3.0"][1]), "--delta-actions", "six"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--delta-actions must be counts like 6,-1" in bad.stderr


def _broken(datasets, tmp_path, edit):
    copy = tmp_path / "ds"
    shutil.copytree(datasets["v3.0"][1], copy)
    edit(copy)
    with pytest.raises(DatasetError) as exc:
        lr.compute_openpi_norm_stats(copy)
    return copy, exc.value


def _drop_column(copy, column):
    path = copy / "meta/episodes/chunk-000/file-000.parquet"
    t = pq.read_table(path)
    pq.write_table(t.drop_columns([column]), path)


def _edit_stats(copy, fn):
    path = copy / "meta/stats.json"
    stats = json.loads(path.read_text())
    fn(stats)
    path.write_text(json.dumps(stats))


@pytest.mark.parametrize(
    "edit, file, match",
    [
        (lambda c: (c / "meta/info.json").unlink(), "meta/info.json", "meta/info.json not found"),
        (lambda c: (c / "meta/info.json").write_text("{"), "meta/info.json", "not valid JSON"),
        (lambda c: (c / "meta/stats.json").unlink(), "meta/stats.json", "meta/stats.json not found"),
        (lambda c: (c / "meta/stats.json").write_text("[1,"), "meta/stats.json", "not valid JSON"),
        (lambda c: _edit_stats(c, lambda s: s.pop("action")), "meta/stats.json", "no statistics for feature 'action'"),
        (lambda c: _edit_stats(c, lambda s: s["observation.state"].update(std=[1.0])), "meta/stats.json",
         r"field observation.state.std is missing or not a list of 7 numbers"),
        (lambda c: shutil.rmtree(c / "meta/episodes"), "meta/episodes", "no episode index"),
        (lambda c: (c / "meta/episodes/chunk-000/file-000.parquet").write_bytes(b"PAR1 broken"),
         "meta/episodes/chunk-000/file-000.parquet", "not a readable parquet file"),
        (lambda c: _drop_column(c, "dataset_to_index"), "meta/episodes/chunk-000/file-000.parquet",
         r"lacks the columns \['dataset_to_index'\]"),
        (lambda c: (c / "meta/tasks.parquet").unlink(), "meta/tasks.parquet", "meta/tasks.parquet not found"),
        (lambda c: (c / "data/chunk-000/file-000.parquet").unlink(), "data/chunk-000/file-000.parquet",
         "parquet file of episode 0 not found"),
    ],
    ids=["no info", "bad info", "no stats", "bad stats", "stats lack action", "stats shape", "no episode index",
         "bad episode index", "index lacks a column", "no tasks", "no data"],
)
def test_missing_or_malformed_metadata_names_the_file_and_field(datasets, tmp_path, edit, file, match):
    copy, err = _broken(datasets, tmp_path, edit)
    assert err.path is not None and str(err.path).endswith(file.split("/")[-1]) and str(copy) in str(err.path)
    assert re.search(match, err.reason), err.reason


def test_episode_index_lengths_must_match_the_data(datasets, tmp_path):
    def edit(copy):
        path = copy / "meta/episodes/chunk-000/file-000.parquet"
        t = pq.read_table(path)
        lengths = t.column("length").to_pylist()
        lengths[1] += 1
        pq.write_table(t.set_column(t.column_names.index("length"), "length", pa.array(lengths, pa.int64())), path)

    _, err = _broken(datasets, tmp_path, edit)
    assert "dataset_to_index - dataset_from_index differs from length 39" in err.reason


@pytest.mark.parametrize("rule", ["next_state", "delta"])
def test_rot6d_state_and_actions(tmp_path, rule):
    """rotation="rot6d": 10-D state and action, the rotation as the first two columns of R (scipy as the
    independent reference); a delta action's rotation is R[t+1] R[t]^-1, the identity on the last frame."""
    from scipy.spatial.transform import Rotation

    out = tmp_path / "ds"
    with lr.LeRobotWriter(out, "pick", rule, rotation="rot6d") as writer:
        for k, (s, f, t) in enumerate(_episodes()[:2]):
            writer.add_episode(s, {lr.CAMERA_KEY: f}, t, stem=f"ep{k}")
        writer.finish()
    info = json.loads((out / "meta/info.json").read_text())
    names = ["eef_pos_x", "eef_pos_y", "eef_pos_z", *(f"eef_rot6d_{i}" for i in range(6)), "gripper_width"]
    assert info["features"]["observation.state"] == {"dtype": "float32", "shape": [10], "names": names}
    assert info["features"]["action"]["shape"] == [10]
    table = pq.read_table(out / "data/chunk-000/file-000.parquet")
    state = table.column("observation.state").combine_chunks().flatten().to_numpy().reshape(-1, 10)
    action = table.column("action").combine_chunks().flatten().to_numpy().reshape(-1, 10)
    source = _episodes()[0][0]
    n = len(source)
    mats = Rotation.from_rotvec(source[:, 3:6].astype(np.float64)).as_matrix()
    np.testing.assert_allclose(state[:n, 3:9], np.concatenate([mats[:, :, 0], mats[:, :, 1]], axis=1), atol=1e-6)
    np.testing.assert_array_equal(state[:n, [0, 1, 2, 9]], source[:, [0, 1, 2, 6]])
    if rule == "next_state":
        np.testing.assert_array_equal(action[:n - 1], state[1:n])
    else:
        rel = Rotation.from_matrix(mats[1:]) * Rotation.from_matrix(mats[:-1]).inv()
        r = rel.as_matrix()
        np.testing.assert_allclose(action[:n - 1, 3:9], np.concatenate([r[:, :, 0], r[:, :, 1]], axis=1), atol=1e-5)
        np.testing.assert_allclose(action[n - 1, 3:9], [1, 0, 0, 0, 1, 0], atol=1e-7)
    stats = lr.compute_openpi_norm_stats(out, action_horizon=5, batch_size=8, delta_action_mask=[True] * 9 + [False])
    assert stats["state"].mean.shape == stats["actions"].q99.shape == (10,)


def test_video_files_roll_over_at_their_size_limit(tmp_path):
    """A tiny video_files_size_in_mb: every episode starts a new video file at from_timestamp 0, and each
    file holds exactly its episode's frames; the data stays in one file."""
    import av

    out = tmp_path / "ds"
    episodes = _episodes()
    with lr.LeRobotWriter(out, "pick", codebase_version="v3.0", video_files_size_in_mb=1e-6, chunks_size=2) as writer:
        for k, (s, f, t) in enumerate(episodes):
            writer.add_episode(s, {lr.CAMERA_KEY: f}, t, stem=f"ep{k}")
        result = writer.finish()
    index = pq.read_table(out / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    key = lr.CAMERA_KEY
    # chunks_size 2: the third file opens chunk-001 (lerobot's update_chunk_file_indices)
    assert [(e[f"videos/{key}/chunk_index"], e[f"videos/{key}/file_index"]) for e in index] == [(0, 0), (0, 1), (1, 0)]
    assert [e[f"videos/{key}/from_timestamp"] for e in index] == [0.0, 0.0, 0.0]
    assert [e["data/file_index"] for e in index] == [0, 0, 0]
    for e, (s, _, _) in zip(index, episodes):
        path = out / f"videos/{key}/chunk-{e[f'videos/{key}/chunk_index']:03d}/file-{e[f'videos/{key}/file_index']:03d}.mp4"
        with av.open(str(path)) as c:
            assert sum(1 for _ in c.decode(video=0)) == len(s)
        assert e[f"videos/{key}/to_timestamp"] == pytest.approx(len(s) / result.fps, rel=1e-12)
