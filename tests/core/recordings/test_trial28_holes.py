"""The holes an adversarial trial found in issue 28 at the file, clock and name level, each made by a
fault generator with its ground truth (which samples, files or frames are wrong, when and by how much):
swapped VIO outputs, stamps in another unit, the whole device clock going back, NaN samples, names in
other scripts, frames decoded from a damaged reference, a re-muxed copy in a sibling task folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from mcap.records import Channel, Message, Schema
from mcap.stream_reader import StreamReader
from mcap.writer import Writer
from mcap_protobuf.decoder import DecoderFactory

from dpflow_core.conversion.decode import decode_camera
from dpflow_core.errors import InvalidNameError, RecordingError
from dpflow_core.names import validate_name
from dpflow_core.pairing import pair_recordings
from dpflow_core.pairing.manifest import pairing_warnings
from dpflow_core.recordings import inspect_recording, read_streams, samples
from dpflow_core.recordings.reader import starts_clean
from dpflow_core.recordings.topics import DAS_DEFAULT as T

SPEC = samples.SampleSpec(seconds=1.2, width=64, height=48, gop_size=12)


def rewrite(path: Path, fn, remux: bool = False) -> Path:
    """Copy ``path`` with ``fn(topic, k, msg, log_time) -> log_time`` applied to each message (k: per topic,
    file order; ``msg`` edited in place); ``remux``: unchunked, other bytes, same messages."""
    tmp = path.with_name(f".{path.name}.x")
    factory, decoders, topic_of, counts, ids = DecoderFactory(), {}, {}, {}, {}
    schemas: dict[int, Schema] = {}
    with open(path, "rb") as fin, open(tmp, "wb") as fout:
        w = Writer(fout, use_chunking=not remux)
        w.start(profile="", library="trial28-holes")
        for r in StreamReader(fin).records:
            if isinstance(r, Schema) and r.id not in schemas:
                schemas[r.id] = r
                ids[("s", r.id)] = w.register_schema(r.name, r.encoding, r.data)
            elif isinstance(r, Channel) and ("c", r.id) not in ids:
                ids[("c", r.id)] = w.register_channel(r.topic, r.message_encoding, ids.get(("s", r.schema_id), 0))
                topic_of[r.id] = r.topic
                decoders[r.id] = factory.decoder_for(r.message_encoding, schemas.get(r.schema_id))
            elif isinstance(r, Message):
                topic = topic_of[r.channel_id]
                msg = decoders[r.channel_id](r.data)
                k = counts[topic] = counts.get(topic, -1) + 1
                log = fn(topic, k, msg, r.log_time)
                w.add_message(ids[("c", r.channel_id)], log, msg.SerializeToString(), r.publish_time, r.sequence)
        w.finish()
    os.replace(tmp, path)
    return path


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean") / "pick"
    return [samples.write_episode(d, f"pick_{k:04d}", SPEC, seed=40 + k) for k in range(3)]


def task_copy(clean, dst: Path, name="pick") -> Path:
    folder = dst / name
    shutil.copytree(clean[0].vio_mcap.parent, folder)
    return folder


def codes(manifest):
    return {r.stem: (r.code, r.reason) for r in manifest.rejected}


def test_swapped_vio_outputs_are_named_with_both_files(clean, tmp_path):
    folder = task_copy(clean, tmp_path)
    a, b = folder / "pick_0000_vio.mcap", folder / "pick_0002_vio.mcap"
    a.rename(folder / "x"), b.rename(a), (folder / "x").rename(b)
    m = pair_recordings(folder)
    assert [x.stem for x in m.accepted] == ["pick_0001"]
    for stem, other in (("pick_0000", "pick_0002"), ("pick_0002", "pick_0000")):
        code, reason = codes(m)[stem]
        n_raw = len(next(e for e in clean if e.stem == stem).camera_ts_ns)
        n_vio = len(next(e for e in clean if e.stem == other).camera_ts_ns)
        assert code == "raw_vio_mismatch" and f"{stem}.mcap {n_raw} camera messages" in reason
        assert f"{stem}_vio.mcap {n_vio} captured" in reason and f"frame_count" in reason


@pytest.mark.parametrize("topic,div,unit", [(T.pose, 10**6, "milliseconds"), (T.camera, 10**3, "microseconds"),
                                            (T.gripper, 10**6, "milliseconds")])
def test_stamps_in_another_unit_are_named_as_such(clean, tmp_path, topic, div, unit):
    folder = task_copy(clean, tmp_path)
    def fn(t, k, msg, log):
        if t == topic:
            msg.header.timestamp = int(msg.header.timestamp) // div
        return log
    rewrite(folder / "pick_0001_vio.mcap", fn)
    code, reason = codes(pair_recordings(folder))["pick_0001"]
    assert code == "timestamp_units" and topic in reason and f"look like {unit}" in reason
    assert abs(float(reason.split("advance ")[1].split(" x")[0]) * div - 1) < 0.05
    assert "clock_reversal" not in reason


@pytest.mark.parametrize("topic,div,unit", [(T.camera, 10**6, "milliseconds"), (T.pose, 10**3, "microseconds"),
                                            (T.gripper, 10**6, "milliseconds")])
def test_stamps_in_another_unit_meet_the_same_reason_at_conversion(clean, tmp_path, topic, div, unit):
    """Issue 28 trial, item 5: a hand-made manifest that never went through pairing, pointing at a recording
    whose camera stamps are in ms, was rejected at conversion as "capture clock ran backwards". The reader now
    names the unit with pairing's own sentence, and no row of that episode reaches the dataset."""
    import hashlib
    import json

    from dpflow_core.conversion import ConversionSettings, convert
    from dpflow_core.replay_buffer import ReplayBuffer

    folder = task_copy(clean, tmp_path)
    manifest = pair_recordings(folder).to_dict()  # all three accepted: then the file changes under it
    victim = folder / "pick_0001_vio.mcap"
    def fn(t, k, msg, log):
        if t == topic:
            msg.header.timestamp = int(msg.header.timestamp) // div
        return log
    rewrite(victim, fn)
    entry = next(a for a in manifest["accepted"] if a["stem"] == "pick_0001")
    entry["files"]["vio_mcap"].update(size_bytes=victim.stat().st_size,
                                      sha256=hashlib.sha256(victim.read_bytes()).hexdigest())
    # hand-made: no figures of pairing's (with them, the edit itself is refused first, as manifest_mismatch)
    entry["validation"] = {}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    paired = codes(pair_recordings(folder))["pick_0001"]
    assert paired[0] == "timestamp_units"
    with pytest.raises(RecordingError) as err:
        read_streams(victim)
    assert err.value.code == "timestamp_units" and f"look like {unit}" in err.value.reason
    assert err.value.reason in paired[1]  # pairing's sentence (it may add "and 1 more problem")
    result = convert(tmp_path / "manifest.json", tmp_path / "ds" / "dataset.npz", ConversionSettings(image_size=(32, 24), short_episode_policy="warn"),
                     workers=1, cache=False)
    (rej,) = result.rejected
    assert (rej["stem"], rej["code"], rej["stage"]) == ("pick_0001", "timestamp_units", "conversion")
    assert rej["reason"] == err.value.reason and "backwards" not in rej["reason"]
    meta = json.loads(result.sidecar_path.read_text())
    assert [e["stem"] for e in meta["episodes"]] == ["pick_0000", "pick_0002"]
    assert len(ReplayBuffer(result.path).episode_ends) == 2


