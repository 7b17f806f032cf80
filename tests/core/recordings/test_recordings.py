"""Validation of single recordings: figures of good files, each fault measured or rejected."""

from __future__ import annotations

import numpy as np
import pytest

from dpflow_core.errors import RecordingError
from dpflow_core.recordings import inspect_recording, read_streams
from recording_fixtures import (
    SMALL,
    TOPICS,
    cut_at_fraction,
    cut_closing_magic,
    rewrite_mcap,
    write_small_episode,
)

CAM, POSE, GRIP, IMU = TOPICS.camera, TOPICS.pose, TOPICS.gripper, TOPICS.imu


@pytest.fixture(scope="module")
def eps(tmp_path_factory):
    """One small episode per fault, written once for the module."""
    d = tmp_path_factory.mktemp("recordings")
    out = {
        "good": write_small_episode(d, "good", seed=1),
        "late": write_small_episode(d, "late", seed=2, camera_start_delay_s=0.4),
        "pframes": write_small_episode(d, "pframes", seed=3, drop_first_idr=True),
        "ooo": write_small_episode(d, "ooo", seed=4, pose_out_of_order=3),
        "invalid": write_small_episode(d, "invalid", seed=5, pose_invalid=((0.5, 1.0),)),
    }
    for name in ("trunc", "nomagic", "chunkonly", "cbor", "cbor_imu", "corrupt", "dup", "overstated", "noposes"):
        out[name] = write_small_episode(d, name, seed=1)
    cut_at_fraction(out["trunc"].vio_mcap, 0.6)
    cut_closing_magic(out["nomagic"].vio_mcap)
    rewrite_mcap(out["chunkonly"].vio_mcap, out["chunkonly"].vio_mcap, chunk_index_only=True)
    rewrite_mcap(out["cbor"].vio_mcap, out["cbor"].vio_mcap, encodings={POSE: "cbor"})
    rewrite_mcap(out["cbor_imu"].vio_mcap, out["cbor_imu"].vio_mcap, encodings={IMU: "cbor"})
    rewrite_mcap(out["dup"].vio_mcap, out["dup"].vio_mcap, duplicate_first={POSE: 4})
    rewrite_mcap(out["overstated"].vio_mcap, out["overstated"].vio_mcap, overstate_counts={CAM: 5})
    rewrite_mcap(out["noposes"].vio_mcap, out["noposes"].vio_mcap, drop_messages=(POSE,))
    data = bytearray(out["corrupt"].vio_mcap.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    out["corrupt"].vio_mcap.write_bytes(bytes(data))
    return out


def test_good_recording_figures_match_ground_truth(eps):
    ep = eps["good"]
    r = inspect_recording(ep.vio_mcap)
    assert r.ok and r.errors == [] and r.warnings == []
    assert r.indexed and r.has_summary and r.has_chunk_index and r.has_message_index and r.has_statistics
    assert r.message_counts[CAM] == len(ep.camera_ts_ns)
    assert r.message_counts[POSE] == len(ep.pose_ts_ns)
    assert r.message_counts[GRIP] == len(ep.gripper_ts_ns)
    assert r.message_counts == r.summary_counts
    assert r.first_ts_ns[CAM] == int(ep.camera_ts_ns[0]) and r.last_ts_ns[POSE] == int(ep.pose_ts_ns[-1])
    assert r.rates_hz[CAM] == pytest.approx(SMALL.fps, rel=0.01)
    assert r.rates_hz[GRIP] == pytest.approx(SMALL.gripper_hz, rel=0.01)
    assert r.rates_hz[IMU] == pytest.approx(SMALL.imu_hz, rel=0.01)
    assert r.expected_hz[CAM] == pytest.approx(30.0)
    start = max(int(ep.camera_ts_ns[0]), int(ep.pose_ts_ns[0]), int(ep.gripper_ts_ns[0]))
    end = min(int(ep.camera_ts_ns[-1]), int(ep.pose_ts_ns[-1]), int(ep.gripper_ts_ns[-1]))
    assert (r.overlap_start_ns, r.overlap_end_ns) == (start, end)
    assert r.overlap_s == pytest.approx((end - start) / 1e9)
    assert r.leading_undecodable_packets == 0 and r.leading_undecodable_s == 0.0
    assert r.first_decodable_ts_ns == int(ep.camera_ts_ns[0])
    assert r.pose_invalid_fraction == 0.0
    assert r.camera_format == "h264"
    assert all(v == 0 for v in r.log_time_inversions.values())
    assert all(v == 0 for v in r.duplicate_timestamps.values())
    d = r.to_dict()
    assert d["indexed"] is True and d["message_counts"][POSE] == len(ep.pose_ts_ns)


def test_raw_recording_needs_no_pose_but_vio_does(eps):
    ep = eps["good"]
    raw = inspect_recording(ep.raw_mcap, required=(CAM, GRIP), probe_video=False)
    assert raw.ok and POSE not in raw.message_counts
    assert raw.leading_undecodable_packets is None and raw.pose_invalid_fraction is None
    as_vio = inspect_recording(ep.raw_mcap)
    assert [p.code for p in as_vio.errors] == ["missing_topics"]
    assert as_vio.errors[0].reason == f"good.mcap: not a Matrix Studio recording: missing topics {POSE}"


def test_truncated_at_60_percent_is_rejected(eps):
    path = eps["trunc"].vio_mcap
    r = inspect_recording(path)
    assert [p.to_dict() for p in r.errors] == [{
        "code": "truncated_mcap",
        "reason": f"trunc_vio.mcap: truncated MCAP: the file ends at byte {path.stat().st_size} in the middle of "
        "a record, before the footer (0 messages readable before the cut)",
    }]
    assert not r.ok
    with pytest.raises(RecordingError) as exc:
        read_streams(path)
    assert exc.value.code == "corrupt_mcap" and exc.value.path == str(path)


def test_missing_closing_magic_is_rejected(eps):
    path = eps["nomagic"].vio_mcap
    r = inspect_recording(path)
    assert [p.to_dict() for p in r.errors] == [{
        "code": "missing_closing_magic",
        "reason": f"nomagic_vio.mcap: missing closing magic: the file ends at byte {path.stat().st_size} right "
        "after the footer (written or copied incompletely)",
    }]


def test_chunk_index_only_is_read_in_a_streaming_pass_and_flagged(eps):
    good, path = eps["chunkonly"], eps["chunkonly"].vio_mcap
    reference = inspect_recording(eps["good"].vio_mcap)  # same seed, same messages
    r = inspect_recording(path)
    assert r.ok
    assert (r.has_summary, r.has_chunk_index, r.has_message_index, r.has_statistics) == (True, True, False, False)
    assert r.indexed is False and r.summary_counts is None
    assert [p.to_dict() for p in r.warnings] == [{
        "code": "no_index",
        "reason": "chunkonly_vio.mcap: no message index and no statistics: read in a streaming pass; "
        "message counts could not be checked against statistics",
    }]
    assert r.message_counts == reference.message_counts
    assert r.message_counts[POSE] == len(good.pose_ts_ns) > 0
    streams = read_streams(path)
    np.testing.assert_array_equal(streams.pose_ts_ns, good.pose_ts_ns.astype(np.int64))


def test_pose_out_of_log_time_order_is_counted_and_sorted(eps):
    ep = eps["ooo"]
    r = inspect_recording(ep.vio_mcap)
    assert r.ok
    assert r.log_time_inversions[POSE] == 3 and r.log_time_inversions[CAM] == 0
    assert [p.to_dict() for p in r.warnings] == [{
        "code": "log_time_inversions",
        "reason": f"ooo_vio.mcap: 3 {POSE} messages out of log-time order; sorted by capture time",
    }]
    streams = read_streams(ep.vio_mcap)
    assert streams.log_time_inversions[POSE] == 3
    np.testing.assert_array_equal(streams.pose_ts_ns, ep.pose_ts_ns.astype(np.int64))


def test_leading_p_frames_are_counted_in_packets_and_seconds(eps):
    ep = eps["pframes"]
    r = inspect_recording(ep.vio_mcap)
    assert r.ok
    n = SMALL.gop_size - 1  # the first IDR was dropped: P-frames until the next IDR
    assert r.leading_undecodable_packets == n
    expected_s = (int(ep.camera_ts_ns[n]) - int(ep.camera_ts_ns[0])) / 1e9
    assert r.leading_undecodable_s == pytest.approx(expected_s)
    assert r.first_decodable_ts_ns == int(ep.camera_ts_ns[n])
    assert r.overlap_start_ns == int(ep.camera_ts_ns[n])
    assert [p.to_dict() for p in r.warnings] == [{
        "code": "leading_undecodable",
        "reason": f"pframes_vio.mcap: {n} leading H.264 packets ({expected_s:.3f} s) before the first decodable "
        "frame (IDR with SPS/PPS); they are skipped",
    }]


def test_late_camera_start_is_reported_for_trimming(eps):
    ep = eps["late"]
    r = inspect_recording(ep.vio_mcap)
    assert r.ok
    first = min(int(ep.pose_ts_ns[0]), int(ep.gripper_ts_ns[0]))
    late_s = (int(ep.camera_ts_ns[0]) - first) / 1e9
    assert late_s >= 0.4
    assert r.start_offsets_s[CAM] == pytest.approx(late_s)
    assert r.start_offsets_s[POSE] < 0.1 and r.start_offsets_s[GRIP] < 0.1
    assert r.overlap_start_ns == int(ep.camera_ts_ns[0])
    assert [p.to_dict() for p in r.warnings] == [{
        "code": "late_start",
        "reason": f"late_vio.mcap: {CAM} starts {late_s:.3f} s after the first stream; trim to the overlap",
    }]


def test_pose_invalid_fraction(eps):
    ep = eps["invalid"]
    r = inspect_recording(ep.vio_mcap)
    streams = read_streams(ep.vio_mcap)
    n_bad = int(np.count_nonzero(~streams.pose_valid))
    assert n_bad > 10  # 0.5 s of 30 Hz poses
    assert r.pose_invalid_fraction == pytest.approx(n_bad / len(ep.pose_ts_ns))
    assert [p.code for p in r.warnings] == ["pose_invalid"]
    assert r.warnings[0].reason == (
        f"invalid_vio.mcap: {n_bad} of {len(ep.pose_ts_ns)} poses ({100 * n_bad / len(ep.pose_ts_ns):.1f} %) "
        "have pose_valid == false (VIO lost tracking)"
    )


def test_unknown_encoding_on_required_topic_is_an_error(eps):
    r = inspect_recording(eps["cbor"].vio_mcap)
    assert [p.to_dict() for p in r.errors] == [{
        "code": "unknown_encoding",
        "reason": f"cbor_vio.mcap: topic {POSE} uses message encoding 'cbor' with schema encoding 'protobuf'; "
        "only protobuf can be decoded",
    }]
    with pytest.raises(RecordingError) as exc:
        read_streams(eps["cbor"].vio_mcap)
    assert exc.value.code == "unknown_encoding"


def test_unknown_encoding_on_optional_topic_is_a_warning(eps):
    r = inspect_recording(eps["cbor_imu"].vio_mcap)
    assert r.ok
    assert [p.code for p in r.warnings] == ["unknown_encoding"]
    assert IMU not in r.rates_hz and r.message_counts[IMU] > 0


def test_corrupt_bytes_are_rejected_with_the_offset(eps):
    r = inspect_recording(eps["corrupt"].vio_mcap)
    assert [p.code for p in r.errors] == ["corrupt_mcap"]
    assert r.errors[0].reason.startswith("corrupt_vio.mcap: corrupt MCAP near byte ")


def test_empty_and_non_mcap_files(tmp_path):
    empty = tmp_path / "e_vio.mcap"
    empty.write_bytes(b"")
    assert [p.to_dict() for p in inspect_recording(empty).errors] == [
        {"code": "empty_file", "reason": "e_vio.mcap: empty file (0 bytes)"}
    ]
    text = tmp_path / "t_vio.mcap"
    text.write_text("this is not an mcap file\r\n")
    r = inspect_recording(text)
    assert [p.code for p in r.errors] == ["not_mcap"]
    assert r.errors[0].reason.startswith("t_vio.mcap: not an MCAP file: bad opening magic at byte 0")
    with pytest.raises(RecordingError) as exc:
        inspect_recording(tmp_path / "missing_vio.mcap")
    assert exc.value.code == "missing_file"


def test_duplicate_timestamps_are_counted_and_dropped(eps):
    ep = eps["dup"]
    r = inspect_recording(ep.vio_mcap)
    assert r.ok and r.indexed
    assert r.message_counts[POSE] == len(ep.pose_ts_ns) + 4 == r.summary_counts[POSE]
    assert r.duplicate_timestamps == {CAM: 0, POSE: 4, GRIP: 0, IMU: 0, TOPICS.camera_info: 0}
    assert [p.to_dict() for p in r.warnings] == [{
        "code": "duplicate_timestamps",
        "reason": f"dup_vio.mcap: 4 {POSE} messages repeat a capture time; later duplicates dropped",
    }]
    streams = read_streams(ep.vio_mcap)
    assert streams.duplicate_timestamps[POSE] == 4
    np.testing.assert_array_equal(streams.pose_ts_ns, ep.pose_ts_ns.astype(np.int64))


def test_counts_that_disagree_with_the_statistics_are_an_error(eps):
    ep = eps["overstated"]
    r = inspect_recording(ep.vio_mcap)
    n = len(ep.camera_ts_ns)
    assert r.summary_counts[CAM] == n + 5 and r.message_counts[CAM] == n
    assert [p.to_dict() for p in r.errors] == [{
        "code": "count_mismatch",
        "reason": f"overstated_vio.mcap: topic {CAM}: read {n} messages, summary statistics say {n + 5}",
    }]


def test_a_required_topic_without_messages_is_an_error_not_an_empty_episode(eps):
    r = inspect_recording(eps["noposes"].vio_mcap)
    assert r.message_counts[POSE] == 0 == r.summary_counts[POSE]
    assert [p.to_dict() for p in r.errors] == [
        {"code": "no_messages", "reason": f"noposes_vio.mcap: required topic {POSE} has no messages"}
    ]
