"""The LeRobot export's rate_policy (issue 28): an episode at another rate than its task's is resampled onto the
task's grid, written as a dataset of its own, or rejected, by the conversion's rule (the largest agreeing group).

Ground truth: each episode's state is a known smooth function of its capture times and each frame carries its own
index as a pattern, so a resampled step is checked against interpolation written here (linear; rotation by the
relative rotation's exponential, not scipy's Slerp) and against the true function, and every decoded frame is
identified (argmin of its error over the source frames) as the latest frame captured at or before its step.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
from scipy.spatial.transform import Rotation
from typer.testing import CliRunner

from dpflow_core import export as lr
from dpflow_core.errors import ConversionError
from test_lerobot import frame_times

HW = (48, 64)


def truth(t: np.ndarray, seed: int) -> np.ndarray:
    """(N, 7) float32 state of episode ``seed`` at times ``t`` (s): slow sines in position, rotation and width."""
    rng = np.random.default_rng(seed)
    w, ph = rng.uniform(0.5, 1.5, 7), rng.uniform(0, 6, 7)
    s = np.sin(t[:, None] * w + ph)
    return lr.episode_state(0.3 + 0.1 * s[:, :3], 0.4 * s[:, 3:6], 0.05 + 0.03 * s[:, 6]).astype(np.float32)


def marked_frames(n: int, seed: int) -> np.ndarray:
    """(n, H, W, 3) uint8; frame i differs from every other by its stripe phase and a bright block at column 4 * i."""
    h, w = HW
    ys, xs = np.mgrid[0:h, 0:w]
    frames = np.empty((n, h, w, 3), np.uint8)
    for i in range(n):
        frames[i, ..., 0] = 128 + 100 * np.sin(xs / 6.0 + 2.1 * i)
        frames[i, ..., 1] = 90 + 60 * np.cos(ys / 5.0 + seed)
        frames[i, ..., 2] = 40
        frames[i, 8:24, (4 * i) % (w - 4):(4 * i) % (w - 4) + 4, 2] = 250
    return frames


#: (frames, rate Hz) of the episodes: two at the task's 30 Hz, one at 15 Hz.
EPISODES = ((30, 30.0), (24, 30.0), (12, 15.0))


def episodes():
    out = []
    for k, (n, hz) in enumerate(EPISODES):
        t = frame_times(n, hz, k)
        out.append((truth(t, k), marked_frames(n, k), t))
    return out


def write(out: Path, eps, version: str, policy: str) -> lr.LeRobotExport:
    with lr.LeRobotWriter(out, "pick the cup", codebase_version=version) as writer:
        for k, (state, frames, t) in enumerate(eps):
            writer.add_episode(state, {lr.CAMERA_KEY: frames}, t, stem=f"ep{k}")
        return writer.finish(rate_policy=policy)


def interpolated(state: np.ndarray, t: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The expected resampled state: linear position/width; rotation R_k exp(a log(R_k^-1 R_k+1))."""
    k = np.clip(np.searchsorted(t, grid, side="right") - 1, 0, len(t) - 2)
    a = (grid - t[k]) / (t[k + 1] - t[k])
    lin = state[k] + a[:, None] * (state[k + 1] - state[k])
    r0, r1 = Rotation.from_rotvec(state[k, 3:6]), Rotation.from_rotvec(state[k + 1, 3:6])
    rot = r0 * Rotation.from_rotvec(a[:, None] * (r0.inv() * r1).as_rotvec())
    return np.concatenate([lin[:, :3], rot.as_rotvec(), lin[:, 6:]], axis=1)


def identify(decoded: np.ndarray, source: np.ndarray) -> list[int]:
    """For each decoded frame, the source frame it is closest to, and the worst PSNR to that frame (dB)."""
    d, s = decoded.astype(np.float64), source.astype(np.float64)
    errors = ((d[:, None] - s[None]) ** 2).mean(axis=(2, 3, 4))
    best = errors.argmin(axis=1)
    psnr = 10 * np.log10(255 ** 2 / errors[np.arange(len(d)), best].max())
    return best.tolist(), psnr


