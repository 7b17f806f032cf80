"""A gripper-width stream stamped off the camera's clock (issue 28, ``gripper_offset``): every gripper stamp shifted
by a second converted silently, and the policy learned to close the gripper a second after the fingers closed.

Ground truth by construction: the simulated world's recordings (both tasks, 64 x 64 px) are written from their
streams, and a variant is an episode whose gripper stamps are moved by a known shift
(``fault_fixtures.gripper_shifted``); the wrist camera sees the fingers, so the offset is measured from the image."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from dpflow_core.conversion import ConversionSettings, align_episode, convert
from dpflow_core.recordings import samples
from dpflow_core.recordings.gripper_timing import check_gripper_offset
from dpflow_core.recordings.plausibility import PlausibilityOptions
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.report import episode_quality
from fault_fixtures import gripper_shifted, record_world

#: task -> (seeds, variants: stem suffix -> (episode, shift s)). The first HONEST episodes are written as recorded; the
#: others only as a variant's base (a shifted copy keeps its camera's bytes, refused beside the original as a duplicate).
WORLD = {
    "pick_place": ((41, 42, 43, 44), {"late_1.0": (2, 1.0), "early_0.5": (3, -0.5)}),
    "stack": ((51, 52, 53, 54), {"early_1.0": (2, -1.0), "late_0.3": (3, 0.3)}),
}
HONEST = 2
SETTINGS = ConversionSettings(image_size=(64, 64))
MEASURED = re.compile(r"the gripper width's stamps are (\d+\.\d{3}) s (later|earlier) than the pose clock's")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Per task: the recordings, their conversion (no cache) and the dataset's metadata."""
    root = tmp_path_factory.mktemp("gripper_offset")
    out = {}
    for task, (seeds, variants) in WORLD.items():
        make = {s: (k, lambda kept, _k=k, _sh=sh: gripper_shifted(kept[_k]["streams"], _sh)) for s, (k, sh) in variants.items()}
        rec = record_world(root, task, seeds, HONEST, make)
        result = convert(rec["manifest"], root / f"{task}.npz", SETTINGS, cache=False, workers=1)
        out[task] = {**rec, "result": result, "meta": json.loads(result.sidecar_path.read_text()),
                     "rejected": {r["stem"]: r for r in result.rejected}}
    return out


def _shifted():
    return [(task, f"{task}_{s}", sh) for task, (_, v) in WORLD.items() for s, (_k, sh) in v.items()]


@pytest.mark.parametrize("task,stem,shift", _shifted())
def test_a_gripper_stamped_off_the_camera_clock_is_rejected_with_its_measured_offset(world, task, stem, shift):
    """Shifts of -1.0, -0.5, +0.3 and +1.0 s converted without a word before; now each is ``gripper_offset``, its
    reason names the file, the stream, the time and the offset measured from the fingers' image change (within
    0.03 s of the shift, its sign included), and no row of it reaches the dataset."""
    r = world[task]["rejected"][stem]
    assert r["code"] == "gripper_offset", r
    assert r["path"].endswith(f"{stem}_vio.mcap") and "gripper_offset: gripper from " in r["reason"], r
    (value, direction), = MEASURED.findall(r["reason"])
    assert float(value) == pytest.approx(abs(shift), abs=0.03) and direction == ("later" if shift > 0 else "earlier")
    assert "(limit 0.25 s)" in r["reason"] and "(policy gripper_offset=reject)" in r["reason"], r["reason"]
    assert stem not in {e["stem"] for e in world[task]["meta"]["episodes"]}


@pytest.mark.parametrize("task", list(WORLD))
def test_honest_world_episodes_measure_near_zero_and_convert(world, task):
    w = world[task]
    honest = w["stems"][:HONEST]
    assert sorted(e["stem"] for e in w["meta"]["episodes"]) == honest, w["result"].rejected
    assert set(w["rejected"]) == set(w["stems"]) - set(honest)
    for e in w["meta"]["episodes"]:
        g = e["gripper_offset"]
        assert g["status"] == "measured" and abs(e["gripper_offset_s"]) < 0.03, g
        assert g["r2"] >= 0.6 and g["contrast"] >= 0.5 and g["travel_m"] > 0.04 and g["cells"], g
        assert not [f for f in e["plausibility"]["findings"] if f["code"] == "gripper_offset"]
    assert w["meta"]["options"]["content_checks"]["plausibility"]["policies"]["gripper_offset"] == "reject"
    assert int(w["meta"]["converter"]["version"]) >= 13
    assert ReplayBuffer(w["result"].path).n_episodes == len(honest)


