"""Well-formed but wrong recordings that converted silently (issue 28): a camera stream of another episode
(``camera_pose_mismatch``) and a whole episode played backwards or a gyro whose sign is flipped (``imu_reversed``).

Ground truth by construction: the simulated world's recordings (both tasks) are written from their streams, and a
variant's streams are another episode's camera moved onto this one's clock (``fault_fixtures.camera_of``), every
stream reversed (``fault_fixtures.reversed_streams``, the frames re-encoded backwards), or the gyro negated."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpflow_core.conversion import ConversionSettings, align_episode, convert
from dpflow_core.errors import ConversionError
from dpflow_core.recordings import samples
from dpflow_core.recordings.camera_pose import check_camera_pose
from dpflow_core.recordings.plausibility import PlausibilityOptions
from dpflow_core.recordings.topics import DAS_DEFAULT
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.report import episode_quality
from fault_fixtures import camera_of, gyro_negated, record_world, reversed_streams

#: task -> (seeds of the episodes recorded, variants: stem suffix -> (kind, episode, other episode)). The last episode
#: is only a variant's base, never written itself: a gyro-negated copy keeps its camera's bytes, which conversion
#: refuses beside the original as a duplicate.
WORLD = {
    "pick_place": ((21, 22, 23, 24, 25), {"swap_01": ("swap", 0, 1), "swap_20": ("swap", 2, 0), "swap_32": ("swap", 3, 2),
                                          "reversed_1": ("reversed", 1, None), "gyro_4": ("gyro", 4, None)}),
    "stack": ((31, 32, 33, 34, 35), {"swap_10": ("swap", 1, 0), "swap_23": ("swap", 2, 3),
                                     "reversed_0": ("reversed", 0, None), "reversed_3": ("reversed", 3, None),
                                     "gyro_4": ("gyro", 4, None)}),
}
HONEST = 4
SETTINGS = ConversionSettings(image_size=(64, 64))
REVERSED_WHY = "the gyro turns against the pose track: the episode may be time-reversed, or the gyro's sign flipped"


def _record_world(root, task: str) -> dict:
    """The task's honest episodes and their variants in one folder, paired; each episode's streams kept."""
    seeds, variants = WORLD[task]
    make = {"swap": lambda i, j: lambda kept: camera_of(kept[i]["streams"], kept[j]["streams"]),
            "reversed": lambda i, _j: lambda kept: reversed_streams(kept[i]["streams"], kept[i]["backwards"]),
            "gyro": lambda i, _j: lambda kept: gyro_negated(kept[i]["streams"])}
    return record_world(root, task, seeds, HONEST, {s: (i, make[kind](i, j)) for s, (kind, i, j) in variants.items()})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Per task: the recordings, their conversion (no cache) and the dataset's metadata."""
    root = tmp_path_factory.mktemp("strangers")
    out = {}
    for task in WORLD:
        rec = _record_world(root, task)
        result = convert(rec["manifest"], root / f"{task}.npz", SETTINGS, cache=False, workers=1)
        out[task] = {**rec, "result": result, "meta": json.loads(result.sidecar_path.read_text()),
                     "rejected": {r["stem"]: r for r in result.rejected}}
    return out


def _variants(kind: str):
    return [(task, f"{task}_{s}") for task, (_, v) in WORLD.items() for s, (k, _i, _j) in v.items() if k == kind]


@pytest.mark.parametrize("task,stem", _variants("swap"))
def test_a_camera_of_another_episode_is_rejected_naming_the_imu_as_witness(world, task, stem):
    """Another episode's camera on this episode's clock converted without a word before (its offset was
    ``not_measurable``, or worse, measured): its fast image motion fits these poses at no offset, while the IMU of
    this episode fits them, so the camera is the stranger; no row of it reaches the dataset."""
    r = world[task]["rejected"][stem]
    assert r["code"] == "camera_pose_mismatch", r
    assert r["path"].endswith(f"{stem}_vio.mcap") and "camera_pose_mismatch: camera vs pose from 0.000" in r["reason"], r
    assert "is not explained by the pose track's fast rotation" in r["reason"], r["reason"]
    assert "the IMU's gyro fits the same poses" in r["reason"] and "the camera stream, not the pose track" in r["reason"]
    assert stem not in {e["stem"] for e in world[task]["meta"]["episodes"]}


@pytest.mark.parametrize("task,stem", _variants("reversed") + _variants("gyro"))
def test_a_reversed_episode_or_a_flipped_gyro_is_rejected(world, task, stem):
    """Every stream played backwards (stamps ascending), or the gyro's sign flipped: the gyro fits the track only
    negated, an improper map, so no reading fitted and nothing was said. Now ``imu_reversed``; the reversed
    episode's camera still fits its poses (a linear fit does not mind the direction), so nothing else is blamed."""
    r = world[task]["rejected"][stem]
    assert r["code"] == "imu_reversed", r
    assert REVERSED_WHY in r["reason"] and r["path"].endswith(f"{stem}_vio.mcap"), r
    assert "camera_pose_mismatch" not in r["reason"], r["reason"]
    assert stem not in {e["stem"] for e in world[task]["meta"]["episodes"]}