@pytest.mark.lerobot
@pytest.mark.slow
def test_resampled_episode_read_by_lerobot_matches_interpolation_and_held_frames(tmp_path):
    from test_lerobot_consumers import read_with_lerobot

    eps = episodes()
    out = tmp_path / "ds"
    result = write(out, eps, "v3.0", "resample")
    assert result.stems == ["ep0", "ep1", "ep2"] and result.resampled == ["ep2"] and result.skipped == {}
    rate = np.median([1 / np.median(np.diff(t)) for _, _, t in eps[:2]])  # the 30 Hz group's: its episodes' median
    state15, frames15, t15 = eps[2]
    grid = t15[0] + np.arange(int(np.floor((t15[-1] - t15[0]) * rate + 1e-6)) + 1) / rate
    assert len(grid) in (22, 23)  # 12 frames over 11/15 s -> 2 * 11 (+ 1) steps at 30 Hz, by the jitter

    arrays, meta = read_with_lerobot("0.4.4", out, tmp_path)
    n0, n1 = EPISODES[0][0], EPISODES[1][0]
    assert meta["num_episodes"] == 3 and meta["num_frames"] == n0 + n1 + len(grid)
    np.testing.assert_array_equal(arrays["episode_index"], np.repeat([0, 1, 2], [n0, n1, len(grid)]))
    got = arrays["state"][n0 + n1:]
    np.testing.assert_allclose(got, interpolated(state15, t15, grid), atol=2e-6)
    np.testing.assert_allclose(got, truth(grid, 2), atol=2e-3)  # interpolation error of a 1.5 rad/s sine at 15 Hz
    np.testing.assert_array_equal(arrays["action"][n0 + n1:], lr.episode_actions(got))
    np.testing.assert_array_equal(arrays["state"][:n0 + n1], np.concatenate([eps[0][0], eps[1][0]]))

    held = [int(np.flatnonzero(t15 <= g + 1e-6)[-1]) for g in grid]
    assert held[:6] == [0, 0, 1, 1, 2, 2]
    which, psnr = identify(arrays["frames_0"][n0 + n1:], frames15)
    assert which == held and psnr > 28, f"PSNR {psnr:.1f} dB"
    which, psnr = identify(arrays["frames_0"][:n0], eps[0][1])
    assert which == list(range(n0)) and psnr > 30

    record = json.loads((out / "meta/dpflow.json").read_text())
    rs = record["episodes"][2]["resampled"]
    assert (rs["frames_before"], rs["frames_after"]) == (12, len(grid)) and rs["to_hz"] == pytest.approx(rate, rel=1e-9)
    assert [w["code"] for w in record["warnings"]] == ["rate_resampled"] and record["rate_policy"] == "resample"
    assert lr.load_export(out).resampled == ["ep2"]