@pytest.mark.parametrize("at,back_s", [(15, 0.6), (24, 0.3)])
def test_whole_device_clock_going_back_is_a_reversal_never_interleaved(clean, tmp_path, at, back_s):
    ep = clean[2]
    folder = task_copy(clean, tmp_path)
    t_at = int(np.sort(ep.camera_ts_ns)[at])
    def fn(t, k, msg, log):
        if int(msg.header.timestamp) >= t_at:
            msg.header.timestamp = int(msg.header.timestamp) - int(back_s * 1e9)
            return log - int(back_s * 1e9)
        return log
    for p in (folder / "pick_0002_vio.mcap", folder / "pick_0002.mcap"):
        rewrite(p, fn)
    code, reason = codes(pair_recordings(folder))["pick_0002"]
    assert code == "clock_reversal" and "file order" in reason and "arrival times went back with it" in reason
    size = float(reason.split("ran backwards by ")[1].split(" s")[0])
    assert abs(size - back_s) < 0.05
    with pytest.raises(RecordingError) as err:
        read_streams(folder / "pick_0002_vio.mcap")
    assert err.value.code == "clock_reversal"


@pytest.mark.parametrize("topic,k", [(T.pose, 20), (T.gripper, 33), (T.pose, 3)])
def test_a_nan_sample_is_named_with_its_time(clean, tmp_path, topic, k):
    ep = clean[1]
    folder = task_copy(clean, tmp_path)
    def fn(t, i, msg, log):
        if t == topic and i == k:
            if topic == T.pose:
                msg.pose.position.y = float("nan")
            else:
                msg.value = float("inf")
        return log
    rewrite(folder / "pick_0001_vio.mcap", fn)
    ts = ep.pose_ts_ns if topic == T.pose else ep.gripper_ts_ns
    t0 = min(int(ep.camera_ts_ns[0]), int(ep.pose_ts_ns[0]), int(ep.gripper_ts_ns[0]))
    at = f"at {(int(np.sort(ts)[k]) - t0) / 1e9:.3f} s"
    code, reason = codes(pair_recordings(folder))["pick_0001"]
    assert code == "not_finite" and topic in reason and at in reason and f"message {k}" in reason
    with pytest.raises(RecordingError) as err:
        read_streams(folder / "pick_0001_vio.mcap")
    assert err.value.code == "not_finite" and at in err.value.reason


