"""The raw recording in Rerun: one ``<STEM>_vio.mcap`` streamed into an ``.rrd``.

What is shown (entity paths), every row at its device capture time (``header.timestamp``, the
clock streams are synchronised on, formats.md section 1) on the ``capture_time`` timeline:

    world/gripper              Transform3D per VIO pose (camera0 optical centre, m and quaternion)
                               and the gripper's frame as axes (static)
    world/gripper/camera0      Pinhole from camera_info (static) and the camera frames: decoded
                               here (PyAV) and logged as JPEG images (``camera="jpeg"``, the
                               default), or the H.264 access units as they are, a VideoStream the
                               viewer decodes (``camera="video"``: nothing decoded, a smaller
                               file; Rerun's web viewer in headless Chromium drew no frame of it)
    world/track                the whole pose track as one line strip (static)
    pose/position_m            x, y, z (m); pose/valid (1/0); pose/score
    gripper/width_m            the encoder's width (m)
    imu/angular_velocity_rps, imu/linear_acceleration_mps2
    timing/<stream>/period_ms  capture-time step to the previous message of that stream
    timing/<stream>/arrival_delay_ms   log (arrival) time minus capture time
    findings                   TextLog: each plausibility finding at its time (WARN, or ERROR
                               when its policy rejects the episode)

Streaming: messages are read in one pass (``mcap.reader.NonSeekingReader``, with or without an
index) and sent to Rerun in batches of :data:`BATCH_ROWS`; camera payloads go out as they come,
through a reorder window of :data:`REORDER_NS` (messages may arrive out of capture order, and a
video stream should reach the viewer in time order). What stays in memory for the whole episode
is small: the capture and arrival times of every message (16 bytes each) and the pose (72 bytes)
and gripper (8 bytes) samples, which the plausibility checks need whole
(:func:`~dpflow_core.recordings.plausibility.check_pose`, ``check_gripper``, ``check_clock``,
the functions conversion, the inspection and the quality report use). The frames never are.

Frame convention (an assumption, stated because no public document fixes it): the pose's body
axes are taken as X forward along the optical axis, Y left, Z up (``ViewCoordinates.FLU``), the
world frame's own convention (X along the camera axis projected on the horizontal, Z up).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap
from dpflow_core.view.rrd import ViewError, output_path, rrd_writer

#: Rows per ``send_columns`` call: large enough to be cheap, small enough to keep memory flat.
BATCH_ROWS = 2048
#: Camera frames per ``send_columns`` call (each call waits for the file sink).
FRAME_BATCH = 64
#: Camera messages are held this long (capture time, ns) behind the newest one before they are sent.
REORDER_NS = 1_000_000_000
TIMELINE = "capture_time"
#: Axis length (m) of the gripper's frame.
AXIS_M = 0.05
#: JPEG quality of the decoded frames (OpenCV's 0-100 scale).
JPEG_QUALITY = 90
CAMERA_MODES = ("jpeg", "video")


@dataclass(frozen=True)
class EpisodeView:
    """What :func:`view_episode` wrote.

    Attributes:
        path: the ``.rrd`` written. source: the ``_vio.mcap`` read.
        message_counts: messages read per stream (``camera``, ``pose``, ``gripper``, ``imu``,
            ``camera_info``); ``frames``: camera frames logged (``camera="jpeg"``: the frames
            the decoder gave, fewer than the messages when the stream starts before an IDR frame).
        first_ts_ns, last_ts_ns: the earliest and latest capture time over all streams (ns).
        findings: the plausibility findings (``Finding.to_dict()``), times in s from ``first_ts_ns``.
    """

    path: Path
    source: Path
    message_counts: dict[str, int]
    first_ts_ns: int
    last_ts_ns: int
    findings: list[dict] = field(default_factory=list)


def episode_sources(path: str | Path) -> list[Path]:
    """The ``_vio.mcap`` files a path names: the file itself, or those of a task folder (sorted).

    Raises:
        ViewError: the path is missing, is a file that is not an ``.mcap``, or a folder without
            ``*_vio.mcap``.
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("*_vio.mcap"))
        if not found:
            raise ViewError("no *_vio.mcap in this folder (a Matrix Studio task folder was expected)", path,
                            code="no_recordings")
        return found
    if not path.exists():
        raise ViewError("not found", path, code="missing_file")
    if path.suffix != ".mcap":
        raise ViewError("not an .mcap recording (a <STEM>_vio.mcap or a task folder was expected)", path,
                        code="not_a_recording")
    return [path]