def test_the_quality_report_names_it(world):
    w = world["pick_place"]
    found = {q.stem: {f["code"] for f in q.findings} for q in episode_quality(w["manifest"])}
    for stem in w["stems"][HONEST:]:
        assert "gripper_offset" in found[stem], (stem, found[stem])
    for stem in w["stems"][:HONEST]:
        assert "gripper_offset" not in found[stem], (stem, found[stem])


def test_the_warn_policy_keeps_the_episode_with_its_offset(world):
    settings = ConversionSettings(image_size=(64, 64), plausibility=PlausibilityOptions(policies={"gripper_offset": "warn"}))
    a = align_episode(world["stack"]["dir"] / "stack_late_0.3_vio.mcap", settings)
    (f,) = [f for f in a.report["plausibility"]["findings"] if f["code"] == "gripper_offset"]
    assert f["action"] == "warned" and f["detail"]["offset_s"] == pytest.approx(0.3, abs=0.03), f
    assert a.report["offsets"]["gripper_offset_s"] == pytest.approx(0.3, abs=0.03)


@pytest.mark.parametrize("spec,size", [(samples.SampleSpec(seconds=6.0, width=96, height=72), (48, 36)),
                                       (samples.SampleSpec(seconds=8.0, width=160, height=120), None)])
def test_sample_recordings_are_not_measured_and_never_refused(tmp_path, spec, size):
    """The random-motion samples' fingers are dark bars closing along a slow sigmoid: a broad peak (contrast at most
    0.38 over 20 samples, each also shifted), so nothing is measured and nothing found."""
    ep = samples.write_episode(tmp_path, "sample", spec, seed=4)
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=size))
    g = a.report["offsets"]["gripper_offset"]
    assert g["status"] == "not_measurable" and a.report["offsets"]["gripper_offset_s"] is None, g
    assert not [f for f in a.report["plausibility"]["findings"] if f["code"] == "gripper_offset"]


# --------------------------------------------------------------------------- the rule itself


def _offsets(offset_s, status="measured", camera_s=0.0):
    return {"gripper_offset": {"status": status, "offset_s": offset_s, "r2": 0.8, "contrast": 0.75, "samples": 250},
            "camera_offset_s": camera_s}


@pytest.mark.parametrize("offsets,action", [
    (_offsets(0.02), None), (_offsets(-0.1), None), (_offsets(0.15), "warned"), (_offsets(-0.2), "warned"),
    (_offsets(0.26), "rejected"), (_offsets(-1.0), "rejected"), (_offsets(None, "not_measurable"), None),
    # a camera 0.3 s late against the pose clock makes an honest gripper look 0.3 s early against the camera
    (_offsets(-0.3, camera_s=0.3), None), (_offsets(-0.3, camera_s=-0.1), "rejected"),
    # the camera's own offset unknown: either stream may be late, so only a warning, whatever the size
    (_offsets(-1.0, camera_s=None), "warned"),
])
def test_the_rule_warns_beyond_a_tenth_and_rejects_beyond_a_quarter_second(offsets, action):
    found = check_gripper_offset(offsets, 1_000_000_000, np.array([2_000_000_000, 9_000_000_000], np.int64))
    assert [f.action for f in found] == ([action] if action else [])
    if action:
        assert (found[0].at_s, found[0].end_s, found[0].unit) == (1.0, 8.0, "s")
        assert found[0].limit == (0.25 if action == "rejected" or abs(found[0].value) > 0.25 else 0.1)


def test_a_late_camera_does_not_make_an_honest_gripper_look_early(tmp_path):
    """A camera stamped 0.3 s late against the pose clock (as a lab's camera pipeline often is; the trainer's
    ``camera_obs_latency`` handles it) measures the honest gripper 0.3 s early against the camera: judged against the
    pose clock (the camera's own offset added) it is on time, and the episode converts with no ``gripper_offset``."""
    from dpflow_core.sim.record import SimRecordingSpec, record_episode
    from dpflow_core.sim.tasks import initial_state, new_world

    world = new_world("pick_place", 64, 64)
    try:
        record_episode(tmp_path, "late_camera", initial_state("pick_place", 45),
                       SimRecordingSpec(width=64, height=64, camera_latency_s=0.3), world)
    finally:
        world.close()
    ep = align_episode(tmp_path / "late_camera_vio.mcap", SETTINGS)
    offsets = ep.report["offsets"]
    assert offsets["gripper_offset_s"] == pytest.approx(-0.3, abs=0.03), offsets
    assert offsets["camera_offset_s"] == pytest.approx(0.3, abs=0.03), offsets
    assert not [f for f in ep.report["plausibility"]["findings"] if f["code"] == "gripper_offset"]
