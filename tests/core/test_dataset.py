"""Norm stats and validation of dataset.npz (dpflow_core.dataset)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from synthetic_dataset import synthetic_arrays, write_npz

from dpflow_core.dataset import CHECKS, compute_norm_stats, validate_dataset, write_norm_stats
from dpflow_core.errors import DatasetError

LOWDIM = ["robot0_demo_end_pose", "robot0_demo_start_pose", "robot0_eef_pos", "robot0_eef_rot_axis_angle",
          "robot0_gripper_width"]


@pytest.fixture()
def arrays():
    """Synthetic buffer whose low-dimensional members vary in every dimension."""
    a = synthetic_arrays(n_episodes=4, episode_length=[50, 60, 47, 70], image_size=(32, 24), frequency_hz=30.0)
    rng = np.random.default_rng(7)
    for key in LOWDIM:
        a[f"data__{key}"] = (a[f"data__{key}"] + rng.normal(0, 1e-3, a[f"data__{key}"].shape)).astype(np.float32)
    return a


def test_norm_stats_equal_numpy_reference(arrays, tmp_path):
    path = write_npz(tmp_path / "dataset.npz", arrays)
    stats = compute_norm_stats(path)
    assert sorted(stats["norm_stats"]) == LOWDIM
    for key in LOWDIM:
        ref = arrays[f"data__{key}"].astype(np.float64)
        got = stats["norm_stats"][key]
        np.testing.assert_allclose(got["mean"], ref.mean(axis=0), atol=1e-6, rtol=0)
        np.testing.assert_allclose(got["std"], ref.std(axis=0), atol=1e-6, rtol=0)
        np.testing.assert_allclose(got["min"], ref.min(axis=0), atol=1e-6, rtol=0)
        np.testing.assert_allclose(got["max"], ref.max(axis=0), atol=1e-6, rtol=0)
        np.testing.assert_allclose(got["q01"], np.quantile(ref, 0.01, axis=0), atol=1e-6, rtol=0)
        np.testing.assert_allclose(got["q99"], np.quantile(ref, 0.99, axis=0), atol=1e-6, rtol=0)
        assert got["count"] == 227
    sha = subprocess.run(["sha256sum", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]
    assert stats["dataset"]["sha256"] == sha
    assert stats["dataset"]["n_episodes"] == 4 and stats["dataset"]["frequency_hz"] == 30.0
    assert compute_norm_stats(path, sha256="given")["dataset"]["sha256"] == "given"


def test_write_norm_stats_never_overwrites(arrays, tmp_path):
    path = write_npz(tmp_path / "dataset.npz", arrays)
    stats = compute_norm_stats(path)
    out = write_norm_stats(stats, tmp_path / "norm_stats.json")
    assert json.loads(out.read_text()) == stats
    with pytest.raises(DatasetError, match="exists"):
        write_norm_stats({"x": 1}, out)
    assert json.loads(out.read_text()) == stats
    write_norm_stats({"x": 1}, out, overwrite=True)
    assert json.loads(out.read_text()) == {"x": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset.npz", "norm_stats.json"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "damage, words",
    [
        ("nan", ["'data__robot0_gripper_width'", "dimension 0", "NaN/inf", "step 5"]),
        ("inf", ["'data__robot0_eef_pos'", "dimension 1", "NaN/inf"]),
        ("lengths", ["inconsistent lengths", "data__robot0_eef_pos=226", "data__timestamp=227"]),
        ("ends", ["'meta__episode_ends'", "ends at 226", "227 steps"]),
        ("zero_var", ["'data__robot0_eef_pos'", "dimension 2", "zero variance"]),
        ("no_frequency", ["meta__info_json", "'frequency_hz'"]),
        ("missing_member", ["'data__robot0_gripper_width'", "missing"]),
        ("truncated", ["not a readable .npz"]),
    ],
)
def test_bad_metadata_is_an_immediate_error(arrays, tmp_path, damage, words):
    if damage == "nan":
        arrays["data__robot0_gripper_width"][5, 0] = np.nan
    elif damage == "inf":
        arrays["data__robot0_eef_pos"][9, 1] = np.inf
    elif damage == "lengths":
        arrays["data__robot0_eef_pos"] = arrays["data__robot0_eef_pos"][:-1]
    elif damage == "ends":
        arrays["meta__episode_ends"][-1] -= 1
    elif damage == "zero_var":
        arrays["data__robot0_eef_pos"][:, 2] = 0.25
    elif damage == "no_frequency":
        info = json.loads(arrays["meta__info_json"].tobytes())
        del info["frequency_hz"]
        arrays["meta__info_json"] = np.frombuffer(json.dumps(info).encode(), np.uint8).copy()
    elif damage == "missing_member":
        del arrays["data__robot0_gripper_width"]
    path = write_npz(tmp_path / "dataset.npz", arrays)
    if damage == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError) as err:
        compute_norm_stats(path)
    assert str(path) in str(err.value)
    for w in words:
        assert w in err.value.reason, (w, err.value.reason)


def test_single_episode_zero_variance_names_the_cause(tmp_path):
    path = write_npz(tmp_path / "d.npz", synthetic_arrays(n_episodes=1, episode_length=50))
    with pytest.raises(DatasetError, match="'data__robot0_demo_end_pose' dimension 0 has zero variance.*single episode"):
        compute_norm_stats(path)
    stats = compute_norm_stats(path, allow_zero_variance=True)
    assert stats["norm_stats"]["robot0_demo_end_pose"]["std"] == [0.0] * 6


def _by_name(results):
    assert [r.name for r in results] == list(CHECKS)
    return {r.name: r for r in results}


def test_validate_good_dataset(arrays, tmp_path):
    path = write_npz(tmp_path / "dataset.npz", arrays)
    res = _by_name(validate_dataset(path, image_size=(32, 24)))
    assert all(r.passed for r in res.values()), [r for r in res.values() if not r.passed]
    assert res["rotation_norm_le_pi"].metadata["max_norm_rad"] == pytest.approx(
        float(np.linalg.norm(arrays["data__robot0_eef_rot_axis_angle"].astype(np.float64), axis=1).max()))
    assert res["members_length_T"].metadata["data__camera0_rgb"] == 227
    # with the UMI default (46 steps) none is short; a stricter length flags exactly the short ones
    short = _by_name(validate_dataset(path, min_train_length=55))["short_episodes"]
    assert not short.passed and short.severity == "warn" and short.metadata["short_episodes"] == [0, 2]
    assert _by_name(validate_dataset(path, min_train_length=55, max_short_episodes=2))["short_episodes"].passed


def test_validate_flags_each_problem(arrays, tmp_path):
    arrays["data__robot0_eef_rot_axis_angle"][3] = [3.0, 1.0, 0.0]
    arrays["data__robot0_gripper_width"][7, 0] = np.nan
    path = write_npz(tmp_path / "dataset.npz", arrays)
    res = _by_name(validate_dataset(path, image_size=(64, 64)))
    assert not res["rotation_norm_le_pi"].passed and res["rotation_norm_le_pi"].metadata["over_pi"] == 1
    assert res["rotation_norm_le_pi"].metadata["max_norm_rad"] == pytest.approx(np.sqrt(10), rel=1e-6)
    assert not res["values_finite"].passed
    assert res["values_finite"].metadata["non_finite"] == {"data__robot0_gripper_width": 1}
    assert not res["image_size"].passed and res["image_size"].metadata["members"] == {"camera0_rgb": [32, 24]}
    assert res["members_length_T"].passed and res["episode_ends_valid"].passed and res["min_two_episodes"].passed

    one = write_npz(tmp_path / "one.npz", synthetic_arrays(n_episodes=1, episode_length=20))
    res = _by_name(validate_dataset(one))
    assert not res["min_two_episodes"].passed and res["min_two_episodes"].metadata["n_episodes"] == 1
    assert not res["short_episodes"].passed and res["short_episodes"].metadata["short_episodes"] == [0]


def test_validate_unopenable_dataset_fails_every_check(arrays, tmp_path):
    arrays["data__timestamp"] = arrays["data__timestamp"][:-2]
    path = write_npz(tmp_path / "dataset.npz", arrays)
    res = _by_name(validate_dataset(path))
    assert not any(r.passed for r in res.values())
    assert "inconsistent lengths" in res["members_length_T"].description
    assert "data__timestamp=225" in res["episode_ends_valid"].description


def test_one_reader_of_the_recorded_sha256_for_the_check_and_the_upload(arrays, tmp_path):
    from dpflow_core.dataset import check_recorded_sha256, read_recorded_sha256, recorded_sha256
    from dpflow_core.files import sha256_file

    path = write_npz(tmp_path / "dataset.npz", arrays)
    sidecar = tmp_path / "dataset.json"
    assert recorded_sha256(path) is None  # no sidecar: not written by dpflow
    missing = check_recorded_sha256(path, sidecar)
    assert not missing.passed and str(sidecar) in missing.description and "cannot read" in missing.description

    sidecar.write_text(json.dumps({"n_episodes": 4}))
    with pytest.raises(DatasetError) as err:
        recorded_sha256(path)
    assert err.value.code == "bad_sidecar" and err.value.path == str(sidecar)
    check = check_recorded_sha256(path, sidecar)
    assert not check.passed and check.description == str(err.value)

    digest = sha256_file(path)
    sidecar.write_text(json.dumps({"sha256": digest}))
    assert read_recorded_sha256(sidecar) == recorded_sha256(path) == digest
    assert check_recorded_sha256(path, sidecar).passed
