"""Content that parses but must not reach a training set silently (issue 15).

Each test builds the damaged recording with the sample writer or the fixture helpers,
asserts the exact code and reason, and checks what conversion made of it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.pairing import pair_recordings
from dpflow_core.replay_buffer import ReplayBuffer
from recording_fixtures import copy_episode, refresh_vio_result, rewrite_mcap, write_small_episode, write_small_task

SIZE = (32, 24)


def _rejects(manifest):
    return {r.stem: r for r in manifest.rejected}


def _set_mtime_after(path: Path, other: Path, seconds: float = 10.0) -> None:
    t = other.stat().st_mtime + seconds
    os.utime(path, (t, t))


# --------------------------------------------------------------------------- 1. the same demonstration twice


@pytest.fixture(scope="module")
def duplicates(tmp_path_factory):
    base = tmp_path_factory.mktemp("dups")
    good = write_small_task(base, episodes=2, seed=3)
    d = base / "pick_place"
    # A retried recording: byte copies of episode 0 under a new stem; its _vio.json still names the original.
    copy_episode(good[0], d, "pick_place_0007")
    # The same camera stream re-muxed (chunk index only, no statistics): other bytes, same content.
    remux = copy_episode(good[1], d, "pick_place_0008")
    rewrite_mcap(good[1].vio_mcap, remux["vio_mcap"], chunk_index_only=True)
    doc = json.loads(good[1].vio_json.read_text())
    doc.update(input_file="pick_place_0008.mcap", output_file="pick_place_0008_vio.mcap")
    remux["vio_json"].write_text(json.dumps(doc))
    # A unique recording whose status file names another stem.
    other = write_small_episode(d, "pick_place_0009", seed=41)
    doc = json.loads(other.vio_json.read_text())
    doc.update(input_file="pick_place_0042.mcap", output_file="pick_place_0042_vio.mcap")
    other.vio_json.write_text(json.dumps(doc))
    for stem in ("pick_place_0007", "pick_place_0008", "pick_place_0009"):
        _set_mtime_after(d / f"{stem}_vio.mcap", good[1].vio_mcap)
    refresh_vio_result(d)
    return d, good, pair_recordings(d)


def test_later_copies_are_rejected_naming_the_original(duplicates):
    d, good, m = duplicates
    assert [a.stem for a in m.accepted] == ["pick_place_0000", "pick_place_0001"]
    rej = _rejects(m)
    sha0 = m.accepted[0].files["vio_mcap"].sha256
    assert rej["pick_place_0007"].code == "duplicate_episode"
    assert rej["pick_place_0007"].reason == (
        f"pick_place_0007_vio.mcap is a byte copy of episode 'pick_place_0000' (SHA-256 {sha0[:12]}...); "
        "its pick_place_0007_vio.json names stem 'pick_place_0000'; "
        "the same demonstration twice would weigh it double: delete the copy"
    )
    cam1 = m.accepted[1].validation["camera_payload_sha256"]
    assert rej["pick_place_0008"].code == "duplicate_episode"
    assert rej["pick_place_0008"].reason == (
        "pick_place_0008_vio.mcap holds the same camera stream as episode 'pick_place_0001' "
        f"(camera payload SHA-256 {cam1[:12]}..., re-muxed copy); delete the copy"
    )
    # the re-muxed file really differs byte-wise
    assert (d / "pick_place_0008_vio.mcap").read_bytes() != good[1].vio_mcap.read_bytes()


def test_status_file_naming_another_stem_is_reported(duplicates):
    _, _, m = duplicates
    r = _rejects(m)["pick_place_0009"]
    assert r.code == "status_stem_mismatch"
    assert r.reason.startswith("pick_place_0009_vio.json names stem 'pick_place_0042', not 'pick_place_0009'")


def test_no_duplicate_reaches_the_dataset(duplicates, tmp_path):
    _, good, m = duplicates
    result = convert(m, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1)
    assert result.n_episodes == 2
    assert [e["stem"] for e in result.metadata["episodes"]] == ["pick_place_0000", "pick_place_0001"]
    rb = ReplayBuffer(result.path)
    assert rb.n_episodes == 2
    codes = {r["stem"]: r["code"] for r in result.rejected}
    assert codes == {"pick_place_0007": "duplicate_episode", "pick_place_0008": "duplicate_episode",
                     "pick_place_0009": "status_stem_mismatch"}


# --------------------------------------------------------------------------- 2. holes in the camera stream

GAP_FRAMES = tuple(range(50, 80))  # one block: 30 frames (1 s at 30 Hz) missing


@pytest.fixture(scope="module")
def gap_task(tmp_path_factory):
    base = tmp_path_factory.mktemp("gaps")
    d = base / "pick_place"
    ep = write_small_episode(d, "pick_place_0000", seed=51, seconds=4.0, missing_frames=GAP_FRAMES)
    refresh_vio_result(d)
    m = pair_recordings(d)
    assert [a.stem for a in m.accepted] == ["pick_place_0000"]
    return ep, m


def _truth_gap(ep):
    cam = ep.camera_ts_ns.astype(np.int64)
    i = int(np.argmax(np.diff(cam)))
    return cam, i


def test_gap_splits_into_segments_never_bridged(gap_task, tmp_path):
    ep, m = gap_task
    result = convert(m, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE, min_segment_frames=20), workers=1)
    cam, i = _truth_gap(ep)
    assert result.n_episodes == 2
    rb = ReplayBuffer(result.path)
    ends = list(rb.episode_ends)
    assert ends == [i + 1, len(cam)]  # every frame kept, cut exactly at the hole
    pos = np.asarray(rb["robot0_eef_pos"])
    ts = np.asarray(rb["timestamp"])
    # rows are the true poses at the frame times (pose and camera share capture times)
    truth = {int(t): p for t, p in zip(ep.pose_ts_ns.astype(np.int64), ep.position_m)}
    np.testing.assert_allclose(pos, np.stack([truth[int(t)] for t in cam]), atol=1e-6)
    # the second segment starts on the first frame after the hole, at time 0
    assert ts[ends[0]] == 0.0
    np.testing.assert_allclose(ts[ends[0]:], (cam[i + 1:] - cam[i + 1]) / 1e9)
    for a, b in ((0, ends[0]), (ends[0], ends[1])):
        assert np.diff(ts[a:b]).max() < 0.05
    meta = result.metadata["episodes"]
    assert [e["segment"]["index"] for e in meta] == [0, 1] and {e["stem"] for e in meta} == {"pick_place_0000"}
    gaps = meta[0]["long_gaps"]
    assert gaps["policy"] == "split" and gaps["max_gap_s"] == 0.5
    assert [(g["missing_frames"], g["action"]) for g in gaps["gaps"]] == [(30, "split")]
    assert gaps["gaps"][0]["duration_s"] == pytest.approx((cam[i + 1] - cam[i]) / 1e9, abs=1e-4)
    assert [s["kept"] for s in gaps["segments"]] == [True, True]


def test_gap_segments_shorter_than_the_minimum_are_dropped_and_listed(gap_task, tmp_path):
    ep, m = gap_task
    result = convert(m, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE),
                     workers=1)  # default minimum 46 frames
    cam, i = _truth_gap(ep)
    segs = result.metadata["episodes"][0]["long_gaps"]["segments"]
    assert [(s["frames"], s["kept"]) for s in segs] == [(i + 1, True), (len(cam) - i - 1, False)]
    assert result.n_episodes == 1 and result.total_steps == i + 1


def test_gap_policy_reject_names_the_hole(gap_task, tmp_path):
    ep, m = gap_task
    cam, i = _truth_gap(ep)
    with pytest.raises(Exception) as err:
        convert(m, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE, gap_policy="reject"), workers=1)
    assert err.value.code == "no_valid_episodes"
    at = (cam[i] - cam[0]) / 1e9
    dur = (cam[i + 1] - cam[i]) / 1e9
    assert (f"pick_place_0000: camera stream has 1 hole longer than 0.5 s ({dur:.2f} s after {at:.2f} s; "
            "30 frames missing) and gap_policy is 'reject'") in err.value.reason
    assert not (tmp_path / "dataset.npz").exists()


def test_dataset_npz_asset_takes_the_gap_options(gap_task, tmp_path):
    """The launchpad's gap options reach the conversion: split with a 20-frame minimum keeps both
    segments; reject fails the step with the reason naming the hole."""
    import dagster as dg
    from partitioned import materialize

    from dpflow_core.pairing import write_manifest
    from dpflow_dagster.defs.dataset import dataset_npz

    ep, m = gap_task
    manifest = write_manifest(m, tmp_path / "manifest.json")

    @dg.asset(name="paired_episodes", group_name="dataset")
    def paired_episodes() -> dict:
        return {"manifest_path": str(manifest), "root": str(tmp_path), "task": "pick_place", "accepted": 1, "rejected": 0}

    def config(**gap):
        return dg.RunConfig(ops={"dataset_npz": {"config": {
            "image_width": SIZE[0], "image_height": SIZE[1], "workers": 1, "output_dir": str(tmp_path / "work"), **gap}}})

    split = materialize([paired_episodes, dataset_npz], "pick_place", run_config=config(min_segment_frames=20))
    assert split.success and split.output_for_node("dataset_npz").n_episodes == 2
    rejected = materialize([paired_episodes, dataset_npz], "pick_place", run_config=config(gap_policy="reject"),
                           raise_on_error=False)
    assert not rejected.success
    [failure] = [e for e in rejected.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "gap_policy is 'reject'" in failure.step_failure_data.error.message + str(failure.step_failure_data.user_failure_data)


def test_report_lists_the_hole(gap_task, tmp_path):
    from dpflow_core.report import episode_quality

    ep, m = gap_task
    cam, i = _truth_gap(ep)
    (q,) = episode_quality(m.to_dict())
    assert len(q.camera_gaps) == 1 and q.camera_gaps[0]["missing_frames"] == 30
    assert q.camera_gaps[0]["duration_s"] == pytest.approx((cam[i + 1] - cam[i]) / 1e9, abs=1e-4)
    assert any(r.startswith("camera hole ") for r in q.outlier_reasons)


# --------------------------------------------------------------------------- 3. invalid poses


def test_invalid_poses_are_named_in_the_reason(tmp_path):
    d = tmp_path / "pick_place"
    ep = write_small_episode(d, "pick_place_0000", seed=61, pose_invalid=((0.0, 1.5),))
    refresh_vio_result(d)
    m = pair_recordings(d)
    assert [a.stem for a in m.accepted] == ["pick_place_0000"]
    with pytest.raises(Exception) as err:
        convert(m, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1)
    cam = ep.camera_ts_ns.astype(np.int64)
    origin = min(int(cam[0]), int(ep.pose_ts_ns[0]), int(ep.gripper_ts_ns[0]))
    t = (cam - cam[0]) / 1e9
    invalid = cam[t < 1.5]
    pct = 100 * len(invalid) / len(cam)
    expected = (f"pick_place_0000: pose_valid false for {pct:.0f} % of the episode, "
                f"{(invalid[0] - origin) / 1e9:.2f}-{(invalid[-1] - origin) / 1e9:.2f} s (VIO lost tracking): "
                "the longest valid stretch")
    assert expected in err.value.reason
    assert "covers only" in err.value.reason



# --------------------------------------------------------------------------- 4. failing cleanly
#
# Tests run as root, for whom chmod 000 does not stop a read, so an unreadable input is a
# directory (open() fails with EISDIR for root too) or a FIFO where the file should be.

REPO = Path(__file__).resolve().parents[3]


def _dpflow(*args, cwd=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", "from dpflow_core.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=cwd or REPO)


@pytest.fixture(scope="module")
def two_episodes(tmp_path_factory):
    base = tmp_path_factory.mktemp("clean")
    good = write_small_task(base, episodes=2, seed=7)
    return base, base / "pick_place", good


def _copy_task(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_directory_or_fifo_where_a_file_should_be_is_unreadable(two_episodes, tmp_path):
    _, d0, _ = two_episodes
    d = _copy_task(d0, tmp_path / "pick_place")
    (d / "pick_place_0000_vio.mcap").unlink()
    (d / "pick_place_0000_vio.mcap").mkdir()
    (d / "pick_place_0001_vio.json").unlink()
    os.mkfifo(d / "pick_place_0001_vio.json")
    m = pair_recordings(d)
    rej = _rejects(m)
    assert rej["pick_place_0000"].code == "unreadable"
    assert rej["pick_place_0000"].reason == (
        "pick_place_0000_vio.mcap is a directory, not a file; a _vio.mcap file was expected there: "
        "move it away and copy the recording's file in its place")
    assert rej["pick_place_0001"].code == "unreadable"
    assert rej["pick_place_0001"].reason.startswith("pick_place_0001_vio.json is a FIFO (named pipe), not a file")
    out = _dpflow("pair", d, "-o", tmp_path / "m.json")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "no episode accepted" in out.stderr and "unreadable x2" in out.stderr
    assert json.loads((tmp_path / "m.json").read_text())["accepted"] == []


def test_input_made_unreadable_after_pairing(two_episodes, tmp_path):
    _, d0, _ = two_episodes
    d = _copy_task(d0, tmp_path / "pick_place")
    manifest = tmp_path / "manifest.json"
    assert _dpflow("pair", d, "-o", manifest).returncode == 0
    (d / "pick_place_0001_vio.mcap").unlink()
    (d / "pick_place_0001_vio.mcap").mkdir()
    # report: the other episode is measured, this one listed with the reason
    rep = _dpflow("report", manifest, "-o", tmp_path / "report")
    assert rep.returncode == 0 and "Traceback" not in rep.stderr, rep.stderr
    assert "pick_place_0001: not measured: unreadable:" in rep.stdout
    quality = json.loads((tmp_path / "report" / "quality.json").read_text())
    assert [e["stem"] for e in quality["episodes"]] == ["pick_place_0000"]
    assert [(r["stem"], r["code"]) for r in quality["rejected"]] == [("pick_place_0001", "unreadable")]
    # convert: the other episode converts, this one is rejected with the reason
    conv = _dpflow("convert", manifest, "-o", tmp_path / "dataset.npz", "--image-size", "32,24", "-j", "1")
    assert conv.returncode == 0 and "Traceback" not in conv.stderr, conv.stderr
    meta = json.loads((tmp_path / "dataset.json").read_text())
    assert meta["n_episodes"] == 1
    (r,) = meta["rejected"]
    assert (r["stem"], r["code"]) == ("pick_place_0001", "unreadable")
    assert r["reason"] == ("pick_place_0001_vio.mcap is a directory, not a file; a recording was expected there")
    # nothing left: report and convert fail with the reasons summarised, no traceback
    (d / "pick_place_0000_vio.mcap").unlink()
    (d / "pick_place_0000_vio.mcap").mkdir()
    rep = _dpflow("report", manifest, "-o", tmp_path / "report2")
    assert rep.returncode == 1 and "Traceback" not in rep.stderr
    assert "no episode to report on" in rep.stderr and "unreadable x2" in rep.stderr
    conv = _dpflow("convert", manifest, "-o", tmp_path / "other.npz", "--image-size", "32,24", "-j", "1")
    assert conv.returncode == 2 and "Traceback" not in conv.stderr
    assert "no valid episodes: 2 found, 2 rejected" in conv.stderr and "is a directory" in conv.stderr
    assert not (tmp_path / "other.npz").exists()


def test_a_single_episode_converts(two_episodes, tmp_path):
    _, d0, good = two_episodes
    m = pair_recordings(d0).to_dict()
    m["accepted"] = m["accepted"][:1]
    result = convert(m, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1)
    assert result.n_episodes == 1
    stats = json.loads(result.norm_stats_path.read_text())["norm_stats"]
    assert stats["robot0_demo_start_pose"]["constant_dims"] == [0, 1, 2, 3, 4, 5]
    assert stats["robot0_demo_start_pose"]["std"] == [0.0] * 6
    assert "constant_dims" not in stats["robot0_eef_pos"]
    rb = ReplayBuffer(result.path)
    start = np.asarray(rb["robot0_demo_start_pose"])
    np.testing.assert_allclose(start[0, :3], np.asarray(rb["robot0_eef_pos"])[0])
    assert [w["code"] for w in result.metadata["warnings"]] == ["single_episode"]
    assert "held-out episodes" in result.metadata["warnings"][0]["reason"]


def test_norm_stats_failure_names_the_output_not_a_temporary_file(two_episodes, tmp_path):
    from dpflow_core.errors import DatasetError

    _, d0, _ = two_episodes
    m = pair_recordings(d0).to_dict()
    first = m["accepted"][0]
    # the same file twice, the second entry under another recorded hash (else it is a rejected duplicate),
    # which is not verified
    files = dict(first["files"], vio_mcap=dict(first["files"]["vio_mcap"], sha256="f" * 64))
    twice = dict(m, accepted=[first, dict(first, stem="again", files=files, validation={})])
    with pytest.raises(DatasetError) as err:  # start/end poses constant over 2 episodes
        convert(twice, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1, verify_sha256=False)
    assert err.value.path == str(tmp_path / "dataset.npz")
    assert ".partial" not in str(err.value) and "(pick_place_0000, again)" in err.value.reason
    assert "dataset.npz was not written" in err.value.reason


def test_explicit_manifest_stems_and_aggregate_list_are_validated(two_episodes, tmp_path):
    _, d0, _ = two_episodes
    d = _copy_task(d0, tmp_path / "pick_place")
    entries = [{"stem": s, "raw_mcap": "pick_place_0000.mcap", "vio_mcap": "pick_place_0000_vio.mcap",
                "vio_json": "pick_place_0000_vio.json"} for s in ("../../x", "...")]
    (tmp_path / "explicit.json").write_text(json.dumps({"episodes": entries}))
    m = pair_recordings(d, explicit_manifest=tmp_path / "explicit.json")
    assert m.accepted == []
    assert sorted((r.stem, r.code) for r in m.rejected) == [("...", "invalid_stem"), ("../../x", "invalid_stem")]
    assert all(r.reason.startswith("explicit.json: entry ") for r in m.rejected)
    # a report of a hand-edited manifest with an unsafe stem writes nothing outside its folder
    bad = pair_recordings(d).to_dict()
    bad["accepted"][0]["stem"] = "../../x"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    rep = _dpflow("report", tmp_path / "bad.json", "-o", tmp_path / "r" / "report")
    assert rep.returncode == 0 and "../../x: not measured: invalid_stem:" in rep.stdout
    assert not (tmp_path / "x.png").exists() and not list(tmp_path.glob("*.png"))
    # vio_result.json naming another task's file, and a stem that is only dots
    summary = json.loads((d / "vio_result.json").read_text())
    summary["success_mcap_files"].append("../stack_cups/cup_0000_vio.mcap")
    (d / "vio_result.json").write_text(json.dumps(summary))
    shutil.copyfile(d / "pick_place_0000_vio.json", d / "..._vio.json")
    rej = _rejects(pair_recordings(d))
    assert rej["cup_0000"].code == "other_task"
    assert rej["cup_0000"].reason.startswith(
        "vio_result.json success_mcap_files lists '../stack_cups/cup_0000_vio.mcap', which lies outside the task folder")
    assert rej["..."].code == "invalid_stem"
    assert rej["..."].reason == "..._vio.json: stem '...' is only dots, not a recording name; rename the file"


def test_upload_refuses_a_dataset_changed_after_conversion(two_episodes, tmp_path):
    _, d0, _ = two_episodes
    out = tmp_path / "pick_place" / "dataset.npz"
    result = convert(pair_recordings(d0), out, ConversionSettings(image_size=SIZE), workers=1)
    with open(out, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    import hashlib

    now = hashlib.sha256(out.read_bytes()).hexdigest()
    up = _dpflow("upload", out, "--remote-dir", tmp_path / "server")
    assert up.returncode == 2 and "Traceback" not in up.stderr
    assert now in up.stderr and result.sha256 in up.stderr and "changed since conversion" in up.stderr
    assert not list((tmp_path / "server").rglob("dataset.npz"))


# --------------------------------------------------------------------------- 5. two messages with the same timestamp


def test_repeated_capture_time_decodes_every_packet(tmp_path):
    from dpflow_core.conversion import ConversionSettings, align_episode
    from dpflow_core.recordings.topics import DAS_DEFAULT

    d = tmp_path / "t"
    ep = write_small_episode(d, "a", seed=71)
    full = align_episode(ep.vio_mcap, ConversionSettings(image_size=None, min_segment_frames=2))
    # frame 20 (a P-frame) carries frame 19's capture time: a different payload, same timestamp
    dup = rewrite_mcap(ep.vio_mcap, d / "dup_vio.mcap", repeat_timestamp={DAS_DEFAULT.camera: (20,)})
    got = align_episode(dup, ConversionSettings(image_size=None, min_segment_frames=2), stem="dup")
    assert got.report["undecodable_packets"] == 0
    assert got.report["duplicate_timestamps"][DAS_DEFAULT.camera] == 1
    np.testing.assert_array_equal(got.camera_ts_ns, np.delete(full.camera_ts_ns, 20))
    assert np.array_equal(got.rgb, np.delete(full.rgb, 20, axis=0))  # bit-identical, frames after 20 included
    # the same message written twice: decoded once, frames identical to the original
    twice = rewrite_mcap(ep.vio_mcap, d / "twice_vio.mcap", duplicate_first={DAS_DEFAULT.camera: 3})
    again = align_episode(twice, ConversionSettings(image_size=None, min_segment_frames=2), stem="twice")
    assert np.array_equal(again.rgb, full.rgb) and again.report["duplicate_timestamps"][DAS_DEFAULT.camera] == 3


# --------------------------------------------------------------------------- 6. more than one arm


def test_second_arm_is_rejected_never_dropped(two_episodes, tmp_path):
    _, d0, _ = two_episodes
    d = _copy_task(d0, tmp_path / "pick_place")
    rewrite_mcap(d / "pick_place_0001_vio.mcap", d / "pick_place_0001_vio.mcap", add_topics_prefix="/robot1")
    m = pair_recordings(d)
    assert [a.stem for a in m.accepted] == ["pick_place_0000"]
    r = _rejects(m)["pick_place_0001"]
    assert r.code == "unsupported_multi_arm"
    assert r.reason.startswith("pick_place_0001_vio.mcap: topics of more than one arm: /robot0 (converted) and "
                               "/robot1 (5 topics, e.g. /robot1/sensor/camera0/camera_info)")
    result = convert(m, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1)
    assert [e["stem"] for e in result.metadata["episodes"]] == ["pick_place_0000"]
    assert {x["stem"]: x["code"] for x in result.rejected} == {"pick_place_0001": "unsupported_multi_arm"}


# --------------------------------------------------------------------------- 8. messages a user understands


def test_crlf_converted_magic_and_clock_domains(two_episodes, tmp_path):
    from dpflow_core.recordings import inspect_recording
    from dpflow_core.recordings.topics import DAS_DEFAULT

    _, d0, good = two_episodes
    data = good[0].vio_mcap.read_bytes()
    crlf = tmp_path / "crlf_vio.mcap"
    crlf.write_bytes(data.replace(b"\r\n", b"\n"))
    r = inspect_recording(crlf)
    assert [p.code for p in r.errors] == ["crlf_converted"]
    assert "bytes look CRLF->LF converted; copy the file in binary mode" in r.errors[0].reason
    # pose stamped with a boot clock (ns since boot) while the camera uses the Unix epoch
    boot = tmp_path / "boot_vio.mcap"
    shift = int(good[0].pose_ts_ns[0]) - 1_260_000_000
    _shift_topic(good[0].vio_mcap, boot, DAS_DEFAULT.pose, -shift)
    r = inspect_recording(boot)
    (err,) = [p for p in r.errors if p.code == "clock_domains_differ"]
    cam0 = f"{float(good[0].camera_ts_ns[0]):.3g}".replace("e+", "e")
    assert f"clock domains differ: camera {cam0} ns, pose 1.26e9 ns" in err.reason


def _shift_topic(src: Path, dst: Path, topic: str, delta_ns: int) -> None:
    from mcap.records import Channel, Message, Schema
    from mcap.stream_reader import StreamReader
    from mcap.writer import Writer
    from mcap_protobuf.decoder import DecoderFactory

    factory = DecoderFactory()
    schemas, channels, decoders = {}, {}, {}
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        w = Writer(fout)
        w.start()
        for rec in StreamReader(fin).records:
            if isinstance(rec, Schema) and rec.id not in schemas:
                schemas[rec.id] = (rec, w.register_schema(rec.name, rec.encoding, rec.data))
            elif isinstance(rec, Channel) and rec.id not in channels:
                channels[rec.id] = (rec.topic, w.register_channel(rec.topic, rec.message_encoding,
                                                                  schemas[rec.schema_id][1]))
                decoders[rec.id] = factory.decoder_for(rec.message_encoding, schemas[rec.schema_id][0])
            elif isinstance(rec, Message):
                name, cid = channels[rec.channel_id]
                payload = rec.data
                if name == topic:
                    msg = decoders[rec.channel_id](rec.data)
                    msg.header.timestamp = msg.header.timestamp + delta_ns
                    payload = msg.SerializeToString()
                w.add_message(cid, rec.log_time, payload, rec.publish_time, rec.sequence)
        w.finish()


def test_formats_md_lists_every_reject_and_warning_code():
    import re

    pairing = [f"pairing/{m}.py" for m in ("naming", "status", "checks", "explicit", "pair", "manifest")]
    files = [REPO / "dpflow_core" / f for f in (*pairing, "report/quality.py", "report/render.py", "recordings/inspection.py",
                                                "recordings/reader.py", "conversion/align.py", "conversion/jobs.py",
                                                "conversion/dataset_npz.py", "conversion/inputs.py", "conversion/gaps.py",
                                                "conversion/rates.py")]
    codes = set()
    for f in files:
        text = f.read_text()
        codes |= set(re.findall(r'code="([a-z0-9_]+)"', text))
        codes |= set(re.findall(r'Problem\(\s*"([a-z0-9_]+)"', text))
        codes |= set(re.findall(r'PairingReject\(\s*[^,()]+,\s*[^,()]+(?:\([^()]*\))?,\s*"([a-z0-9_]+)"', text))
        codes |= set(re.findall(r'"code":\s*"([a-z0-9_]+)"', text))
    assert {"duplicate_episode", "camera_gap", "unsupported_multi_arm", "crlf_converted", "single_episode"} <= codes
    docs = (REPO / "docs" / "formats.md").read_text()
    assert sorted(c for c in codes if f"`{c}`" not in docs) == []


def test_tables_tell_long_stems_apart_in_80_columns(tmp_path):
    d = tmp_path / "pick_place"
    stems = [f"pick_place_session_2026_12_01_operator_alice_take_{k:04d}" for k in (1, 2)]
    for k, stem in enumerate(stems):
        write_small_episode(d, stem, seed=80 + k, vio_status="failed")
    refresh_vio_result(d)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from dpflow_core.cli import main; main()", "pair", str(d), "-o",
                          str(tmp_path / "m.json")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "80", "TERM": "dumb"})
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    # a folded stem cell: rejoin the first column's pieces row by row
    cells = [line.split("│")[1].strip() for line in lines if line.count("│") >= 3]
    joined = "".join(cells)
    for stem in stems:
        assert stem in joined


# --------------------------------------------------------------------------- duplicates across task folders (issue 28)


def test_duplicates_across_the_manifests_of_one_dataset_are_rejected(tmp_path):
    first = write_small_task(tmp_path / "a", episodes=2, seed=31)
    other = write_small_task(tmp_path / "b", episodes=1, seed=32, task="pick_cup")
    d2 = tmp_path / "b" / "pick_cup"
    copy_episode(first[0], d2, "pick_cup_0100")  # a byte copy under a new name
    remux = copy_episode(first[1], d2, "pick_cup_0101")  # the same camera stream, re-muxed
    rewrite_mcap(first[1].vio_mcap, remux["vio_mcap"], chunk_index_only=True)
    for stem, src in (("pick_cup_0100", first[0]), ("pick_cup_0101", first[1])):
        doc = json.loads(src.vio_json.read_text())
        doc.update(input_file=f"{stem}.mcap", output_file=f"{stem}_vio.mcap")
        (d2 / f"{stem}_vio.json").write_text(json.dumps(doc))
    refresh_vio_result(d2)
    m1, m2 = pair_recordings(tmp_path / "a" / "pick_place"), pair_recordings(d2)
    assert len(m2.accepted) == 3  # each folder alone holds no duplicate
    # the two folders are named as two tasks (pick_place, pick_cup): mixed on purpose, else refused as mixed_tasks
    result = convert([m1, m2], tmp_path / "out" / "dataset.npz", ConversionSettings(image_size=SIZE),
                     workers=1, cache=False, mixed_tasks=True)
    rej = {r["stem"]: r for r in result.rejected if r["code"] == "duplicate_episode"}
    assert sorted(rej) == ["pick_cup_0100", "pick_cup_0101"]
    assert f"same content as episode {first[0].stem!r}" in rej["pick_cup_0100"]["reason"]
    assert "SHA-256" in rej["pick_cup_0100"]["reason"]
    assert f"episode {first[1].stem!r}" in rej["pick_cup_0101"]["reason"] and "camera payload" in rej["pick_cup_0101"]["reason"]
    stems = [e["stem"] for e in result.metadata["episodes"]]
    assert sorted(stems) == sorted([first[0].stem, first[1].stem, other[0].stem])
