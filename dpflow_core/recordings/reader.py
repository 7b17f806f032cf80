"""The MCAP reader: one Matrix Studio recording in, its decoded streams out.

Takes a ``.mcap`` path and a :class:`~dpflow_core.recordings.topics.TopicMap`; gives
:class:`EpisodeStreams`: per topic the ``header.timestamp`` capture times (ns, int64, sorted) with
the decoded values (pose position m and quaternion, gripper width m, camera H.264 packets as bytes).
Messages are decoded with the protobuf schemas embedded in the file (mcap-protobuf-support).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from mcap.exceptions import DecoderNotFoundError, McapError
from mcap.reader import NonSeekingReader
from mcap_protobuf.decoder import DecoderFactory

from dpflow_core.errors import RecordingError
from dpflow_core.files import HashingReader, path_kind
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap


@dataclass
class EpisodeStreams:
    """The streams of one ``<STEM>_vio.mcap`` needed for conversion, sorted by capture time.

    Attributes:
        path: the file read.
        camera_ts_ns: (N,) int64 capture times (ns) of the camera access units,
            non-decreasing (see ``duplicate_timestamps``).
        camera_packets: N H.264 Annex-B access units (``bytes``) in capture order: a list, or a
            :class:`SpooledPackets` reading them from a spool file (``spool_path``).
        camera_format: the ``format`` field of the first camera message (e.g. "h264").
        camera_decode_order: (N,) int64 indices into ``camera_packets`` in the order the decoder
            must read them (:func:`decode_order`: B-frames), or None for capture order.
        pose_ts_ns: (M,) int64 capture times of the VIO poses.
        position_m: (M, 3) float64 camera0 optical-centre position, metres.
        quat_xyzw: (M, 4) float64 orientation quaternion (x, y, z, w), unit norm.
        pose_valid: (M,) bool, false where VIO lost tracking.
        score: (M,) float32 VIO quality score.
        gripper_ts_ns: (G,) int64; gripper_width_m: (G,) float64 metres.
        log_time_inversions: per topic, how many messages arrived (log_time)
            before one captured earlier; they are sorted by capture time.
        duplicate_timestamps: per topic, how many messages repeat a capture time.
            Pose and gripper: the later duplicates are dropped. Camera: a later message
            whose payload is byte-identical to an earlier one with the same capture time
            (the same message written twice) is dropped; one with a different payload is
            kept, so ``camera_ts_ns`` may repeat a value: every access unit must reach the
            decoder (later frames reference it), and the duplicate *frame* is dropped after
            decoding (:func:`dpflow_core.conversion.align_episode`).
        message_counts: per topic, messages read in the streaming pass.
        sha256: SHA-256 (hex) of the whole file, computed from the bytes the streaming pass
            read (the file is read once: parsing and hashing share the read).
        imu_ts_ns, gyro_rps: (I,) int64 capture times and (I, 3) float64 angular velocity (rad/s) of
            the optional IMU topic (messages of a schema in ``topics.imu_schemas``), sorted; None without.
        accel_mps2: (I, 3) float64 specific force (m/s^2) of the same IMU messages; None without.
    """

    path: Path
    camera_ts_ns: np.ndarray
    camera_packets: list[bytes]
    camera_format: str
    pose_ts_ns: np.ndarray
    position_m: np.ndarray
    quat_xyzw: np.ndarray
    pose_valid: np.ndarray
    score: np.ndarray
    gripper_ts_ns: np.ndarray
    gripper_width_m: np.ndarray
    log_time_inversions: dict[str, int] = field(default_factory=dict)
    duplicate_timestamps: dict[str, int] = field(default_factory=dict)
    message_counts: dict[str, int] = field(default_factory=dict)
    sha256: str | None = None
    imu_ts_ns: np.ndarray | None = None
    gyro_rps: np.ndarray | None = None
    camera_decode_order: np.ndarray | None = None
    accel_mps2: np.ndarray | None = None


def decode_order(sequence_num: np.ndarray, packets: Sequence[bytes]) -> np.ndarray | None:
    """The order to decode camera messages in, given in capture order: None when that is capture order.

    With B-frames an encoder emits a frame after the later frames it references, so messages
    stamped with each frame's capture time are out of capture order in emission (decode) order,
    which the device header's ``sequence_num`` gives. That order is taken only when the messages
    it moves hold B slices (:func:`has_b_slice`): sequence numbers that repeat (a writer that leaves
    them 0), or that disagree with capture order in a stream without B-frames, say nothing about
    decoding, and capture order stays. ``sequence_num``: (N,) int64, ``packets``: (N,) payloads,
    both capture order; returns (N,) int64 indices into them.
    """
    if len(sequence_num) < 2 or len(np.unique(sequence_num)) < len(sequence_num):
        return None
    if np.all(np.diff(sequence_num) > 0):
        return None
    order = np.argsort(sequence_num, kind="stable").astype(np.int64)
    moved = np.flatnonzero(order != np.arange(len(order)))
    return order if any(has_b_slice(packets[int(i)]) for i in moved) else None


def has_b_slice(data: bytes) -> bool:
    """Whether an H.264 Annex-B payload holds a B slice (ITU-T H.264 7.3.3: the slice header of a
    NAL unit of type 1 or 5 starts with ue(v) ``first_mb_in_slice`` and ue(v) ``slice_type``,
    B = 1 or 6)."""
    for start in _nal_starts(data):
        if start < len(data) and data[start] & 0x1F in (1, 5):
            slice_type = _slice_type(data[start + 1 : start + 17])
            if slice_type is not None and slice_type % 5 == 1:
                return True
    return False


def starts_clean(data: bytes) -> bool:
    """Whether an H.264 Annex-B access unit references no earlier frame: it holds an IDR slice (NAL type
    5), or every slice of it is an I or SI slice (``slice_type`` 2, 4, 7 or 9; ITU-T H.264 7.4.3), so the
    frames decoded after it no longer depend on what came before (a damaged reference stops there)."""
    types = []
    for start in _nal_starts(data):
        if start < len(data) and data[start] & 0x1F in (1, 5):
            if data[start] & 0x1F == 5:
                return True
            types.append(_slice_type(data[start + 1 : start + 17]))
    return bool(types) and all(t is not None and t % 5 in (2, 4) for t in types)


def _slice_type(head: bytes) -> int | None:
    """``slice_type`` of a slice header (the bytes after its NAL header): its second ue(v) field."""
    bits = "".join(f"{b:08b}" for b in head.replace(b"\x00\x00\x03", b"\x00\x00"))
    at, values = 0, []
    for _ in range(2):
        zeros = len(bits) - len(bits[at:].lstrip("0")) - at
        if at + 2 * zeros + 1 > len(bits):
            return None
        values.append(int(bits[at + zeros : at + 2 * zeros + 1], 2) - 1)
        at += 2 * zeros + 1
    return values[1]


def _nal_starts(data: bytes):
    """Offsets of the first byte after each Annex-B start code (00 00 01)."""
    i = data.find(b"\x00\x00\x01")
    while i >= 0:
        yield i + 3
        i = data.find(b"\x00\x00\x01", i + 3)


class SpooledPackets(Sequence):
    """Camera payloads kept in a spool file instead of memory: item ``i`` is read back with
    ``os.pread`` when asked for, so holding every access unit of a long episode costs this
    process a few bytes per packet (the bytes sit in the page cache, never in its RSS).

    Built by :func:`read_streams` with ``spool_path``; :meth:`close` closes and removes the file.
    """

    def __init__(self, path: Path, fh, offsets: np.ndarray, lengths: np.ndarray):
        self.path, self._fh = path, fh
        self._offsets, self._lengths = offsets, lengths

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return os.pread(self._fh.fileno(), int(self._lengths[i]), int(self._offsets[i]))

    def reordered(self, order: np.ndarray) -> "SpooledPackets":
        """The same spool with its items in ``order`` (indices into this sequence)."""
        return SpooledPackets(self.path, self._fh, self._offsets[order], self._lengths[order])

    def close(self) -> None:
        """Close and delete the spool file (its unread pages are dropped, never written back)."""
        if not self._fh.closed:
            self._fh.close()
        self.path.unlink(missing_ok=True)


def _order(ts: list[int], log_times: list[int]) -> tuple[np.ndarray, int, np.ndarray]:
    """Sort indices by capture time, the count of log-time inversions, and a keep mask for duplicates."""
    t = np.asarray(ts, dtype=np.int64)
    lt = np.asarray(log_times, dtype=np.int64)
    inversions = int(np.count_nonzero(np.diff(lt) < 0)) if len(lt) > 1 else 0
    order = np.argsort(t, kind="stable")
    keep = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        keep[1:] = np.diff(t[order]) != 0
    return order[keep], inversions, int(np.count_nonzero(~keep))


def _order_camera(ts: list[int], log_times: list[int], data: Sequence[bytes]) -> tuple[np.ndarray, int, int]:
    """Capture-order indices of the camera messages: repeated capture times are kept unless
    the payload repeats too (see ``EpisodeStreams.duplicate_timestamps``)."""
    t = np.asarray(ts, dtype=np.int64)
    lt = np.asarray(log_times, dtype=np.int64)
    inversions = int(np.count_nonzero(np.diff(lt) < 0)) if len(lt) > 1 else 0
    order = np.argsort(t, kind="stable")
    keep: list[int] = []
    repeated = 0
    for k, i in enumerate(order):
        if k and t[i] == t[order[k - 1]]:
            repeated += 1
            j = len(keep) - 1
            same_time = []
            while j >= 0 and t[keep[j]] == t[i]:
                same_time.append(keep[j])
                j -= 1
            if any(data[m] == data[i] for m in same_time):
                continue
        keep.append(int(i))
    return np.asarray(keep, dtype=np.int64), inversions, repeated


def _check_samples(path: Path, topics: TopicMap, camera, pose, gripper, pose_vals, grip_vals) -> None:
    """Stamps in another unit than ns (``timestamp_units``, as pairing names them), and what sorting by
    capture time would hide: a clock that went back in file order (rows from before
    and after would interleave), a capture clock that stepped against its arrival times
    (:func:`~dpflow_core.recordings.plausibility.check_clock` with its default ``clock_step_s``, as
    pairing judges it: every later sample would pair with the wrong ones of the other streams) and
    NaN/inf samples (a valid pose's or a gripper width), each a :class:`RecordingError` naming the
    stream, the time (s from the first sample) and the figure. Checked here too, not only at pairing,
    so that a hand-made manifest that never went through ``dpflow pair`` cannot skip it."""
    from dpflow_core.recordings.inspection import file_order_reversal
    from dpflow_core.recordings.plausibility import check_clock
    from dpflow_core.recordings.stream_checks import frozen_clock, frozen_clock_reason, timestamp_units

    t0 = min((min(ts) for ts, _lt in (camera, pose, gripper) if ts), default=0)
    # First the unit, as pairing judges it: a clock in ms "runs backwards" against the others' ns only by accident.
    off = timestamp_units({topics.camera: camera, topics.pose: pose, topics.gripper: gripper}, path.name)
    if off:
        topic, reason = next(iter(off.items()))
        more = f" (and {len(off) - 1} more stream{'s' if len(off) > 2 else ''} so)" if len(off) > 1 else ""
        raise RecordingError(reason + more, path, code="timestamp_units")
    for topic, (ts, lt) in ((topics.camera, camera), (topics.pose, pose), (topics.gripper, gripper)):
        frozen = frozen_clock(np.asarray(ts, dtype=np.int64), np.asarray(lt, dtype=np.int64))
        if frozen is not None:
            raise RecordingError(frozen_clock_reason(path.name, topic, frozen, len(ts), t0), path, code="clock_frozen")
        back = file_order_reversal(np.asarray(ts, dtype=np.int64), np.asarray(lt, dtype=np.int64))
        if back is not None:
            k, size_s, _device = back
            raise RecordingError(
                f"{topic} capture clock ran backwards by {size_s:.3f} s at {(ts[k - 1] - t0) / 1e9:.3f} s (message {k}, "
                "file order): its samples after that would interleave with earlier ones", path, code="clock_reversal")
        for f in check_clock(np.asarray(ts, dtype=np.int64), np.asarray(lt, dtype=np.int64), t0, topic):
            if f.policy == "reject":
                what = "stepped forward" if f.code == "clock_step" else "ran backwards"
                raise RecordingError(
                    f"{topic} capture clock {what} by {abs(f.value):.3f} s at {f.at_s:.3f} s (message "
                    f"{f.detail.get('message_index')}) against its arrival times: every later sample would pair "
                    "with the wrong samples of the other streams", path, code=f.code)
    vals = np.asarray(pose_vals, dtype=np.float64).reshape(-1, 9)
    bad_pose = ~np.isfinite(vals[:, :7]).all(axis=1) & (vals[:, 7] != 0)
    widths = np.asarray(grip_vals, dtype=np.float64)
    for topic, ts, bad, what in ((topics.pose, pose[0], bad_pose, "pose (pose_valid true)"),
                                 (topics.gripper, gripper[0], ~np.isfinite(widths), "gripper width")):
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise RecordingError(
                f"{topic}: {int(bad.sum())} {what} sample{'s' if bad.sum() > 1 else ''} NaN/inf, the first at "
                f"{(ts[k] - t0) / 1e9:.3f} s (message {k} of {len(ts)}): a NaN/inf sample is no measurement",
                path, code="not_finite")


def read_streams(path: str | Path, topics: TopicMap = DAS_DEFAULT, spool_path: str | Path | None = None) -> EpisodeStreams:
    """Read the camera, pose and gripper streams of a ``<STEM>_vio.mcap``.

    Args:
        path: the ``_vio.mcap`` file.
        topics: topic names and accepted schema names.
        spool_path: when given, a new file (it must not exist) that receives the camera
            payloads as they are read; ``camera_packets`` is then a :class:`SpooledPackets`
            reading them back, so memory does not grow with the recording's length. The
            caller closes it (``camera_packets.close()`` also deletes the file).

    Returns:
        The streams sorted by ``header.timestamp``, with the file's SHA-256 (``sha256``),
        hashed from the same bytes the parser read.

    Raises:
        RecordingError: the file is missing, not a regular file (``unreadable``), empty,
            truncated or corrupt (with
            the byte offset reached), a stream's capture stamps are in another unit than ns (``timestamp_units``),
            a capture clock went back in file order (``clock_reversal``) or
            froze (``clock_frozen``: :func:`~dpflow_core.recordings.stream_checks.frozen_clock`),
            a valid pose or a gripper width is NaN/inf (``not_finite``), a channel uses a message encoding other
            than protobuf, required topics are missing ("not a Matrix Studio
            recording: missing topics ..."), a topic has an unexpected schema,
            or a required topic has no messages.
    """
    path = Path(path)
    if path.exists() and not path.is_file():
        raise RecordingError(f"{path.name} is {path_kind(path)}, not a file; a recording was expected there", path,
                             code="unreadable")
    if not path.is_file():
        raise RecordingError("file not found", path, code="missing_file")
    if path.stat().st_size == 0:
        raise RecordingError("empty file", path, code="empty_file")
    spool = open(spool_path, "xb+") if spool_path is not None else None
    try:
        return _read(path, topics, spool)
    except BaseException:
        if spool is not None:
            spool.close()
            Path(spool_path).unlink(missing_ok=True)
        raise


def _read(path: Path, topics: TopicMap, spool) -> EpisodeStreams:
    """The streaming pass of :func:`read_streams` (camera payloads to ``spool`` when it is a file)."""
    wanted = {topics.camera: "camera", topics.pose: "pose", topics.gripper: "gripper"}
    if topics.imu:  # optional: read in the same pass, for the offsets (dpflow_core.offsets)
        wanted[topics.imu] = "imu"
    imu_ts, imu_vals = [], []
    cam_ts, cam_lt, cam_seq, cam_data = [], [], [], []
    pose_ts, pose_lt, pose_vals = [], [], []
    grip_ts, grip_lt, grip_vals = [], [], []
    counts: dict[str, int] = {}
    seen_schemas: dict[str, str] = {}
    cam_fmt = ""
    spool_at = 0
    with HashingReader(path) as f:
        reader = NonSeekingReader(f, decoder_factories=[DecoderFactory()])
        try:
            for schema, channel, message, decoded in reader.iter_decoded_messages(
                topics=list(wanted), log_time_order=False
            ):
                topic = channel.topic
                seen_schemas[topic] = schema.name if schema else ""
                counts[topic] = counts.get(topic, 0) + 1
                ts = int(decoded.header.timestamp)
                kind = wanted[topic]
                if kind == "camera":
                    cam_ts.append(ts)
                    cam_lt.append(message.log_time)
                    cam_seq.append(int(decoded.header.sequence_num))
                    if spool is None:
                        cam_data.append(bytes(decoded.data))
                    else:
                        n = spool.write(decoded.data)
                        cam_data.append((spool_at, n))
                        spool_at += n
                    cam_fmt = cam_fmt or decoded.format
                elif kind == "pose":
                    p, q = decoded.pose.position, decoded.pose.orientation
                    pose_ts.append(ts)
                    pose_lt.append(message.log_time)
                    pose_vals.append((p.x, p.y, p.z, q.x, q.y, q.z, q.w, decoded.pose_valid, decoded.score))
                elif kind == "gripper":
                    grip_ts.append(ts)
                    grip_lt.append(message.log_time)
                    grip_vals.append(decoded.value)
                elif seen_schemas[topic] in topics.imu_schemas:
                    w, acc = decoded.angular_velocity, decoded.linear_acceleration
                    imu_ts.append(ts)
                    imu_vals.append((w.x, w.y, w.z, acc.x, acc.y, acc.z))
        except DecoderNotFoundError as exc:
            raise RecordingError(f"unknown message encoding: {exc}", path, code="unknown_encoding") from exc
        except (McapError, EOFError, ValueError, KeyError) as exc:
            raise RecordingError(
                f"truncated or corrupt MCAP at byte {f.tell()} of {path.stat().st_size}: {type(exc).__name__}: {exc}",
                path,
                code="corrupt_mcap",
            ) from exc
        digest = f.sha256()
    missing = [t for t, kind in wanted.items() if kind != "imu" and t not in counts]
    if missing:
        raise RecordingError(
            f"not a Matrix Studio recording: missing topics {', '.join(missing)}", path, code="missing_topics"
        )
    accepted = {topics.camera: topics.camera_schemas, topics.pose: topics.pose_schemas, topics.gripper: topics.gripper_schemas}
    for topic, schema_name in seen_schemas.items():
        if topic in accepted and schema_name not in accepted[topic]:
            raise RecordingError(
                f"topic {topic} has schema {schema_name!r}, expected one of {list(accepted[topic])}",
                path,
                code="unexpected_schema",
            )

    _check_samples(path, topics, (cam_ts, cam_lt), (pose_ts, pose_lt), (grip_ts, grip_lt), pose_vals, grip_vals)
    if spool is not None:
        spool.flush()
        at = np.asarray(cam_data, dtype=np.int64).reshape(-1, 2)
        cam_data = SpooledPackets(Path(spool.name), spool, at[:, 0], at[:, 1])
    inversions, duplicates = {}, {}
    c_idx, inversions[topics.camera], duplicates[topics.camera] = _order_camera(cam_ts, cam_lt, cam_data)
    p_idx, inversions[topics.pose], duplicates[topics.pose] = _order(pose_ts, pose_lt)
    g_idx, inversions[topics.gripper], duplicates[topics.gripper] = _order(grip_ts, grip_lt)
    imu = np.asarray(imu_vals, dtype=np.float64).reshape(-1, 6)[np.argsort(imu_ts, kind="stable")] if imu_ts else None
    cam_packets = cam_data.reordered(c_idx) if spool is not None else [cam_data[i] for i in c_idx]
    cam_decode = decode_order(np.asarray(cam_seq, dtype=np.int64)[c_idx], cam_packets)
    pose = np.asarray(pose_vals, dtype=np.float64).reshape(-1, 9)[p_idx]
    quat = pose[:, 3:7]
    norms = np.linalg.norm(quat, axis=1)
    if np.any(norms < 1e-6):
        raise RecordingError(f"{np.count_nonzero(norms < 1e-6)} pose messages have a zero quaternion", path, code="bad_pose")
    return EpisodeStreams(
        path=path,
        camera_ts_ns=np.asarray(cam_ts, dtype=np.int64)[c_idx],
        camera_packets=cam_packets,
        camera_format=cam_fmt,
        camera_decode_order=cam_decode,
        pose_ts_ns=np.asarray(pose_ts, dtype=np.int64)[p_idx],
        position_m=pose[:, 0:3].copy(),
        quat_xyzw=quat / norms[:, None],
        pose_valid=pose[:, 7].astype(bool),
        score=pose[:, 8].astype(np.float32),
        gripper_ts_ns=np.asarray(grip_ts, dtype=np.int64)[g_idx],
        gripper_width_m=np.asarray(grip_vals, dtype=np.float64)[g_idx],
        log_time_inversions=inversions,
        duplicate_timestamps=duplicates,
        message_counts=counts,
        sha256=digest,
        imu_ts_ns=np.asarray(imu_ts, dtype=np.int64)[np.argsort(imu_ts, kind="stable")] if imu_ts else None,
        gyro_rps=imu[:, :3].copy() if imu is not None else None,
        accel_mps2=imu[:, 3:].copy() if imu is not None else None,
    )