def episode_output(source: str | Path, out: str | Path | None = None) -> Path:
    """Where :func:`view_episode` writes the view of ``source`` (a ``<STEM>_vio.mcap``): ``out`` when it
    is a file path, else ``<STEM>.rrd`` in ``out`` (a folder) or in the current folder."""
    return output_path(out, f"{_stem(source)}.rrd")


def _stem(source: str | Path) -> str:
    return Path(source).name.removesuffix(".mcap").removesuffix("_vio")


def view_episodes(path: str | Path, out: str | Path | None = None, *, topics: TopicMap = DAS_DEFAULT,
                  camera: str = "jpeg", overwrite: bool = False) -> list["EpisodeView"]:
    """Write the ``.rrd`` of every episode ``path`` names (:func:`episode_sources`), one per episode.

    Every output is checked before any is written: without ``overwrite``, one that exists refuses
    them all (a trial wrote ``stack_0000.rrd``, then stopped at an existing ``stack_0001.rrd``).

    Args:
        path: a ``<STEM>_vio.mcap`` or a task folder.
        out: the ``.rrd`` (one episode) or a folder; default the current folder.
        topics, camera, overwrite: as :func:`view_episode`.

    Raises:
        ViewError: as :func:`episode_sources`; several episodes and ``out`` is not a folder; any output
            exists and ``overwrite`` is false (naming every one that exists). RecordingError: as
            :func:`view_episode`.
    """
    sources = episode_sources(path)
    if len(sources) > 1 and out is not None and not Path(out).is_dir():
        raise ViewError(f"holds {len(sources)} episodes: -o must be an existing folder, not {str(out)!r}", path,
                        code="bad_output")
    existing = [str(p) for p in (episode_output(s, out) for s in sources) if p.exists()]
    if existing and not overwrite:
        raise ViewError(f"{len(existing)} of the {len(sources)} views exist, nothing written; pass --overwrite to "
                        f"replace them: {', '.join(existing)}", path, code="output_exists")
    return [view_episode(s, out, topics=topics, camera=camera, overwrite=overwrite) for s in sources]


class _Columns:
    """Rows of one entity gathered until :data:`BATCH_ROWS`, then sent with ``send_columns``."""

    def __init__(self, rec, entity: str, make, rows: int = BATCH_ROWS, drain: bool = False):
        self.rec, self.entity, self.make, self.batch, self.drain = rec, entity, make, rows, drain
        self.ts: list[int] = []
        self.rows: list = []

    def add(self, ts: int, row) -> None:
        self.ts.append(ts)
        self.rows.append(row)
        if len(self.ts) >= self.batch:
            self.flush()

    def flush(self) -> None:
        import rerun as rr

        if self.ts:
            index = rr.TimeColumn(TIMELINE, timestamp=np.asarray(self.ts, dtype=np.int64).astype("datetime64[ns]"))
            self.rec.send_columns(self.entity, indexes=[index], columns=self.make(self.rows))
            self.ts, self.rows = [], []
            if self.drain:
                # Frames are the bulk: wait until the file sink has written them, so that the SDK's
                # queue (which otherwise grows while this loop outpaces the encoder) stays short.
                self.rec.flush()