@pytest.mark.parametrize("stem", ["pick place 0003", "抓取_0004", "pick_placé_0005", "take (2)"])
def test_stems_in_any_script_are_accepted_by_every_reader(clean, tmp_path, stem):
    folder = tmp_path / "pick"
    folder.mkdir()
    src = clean[0]
    for suffix, p in ((".mcap", src.raw_mcap), ("_vio.mcap", src.vio_mcap)):
        shutil.copyfile(p, folder / f"{stem}{suffix}")
    (folder / f"{stem}_vio.json").write_text(src.vio_json.read_text().replace(src.stem, stem), encoding="utf-8")
    m = pair_recordings(folder)
    assert [a.stem for a in m.accepted] == [stem] and validate_name(stem, "stem") == stem


@pytest.mark.parametrize("stem", ["../x", "a/b", "a\tb", "x.", "-x", ".."])
def test_stems_that_could_escape_stay_refused(stem):
    with pytest.raises(InvalidNameError):
        validate_name(stem, "stem")


@pytest.mark.parametrize("bad", [5, 17])
def test_frames_from_a_damaged_reference_are_dropped_and_named(clean, bad):
    s = read_streams(clean[0].vio_mcap)
    packets = [bytes(p) for p in s.camera_packets]
    good = decode_camera(packets, None, "h264", None, clean[0].vio_mcap, s.camera_ts_ns)
    rng = np.random.default_rng(bad)
    packets[bad] = packets[bad][:6] + rng.integers(0, 256, len(packets[bad]) - 6, dtype=np.uint8).tobytes()
    nxt = next(i for i in range(bad + 1, len(packets)) if starts_clean(packets[i]))
    damaged: list = []
    frames, idx, errors, *_ , times = decode_camera(packets, None, "h264", None, clean[0].vio_mcap, s.camera_ts_ns,
                                                    damaged=damaged)
    assert bad in errors and not set(idx.tolist()) & set(range(bad, nxt))
    assert set(idx.tolist()) == set(range(len(packets))) - set(range(bad, nxt))
    by_msg = {int(m): k for k, m in enumerate(good[1])}
    for k, m in enumerate(idx):  # frame identity: every kept frame is the clean decode's frame of its message
        assert np.array_equal(frames[k], good[0][by_msg[int(m)]])
    [d] = damaged
    assert d["message"] == bad and d["until_message"] == nxt and d["frames"] == nxt - bad - 1
    assert d["first_ns"] == int(s.camera_ts_ns[bad + 1]) and d["last_ns"] == int(s.camera_ts_ns[nxt - 1])


