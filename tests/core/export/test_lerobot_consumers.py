"""The exports as their consumers read them: lerobot 0.4.4 reads v3.0, lerobot 0.3.3 reads v2.1.

Each test writes a small dataset (3 episodes of 21-40 frames, 48x64 frames), then runs
tests/lerobot_reader.py in a subprocess with the interpreter of the lerobot environment that
``scripts/setup-lerobot.sh`` made (``.venv-lerobot-0.4``, ``.venv-lerobot-0.3``: lerobot with
``--no-deps``, our CPU torch, and only what ``lerobot.datasets`` imports). The reader goes through
``LeRobotDataset.__getitem__`` for every frame, and the values are compared with the arrays the
dataset was written from.

Not lerobot's own, because torchvision does not import beside the CPU torch wheel: the video
decoder. A stand-in ``torchvision`` module lets lerobot's modules import, and lerobot's
``decode_video_frames`` is replaced by a PyAV decoder that gets the file and timestamps lerobot
computes and applies lerobot's tolerance rule (see tests/lerobot_reader.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import REPO, require_service
from dpflow_core import export as lr
from test_lerobot import frame_times, synthetic_episode

pytestmark = [pytest.mark.lerobot, pytest.mark.slow]

LENGTHS = (40, 21, 33)
READER = REPO / "tests" / "lerobot_reader.py"


def lerobot_python(version: str) -> Path:
    """The interpreter of ``.venv-lerobot-<major.minor>``; skipped (failed under CI) when it is missing."""
    python = REPO / f".venv-lerobot-{version.rsplit('.', 1)[0]}" / "bin" / "python"
    require_service(f"lerobot {version}", None if python.is_file() else f"{python} not found")
    return python


@pytest.fixture(scope="module")
def episodes():
    """Per episode: state (N, 7), frames (N, 48, 64, 3), capture times (N,) at about 30 Hz."""
    out = []
    for k, n in enumerate(LENGTHS):
        state, frames = synthetic_episode(n, k)
        out.append((state, frames, frame_times(n, 30.0, k)))
    return out


def write(out: Path, episodes, version: str, **options) -> lr.LeRobotExport:
    with lr.LeRobotWriter(out, "pick the cup", codebase_version=version, **options) as writer:
        for k, (state, frames, times) in enumerate(episodes):
            writer.add_episode(state, {lr.CAMERA_KEY: frames}, times, stem=f"ep{k}")
        return writer.finish()


def read_with_lerobot(version: str, dataset: Path, tmp_path: Path, source: Path | None = None) -> tuple[dict, dict]:
    python = lerobot_python(version)
    out = tmp_path / "read.npz"
    cmd = [str(python), str(READER), str(dataset), str(out)] + ([str(source)] if source else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads(str(arrays.pop("meta")))


def assert_same_as_source(arrays: dict, meta: dict, episodes, result: lr.LeRobotExport) -> None:
    n = sum(LENGTHS)
    assert meta["num_frames"] == n and meta["num_episodes"] == 3 and meta["tasks"] == ["pick the cup"]
    assert meta["fps"] == pytest.approx(result.fps, rel=1e-12)
    np.testing.assert_array_equal(arrays["state"], np.concatenate([e[0] for e in episodes]))
    np.testing.assert_array_equal(arrays["action"], np.concatenate([lr.episode_actions(e[0]) for e in episodes]))
    frame_index = np.concatenate([np.arange(k) for k in LENGTHS])
    np.testing.assert_array_equal(arrays["frame_index"], frame_index)
    np.testing.assert_array_equal(arrays["episode_index"], np.repeat(np.arange(3), LENGTHS))
    np.testing.assert_array_equal(arrays["index"], np.arange(n))
    np.testing.assert_allclose(arrays["timestamp"], frame_index / result.fps, atol=1e-6)
    frames, start = arrays["frames_0"].astype(np.float64), 0
    for k, (_, source, _) in enumerate(episodes):
        got = frames[start:start + len(source)]
        psnr = 10 * np.log10(255 ** 2 / np.mean((got - source) ** 2))
        assert psnr > 30, f"episode {k}: PSNR {psnr:.1f} dB"
        # each decoded frame is its own source frame, not a neighbour (the frames change over time)
        for i in (0, len(source) // 2, len(source) - 1):
            errors = [np.mean((got[i] - source[j]) ** 2) for j in range(len(source))]
            assert int(np.argmin(errors)) == i, f"episode {k} frame {i} decoded as frame {int(np.argmin(errors))}"
        start += len(source)


def test_v30_export_is_read_by_lerobot_0_4(episodes, tmp_path):
    """Every frame through lerobot 0.4.4's LeRobotDataset; three data files (one per episode, by a small
    data_files_size_in_mb) and one video file holding the three episodes one after the other; and
    meta/stats.json equal to lerobot's own compute_episode_stats + aggregate_stats of the source arrays."""
    out = tmp_path / "ds"
    result = write(out, episodes, "v3.0", data_files_size_in_mb=1e-6)
    assert sorted(p.relative_to(out).as_posix() for p in (out / "data").rglob("*.parquet")) == [
        f"data/chunk-000/file-{k:03d}.parquet" for k in range(3)]
    assert sorted(p.name for p in (out / "videos").rglob("*.mp4")) == ["file-000.mp4"]
    source = tmp_path / "source.npz"
    np.savez(source, **{f"{name}_{k}": v for k, (s, f, _) in enumerate(episodes)
                        for name, v in (("state", s), ("action", lr.episode_actions(s)), ("frames", f))})
    arrays, meta = read_with_lerobot("0.4.4", out, tmp_path, source)
    assert meta["lerobot_version"] == "0.4.4" and meta["codebase_version"] == "v3.0"
    assert [Path(f).name for f in meta["video_files"]] == ["file-000.mp4"]
    assert_same_as_source(arrays, meta, episodes, result)

    ours = json.loads((out / "meta/stats.json").read_text())
    assert meta["stats"] == ours  # what lerobot loaded is what we wrote
    theirs = meta["lerobot_stats"]
    for feature in ("observation.state", "action", lr.CAMERA_KEY):
        assert set(ours[feature]) == {"min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99"}
        for name, value in theirs[feature].items():
            if name == "std" and feature == lr.CAMERA_KEY:
                continue  # lerobot squares uint8 pixels (wraps around); ours is checked below
            # lerobot accumulates float32 vectors in float32: means and std agree to ~1e-4 relative
            np.testing.assert_allclose(ours[feature][name], value, rtol=1e-3 if name == "std" else 1e-5, atol=1e-7,
                                       err_msg=f"{feature}.{name}")
    # the camera's std: pooled over episodes from the exact std of the pixels lerobot samples
    idx = [lr.stats.sample_frame_indices(len(f)) for _, f, _ in episodes]
    pixels = [f[i].reshape(-1, 3).astype(np.float64) / 255 for (_, f, _), i in zip(episodes, idx)]
    counts = np.array([len(i) for i in idx], dtype=np.float64)
    means = np.array([p.mean(0) for p in pixels])
    total = (means * counts[:, None]).sum(0) / counts.sum()
    pooled = (((np.array([p.std(0) for p in pixels]) ** 2) + (means - total) ** 2) * counts[:, None]).sum(0) / counts.sum()
    np.testing.assert_allclose(np.ravel(ours[lr.CAMERA_KEY]["std"]), np.sqrt(pooled), rtol=1e-9)

    episodes_index = pq.read_table(out / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [e["data/file_index"] for e in episodes_index] == [0, 1, 2]
    to = [e[f"videos/{lr.CAMERA_KEY}/to_timestamp"] for e in episodes_index]
    assert [e[f"videos/{lr.CAMERA_KEY}/from_timestamp"] for e in episodes_index] == [0.0, to[0], to[1]]
    np.testing.assert_allclose(to, np.cumsum(LENGTHS) / result.fps, rtol=1e-12)


def test_v21_export_is_read_by_lerobot_0_3(episodes, tmp_path):
    """Every frame through lerobot 0.3.3's LeRobotDataset (the v2.1 reader openpi pins): one parquet file
    and one video per episode, lerobot's timestamp sync check passing at the measured fps."""
    out = tmp_path / "ds"
    result = write(out, episodes, "v2.1")
    arrays, meta = read_with_lerobot("0.3.3", out, tmp_path)
    assert meta["lerobot_version"] == "0.3.3" and meta["codebase_version"] == "v2.1"
    assert [Path(f).name for f in meta["video_files"]] == [f"episode_{k:06d}.mp4" for k in range(3)]
    assert_same_as_source(arrays, meta, episodes, result)