class _Frames:
    """Camera access units in capture order -> decoded frames logged as JPEG (or, for ``video``,
    the units themselves as a VideoStream). A packet's capture time rides on its ``pts``, so a
    frame keeps its own time even when the decoder drops packets before the first IDR frame."""

    def __init__(self, rec, entity: str, fmt: str, mode: str, source: Path):
        import rerun as rr

        from dpflow_core.errors import RecordingError

        codec = {"h264": (rr.VideoCodec.H264, "h264"), "h265": (rr.VideoCodec.H265, "hevc")}.get(fmt.lower())
        if codec is None:
            raise RecordingError(f"camera format {fmt!r} is not H.264/H.265: cannot be shown", source,
                                 code="unsupported_format")
        self.mode, self.frames = mode, 0
        if mode == "video":
            rec.log(entity, rr.VideoStream(codec=codec[0]), static=True)
            self.cols = _Columns(rec, entity, lambda rows: rr.VideoStream.columns(sample=rows), rows=FRAME_BATCH,
                                 drain=True)
            return
        import av

        self.ctx = av.CodecContext.create(codec[1], "r")
        self.ctx.thread_count = 1  # one decode thread: threads did not help on 2 vCPU (environment.md)
        self.cols = _Columns(rec, entity, lambda rows: rr.EncodedImage.columns(
            blob=rows, media_type=["image/jpeg"] * len(rows)), rows=FRAME_BATCH, drain=True)
        self.times: dict[int, int] = {}
        self.n = 0

    def add(self, ts: int, data: bytes) -> None:
        if self.mode == "video":
            self.cols.add(ts, data)
            self.frames += 1
            return
        import av

        packet = av.Packet(data)
        packet.pts = self.n
        self.times[self.n] = ts
        self.n += 1
        try:
            frames = self.ctx.decode(packet)
        except av.error.InvalidDataError:
            return  # a packet before the first decodable frame: the decoder skips it
        for frame in frames:
            self._emit(frame)

    def _emit(self, frame) -> None:
        import cv2

        ts = self.times.pop(frame.pts)
        for k in [k for k in self.times if k < frame.pts]:
            del self.times[k]  # packets that gave no frame
        bgr = frame.to_ndarray(format="bgr24")
        ok, jpeg = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
        self.cols.add(ts, jpeg.tobytes())
        self.frames += 1

    def close(self) -> None:
        if self.mode == "jpeg":
            for frame in self.ctx.decode(None):
                self._emit(frame)
        self.cols.flush()


def _vector_rows(rows) -> "object":
    import rerun as rr

    return rr.Scalars.columns(scalars=np.asarray(rows, dtype=np.float64))


def view_episode(source: str | Path, out: str | Path | None = None, *, topics: TopicMap = DAS_DEFAULT,
                 camera: str = "jpeg", overwrite: bool = False) -> EpisodeView:
    """Write the ``.rrd`` of one ``<STEM>_vio.mcap`` (see the module docstring for what it shows).

    Args:
        source: the ``_vio.mcap``.
        out: the ``.rrd`` path, or a folder for ``<STEM>.rrd``; default the current folder.
        topics: the recording's topic names.
        camera: ``jpeg`` (decode and log images) or ``video`` (log the H.264 units as they are).
        overwrite: replace an existing output.

    Returns:
        The paths, per-stream counts, time range and findings.

    Raises:
        RecordingError: the file is truncated or corrupt (with the byte offset), or has no camera,
            pose or gripper message, or its camera format is neither H.264 nor H.265.
        ViewError: ``camera`` is not one of :data:`CAMERA_MODES`, the output exists (and ``overwrite`` is false) or its folder is missing.
    """
    import rerun as rr
    import rerun.blueprint as rrb

    if camera not in CAMERA_MODES:
        raise ViewError(f"camera must be one of {', '.join(CAMERA_MODES)}, got {camera!r}")
    source, stem = Path(source), _stem(source)
    path = episode_output(source, out)
    blueprint = rrb.Blueprint(
        rrb.Horizontal(
            rrb.Vertical(rrb.Spatial3DView(origin="world", name="3-D pose"),
                         rrb.Spatial2DView(origin="world/gripper/camera0", name="camera0")),
            rrb.Vertical(rrb.TimeSeriesView(origin="gripper", name="gripper width"),
                         rrb.TimeSeriesView(origin="pose", name="pose"),
                         rrb.TimeSeriesView(origin="imu", name="IMU"),
                         rrb.TimeSeriesView(origin="timing", name="timestamps"),
                         rrb.TextLogView(origin="findings", name="findings")),
        ),
        collapse_panels=True,
    )
    with rrd_writer(path, stem, blueprint=blueprint, overwrite=overwrite) as rec:
        times, pose, gripper, counts = _stream(rec, source, topics, camera)
        t0 = min(int(t[0].min()) for t in times.values() if len(t[0]))
        t1 = max(int(t[0].max()) for t in times.values() if len(t[0]))
        _log_timing(rec, times)
        _log_track(rec, pose)
        findings = _findings(times, pose, gripper, t0)
        for f in findings:
            level = "ERROR" if f.action == "rejected" else "WARN"
            rec.set_time(TIMELINE, timestamp=np.datetime64(t0 + int(round(f.at_s * 1e9)), "ns"))
            rec.log("findings", rr.TextLog(f.describe(), level=level))
    return EpisodeView(path, source, counts, t0, t1, [f.to_dict() for f in findings])