def test_a_remuxed_copy_in_a_sibling_task_folder_is_a_duplicate(clean, tmp_path):
    pick = task_copy(clean, tmp_path)
    place = tmp_path / "place"
    samples.write_episode(place, "place_0000", SPEC, seed=60)
    src = clean[1]
    for suffix, p in ((".mcap", src.raw_mcap), ("_vio.mcap", src.vio_mcap)):
        shutil.copyfile(p, place / f"place_0007{suffix}")
        rewrite(place / f"place_0007{suffix}", lambda t, k, msg, log: log, remux=True)
    (place / "place_0007_vio.json").write_text(src.vio_json.read_text().replace(src.stem, "place_0007"))
    later = src.vio_mcap.stat().st_mtime + 60
    os.utime(place / "place_0007_vio.mcap", (later, later))
    assert (place / "place_0007_vio.mcap").stat().st_size != src.vio_mcap.stat().st_size
    m = pair_recordings(place)
    code, reason = codes(m)["place_0007"]
    assert code == "duplicate_episode" and "re-muxed copy" in reason and str(pick / "pick_0001_vio.mcap") in reason
    assert [a.stem for a in m.accepted] == ["place_0000"]


def test_pairing_warnings_are_carried_for_the_dataset(clean, tmp_path):
    folder = task_copy(clean, tmp_path)
    def imu_ms(t, k, msg, log):
        if t == T.imu:
            msg.header.timestamp = int(msg.header.timestamp) // 10**6
        return log
    rewrite(folder / "pick_0000_vio.mcap", imu_ms)
    m = pair_recordings(folder)
    entry = next(a for a in m.to_dict()["accepted"] if a["stem"] == "pick_0000")
    warnings = pairing_warnings(entry)
    assert any(w["code"] == "timestamp_units" and T.imu in w["reason"] and w["stage"] == "pairing" for w in warnings)
    assert inspect_recording(folder / "pick_0000_vio.mcap").ok


def test_a_nan_in_the_motion_is_not_measurable_never_a_traceback():
    from dpflow_core.offsets import OffsetOptions, estimate_offset

    rng = np.random.default_rng(3)
    n = 400
    target = rng.normal(size=(n, 3))
    def regressors(taus):
        x = np.repeat(target[None], len(taus), axis=0) + 0.1 * rng.normal(size=(len(taus), n, 3))
        x[:, n // 2, 0] = np.nan  # one pose sample NaN while marked valid
        return x
    est = estimate_offset("camera", target, regressors, 1.0, OffsetOptions())
    assert est.status == "not_measurable" and "NaN/inf" in est.reason


def test_a_stretch_cut_out_is_no_rate_mismatch_but_a_wrong_header_rate_is(tmp_path):
    """A curated trim cuts a stretch out of every stream: messages over the span fell by a third, and each
    stream was reported 'measured 20 Hz, header expects 30 Hz' (a new user's curation trial). The rate is now the
    sampling rate (median interval); a header that really expects another rate is still named with both."""
    from fault_fixtures import CAMERA, GRIPPER, IMU, POSE, _rewrite, edit_messages
    from recording_fixtures import write_small_episode

    ep = write_small_episode(tmp_path / "pick", "pick_0000", seed=5, seconds=4.5)
    t0 = int(ep.camera_ts_ns[0])
    cut = (t0 + 1_500_000_000, t0 + 3_000_000_000)

    def emit(topic, k, msg, rec):
        inside = cut[0] <= int(msg.header.timestamp) <= cut[1]
        return [] if inside else [(rec.log_time, rec.data, rec.publish_time)]

    _rewrite(ep.vio_mcap, (CAMERA, POSE, GRIPPER, IMU), emit)
    report = inspect_recording(ep.vio_mcap)
    assert report.rates_hz[CAMERA] < 25  # messages over the span: a third fewer
    assert not [w for w in report.warnings if w.code == "rate_mismatch"], report.warnings

    def header_60(topic, k, msg):
        msg.header.expect_hz = 60.0

    edit_messages(ep.vio_mcap, (CAMERA,), header_60)
    (w,) = [w for w in inspect_recording(ep.vio_mcap).warnings if w.code == "rate_mismatch"]
    assert f"{CAMERA} sampled at 30.0" in w.reason and "header expects 60 Hz" in w.reason