def _decoded(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


def test_group_writes_the_15hz_episode_as_its_own_dataset_and_reject_uses_the_largest_group(tmp_path):
    eps = episodes()
    out = tmp_path / "ds"
    result = write(out, eps, "v2.1", "group")
    group = tmp_path / "ds-15hz"
    assert result.stems == ["ep0", "ep1"] and result.resampled == [] and result.skipped == {}
    assert [(Path(g["path"]), g["n_episodes"], g["total_frames"], g["stems"]) for g in result.rate_groups] == [
        (group, 1, 12, ["ep2"])]
    info = json.loads((group / "meta/info.json").read_text())
    assert info["fps"] == pytest.approx(1 / np.median(np.diff(eps[2][2])), rel=1e-12) and 14.5 < info["fps"] < 15.5
    assert json.loads((out / "meta/info.json").read_text())["total_frames"] == 54
    table = pq.read_table(group / "data/chunk-000/episode_000000.parquet")
    np.testing.assert_array_equal(np.stack(table["observation.state"].to_numpy(zero_copy_only=False)), eps[2][0])
    which, psnr = identify(_decoded(group / f"videos/chunk-000/{lr.CAMERA_KEY}/episode_000000.mp4"), eps[2][1])
    assert which == list(range(12)) and psnr > 30
    assert json.loads((group / "meta/dpflow.json").read_text())["rate_group_of"] == str(out)
    assert lr.load_export(out).rate_groups == result.rate_groups
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folder left behind"

    (tmp_path / "other-15hz").mkdir()  # a rate group's folder is never overwritten either
    with pytest.raises(ConversionError, match="rate group folder already exists"):
        write(tmp_path / "other", eps, "v2.1", "group")
    assert not (tmp_path / "other").exists() and not any((tmp_path / "other-15hz").iterdir())

    # 10, 20, 30, 30 Hz: the median (25 Hz) agrees with none; the task's rate is the 30 Hz pair's
    mixed = [(truth(t, k), marked_frames(len(t), k), t)
             for k, (n, hz) in enumerate(((8, 10.0), (10, 20.0), (12, 30.0), (14, 30.0))) for t in [frame_times(n, hz, k)]]
    rejected = write(tmp_path / "mixed", mixed, "v3.0", "reject")
    assert rejected.stems == ["ep2", "ep3"] and set(rejected.skipped) == {"ep0", "ep1"}
    for stem, hz in (("ep0", 10), ("ep1", 20)):
        m = re.match(r"frequency_mismatch: measured ([\d.]+) Hz differs from the dataset's ([\d.]+) Hz", rejected.skipped[stem])
        assert m and float(m[1]) == pytest.approx(hz, rel=0.01) and float(m[2]) == pytest.approx(30, rel=0.01)


# --------------------------------------------------------------------------- through the CLI and the asset


@pytest.fixture(scope="module")
def mixed_manifest(tmp_path_factory) -> Path:
    """Two 30 Hz recordings and one at 15 Hz, paired."""
    from dpflow_core.pairing import pair_recordings, write_manifest
    from dpflow_core.recordings.samples import SampleSpec, write_episode, write_task

    spec = SampleSpec(seconds=3.4, width=64, height=48, gop_size=15)  # 15 Hz: 51 frames, over min_segment_frames (46)
    base = tmp_path_factory.mktemp("rates")
    write_task(base, episodes=2, seconds=spec.seconds, seed=7, task="pick_place", spec=spec)
    task = base / "pick_place"
    slow = write_episode(task, "pick_place_0002", replace(spec, fps=15.0), seed=8)
    summary = json.loads((task / "vio_result.json").read_text())
    summary["success_mcap_files"].append(slow.vio_mcap.name)
    (task / "vio_result.json").write_text(json.dumps(summary))
    return write_manifest(pair_recordings(task), base / "manifest.json")


def test_cli_rate_policy_reject_and_the_asset_config_group(mixed_manifest, tmp_path):
    from dpflow_core.cli import app
    from partitioned import materialize
    from test_lerobot_dagster import _upstream
    from dpflow_dagster.defs import lerobot as assets

    run = CliRunner().invoke(app, ["export-lerobot", str(mixed_manifest), "-o", str(tmp_path / "cli"),
                                   "--rate-policy", "reject", "--workers", "1"])
    assert run.exit_code == 0, run.output
    assert re.search(r"skipped pick_place_0002: frequency_mismatch: measured 1[45]\.\d+ Hz differs from the "
                     r"dataset's (29\.9|30\.0)\d* Hz", run.output), run.output
    assert lr.load_export(tmp_path / "cli").stems == ["pick_place_0000", "pick_place_0001"]
    bad = CliRunner().invoke(app, ["export-lerobot", str(mixed_manifest), "-o", str(tmp_path / "x"), "--rate-policy", "drop"])
    assert bad.exit_code != 0 and not (tmp_path / "x").exists()

    paired = {"manifest_path": str(mixed_manifest), "root": str(mixed_manifest.parent / "pick_place"),
              "task": "pick_place", "accepted": 3, "rejected": 0}
    result = materialize([_upstream(paired), assets.lerobot_dataset], "pick_place", run_config={"ops": {
        "lerobot_dataset": {"config": {"output_dir": str(tmp_path / "work"), "workers": 1, "rate_policy": "group"}}}})
    value = result.output_for_node("lerobot_dataset")
    assert value.stems == ["pick_place_0000", "pick_place_0001"] and value.skipped == {}
    (g,) = value.rate_groups
    assert g["stems"] == ["pick_place_0002"] and Path(g["path"]) == value.path.with_name(value.path.name + "-15hz")
    assert 14.5 < json.loads((Path(g["path"]) / "meta/info.json").read_text())["fps"] < 15.5
    assert value.path.name == lr.export_key(str(mixed_manifest), lr.ExportSettings(rate_policy="group"))[:16]