def _stream(rec, source: Path, topics: TopicMap, camera_mode: str):
    """The streaming pass: send every message, keep times, pose and gripper samples."""
    import rerun as rr
    from mcap.exceptions import McapError
    from mcap.reader import NonSeekingReader
    from mcap_protobuf.decoder import DecoderFactory

    from dpflow_core.errors import RecordingError

    names = {topics.camera: "camera", topics.pose: "pose", topics.gripper: "gripper", topics.imu: "imu"}
    times: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    pose: tuple[list[int], list[tuple]] = ([], [])
    gripper: tuple[list[int], list[float]] = ([], [])
    counts: dict[str, int] = defaultdict(int)
    cols = {
        "pose": _Columns(rec, "world/gripper", lambda rows: rr.Transform3D.columns(
            translation=np.asarray(rows)[:, 0:3], quaternion=np.asarray(rows)[:, 3:7])),
        "position": _Columns(rec, "pose/position_m", _vector_rows),
        "valid": _Columns(rec, "pose/valid", _vector_rows),
        "score": _Columns(rec, "pose/score", _vector_rows),
        "gripper": _Columns(rec, "gripper/width_m", _vector_rows),
        "gyro": _Columns(rec, "imu/angular_velocity_rps", _vector_rows),
        "accel": _Columns(rec, "imu/linear_acceleration_mps2", _vector_rows),
    }
    camera = None
    pending: list[tuple[int, int, bytes]] = []  # heap of (capture ns, arrival order, payload)
    newest = None
    rec.log("world", rr.ViewCoordinates.RIGHT_HAND_Z_UP, static=True)
    rec.log("world/gripper", rr.TransformAxes3D(AXIS_M), static=True)
    for series, names_ in (("pose/position_m", ["x", "y", "z"]), ("imu/angular_velocity_rps", ["x", "y", "z"]),
                           ("imu/linear_acceleration_mps2", ["x", "y", "z"])):
        rec.log(series, rr.SeriesLines(names=names_), static=True)
    try:
        with open(source, "rb") as f:
            reader = NonSeekingReader(f, decoder_factories=[DecoderFactory()])
            for _schema, channel, message, m in reader.iter_decoded_messages(
                    topics=[*names, topics.camera_info], log_time_order=False):
                if channel.topic == topics.camera_info:
                    counts["camera_info"] += 1
                    if counts["camera_info"] == 1:
                        rec.log("world/gripper/camera0", rr.Pinhole(
                            image_from_camera=np.asarray(m.K, dtype=np.float64).reshape(3, 3),
                            resolution=[m.width, m.height], camera_xyz=rr.ViewCoordinates.FLU), static=True)
                    continue
                kind = names[channel.topic]
                ts = int(m.header.timestamp)
                counts[kind] += 1
                times[kind][0].append(ts)
                times[kind][1].append(int(message.log_time))
                if kind == "camera":
                    if camera is None:
                        camera = _Frames(rec, "world/gripper/camera0", m.format, camera_mode, source)
                    heapq.heappush(pending, (ts, counts[kind], bytes(m.data)))
                    newest = ts if newest is None else max(newest, ts)
                    while pending and pending[0][0] <= newest - REORDER_NS:
                        t, _, data = heapq.heappop(pending)
                        camera.add(t, data)
                elif kind == "pose":
                    p, q = m.pose.position, m.pose.orientation
                    row = (p.x, p.y, p.z, q.x, q.y, q.z, q.w)
                    pose[0].append(ts)
                    pose[1].append(row)
                    cols["pose"].add(ts, row)
                    cols["position"].add(ts, row[:3])
                    cols["valid"].add(ts, float(m.pose_valid))
                    cols["score"].add(ts, float(m.score))
                elif kind == "gripper":
                    gripper[0].append(ts)
                    gripper[1].append(float(m.value))
                    cols["gripper"].add(ts, float(m.value))
                else:
                    w, a = m.angular_velocity, m.linear_acceleration
                    cols["gyro"].add(ts, (w.x, w.y, w.z))
                    cols["accel"].add(ts, (a.x, a.y, a.z))
    except (McapError, EOFError, ValueError, KeyError) as exc:
        raise RecordingError(f"truncated or corrupt MCAP: {type(exc).__name__}: {exc}", source,
                             code="corrupt_mcap") from exc
    while pending:
        t, _, data = heapq.heappop(pending)
        camera.add(t, data)
    for c in cols.values():
        c.flush()
    if camera is not None:
        camera.close()
        counts["frames"] = camera.frames
    missing = [k for k in ("camera", "pose", "gripper") if not counts.get(k)]
    if missing:
        raise RecordingError(f"no {', '.join(missing)} messages: not a Matrix Studio _vio recording", source,
                             code="missing_topics")
    arrays = {k: (np.asarray(v[0], dtype=np.int64), np.asarray(v[1], dtype=np.int64)) for k, v in times.items()}
    # Capture times stay int64: as float64 a time since 1970 in ns would lose its last 8 bits.
    pose_arrays = (np.asarray(pose[0], dtype=np.int64), np.asarray(pose[1], dtype=np.float64).reshape(-1, 7))
    gripper_arrays = (np.asarray(gripper[0], dtype=np.int64), np.asarray(gripper[1], dtype=np.float64))
    return arrays, pose_arrays, gripper_arrays, dict(counts)