@pytest.mark.parametrize("task", list(WORLD))
def test_honest_world_episodes_convert_with_no_such_finding(world, task):
    w = world[task]
    honest = [s for s in w["stems"] if s[-4:].isdigit()]
    assert sorted(e["stem"] for e in w["meta"]["episodes"]) == honest, w["result"].rejected
    assert set(w["rejected"]) == set(w["stems"]) - set(honest)
    for e in w["meta"]["episodes"]:
        assert not [f for f in e["plausibility"]["findings"] if f["code"] in ("camera_pose_mismatch", "imu_reversed")]
        cam = e["camera_offset"]
        assert cam["fast_r2"] >= 0.9 * cam["fast_ceiling"] and cam["fast_ceiling"] >= 0.5 and cam["fast_rotation_rps"] > 0.06, cam
    policies = w["meta"]["options"]["content_checks"]["plausibility"]["policies"]
    assert (policies["camera_pose_mismatch"], policies["imu_reversed"]) == ("reject", "reject")
    assert int(w["meta"]["converter"]["version"]) >= 13
    buffer = ReplayBuffer(w["result"].path)
    assert buffer.n_episodes == len(honest)


def test_the_quality_report_names_both(world):
    w = world["pick_place"]
    found = {q.stem: {f["code"] for f in q.findings} for q in episode_quality(w["manifest"])}
    for stem, (kind, _i, _j) in ((f"pick_place_{s}", v) for s, v in WORLD["pick_place"][1].items()):
        assert ("camera_pose_mismatch" if kind == "swap" else "imu_reversed") in found[stem], (stem, found[stem])
    for stem in w["stems"][:HONEST]:
        assert not found[stem] & {"camera_pose_mismatch", "imu_reversed"}, (stem, found[stem])


def test_the_warn_policy_keeps_the_episode_and_lists_both(world):
    """(Another episode's camera shows its fingers moving when this gripper does not: ``gripper_offset`` too.)"""
    opts = PlausibilityOptions(policies={"camera_pose_mismatch": "warn", "imu_reversed": "warn", "gripper_offset": "warn"})
    settings = ConversionSettings(image_size=(64, 64), plausibility=opts)
    for stem, code in (("stack_swap_10", "camera_pose_mismatch"), ("stack_gyro_4", "imu_reversed")):
        a = align_episode(world["stack"]["dir"] / f"{stem}_vio.mcap", settings)
        (f,) = [f for f in a.report["plausibility"]["findings"] if f["code"] == code]
        assert f["action"] == "warned", f


# --------------------------------------------------------------------------- the random-motion samples


@pytest.fixture(scope="module")
def sample_streams(tmp_path_factory):
    """Random-motion sample episodes (slow smooth motion) written with their streams kept."""
    root = tmp_path_factory.mktemp("samples")
    real = samples.write_recording
    kept = {}
    for seed in (3, 4, 5):
        def write(task_dir, stem, rng, spec, topics, streams, _seed=seed):
            kept[_seed] = (spec, streams)
            return real(task_dir, stem, rng, spec, topics, streams)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(samples, "write_recording", write)
            samples.write_episode(root, f"honest_{seed}", samples.SampleSpec(seconds=6.0, width=96, height=72), seed=seed)
    for a, b in ((3, 4), (5, 3)):
        spec, streams = kept[a]
        real(root, f"swap_{a}{b}", np.random.default_rng(a), spec, DAS_DEFAULT, camera_of(streams, kept[b][1]))
    return root


@pytest.mark.parametrize("stem", ["honest_3", "honest_4", "honest_5", "swap_34", "swap_53"])
def test_slow_smooth_motion_is_never_judged(sample_streams, stem):
    """The samples' motion is slow and smooth (sinusoids under 0.35 Hz): two unrelated ones fit each other as well as
    an honest pair (raw R^2 0.53-0.97 either way), and their fast part is tracking noise (0.010-0.034 rad/s). So
    neither an honest sample nor one with another sample's camera gives a finding: it cannot be judged."""
    a = align_episode(sample_streams / f"{stem}_vio.mcap", ConversionSettings(image_size=(48, 36)))
    assert not [f for f in a.report["plausibility"]["findings"] if f["code"] == "camera_pose_mismatch"]
    cam = a.report["offsets"]["camera_offset"]
    assert cam["fast_rotation_rps"] is not None and cam["fast_rotation_rps"] < 0.06, cam


# --------------------------------------------------------------------------- the rule itself


def _offsets(fast_r2=0.3, ceiling=0.7, turn=0.15, imu="measured"):
    return {"camera_offset": {"r2": 0.7, "fast_r2": fast_r2, "fast_ceiling": ceiling, "fast_rotation_rps": turn},
            "imu_offset": {"status": imu, "r2": 0.99, "offset_s": 0.002}}


@pytest.mark.parametrize("offsets,found", [
    (_offsets(), True), (_offsets(fast_r2=0.55), True), (_offsets(fast_r2=0.57), False),
    (_offsets(turn=0.05), False), (_offsets(ceiling=0.25, fast_r2=0.05), False), (_offsets(fast_r2=None), False),
])
def test_the_rule_needs_ample_fast_motion_and_a_poor_fit(offsets, found):
    """Limit: 0.8 of the ceiling (0.7 here: 0.56); the VIO must turn 0.06 rad/s and the image stand 0.3 above its noise."""
    pose_ts = np.array([2_000_000_000, 9_000_000_000], np.int64)
    f = check_camera_pose(offsets, 1_000_000_000, pose_ts)
    assert bool(f) == found
    if found:
        assert (f[0].at_s, f[0].end_s, f[0].action) == (1.0, 8.0, "rejected") and f[0].limit == pytest.approx(0.56)


def test_without_the_imu_as_witness_the_pose_track_is_suspect_too():
    (f,) = check_camera_pose(_offsets(imu="not_measurable"), 0, np.array([0, 10**9], np.int64))
    assert "the IMU does not vouch for the poses either (not_measurable)" in f.describe()
