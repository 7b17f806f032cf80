"""An episode at another rate than its task's (issue 28): resampled to the dataset's rate, kept as a dataset
of its own, or rejected, as the user chooses; values checked against the recordings' ground truth."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.conversion.rates import rate_groups, sample_and_hold_grid
from dpflow_core.errors import ConversionError
from dpflow_core.recordings import samples
from test_conversion import manifest_for

SPEC = samples.SampleSpec(seconds=2.5, width=160, height=120, gop_size=15)
SIZE = (64, 48)
# (stem, rate Hz, seconds, seed): two at the task's rate, one slower and longer, one faster and shorter
EPISODES = [("a30", 30.0, 2.5, 41), ("b30", 30.0, 2.0, 42), ("c15", 15.0, 3.5, 43), ("d60", 60.0, 1.5, 44)]


def _t0_ns(seed: int) -> int:
    """The capture clock's origin of a sample episode (samples.write_episode draws it first from its seed)."""
    return samples._EPOCH_NS + seed * 3_600_000_000_000 + int(np.random.default_rng(seed).integers(0, 10**9))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("rates")
    eps = {stem: (samples.write_episode(root, stem, replace(SPEC, fps=hz, seconds=s), seed=seed), seed)
           for stem, hz, s, seed in EPISODES}
    for ep, seed in eps.values():  # the truth below is the generator's own trajectory
        t = (ep.pose_ts_ns.astype(np.int64) - _t0_ns(seed)) / 1e9
        np.testing.assert_allclose(samples.trajectory(t, seed)[0], ep.position_m, atol=1e-9)
    cache = root / "cache"
    manifest = manifest_for([e for e, _ in eps.values()], root)
    grouped = convert(manifest, root / "g" / "dataset.npz",
                      ConversionSettings(image_size=SIZE, rate_policy="group", min_segment_frames=20),
                      workers=1, cache=cache)
    resampled = convert(manifest, root / "r" / "dataset.npz",
                        ConversionSettings(image_size=SIZE, min_segment_frames=20), workers=1, cache=cache)
    return eps, grouped, resampled


def _episodes(path):
    meta = json.loads(path.with_suffix(".json").read_text())
    with np.load(path) as z:
        data = {k: z[k] for k in z.files if k.startswith("data__")}
    return {e["stem"]: (e, {k[6:]: v[e["start"]: e["start"] + e["length"]] for k, v in data.items()})
            for e in meta["episodes"]}, meta


def _check_truth(ep, seed, entry, arrays, pos_tol_m, rot_tol_rad):
    t_abs = (entry["start_ts_ns"] - _t0_ns(seed)) / 1e9 + arrays["timestamp"]
    pos, rotvec, _ = samples.trajectory(t_abs, seed)
    assert np.abs(arrays["robot0_eef_pos"] - pos).max() < pos_tol_m
    err = (Rotation.from_rotvec(arrays["robot0_eef_rot_axis_angle"]) * Rotation.from_rotvec(rotvec).inv()).magnitude()
    assert err.max() < rot_tol_rad
    truth_width = np.interp(entry["start_ts_ns"] + arrays["timestamp"] * 1e9, ep.gripper_ts_ns.astype(np.float64),
                            ep.gripper_width_m)
    assert np.abs(arrays["robot0_gripper_width"][:, 0] - truth_width).max() < 2e-3


def test_rate_groups_take_the_largest_agreeing_group_first():
    assert rate_groups([30.0, 15.0, 30.1, 60.0, 29.9], 0.05) == [[0, 2, 4], [1], [3]]
    assert rate_groups([15.0, 30.0], 0.05) == [[0], [1]]  # no mean of two settings (22.5 Hz fits neither)
    grid, source = sample_and_hold_grid(np.array([0.0, 0.066, 0.134, 0.2]), 30.0)
    assert np.allclose(grid, np.arange(7) / 30.0) and source.tolist() == [0, 0, 1, 1, 1, 2, 3]  # 0.1333 s is before 0.134 s


def test_group_keeps_each_rate_as_its_own_dataset(recorded):
    eps, grouped, _ = recorded
    assert grouped.n_episodes == 2 and not grouped.rejected
    assert grouped.frequency_hz == pytest.approx(30.0, rel=0.01)
    groups = {round(g["frequency_hz"]): g for g in grouped.metadata["rate_groups"]}
    assert set(groups) == {15, 60} and groups[15]["episodes"] == ["c15"] and groups[60]["episodes"] == ["d60"]
    for hz, stem in ((15, "c15"), (60, "d60")):
        path = grouped.path.with_name(f"dataset-{hz}hz.npz")
        assert groups[hz]["path"] == str(path) and path.with_suffix(".json").exists()
        (entry, arrays), = _episodes(path)[0].values()
        assert entry["stem"] == stem and entry["resampled"] is None
        assert np.median(np.diff(arrays["timestamp"])) == pytest.approx(1 / hz, rel=0.02)
        _check_truth(*eps[stem], entry, arrays, 2e-3, 0.01)


def test_resample_puts_every_episode_on_the_dataset_grid(recorded):
    eps, grouped, resampled = recorded
    assert resampled.n_episodes == 4 and not resampled.rejected
    episodes, meta = _episodes(resampled.path)
    assert [e["stem"] for e in meta["episodes"]] == ["a30", "b30", "c15", "d60"]  # resampled ones after the others
    assert {w["stem"] for w in meta["warnings"] if w["code"] == "rate_resampled"} == {"c15", "d60"}
    native, _ = _episodes(grouped.path)
    for stem in ("a30", "b30"):  # untouched: the same rows as without any other-rate episode
        for key, values in native[stem][1].items():
            assert np.array_equal(episodes[stem][1][key], values), key
    for hz, stem in ((15, "c15"), (60, "d60")):
        entry, arrays = episodes[stem]
        own_entry, own = next(iter(_episodes(grouped.path.with_name(f"dataset-{hz}hz.npz"))[0].values()))
        rs = entry["resampled"]
        assert rs["from_hz"] == pytest.approx(hz, rel=0.02) and rs["to_hz"] == pytest.approx(30.0, rel=0.01)
        assert rs["frames_before"] == own_entry["length"] and rs["frames_after"] == entry["length"]
        assert np.allclose(np.diff(arrays["timestamp"]), 1 / rs["to_hz"])
        assert arrays["timestamp"][-1] <= own["timestamp"][-1] + 1e-9 < arrays["timestamp"][-1] + 1 / rs["to_hz"]
        # each step shows the latest frame captured at or before it, row for row
        held = np.searchsorted(own["timestamp"], arrays["timestamp"] + 1e-6, side="right") - 1
        assert np.array_equal(arrays["camera0_rgb"], own["camera0_rgb"][held])
        _check_truth(*eps[stem], entry, arrays, 3e-3, 0.015)
        assert np.array_equal(arrays["robot0_demo_start_pose"][0], own["robot0_demo_start_pose"][0])
    with pytest.raises(ConversionError, match="rate_policy must be one of"):
        convert(manifest_for([e for e, _ in eps.values()], grouped.path.parent), grouped.path.parent / "x.npz",
                ConversionSettings(image_size=SIZE, rate_policy="drop"))