def _log_timing(rec, times: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Per stream, in capture order: the step from the previous capture time and the arrival delay (ms)."""
    import rerun as rr

    for kind, (ts, log) in times.items():
        order = np.argsort(ts, kind="stable")
        t, lt = ts[order], log[order]
        index = [rr.TimeColumn(TIMELINE, timestamp=t.astype("datetime64[ns]"))]
        rec.send_columns(f"timing/{kind}/arrival_delay_ms", indexes=index,
                         columns=rr.Scalars.columns(scalars=(lt - t) / 1e6))
        if len(t) > 1:
            index = [rr.TimeColumn(TIMELINE, timestamp=t[1:].astype("datetime64[ns]"))]
            rec.send_columns(f"timing/{kind}/period_ms", indexes=index,
                             columns=rr.Scalars.columns(scalars=np.diff(t) / 1e6))


def _log_track(rec, pose: tuple[np.ndarray, np.ndarray]) -> None:
    import rerun as rr

    order = np.argsort(pose[0], kind="stable")
    rec.log("world/track", rr.LineStrips3D([pose[1][order, 0:3]], radii=[0.002]), static=True)


def _findings(times, pose: tuple[np.ndarray, np.ndarray], gripper: tuple[np.ndarray, np.ndarray], t0: int) -> list:
    """The plausibility findings of the pose, the gripper and every stream's clock."""
    from dpflow_core.recordings.plausibility import check_clock, check_gripper, check_pose

    def ordered(ts: np.ndarray) -> np.ndarray:
        # Capture-ordered, later duplicates dropped, as the reader does before conversion.
        order = np.argsort(ts, kind="stable")
        keep = np.ones(len(order), dtype=bool)
        keep[1:] = np.diff(ts[order]) != 0
        return order[keep]

    keep = ordered(pose[0])
    p_ts, p = pose[0][keep], pose[1][keep]
    norms = np.linalg.norm(p[:, 3:7], axis=1)
    good = norms > 1e-6  # a zero quaternion is no orientation: left out of the checks
    verdict = check_pose(p_ts[good], p[good, 0:3], p[good, 3:7] / norms[good, None], t0)
    g = ordered(gripper[0])
    found = list(verdict.findings)
    found += check_gripper(gripper[0][g], gripper[1][g], p_ts[good], verdict.position_m, t0)
    for kind, (ts, log) in times.items():
        found += check_clock(ts, log, t0, kind)
    return sorted(found, key=lambda f: f.at_s)
